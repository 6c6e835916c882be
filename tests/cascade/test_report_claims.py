"""The report reads a run's manifest and metrics: each score with its standard error and its change
from the weights the stage started from (``init_from``, not the row above), pass@k, the held-out
curves of stages evaluated during training (e.g. MOPD vs GRPO from the same weights) with their
teachers' levels, and the step at which a curve reaches a teacher."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from megatron_cascade.cascade.manifest import Manifest
from megatron_cascade.cascade.report import (
    eval_curves,
    format_table,
    stage_results,
    steps_to_level,
    teacher_levels,
    write_report_png,
)


def _stage(kind, scores, se, init_from=None, teachers=None, steps=10):
    record = {"status": "complete", "type": kind, "steps": steps, "final_weights": "x", "eval": scores,
              "eval_se": se, "eval_pass_at_k": {d: min(1.0, v + 0.4) for d, v in scores.items()}, "eval_k": 8}
    if init_from:
        record["init_from"] = init_from
    if teachers:
        record["teachers"] = teachers
    return record


EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_cascade"


@pytest.fixture(scope="module")
def claims():
    """benchmarks/claims.py as a module."""
    spec = importlib.util.spec_from_file_location("claims", Path(__file__).parents[2] / "benchmarks" / "claims.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run_dir(tmp_path):
    out = str(tmp_path)
    manifest = Manifest(out)
    manifest.record("stage_order", ["sft", "a_rl", "b_rl", "mopd", "grpo_ref"])
    manifest.record_stage("sft", _stage("sft", {"a": 0.30, "b": 0.20}, {"a": 0.02, "b": 0.03}))
    manifest.record_stage("a_rl", _stage("grpo", {"a": 0.80, "b": 0.18}, {"a": 0.03, "b": 0.03}, "sft"))
    manifest.record_stage("b_rl", _stage("grpo", {"a": 0.75, "b": 0.70}, {"a": 0.03, "b": 0.04}, "a_rl"))
    manifest.record_stage("mopd", _stage("mopd", {"a": 0.79, "b": 0.69}, {"a": 0.03, "b": 0.04}, "sft",
                                         teachers={"a": "a_rl", "b": "b_rl"}))
    manifest.record_stage("grpo_ref", _stage("grpo", {"a": 0.60, "b": 0.40}, {"a": 0.03, "b": 0.04}, "sft"))
    for stage, curve in (("mopd", {5: (0.6, 0.5), 10: None}), ("grpo_ref", {5: (0.4, 0.25), 10: None})):
        os.makedirs(os.path.join(out, "stages", stage))
        with open(os.path.join(out, "stages", stage, "metrics.jsonl"), "w") as f:
            for step in range(1, 11):
                row = {"step": step, "reward/mean": 0.1 * step}
                if curve.get(step):
                    row.update({"eval/a": curve[step][0], "eval/b": curve[step][1]})
                f.write(json.dumps(row) + "\n")
    return out


def test_table_shows_se_and_the_change_from_the_init_stage(run_dir):
    lines = format_table(run_dir).splitlines()
    mopd = next(line for line in lines if line.startswith("mopd"))
    # mopd started from sft (init_from), not from b_rl (the row above): +0.49 on a, +0.49 on b
    assert "0.79±0.03 (+0.49)" in mopd and "0.69±0.04 (+0.49)" in mopd and " sft " in mopd
    b_rl = next(line for line in lines if line.startswith("b_rl"))
    assert "0.75±0.03 (-0.05)" in b_rl  # b_rl's effect on the other domain: forgetting
    assert any(line.startswith("pass@8") for line in lines)


def test_curves_start_at_the_init_stage_and_end_at_the_final_eval(run_dir):
    curves = eval_curves(run_dir)
    assert set(curves) == {"mopd", "grpo_ref"}
    assert curves["mopd"]["a"] == [(0, 0.30), (5, 0.6), (10, 0.79)]
    assert curves["grpo_ref"]["b"] == [(0, 0.20), (5, 0.25), (10, 0.40)]
    assert teacher_levels(run_dir, "mopd") == {"a": 0.80, "b": 0.70}


def test_steps_to_teacher_level():
    curve = [(0, 0.3), (5, 0.6), (10, 0.78)]
    assert steps_to_level(curve, 0.80) == 10
    assert steps_to_level(curve, 0.62) == 5
    assert steps_to_level(curve, 0.90) is None


def test_a_manifest_without_init_from_counts_from_the_previous_stage(run_dir):
    manifest = Manifest(run_dir)
    del manifest.data["stages"]["mopd"]["init_from"]
    manifest.save()
    assert [r.start for r in stage_results(run_dir)] == [None, "sft", "a_rl", "b_rl", "sft"]


def test_png_has_the_curve_panel(run_dir):
    path = write_report_png(run_dir)
    assert os.path.getsize(path) > 10_000


def test_claims_tables_from_finished_runs(run_dir, claims):
    runs = [stage_results(run_dir)] * 2
    domains = {"sft": ["a", "b"], "a_rl": ["a"], "b_rl": ["b"], "mopd": ["a", "b"], "grpo_ref": ["a", "b"]}
    gains = "\n".join(claims.gains_table(runs, domains))
    assert "a_rl" in gains and "+0.50" in gains  # 0.80 - 0.30
    lines = claims.mopd_vs_grpo([run_dir] * 2, runs, domains)
    a = next(line for line in lines if line.startswith("a "))
    assert "10 10" in a and "- -" in a  # MOPD within 0.03 of 0.80 at step 10; GRPO never
    # MOPD minus GRPO, paired per seed: at step 5 (the stage's middle) 0.6 - 0.4, at the end 0.79 - 0.60
    assert a.split()[-2:] == ["+0.20±0.00", "+0.19±0.00"], a
    png = claims.write_claims_png(os.path.join(run_dir, "claims.png"), [run_dir] * 2, runs, [], domains)
    assert os.path.getsize(png) > 10_000


def test_claims_mixed_table_puts_the_cascade_next_to_mixed_rl(run_dir, tmp_path, claims):
    mixed = tmp_path / "mixed"
    manifest = Manifest(str(mixed))
    manifest.record("stage_order", ["mixed_rl"])
    manifest.record_stage("mixed_rl", _stage("grpo", {"a": 0.55, "b": 0.50}, {"a": 0.03, "b": 0.03}))
    domains = {"sft": ["a", "b"], "a_rl": ["a"], "b_rl": ["b"], "mopd": ["a", "b"], "grpo_ref": ["a", "b"]}
    os.makedirs(mixed / "stages" / "mixed_rl")
    (mixed / "stages" / "mixed_rl" / "metrics.jsonl").write_text(
        json.dumps({"step": 5, "eval/a": 0.65, "eval/b": 0.45}) + "\n")  # its best on a, before its end
    lines = claims.mixed_table([stage_results(run_dir)], [stage_results(str(mixed))], [str(mixed)], domains)
    a = next(line for line in lines if line.startswith("a "))
    # SFT 0.30, after a_rl 0.80, the cascade's end 0.79 (mopd: grpo_ref, the last stage, is its
    # comparison), mixed 0.55, the cascade minus mixed +0.24; drops from each run's own best: the
    # cascade 0.80 - 0.79, mixed 0.65 - 0.55
    assert a.split()[1:] == ["0.30", "0.80", "(a_rl)", "0.79", "0.55", "+0.24", "0.01", "0.10"]


def test_the_cascade_end_is_its_last_stage_but_the_grpo_comparison(run_dir, claims):
    """The comparison beside MOPD (a GRPO stage from MOPD's start on MOPD's domains) is not the
    cascade, wherever it runs; any other last stage is its end."""
    runs = stage_results(run_dir)
    domains = {"sft": ["a", "b"], "a_rl": ["a"], "b_rl": ["b"], "mopd": ["a", "b"], "grpo_ref": ["a", "b"]}
    assert claims.cascade_end(runs, domains).name == "mopd"
    assert claims.cascade_end([runs[i] for i in (0, 1, 2, 4, 3)], domains).name == "mopd"
    assert claims.cascade_end(runs, {**domains, "grpo_ref": ["a"]}).name == "grpo_ref"  # other domains
    assert claims.cascade_end(runs[:3] + runs[4:], domains).name == "grpo_ref"  # no MOPD beside it


def test_the_curve_panel_compares_mopd_with_grpo_from_the_same_start(run_dir):
    from megatron_cascade.cascade.report import comparison

    os.makedirs(os.path.join(run_dir, "stages", "a_rl"))
    with open(os.path.join(run_dir, "stages", "a_rl", "metrics.jsonl"), "w") as f:  # a curve of another stage
        f.write(json.dumps({"step": 5, "eval/a": 0.5}) + "\n")
    curves = eval_curves(run_dir)
    assert set(curves) == {"mopd", "grpo_ref", "a_rl"}
    assert set(comparison(run_dir, curves)) == {"mopd", "grpo_ref"}


def test_claims_mixed_config_starts_from_the_cascade_sft_with_a_relative_out(tmp_path, monkeypatch, claims):
    """``--out outputs/claims`` (relative, as the docstring runs it): the mixed config, written inside
    that folder, must still name the cascade's SFT weights (a relative path there would be read
    against the config's own folder: outputs/claims/outputs/claims/...)."""
    from megatron_cascade.config import load_config

    monkeypatch.chdir(tmp_path)
    config = claims.mixed_from_sft(os.path.join("outputs", "claims", "mixed_seed1"),
                                   os.path.join("outputs", "claims", "cascade_seed1"), [])
    cfg = load_config(str(config))
    assert cfg.init_checkpoint == str(tmp_path / "outputs" / "claims" / "cascade_seed1" / "stages" / "sft" / "final")


def test_the_mixed_baseline_samples_the_cascades_data(tmp_path, claims):
    """Equal terms: mixed RL samples as many responses per domain as the RL stages the cascade's end
    (mopd) comes from (if_rl, math_rl, code_rl, mopd; not grpo_ref, which runs last), and the
    committed mixed.yaml is the stage claims.py derives (before, mixed RL sampled 3.3x the cascade's
    code responses)."""
    from megatron_cascade.config import load_config
    from megatron_cascade.config.lineage import rl_samples_per_domain

    cascade = load_config(str(EXAMPLE / "cascade.yaml"))
    assert cascade.stages[-1].name == "grpo_ref"
    lineage = ["sft", "if_rl", "math_rl", "code_rl", "mopd"]
    wanted = rl_samples_per_domain(cascade, lineage)
    assert wanted == {"instruction_following": 14336, "math": 14336, "code": 4608}
    stage = claims.equal_data_mixed_stage([])
    mixed = rl_samples_per_domain(load_config(str(claims.mixed_from_sft(str(tmp_path / "m"), str(tmp_path / "c"), []))),
                                  ["mixed_rl"])
    assert mixed == pytest.approx(wanted)
    committed = next(s for s in load_config(str(EXAMPLE / "mixed.yaml")).stages if s.name == "mixed_rl")
    assert {k: getattr(committed, k) for k in ("steps", "prompts_per_step", "samples_per_prompt")} == {
        k: stage[k] for k in ("steps", "prompts_per_step", "samples_per_prompt")}
    assert dict(committed.domains) == stage["domains"]
    # Overrides reach the derivation: a longer code stage buys mixed RL as much more code.
    longer = claims.equal_data_mixed_stage(["stages.3.steps=80"])
    assert longer["steps"] == 260 + 40 * 8 * 8 // 128
    assert longer["domains"] == {"code": 1, "instruction_following": 2, "math": 2}  # 7,168 code : 14,336 each


def test_readme_block_is_written_by_the_benchmark(run_dir, tmp_path, monkeypatch, claims):
    """``--no-run --readme``: the printed tables of the finished runs (a running one has a manifest too)
    replace what lies between README's markers, the rest of the file is kept; the committed README has
    the markers (once), and a file without them is refused untouched."""
    readme = Path(__file__).parents[2] / "README.md"
    text = readme.read_text()
    assert text.count(claims.README_BEGIN) == 1 and text.count(claims.README_END) == 1
    assert text.index(claims.README_BEGIN) < text.index(claims.README_END)
    out = tmp_path / "out"
    os.makedirs(out)
    os.symlink(run_dir, out / "cascade_seed7")
    for running in ("cascade_seed8", "mixed_seed7"):
        Manifest(str(out / running)).record("stage_order", ["sft", "mixed_rl"])
    monkeypatch.setattr(claims, "stage_domains", lambda config, overrides: {  # the fixture's stages
        "sft": ["a", "b"], "a_rl": ["a"], "b_rl": ["b"], "mopd": ["a", "b"], "grpo_ref": ["a", "b"]})
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{claims.README_BEGIN}\nold table\n{claims.README_END}\nafter\n")
    claims.main(["--seeds", "7", "8", "--out", str(out), "--no-run", "--readme", str(doc)])
    written = doc.read_text()
    assert "old table" not in written
    assert written.startswith(f"before\n{claims.README_BEGIN}\n```\nseeds [7]: mean ± standard error over seeds "
                              "(not finished: [8])\n")
    assert "forgetting" not in written  # mixed_seed7 is still running
    assert written.endswith(f"```\n{claims.README_END}\nafter\n")
    assert "MOPD vs GRPO" in written and "a_rl" in written
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        claims.write_readme_block(str(plain), ["x"])
    assert plain.read_text() == "no markers\n"
