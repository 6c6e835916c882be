"""HF ``nemotron_h`` <-> Megatron hybrid (MambaModel) conversion of a tiny random Nemotron-H.

The model has one layer of each kind (pattern ``M*ME-``: Mamba-2, attention, Mamba-2, MoE with a
shared expert and expert bias, dense relu² MLP), 2 Mamba groups (TP=2 splits them), GQA 4/2 and a
vocab of 200 padded to 256; every parameter is randomised, the expert bias too, so that any mix-up
(a z/x/B/C/dt part sharded as one block, a wrong expert, a dropped bias) moves the logits.
One single-process worker converts (fp32 and bf16; also a checkpoint without the imported HF config,
as training writes them) and compares at TP=1 (also through ``convert compare``); one two-process worker
compares at TP=2 + sequence parallel and EP=2 and reloads a checkpoint saved at TP=2 at TP=1.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
import torch

from megatron_cascade.convert.safetensors_io import INDEX_FILE, SafetensorsReader
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed
ATOL = 1e-4
VOCAB = 200
TOKENS = 16
NEMOTRON_H = dict(
    vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern="M*ME-", num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
    conv_kernel=4, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
    moe_shared_expert_intermediate_size=80, routed_scaling_factor=2.5, max_position_embeddings=128,
    layer_norm_epsilon=1e-5, tie_word_embeddings=False,
)
TOKENIZER_FILES = {"tokenizer_config.json": {"model_max_length": 128}, "tokenizer.json": {"version": "1.0"}}


def make_nemotron_h(out_dir: str, *, max_shard_size: str = "5GB"):
    """Build, randomise and save the tiny Nemotron-H (fp32) with tokenizer files; returns the HF model."""
    import transformers

    config = transformers.NemotronHConfig(**NEMOTRON_H)
    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 8.0)))  # A = -exp(A_log) in [-8, -1]
            elif "norm" in name or name.endswith(".D"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    for name, content in TOKENIZER_FILES.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f)
    return model


def write_bf16_copy(src: str, dst: str) -> None:
    """``src`` with every tensor in bf16 but the router's expert bias (float32, as transformers keeps it)."""
    from safetensors.torch import save_file

    reader = SafetensorsReader(src)
    tensors = {n: reader.get(n) if n.endswith("e_score_correction_bias") else reader.get(n).to(torch.bfloat16)
               for n in reader.tensors}
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, "dtype": "bfloat16"}, f)


def single_worker(tmp: str) -> dict:
    """World size 1: convert fp32 (sharded input and output) and bf16 both ways; compare at TP=1."""
    from megatron_cascade.convert import format_summary, hf_to_megatron, inspect_checkpoint, megatron_to_hf, reshard
    from megatron_cascade.convert.cli import main
    from megatron_cascade.convert.compare import compare_checkpoints, sample_tokens
    from megatron_cascade.convert.dist_reader import read_dist_metadata

    model = make_nemotron_h(f"{tmp}/hf", max_shard_size="60KB")
    cfg = hf_to_megatron(f"{tmp}/hf", f"{tmp}/meg", tp=2, ep=2)
    megatron_to_hf(f"{tmp}/meg", f"{tmp}/hf_back", max_shard_size="80KB")
    reshard(f"{tmp}/meg", f"{tmp}/meg_tp2", tp=2)
    write_bf16_copy(f"{tmp}/hf", f"{tmp}/hf_bf16")
    hf_to_megatron(f"{tmp}/hf_bf16", f"{tmp}/meg_bf16")
    megatron_to_hf(f"{tmp}/meg_bf16", f"{tmp}/hf_bf16_back")
    with torch.no_grad():
        hf = model(sample_tokens(VOCAB, TOKENS)).logits.float()
    # a checkpoint without the imported HF config (as training writes them): the config is made from ours
    shutil.copytree(f"{tmp}/meg", f"{tmp}/meg_trained", ignore=shutil.ignore_patterns("hf", "files.json"))
    megatron_to_hf(f"{tmp}/meg_trained", f"{tmp}/hf_from_scratch")
    meta = read_dist_metadata(f"{tmp}/meg_bf16").state_dict_metadata
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_status = main(["compare", "--hf", f"{tmp}/hf", "--ckpt", f"{tmp}/meg", "--tokens", "8"])
    return {
        "inspect": format_summary(inspect_checkpoint(f"{tmp}/meg"), show_tensors=False),
        "cli": (cli_status, out.getvalue()),
        "cfg": cfg, "hf": hf,
        "tp1": compare_checkpoints(f"{tmp}/hf", f"{tmp}/meg", tokens=TOKENS),
        "resharded": compare_checkpoints(f"{tmp}/hf", f"{tmp}/meg_tp2", tokens=TOKENS),
        "bf16": compare_checkpoints(f"{tmp}/hf_bf16", f"{tmp}/meg_bf16", tokens=TOKENS),
        "from_scratch": compare_checkpoints(f"{tmp}/hf_from_scratch", f"{tmp}/meg_trained", tokens=TOKENS),
        "keys": {k: (tuple(v.size), v.properties.dtype) for k, v in meta.items() if hasattr(v, "chunks")},
    }


def parallel_worker(tmp: str, cfg) -> dict:
    """World size 2: logits at TP=2 + sequence parallel and at EP=2; a TP=2 save reloaded at TP=1."""
    from dataclasses import replace

    from megatron.core import parallel_state

    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.convert.compare import megatron_logits, sample_tokens
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.model import save_model_weights

    tokens, out = sample_tokens(VOCAB, TOKENS), {}
    for name, parallel in {"tp2_sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                           "ep2": ParallelConfig(expert_model_parallel_size=2)}.items():
        initialize_model_parallel(parallel, seed=1)
        try:
            out[name] = megatron_logits(f"{tmp}/meg", tokens, parallel, cfg)
            if name == "tp2_sp":
                model = build_gpt_model(cfg, parallel)
                load_model_weights(model, f"{tmp}/meg", cfg)
                save_model_weights(model, f"{tmp}/saved_tp2", cfg)
        finally:
            parallel_state.destroy_model_parallel()
    single = replace(ParallelConfig())
    initialize_model_parallel(single, seed=1)
    try:
        out["tp2_saved_tp1_loaded"] = megatron_logits(f"{tmp}/saved_tp2", tokens, single, cfg)
    finally:
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("nemotron_h"))
    single = run_distributed(single_worker, 1, tmp, timeout_s=400)[0]
    ranks = run_distributed(parallel_worker, 2, tmp, single["cfg"], timeout_s=400)
    return tmp, single, ranks


def test_config_maps_to_a_hybrid_model(converted):
    _, single, _ = converted
    cfg = single["cfg"]
    assert cfg.architecture == "hybrid" and cfg.hybrid.layer_pattern == "M*ME-"
    h = cfg.hybrid
    assert (h.mamba_num_heads, h.mamba_head_dim, h.mamba_state_dim, h.mamba_num_groups, h.mamba_conv_kernel,
            h.mamba_chunk_size) == (8, 16, 16, 2, 4, 8)
    assert (cfg.activation, cfg.position_embedding_type, cfg.padded_vocab_size) == ("squared_relu", "none", 256)
    moe = cfg.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size,
            moe.shared_expert_intermediate_size) == (4, 2, 48, 80)
    assert (moe.router_score_function, moe.router_enable_expert_bias, moe.router_topk_scaling_factor) == \
        ("sigmoid", True, 2.5)


@pytest.mark.parametrize("which", ["tp1", "resharded", "from_scratch"])
def test_compare_at_tp1_is_within_tolerance(converted, which):
    _, single, _ = converted
    result = single[which]
    assert result.max_abs_diff <= ATOL, result.summary()
    assert result.max_abs_logit > 1.0, "random weights should give logits far from zero"
    assert result.argmax_agreement == 1.0


def test_inspect_shows_the_hybrid_layout(converted):
    _, single, _ = converted
    assert "shared_expert=80 pattern=M*ME- mamba_heads=8x16 state=16 groups=2" in single["inspect"]


def test_compare_cli_on_nemotron_h(converted):
    _, single, _ = converted
    status, stdout = single["cli"]
    assert status == 0, stdout
    line = next(ln for ln in stdout.splitlines() if "max abs logit difference" in ln)
    assert line.startswith("NemotronHForCausalLM") and float(line.split("difference ")[1].split()[0]) <= ATOL


@pytest.mark.parametrize("layout", ["tp2_sp", "ep2"])
def test_logits_at_tp2_sequence_parallel_and_ep2_equal_hf(converted, layout):
    _, single, ranks = converted
    for rank in ranks:
        torch.testing.assert_close(rank[layout], single["hf"], atol=ATOL, rtol=0)


def test_checkpoint_saved_at_tp2_loads_at_tp1(converted):
    _, _, ranks = converted
    for rank in ranks:
        torch.testing.assert_close(rank["tp2_saved_tp1_loaded"], rank["tp2_sp"], atol=1e-5, rtol=0)


def test_mamba_in_proj_and_conv1d_parts_are_stored_under_their_own_keys(converted):
    _, single, _ = converted
    keys = single["keys"]
    # d_inner 128, groups x state 32, heads 8: each part its own key, so TP shards each part on its own.
    for part, rows in {"z": 128, "x": 128, "B": 32, "C": 32, "dt": 8}.items():
        assert keys[f"decoder.layers.0.mixer.in_proj.weight.{part}"][0] == (rows, 64)
    for part, rows in {"x": 128, "B": 32, "C": 32}.items():
        assert keys[f"decoder.layers.2.mixer.conv1d.weight.{part}"][0] == (rows, 1, 4)
        assert keys[f"decoder.layers.2.mixer.conv1d.bias.{part}"][0] == (rows,)
    assert "decoder.layers.0.mixer.in_proj.weight" not in keys


def test_bf16_checkpoint_keeps_the_expert_bias_in_float32(converted):
    _, single, _ = converted
    keys = single["keys"]
    assert keys["decoder.layers.3.mlp.router.expert_bias"][1] == torch.float32
    assert keys["decoder.layers.3.mlp.router.weight"][1] == torch.bfloat16
    assert keys["decoder.layers.0.mixer.in_proj.weight.z"][1] == torch.bfloat16
    # the same bf16 weights on both sides, both run in float32
    assert single["bf16"].max_abs_diff <= ATOL, single["bf16"].summary()


@pytest.mark.parametrize("src,back", [("hf", "hf_back"), ("hf_bf16", "hf_bf16_back")])
def test_round_trip_is_bit_identical(converted, src, back):
    tmp, _, _ = converted
    a, b = SafetensorsReader(f"{tmp}/{src}"), SafetensorsReader(f"{tmp}/{back}")
    assert sorted(b.tensors) == sorted(a.tensors)
    for name in a.tensors:
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    with open(f"{tmp}/{src}/config.json") as f:
        before = json.load(f)
    with open(f"{tmp}/{back}/config.json") as f:
        after = json.load(f)
    assert {k: v for k, v in after.items() if k != "transformers_version"} == \
        {k: v for k, v in before.items() if k != "transformers_version"}


def test_sharded_input_and_output_use_an_index(converted):
    tmp, _, _ = converted
    for name in ("hf", "hf_back"):
        with open(f"{tmp}/{name}/{INDEX_FILE}") as f:
            assert len(set(json.load(f)["weight_map"].values())) > 1, name
    for name, content in TOKENIZER_FILES.items():
        with open(f"{tmp}/hf_back/{name}") as f:
            assert json.load(f) == content
