"""Every argument of every subcommand says what it is in ``--help`` (issue 28: ``run``'s config, the
``stages`` help naming OUTPUT_DIR while it takes a config, ``convert reshard --ckpt/--out`` and
``nemo2-to-megatron --out`` had none)."""

from __future__ import annotations

import argparse
from megatron_cascade.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) of every (sub)command, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, path + (name,))


def test_every_argument_of_every_subcommand_has_help():
    missing = []
    commands = list(_subparsers(build_parser()))
    assert {path for path, _ in commands} >= {("run",), ("stages",), ("eval",), ("report",), ("doctor",),
                                              ("convert", "reshard"), ("convert", "nemo2-to-megatron")}
    for path, parser in commands:
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip():
                missing.append(f"{' '.join(path)} {action.dest}")
    assert not missing, missing


def test_help_runs_for_every_subcommand(capsys):
    import pytest

    for path, _ in _subparsers(build_parser()):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*path, "--help"])
        assert info.value.code == 0 and "usage:" in capsys.readouterr().out, path


def test_megatron_info_on_the_root_logger_stays_off_the_console():
    """Before: megatron-core's ``logging.info("DynamicInferenceContext: allocated context ...")`` (root
    logger) printed at every generate call, into the progress bar. Its warnings and our INFO still show."""
    import subprocess
    import sys

    code = """
import logging
from megatron_cascade.cli import _setup_logging
_setup_logging()
from megatron.core.inference.contexts import dynamic_context
logging.info("ours: kept")
record = logging.LogRecord("root", logging.INFO, dynamic_context.__file__, 1, "megatron: allocated context", None, None)
logging.getLogger().handle(record)
logging.getLogger().handle(logging.LogRecord("root", logging.WARNING, dynamic_context.__file__, 1, "megatron: warned",
                                             None, None))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ours: kept" in res.stderr and "megatron: warned" in res.stderr
    assert "allocated context" not in res.stderr
