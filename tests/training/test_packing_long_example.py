"""The long-context example (examples/tiny_cascade/long.yaml) and its data: reproducible, loadable,
packed and recomputed; the recipe's long-context stage packs."""

import importlib.util
from pathlib import Path

from megatron_cascade.config.loader import load_config, resolve_stage

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = EXAMPLES / "tiny_cascade"


def _make_data():
    spec = importlib.util.spec_from_file_location("tiny_cascade_make_data_long", TINY / "make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_long_data_is_what_make_data_generates(tmp_path):
    _make_data().main(["--long", "--out", str(tmp_path), "--seed", "0"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"long_context_{s}.jsonl" for s in ("eval", "sft", "train")]
    for name in names:
        assert (tmp_path / name).read_bytes() == (TINY / "data" / name).read_bytes(), \
            f"{name} is stale: rerun python examples/tiny_cascade/make_data.py --long"


def test_long_prompts_hide_the_key_in_1k_to_2k_tokens():
    rows = _make_data().make_long_context(0)
    for split, split_rows in rows.items():
        for row in split_rows:
            assert 1000 <= len(row["prompt"]) <= 2000
            assert f"key={row['answer']}." in row["prompt"] and row["prompt"].endswith(" what is key?")
            assert row["response"] == row["answer"] or (split == "sft" and row.get("habit"))
    assert not any(r.get("habit") for split in ("train", "eval") for r in rows[split])


def test_long_yaml_trains_packed_and_recomputed():
    cfg = load_config(str(TINY / "long.yaml"))
    assert cfg.training.sequence_packing and cfg.training.max_tokens_per_row == 8192
    assert cfg.model.recompute == "full"
    assert cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens < cfg.model.max_position_embeddings
    recipe = load_config(str(EXAMPLES / "nemotron_cascade2" / "05_long_context_rl.yaml"), check_paths=False)
    stage = resolve_stage(recipe, recipe.stages[0])  # packing is the stage's (as in cascade.yaml)
    assert stage.training.sequence_packing and stage.training.max_tokens_per_row == 81920
    assert recipe.training.micro_batch_size == 1  # base.yaml's, kept
