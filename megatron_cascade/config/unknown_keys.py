"""Every unknown key of a run's YAML files in one report, each with the file and line that wrote it.

OmegaConf's schema merge stops at the first unknown key; a user with three typos would need three
runs to find them. This walks the YAML tree against the schema's dataclasses before the merge and
names every key the schema does not know, where it was written (``file:line``), and the closest
known key.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Mapping, Optional, Sequence

import yaml

KeyPath = tuple  # ("stages", "2", "trian"): mapping keys and list indices as strings


def key_lines(text: str) -> dict[KeyPath, int]:
    """The 1-based line of every key (and list item) of a YAML document, by its path."""
    lines: dict[KeyPath, int] = {}

    def walk(node: yaml.Node, path: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = path + (str(key.value),)
                lines.setdefault(sub, key.start_mark.line + 1)
                walk(value, sub)
        elif isinstance(node, yaml.SequenceNode):
            for index, value in enumerate(node.value):
                sub = path + (str(index),)
                lines.setdefault(sub, value.start_mark.line + 1)
                walk(value, sub)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, ())
    return lines


def unknown_keys(tree: Mapping[str, Any], schema: type,
                 dict_sections: Optional[Mapping[str, type]] = None) -> list[tuple[KeyPath, str]]:
    """``(path, hint)`` of each key of ``tree`` (a plain nested dict/list) that ``schema`` (a
    dataclass) does not declare; ``hint`` is `` (did you mean 'x'?)`` or the known keys.

    ``dict_sections`` gives a dataclass for fields typed as a free-form dict that are checked
    against a section's schema later (a stage's ``optimizer``/``loss``/... overrides).
    """
    found: list[tuple[KeyPath, str]] = []
    _walk(tree, schema, (), dict(dict_sections or {}), found)
    return found


def _walk(node: Any, cls: type, path: KeyPath, sections: dict[str, type], found: list) -> None:
    if not isinstance(node, Mapping):
        return
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key, value in node.items():
        key = str(key)
        if key not in hints:
            close = difflib.get_close_matches(key, names, n=1)
            found.append((path + (key,), f" (did you mean '{close[0]}'?)" if close
                          else f" (known keys: {', '.join(names)})"))
            continue
        sub = sections.get(key) if key in sections and _is_free_dict(hints[key]) else None
        if sub is not None:
            _walk(value, sub, path + (key,), {}, found)
        else:
            _walk_typed(value, hints[key], path + (key,), sections, found)


def _walk_typed(value: Any, annotation: Any, path: KeyPath, sections: dict[str, type], found: list) -> None:
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if is_dataclass(annotation):
        _walk(value, annotation, path, sections, found)
    elif origin in (dict, Mapping) and isinstance(value, Mapping):
        item = typing.get_args(annotation)[1]
        for key, sub in value.items():
            _walk_typed(sub, item, path + (str(key),), sections, found)
    elif origin in (list, Sequence) and isinstance(value, list):
        item = typing.get_args(annotation)[0]
        for index, sub in enumerate(value):
            _walk_typed(sub, item, path + (str(index),), sections, found)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_free_dict(annotation: Any) -> bool:
    annotation = _strip_optional(annotation)
    return typing.get_origin(annotation) in (dict, Mapping) and typing.get_args(annotation)[1] is Any
