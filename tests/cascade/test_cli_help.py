"""Every argument of every subcommand says what it is in ``--help`` (issue 28: ``run``'s config, the
``stages`` help naming OUTPUT_DIR while it takes a config, ``convert reshard --ckpt/--out`` and
``nemo2-to-megatron --out`` had none)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

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
    for path, _ in _subparsers(build_parser()):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*path, "--help"])
        assert info.value.code == 0 and "usage:" in capsys.readouterr().out, path


_LOGS = """
import logging, sys
from megatron_cascade.run_logging import log_to_file, setup_console_logging
setup_console_logging(show_everything=sys.argv[2] == "verbose")
log_to_file(sys.argv[1])
from megatron.core.inference.contexts import dynamic_context
logging.info("ours: kept")
for level, text in ((logging.INFO, "megatron: allocated context"), (logging.WARNING, "megatron: warned")):
    logging.getLogger().handle(logging.LogRecord("root", level, dynamic_context.__file__, 1, text, None, None))
logging.getLogger("megatron.core.x").info("megatron named: info")
"""


@pytest.mark.parametrize("mode", ["quiet", "verbose"])
def test_megatron_info_goes_to_the_log_file_not_the_console(tmp_path, mode):
    """Before: megatron-core's ``logging.info("DynamicInferenceContext: allocated context ...")`` (root
    logger) printed at every generate call, into the progress bar. Now it is in the rank's log file;
    its warnings and our INFO still show; ``--verbose`` shows it all."""
    res = subprocess.run([sys.executable, "-c", _LOGS, str(tmp_path), mode], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ours: kept" in res.stderr and "megatron: warned" in res.stderr
    shown = ("allocated context" in res.stderr, "megatron named: info" in res.stderr)
    assert shown == ((True, True) if mode == "verbose" else (False, False)), res.stderr
    with open(tmp_path / "logs" / "rank0.log") as f:
        logged = f.read()
    for text in ("ours: kept", "megatron: allocated context", "megatron: warned", "megatron named: info"):
        assert text in logged, logged


def test_verbose_is_taken_before_or_after_the_subcommand():
    from megatron_cascade.cli import _parse

    assert _parse(["--verbose", "stages", "c.yaml"]).verbose
    assert _parse(["stages", "c.yaml", "-v", "seed=1"]).verbose
    assert not _parse(["stages", "c.yaml"]).verbose
