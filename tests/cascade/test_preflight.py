"""Everything a run will need is checked before it writes anything or takes a step (issue 28): every
stage's data files, eval files, ``init_checkpoint``, ``--stage`` and the stages it needs complete —
all problems in one error, and ``output_dir`` not created."""

from __future__ import annotations

from cascade_fixtures import run_cli, write_short_config


def test_every_problem_of_every_stage_in_one_report_before_output_dir_exists(tmp_path):
    """Before: a later stage's missing file surfaced when that stage started, --stage was checked after
    output_dir was created, only the first problem was reported, a problem did not say where its value
    came from, and a row's tool the config does not map failed only when its episode started."""
    out = tmp_path / "out"
    tool_rows = tmp_path / "tool_eval.jsonl"
    tool_rows.write_text('{"prompt": "1+1?", "answer": "2", "tools": [{"name": "os:system"}]}\n')
    extra = f"domains:\n  tool:\n    eval: {tool_rows}\n    environment: {{name: tool_calling}}\n" \
            f"    reward: {{name: tool_calling}}\n"
    config = write_short_config(str(tmp_path), str(out), extra=extra)
    tool_line = open(config).read().splitlines().index(f"    eval: {tool_rows}") + 1
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"answer": "3"}\n{not json\n')
    typo = f"domains.instruction_following.train={tmp_path / 'typo.jsonl'}"
    res = run_cli("run", config, typo, f"domains.math.train={bad_rows}", "--stage", "mopd", timeout=180)
    assert res.returncode == 2, res.stdout[-3000:]
    text = res.stdout
    assert "the run cannot start; nothing was written" in text and "Traceback" not in text, text[-3000:]
    for words in ("--stage mopd: it needs stage 'if_rl' complete",  # its init_from and a teacher
                  "--stage mopd: it needs stage 'sft' complete",  # a teacher
                  f"command-line override {typo!r}: domains.instruction_following.train: "
                  f"{tmp_path / 'typo.jsonl'}: cannot open data file",
                  f"command-line override 'domains.math.train={bad_rows}': domains.math.train: {bad_rows}:1: ",
                  f"{config}:{tool_line}: domains.tool.eval: {tool_rows}:1: the row declares tool 'os:system'"):
        assert words in text, text[-3000:]
    assert not out.exists()
    typo = run_cli("run", config, "--stage", "mopdd", timeout=180)
    assert typo.returncode == 2 and "--stage 'mopdd': no such stage" in typo.stdout and not out.exists(), typo.stdout
