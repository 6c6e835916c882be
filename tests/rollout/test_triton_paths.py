"""Generation on CPU whether or not ``triton`` is importable.

PyPI's torch wheel is the CUDA build and brings ``triton``; with it importable, megatron-core takes
its Triton kernels whatever the device (its paged KV append asserted "All tensors must be on CUDA
devices" right after SFT). The test extra installs triton, so the whole suite runs that way; here the
paged generator's tests also run with triton hidden (PyTorch's CPU wheel), in a pytest of their own.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys

import pytest

from megatron_cascade.testing import run_distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _megatron_triton_paths() -> dict:
    import triton  # noqa: F401  (importable: Megatron's Triton modules import too)
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.ssm import mamba_mixer

    from megatron_cascade.ops.mamba_tensor_ops import TENSOR_OPS

    return {"kv_append": dynamic_context.triton_append_key_value_cache,
            "mamba_tensor_ops": {name: getattr(mamba_mixer, name) is fn for name, fn in TENSOR_OPS.items()}}


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64",
                    reason="the test extra brings triton on Linux x86_64 only")
def test_suite_runs_with_triton_importable_and_cpu_mode_takes_no_triton_kernel():
    assert importlib.util.find_spec("triton") is not None, "install the test extra: pip install -e .[test]"
    paths = run_distributed(_megatron_triton_paths, 1)[0]
    assert paths["kv_append"] is None
    assert all(paths["mamba_tensor_ops"].values()), paths


def test_generation_with_triton_hidden():
    """GPT (budgets, preemption) and hybrid (paged state slots) generation with ``import triton`` failing."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(HERE, "triton_hidden"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    hidden = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True, text=True)
    assert "triton is hidden" in hidden.stderr, hidden.stderr
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
         "tests/rollout/test_paged_generation.py::test_small_kv_budget_changes_no_token",
         "tests/rollout/test_hybrid_generation.py::test_paged_hybrid_runs_requests_together_and_preempts_under_a_tight_budget"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
