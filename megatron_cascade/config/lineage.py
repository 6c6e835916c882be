"""Which stages a stage's weights come from, and how much RL data they consumed.

A stage's final weights depend on the stage it starts from (``init_from``, default the previous
stage) and, for MOPD, on its teachers: the *lineage* is that closure. Two schedules are compared on
equal data (the cascade's end vs a mixed-RL baseline) when they sample as many responses per domain
over the RL stages of their lineages: :func:`rl_samples_per_domain`.
"""

from __future__ import annotations

from megatron_cascade.config.loader import start_stage
from megatron_cascade.config.rules import ConfigError
from megatron_cascade.config.schema import RunConfig

# Stage types that learn from sampled responses (an SFT stage trains on fixed rows).
_NOT_RL = ("sft",)


def stage_lineage(cfg: RunConfig, name: str) -> list[str]:
    """The stages whose final weights ``name``'s final weights depend on, ``name`` included, in run
    order: its start stage and its teachers that are stages of this run, recursively. A teacher
    given as a weights folder and the run's ``init_checkpoint`` are outside the run: not counted."""
    order = [s.name for s in cfg.stages]
    if name not in order:
        raise ConfigError(f"stage {name!r} is not in this run (stages: {order})")
    needed, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in needed:
            continue
        needed.add(current)
        index = order.index(current)
        start = start_stage(cfg, index)
        todo.extend([start] if start else [])
        todo.extend(t for t in cfg.stages[index].teachers.values() if t in order)
    return [s for s in order if s in needed]


def rl_samples_per_domain(cfg: RunConfig, names: list[str]) -> dict[str, float]:
    """Responses sampled per domain over the RL stages among ``names`` (expected counts: a stage's
    ``steps * prompts_per_step * samples_per_prompt`` split by its domain weights)."""
    by_name = {s.name: s for s in cfg.stages}
    samples: dict[str, float] = {}
    for name in names:
        stage = by_name[name]
        if stage.type in _NOT_RL:
            continue
        total = sum(stage.domains.values())
        for domain, weight in stage.domains.items():
            samples[domain] = samples.get(domain, 0.0) + (
                stage.steps * stage.prompts_per_step * stage.samples_per_prompt * weight / total)
    return samples
