"""What a run checks before it touches ``output_dir`` or takes a step: everything it will need later.

A typo in a later stage's data file used to surface when that stage started (20-40 minutes into the
demo, hours into a real cascade), and ``--stage`` was checked only after the output folder existed.
``preflight`` reads, for every stage still to run, each domain's data file (it opens, and its first
rows parse as the stage needs them: prompts, references for SFT, what the domain's environment
needs, e.g. tools the config maps), the eval files, the
``init_checkpoint`` folder, and with ``--stage`` the stage's name and the earlier stages it starts
from or distils from; every problem goes into one ``ConfigError``.
"""

from __future__ import annotations

import itertools
import os
from typing import Optional

from megatron_cascade.stages.prompt_data import DataError, RowCheck, parse_rows
from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.config import ConfigError, RunConfig
from megatron_cascade.config.origins import ConfigOrigins
from megatron_cascade.config.schema import DomainConfig
from megatron_cascade.config.loader import start_stage
from megatron_cascade.environments.settings import domain_row_check
from megatron_cascade.stages import stage_class

ROWS_CHECKED = 100  # rows of each data file parsed up front (the whole file is read when its stage starts)


def preflight(cfg: RunConfig, tokenizer, only_stage: Optional[str] = None,
              origins: Optional[ConfigOrigins] = None) -> None:
    """Raise one ``ConfigError`` listing every problem found (nothing is written anywhere), each
    about a config value led by where that value came from (``origins``: an override or file:line)."""
    origins = origins or ConfigOrigins("config")
    names = [s.name for s in cfg.stages]
    problems: list[str] = []
    if only_stage is not None and only_stage not in names:
        problems.append(f"--stage {only_stage!r}: no such stage (stages: {names})")
    manifest = Manifest(cfg.output_dir)
    to_run = [i for i, s in enumerate(cfg.stages) if not manifest.is_complete(s.name)
              and (only_stage is None or s.name == only_stage)]
    if only_stage is not None:
        problems += _missing_predecessors(cfg, manifest, to_run)
    # (domain, its key naming the file) -> (whether rows need a reference response, whether they start episodes)
    reads: dict[tuple[str, str], tuple[bool, bool]] = {}
    for index in to_run:
        kind = stage_class(cfg.stages[index].type)
        for domain in cfg.stages[index].domains:
            key = (domain, _data_key(cfg.domains[domain], kind.data_path(cfg.domains[domain])))
            response, episodes = reads.get(key, (False, False))
            reads[key] = (response or kind.needs_response, episodes or kind.runs_episodes)
    reads.update({(domain, "eval"): (False, True) for domain, spec in cfg.domains.items() if spec.eval})
    checks: dict[str, Optional[RowCheck]] = {}  # per domain whose rows start episodes: its environment's check
    for domain in sorted({domain for (domain, _), (_, episodes) in reads.items() if episodes}):
        try:
            checks[domain] = domain_row_check(domain, cfg.domains[domain])
        except ConfigError as exc:
            problems.append(origins.lead(f"domains.{domain}.environment.name", str(exc)))
    for (domain, field_name), (need_response, episodes) in sorted(reads.items()):
        key = f"domains.{domain}.{field_name}"
        problems += [origins.lead(key, f"{key}: {problem}") for problem in _file_problems(
            getattr(cfg.domains[domain], field_name), domain, tokenizer, cfg, need_response,
            checks.get(domain) if episodes else None)]
    if 0 in to_run and cfg.init_checkpoint and not os.path.isdir(cfg.init_checkpoint):
        problems.append(origins.lead("init_checkpoint", f"init_checkpoint: folder {cfg.init_checkpoint} does not exist"))
    if problems:
        raise ConfigError("the run cannot start; nothing was written:\n  - " + "\n  - ".join(problems))


def _data_key(domain: DomainConfig, path: str) -> str:
    """The field of ``domain`` that names ``path`` (``sft`` before ``train``: an SFT stage's own file)."""
    return next(name for name in ("sft", "train") if getattr(domain, name) == path)


def _missing_predecessors(cfg: RunConfig, manifest: Manifest, to_run: list[int]) -> list[str]:
    """``--stage``: the stages it starts from (``init_from``, default the previous one) or distils from
    that are not complete in ``output_dir``."""
    names = {s.name for s in cfg.stages}
    problems = []
    for index in to_run:
        stage = cfg.stages[index]
        needed = [name for name in [start_stage(cfg, index)] if name is not None]
        needed += [t for t in stage.teachers.values() if t in names]
        for name in dict.fromkeys(needed):
            if not manifest.is_complete(name):
                problems.append(f"--stage {stage.name}: it needs stage {name!r} complete in {cfg.output_dir} "
                                f"(run the cascade without --stage, or that stage first)")
    return problems


def _file_problems(path: str, domain: str, tokenizer, cfg: RunConfig, need_response: bool,
                   check_row: Optional[RowCheck]) -> list[str]:
    """Why the first ``ROWS_CHECKED`` rows of ``path`` cannot be used (empty list: they can), as
    data and by ``check_row`` (the domain environment's, e.g. a tool the config does not map)."""
    try:
        rows = list(itertools.islice(parse_rows(path, domain, tokenizer, need_response=need_response,
                                                max_prompt_tokens=cfg.data.max_prompt_tokens, check_row=check_row),
                                     ROWS_CHECKED))
    except DataError as exc:
        return [str(exc)]
    bad = [error for error in rows if isinstance(error, DataError)]
    if bad and (cfg.data.on_bad_row == "error" or len(bad) == len(rows)):
        return [f"{bad[0]}" + (f" ({len(bad)} of the first {len(rows)} rows bad)" if len(bad) > 1
                                                 else "")]
    if not rows:
        return [f"{path} has no rows"]
    return []
