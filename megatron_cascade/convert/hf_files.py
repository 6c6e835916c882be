"""Non-weight files of a Hugging Face checkpoint: config.json and the tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from megatron_cascade.convert.errors import ConversionError

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
    """Copy the tokenizer/generation files (and optionally config.json) present in ``src``; returns their names."""
    names = [n for n in SIDE_FILES + ((CONFIG_FILE,) if include_config else ()) if os.path.isfile(os.path.join(src, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return names
