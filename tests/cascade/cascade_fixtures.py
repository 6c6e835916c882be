"""A CI-sized tiny cascade config and helpers to run the CLI in a subprocess (shared by the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "examples", "tiny_cascade", "cascade.yaml")

SHORT = """
defaults: [{tiny}]
output_dir: {out}
model: {{num_layers: 1, hidden_size: 48, ffn_hidden_size: 96}}
training: {{micro_batch_size: 8}}
rollout: {{max_new_tokens: 10}}
eval: {{max_prompts: 4}}
checkpoint: {{every_steps: 1, keep_last: 2}}
logging: {{progress_bar: false}}
stages:
  - {{name: sft, type: sft, steps: 4, prompts_per_step: 8, domains: {{math: 1.0, instruction_following: 1.0}}}}
  - {{name: if_rl, type: grpo, steps: 3, prompts_per_step: 4, samples_per_prompt: 4,
      domains: {{instruction_following: 1.0}}}}
  - {{name: mopd, type: mopd, steps: 3, prompts_per_step: 4, samples_per_prompt: 2,
      domains: {{math: 1.0, instruction_following: 1.0}}, teachers: {{math: sft, instruction_following: if_rl}}}}
"""


def write_short_config(folder: str, out: str, extra: str = "") -> str:
    """A 3-stage (sft -> grpo -> mopd) config that runs in about a minute on 2 cores."""
    path = os.path.join(folder, "short.yaml")
    with open(path, "w") as f:
        f.write(SHORT.format(tiny=TINY, out=out) + extra)
    return path


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_cascade.cli", *args]


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI to completion (its own session, so nothing it starts outlives a timeout)."""
    proc = subprocess.Popen(cli_command(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"CLI timed out: {args}\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def read_manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json")) as f:
        return json.load(f)
