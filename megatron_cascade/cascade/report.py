"""``megatron-cascade report``: the stage x domain eval table (score, its standard error over prompts
and the change from the weights the stage started from), pass@k, and report.png (heatmap, reward
curves, held-out score against step for the stages evaluated during training, e.g. MOPD vs GRPO)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from megatron_cascade.cascade.logger import read_records
from megatron_cascade.cascade.manifest import Manifest


@dataclass
class StageResult:
    """One complete stage's held-out results (domain -> value); ``start`` the stage it started from."""

    name: str
    type: str
    start: Optional[str]
    scores: dict[str, float]
    se: dict[str, float] = field(default_factory=dict)
    pass_at_k: dict[str, float] = field(default_factory=dict)
    k: Optional[int] = None
    teachers: dict[str, str] = field(default_factory=dict)


def stage_results(output_dir: str) -> list[StageResult]:
    """The complete stages of a run in run order. A stage recorded before ``init_from`` existed
    started from the previous complete stage."""
    manifest = Manifest(output_dir)
    complete = [name for name, rec in manifest.data["stages"].items() if rec.get("status") == "complete"]
    order = [s for s in manifest.data.get("stage_order", complete) if s in complete]
    out: list[StageResult] = []
    for i, name in enumerate(order):
        rec = manifest.stage(name)
        start = rec.get("init_from", order[i - 1] if i else None)
        out.append(StageResult(name, rec["type"], start, dict(rec.get("eval", {})), dict(rec.get("eval_se", {})),
                               dict(rec.get("eval_pass_at_k", {})), rec.get("eval_k"), dict(rec.get("teachers", {}))))
    return out


def eval_table(output_dir: str) -> tuple[list[str], list[str], list[list[float | None]]]:
    """(stage names, domains, scores[stage][domain]) from the manifest, in run order."""
    results = stage_results(output_dir)
    domains = sorted({d for r in results for d in r.scores})
    return [r.name for r in results], domains, [[r.scores.get(d) for d in domains] for r in results]


def _cell(value: Optional[float], se: Optional[float], before: Optional[float]) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}" if se is None else f"{value:.2f}±{se:.2f}"
    return text if before is None else f"{text} ({value - before:+.2f})"


def format_table(output_dir: str) -> str:
    """The table as text: one row per stage, one column per domain: the score ± its standard error
    over prompts, and (in brackets) the change from the weights the stage started from (``init_from``,
    by default the previous stage), so a stage's effect on the other domains (forgetting) is its row's
    other columns. Then pass@k per stage (k = eval.samples) when recorded."""
    results = stage_results(output_dir)
    if not results:
        return f"{output_dir}: no complete stage in the manifest yet"
    by_name = {r.name: r for r in results}
    domains = sorted({d for r in results for d in r.scores})
    width = max(22, *(len(d) + 2 for d in domains))
    name_width = max(12, *(len(r.name) + 2 for r in results))
    lines = [f"{'stage':<{name_width}}{'type':<6}{'from':<{name_width}}" + "".join(f"{d:>{width}}" for d in domains)]
    for r in results:
        start = by_name.get(r.start) if r.start else None
        cells = [_cell(r.scores.get(d), r.se.get(d), start.scores.get(d) if start else None) for d in domains]
        lines.append(f"{r.name:<{name_width}}{r.type:<6}{(r.start or '-'):<{name_width}}"
                     + "".join(f"{c:>{width}}" for c in cells))
    ks = {r.k for r in results if r.pass_at_k}
    if ks:
        lines.append("")
        lines.append(f"{'pass@' + '/'.join(str(k) for k in sorted(ks)):<{name_width}}{'':<6}{'':<{name_width}}"
                     + "".join(f"{d:>{width}}" for d in domains))
        for r in results:
            cells = ["-" if r.pass_at_k.get(d) is None else f"{r.pass_at_k[d]:.2f}" for d in domains]
            lines.append(f"{r.name:<{name_width}}{'':<6}{'':<{name_width}}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def eval_curves(output_dir: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """stage -> domain -> [(stage step, held-out score)] for the stages with periodic evals
    (``eval.every_steps``): step 0 is the start weights' score (the ``init_from`` stage's final eval),
    the last step the stage's own final eval."""
    results = stage_results(output_dir)
    by_name = {r.name: r for r in results}
    manifest = Manifest(output_dir)
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in results:
        records = read_records(output_dir, r.name)
        periodic = {d: [(int(rec["step"]), float(rec[f"eval/{d}"])) for rec in records if f"eval/{d}" in rec]
                    for d in r.scores}
        periodic = {d: points for d, points in periodic.items() if points}
        if not periodic:
            continue
        start = by_name.get(r.start) if r.start else None
        steps = manifest.stage(r.name).get("steps", max(p[-1][0] for p in periodic.values()))
        curves[r.name] = {}
        for domain, points in periodic.items():
            first = [(0, start.scores[domain])] if start and domain in start.scores else []
            curves[r.name][domain] = first + points + [(steps, r.scores[domain])]
    return curves


def teacher_levels(output_dir: str, stage: str) -> dict[str, float]:
    """Domain -> its teacher's held-out score, for a stage with teachers that are stages of this run."""
    by_name = {r.name: r for r in stage_results(output_dir)}
    record = by_name.get(stage)
    if record is None:
        return {}
    return {d: by_name[t].scores[d] for d, t in record.teachers.items() if t in by_name and d in by_name[t].scores}


def steps_to_level(curve: list[tuple[int, float]], level: float, tolerance: float = 0.03) -> Optional[int]:
    """The first step at which ``curve`` comes within ``tolerance`` of ``level`` (None: never)."""
    for step, score in curve:
        if score >= level - tolerance:
            return step
    return None


def write_report_png(output_dir: str) -> str:
    """Heatmap of the eval table, per-stage training reward curves and (when a stage logged periodic
    evals) held-out score against step with the teachers' levels; returns the file path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages, domains, scores = eval_table(output_dir)
    curves_by_stage = eval_curves(output_dir)
    panels = 3 if curves_by_stage else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    heat, rewards = axes[0], axes[1]
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
            rewards.plot(xs, ys, label=stage)
        offset += len(records)
    rewards.set_xlabel("cascade step")
    rewards.set_ylabel("training reward (mean)")
    rewards.set_title("training reward per stage")
    if rewards.lines:
        rewards.legend()
    if curves_by_stage:
        _plot_eval_curves(axes[2], output_dir, comparison(output_dir, curves_by_stage))
    fig.tight_layout()
    path = os.path.join(output_dir, "report.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comparison(output_dir: str, curves_by_stage: dict) -> dict:
    """The curves to plot: each stage with teachers (MOPD) and every stage that started from the same
    weights and evaluated the same domains (GRPO from the same start); all of them if none has teachers."""
    results = stage_results(output_dir)
    taught = [r for r in results if r.teachers and r.name in curves_by_stage]
    if not taught:
        return curves_by_stage
    keep = set()
    for t in taught:
        keep |= {r.name for r in results if r.name in curves_by_stage and r.start == t.start
                 and set(curves_by_stage[r.name]) == set(curves_by_stage[t.name])}
    return {name: curves for name, curves in curves_by_stage.items() if name in keep}


def _plot_eval_curves(ax, output_dir: str, curves_by_stage: dict) -> None:
    """Held-out score against stage step, one line per (stage, domain); dashed: teacher levels."""
    styles = ["-", "--", ":", "-."]
    colors: dict[str, str] = {}
    for i, (stage, curves) in enumerate(sorted(curves_by_stage.items())):
        for domain, points in sorted(curves.items()):
            color = colors.setdefault(domain, f"C{len(colors)}")
            ax.plot([p[0] for p in points], [p[1] for p in points], styles[i % len(styles)], color=color,
                    marker="o", markersize=3, label=f"{stage}: {domain}")
        for domain, level in teacher_levels(output_dir, stage).items():
            ax.axhline(level, color=colors.setdefault(domain, f"C{len(colors)}"), linewidth=0.8, alpha=0.5)
    ax.set_xlabel("stage step")
    ax.set_ylabel("held-out score")
    ax.set_title("held-out score during stages (thin lines: teachers)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
