"""Per-step metrics: TensorBoard scalars, a JSONL record (the report's curves), a console progress bar.

Only rank 0 writes. Tags are ``<stage>/<metric>`` at the cascade-wide step (stages follow one
another on the x axis). On resume, events and records past the resumed step are dropped first.
"""

from __future__ import annotations

import json
import math
import os
from megatron_cascade.cascade.runtime import is_main_rank

METRICS_FILE = "metrics.jsonl"


class StageLogger:
    """Writes one stage's metrics; a no-op on ranks other than 0."""

    def __init__(self, output_dir: str, stage: str, steps: int, first_step: int, global_offset: int,
                 tensorboard: bool, progress_bar: bool) -> None:
        self.enabled = is_main_rank()
        self.stage, self.global_offset = stage, global_offset
        self.writer = None
        self.bar = None
        if not self.enabled:
            return
        self.records = os.path.join(output_dir, "stages", stage, METRICS_FILE)
        os.makedirs(os.path.dirname(self.records), exist_ok=True)
        _truncate_records(self.records, first_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard hides earlier events at or after purge_step: the steps a resume redoes (the
            # kept ones end at global step offset + first_step, which is also the previous stage's
            # last step and its eval point when this stage starts fresh).
            self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"),
                                        purge_step=global_offset + first_step + 1)
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=first_step, desc=stage, unit="step", dynamic_ncols=True)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of stage step ``step`` (0-based, the step just finished)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        with open(self.records, "a") as f:
            f.write(json.dumps({"step": step + 1, **clean}, sort_keys=True) + "\n")
        if self.writer is not None:
            for key, value in clean.items():
                if math.isfinite(value):
                    self.writer.add_scalar(f"{self.stage}/{key}", value, self.global_offset + step + 1)
            self.writer.flush()
        if self.bar is not None:
            shown = {k: f"{clean[k]:.3g}" for k in ("reward/mean", "loss", "reverse_kl_mean") if k in clean}
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(1)

    def log_eval(self, scores: dict[str, float], step: int) -> None:
        if self.enabled and self.writer is not None:
            for domain, score in scores.items():
                self.writer.add_scalar(f"eval/{domain}", score, self.global_offset + step)
            self.writer.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


def _truncate_records(path: str, first_step: int) -> None:
    if not os.path.isfile(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= first_step]
    with open(path, "w") as f:
        f.writelines(kept)


def read_records(output_dir: str, stage: str) -> list[dict]:
    """The per-step records of a stage (empty if none)."""
    path = os.path.join(output_dir, "stages", stage, METRICS_FILE)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
