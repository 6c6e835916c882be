"""SWE RL environment (issue 16 item 3): workspaces, tools, hidden-test reward, sandbox isolation.

The shipped task set (examples/swe_tasks): every oracle fix scores 1 and no patch scores 0 through
the environment's own tool calls. Tools work on a private copy of the repository (paths cannot leave
it), commands and hidden tests run in the code sandbox, the hidden tests exist only while scoring,
forged test results do not pass, and attacks of tests/rewards/test_sandbox_attacks.py fail inside SWE
workspaces too (run as a command, or as the patch the hidden tests import), leaving nothing behind.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_cascade.environments import build_environment
from megatron_cascade.environments.swe import SWEEnvironment
from megatron_cascade.rewards.sandbox import CodeSandbox, SandboxUnavailableError
from megatron_cascade.tokenizers import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "swe_tasks" / "tasks.jsonl"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


attacks = _load("sandbox_attack_helpers", ROOT / "tests" / "rewards" / "test_sandbox_attacks.py")
reward_fixtures = _load("reward_test_fixtures", ROOT / "tests" / "rewards" / "conftest.py")
make_tasks = _load("make_swe_tasks", ROOT / "examples" / "swe_tasks" / "make_tasks.py")


@pytest.fixture(scope="module")
def sandbox_tmp(tmp_path_factory):
    """Sandboxes of this module make their directories in a folder of their own: the leftover checks
    below see only this module's sandboxes (other test runs on the machine have theirs). pytest's
    base temporary folder is made first, outside it: made inside, the removal below would take it
    from every later test (their tmp_path failed with FileNotFoundError when this module ran first)."""
    tmp_path_factory.getbasetemp()
    folder = tempfile.mkdtemp(prefix="mc-swe-test-")
    before, tempfile.tempdir = tempfile.tempdir, folder
    yield folder
    tempfile.tempdir = before
    assert glob.glob(os.path.join(folder, "mc-sandbox-*")) == []  # every sandbox removed its directory
    shutil.rmtree(folder)


@pytest.fixture(scope="module")
def env(sandbox_tmp) -> SWEEnvironment:
    try:
        CodeSandbox().require_isolation()
    except SandboxUnavailableError as e:
        pytest.skip(f"isolated sandbox unavailable here (the swe environment refuses without it): {e}")
    return build_environment("swe", {"command_timeout_s": 3.0, "test_timeout_s": 3.0, "max_output_chars": 3000},
                             CharTokenizer())


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return [json.loads(line) for line in TASKS.read_text().splitlines()]


@pytest.fixture
def no_leftovers(sandbox_tmp):
    """No process of this module's sandboxes (their command lines name their directory) and no
    sandbox directory left after the test."""
    yield
    leftovers = reward_fixtures.processes_with(sandbox_tmp)
    for p in leftovers:  # ours only (the folder is this module's)
        p.kill()
    assert not leftovers
    assert glob.glob(os.path.join(sandbox_tmp, "mc-sandbox-*")) == []


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _episode(env: SWEEnvironment, row: dict, turns: list[str]):
    """Play ``turns`` (model texts) in one episode; every step's EnvStep and the final state."""
    tok = env.tokenizer
    state = env.start(row)
    steps = []
    try:
        for text in turns:
            steps.append(env.step(state, tok.encode(text) + [tok.eos_id], text))
            if steps[-1].done:
                break
    finally:
        env.finish(state)
    return steps, state


def test_task_set_is_the_generators_and_small(rows):
    assert rows == [make_tasks.make_row(t) for t in make_tasks.TASKS]
    assert len(rows) == 20 and TASKS.stat().st_size < 64 * 1024


def test_oracle_patch_scores_1_and_no_patch_0_on_every_task(env, rows, no_leftovers):
    def play(job):
        row, fixed = job
        edits = [call("edit", **e) for e in row["oracle_edits"]] if fixed else []
        steps, _ = _episode(env, row, edits + ["I am done."])  # a turn without a tool call submits
        return steps[-1]

    with ThreadPoolExecutor(max_workers=8) as pool:
        last = list(pool.map(play, [(row, fixed) for row in rows for fixed in (True, False)]))
    assert [s.reward for s in last] == [1.0, 0.0] * len(rows)
    assert all(s.done and s.metrics["swe_submitted"] == 1.0 for s in last)
    assert [s.metrics["swe_files_changed"] for s in last[:2]] == [1.0, 0.0]


def test_tools_on_the_workspace(env, rows, no_leftovers):
    row = rows[0]  # calc: add returns a - b
    turns = [
        call("view") + call("view", path="calc/core.py") + call("search", text="def add"),
        call("edit", path="calc/core.py", old="a", new="x") + call("edit", path="../escape.py", old="", new="1")
        + call("view", path="/etc/passwd") + call("edit", path="calc/core.py", old="nothing", new="x"),
        call("run", command="python -m unittest tests.test_core") + call("run", command="ls /")
        + call("frobnicate") + "<tool_call>{not json</tool_call>",
        call("run", command="python -c \"import os; open('notes.txt', 'w').write('hi'); os.remove('README.md')\"")
        + call("view", path="notes.txt"),
        call("edit", path="calc/core.py", old="a - b", new="a + b") + call("run", command="python -m unittest -q"),
        call("submit"),
    ]
    steps, state = _episode(env, row, turns)
    tok = env.tokenizer
    obs = [tok.decode(s.observation_ids) for s in steps]
    assert "README.md\ncalc/__init__.py\ncalc/core.py" in obs[0] and "    2      return a - b" in obs[0]
    assert "calc/core.py:1: def add(a, b):" in obs[0]
    assert "'old' occurs 3 times in calc/core.py" in obs[1] and "'old' occurs 0 times" in obs[1]
    assert "it leaves the repository" in obs[1] and "relative to the repository root" in obs[1]
    assert "[exit status 1]" in obs[2] and "AssertionError: -1 != 5" in obs[2]
    assert "only Python runs here" in obs[2] and "unknown tool 'frobnicate'" in obs[2] and "not JSON" in obs[2]
    assert "    1  hi" in obs[3] and "README.md" not in state.workspace.files
    assert "[exit status 0]" in obs[4] and "OK" in obs[4]
    assert [s.metrics["tool_calls"] for s in steps[:5]] == [3, 4, 4, 2, 2]
    assert [s.metrics["tool_calls_ok"] for s in steps[:5]] == [3, 0, 1, 2, 2]
    assert steps[-1].done and steps[-1].reward == 1.0
    assert not any(s.done for s in steps[:-1]) and all(s.observation_ids for s in steps[:-1])


def test_a_command_changes_the_workspace(env, rows, no_leftovers):
    state = env.start(rows[0])
    env.step(state, [], call("run", command="python -c \"import os; open('notes.txt', 'w').write('hi'); "
                                                "os.remove('README.md'); os.symlink('/etc/passwd', 'link')\""))
    assert state.workspace.files["notes.txt"] == "hi"
    assert "README.md" not in state.workspace.files and "link" not in state.workspace.files
    assert state.workspace.changed() == ["README.md", "notes.txt"]
    env.finish(state)


def test_hidden_tests_exist_only_while_scoring(env, rows, no_leftovers):
    row = rows[0]
    fake = "import unittest\n\n\nclass TestHidden(unittest.TestCase):\n" + "".join(
        f"    def test_{i}(self):\n        pass\n\n" for i in range(row["hidden_test_count"]))
    look = call("run", command="python -c \"import os; print(sorted(os.listdir('tests')))\"")
    steps, state = _episode(env, row, [look, call("edit", path="tests/test_hidden.py", old="", new=fake), "done"])
    assert "['__init__.py', 'test_core.py']" in env.tokenizer.decode(steps[0].observation_ids)
    assert steps[-1].done and steps[-1].reward == 0.0  # the real hidden tests replaced the model's stand-in
    assert "tests/test_hidden.py" not in row["repo"]


@pytest.mark.parametrize("patch", [
    "import os\nos._exit(0)\n",  # the test process ends early with status 0
    "import sys\nsys.exit(0)\n",
    "print('\\n__SWE_RESULT__{\"run\": 3, \"failures\": 0, \"errors\": 0, \"skipped\": 0}', flush=True)\n"
    "import os\nos._exit(0)\n",
    "import unittest\nunittest.TestCase.run = lambda self, result=None: None\n",  # tests that never run
    "import atexit\natexit.register(lambda: print('\\n__SWE_RESULT__{\"run\": 3, \"failures\": 0, \"errors\": 0, "
    "\"skipped\": 0}'))\n",
], ids=["os-exit", "sys-exit", "forged-result", "no-tests-run", "atexit"])
def test_a_patch_cannot_fake_passing_tests(env, rows, patch, no_leftovers):
    """Each patch keeps the bug and tries to make the hidden tests look passed."""
    row = rows[0]
    prefix = patch + "\n\ndef add(a, b):\n    return a - b\n"
    steps, _ = _episode(env, row, [call("edit", path="calc/core.py", old="def add(a, b):\n    return a - b\n",
                                        new=prefix), "done"])
    assert steps[-1].done and steps[-1].reward == 0.0


_FAKE_UNITTEST = (  # a repository's own unittest.py: takes the runner's stdin (its nonce), reports all passed
    "import os, sys\n"
    "nonce = sys.stdin.readline().strip()\n"
    "print('\\n__SWE_RESULT__' + nonce + '{\"run\": 3, \"failures\": 0, \"errors\": 0, \"skipped\": 0}', "
    "flush=True)\n"
    "os._exit(0)\n")


@pytest.mark.parametrize("patch,extra_files", [
    # Issue 29's three forgeries that scored 1.0 with the bug in place:
    ("import unittest\nunittest.TestResult.addFailure = lambda self, test, err: None\n"
     "unittest.TestResult.addError = lambda self, test, err: None\n", {}),  # unittest's own bookkeeping
    ("", {"unittest.py": _FAKE_UNITTEST}),  # shadows the runner's unittest
    ("import __main__, os\n"
     "print('\\n__SWE_RESULT__' + getattr(__main__, 'nonce', '') + '{\"run\": 3, \"failures\": 0, \"errors\": 0, "
     "\"skipped\": 0}', flush=True)\nos._exit(0)\n", {}),  # reads the runner's nonce, forges, exits
    # and an answer that equals everything:
    ("class _Always:\n    __eq__ = lambda self, other: True\n    __bool__ = lambda self: True\n", {}),
], ids=["patched-testresult", "shadowing-unittest", "nonce-from-main", "equal-to-everything"])
def test_the_verdict_is_out_of_the_patchs_reach(env, rows, patch, extra_files, no_leftovers):
    """Before: the first three scored 1.0 with the bug still there (the tests imported the patch into
    the process that kept their counts). Now the hidden tests run where no repository code runs."""
    row = rows[0]
    body = "def add(a, b):\n    return _Always()\n" if "_Always" in patch else "def add(a, b):\n    return a - b\n"
    turns = [call("edit", path="calc/core.py", old="def add(a, b):\n    return a - b\n", new=patch + "\n" + body)]
    turns += [call("edit", path=path, old="", new=text) for path, text in extra_files.items()]
    steps, _ = _episode(env, row, turns + ["done"])
    assert steps[-1].done and steps[-1].reward == 0.0


_SPY = """
import os, sys
seen = []
for path in ("/proc/1/fd/0", "/proc/%d/fd/0" % os.getppid(), "/proc/1/environ", "/proc/%d/environ" % os.getppid()):
    try:
        with open(path, "rb") as f:
            seen.append(f.read(200000).decode("utf-8", "replace"))
    except OSError as e:
        seen.append("refused " + path)
for pid in (1, os.getppid()):
    try:
        with open("/proc/%d/mem" % pid, "rb") as f:
            seen.append("mem readable")
    except OSError:
        pass
print("SPY:", " | ".join(seen), file=sys.stderr, flush=True)

def add(a, b):
    return a - b
"""


def test_nothing_of_the_spec_is_readable_by_the_code_under_test(env, rows, no_leftovers):
    """Issue 29: ``/proc/1/fd/0`` -- the driver's stdin, the whole spec with the hidden tests -- was
    readable by the code under test. Now the driver and the runner are non-dumpable and neither keeps
    the spec on a file descriptor: the patch that looks finds nothing."""
    row = rows[0]
    state = env.start(row)
    try:
        state.workspace.files["calc/core.py"] = _SPY
        outcome = env.runner.run_tests(state.workspace, row["hidden_tests"], ["tests.test_hidden"], 10.0)
    finally:
        env.finish(state)
    assert outcome is not None and outcome.failures > 0
    spied = outcome.output[outcome.output.index("SPY:"):]
    assert "refused /proc/1/fd/0" in spied and "assertEqual" not in spied and "mem readable" not in spied, spied


def test_with_reasoning_markers_only_calls_after_the_reasoning_run(env, rows, sandbox_tmp, no_leftovers):
    row = rows[0]
    (edit,) = [call("edit", **e) for e in row["oracle_edits"]]
    thinking = build_environment("swe", {"command_timeout_s": 3.0, "test_timeout_s": 3.0,
                                         "reasoning_markers": ["<think>", "</think>"]}, CharTokenizer())
    tok = thinking.tokenizer
    state = thinking.start(row)
    cut = thinking.step(state, [], "<think>I could " + edit)  # the stop string ended the turn mid-thought
    assert not cut.done and "ended inside the reasoning" in tok.decode(cut.observation_ids)
    assert state.workspace.changed() == []  # the call it only thought about did not run
    acted = thinking.step(state, [], "<think>the sign is wrong</think>" + edit)
    assert state.workspace.changed() == ["calc/core.py"] and acted.metrics["tool_calls_ok"] == 1.0
    done = thinking.step(state, [], "checked</think>" + call("submit"))  # the template opened the reasoning
    assert done.done and done.reward == 1.0
    thinking.finish(state)
    plain = env.start(row)  # without markers the whole turn is read: the thought-of call runs
    env.step(plain, [], "<think>I could " + edit)
    assert plain.workspace.changed() == ["calc/core.py"]
    env.finish(plain)


# -- sandbox attacks inside SWE workspaces (tests/rewards/test_sandbox_attacks.py) --------------------------

def _attack(env, row, body: str, where: str) -> tuple[float, float, str]:
    """``body`` run as a command (``where="command"``) or as the module the hidden tests import
    (``"tests"``); (the episode's reward, seconds, the command's output)."""
    start = time.monotonic()
    if where == "command":
        steps, _ = _episode(env, row, [call("edit", path="attack.py", old="", new=body)
                                       + call("run", command="python attack.py"), "done"])
        return steps[-1].reward, time.monotonic() - start, env.tokenizer.decode(steps[0].observation_ids)
    core = "def add(a, b):\n    return a + b\n"
    steps, _ = _episode(env, row, [call("edit", path="calc/core.py", old="def add(a, b):\n    return a - b\n",
                                        new=body + "\n" + core), "done"])
    return steps[-1].reward, time.monotonic() - start, ""


@pytest.mark.parametrize("where", ["command", "tests"])
def test_attacks_fail_inside_swe_workspaces(env, rows, where, tmp_path, monkeypatch, no_leftovers):
    row = rows[0]
    limit = 3.0 + 10.0 + attacks.SLACK_S  # the command's deadline, the driver's margin, slack
    # No network: a listening socket of the host is unreachable.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.1)
    try:
        body = (f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), 1)\n"
                "print('PWNED')")
        reward, _, out = _attack(env, row, body, where)
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()
    assert reward == 0.0 and "PWNED" not in out
    # The host's files are out of reach, and its secrets are not in the environment.
    world = tmp_path / "world"
    world.mkdir(mode=0o777)
    os.chmod(world, 0o777)
    monkeypatch.setenv("MC_TEST_SECRET_TOKEN", "mc-secret-value-42")
    body = (f"import os\nopen({str(world / 'written.txt')!r}, 'w').write('x')\n")
    reward, _, out = _attack(env, row, body, where)
    assert not (world / "written.txt").exists() and reward == 0.0
    body = "import os\nprint('SECRET=' + os.environ.get('MC_TEST_SECRET_TOKEN', 'none'))\n"
    _, _, out = _attack(env, row, body, where)
    assert "mc-secret-value-42" not in out and (where == "tests" or "SECRET=none" in out)
    # Runaway code ends at its deadline: the reward is 0 and the step comes back in time.
    for body in ("while True:\n    pass", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                 "        pass"):
        reward, elapsed, out = _attack(env, row, body, where)
        assert reward == 0.0 and elapsed < limit, (body, elapsed)


@pytest.mark.parametrize("where", ["command", "tests"])
def test_a_daemon_does_not_outlive_its_command(env, rows, where, tmp_path, no_leftovers):
    marker = f"mcmarker{os.getpid()}{where}"
    world = tmp_path / "w"
    world.mkdir()
    os.chmod(world, 0o777)
    flag = str(world / "daemon.txt")
    _, elapsed, _ = _attack(env, rows[0], attacks._daemon_body(marker, flag, "pass"), where)
    assert reward_fixtures.processes_with(marker) == []
    time.sleep(max(0.0, 3.5 - elapsed))
    assert not os.path.exists(flag) and reward_fixtures.processes_with(marker) == []


# -- configuration and rows ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,key", [
    ({"command_timeout_s": 0}, "command_timeout_s"), ({"test_timeout_s": float("nan")}, "test_timeout_s"),
    ({"memory_mb": 1.5}, "memory_mb"), ({"max_calls_per_turn": 0}, "max_calls_per_turn"),
    ({"allow_unsafe_sandbox": "yes"}, "allow_unsafe_sandbox"),
    ({"reasoning_markers": ["<think>"]}, "reasoning_markers"),
])
def test_bad_kwargs_are_refused_naming_them(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build_environment("swe", kwargs, CharTokenizer())


@pytest.mark.parametrize("row,message", [
    ({"repo": {"a.py": ""}}, "hidden_tests"),
    ({"repo": {}, "hidden_tests": {"t.py": ""}}, "'repo' must be a non-empty object"),
    ({"repo": {"../a.py": ""}, "hidden_tests": {"t.py": ""}}, "leaves the repository"),
    ({"repo": {"a.py": ""}, "hidden_tests": {"t.py": ""}, "test_modules": []}, "test_modules"),
])
def test_bad_rows_fail_their_episode(env, row, message):
    with pytest.raises(ValueError, match=message):
        env.start(row)


def test_the_recipe_stage_builds_its_environment():
    from megatron_cascade.config import load_config
    from megatron_cascade.rewards import build_reward

    cfg = load_config(str(ROOT / "examples" / "nemotron_cascade2" / "07_swe_rl.yaml"), check_paths=False)
    spec = cfg.domains["swe"].environment
    assert spec.name == "swe" and spec.max_turns > 1 and Path(cfg.domains["swe"].train) == TASKS
    assert spec.step_timeout_s > spec.kwargs["test_timeout_s"] + 10  # the submit step has room for the tests
    try:
        env = build_environment(spec.name, spec.kwargs, CharTokenizer())
    except SandboxUnavailableError as e:
        pytest.skip(f"isolated sandbox unavailable here: {e}")
    assert isinstance(env, SWEEnvironment) and env.test_timeout_s == spec.kwargs["test_timeout_s"]
    assert build_reward("environment")("any transcript", {}) == 0.0  # the environment's reward is the score


# -- the stage on the shipped task set ------------------------------------------------------------------------

STAGE_CONFIG = """
output_dir: {out}
seed: 1
tokenizer: builtin:char
model: {{num_layers: 2, hidden_size: 32, ffn_hidden_size: 64, num_attention_heads: 4, vocab_size: 103,
         max_position_embeddings: 1024, precision: fp32}}
rollout: {{max_new_tokens: 16, filter_uninformative_groups: false}}
training: {{micro_batch_size: 4}}
eval: {{enabled: false}}
data: {{max_prompt_tokens: 900}}
checkpoint: {{every_steps: 0}}
logging: {{progress_bar: false, tensorboard: false}}
domains:
  swe:
    train: {tasks}
    reward: {{name: environment}}
    environment: {{name: swe, kwargs: {{command_timeout_s: 5.0, test_timeout_s: 10.0}}, max_turns: 3,
                  step_timeout_s: 30.0}}
stages:
  - {{name: swe_rl, type: grpo, steps: 1, prompts_per_step: 2, samples_per_prompt: 2, domains: {{swe: 1.0}}}}
"""


def _swe_stage_worker(tmp: str, sandbox_dir: str) -> list[dict]:
    from megatron_cascade.cascade.runner import build_context
    from megatron_cascade.cascade.stage import StageRunner
    from megatron_cascade.config import load_config, resolve_stage
    from megatron_cascade.model import initialize_model_parallel

    tempfile.tempdir = sandbox_dir  # this test's sandboxes only (the leftover check)
    config = os.path.join(tmp, "swe.yaml")
    with open(config, "w") as f:
        f.write(STAGE_CONFIG.format(out=os.path.join(tmp, "out"), tasks=TASKS))
    cfg = load_config(config)
    initialize_model_parallel(cfg.parallel, seed=cfg.seed)
    StageRunner(build_context(cfg), 0, resolve_stage(cfg, cfg.stages[0])).run(0)
    with open(os.path.join(tmp, "out", "stages", "swe_rl", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_grpo_stage_runs_swe_episodes_on_the_shipped_tasks(env, tmp_path, sandbox_tmp, no_leftovers):
    """A tiny random policy on the shipped task set: the stage runs its episodes in the swe environment
    (a turn without a tool call submits; the hidden tests give 0), trains, and leaves nothing behind."""
    from megatron_cascade.testing import run_distributed

    (step,) = run_distributed(_swe_stage_worker, 1, str(tmp_path), sandbox_tmp, timeout_s=300)[0]
    assert step["step"] == 1 and step["reward/mean"] == 0.0 and step["reward/errors"] == 0.0
    assert step["episode/turns_mean"] >= 1.0
    assert "episode/swe_submitted_mean" in step and "episode/swe_resolved_mean" in step
    assert (tmp_path / "out" / "stages" / "swe_rl" / "final").is_dir()
