"""Resume safety: compare a run's resolved config with the one its directory records (``config.yaml``).

What a run has computed so far depends on the seed, tokenizer (and its chat-template arguments), model, start weights, data handling,
reward handling, and on the resolved settings of every *started* stage (complete, or holding a
checkpoint), including its place in the stage order (stage seeds and start weights follow from it);
once a stage is complete, its evaluation too. A change to any of these is refused unless the user
names it (``--allow-config-change``); stages that have not started, appended stages and settings of
how a run executes (``FREE_KEYS``) may change freely.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_cascade.cascade.manifest import Manifest, checkpoint_root
from megatron_cascade.config import ConfigError, RunConfig, resolve_stage
from megatron_cascade.config.stage_types import stage_type
from megatron_cascade.training.resume_checkpoint import read_latest

RECORDED_CONFIG = "config.yaml"

# Where and how a run executes, not what it computes: the parallel layout (checkpoints load at any
# layout), checkpoint cadence, logging, collective timeouts, dry-run cluster sizing, activation
# recompute, the KV-cache memory budget and admission of generation, parking the training state
# while generating. Keys relative to the run (or to a stage).
FREE_KEYS = ("output_dir", "parallel", "checkpoint", "distributed", "logging", "cluster", "model.recompute",
             "model.recompute_num_layers", "rollout.kv_cache_bytes", "rollout.kv_cache_fraction",
             "rollout.kv_block_size_tokens", "rollout.expected_response_fraction",
             "rollout.adapt_expected_response_fraction", "rollout.parallel", "rollout.offload_training_state")
# Run-level keys that shape every started stage (their sections under a stage are compared resolved).
# chat_template_kwargs change every rendered prompt (enable_thinking), like the tokenizer itself.
_RUN_KEYS = ("seed", "tokenizer", "chat_template_kwargs", "init_checkpoint", "model", "data", "rewards")
# What evaluation after a stage reads besides ``eval`` and the eval domains.
_EVAL_ROLLOUT_KEYS = ("rollout.max_new_tokens", "rollout.stop_strings")


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs from the recorded config (``key``: dotted; stages by name)."""

    key: str
    recorded: Any
    now: Any

    def allowed_by(self, allowed: Iterable[str]) -> bool:
        """``allowed`` names this key, a section above it, or (for ``stages.<name>.x``) the stage-relative ``x``."""
        names = [self.key]
        parts = self.key.split(".")
        if parts[0] == "stages" and len(parts) > 2:
            names.append(".".join(parts[2:]))
        return any(n == a or n.startswith(a + ".") for n in names for a in allowed)

    def __str__(self) -> str:
        return f"{self.key}: {self.recorded!r} -> {self.now!r}"


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _free(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_KEYS)


def _diff(recorded: dict, now: dict, prefix: str, relative_to: str = "") -> list[ConfigChange]:
    """Differences of two nested dicts, free keys left out (judged relative to ``relative_to``)."""
    a, b = _flatten(recorded, prefix), _flatten(now, prefix)
    changes = []
    for key in sorted(set(a) | set(b)):
        if _free(key[len(relative_to):] if relative_to and key.startswith(relative_to) else key):
            continue
        if a.get(key) != b.get(key):
            changes.append(ConfigChange(key, a.get(key), b.get(key)))
    return changes


def _unread_keys(kind: str) -> tuple[str, ...]:
    """Stage-relative keys a stage of type ``kind`` never reads (from the stage registry): sampling
    settings of a stage that does not generate, loss settings and G of supervised (NLL) stages."""
    entry = stage_type(kind)
    unread = () if entry.generates else ("rollout", "samples_per_prompt")
    return unread + (("loss",) if entry.loss == "sft" else ())  # the NLL reads no loss setting


def _stage_changes(recorded: RunConfig, now: RunConfig, stage, now_stage) -> list[ConfigChange]:
    """A started stage's resolved settings, recorded vs now, left out what its type never reads."""
    prefix = f"stages.{stage.name}"
    was, becomes = asdict(resolve_stage(recorded, stage)), asdict(resolve_stage(now, now_stage))
    if stage.type == now_stage.type:
        for key in _unread_keys(stage.type):
            was.pop(key, None)
            becomes.pop(key, None)
    return _diff(was, becomes, prefix, relative_to=prefix + ".")


def read_recorded_config(output_dir: str) -> Optional[RunConfig]:
    """The config ``output_dir`` records, with defaults for keys added since; None when there is none."""
    path = os.path.join(output_dir, RECORDED_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ConfigError(f"{path}: the config this run was started with cannot be read "
                          f"({str(exc).splitlines()[0]}); restore it or start in a new output_dir") from None


def started_stages(output_dir: str, names: Sequence[str]) -> list[str]:
    """The stages of ``names`` whose work persists in ``output_dir``: complete, or with a checkpoint."""
    manifest = Manifest(output_dir)
    return [n for n in names
            if manifest.is_complete(n) or read_latest(checkpoint_root(output_dir, n)) is not None]


def result_changes(recorded: RunConfig, now: RunConfig, started: Sequence[str], evaluated: bool) -> list[ConfigChange]:
    """The changes from ``recorded`` to ``now`` that alter what the ``started`` stages computed (and,
    when ``evaluated`` (a stage is complete), what evaluation reports)."""
    if not started:
        return []
    old, new = asdict(recorded), asdict(now)
    changes = [c for key in _RUN_KEYS for c in _diff({key: old[key]}, {key: new[key]}, "")]
    recorded_names = [s.name for s in recorded.stages]
    now_names = [s.name for s in now.stages]
    depth = max(recorded_names.index(n) for n in started) + 1
    if now_names[:depth] != recorded_names[:depth]:  # a started stage moved, or one was put before it
        changes.append(ConfigChange("stages", recorded_names, now_names))
    now_by_name = {s.name: s for s in now.stages}
    used = set()
    for stage in recorded.stages:
        if stage.name not in started:
            continue
        used |= set(stage.domains)
        if stage.name in now_by_name:
            changes += _stage_changes(recorded, now, stage, now_by_name[stage.name])
    if evaluated and (old["eval"]["enabled"] or new["eval"]["enabled"]):  # scores in the manifest would mix
        changes += _diff({"eval": old["eval"]}, {"eval": new["eval"]}, "")
        for key in _EVAL_ROLLOUT_KEYS:
            section, name = key.split(".")
            if old[section][name] != new[section][name]:
                changes.append(ConfigChange(key, old[section][name], new[section][name]))
        used |= {d for cfg in (old, new) for d, spec in cfg["domains"].items() if spec["eval"]}
    for domain in sorted(used):
        changes += _diff({domain: old["domains"].get(domain)}, {domain: new["domains"].get(domain)}, "domains")
    return changes


def check_resume(cfg: RunConfig, allowed: Sequence[str] = ()) -> list[ConfigChange]:
    """Compare ``cfg`` with the config recorded in ``cfg.output_dir``; return the changes that alter the
    result and ``allowed`` names (the caller records them), or raise ``ConfigError`` naming the others.

    ``allowed``: dotted keys; a key allows its sub-keys, and ``optimizer.lr`` allows
    ``stages.<any>.optimizer.lr``. Nothing recorded (a new run) or nothing started: no changes.
    """
    recorded = read_recorded_config(cfg.output_dir)
    if recorded is None:
        return []
    started = started_stages(cfg.output_dir, [s.name for s in recorded.stages])
    evaluated = any(Manifest(cfg.output_dir).is_complete(n) for n in started)
    changes = result_changes(recorded, cfg, started, evaluated)
    refused = [c for c in changes if not c.allowed_by(allowed)]
    if refused:
        lines = "\n".join(f"  {c}" for c in refused)
        keys = ",".join(c.key for c in refused)
        raise ConfigError(
            f"{os.path.join(cfg.output_dir, RECORDED_CONFIG)} records the config this run was started with, and "
            f"resuming with this one would change what its started stages ({', '.join(started)}) computed:\n"
            f"{lines}\nRestore these values, use a new output_dir, or accept the change with "
            f"--allow-config-change {keys} (recorded in manifest.json)")
    return changes
