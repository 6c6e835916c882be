"""The paper's claims on the tiny cascade, over several seeds: each GRPO stage raises its own domain,
later stages forget little (next to a mixed-RL baseline with the same steps and data), and MOPD
reaches its teachers' scores in fewer steps than GRPO from the same weights.

    python benchmarks/claims.py --seeds 1234 1 2 3 4 --out outputs/claims            # runs, then prints
    python benchmarks/claims.py --seeds 1234 1 2 3 4 --out outputs/claims --no-run   # print finished runs
    ... --no-run --readme README.md   # and write them into README's claims block

Per seed it runs ``examples/tiny_cascade/cascade.yaml`` and the RL stage of ``mixed.yaml`` from that
cascade's SFT weights (the same start, so only the RL schedule differs; ``seed=<s>``; a finished run
is skipped, an interrupted one resumes; the mixed stage samples as many responses per domain as the
RL stages the cascade's end comes from: ``equal_data_mixed_stage``) and prints, mean ± standard error over seeds:

1. every stage's held-out score per domain and its change from the weights it started from;
2. each GRPO stage's gain on its own domains, in units of the eval's standard error (over prompts);
3. the cascade's final scores next to the mixed baseline's;
4. MOPD vs GRPO: stage steps until the held-out score is within 0.03 of the teacher (the step of the
   first periodic eval at that level, ``eval.every_steps``; "-" = not within the stage), and MOPD's
   score minus GRPO's (paired per seed) at the middle of the stage and at its end;

and writes ``<out>/claims.png``: per domain, bars of the SFT score, the domain's own GRPO stage, the
cascade's end and mixed RL's end; per MOPD domain, the MOPD and GRPO held-out curves (mean with a ± SE
band over seeds) against the teacher's level.

The seed changes the weights' initialisation, the prompt order and the sampling; the data splits are
the committed ones. Extra arguments are config overrides for both runs (``stages.*`` ones for the
cascade only: the mixed stage is derived from its stages).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_cascade.cascade.report import StageResult, eval_curves, stage_results, steps_to_level  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny_cascade"
TOLERANCE = 0.03  # "within 0.03 of the teacher"
# README's five-seed tables lie between these (``--readme``): written by this script, not by hand.
README_BEGIN = "<!-- claims.py --readme: begin -->"
README_END = "<!-- claims.py --readme: end -->"


def run(config: Path, out: str, seed: int, overrides: list[str]) -> None:
    """One run of ``config`` (resumes; a complete run only re-reads its manifest)."""
    cmd = [sys.executable, "-m", "megatron_cascade.cli", "run", str(config), f"output_dir={out}", f"seed={seed}",
           "logging.progress_bar=false", *overrides]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def run_level(overrides: list[str]) -> list[str]:
    """The overrides that apply to the mixed run: stage overrides are the cascade's (mixed RL's stage
    follows from them)."""
    return [o for o in overrides if not o.startswith("stages.")]


def cascade_data(overrides: list[str]) -> dict[str, float]:
    """Responses per domain sampled by the RL stages the cascade's end (:func:`cascade_end`) comes
    from: its start chain and MOPD teachers, not the ``grpo_ref`` comparison."""
    from megatron_cascade.config import load_config
    from megatron_cascade.config.lineage import rl_samples_per_domain, stage_lineage
    from megatron_cascade.config.loader import start_stage

    cascade = load_config(str(EXAMPLE / "cascade.yaml"), overrides)
    stages = [StageResult(s.name, s.type, start_stage(cascade, i), {}, teachers=dict(s.teachers))
              for i, s in enumerate(cascade.stages)]
    end = cascade_end(stages, {s.name: list(s.domains) for s in cascade.stages})
    return rl_samples_per_domain(cascade, stage_lineage(cascade, end.name))


def equal_data_mixed_stage(overrides: list[str]) -> dict:
    """The mixed-RL stage on the cascade's data (:func:`cascade_data`): mixed.yaml's RL batch (prompts x
    samples per step), as many steps as that many responses take and domain weights in their ratio."""
    from megatron_cascade.config import load_config

    samples = cascade_data(overrides)
    mixed = [s for s in load_config(str(EXAMPLE / "mixed.yaml"), run_level(overrides)).stages if s.type != "sft"]
    if len(mixed) != 1:
        raise SystemExit(f"mixed.yaml must have one RL stage, has {[s.name for s in mixed]}")
    batch = mixed[0].prompts_per_step * mixed[0].samples_per_prompt
    steps = round(sum(samples.values()) / batch)
    unit = math.gcd(*(round(v) for v in samples.values()))
    return {"name": mixed[0].name, "type": mixed[0].type, "steps": steps, "prompts_per_step": mixed[0].prompts_per_step,
            "samples_per_prompt": mixed[0].samples_per_prompt,
            "domains": {d: round(v) // unit for d, v in sorted(samples.items())}}


def mixed_from_sft(folder: str, cascade_out: str, overrides: list[str]) -> Path:
    """A config of the equal-data mixed-RL stage only, starting from the cascade run's SFT weights."""
    stage = equal_data_mixed_stage(overrides)
    path = Path(folder + ".yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fields = ", ".join(f"{k}: {v}" for k, v in stage.items())
    path.write_text(f"defaults: [{EXAMPLE / 'mixed.yaml'}]\n"
                    f"init_checkpoint: {os.path.abspath(os.path.join(cascade_out, 'stages', 'sft', 'final'))}\n"
                    f"stages:\n  - {{{fields}}}\n")
    return path


def finished(out: str) -> bool:
    """Whether the run in ``out`` completed every stage it lists (a running or interrupted one has a
    manifest too)."""
    from megatron_cascade.cascade.manifest import Manifest

    if not os.path.isfile(os.path.join(out, "manifest.json")):
        return False
    data = Manifest(out).data
    order = data.get("stage_order") or list(data["stages"])
    return bool(order) and all(data["stages"].get(name, {}).get("status") == "complete" for name in order)


def mean_se(values: list[float], signed: bool = False) -> str:
    """``mean±se`` over seeds (the SE is the sample std / sqrt(n); only the mean with one value)."""
    if not values:
        return "-"
    mean = statistics.fmean(values)
    text = f"{mean:+.2f}" if signed else f"{mean:.2f}"
    if len(values) < 2:
        return text
    return f"{text}±{statistics.stdev(values) / math.sqrt(len(values)):.2f}"


def _delta(results: dict[str, StageResult], stage: StageResult, domain: str) -> Optional[float]:
    start = results.get(stage.start) if stage.start else None
    if start is None or domain not in start.scores or domain not in stage.scores:
        return None
    return stage.scores[domain] - start.scores[domain]


def stage_table(runs: list[list[StageResult]]) -> list[str]:
    """Per stage x domain: score (change from the start weights), mean ± SE over seeds."""
    stages = [r.name for r in runs[0]]
    domains = sorted({d for r in runs[0] for d in r.scores})
    lines = [f"{'stage':<10}{'type':<6}" + "".join(f"{d:>30}" for d in domains)]
    for i, name in enumerate(stages):
        cells = []
        for d in domains:
            scores = [run_[i].scores[d] for run_ in runs if d in run_[i].scores]
            deltas = [x for x in (_delta({r.name: r for r in run_}, run_[i], d) for run_ in runs) if x is not None]
            cells.append(mean_se(scores) + (f" ({mean_se(deltas, signed=True)})" if deltas else ""))
        lines.append(f"{name:<10}{runs[0][i].type:<6}" + "".join(f"{c:>30}" for c in cells))
    return lines


def gains_table(runs: list[list[StageResult]], domains_of: dict[str, list[str]]) -> list[str]:
    """Each GRPO stage's change on its own domains, and that change over the eval's SE, per seed."""
    lines = [f"{'stage':<10}{'domain':<24}{'gain':>12}{'gain / eval SE':>18}  per seed"]
    for i, stage in enumerate(runs[0]):
        if stage.type != "grpo":
            continue
        for d in domains_of.get(stage.name, []):
            gains, ratios = [], []
            for run_ in runs:
                by_name = {r.name: r for r in run_}
                delta = _delta(by_name, run_[i], d)
                if delta is None:
                    continue
                se = math.hypot(run_[i].se.get(d, 0.0), by_name[run_[i].start].se.get(d, 0.0))
                gains.append(delta)
                ratios.append(delta / se if se > 0 else float("inf"))
            per_seed = " ".join(f"{g:+.2f}/{r:.0f}SE" for g, r in zip(gains, ratios))
            lines.append(f"{stage.name:<10}{d:<24}{mean_se(gains, signed=True):>12}{mean_se(ratios):>18}  {per_seed}")
    return lines


def mixed_table(cascades: list[list[StageResult]], mixed: list[list[StageResult]], mixed_outs: list[str],
                domains_of: dict[str, list[str]]) -> list[str]:
    """Per domain: the SFT score, the cascade's score right after the GRPO stage for that domain alone,
    at the cascade's end (what later stages left of it) and mixed RL's end; then each run's drop from
    the domain's own best (cascade: its own stage; mixed: its best periodic eval). ``cascades[i]`` and
    ``mixed[i]`` are one seed's runs: the cascade's end minus mixed RL's is paired per seed."""
    domains = sorted({d for r in cascades[0] for d in r.scores})
    lines = [f"{'domain':<24}{'SFT':>12}{'own stage':>22}{'cascade end':>14}{'mixed RL end':>14}"
             f"{'cascade - mixed':>17}{'cascade drop':>14}{'mixed drop':>12}"]
    mixed_curves = [eval_curves(out) for out in mixed_outs]
    ends = [cascade_end(run_, domains_of) for run_ in cascades]
    for d in domains:
        own = next((i for i, r in enumerate(cascades[0]) if r.type == "grpo" and domains_of.get(r.name) == [d]), None)
        sft = [run_[0].scores[d] for run_ in cascades if d in run_[0].scores]
        after = [run_[own].scores[d] for run_ in cascades] if own is not None else []
        end = [s.scores[d] for s in ends if d in s.scores]
        mix = [run_[-1].scores[d] for run_ in mixed if d in run_[-1].scores]
        best = [max(score for step, score in curves[run_[-1].name][d] if step > 0)  # step 0: its start
                for run_, curves in zip(mixed, mixed_curves) if d in curves.get(run_[-1].name, {})]
        label = f"{mean_se(after)} ({cascades[0][own].name})" if own is not None else "-"
        cascade_drop = [a - e for a, e in zip(after, end)]
        mixed_drop = [b - e for b, e in zip(best, mix)]
        lines.append(f"{d:<24}{mean_se(sft):>12}{label:>22}{mean_se(end):>14}{mean_se(mix):>14}"
                     f"{mean_se([e - m for e, m in zip(end, mix)], signed=True):>17}"
                     f"{mean_se(cascade_drop):>14}{mean_se(mixed_drop):>12}")
    return lines


def _grpo_beside(mopd: StageResult, stages: list[StageResult], domains_of: dict[str, list[str]]) -> Optional[StageResult]:
    """The GRPO stage compared with ``mopd``: the same start weights and the same domains."""
    return next((s for s in stages if s.type == "grpo" and s.start == mopd.start
                 and sorted(domains_of[s.name]) == sorted(domains_of[mopd.name])), None)


def cascade_end(stages: list[StageResult], domains_of: dict[str, list[str]]) -> StageResult:
    """The stage whose weights are the cascade's result: its last stage that is not the GRPO
    comparison beside a MOPD stage (:func:`_grpo_beside`; the recipe places MOPD last, the
    comparison may run after it)."""
    beside = {g.name for m in stages if m.teachers for g in [_grpo_beside(m, stages, domains_of)] if g is not None}
    return [s for s in stages if s.name not in beside][-1]


def mopd_vs_grpo(outs: list[str], runs: list[list[StageResult]], domains_of: dict[str, list[str]]) -> list[str]:
    """Steps to teacher level (within TOLERANCE) for each MOPD stage and the GRPO stage that starts
    from the same weights on the same domains."""
    lines = [f"{'domain':<24}{'teacher':>12}{'MOPD steps':>18}{'GRPO steps':>18}{'MOPD end':>12}{'GRPO end':>12}"
             f"{'MOPD - GRPO, mid':>18}{'end':>12}"]
    first = runs[0]
    for mopd in (s for s in first if s.teachers):
        grpo = _grpo_beside(mopd, first, domains_of)
        for d, teacher in sorted(mopd.teachers.items()):
            cols = {"teacher": [], "mopd": [], "grpo": [], "mopd_end": [], "grpo_end": [], "mid": [], "end": []}
            for out, run_ in zip(outs, runs):
                by_name = {r.name: r for r in run_}
                level = by_name[teacher].scores[d]
                curves = eval_curves(out)
                cols["teacher"].append(level)
                cols["mopd_end"].append(by_name[mopd.name].scores[d])
                cols["mopd"].append(steps_to_level(curves.get(mopd.name, {}).get(d, []), level, TOLERANCE))
                if grpo is not None:
                    cols["grpo_end"].append(by_name[grpo.name].scores[d])
                    cols["grpo"].append(steps_to_level(curves.get(grpo.name, {}).get(d, []), level, TOLERANCE))
                    cols["end"].append(cols["mopd_end"][-1] - cols["grpo_end"][-1])
                    mid = _midpoint_difference(curves.get(mopd.name, {}).get(d, []), curves.get(grpo.name, {}).get(d, []))
                    if mid is not None:
                        cols["mid"].append(mid)

            def steps(values: list[Optional[int]]) -> str:
                return " ".join("-" if v is None else str(v) for v in values) or "n/a"

            lines.append(f"{d:<24}{mean_se(cols['teacher']):>12}{steps(cols['mopd']):>18}{steps(cols['grpo']):>18}"
                         f"{mean_se(cols['mopd_end']):>12}{mean_se(cols['grpo_end']):>12}"
                         f"{mean_se(cols['mid'], signed=True):>18}{mean_se(cols['end'], signed=True):>12}")
        lines.append(f"(MOPD stage {mopd.name!r}, GRPO stage {grpo.name if grpo else None!r}, both from "
                     f"{mopd.start!r}; steps per seed)")
    return lines


def _band(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean, SE) over seeds at the steps every seed's curve has."""
    steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves))) if curves else []
    means, ses = [], []
    for step in steps:
        values = [dict(c)[step] for c in curves]
        means.append(statistics.fmean(values))
        ses.append(statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)
    return steps, means, ses


def write_claims_png(path: str, outs: list[str], cascades: list[list[StageResult]],
                     mixed: list[list[StageResult]], domains_of: dict[str, list[str]]) -> str:
    """The claims as an image: per domain, bars of SFT / own GRPO stage / cascade end / mixed-RL end
    (mean ± SE over seeds); per MOPD domain, MOPD vs GRPO held-out curves with seed bands (± SE) and
    the teacher's level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = cascades[0]
    domains = sorted({d for r in first for d in r.scores})
    mopd = next((s for s in first if s.teachers), None)
    grpo = _grpo_beside(mopd, first, domains_of) if mopd else None
    taught = sorted(mopd.teachers) if mopd else []
    fig, axes = plt.subplots(1, 1 + len(taught), figsize=(6.5 + 4.5 * len(taught), 4.6), squeeze=False)
    bars = axes[0][0]
    own = {d: next((i for i, r in enumerate(first) if r.type == "grpo" and domains_of.get(r.name) == [d]), None)
           for d in domains}
    ends = [cascade_end(run_, domains_of) for run_ in cascades]
    series = {"SFT": [[run_[0].scores.get(d) for run_ in cascades] for d in domains],
              "own GRPO stage": [[run_[own[d]].scores[d] for run_ in cascades] if own[d] is not None else []
                                 for d in domains],
              "cascade end": [[end.scores.get(d) for end in ends] for d in domains],
              "mixed RL end": [[run_[-1].scores.get(d) for run_ in mixed] for d in domains]}
    width = 0.8 / len(series)
    for k, (label, per_domain) in enumerate(series.items()):
        values = [[v for v in vs if v is not None] for vs in per_domain]
        means = [statistics.fmean(v) if v else float("nan") for v in values]
        errors = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in values]
        bars.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(domains))], means, width,
                 yerr=errors, capsize=2, label=label)
    bars.set_xticks(range(len(domains)), domains, rotation=10)
    bars.set_ylim(0, 1)
    bars.set_ylabel("held-out score")
    bars.set_title(f"cascade ({len(cascades)} seeds) vs mixed RL ({len(mixed)} seeds), ± SE")
    bars.legend(fontsize=7)
    all_curves = [eval_curves(out) for out in outs]
    for ax, domain in zip(axes[0][1:], taught):
        for stage, color in ((mopd, "C0"), (grpo, "C1")):
            if stage is None:
                continue
            steps, means, ses = _band([c[stage.name][domain] for c in all_curves if domain in c.get(stage.name, {})])
            ax.plot(steps, means, marker="o", markersize=3, color=color, label=f"{stage.name} ({stage.type})")
            ax.fill_between(steps, [m - e for m, e in zip(means, ses)], [m + e for m, e in zip(means, ses)],
                            color=color, alpha=0.25)
        level = statistics.fmean({r.name: r for r in run_}[mopd.teachers[domain]].scores[domain] for run_ in cascades)
        ax.axhline(level, color="k", linewidth=0.8, label=f"teacher {mopd.teachers[domain]}")
        ax.axhspan(level - TOLERANCE, level, color="k", alpha=0.08)
        ax.set_xlabel("stage step")
        ax.set_ylim(0, 1)
        ax.set_title(f"{domain}: MOPD vs GRPO from {mopd.start}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _midpoint_difference(mopd: list[tuple[int, float]], grpo: list[tuple[int, float]]) -> Optional[float]:
    """MOPD's score minus GRPO's at the periodic eval nearest the middle of the stage (both curves')."""
    common = sorted(set(dict(mopd)) & set(dict(grpo)) - {0})
    if not common:
        return None
    middle = min(common, key=lambda step: abs(step - common[-1] / 2))
    return dict(mopd)[middle] - dict(grpo)[middle]


def stage_domains(config: Path, overrides: list[str]) -> dict[str, list[str]]:
    """stage name -> the domains it trains on (from the config)."""
    from megatron_cascade.config import load_config

    cfg = load_config(str(config), overrides)
    return {s.name: list(s.domains) for s in cfg.stages}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2, 3, 4])
    parser.add_argument("--out", default=str(ROOT / "outputs" / "claims"))
    parser.add_argument("--no-run", action="store_true", help="only print the tables of finished runs")
    parser.add_argument("--no-mixed", action="store_true", help="skip the mixed-RL baseline")
    parser.add_argument("--readme", metavar="PATH",
                        help=f"also write the tables into PATH between its {README_BEGIN!r} and {README_END!r} lines")
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs (key=value)")
    args = parser.parse_args(argv)
    cascade_outs = [os.path.join(args.out, f"cascade_seed{s}") for s in args.seeds]
    mixed_outs = [os.path.join(args.out, f"mixed_seed{s}") for s in args.seeds]
    if not args.no_run:
        for seed, c_out, m_out in zip(args.seeds, cascade_outs, mixed_outs):
            run(EXAMPLE / "cascade.yaml", c_out, seed, args.overrides)
            if not args.no_mixed:
                run(mixed_from_sft(m_out, c_out, args.overrides), m_out, seed, run_level(args.overrides))
    finished_cascades = {o: stage_results(o) for o in cascade_outs if finished(o)}  # each manifest read once
    cascade_seeds = [s for s, o in zip(args.seeds, cascade_outs) if o in finished_cascades]
    done, cascades = list(finished_cascades), list(finished_cascades.values())
    if not cascades or any(len(r) != len(cascades[0]) for r in cascades):
        raise SystemExit(f"no finished cascade run (or runs with different stages) under {args.out} (seeds {args.seeds})")
    domains_of = stage_domains(EXAMPLE / "cascade.yaml", args.overrides)
    out = [f"seeds {cascade_seeds}: mean ± standard error over seeds"
           + (f" (not finished: {sorted(set(args.seeds) - set(cascade_seeds))})" if len(cascade_seeds) < len(args.seeds) else ""),
           ""]
    out += stage_table(cascades)
    out += ["", "GRPO stages on their own domains (gain / SE: the change over the eval's standard error)", ""]
    out += gains_table(cascades, domains_of)
    paired = [(s, c, m) for s, c, m in zip(args.seeds, cascade_outs, mixed_outs) if c in finished_cascades and finished(m)]
    mixed_seeds = [s for s, _, _ in paired]
    mixed_done = [m for _, _, m in paired]
    mixed = [stage_results(m) for m in mixed_done]
    if mixed:
        stage = equal_data_mixed_stage(args.overrides)
        out += ["", f"forgetting: the cascade (its end: {cascade_end(cascades[0], domains_of).name}) vs mixed RL on "
                "the same RL data (responses per domain of the stages the "
                f"cascade's end comes from, {', '.join(f'{d} {n:.0f}' for d, n in sorted(cascade_data(args.overrides).items()))}; "
                f"mixed RL: {stage['steps']} steps of {stage['prompts_per_step']} x {stage['samples_per_prompt']}, "
                f"domain weights {stage['domains']}; seeds {mixed_seeds})", ""]
        out += mixed_table([finished_cascades[c] for _, c, _ in paired], mixed, mixed_done, domains_of)
    out += ["", f"MOPD vs GRPO: stage steps to within {TOLERANCE} of the teacher's held-out score", ""]
    out += mopd_vs_grpo(done, cascades, domains_of)
    print("\n" + "\n".join(out))
    print("\nwrote", write_claims_png(os.path.join(args.out, "claims.png"), done, cascades, mixed, domains_of))
    if args.readme:
        print("wrote", write_readme_block(args.readme, out))


def write_readme_block(path: str, lines: list[str]) -> str:
    """Put ``lines`` as a code block between the ``README_BEGIN`` and ``README_END`` markers of the
    markdown file ``path`` (what is between them is replaced; the rest is kept byte for byte)."""
    text = Path(path).read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin or text.count(README_BEGIN) != 1 or text.count(README_END) != 1:
        raise SystemExit(f"{path}: needs one {README_BEGIN!r} line followed by one {README_END!r} line")
    block = "\n".join(["", "```", *(line.rstrip() for line in lines), "```", ""])
    Path(path).write_text(text[:begin + len(README_BEGIN)] + block + text[end:])
    return path


if __name__ == "__main__":
    main()
