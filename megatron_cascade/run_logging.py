"""Where log records go: a quiet console, and everything in the run's per-rank log file.

The console shows our records (INFO on rank 0, warnings elsewhere) and every library's warnings and
errors; megatron-core's INFO chatter ("DynamicInferenceContext: allocated context ..." at every
generate call, logged on the root logger) and the import-time notices that TE/apex are absent are
kept off it. ``output_dir/logs/rank<R>.log`` gets every INFO record, megatron-core's included.
``verbose`` (``megatron-cascade --verbose``) shows everything on the console.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VERBOSE_ENV = "MEGATRON_CASCADE_VERBOSE"  # set by --verbose: child processes show everything too
_FORMAT = "[%(asctime)s r{rank} %(name)s] %(levelname)s %(message)s"
_MEGATRON_PATH = f"{os.sep}megatron{os.sep}core{os.sep}"


def verbose() -> bool:
    """Whether this run shows every library record and warning (``--verbose``)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class _LibraryInfoFilter(logging.Filter):
    """Drops megatron-core's records below WARNING (its named loggers, and what it logs on the root
    logger with ``logging.info(...)``); its warnings and errors pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return not (record.name == "megatron" or record.name.startswith("megatron.")
                    or _MEGATRON_PATH in record.pathname)


def setup_console_logging(show_everything: bool = False) -> None:
    """The console handler (stderr) of this process; ``show_everything`` = ``--verbose`` (also
    exported to the processes this one starts)."""
    if show_everything:
        os.environ[VERBOSE_ENV] = "1"
    rank = os.environ.get("RANK", "0")
    root = logging.getLogger()
    root.setLevel(logging.INFO)  # the file handler takes every rank's INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%H:%M:%S"))
    handler.setLevel(logging.INFO if rank == "0" or verbose() else logging.WARNING)
    if not verbose():
        handler.addFilter(_LibraryInfoFilter())
    for old in list(root.handlers):
        if isinstance(old, logging.StreamHandler) and not isinstance(old, logging.FileHandler):
            root.removeHandler(old)
    root.addHandler(handler)
    silence_cpu_warnings()


def silence_cpu_warnings() -> None:
    """Hide Megatron-Core's import-time notices that TE/apex/CUDA are absent (expected on CPU); nothing
    is hidden under ``--verbose``."""
    if verbose():
        return
    for pattern in (".*Transformer Engine.*", ".*Apex is not installed.*", ".*CUDA_DEVICE_MAX_CONNECTIONS.*",
                    ".*cuda_graph_scope.*", ".*all_gather_into_tensor.*", ".*reduce_scatter_tensor.*",
                    ".*load_state_dict` is deprecated.*", ".*deprecating ShardedTensor.*"):
        warnings.filterwarnings("ignore", message=pattern)


def log_to_file(output_dir: str) -> str:
    """Append this rank's INFO records (every library's) to ``output_dir/logs/rank<R>.log``; returns
    the path. Idempotent per path."""
    rank = os.environ.get("RANK", "0")
    path = os.path.join(output_dir, "logs", f"rank{rank}.log")
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and h.baseFilename == os.path.abspath(path) for h in root.handlers):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), datefmt="%Y-%m-%d %H:%M:%S"))
    handler.setLevel(logging.INFO)
    root.addHandler(handler)
    return path
