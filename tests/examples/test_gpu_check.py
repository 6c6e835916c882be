"""benchmarks/gpu_check.{sh,py}, the check for a lent GPU, as far as this CPU machine can take it:
argument parsing, the fast "no CUDA" exit of both entry points, shellcheck, and the checks
themselves driven on CPU with a tiny model (the GPU-only FP8 check then reports SKIP)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "32", "--batch", "4",
        "--steps", "2", "--new-tokens", "4", "--slice-seqs", "32", "64"]
# The recipe slices: each recipe's model with its widths shrunk (every other setting the recipe's).
_SMALL = ("model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=2",
          "model.kv_channels=16", "model.vocab_size=256", "model.moe.num_experts=4", "model.moe.router_topk=2",
          "model.moe.ffn_hidden_size=32")
for _override in _SMALL:
    TINY += ["--moe-set", _override, "--hybrid-set", _override]
for _override in ("model.moe.shared_expert_intermediate_size=64", "model.hybrid.mamba_num_heads=4",
                  "model.hybrid.mamba_head_dim=16", "model.hybrid.mamba_state_dim=16", "model.hybrid.mamba_num_groups=2",
                  "model.hybrid.mamba_chunk_size=16"):
    TINY += ["--hybrid-set", _override]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_argparse_and_help():
    gpu_check = load_gpu_check()
    args = gpu_check.build_parser().parse_args(["--steps", "3", "--json", "x.json"])
    assert args.steps == 3 and args.json == "x.json" and args.write_cpu_checkpoint is None
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "cpu_checkpoint" in res.stdout, res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_both_entry_points_exit_2_at_once():
    start = time.monotonic()
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check.py")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no CUDA device" in res.stderr, res.stdout + res.stderr
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(["bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 2 and "no CUDA device" in res.stderr, res.stdout + res.stderr
    assert time.monotonic() - start < 45


def test_shell_script_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install -y shellcheck)")
    res = subprocess.run(["shellcheck", "--shell=bash", str(BENCH / "gpu_check.sh")], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


_DRIVER = """
import json, sys
sys.path.insert(0, {bench!r})
import gpu_check
args = gpu_check.build_parser().parse_args({argv!r})
log = gpu_check.ResultLog({json_path!r})
results = gpu_check.run_checks(args, on_result=log.add)
# the JSON keeps up with every result (compared as text: unmeasured figures are NaN)
assert json.dumps([vars(r) for r in results]) == json.dumps(json.load(open({json_path!r})))
print("RESULTS" + json.dumps([vars(r) for r in results]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU drive of the checks")
def test_checks_run_on_cpu_with_a_tiny_model(tmp_path):
    """The same functions the GPU run calls (CPU-written checkpoint, bf16 steps after the load,
    fused log-prob head, packed rows, generation, a converted Nemotron-H) pass on CPU; FP8 needs
    Transformer Engine and says so. Each result is printed, and the JSON rewritten, as its check ends."""
    code = _DRIVER.format(bench=str(BENCH), argv=TINY, json_path=str(tmp_path / "results.json"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULTS")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(line[len("RESULTS"):])}
    printed = [x.split()[1] for x in res.stdout.splitlines() if x.split()[:1] in (["PASS"], ["FAIL"], ["SKIP"])]
    assert printed == list(results), res.stdout[-3000:]  # one line per check, in order
    for name in ("moe_slice", "hybrid_slice", "cpu_writer", "moe_checkpoint", "cpu_checkpoint", "bf16_step", "optimizer_resume", "training_state_offload", "fused_logprob_head", "packed_step", "generation", "decode_copy",
                 "decode_cuda_graphs", "nemotron_h_te"):
        assert results[name]["status"] == "PASS", results[name]
    for name in ("fp8_step", "fp8_resume", "fp8_reference", "fp8_generation"):  # Transformer Engine only
        assert results[name]["status"] == "SKIP", results[name]
    for name in ("moe_slice", "hybrid_slice"):
        fig = results[name]["figures"]
        assert fig["planned_gib_64"] > fig["planned_gib_32"] > 0 and fig["tokens_per_s_64"] > 0, fig
    assert 0 < results["bf16_step"]["figures"]["rel_change_from_loaded"] < 0.1
    assert results["bf16_step"]["figures"]["tokens_per_s"] > 0
    assert results["optimizer_resume"]["figures"]["max_diff_resumed"] == 0.0, results["optimizer_resume"]
    offload = results["training_state_offload"]["figures"]
    assert offload["max_diff_parked"] == 0.0 and offload["grads_and_optimizer_gib"] > 0, offload
    # Decode-time log-probs (paged KV cache) equal a teacher-forced recompute, to bf16 rounding.
    assert results["generation"]["figures"]["max_logprob_gap"] < 0.1, results["generation"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU drive of the hybrid checks")
def test_hybrid_checks_run_on_cpu():
    """gpu_check_hybrid.py's checks (CPU-written hybrid weights reloaded; cached SSM state vs full
    recompute in generation) pass on CPU with the local spec."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, str(BENCH / "gpu_check_hybrid.py"), "--allow-cpu"], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("hybrid_checkpoint", "hybrid_generation", "hybrid_generation_tight", "hybrid_generation_static",
                 "hybrid_recompute"):
        assert f"name={name} status=PASS" in res.stdout, res.stdout


_FP8_DRIVER = """
import json, sys
sys.path.insert(0, {bench!r})
import gpu_check, gpu_check_fp8
from megatron_cascade.cascade.runtime import init_distributed
from megatron_cascade.config.model import ParallelConfig
from megatron_cascade.model import initialize_model_parallel
args = gpu_check.build_parser().parse_args({argv!r})
init_distributed()
initialize_model_parallel(ParallelConfig(), seed=0)
results = gpu_check_fp8.run_fp8_checks(args, gpu_check.guarded, fp8_format=None)
print("RESULTS" + json.dumps([vars(r) for r in results]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU drive of the FP8 checks' code")
def test_fp8_checks_code_runs_without_fp8_on_cpu():
    """The FP8 checks need Transformer Engine; their code (one policy stepped, its checkpoint loaded
    into a fresh policy, the frozen copy from that checkpoint, generation) runs here with FP8 off:
    bit-equal after the round trip, no gap between the frozen copy and the policy."""
    code = _FP8_DRIVER.format(bench=str(BENCH), argv=TINY)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULTS")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(line[len("RESULTS"):])}
    assert list(results) == ["fp8_step", "fp8_resume", "fp8_reference", "fp8_generation"]
    assert all(r["status"] == "PASS" for r in results.values()), results
    assert results["fp8_resume"]["figures"]["max_logprob_diff"] == 0.0
    assert results["fp8_reference"]["figures"]["max_logprob_gap"] == 0.0


_WRITER_FAILS = """
import json, sys
sys.path.insert(0, {bench!r})
import gpu_check, gpu_check_fp8, gpu_check_moe
def broken_writer(args, out_dir):
    raise RuntimeError("CPU checkpoint writer failed (1): no space left on device")
gpu_check.run_cpu_writer = broken_writer
skip = lambda name: (lambda *a, **k: gpu_check.Result(name, "SKIP", "not this test"))
gpu_check_moe.check_moe_slice, gpu_check_moe.check_hybrid_slice = skip("moe_slice"), skip("hybrid_slice")
gpu_check_fp8.run_fp8_checks = lambda args, guard: []
gpu_check.check_nemotron_h_conversion = skip("nemotron_h_te")
args = gpu_check.build_parser().parse_args({argv!r})
results = gpu_check.run_checks(args)
print("RESULTS" + json.dumps([vars(r) for r in results]))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU drive of the checks")
def test_a_failing_cpu_writer_skips_only_the_checks_of_its_checkpoints():
    """Before, the CPU writer ran outside every check's guard: its failure ended the whole run with
    nothing reported. Now it is a result of its own and only the two checkpoint loads SKIP."""
    code = _WRITER_FAILS.format(bench=str(BENCH), argv=TINY)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULTS")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    results = {r["name"]: r for r in json.loads(line[len("RESULTS"):])}
    assert results["cpu_writer"]["status"] == "FAIL" and "no space left" in results["cpu_writer"]["detail"]
    assert results["moe_checkpoint"]["status"] == results["cpu_checkpoint"]["status"] == "SKIP"
    for name in ("bf16_step", "optimizer_resume", "generation", "decode_copy"):
        assert results[name]["status"] == "PASS", results[name]
    assert "masters reload is not checked" in results["bf16_step"]["detail"]
