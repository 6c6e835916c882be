"""The paged KV cache's config keys: validated at load time with the key named, and turned into the
``KVCacheConfig`` that ``generate`` takes."""

from pathlib import Path

import pytest

from megatron_cascade.config import ConfigError, load_config
from megatron_cascade.rollout import KVCacheConfig

TINY = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml")


@pytest.mark.parametrize("override,message", [
    ("rollout.kv_cache_bytes=0", r"rollout.kv_cache_bytes=0 must be > 0"),
    ("rollout.kv_cache_fraction=1.5", r"rollout.kv_cache_fraction=1.5 must be in \(0, 1\]"),
    ("rollout.kv_block_size_tokens=0", r"rollout.kv_block_size_tokens=0 must be >= 1"),
])
def test_bad_kv_cache_keys_are_refused_at_load(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, [override], check_paths=False)


def test_kv_cache_keys_reach_generate():
    cfg = load_config(TINY, ["rollout.kv_cache_bytes=4096", "rollout.kv_block_size_tokens=16"], check_paths=False)
    assert KVCacheConfig.from_rollout(cfg.rollout) == KVCacheConfig(kv_cache_bytes=4096, block_size_tokens=16)
    assert KVCacheConfig.from_rollout(load_config(TINY, check_paths=False).rollout) == KVCacheConfig()


@pytest.mark.parametrize("kwargs,message", [
    ({"kv_cache_bytes": -1}, "rollout.kv_cache_bytes"),
    ({"kv_cache_fraction": 0.0}, "rollout.kv_cache_fraction"),
    ({"block_size_tokens": 0}, "rollout.kv_block_size_tokens"),
])
def test_kv_cache_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**kwargs)
