"""Shared pytest configuration: markers and CPU-mode defaults."""

import os
import resource

os.environ.setdefault("OMP_NUM_THREADS", "1")

# A test process builds and tears down Megatron's gloo groups many times (the conversion fixtures:
# several layouts per model family); their pipes and sockets outlive destroy_model_parallel until
# collected. 1024 open files, a normal user's usual soft limit (root here: 20000), ran out ("pipe: Too
# many open files"); any user may raise the soft limit to the hard one. Workers inherit it.
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _soft != resource.RLIM_INFINITY and (_hard == resource.RLIM_INFINITY or _soft < _hard):
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard if _hard != resource.RLIM_INFINITY else 65536, _hard))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end tests (run in CI too)")
    config.addinivalue_line("markers", "distributed: spawns several gloo worker processes")
