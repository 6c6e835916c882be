"""Conversion copies a checkpoint's side files only when they are regular files inside it (red-team
issue 29: a downloaded checkpoint's ``tokenizer.json`` linking to a private key or to
``/proc/self/environ`` landed that file in the converted checkpoint). The Hugging Face cache's own
links (``snapshots/<rev>/x -> ../../blobs/<hash>``) still work."""

from __future__ import annotations

import os

import pytest

from megatron_cascade.models.errors import ConversionError
from megatron_cascade.convert.hf_files import copy_directory_files, copy_side_files


@pytest.mark.parametrize("target", ["secret", "/proc/self/environ"])
def test_a_side_file_linking_outside_the_checkpoint_is_refused_and_nothing_is_copied(tmp_path, target):
    src, out = tmp_path / "model", tmp_path / "out"
    src.mkdir()
    (tmp_path / "secret").write_text("PRIVATE KEY")
    (src / "tokenizer_config.json").write_text("{}")
    os.symlink(tmp_path / target if target == "secret" else target, src / "tokenizer.json")
    with pytest.raises(ConversionError, match="leads outside the checkpoint"):
        copy_side_files(str(src), str(out))
    with pytest.raises(ConversionError, match="leads outside the checkpoint"):
        copy_directory_files(str(src), str(out))
    assert not out.exists()


def test_hf_cache_links_and_plain_files_are_copied(tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "f00d").write_text('{"model": "tok"}')
    os.symlink("../../blobs/f00d", snapshot / "tokenizer.json")
    (snapshot / "generation_config.json").write_text("{}")
    names = copy_side_files(str(snapshot), str(tmp_path / "out"))
    assert set(names) == {"tokenizer.json", "generation_config.json"}
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "tok"}'
    assert not (tmp_path / "out" / "tokenizer.json").is_symlink()
