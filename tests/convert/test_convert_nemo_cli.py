"""NeMo 2 import, reshard, inspect and the CLI (``python -m megatron_cascade.convert``) end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch
from convert_fixtures import NEMO_YAML, TOKENIZER_FILES, hf_logits, make_hf_model, nemo_model_config, nemo_worker

from megatron_cascade.convert import ConversionError, model_config_from_nemo
from megatron_cascade.convert.safetensors_io import INDEX_FILE, SafetensorsReader
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_cascade.convert", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_nemo2_import_keeps_weights_and_exports_to_hf(tmp_path):
    import transformers
    import yaml

    out = run_distributed(nemo_worker, 1, str(tmp_path), timeout_s=300)[0]
    assert out["cfg"] == nemo_model_config()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    torch.testing.assert_close(hf_logits(hf.eval()), out["logits"], atol=1e-4, rtol=0)
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == TOKENIZER_FILES["tokenizer.json"]
    cfg = yaml.safe_load(NEMO_YAML.format(config_class="Llama3Config8B"))["config"]
    assert model_config_from_nemo(cfg, "model.yaml") == nemo_model_config()


@pytest.mark.parametrize("target,needle", [
    ("nemo.collections.llm.gpt.model.llama.Llama31Config8B", "RoPE scaling"),
    ("nemo.collections.llm.gpt.model.mixtral.MixtralConfig8x7B", "is not supported"),
    ("my.own.Config", "my.own.Config is not supported"),
])
def test_nemo2_unknown_or_unsupported_config_is_refused(target, needle):
    import yaml

    cfg = yaml.safe_load(NEMO_YAML.format(config_class="X"))["config"]
    with pytest.raises(ConversionError, match=needle):
        model_config_from_nemo(dict(cfg, _target_=target), "context/model.yaml")


@pytest.fixture(scope="module")
def llama_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "hf"
    make_hf_model("llama", str(path))
    return path


def test_cli_hf_to_megatron_reshard_inspect_and_back_in_bf16(llama_hf, tmp_path):
    meg, resharded, back = tmp_path / "meg", tmp_path / "resharded", tmp_path / "back"
    run = _cli("hf-to-megatron", "--hf", str(llama_hf), "--out", str(meg), "--tp", "2", "--pp", "2")
    assert run.returncode == 0, run.stderr
    run = _cli("reshard", "--ckpt", str(meg), "--out", str(resharded), "--tp", "2")
    assert run.returncode == 0, run.stderr
    run = _cli("megatron-to-hf", "--ckpt", str(resharded), "--out", str(back), "--dtype", "bf16")
    assert run.returncode == 0, run.stderr
    src, out = SafetensorsReader(str(llama_hf)), SafetensorsReader(str(back))
    for name in src.tensors:
        assert torch.equal(out.get(name), src.get(name).to(torch.bfloat16)), name
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"

    hf_info = json.loads(_cli("inspect", str(llama_hf), "--json").stdout)
    meg_info = json.loads(_cli("inspect", str(resharded), "--json").stdout)
    assert hf_info["kind"] == "huggingface" and meg_info["kind"] == "megatron"
    assert hf_info["model_config"] == meg_info["model_config"]
    padding = (256 - 200) * 64 * 2  # embedding and output rows added by vocab padding
    assert meg_info["total_parameters"] == hf_info["total_parameters"] + padding
    shapes = {t["name"]: t["shape"] for t in meg_info["tensors"]}
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == [2, 128, 64]
    text = _cli("inspect", str(resharded)).stdout
    assert "megatron checkpoint" in text and "parameters:" in text


def test_cli_errors_name_the_problem(llama_hf, tmp_path):
    run = _cli("hf-to-megatron", "--hf", str(llama_hf), "--out", str(tmp_path / "x"), "--tp", "3")
    assert run.returncode == 2 and "--tp=3 does not divide" in run.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((llama_hf / "config.json").read_text())
    (broken / INDEX_FILE).write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    run = _cli("hf-to-megatron", "--hf", str(broken), "--out", str(tmp_path / "y"))
    assert run.returncode == 2 and "model-00002-of-00002.safetensors, which is missing" in run.stderr
    run = _cli("megatron-to-hf", "--ckpt", str(llama_hf), "--out", str(tmp_path / "z"))
    assert run.returncode == 2 and "model_config.json" in run.stderr
