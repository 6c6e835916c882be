"""TensorBoard after a stage boundary and a resume (real event files, read as TensorBoard reads a run
directory): every step once, the redone steps replaced, nothing of the previous stage hidden."""

from __future__ import annotations

import os

from megatron_cascade.cascade.logger import StageLogger


def test_resume_replaces_only_the_redone_steps(tmp_path):
    """Before: a stage's writer hid everything from global step offset + first_step on, which is the
    previous stage's last step and its eval point (fresh start), or the last step the checkpoint kept
    (resume): a/loss lost step 3, eval/math its only point, b/loss its step 4."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = str(tmp_path)
    a = StageLogger(out, "a", 3, 0, 0, tensorboard=True, progress_bar=False)
    for step in range(3):
        a.log_step(step, {"loss": float(step)})
    a.log_eval({"math": 0.5}, 3)
    a.close()
    b = StageLogger(out, "b", 4, 0, 3, tensorboard=True, progress_bar=False)
    for step in range(2):
        b.log_step(step, {"loss": 10.0 + step})
    b.close()  # killed after its second step; the checkpoint holds its first
    b = StageLogger(out, "b", 4, 1, 3, tensorboard=True, progress_bar=False)
    for step in range(1, 4):
        b.log_step(step, {"loss": 20.0 + step})
    b.close()
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    points = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in ("a/loss", "eval/math", "b/loss")}
    assert points == {"a/loss": [(1, 0.0), (2, 1.0), (3, 2.0)], "eval/math": [(3, 0.5)],
                      "b/loss": [(4, 10.0), (5, 21.0), (6, 22.0), (7, 23.0)]}
