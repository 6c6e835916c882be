"""Shared pytest configuration: markers and CPU-mode defaults."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Test configs in temporary folders include the repository's examples (``defaults: [/abs/ci.yaml]``):
# the operator's allowance of that folder (megatron_cascade/config/yaml_safety.py).
os.environ.setdefault("MEGATRON_CASCADE_CONFIG_INCLUDE_DIRS",
                      os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (run in CI too)")
    config.addinivalue_line("markers", "distributed: spawns several gloo worker processes")
