"""``convert compare`` on a GPT family (Llama): within tolerance exits 0, a checkpoint of other weights exits 1,
bad input exits 2 in one line; the ``megatron-cascade`` CLI has the command. (nemotron_h: test_nemotron_h_convert.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import pytest
from convert_fixtures import make_hf_model

from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed


def _run_cli(*argv: str, main_cli: bool = False) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``compare`` through ``python -m megatron_cascade.convert``'s main, or
    with ``main_cli`` the ``megatron-cascade`` console script's (in this process: no new interpreter)."""
    from megatron_cascade import cli
    from megatron_cascade.convert import cli as convert_cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["convert", "compare", *argv]) if main_cli else convert_cli.main(["compare", *argv])
    return code, out.getvalue(), err.getvalue()


def _edited_copy(src: str, dst: str, *, config: dict | None = None, scale: str | None = None) -> None:
    """``src`` copied to ``dst`` with ``config`` keys changed, or tensor ``scale`` multiplied by 1.5."""
    from safetensors.torch import save_file

    from megatron_cascade.convert.safetensors_io import SafetensorsReader

    shutil.copytree(src, dst)
    if config:
        with open(f"{dst}/config.json") as f:
            data = json.load(f)
        with open(f"{dst}/config.json", "w") as f:
            json.dump({**data, **config}, f)
    if scale:
        reader = SafetensorsReader(src)
        tensors = {n: reader.get(n) * (1.5 if n == scale else 1.0) for n in reader.tensors}
        for name in os.listdir(dst):
            if name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".json")):
                os.remove(f"{dst}/{name}")
        save_file(tensors, f"{dst}/model.safetensors", metadata={"format": "pt"})


def compare_worker(tmp: str) -> dict:
    """World size 1: convert a tiny Llama and a copy with one weight changed; ``compare`` good and bad pairs."""
    from megatron_cascade.convert import hf_to_megatron

    make_hf_model("llama", f"{tmp}/llama")
    hf_to_megatron(f"{tmp}/llama", f"{tmp}/llama_meg")
    _edited_copy(f"{tmp}/llama", f"{tmp}/llama_other", scale="model.layers.1.mlp.down_proj.weight")
    hf_to_megatron(f"{tmp}/llama_other", f"{tmp}/llama_other_meg")
    _edited_copy(f"{tmp}/llama", f"{tmp}/llama_vocab", config={"vocab_size": 300})
    return {
        "main_cli": _run_cli("--hf", f"{tmp}/llama", "--ckpt", f"{tmp}/llama_meg", "--tokens", "8", main_cli=True),
        "llama": _run_cli("--hf", f"{tmp}/llama", "--ckpt", f"{tmp}/llama_meg", "--tokens", "12"),
        "wrong_pair": _run_cli("--hf", f"{tmp}/llama", "--ckpt", f"{tmp}/llama_other_meg", "--tokens", "12"),
        "vocab": _run_cli("--hf", f"{tmp}/llama_vocab", "--ckpt", f"{tmp}/llama_meg"),
        "tokens": _run_cli("--hf", f"{tmp}/llama", "--ckpt", f"{tmp}/llama_meg", "--tokens", "0"),
    }


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("compare"))
    return tmp, run_distributed(compare_worker, 1, tmp, timeout_s=400)[0]


def test_gpt_family_within_tolerance(compared):
    _, out = compared
    code, stdout, _ = out["llama"]
    assert code == 0, stdout
    assert "LlamaForCausalLM: max abs logit difference" in stdout and "OK: within --tolerance 0.0001" in stdout


def test_wrong_pairing_exits_1_naming_the_difference(compared):
    _, out = compared
    code, stdout, stderr = out["wrong_pair"]
    assert code == 1
    assert "LlamaForCausalLM: max abs logit difference" in stdout and "FAIL" in stderr


@pytest.mark.parametrize("case,needle", [("vocab", "vocab_size=300"), ("tokens", "--tokens=0 must be >= 1")])
def test_bad_input_exits_2_with_one_line(compared, case, needle):
    _, out = compared
    code, _, stderr = out[case]
    assert code == 2 and needle in stderr and stderr.count("\n") == 1


def test_megatron_cascade_cli_has_the_command(compared):
    _, out = compared
    code, stdout, stderr = out["main_cli"]
    assert code == 0, stdout + stderr
    line = next(ln for ln in stdout.splitlines() if "max abs logit difference" in ln)
    assert line.startswith("LlamaForCausalLM") and float(line.split("difference ")[1].split()[0]) <= 1e-4
