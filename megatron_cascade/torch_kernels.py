"""Torch stand-ins for the CUDA-extension kernels Megatron-Core calls: flash-attn's paged KV-cache
attention (``ops/paged_attention_reference.py``) and the ``mamba_ssm`` / ``causal_conv1d`` kernels of
Mamba-2 layers (``ops/mamba_reference.py``, ``ops/mamba_tensor_ops.py``).

CPU mode (``cpu_runtime.enable_cpu_mode``) always installs them. ``enable_torch_kernels()`` installs,
on a GPU machine, those whose package is missing: a node that has only torch (no flash-attn,
mamba-ssm, causal-conv1d or Transformer Engine) then runs every path on the local layer spec, exactly
and slowly (paged attention gathers each request's whole KV per step; prefills go one by one). That is
for checking a bare GPU node (``benchmarks/gpu_check.py``), not for a real run, whose generation
refuses to start without flash-attn (``megatron-cascade doctor CONFIG`` says so first).
"""

from __future__ import annotations

import importlib
import sys
import types

from megatron_cascade.ops import paged_attention_reference

_REPLACED: list[str] = []  # what enable_torch_kernels() has put in place, in order
_TRITON_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


def _stub_triton_tensor_ops() -> None:
    """``mamba_mixer`` imports Megatron's Triton tensor ops at module level (``import triton``): without
    Triton, a stand-in module with the torch versions (``ops/mamba_tensor_ops.py``) lets it import."""
    try:
        importlib.import_module(_TRITON_TENSOR_OPS)
        return
    except ImportError:
        pass
    from megatron_cascade.ops.mamba_tensor_ops import TENSOR_OPS

    module = types.ModuleType(_TRITON_TENSOR_OPS)
    for name, fn in TENSOR_OPS.items():
        setattr(module, name, fn)
    sys.modules[_TRITON_TENSOR_OPS] = module


def _sharded_gated_norm_class():
    """``mamba_mixer.ExtendedRMSNorm`` on the torch gated norm: the weight sharded over TP on dim 0.
    (The original class body is lost: without ``mamba_ssm`` it subclasses a ``MagicMock``.)"""
    from megatron.core import parallel_state
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    from megatron_cascade.ops.mamba_reference import GatedRMSNorm

    class ExtendedRMSNorm(GatedRMSNorm):
        """Gated RMSNorm of a Mamba mixer, with a TP-sharded checkpoint entry (as megatron-core's)."""

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            tp_group = getattr(self, "tp_group", None) or parallel_state.get_tensor_model_parallel_group()
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                tp_group=tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return ExtendedRMSNorm


def install_mamba(*, local_final_norm: bool) -> None:
    """Make megatron-core's ``MambaMixer`` / ``MambaStack`` run without the CUDA-only packages (idempotent).

    * ``mamba_ssm`` (Triton kernels, gated RMSNorm) and ``causal_conv1d`` do not build on CPU: the
      mixer refuses to start without ``mamba_ssm`` (``HAVE_MAMBA_SSM``) and its norm class
      subclasses a ``MagicMock``. The torch references of ``ops/mamba_reference.py`` take their
      place (same arguments, autograd backward); decoding already has torch fallbacks in the mixer.
    * Packed sequences (training) and the paged engine (generation): the mixer asks for
      ``causal_conv1d`` / ``mamba_ssm`` versions and calls their decode, varlen-state and Triton
      tensor-op kernels; ``ops/mamba_tensor_ops.py`` installs torch versions of all of them.
    * ``MambaStack`` builds its final norm with ``TENorm`` unconditionally: with ``local_final_norm``
      (CPU mode; a GPU without Transformer Engine) a local norm instead (``SequenceParallelNorm``:
      marks its weight for the SP gradient all-reduce).
    """
    _stub_triton_tensor_ops()
    from megatron.core.ssm import mamba_block, mamba_mixer

    from megatron_cascade.model.cpu_spec import SequenceParallelNorm
    from megatron_cascade.ops import mamba_reference

    if local_final_norm:
        mamba_block.TENorm = SequenceParallelNorm
    if mamba_mixer.HAVE_MAMBA_SSM:
        return  # the real kernels are importable (a CUDA build): nothing to replace
    mamba_mixer.ExtendedRMSNorm = _sharded_gated_norm_class()
    mamba_mixer.RMSNormGated = mamba_reference.GatedRMSNorm
    mamba_mixer.mamba_chunk_scan_combined = mamba_reference.mamba_chunk_scan_combined
    mamba_mixer.mamba_split_conv1d_scan_combined = mamba_reference.mamba_split_conv1d_scan_combined
    mamba_mixer.HAVE_MAMBA_SSM = True
    from megatron_cascade.ops import mamba_tensor_ops

    mamba_tensor_ops.install()


def install_paged_attention() -> None:
    """Route Megatron's dynamic-batching attention to the torch stand-ins (idempotent)."""
    paged_attention_reference.install()


def _transformer_engine_missing() -> bool:
    from megatron_cascade.model.parallel import transformer_engine_available

    return not transformer_engine_available()


def enable_torch_kernels() -> list[str]:
    """On a GPU machine: the stand-ins for each missing kernel package; returns what they replace
    (empty when flash-attn, mamba-ssm and Transformer Engine are all there; the same list on every
    call). Call before building models."""
    from megatron.core.ssm import mamba_mixer

    if not paged_attention_reference.paged_kernels_available():
        install_paged_attention()
        _REPLACED.append("flash-attn paged KV attention")
    te_missing = _transformer_engine_missing() and "Transformer Engine's Mamba final norm" not in _REPLACED
    if not mamba_mixer.HAVE_MAMBA_SSM or te_missing:
        if not mamba_mixer.HAVE_MAMBA_SSM:
            _REPLACED.append("mamba-ssm / causal-conv1d kernels")
        if te_missing:
            _REPLACED.append("Transformer Engine's Mamba final norm")
        install_mamba(local_final_norm=te_missing)
    return list(_REPLACED)
