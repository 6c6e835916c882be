"""Command line: ``megatron-cascade run|stages|eval|report|doctor|convert``.

    megatron-cascade run CONFIG [key=value ...] [--stage NAME] [--dry-run] [--allow-config-change KEY[,KEY]]
    megatron-cascade stages CONFIG [key=value ...]        # <stage>\t<complete|partial|pending>
    megatron-cascade eval CONFIG [key=value ...] [--weights DIR]
    megatron-cascade report OUTPUT_DIR
    megatron-cascade doctor [CONFIG [key=value ...]]      # versions, GPUs; what of CONFIG cannot run here
    megatron-cascade convert {hf-to-megatron,megatron-to-hf,reshard,nemo2-to-megatron,compare,inspect} ...

Distributed runs take RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the launcher (torchrun, or
slurm/stage.sbatch); without them a run is one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_cascade.config import ConfigError, RunConfig, load_config
from megatron_cascade.config.loader import load_config_with_origins
from megatron_cascade.run_logging import setup_console_logging


def _cmd_run(args: argparse.Namespace) -> int:
    cfg, origins = load_config_with_origins(args.config, args.overrides, check_paths=not args.dry_run)
    allowed = [key.strip() for item in args.allow_config_change for key in item.split(",") if key.strip()]
    if args.dry_run:
        from megatron_cascade.cascade.plan import describe_plan

        print(describe_plan(cfg))
        resume = _dry_run_resume_check(cfg, allowed)
        if resume:
            print(resume)
        return 0
    from megatron_cascade.cascade.runner import run_cascade

    return run_cascade(cfg, only_stage=args.stage, allow_config_change=allowed, origins=origins)


def _dry_run_resume_check(cfg: RunConfig, allowed: list[str]) -> str:
    """What a run would say about resuming in ``cfg.output_dir`` ("" for a new run; ``ConfigError`` if it
    would refuse); takes no lock and writes nothing."""
    from megatron_cascade.cascade.resume_check import check_resume, read_recorded_config

    if read_recorded_config(cfg.output_dir) is None:
        return ""
    changes = check_resume(cfg, allowed)
    if not changes:
        return f"resume: {cfg.output_dir}: no change to what its started stages computed"
    return (f"resume: {cfg.output_dir}: --allow-config-change accepts " + "; ".join(str(c) for c in changes))


def _cmd_stages(args: argparse.Namespace) -> int:
    from megatron_cascade.cascade.manifest import stage_status

    cfg = load_config(args.config, args.overrides)
    for stage in cfg.stages:
        print(f"{stage.name}\t{stage_status(cfg.output_dir, stage.name)}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from megatron_cascade.cascade.evaluate_cli import evaluate_weights

    cfg = load_config(args.config, args.overrides)
    scores = evaluate_weights(cfg, args.weights)
    if scores is not None:
        print(json.dumps(scores, indent=2, sort_keys=True))
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from megatron_cascade.cascade.report import format_table, write_report_png

    if not os.path.isfile(os.path.join(args.output_dir, "manifest.json")):
        raise ConfigError(f"{args.output_dir} has no manifest.json: not a megatron-cascade run directory")
    print(format_table(args.output_dir))
    print(f"wrote {write_report_png(args.output_dir)}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from megatron_cascade.doctor import run_doctor

    return run_doctor(args.config, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-cascade", description="Cascade RL and MOPD on Megatron-Core.")
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) the cascade of a config")
    run.add_argument("config", help="the run's YAML config (examples/tiny_cascade/cascade.yaml, ...)")
    run.add_argument("overrides", nargs="*", help="key.sub=value (stages by name: stages.if_rl.steps=5)")
    run.add_argument("--stage", help="run only this stage (earlier stages must be complete)")
    run.add_argument("--dry-run", action="store_true", help="validate; print layout, memory and stage plan")
    run.add_argument("--allow-config-change", action="append", default=[], metavar="KEY[,KEY]",
                     help="resume although these keys (dotted; a section allows its keys; optimizer.lr allows "
                          "stages.<name>.optimizer.lr) changed what started stages computed; recorded in "
                          "manifest.json")
    run.set_defaults(func=_cmd_run)
    stages = sub.add_parser("stages", help="print each stage's status (complete / partial / pending) in the "
                                           "config's output_dir")
    stages.add_argument("config", help="the run's YAML config")
    stages.add_argument("overrides", nargs="*", help="key.sub=value, as for run (e.g. output_dir=...)")
    stages.set_defaults(func=_cmd_stages)
    ev = sub.add_parser("eval", help="score weights on every domain's eval set")
    ev.add_argument("config", help="the run's YAML config (its domains' eval sets, rewards and eval settings)")
    ev.add_argument("overrides", nargs="*", help="key.sub=value, as for run")
    ev.add_argument("--weights", help="weights folder (default: the last complete stage)")
    ev.set_defaults(func=_cmd_eval)
    report = sub.add_parser("report", help="print the stage x domain table and write report.png")
    report.add_argument("output_dir", help="a run directory (holds manifest.json)")
    report.set_defaults(func=_cmd_report)
    doctor = sub.add_parser("doctor", help="print torch/CUDA/TE/flash-attn/Mamba/megatron-core versions and GPUs; "
                                           "with a config, each of its features that will not run here (exit 1)")
    doctor.add_argument("config", nargs="?", help="a run config (YAML) to check against this machine")
    doctor.add_argument("overrides", nargs="*", help="key.sub=value, as for run")
    doctor.set_defaults(func=_cmd_doctor)
    from megatron_cascade.convert.cli import register

    register(sub)
    _accept_verbose_anywhere(sub)
    return parser


_VERBOSE_HELP = ("show every library's INFO records and warnings on the console (by default they go only to "
                 "OUTPUT_DIR/logs/rank<R>.log)")


def _accept_verbose_anywhere(sub: argparse._SubParsersAction) -> None:
    """``--verbose`` after the subcommand too (``run CONFIG --verbose``)."""
    for parser in sub.choices.values():
        parser.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _accept_verbose_anywhere(action)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but ``key=value`` overrides may also follow options (``run C --stage s k=v``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    setup_console_logging(show_everything=args.verbose)
    from megatron_cascade.stages.prompt_data import DataError
    from megatron_cascade.cascade.run_lock import RunLockError
    from megatron_cascade.model import CheckpointError
    from megatron_cascade.rewards.sandbox import SandboxUnavailableError

    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"megatron-cascade: configuration error: {exc}", file=sys.stderr)
        return 2
    except (DataError, CheckpointError, SandboxUnavailableError) as exc:
        print(f"megatron-cascade: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except RunLockError as exc:
        print(f"megatron-cascade: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
