"""Tiny random Hugging Face models of each family, and the worker functions the conversion tests run.
A new family (``megatron_cascade/models/<family>/``) joins every conversion test by its line in ``FAMILIES``.

Every model: hidden 64, 2 layers, vocab 200 (padded to 256: padding is exercised), GQA 4/2,
all parameters randomised (norm weights around 1, biases non-zero) so that any mix-up shows.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

VOCAB = 200
TOKENS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # head_dim * heads != hidden
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}
MOE_FAMILIES = ("qwen3_moe", "mixtral")
TOKENIZER_FILES = {"tokenizer_config.json": {"model_max_length": 128}, "tokenizer.json": {"version": "1.0"}}


def make_hf_model(family: str, out_dir: str, *, max_shard_size: str = "5GB"):
    """Build, randomise and save the tiny ``family`` model (fp32, eager attention) with tokenizer files."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for name, content in TOKENIZER_FILES.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f)
    return model


def hf_logits(model) -> torch.Tensor:
    """[batch, seq, vocab] fp32 logits of ``TOKENS``."""
    with torch.no_grad():
        return model(TOKENS).logits.float()


def megatron_logits(model_cfg, parallel, ckpt_dir: str) -> torch.Tensor:
    """Logits [batch, seq, vocab] (padding stripped, gathered over TP) of the checkpoint at ``parallel``.

    Initialises and destroys Megatron's model-parallel state (torch.distributed must be up).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights

    initialize_model_parallel(parallel, seed=1)
    try:
        model = build_gpt_model(model_cfg, parallel).eval()
        load_model_weights(model, ckpt_dir, model_cfg)
        pos = torch.arange(TOKENS.shape[1]).unsqueeze(0).expand_as(TOKENS)
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(model(TOKENS, pos, None))
        return logits[..., :VOCAB].float()
    finally:
        parallel_state.destroy_model_parallel()


def convert_all_worker(tmp: str) -> dict:
    """World size 1: for each family convert HF -> Megatron -> HF; HF and TP=1 Megatron logits; a wrong-arch load."""
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.convert import hf_to_megatron, megatron_to_hf
    from megatron_cascade.model import CheckpointError

    out = {}
    for family in FAMILIES:
        base = os.path.join(tmp, family)
        shard = "40KB" if family == "llama" else "5GB"  # llama input is sharded with an index
        model = make_hf_model(family, f"{base}/hf", max_shard_size=shard)
        cfg = hf_to_megatron(f"{base}/hf", f"{base}/meg")
        megatron_to_hf(f"{base}/meg", f"{base}/hf_back", max_shard_size="60KB" if family == "qwen3" else "5GB")
        if cfg.moe.num_experts:
            cfg = replace(cfg, moe=replace(cfg.moe, token_dispatcher_type="allgather"))
        result = {"cfg": cfg, "hf": hf_logits(model), "tp1": megatron_logits(cfg, ParallelConfig(), f"{base}/meg")}
        try:
            megatron_logits(replace(cfg, num_layers=3), ParallelConfig(), f"{base}/meg")
        except CheckpointError as exc:
            result["wrong_arch_error"] = str(exc)
        out[family] = result
    return out


def parallel_worker(tmp: str, cfgs: dict) -> dict:
    """World size 2: TP=2 (dense) / EP=2 (MoE) logits; dense: save at TP=2, reload at TP=1."""
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.model import save_model_weights
    from megatron.core import parallel_state

    out = {}
    for family, cfg in cfgs.items():
        ckpt = os.path.join(tmp, family, "meg")
        if cfg.moe.num_experts:
            out[family] = {"parallel": megatron_logits(cfg, ParallelConfig(expert_model_parallel_size=2), ckpt)}
            continue
        tp2 = ParallelConfig(tensor_model_parallel_size=2)
        logits = megatron_logits(cfg, tp2, ckpt)
        initialize_model_parallel(tp2, seed=1)
        model = build_gpt_model(cfg, tp2)
        load_model_weights(model, ckpt, cfg)
        save_model_weights(model, os.path.join(tmp, family, "saved_tp2"), cfg)
        parallel_state.destroy_model_parallel()
        reloaded = megatron_logits(cfg, ParallelConfig(), os.path.join(tmp, family, "saved_tp2"))
        out[family] = {"parallel": logits, "tp2_saved_tp1_loaded": reloaded}
    return out


def export_worker(ckpt_dir: str, out_dir: str) -> str:
    """World size 1: ``megatron_to_hf(ckpt_dir, out_dir)``."""
    from megatron_cascade.convert import megatron_to_hf

    return megatron_to_hf(ckpt_dir, out_dir)


NEMO_YAML = """\
_target_: nemo.collections.llm.gpt.model.llama.LlamaModel
config:
  _target_: nemo.collections.llm.gpt.model.llama.{config_class}
  num_layers: 2
  hidden_size: 64
  ffn_hidden_size: 96
  num_attention_heads: 4
  num_query_groups: 2
  kv_channels: 16
  seq_length: 128
  share_embeddings_and_output_weights: false
  normalization: RMSNorm
  layernorm_epsilon: 1.0e-05
  rotary_base: 500000
  vocab_size: 200
  make_vocab_size_divisible_by: 128
  position_embedding_type: rope
  gated_linear_unit: true
  activation_func:
    _target_: torch.nn.functional.silu
    _call_: false
  add_bias_linear: false
tokenizer:
  _target_: nemo.collections.common.tokenizers.huggingface.auto_tokenizer.AutoTokenizer
  pretrained_model_name: /nemo_tokenizer
"""


def nemo_model_config():
    """The ModelConfig the NEMO_YAML describes."""
    from megatron_cascade.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                       kv_channels=16, vocab_size=200, max_position_embeddings=128, rotary_base=500000,
                       norm_epsilon=1e-5)


def write_nemo_dir(nemo_dir: str, config_class: str = "Llama3Config8B") -> None:
    """A NeMo-2-style directory: random weights under ``weights/`` (keys ``module.``-prefixed), context/model.yaml."""
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=5)
    try:
        model = build_gpt_model(nemo_model_config(), ParallelConfig())
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        os.makedirs(f"{nemo_dir}/weights")
        dist_checkpointing.save(model.sharded_state_dict(prefix="module."), f"{nemo_dir}/weights")
    finally:
        parallel_state.destroy_model_parallel()
    os.makedirs(f"{nemo_dir}/context/nemo_tokenizer")
    with open(f"{nemo_dir}/context/model.yaml", "w") as f:
        f.write(NEMO_YAML.format(config_class=config_class))
    for name, content in TOKENIZER_FILES.items():
        with open(f"{nemo_dir}/context/nemo_tokenizer/{name}", "w") as f:
            json.dump(content, f)


def nemo_worker(tmp: str) -> dict:
    """World size 1: write a NeMo 2 dir, import it, export it to HF; logits of the NeMo weights and the import."""
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.convert import nemo2_to_megatron, megatron_to_hf

    write_nemo_dir(f"{tmp}/nemo")
    imported = nemo2_to_megatron(f"{tmp}/nemo", f"{tmp}/meg", tp=2)
    megatron_to_hf(f"{tmp}/meg", f"{tmp}/hf")
    return {"cfg": imported, "logits": megatron_logits(imported, ParallelConfig(), f"{tmp}/meg")}
