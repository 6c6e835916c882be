"""Non-weight files of a Hugging Face checkpoint: config.json and the tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from megatron_cascade.models.errors import ConversionError

CONFIG_FILE = "config.json"
# Copied verbatim when present (tokenizers of Llama 3 / Qwen: tokenizer.json; older: vocab + merges).
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
)
# Inside a Megatron checkpoint made by hf-to-megatron: the source config + tokenizer, used on export.
HF_SUBDIR = "hf"


def read_hf_config(directory: str) -> tuple[dict[str, Any], str]:
    """(config dict, path) of ``directory/config.json``."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConversionError(f"{directory} is not a Hugging Face checkpoint: {CONFIG_FILE} missing")
    try:
        with open(path) as f:
            return json.load(f), path
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc


def write_hf_config(directory: str, config: dict[str, Any]) -> None:
    """Write ``config.json`` (sorted keys, as transformers does)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def copy_side_files(src: str, dst: str, *, include_config: bool = False) -> list[str]:
    """Copy the tokenizer/generation files (and optionally config.json) present in ``src``; returns their names.

    Raises:
        ConversionError: a side file is not a regular file inside the checkpoint (see :func:`checked_file`).
    """
    wanted = SIDE_FILES + ((CONFIG_FILE,) if include_config else ())
    names = [n for n in wanted if os.path.lexists(os.path.join(src, n))]
    sources = [checked_file(src, name) for name in names]  # every one checked before anything is written
    if names:
        os.makedirs(dst, exist_ok=True)
    for name, source in zip(names, sources):
        shutil.copyfile(source, os.path.join(dst, name))
    return names


def copy_directory_files(src: str, dst: str) -> list[str]:
    """Copy every file of the folder ``src`` (not recursive) to ``dst``, each checked as :func:`checked_file`."""
    names = sorted(os.listdir(src))
    sources = [checked_file(src, name) for name in names]
    os.makedirs(dst, exist_ok=True)
    for name, source in zip(names, sources):
        shutil.copyfile(source, os.path.join(dst, name))
    return names


def checked_file(folder: str, name: str) -> str:
    """The real path of ``folder/name`` if it is a regular file inside the checkpoint: ``folder``
    itself or, for a Hugging Face cache snapshot (``.../models--X/snapshots/<rev>``), its repository
    folder, where the cache's symlinks point (``../../blobs/<hash>``). A symlink anywhere else (a
    downloaded checkpoint's ``tokenizer.json -> ~/.ssh/id_rsa`` or ``/proc/self/environ``) would copy
    that file into the converted checkpoint.

    Raises:
        ConversionError: naming the file and where it leads.
    """
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    folder_abs = os.path.abspath(folder)
    roots = [os.path.realpath(folder_abs)]
    if os.path.basename(os.path.dirname(folder_abs)) == "snapshots":
        roots.append(os.path.realpath(os.path.dirname(os.path.dirname(folder_abs))))
    if not any(os.path.commonpath([real, root]) == root for root in roots):
        raise ConversionError(f"{path} leads outside the checkpoint (to {real}); refusing to copy it")
    if not os.path.isfile(real):
        raise ConversionError(f"{path} is not a regular file; refusing to copy it")
    return real
