"""HF <-> Megatron conversion of tiny random Llama 3 / Qwen2.5 / Qwen3 / Qwen3-MoE / Mixtral models.

One single-process worker converts every family (HF -> Megatron -> HF) and computes HF and TP=1
Megatron logits; one two-process worker computes TP=2 (dense) / EP=2 (MoE) logits and re-loads a
checkpoint saved at TP=2 at TP=1.
"""

import json
import os

import pytest
import torch
from convert_fixtures import FAMILIES, MOE_FAMILIES, TOKENIZER_FILES, convert_all_worker, export_worker, parallel_worker

from megatron_cascade.convert.safetensors_io import INDEX_FILE, SafetensorsReader
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed
ATOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("families"))
    single = run_distributed(convert_all_worker, 1, tmp, timeout_s=400)[0]
    cfgs = {family: r["cfg"] for family, r in single.items()}
    ranks = run_distributed(parallel_worker, 2, tmp, cfgs, timeout_s=400)
    return tmp, single, ranks


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_logits_equal_megatron_tp1(converted, family):
    _, single, _ = converted
    torch.testing.assert_close(single[family]["tp1"], single[family]["hf"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_logits_equal_megatron_tp2_or_ep2(converted, family):
    _, single, ranks = converted
    for rank in ranks:
        torch.testing.assert_close(rank[family]["parallel"], single[family]["hf"], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in MOE_FAMILIES])
def test_checkpoint_saved_at_tp2_loads_at_tp1(converted, family):
    _, _, ranks = converted
    for rank in ranks:
        torch.testing.assert_close(rank[family]["tp2_saved_tp1_loaded"], rank[family]["parallel"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(converted, family):
    tmp, _, _ = converted
    src, back = SafetensorsReader(f"{tmp}/{family}/hf"), SafetensorsReader(f"{tmp}/{family}/hf_back")
    assert sorted(back.tensors) == sorted(src.tensors)
    for name in src.tensors:
        a, b = src.get(name), back.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    with open(f"{tmp}/{family}/hf/config.json") as f:
        before = json.load(f)
    with open(f"{tmp}/{family}/hf_back/config.json") as f:
        after = json.load(f)
    assert {k: v for k, v in after.items() if k != "transformers_version"} == \
        {k: v for k, v in before.items() if k != "transformers_version"}
    for name, content in TOKENIZER_FILES.items():
        with open(f"{tmp}/{family}/hf_back/{name}") as f:
            assert json.load(f) == content


def test_sharded_input_and_output_use_an_index(converted):
    tmp, _, _ = converted
    assert os.path.isfile(f"{tmp}/llama/hf/{INDEX_FILE}"), "the llama input should be sharded"
    with open(f"{tmp}/qwen3/hf_back/{INDEX_FILE}") as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert all(os.path.isfile(f"{tmp}/qwen3/hf_back/{name}") for name in weight_map.values())


def test_vocab_padding_rows_are_zero_in_megatron_checkpoint(converted):
    _, single, _ = converted
    cfg = single["llama"]["cfg"]
    assert cfg.vocab_size == 200 and cfg.padded_vocab_size == 256


def test_wrong_architecture_is_refused(converted):
    _, single, _ = converted
    message = single["llama"]["wrong_arch_error"]
    assert "num_layers" in message and "checkpoint=2" in message and "model=3" in message


def test_checkpoint_saved_by_megatron_at_tp2_exports_bit_identical(converted):
    tmp, _, _ = converted
    run_distributed(export_worker, 1, f"{tmp}/qwen3/saved_tp2", f"{tmp}/qwen3/hf_from_tp2", timeout_s=300)
    src, back = SafetensorsReader(f"{tmp}/qwen3/hf"), SafetensorsReader(f"{tmp}/qwen3/hf_from_tp2")
    assert sorted(back.tensors) == sorted(src.tensors)
    for name in src.tensors:
        assert torch.equal(src.get(name), back.get(name)), name
