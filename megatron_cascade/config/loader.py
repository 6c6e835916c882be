"""Load a run config: YAML (with ``defaults`` includes and ``${...}`` interpolation, within the bounds
of ``config.yaml_safety``), command-line ``key.sub=value`` overrides, and validation against the
schema (unknown keys and wrong types are errors naming the file, the key and a hint). Choices are
enums of the schema, refused by OmegaConf when the YAML is merged; every field's range and every
section's own rules (``config.rules``) are checked by ``validate_run``, which adds the rules between
sections."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, Iterable, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_cascade.config.origins import ConfigOrigins
from megatron_cascade.config.rules import ConfigError, field_problems, validate_tree
from megatron_cascade.config.schema import ResolvedStage, RolloutConfig, RunConfig, StageConfig
from megatron_cascade.config.unknown_keys import key_lines, unknown_keys
from megatron_cascade.config.training import (
    LossConfig, OptimizerConfig, TrainingConfig, validate_optimizer_config,
)
from megatron_cascade.config.yaml_safety import (
    check_interpolations, check_yaml_size, include_path, parse_override_value,
)
from megatron_cascade.config.stage_types import STAGE_TYPES, stage_type

_STAGE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# The key a validation error is about: "stages[1].steps=0 ...", "stages[1] (if_rl): rollout.top_p=2 ...".
_VALUE_KEY = re.compile(r"(?:stages\[(\d+)\](?: \([^)]*\))?(?::\s*|\.))?([A-Za-z_][\w.]*)=")
_MORE_KEYS = re.compile(r"(?<![\w.'\"])([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+)=")
_ENUM_REFUSAL = re.compile(r"Invalid value '(.*)', expected one of \[(.*)\]")
_STAGE_SECTIONS = {"optimizer": OptimizerConfig, "loss": LossConfig, "training": TrainingConfig,
                   "rollout": RolloutConfig}


def load_config(path: str, overrides: Iterable[str] = (), *, check_paths: bool = True) -> RunConfig:
    """Read ``path`` (and its ``defaults`` includes), apply ``key=value`` overrides, validate.

    Relative data paths in the file are resolved against the file's folder. ``check_paths=False``
    (dry runs) does not require checkpoint folders named in the config to exist on this machine.
    Raises ``ConfigError`` with the file, key and a hint.
    """
    return load_config_with_origins(path, overrides, check_paths=check_paths)[0]


def load_config_with_origins(path: str, overrides: Iterable[str] = (), *,
                             check_paths: bool = True) -> tuple[RunConfig, ConfigOrigins]:
    """As :func:`load_config`, with where each value came from (for errors found later, e.g. the
    run's preflight of data files)."""
    top = os.path.abspath(path)
    texts: list[tuple[str, str]] = []  # (file, its YAML) in merge order
    raw = _read_with_includes(top, seen=(), top_folder=os.path.dirname(top), texts=texts)
    _refuse_unknown_keys(raw, texts, shown=path if len(texts) == 1 else None)
    schema = OmegaConf.structured(RunConfig)
    merged = _merge(schema, raw, source=path)
    origins = ConfigOrigins(path, tuple(texts), {_apply_override(merged, item): item for item in overrides})
    check_interpolations(OmegaConf.to_container(merged, resolve=False), source=path)
    try:
        cfg: RunConfig = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, path) from None
    try:
        validate_run(cfg, source=path, check_paths=check_paths)
    except ConfigError as exc:
        lines = [_with_origin(line, path, origins) for line in str(exc).splitlines()]
        raise ConfigError(lines[0] if len(lines) == 1
                          else f"{len(lines)} bad config values:\n  " + "\n  ".join(lines)) from None
    return cfg, origins


def _with_origin(message: str, path: str, origins: ConfigOrigins) -> str:
    """``message`` (``"<path>: <key>=<value> ..."``) led by where the value came from: the
    command-line override that set it, else the ``file:line`` that wrote it (else ``path``)."""
    rest = message[len(path) + 2:] if message.startswith(f"{path}: ") else message
    match = _VALUE_KEY.match(rest)
    if match is None:
        return message
    stage = f"stages.{match.group(1)}." if match.group(1) else ""
    # Every "key=" of the message (a rule between keys names several): an overridden one is to blame.
    keys = [stage + match.group(2)] + [key if key.startswith("model.") else stage + key  # the model is run-wide
                                       for key in _MORE_KEYS.findall(rest[match.end():])]
    for key in keys:
        origin = origins.of(key)
        if origin is not None and origin.startswith("command-line override"):
            return f"{origin}: {rest}"
    origin = origins.of(keys[0])
    return message if origin is None else f"{origin}: {rest}"


def _refuse_unknown_keys(raw: DictConfig, texts: list[tuple[str, str]], shown: Optional[str]) -> None:
    """One ``ConfigError`` naming every unknown key of the YAML files, each at its ``file:line``
    (``shown`` names the one file as the user wrote it)."""
    found = unknown_keys(OmegaConf.to_container(raw, resolve=False), RunConfig, dict_sections=_STAGE_SECTIONS)
    if not found:
        return
    lines = [(shown or file, key_lines(text)) for file, text in texts]
    problems = []  # (file's merge order, line, message): reported in the order they were written
    for key_path, hint in found:
        index, file, line = next(((i, file, at[key_path]) for i, (file, at) in reversed(list(enumerate(lines)))
                                  if key_path in at), (len(lines) - 1, lines[-1][0], 0))
        where = f"{file}:{line}" if line else file
        problems.append((index, line, f"{where}: unknown config key '{'.'.join(key_path)}'{hint}"))
    problems = [message for _, _, message in sorted(problems)]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    raise ConfigError(f"{len(problems)} unknown config keys:\n  " + "\n  ".join(problems))


def _read_with_includes(path: str, seen: tuple, top_folder: str, texts: list[tuple[str, str]]) -> DictConfig:
    if path in seen:
        raise ConfigError(f"{path}: 'defaults' includes form a cycle: {' -> '.join(seen + (path,))}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        check_yaml_size(text, path)
        node = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    includes = node.pop("defaults", [])
    if not isinstance(includes, (list, ListConfig)):
        raise ConfigError(f"{path}: 'defaults' must be a list of YAML files to merge first")
    _absolutize_paths(node, os.path.dirname(path))
    base = OmegaConf.create({})
    for include in includes:
        child = include_path(path, include, top_folder)
        base = OmegaConf.merge(base, _read_with_includes(child, seen + (path,), top_folder, texts))
    texts.append((path, text))
    return OmegaConf.merge(base, node)


def _absolutize_paths(node: DictConfig, base: str) -> None:
    """Make the file paths a YAML file names relative to that file's own folder (not the includer's).

    Paths: ``domains.*.train/eval/sft``, ``init_checkpoint``, and teacher values containing a '/'
    (a bare word is a stage name; write ``./folder`` for a folder next to the file).
    """
    def fix(value):
        if isinstance(value, str) and value and "${" not in value and not os.path.isabs(value):
            return os.path.normpath(os.path.join(base, value))
        return value

    for domain in (node.get("domains") or {}).values():
        if isinstance(domain, DictConfig):
            for key in ("train", "eval", "sft"):
                if key in domain:
                    domain[key] = fix(domain[key])
    if node.get("init_checkpoint"):
        node["init_checkpoint"] = fix(node["init_checkpoint"])
    for stage in node.get("stages") or []:
        teachers = stage.get("teachers") if isinstance(stage, DictConfig) else None
        for domain, teacher in (teachers or {}).items():
            if isinstance(teacher, str) and "/" in teacher:
                teachers[domain] = fix(teacher)


def _merge(schema: DictConfig, raw: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(schema, raw)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, source) from None


def _apply_override(cfg: DictConfig, item: str) -> str:
    """Apply ``key=value``; returns the key with stages by index (``stages.1.steps``)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, text = item.split("=", 1)
    key = _stage_key_by_name(cfg, key.strip())
    value = parse_override_value(item, text)
    try:
        _open_stage_section(cfg, key)
        _open_optional_sections(cfg, key)
        OmegaConf.update(cfg, key, value, merge=True)
    except OmegaConfBaseException as exc:
        raise _config_error(exc, f"command-line override {item!r}") from None
    return key


def _open_stage_section(cfg: DictConfig, key: str) -> None:
    """``stages.N.optimizer.lr=...`` on a stage without an optimizer section: start it empty."""
    parts = key.split(".")
    if len(parts) >= 4 and parts[0] == "stages" and parts[1].isdigit() and parts[2] in _STAGE_SECTIONS:
        stage = cfg.stages[int(parts[1])]
        if stage[parts[2]] is None:
            stage[parts[2]] = {}


def _open_optional_sections(cfg: DictConfig, key: str) -> None:
    """``rollout.parallel.tensor_model_parallel_size=1`` while ``rollout.parallel`` is null (an
    optional section, e.g. no decode layout): start the section at its defaults first."""
    parts = key.split(".")
    node = cfg
    for part in parts[:-1]:
        if not isinstance(node, DictConfig) or part not in node:
            return
        if node[part] is None:
            section = node._get_node(part)._metadata.ref_type  # the schema's dataclass of the section
            if not is_dataclass(section):
                return
            node[part] = section()
        node = node[part]


def _stage_key_by_name(cfg: DictConfig, key: str) -> str:
    """``stages.<name>.x`` -> ``stages.<index>.x`` so stages can be addressed by name."""
    parts = key.split(".")
    if len(parts) < 2 or parts[0] != "stages" or parts[1].isdigit():
        return key
    names = [stage.name for stage in cfg.stages]
    if parts[1] not in names:
        raise ConfigError(f"override {key!r}: no stage named {parts[1]!r} (stages: {names})")
    return ".".join(["stages", str(names.index(parts[1])), *parts[2:]])


def _config_error(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    message = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
    if _bad_choice(message):
        return ConfigError(f"{source}: {key}={_bad_choice(message)}")
    unknown_key = " not in " in message
    hint = _hint_for(key) if unknown_key and "Did you mean" not in message else ""
    return ConfigError(f"{source}: config key '{key}': {message}{hint}")


def _bad_choice(message: str) -> str:
    """OmegaConf's refusal of a value outside a ``Choice`` enum, in the words of ``config.rules``
    (``'clip' is not one of [...]``); empty for any other message."""
    match = _ENUM_REFUSAL.fullmatch(message)
    return f"{match.group(1)!r} is not one of {match.group(2).split(', ')}" if match else ""


def _hint_for(full_key: str) -> str:
    """'did you mean ...' from the schema fields next to the bad key."""
    parts = [p for p in re.split(r"[.\[\]]", full_key) if p]
    node: Any = RunConfig
    for part in parts[:-1]:
        if part.isdigit() and node is RunConfig:
            continue
        node = _field_type(node, part)
        if node is None:
            return ""
    if not (is_dataclass(node) and parts):
        return ""
    names = [f.name for f in fields(node)]
    close = difflib.get_close_matches(parts[-1], names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (known keys: {', '.join(names)})"


def _field_type(node: Any, name: str) -> Any:
    if name.isdigit():
        return StageConfig if node is RunConfig else None
    if not is_dataclass(node):
        return None
    for f in fields(node):
        if f.name == name:
            if name == "stages":
                return RunConfig  # list of StageConfig: the next part is an index
            default = f.default_factory() if callable(f.default_factory) else None  # type: ignore[misc]
            return type(default) if is_dataclass(default) else None
    return None


def validate_run(cfg: RunConfig, source: str = "config", check_paths: bool = True) -> None:
    """Every field's declared range (all problems in one ``ConfigError``, a line each) and every
    section's own rules (``config.rules``), then the checks between sections and stages;
    ``ConfigError`` naming ``source`` and the key."""
    problems = [f"{source}: {problem}" for problem in field_problems(cfg)]
    for index, stage in enumerate(cfg.stages):
        problems += [f"{source}: stages[{index}] ({stage.name}): {problem}"
                     for problem in _stage_override_problems(cfg, stage)]
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        validate_tree(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not cfg.stages:
        raise ConfigError(f"{source}: 'stages' is empty: a run needs at least one stage")
    if cfg.eval.max_new_tokens is not None and cfg.eval.max_new_tokens >= cfg.model.max_position_embeddings:
        raise ConfigError(f"{source}: eval.max_new_tokens={cfg.eval.max_new_tokens} leaves no room for the prompt "
                          f"in model.max_position_embeddings={cfg.model.max_position_embeddings}")
    seen: list[str] = []
    for index, stage in enumerate(cfg.stages):
        where = f"{source}: stages[{index}] ({stage.name})"
        if not _STAGE_NAME.match(stage.name):
            raise ConfigError(f"{where}: name must be letters, digits, '_', '-' or '.', got {stage.name!r}")
        if stage.name in seen:
            raise ConfigError(f"{where}: stage name {stage.name!r} is used twice")
        if stage.type not in STAGE_TYPES:
            raise ConfigError(f"{where}: type={stage.type!r} is not one of {sorted(STAGE_TYPES)}")
        if not stage.domains:
            raise ConfigError(f"{where}: 'domains' is empty: name the domains (and weights) this stage trains on")
        for domain in stage.domains:
            if domain not in cfg.domains:
                raise ConfigError(f"{where}: domain {domain!r} is not defined under 'domains' "
                                  f"(defined: {sorted(cfg.domains)})")
            if cfg.domains[domain].train is None:
                raise ConfigError(f"{where}: domain {domain!r} has no 'train' file")
        _validate_teachers(stage, seen, where, check_paths)
        if stage.init_from is not None and stage.init_from not in seen:
            raise ConfigError(f"{where}: init_from={stage.init_from!r} is not an earlier stage (earlier: {seen})")
        seen.append(stage.name)
        try:
            resolved = resolve_stage(cfg, stage)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        _validate_sections(cfg, resolved, where)


def _stage_override_problems(cfg: RunConfig, stage: StageConfig) -> list[str]:
    """Declared-range problems of the values a stage's own sections set (those it inherits are the
    run's, reported once there); none when the sections do not merge (reported later, by key)."""
    try:
        resolved = resolve_stage(cfg, stage)
    except ConfigError:
        return []
    problems = []
    for name in _STAGE_SECTIONS:
        own = getattr(stage, name) or {}
        for problem in field_problems(getattr(resolved, name), f"{name}."):
            node: Any = own
            for part in problem.split("=", 1)[0].split(".")[1:]:
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None:
                problems.append(problem)
    return problems


def _validate_sections(cfg: RunConfig, stage: ResolvedStage, where: str) -> None:
    """A stage's merged sections: each field's range and section rules (its overrides may break
    them), and the rules between them and the run's model."""
    try:
        validate_optimizer_config(stage.optimizer, cfg.model)
        for name in ("loss", "training", "rollout"):
            validate_tree(getattr(stage, name), f"{name}.")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if stage.rollout.max_new_tokens >= cfg.model.max_position_embeddings:
        raise ConfigError(f"{where}: rollout.max_new_tokens={stage.rollout.max_new_tokens} leaves no room for the "
                          f"prompt in model.max_position_embeddings={cfg.model.max_position_embeddings}")
    if stage.rollout.dynamic_sampling_max_rounds > 1 and not stage_type(stage.type).groups:
        raise ConfigError(f"{where}: rollout.dynamic_sampling_max_rounds > 1 refills filtered response groups; "
                          f"a {stage.type} stage has none (only {[n for n, e in STAGE_TYPES.items() if e.groups]})")


def _validate_teachers(stage: StageConfig, earlier: list[str], where: str, check_paths: bool) -> None:
    if not stage_type(stage.type).teachers:
        if stage.teachers:
            raise ConfigError(f"{where}: 'teachers' is only used by stage types that distill from teachers "
                              f"({[name for name, entry in STAGE_TYPES.items() if entry.teachers]}); "
                              f"this one is {stage.type}")
        return
    for domain in stage.domains:
        if domain not in stage.teachers:
            raise ConfigError(f"{where}: {stage.type} needs a teacher for domain {domain!r} "
                              f"(teachers.{domain}: <stage name>)")
    for domain, teacher in stage.teachers.items():
        if domain not in stage.domains:
            raise ConfigError(f"{where}: teachers.{domain}: the stage does not train on domain {domain!r}")
        if "/" in teacher:
            if check_paths and not os.path.isdir(teacher):
                raise ConfigError(f"{where}: teachers.{domain}: checkpoint folder {teacher} does not exist")
        elif teacher not in earlier:
            raise ConfigError(f"{where}: teachers.{domain}={teacher!r} is neither an earlier stage "
                              f"(earlier: {earlier}) nor a checkpoint folder")


def start_stage(cfg: RunConfig, index: int) -> Optional[str]:
    """The earlier stage whose final weights stage ``index`` starts from: its ``init_from``, default the
    previous stage; None for the first stage (it starts from ``init_checkpoint``)."""
    if index == 0:
        return None
    return cfg.stages[index].init_from or cfg.stages[index - 1].name


def resolve_stage(cfg: RunConfig, stage: StageConfig) -> ResolvedStage:
    """Merge the stage's override sections over the run-level sections (type-checked)."""
    sections = {}
    for name, cls in _STAGE_SECTIONS.items():
        base = OmegaConf.structured(getattr(cfg, name))
        override = getattr(stage, name) or {}
        try:
            sections[name] = OmegaConf.to_object(OmegaConf.merge(base, override))
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", "?")
            message = str(getattr(exc, "msg", exc)).splitlines()[0]
            if _bad_choice(message):
                raise ConfigError(f"stage {stage.name!r}: {name}.{key}={_bad_choice(message)}") from None
            hint = "" if "Did you mean" in message else _close(str(key), cls)
            raise ConfigError(f"stage {stage.name!r}: '{name}.{key}': {message}{hint}") from None
    return ResolvedStage(stage.name, stage.type, stage.steps, stage.prompts_per_step, stage.samples_per_prompt,
                         dict(stage.domains), dict(stage.teachers), **sections, init_from=stage.init_from)


def _close(key: str, cls: type) -> str:
    names = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(key.split(".")[-1], names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def to_yaml(cfg: RunConfig) -> str:
    """The fully resolved config as YAML (saved into the run directory)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
