"""The cascade end to end (CI-sized): stages chained, manifest, report, TensorBoard; and resume after
SIGKILL mid-stage and mid-checkpoint giving the same final manifest as an uninterrupted run."""

import glob
import os
import signal
import subprocess
import time

import pytest
from cascade_fixtures import cli_command, read_manifest, run_cli, write_short_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("e2e")
    out = str(folder / "run")
    config = write_short_config(str(folder), out)
    result = run_cli("run", config)
    assert result.returncode == 0, result.stdout[-4000:]
    return config, out, result.stdout


def test_every_stage_completes_and_is_recorded(uninterrupted):
    config, out, _ = uninterrupted
    manifest = read_manifest(out)
    assert manifest["stage_order"] == ["sft", "if_rl", "mopd"]
    for name in manifest["stage_order"]:
        record = manifest["stages"][name]
        assert record["status"] == "complete"
        assert os.path.isfile(os.path.join(out, record["final_weights"], "model_config.json"))
        assert set(record["eval"]) == {"math", "instruction_following", "code"}
        assert all(0.0 <= v <= 1.0 for v in record["eval"].values())
    assert manifest["stages"]["mopd"]["teachers"] == {"math": "sft", "instruction_following": "if_rl"}
    assert os.path.isfile(os.path.join(out, "config.yaml"))
    status = run_cli("stages", config)
    assert status.stdout.strip().splitlines()[-3:] == ["sft\tcomplete", "if_rl\tcomplete", "mopd\tcomplete"]


def test_completed_stages_are_not_rerun(uninterrupted):
    config, out, _ = uninterrupted
    before = os.path.getmtime(os.path.join(out, "stages", "sft", "final"))
    result = run_cli("run", config)
    assert result.returncode == 0 and "is complete; skipping" in result.stdout
    assert os.path.getmtime(os.path.join(out, "stages", "sft", "final")) == before


def test_report_prints_the_table_and_writes_png(uninterrupted):
    _, out, _ = uninterrupted
    result = run_cli("report", out)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("stage"))
    assert all(d in header for d in ("code", "instruction_following", "math"))
    assert any(line.startswith("if_rl") and "grpo" in line for line in lines)
    assert os.path.getsize(os.path.join(out, "report.png")) > 10_000


def test_tensorboard_has_the_named_scalars(uninterrupted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = uninterrupted
    tags = set()
    for path in glob.glob(os.path.join(out, "tensorboard", "events.out.tfevents.*")):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    expected = {
        "sft/loss", "sft/nll_mean", "sft/grad_norm", "sft/lr", "sft/throughput/tokens_per_s",
        "if_rl/reward/mean", "if_rl/reward/domain/instruction_following", "if_rl/advantage/abs_mean", "if_rl/loss",
        "if_rl/grad_norm", "if_rl/lr", "if_rl/response/length_mean", "if_rl/finish/stop_frac",
        "if_rl/finish/length_frac", "if_rl/is_abs_log_ratio_mean", "if_rl/is_masked_frac",
        "if_rl/time/generation_s", "if_rl/time/reward_s", "if_rl/time/train_s", "if_rl/throughput/tokens_per_s",
        "if_rl/entropy_mean", "if_rl/clip_frac", "sft/entropy_mean", "mopd/entropy_mean",
        "mopd/reverse_kl_mean", "mopd/reward/domain/math", "eval/math", "eval/instruction_following",
        # issue 12's rollout telemetry
        "if_rl/reward/std", "if_rl/reward/raw_mean", "if_rl/response/length_max",
        "if_rl/response/length_mean/instruction_following", "if_rl/finish/stop_frac/instruction_following",
        "if_rl/batch/effective_prompts", "if_rl/batch/effective_frac", "if_rl/sampling/rounds",
        "if_rl/throughput/tokens_per_s_per_gpu", "mopd/time/teacher_s", "mopd/reverse_kl/domain/math",
        "mopd/reverse_kl/teacher/sft",
    }
    assert expected <= tags, f"missing: {sorted(expected - tags)}"


def _kill_when(config: str, out: str, ready, timeout: float = 300) -> None:
    proc = subprocess.Popen(cli_command("run", config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not ready(out):
            assert proc.poll() is None, "the run ended before the kill point"
            assert time.monotonic() < deadline, "kill point never reached"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _mid_stage(out: str) -> bool:
    return os.path.isfile(os.path.join(out, "stages", "if_rl", "checkpoints", "latest"))


def _mid_checkpoint(out: str) -> bool:
    """While mopd's second checkpoint is being written (its first one is complete)."""
    return bool(glob.glob(os.path.join(out, "stages", "mopd", "checkpoints", "step_00000002.partial", "weights")))


@pytest.mark.parametrize("kill_point", [_mid_stage, _mid_checkpoint], ids=["mid-stage", "mid-checkpoint"])
def test_resume_after_sigkill_gives_the_same_manifest(uninterrupted, tmp_path, kill_point):
    _, reference_out, _ = uninterrupted
    out = str(tmp_path / "run")
    config = write_short_config(str(tmp_path), out)
    _kill_when(config, out, kill_point)
    status = run_cli("stages", config).stdout
    assert "partial" in status
    if kill_point is _mid_checkpoint:  # the interrupted save left "latest" on the previous checkpoint
        with open(os.path.join(out, "stages", "mopd", "checkpoints", "latest")) as f:
            assert f.read().strip() == "step_00000001"
    result = run_cli("run", config)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "resuming from" in result.stdout
    assert read_manifest(out) == read_manifest(reference_out)
