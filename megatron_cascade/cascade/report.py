"""``megatron-cascade report``: the stage x domain eval table, and report.png (heatmap + reward curves)."""

from __future__ import annotations

import os

from megatron_cascade.cascade.logger import read_records
from megatron_cascade.cascade.manifest import Manifest


def eval_table(output_dir: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(stage names, domains, scores[stage][domain]) from the manifest, in run order."""
    manifest = Manifest(output_dir)
    stages = [name for name, rec in manifest.data["stages"].items() if rec.get("status") == "complete"]
    order = manifest.data.get("stage_order", stages)
    stages = [s for s in order if s in stages]
    domains = sorted({d for s in stages for d in manifest.stage(s).get("eval", {})})
    scores = [[manifest.stage(s).get("eval", {}).get(d) for d in domains] for s in stages]
    return stages, domains, scores


def format_table(output_dir: str) -> str:
    """The table as text: one row per stage, one column per domain; the change vs the previous stage."""
    stages, domains, scores = eval_table(output_dir)
    if not stages:
        return f"{output_dir}: no complete stage in the manifest yet"
    manifest = Manifest(output_dir)
    width = max(12, *(len(d) + 2 for d in domains))
    lines = [f"{'stage':<12}{'type':<6}" + "".join(f"{d:>{width}}" for d in domains)]
    previous: list[float | None] = [None] * len(domains)
    for stage, row in zip(stages, scores):
        cells = []
        for value, before in zip(row, previous):
            if value is None:
                cells.append(f"{'-':>{width}}")
                continue
            delta = "" if before is None else f" ({value - before:+.2f})"
            cells.append(f"{f'{value:.2f}{delta}':>{width}}")
        lines.append(f"{stage:<12}{manifest.stage(stage)['type']:<6}" + "".join(cells))
        previous = row
    return "\n".join(lines)


def write_report_png(output_dir: str) -> str:
    """Heatmap of the eval table + per-stage training reward curves; returns the file path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages, domains, scores = eval_table(output_dir)
    fig, (heat, curves) = plt.subplots(1, 2, figsize=(13, 4.8))
    grid = [[float("nan") if v is None else v for v in row] for row in scores] or [[float("nan")]]
    image = heat.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    heat.set_xticks(range(len(domains)), domains, rotation=20)
    heat.set_yticks(range(len(stages)), stages)
    for i, row in enumerate(scores):
        for j, value in enumerate(row):
            if value is not None:
                heat.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black")
    heat.set_title("held-out score after each stage")
    fig.colorbar(image, ax=heat, fraction=0.046)
    offset = 0
    for stage in stages:
        records = read_records(output_dir, stage)
        xs = [offset + r["step"] for r in records if "reward/mean" in r]
        ys = [r["reward/mean"] for r in records if "reward/mean" in r]
        if xs:
            curves.plot(xs, ys, label=stage)
        offset += len(records)
    curves.set_xlabel("cascade step")
    curves.set_ylabel("training reward (mean)")
    curves.set_title("training reward per stage")
    if curves.lines:
        curves.legend()
    fig.tight_layout()
    path = os.path.join(output_dir, "report.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
