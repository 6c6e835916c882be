"""Every Megatron checkpoint the converter writes carries ``files.json`` (each file's size and hash),
and everything that reads one verifies it first (red-team issue 29: a changed byte inside a tensor
shard of a checkpoint was read as weights). Before: no record; the conversion back to Hugging Face and
the reshard copied the changed shard, the load read it."""

from __future__ import annotations

import json
import os

import pytest

from megatron_cascade.models.errors import ConversionError
from megatron_cascade.testing import run_distributed
from tests.convert.convert_fixtures import make_hf_model

pytestmark = pytest.mark.distributed


def _convert_damage_read(tmp: str) -> dict:
    from megatron_cascade.convert import hf_to_megatron, megatron_to_hf
    from megatron_cascade.convert.reshard import reshard
    from megatron_cascade.model import CheckpointError, build_gpt_model, initialize_model_parallel, load_model_weights
    from megatron_cascade.config import ParallelConfig

    make_hf_model("llama", os.path.join(tmp, "hf"))
    ckpt = os.path.join(tmp, "mcore")
    model = hf_to_megatron(os.path.join(tmp, "hf"), ckpt)
    with open(os.path.join(ckpt, "files.json")) as f:
        recorded = sorted(json.load(f))
    on_disk = sorted(os.path.relpath(os.path.join(d, n), ckpt) for d, _, names in os.walk(ckpt) for n in names)
    reshard(ckpt, os.path.join(tmp, "copy"))  # a healthy checkpoint copies, and the copy has its own record
    shard = max((n for n in os.listdir(ckpt) if n.endswith(".distcp")), key=lambda n: os.path.getsize(os.path.join(ckpt, n)))
    with open(os.path.join(ckpt, shard), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(ckpt, shard)) // 2)
        f.write(b"\x7f" * 64)
    outcomes = {}
    for what, read in (("to_hf", lambda: megatron_to_hf(ckpt, os.path.join(tmp, "back"))),
                       ("reshard", lambda: reshard(ckpt, os.path.join(tmp, "copy2")))):
        try:
            read()
            outcomes[what] = "read"
        except ConversionError as exc:
            outcomes[what] = f"ConversionError: {exc}"
    initialize_model_parallel(ParallelConfig(), seed=0)
    net = build_gpt_model(model, ParallelConfig())
    try:
        load_model_weights(net, ckpt, model)
        outcomes["load"] = "read"
    except CheckpointError as exc:
        outcomes["load"] = f"CheckpointError: {exc}"
    return {"recorded": recorded, "on_disk": on_disk, "shard": shard, "outcomes": outcomes,
            "copy_recorded": os.path.isfile(os.path.join(tmp, "copy", "files.json"))}


def test_a_changed_byte_in_a_converted_checkpoint_is_refused_by_every_reader(tmp_path):
    result = run_distributed(_convert_damage_read, 1, str(tmp_path))[0]
    assert result["recorded"] == [f for f in result["on_disk"] if f != "files.json"], result
    assert result["copy_recorded"], result
    for what, outcome in result["outcomes"].items():
        assert f"is damaged: {result['shard']}: content differs from what was written (xxh3_128)" in outcome, (what, outcome)
    assert not os.path.exists(tmp_path / "back") and not os.path.exists(tmp_path / "copy2")
