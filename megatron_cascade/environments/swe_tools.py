"""The SWE environment's workspace and tools: view, search and edit files, run Python commands.

A workspace is an episode's private copy of a repository, held as ``{relative path: text}`` in the
trainer's memory: view/search/edit never touch the host's file system, so no model-chosen path can
reach it. A command (``run``) and the hidden tests run in a fresh code sandbox
(:class:`~megatron_cascade.rewards.sandbox.CodeSandbox`: minimal root, no network, own uid, rlimits,
process-tree kill, its directory removed after): a small driver program writes the workspace into
the sandbox's work dir, runs the command there under its own deadline, and sends back the output's
tail and the files as the command left them (regular UTF-8 files only; symlinks, ``__pycache__`` and
files over the size cap are not kept). Nothing of a command outlives it. The driver is non-dumpable
and lets go of its stdin once read, so nothing it was given is readable from ``/proc`` by the code it
runs (the hidden tests' verdict: ``_swe_runner.py``).

The sandbox has no shell: a command is ``python ...`` / ``python3 ...`` (``python -m unittest``,
``python script.py``, ``python -c ...``), run with the interpreter of the sandbox and the standard
library only.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Optional

from megatron_cascade.rewards.sandbox import CodeSandbox, Program, SandboxLimits


class ToolError(ValueError):
    """A tool call that cannot be carried out; the message is fed back to the model."""


#: What the driver prints before its JSON report (the last such line counts).
_REPORT = "__SWE_DRIVER__"

# Runs inside the sandbox as main.py; stdin: {"files", "argv", "timeout_s", "max_output_chars",
# "max_file_bytes", "max_total_bytes", "stdin"}. The repository lives in ./repo (main.py stays out of
# it). Isolated, the driver is its PID namespace's init: before it reports, everything the command
# left running is killed (kill -1 from init spares only init), so nothing writes after its report.
_DRIVER = r'''
import ctypes, json, os, signal, stat, subprocess, sys
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: its memory and fds stay out of /proc
spec = json.loads(sys.stdin.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # /proc/1/fd/0 no longer names the spec
os.mkdir("repo")
for path, text in spec["files"].items():
    target = os.path.join("repo", path)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with open(target, "w", encoding="utf-8") as f:
        f.write(text)
env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
timed_out, rc, verdict = False, None, None
argv, fds = [sys.executable, *spec["argv"]], ()
if spec.get("verdict"):  # a private pipe for the hidden tests' counts, its write end the runner's only
    verdict_r, verdict_w = os.pipe()
    argv, fds = argv + [str(verdict_w)], (verdict_w,)
with open("cmd_output", "wb") as out:
    proc = subprocess.Popen(argv, cwd="repo", stdout=out, stderr=subprocess.STDOUT, env=env, pass_fds=fds,
                            stdin=subprocess.DEVNULL if spec.get("stdin") is None else subprocess.PIPE)
    for fd in fds:
        os.close(fd)
    try:
        proc.communicate(None if spec.get("stdin") is None else spec["stdin"].encode(), timeout=spec["timeout_s"])
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        timed_out = True
if fds:
    with os.fdopen(verdict_r, "rb") as f:
        verdict = f.read(4096).decode("utf-8", "replace")
if os.getpid() == 1:
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
with open("cmd_output", "rb") as f:
    f.seek(max(0, os.path.getsize("cmd_output") - 4 * spec["max_output_chars"]))
    output = f.read().decode("utf-8", "replace")[-spec["max_output_chars"]:]
files, skipped, total = {}, [], 0
for root, dirs, names in os.walk("repo"):
    dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not os.path.islink(os.path.join(root, d)))
    for name in sorted(names):
        full = os.path.join(root, name)
        rel = os.path.relpath(full, "repo").replace(os.sep, "/")
        st = os.lstat(full)
        if not stat.S_ISREG(st.st_mode) or st.st_size > spec["max_file_bytes"] or name.endswith(".pyc"):
            skipped.append(rel)
            continue
        try:
            with open(full, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped.append(rel)
            continue
        total += len(text.encode())
        if total > spec["max_total_bytes"]:
            skipped.append(rel)
            continue
        files[rel] = text
print("\n" + "__SWE_DRIVER__" + json.dumps({"rc": rc, "timed_out": timed_out, "output": output,
                                             "files": files, "skipped": skipped, "verdict": verdict}))
'''

# The hidden tests' runner and the subject holding the repository's code (see its docstring).
_RUNNER_PATH = os.path.join(os.path.dirname(__file__), "_swe_runner.py")


@functools.lru_cache(maxsize=1)
def _runner_source() -> str:
    with open(_RUNNER_PATH, encoding="utf-8") as f:
        return f.read()


def module_name(path: str) -> str:
    """The import name of a repository's ``.py`` file (``tests/test_x.py`` -> ``tests.test_x``)."""
    name = path[:-3].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def normalize_path(path: object, *, allow_root: bool = False) -> str:
    """A workspace path as a clean relative POSIX path (``"."`` for the root when allowed).

    Raises:
        ToolError: not a string, absolute, leaving the workspace (``..``), empty, or odd characters.
    """
    if not isinstance(path, str):
        raise ToolError("path must be a string")
    if len(path) > 256 or "\x00" in path or "\\" in path:
        raise ToolError(f"bad path {path[:80]!r}: at most 256 characters, '/' separators, no NUL")
    if path.startswith("/"):
        raise ToolError(f"bad path {path!r}: paths are relative to the repository root")
    clean = posixpath.normpath(path or ".")
    if clean == ".":
        if allow_root:
            return "."
        raise ToolError("path names a folder; give a file path")
    if clean == ".." or clean.startswith("../"):
        raise ToolError(f"bad path {path!r}: it leaves the repository")
    return clean


def _numbered(lines: list[str], first: int) -> str:
    return "\n".join(f"{first + i:5d}  {line}" for i, line in enumerate(lines))


@dataclass
class Workspace:
    """An episode's repository: ``files`` maps relative POSIX paths to their text.

    Attributes:
        max_file_bytes: largest file a tool may write; ``max_total_bytes``: the whole workspace.
        max_output_chars: longest tool result (longer ones are cut, saying so).
    """

    files: dict[str, str]
    max_file_bytes: int = 256 * 1024
    max_total_bytes: int = 2 * 2**20
    max_output_chars: int = 4000
    original: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_repo(cls, repo: Mapping[str, str], **limits: int) -> "Workspace":
        """A fresh workspace holding a copy of ``repo`` (a data row's ``repo``: path -> text).

        Raises:
            ValueError: ``repo`` is not a mapping of clean relative paths to strings, or too large.
        """
        if not isinstance(repo, Mapping) or not repo:
            raise ValueError("a SWE row's 'repo' must be a non-empty object {relative path: file text}")
        files: dict[str, str] = {}
        for path, text in repo.items():
            try:
                clean = normalize_path(path)
            except ToolError as e:
                raise ValueError(f"SWE row 'repo': {e}") from None
            if not isinstance(text, str):
                raise ValueError(f"SWE row 'repo': {path!r} must map to the file's text")
            files[clean] = text
        ws = cls(files, **limits)
        if ws.total_bytes() > ws.max_total_bytes:
            raise ValueError(f"SWE row 'repo' holds {ws.total_bytes()} bytes > max_total_bytes={ws.max_total_bytes}")
        ws.original = dict(files)
        return ws

    def total_bytes(self) -> int:
        return sum(len(t.encode()) for t in self.files.values())

    def changed(self) -> list[str]:
        """Paths added, removed or modified since :meth:`from_repo`."""
        paths = set(self.files) | set(self.original)
        return sorted(p for p in paths if self.files.get(p) != self.original.get(p))

    def cut(self, text: str) -> str:
        """``text`` within ``max_output_chars`` (its head and tail, saying how much was left out)."""
        limit = self.max_output_chars
        if len(text) <= limit:
            return text
        half = limit // 2
        return f"{text[:half]}\n... [{len(text) - 2 * half} characters left out] ...\n{text[-half:]}"

    # -- tools ------------------------------------------------------------------------------------
    def view(self, path: str = ".", start_line: int = 1, end_line: Optional[int] = None) -> str:
        """A folder's files (recursive), or a file's lines ``start_line..end_line`` (1-based, numbered)."""
        clean = normalize_path(path, allow_root=True)
        if clean not in self.files:
            prefix = "" if clean == "." else clean + "/"
            inside = sorted(p for p in self.files if p.startswith(prefix))
            if not inside:
                raise ToolError(f"no such file or folder: {path!r}")
            return self.cut("\n".join(inside))
        if not isinstance(start_line, int) or not (end_line is None or isinstance(end_line, int)):
            raise ToolError("start_line and end_line must be integers")
        lines = self.files[clean].splitlines()
        first = max(1, start_line)
        last = len(lines) if end_line is None else min(len(lines), end_line)
        return self.cut(_numbered(lines[first - 1:last], first) if last >= first else "(no lines in that range)")

    def search(self, text: str, path: str = ".") -> str:
        """Lines containing ``text`` (plain substring, case-sensitive) as ``file:line: content``."""
        if not isinstance(text, str) or not text:
            raise ToolError("text must be a non-empty string")
        clean = normalize_path(path, allow_root=True)
        prefix = "" if clean == "." else clean
        hits = [f"{p}:{n}: {line.strip()}" for p in sorted(self.files)
                if p == prefix or p.startswith(prefix + "/" if prefix else "")
                for n, line in enumerate(self.files[p].splitlines(), 1) if text in line]
        return self.cut("\n".join(hits[:200]) if hits else f"no line contains {text!r}")

    def edit(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of ``old`` in ``path`` by ``new``; ``old == ""`` creates a new file
        holding ``new``."""
        clean = normalize_path(path)
        if not isinstance(old, str) or not isinstance(new, str):
            raise ToolError("old and new must be strings")
        if old == "":
            if clean in self.files:
                raise ToolError(f"{clean} exists: give the text to replace in 'old'")
            if any(p.startswith(clean + "/") for p in self.files) or any(
                    clean.startswith(p + "/") for p in self.files):
                raise ToolError(f"{clean} collides with a folder or file of the same name")
            text = new
        else:
            if clean not in self.files:
                raise ToolError(f"no such file: {clean}")
            count = self.files[clean].count(old)
            if count != 1:
                raise ToolError(f"'old' occurs {count} times in {clean}; it must occur exactly once")
            text = self.files[clean].replace(old, new)
        self._store(clean, text)
        return f"edited {clean}"

    def _store(self, path: str, text: str) -> None:
        size = len(text.encode())
        if size > self.max_file_bytes:
            raise ToolError(f"{path} would hold {size} bytes > {self.max_file_bytes}")
        if self.total_bytes() - len(self.files.get(path, "").encode()) + size > self.max_total_bytes:
            raise ToolError(f"the repository would exceed {self.max_total_bytes} bytes")
        self.files[path] = text


@dataclass(frozen=True)
class CommandResult:
    """A command's outcome: exit status (None when it timed out), the tail of its output, and the
    files it left that were not kept (binary, too large, symlinks)."""

    returncode: Optional[int]
    output: str
    timed_out: bool
    skipped: tuple[str, ...] = ()

    def text(self) -> str:
        """As fed back to the model."""
        status = "timed out" if self.timed_out else f"exit status {self.returncode}"
        note = f"\n(not kept: {', '.join(self.skipped[:10])})" if self.skipped else ""
        return f"[{status}]\n{self.output}{note}"


@dataclass(frozen=True)
class TestOutcome:
    """The hidden tests' result: unittest's counts, and whether they all passed."""

    run: int
    failures: int
    errors: int
    skipped: int
    output: str

    def passed(self, expected: Optional[int]) -> bool:
        """Every test ran (``expected`` of them when given) and none failed, errored or was skipped."""
        return (self.run > 0 and (expected is None or self.run == expected)
                and self.failures == self.errors == self.skipped == 0)


class SandboxRunner:
    """Runs commands and hidden tests on a workspace, each in a fresh sandbox.

    Args:
        sandbox: the code sandbox (isolated, or unsafe where allowed).
        memory_mb, max_processes, max_disk_mb: the sandbox's limits for one command's whole tree.
    """

    def __init__(self, sandbox: CodeSandbox, *, memory_mb: int = 1024, max_processes: int = 8,
                 max_disk_mb: int = 64) -> None:
        self.sandbox = sandbox
        self.memory_mb, self.max_processes, self.max_disk_mb = memory_mb, max_processes, max_disk_mb

    def _drive(self, ws: Workspace, files: Mapping[str, str], argv: list[str], timeout_s: float,
               output_chars: int, stdin: Optional[str] = None, verdict: bool = False) -> Optional[dict]:
        spec = {"files": dict(files), "argv": argv, "timeout_s": timeout_s, "max_output_chars": output_chars,
                "max_file_bytes": ws.max_file_bytes, "max_total_bytes": ws.max_total_bytes, "stdin": stdin,
                "verdict": verdict}
        limits = SandboxLimits(timeout_s=timeout_s + 10.0, memory_mb=self.memory_mb,
                               max_processes=self.max_processes, max_disk_mb=self.max_disk_mb,
                               max_file_mb=max(1, -(-ws.max_total_bytes // 2**20)) + 1,
                               max_output_bytes=2 * ws.max_total_bytes + 8 * output_chars + 65536)
        result = self.sandbox.run(Program(_DRIVER, stdin=json.dumps(spec)), limits)
        head, sep, report = result.stdout.rpartition(_REPORT)
        if result.timed_out or not sep:
            return None
        try:
            data = json.loads(report)
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def run_command(self, ws: Workspace, command: str, timeout_s: float) -> CommandResult:
        """Run ``command`` (``python ...``) on the workspace; the files it leaves replace the workspace's.

        Raises:
            ToolError: not a ``python`` command.
        """
        argv = _python_argv(command)
        data = self._drive(ws, ws.files, argv, timeout_s, ws.max_output_chars)
        if data is None:
            return CommandResult(None, "(the command's sandbox ended without a report: the workspace is unchanged)",
                                 True)
        files = data.get("files")
        if isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            kept = {}
            for path, text in files.items():
                try:
                    kept[normalize_path(path)] = text
                except ToolError:
                    continue
            ws.files = kept
        skipped = tuple(str(s) for s in data.get("skipped", []) if isinstance(s, str))
        rc = data.get("rc")
        return CommandResult(rc if isinstance(rc, int) else None, str(data.get("output", "")),
                             bool(data.get("timed_out")), skipped)

    def run_tests(self, ws: Workspace, hidden: Mapping[str, str], modules: list[str],
                  timeout_s: float) -> Optional[TestOutcome]:
        """Run the hidden tests (``{path: text}``; ``modules``: what unittest loads) against the
        workspace: the runner loads them from their text (never from disk) and reaches the repository
        only through the subject process (``_swe_runner.py``); None when no verdict came back (timed
        out, crashed)."""
        sources = {module_name(path): text for path, text in hidden.items() if path.endswith(".py")}
        top_level = sorted({module_name(path).partition(".")[0] for path in ws.files if path.endswith(".py")}
                           | {path.partition("/")[0] for path in ws.files if "/" in path})
        spec = {"sources": sources, "modules": list(modules), "program": _runner_source(), "top_level": top_level}
        data = self._drive(ws, ws.files, ["-I", "-c", _runner_source(), "runner"], timeout_s, 20000,
                           stdin=json.dumps(spec), verdict=True)
        if data is None or data.get("timed_out") or not isinstance(data.get("verdict"), str):
            return None
        try:
            counts = json.loads(data["verdict"])
            return TestOutcome(int(counts["run"]), int(counts["failures"]), int(counts["errors"]),
                               int(counts["skipped"]) + int(counts.get("unexpected_successes", 0)),
                               str(data.get("output", "")))
        except (ValueError, KeyError, TypeError):
            return None


def _python_argv(command: object) -> list[str]:
    if not isinstance(command, str) or not command.strip():
        raise ToolError("command must be a non-empty string")
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ToolError(f"cannot parse the command: {e}") from None
    if argv[0] not in ("python", "python3"):
        raise ToolError("only Python runs here (no shell): e.g. 'python -m unittest -v' or 'python script.py'")
    return argv[1:]
