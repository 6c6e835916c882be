"""The decode copy (``training/decode_copy.py``): an inference-only model at ``rollout.parallel``'s
layout on its own process groups, refit in memory from the trained policy.

Four gloo processes train at one layout and decode at another; the reference is one process:
* GPT, training TP=2 x PP=2 (one replica) -> decode TP=1 (four replicas): greedy and sampled tokens
  of every replica equal one process's, log-probs to float rounding; after two real optimizer steps
  (random gradients, Adam) each refit leaves the copy holding exactly the trained weights (every
  tensor bit for bit against the policy's checkpoint, reassembled);
* GPT with tied embeddings, training TP=2 (two replicas) -> decode PP=2 (two pipelines): the same,
  the last stage's output weight equal to the trained embedding (the policy has no such parameter:
  ``training/reshard_patches.tag_tied_output``);
* MoE, training EP=2 x DP=2 -> decode EP=2 across the other DP pairs (expert biases in the
  router, experts that differ per rank): tokens equal, and the copy's experts are the policy's;
* hybrid Mamba / attention / MoE, training PP=2 -> decode TP=1 (a pipeline stage without attention
  layers), TP=2 (+SP) -> decode TP=2, and TP=2 (+SP) -> decode TP=1 (a Mamba layer's in_proj / conv1d
  hold five / three parts, each split over TP on its own: ``training/reshard_patches.py``): tokens
  equal, weights equal after a step.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.model import DecodeParallelConfig, HybridConfig
from megatron_cascade.config.training import OptimizerConfig
from megatron_cascade.testing import run_distributed
from megatron_cascade.tokenizers import CharTokenizer

pytestmark = pytest.mark.distributed

TOKENIZER = CharTokenizer()
PROMPTS = [TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
           for text in ("abc", "what is 2+2?", "Write a haiku about rain.\nGo", "xyz")]
GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=103,
                  ffn_hidden_size=96, max_position_embeddings=96, init_method_std=0.05)
MOE = replace(GPT, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, token_dispatcher_type="alltoall",
                                 router_score_function="sigmoid", router_enable_expert_bias=True))
HYBRID = ModelConfig(
    architecture="hybrid", num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=103,
    ffn_hidden_size=64, max_position_embeddings=96, init_method_std=0.05, position_embedding_type="none",
    activation="squared_relu",
    hybrid=HybridConfig(layer_pattern="M*ME", mamba_head_dim=8, mamba_num_groups=2, mamba_state_dim=16,
                        mamba_chunk_size=8),
    moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, router_score_function="sigmoid",
                  router_enable_expert_bias=True))


def _params():
    from megatron_cascade.rollout import SamplingParams

    return {"greedy": SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True),
            "sampled": SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=7, ignore_eos=True)}


def _generate(model, prompts):
    from megatron_cascade.rollout import generate

    out = {}
    for name, params in _params().items():
        batch = generate(model, prompts, params, tokenizer=TOKENIZER)
        out[name] = ([s.response_ids for s in batch], [s.response_logprobs for s in batch])
    return out


def _distinct_weights(model):
    """Give every parameter (and expert bias) values that differ per element, layer, expert and rank
    of the layout, reproducibly: a same-seed init gives local expert K the same values on every EP
    rank and would hide a refit that copies the wrong expert."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(hash(name) % 2**31)
            param.add_(0.02 * torch.randn(param.shape, generator=gen))


def reference_worker(model_cfg, weights_dir):
    """One process: save the weights (with per-expert differences) and generate."""
    from megatron_cascade.model import build_model, initialize_model_parallel, save_model_weights

    initialize_model_parallel(ParallelConfig(), seed=5)
    model = build_model(model_cfg, ParallelConfig())
    _distinct_weights(model)
    for name, buf in model.named_buffers():
        if name.endswith("expert_bias"):
            buf.copy_(torch.linspace(-0.5, 0.5, buf.numel()))
    save_model_weights(model, weights_dir, model_cfg)
    return _generate(model, PROMPTS)


def layout_worker(model_cfg, train: ParallelConfig, decode: DecodeParallelConfig, weights_dir, steps, ckpt_root):
    """Train at ``train``, refit a decode copy at ``decode``; generate on both; after each of ``steps``
    optimizer steps, refit and save the policy's weights (for the bit-for-bit comparison)."""
    from megatron_cascade.model import initialize_model_parallel, save_model_weights
    from megatron_cascade.training.decode_copy import DecodeCopy
    from megatron_cascade.training.policy import build_policy, load_policy_weights, unwrap

    initialize_model_parallel(train, seed=5)
    policy = build_policy(model_cfg, train, OptimizerConfig(lr=1e-2), total_steps=10)
    load_policy_weights(policy, weights_dir)
    copy = DecodeCopy(model_cfg, decode)
    copy.refit(policy)
    out = {"decode": _generate(copy.module, PROMPTS), "train": _generate(policy.module, PROMPTS),
           "decode_dp": (copy.dp_rank, copy.dp_size), "ep_rank": torch.distributed.get_rank(copy.groups.ep),
           "pp_rank": torch.distributed.get_rank(copy.groups.pp), "copies": []}
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for param in policy.module.parameters():
            param.main_grad.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        policy.optimizer.step()
        copy.release()  # as after every generation: the weights are freed, the refit allocates them again
        copy.refit(policy)
        mine = {k: v.detach().clone() for k, v in copy.module.state_dict().items() if not k.endswith("_extra_state")}
        if decode.tensor_model_parallel_size == 1:  # the whole model on every rank (but other EP ranks' experts)
            save_model_weights(policy.module, f"{ckpt_root}/step{step}", model_cfg)
            out["copies"].append(mine)
        else:  # the same layout: this rank's shards, tensor for tensor
            trained = unwrap(policy.module).state_dict()
            out["copies"].append(sorted(k for k, v in mine.items() if not torch.equal(v, trained[k])))
    return out


def _full(model_cfg, ckpt):
    from megatron_cascade.testing.checkpoints import full_state_dict

    return full_state_dict(model_cfg, ckpt)


def _close(got, ref):
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


def _check_tokens(result, reference):
    for name in ("greedy", "sampled"):
        assert result[name][0] == reference[name][0], name
        _close(result[name][1], reference[name][1])


@pytest.mark.parametrize("case", ["gpt-tp2pp2-to-tp1", "gpt-tp2-to-pp2", "moe-ep2-to-ep2", "hybrid-pp2-to-tp1",
                                  "hybrid-tp2-to-tp2", "hybrid-tp2-to-tp1"])
def test_decode_copy_generates_what_the_training_layout_does(tmp_path, case):
    model_cfg, train, decode, steps = {
        "gpt-tp2pp2-to-tp1": (GPT, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                              DecodeParallelConfig(), 2),
        # Pipeline stages in the copy (weights too large for TP x EP alone), tied embeddings: the last
        # stage's output weight, which the policy without PP does not have, is refit from its embedding.
        "gpt-tp2-to-pp2": (replace(GPT, tie_embeddings=True), ParallelConfig(tensor_model_parallel_size=2),
                           DecodeParallelConfig(pipeline_model_parallel_size=2), 1),
        "moe-ep2-to-ep2": (MOE, ParallelConfig(expert_model_parallel_size=2),
                           DecodeParallelConfig(expert_model_parallel_size=2), 1),
        "hybrid-pp2-to-tp1": (HYBRID, ParallelConfig(pipeline_model_parallel_size=2), DecodeParallelConfig(), 1),
        "hybrid-tp2-to-tp2": (HYBRID, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                              DecodeParallelConfig(tensor_model_parallel_size=2), 1),
        "hybrid-tp2-to-tp1": (HYBRID, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                              DecodeParallelConfig(), 1),
    }[case]
    weights = str(tmp_path / "w")
    reference = run_distributed(reference_worker, 1, model_cfg, weights)[0]
    world = 2 if case.startswith("hybrid") else 4
    ranks = run_distributed(layout_worker, world, model_cfg, train, decode, weights, steps, str(tmp_path / "ck"),
                            timeout_s=600)
    # No CP in a decode layout: DP is what TP x PP leave.
    dp = world // (decode.tensor_model_parallel_size * decode.pipeline_model_parallel_size)
    assert sorted(r["decode_dp"] for r in ranks) == sorted((i, dp) for i in range(dp) for _ in range(world // dp))
    for result in ranks:
        _check_tokens(result["decode"], reference)
        _check_tokens(result["train"], reference)
    per_rank = (model_cfg.moe.num_experts or 0) // decode.expert_model_parallel_size
    if decode.tensor_model_parallel_size > 1:
        assert all(result["copies"] == [[]] * steps for result in ranks)
        return
    pp = decode.pipeline_model_parallel_size
    for step in range(steps):
        trained = run_distributed(_full, 1, model_cfg, str(tmp_path / "ck" / f"step{step}"))[0]
        held = set()
        for result in ranks:
            copy = {_global_layer(_global_expert(name, result["ep_rank"], per_rank), result["pp_rank"],
                                  model_cfg.num_layers // pp): t for name, t in result["copies"][step].items()}
            if pp > 1 and model_cfg.tie_embeddings and "output_layer.weight" in copy:  # the last stage's tied copy
                assert torch.equal(copy.pop("output_layer.weight"), trained["embedding.word_embeddings.weight"])
            assert copy.keys() <= trained.keys() and len(copy) > 0
            held |= copy.keys()
            if decode.expert_model_parallel_size == 1 and pp == 1:
                assert copy.keys() == trained.keys()
            for name, tensor in copy.items():
                assert torch.equal(tensor, trained[name]), (step, name)
        assert held == trained.keys() or decode.expert_model_parallel_size > 1


def _global_layer(name: str, pp_rank: int, per_stage: int) -> str:
    """A pipeline stage's parameter name with its global layer index (stage x layers per stage + local)."""
    import re

    return re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{pp_rank * per_stage + int(m.group(1))}.", name)


def _global_expert(name: str, ep_rank: int, per_rank: int) -> str:
    """A local-spec expert parameter's name with its global expert index (EP rank x experts per rank + K)."""
    import re

    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * per_rank + int(m.group(1))}.", name)


def _dtype_worker():
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training.decode_copy import DecodeCopy
    from megatron_cascade.training.policy import build_policy

    initialize_model_parallel(ParallelConfig(), seed=5)
    policy = build_policy(GPT, ParallelConfig(), OptimizerConfig(lr=1e-2), total_steps=1)
    copy = DecodeCopy(GPT, DecodeParallelConfig())
    copy.module.double()  # megatron-core's resharding would copy fp32 values into fp64 storage unchecked
    try:
        copy.refit(policy)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_copy_of_another_dtype_is_refused():
    message = run_distributed(_dtype_worker, 1)[0]
    assert "the decode copy holds ['torch.float64'] parameters, the policy ['torch.float32']" in message
