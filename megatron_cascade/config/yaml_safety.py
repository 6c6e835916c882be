"""What a config file may make the loader do: a shared recipe is input, not code.

* **Size.** YAML aliases expand: ten nested levels of ten references are 10^10 nodes from 300
  characters (a command-line override of that shape took 98 s to load, x10 per level). Every file and
  every override is composed first and refused past ``MAX_YAML_NODES`` nodes once aliases are expanded
  (a real config has a few hundred); an override is also refused past ``MAX_OVERRIDE_CHARS``.
* **Includes.** ``defaults: [...]`` may name files inside the top-level config's folder, inside the
  recipes shipped with this package (``examples/`` of the checkout: as trusted as its code; the
  Nemotron-3-Nano recipe includes ``../base.yaml``), or inside a folder the operator lists in
  ``$MEGATRON_CASCADE_CONFIG_INCLUDE_DIRS`` (``os.pathsep``-separated) — never ``/``-absolute or
  ``../`` paths elsewhere on the machine on a recipe's say-so.
* **Resolvers.** OmegaConf's ``${oc.env:VAR}`` reads the environment when the config is resolved: a
  shared recipe could send ``HF_TOKEN`` to a reward server and record it in the run folder's
  ``config.yaml``. Only variables the operator lists in ``$MEGATRON_CASCADE_CONFIG_ENV`` (comma-separated)
  may be read, never one whose name looks like a secret (``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``,
  ``CREDENTIAL``); every other resolver (``oc.decode``, ``oc.create``, ...) is refused. Plain references
  to other keys (``${rollout.temperature}``) stay.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from megatron_cascade.config.rules import ConfigError

MAX_YAML_NODES = 20_000
MAX_OVERRIDE_CHARS = 65_536
CONFIG_INCLUDE_DIRS_VAR = "MEGATRON_CASCADE_CONFIG_INCLUDE_DIRS"
CONFIG_ENV_VAR = "MEGATRON_CASCADE_CONFIG_ENV"
SHIPPED_RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))),
                               "examples")
_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL", re.IGNORECASE)
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*:([^}]*)\}?")


def check_yaml_size(text: str, source: str) -> None:
    """Refuse YAML ``text`` that expands past ``MAX_YAML_NODES`` nodes (``ConfigError`` naming ``source``).
    Composing is linear in the text (an alias is a reference); the count expands each alias."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return  # the caller's parser reports the syntax error in its own words
    memo: dict[int, int] = {}
    try:
        nodes = _expanded_nodes(root, memo) if root is not None else 0
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested too deep") from None
    if nodes > MAX_YAML_NODES:
        raise ConfigError(f"{source}: YAML expands to {nodes:,} nodes with its aliases "
                          f"(at most {MAX_YAML_NODES:,}); a config is not that large")


def _expanded_nodes(node: yaml.Node, memo: dict[int, int]) -> int:
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, yaml.MappingNode):
        count = 1 + sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        count = 1 + sum(_expanded_nodes(item, memo) for item in node.value)
    else:
        count = 1
    memo[id(node)] = count
    return count


def parse_override_value(item: str, text: str) -> Any:
    """The YAML value of the command-line override ``item`` (``key=text``), bounded in size; text that
    is not YAML stays a string."""
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError(f"command-line override {item[:60]!r}...: value of {len(text):,} characters "
                          f"(at most {MAX_OVERRIDE_CHARS:,})")
    if text == "":
        return ""
    check_yaml_size(text, f"command-line override {item[:200]!r}")
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def include_path(includer: str, include: Any, top_folder: str) -> str:
    """The file a ``defaults`` entry of ``includer`` names (relative to the includer's folder), if it
    lies inside ``top_folder``, the shipped recipes or a folder listed in
    ``$MEGATRON_CASCADE_CONFIG_INCLUDE_DIRS``."""
    if not isinstance(include, str) or not include:
        raise ConfigError(f"{includer}: 'defaults' entries must be file names, got {include!r}")
    path = os.path.realpath(os.path.join(os.path.dirname(includer), include))
    allowed = [os.path.realpath(top_folder), SHIPPED_RECIPES] + [
        os.path.realpath(d) for d in os.environ.get(CONFIG_INCLUDE_DIRS_VAR, "").split(os.pathsep) if d]
    if not any(os.path.commonpath([path, folder]) == folder for folder in allowed):
        raise ConfigError(f"{includer}: 'defaults' entry {include!r} is outside the config's folder "
                          f"{os.path.realpath(top_folder)}; to allow it, add its folder to ${CONFIG_INCLUDE_DIRS_VAR}")
    return path


def check_interpolations(container: Any, source: str, key: str = "") -> None:
    """Refuse resolver interpolations in the unresolved config ``container`` (plain containers from
    ``OmegaConf.to_container(resolve=False)``) except ``oc.env`` of an operator-allowed variable."""
    if isinstance(container, dict):
        for k, v in container.items():
            check_interpolations(v, source, f"{key}.{k}" if key else str(k))
    elif isinstance(container, list):
        for i, v in enumerate(container):
            check_interpolations(v, source, f"{key}[{i}]")
    elif isinstance(container, str) and "${" in container:
        allowed = {v.strip() for v in os.environ.get(CONFIG_ENV_VAR, "").split(",") if v.strip()}
        for name, argument in _RESOLVER.findall(container):
            variable = argument.split(",", 1)[0].strip()
            if name != "oc.env":
                raise ConfigError(f"{source}: {key}: resolver '${{{name}:...}}' is not allowed in a config "
                                  "(only references to other keys, and oc.env of allowed variables)")
            if "$" in variable or variable not in allowed or _SECRET_NAME.search(variable):
                why = ("its name looks like a secret: pass secrets by name (e.g. api_key_env), never by value"
                       if _SECRET_NAME.search(variable) else
                       f"to allow it, list it in ${CONFIG_ENV_VAR} (comma-separated)")
                raise ConfigError(f"{source}: {key}: '${{oc.env:{variable}}}' reads the environment; {why}")
