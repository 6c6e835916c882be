"""Shared pytest configuration: markers and CPU-mode defaults."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (run in CI too)")
    config.addinivalue_line("markers", "distributed: spawns several gloo worker processes")
