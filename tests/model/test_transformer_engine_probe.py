"""``transformer_engine_available``: a TE whose PyTorch extension does not load counts as absent.

gpu_review_2: ``import transformer_engine`` succeeds with only TE's core library, so a TE built
against another torch passed the check and the first TE layer failed deep inside a model build. A
stand-in ``transformer_engine`` package (its ``pytorch`` part raising as a mis-built extension does)
and a CUDA answer from torch stand for the GPU node; each case runs in a fresh process."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
torch.cuda.is_available = lambda: True
sys.path.insert(0, {root!r})
from megatron_cascade.model.parallel import transformer_engine_available
print("AVAILABLE", transformer_engine_available())
"""


@pytest.mark.parametrize("pytorch_part,expected", [
    ("raise OSError('libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDevice')", "False"),
    ("", "True"),
])
def test_a_te_whose_torch_extension_does_not_load_is_absent(tmp_path, pytorch_part, expected):
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(pytorch_part + "\n")
    res = subprocess.run([sys.executable, "-c", _PROBE.format(root=str(tmp_path))], capture_output=True, text=True,
                         timeout=120)
    assert f"AVAILABLE {expected}" in res.stdout, res.stdout + res.stderr[-3000:]
    if expected == "False":
        assert "transformer_engine.pytorch does not import (OSError: libtransformer_engine.so" in res.stderr
