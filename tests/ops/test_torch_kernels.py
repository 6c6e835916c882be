"""``torch_kernels.enable_torch_kernels``: on a GPU node that has only torch (the carried wheelhouse),
the stand-ins for each missing kernel package, and nothing of CPU mode. This machine lacks flash-attn,
mamba-ssm and Transformer Engine, as such a node does; the process never enters CPU mode."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, torch
cuda_runtime = (torch.cuda.current_device, torch.cuda.synchronize)
from megatron_cascade.torch_kernels import enable_torch_kernels
from megatron_cascade.cpu_runtime import cpu_mode_enabled
replaced = enable_torch_kernels()
assert enable_torch_kernels() == replaced  # idempotent
from megatron.core.transformer import attention
from megatron.core.ssm import mamba_block, mamba_mixer
from megatron_cascade.model.cpu_spec import SequenceParallelNorm
from megatron_cascade.ops import mamba_reference
from megatron_cascade.ops import paged_attention_reference
print("RESULT" + json.dumps({
    "replaced": replaced,
    "paged": attention.flash_attn_varlen_func is paged_attention_reference.flash_attn_varlen_func
             and attention.flash_attn_with_kvcache is paged_attention_reference.flash_attn_with_kvcache
             and attention.is_fa_min_version("2.7.3"),
    "mamba": mamba_mixer.HAVE_MAMBA_SSM and mamba_mixer.mamba_chunk_scan_combined is mamba_reference.mamba_chunk_scan_combined,
    "final_norm": mamba_block.TENorm is SequenceParallelNorm,
    "cpu_mode": cpu_mode_enabled(),
    "cuda_runtime_untouched": (torch.cuda.current_device, torch.cuda.synchronize) == cuda_runtime,
}))
"""


def test_a_torch_only_gpu_node_gets_the_stand_ins_and_nothing_of_cpu_mode():
    res = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, res.stdout[-2000:] + res.stderr[-3000:]
    got = json.loads(line[len("RESULT"):])
    assert got["replaced"] == ["flash-attn paged KV attention", "mamba-ssm / causal-conv1d kernels",
                               "Transformer Engine's Mamba final norm"]
    assert got["paged"] and got["mamba"] and got["final_norm"], got
    assert not got["cpu_mode"] and got["cuda_runtime_untouched"], got
