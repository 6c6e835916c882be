"""Where each value of a loaded run config came from: the command-line override that set it, else
the YAML ``file:line`` that wrote it (includes too) — what an error about a value leads with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from megatron_cascade.config.unknown_keys import key_lines


@dataclass(frozen=True)
class ConfigOrigins:
    """Attributes:
        path: the config file as the user named it.
        texts: (file, its YAML text) in merge order (the last one written wins).
        overridden: dotted key (stages by index) -> the command-line override that set it, in order.
    """

    path: str
    texts: tuple[tuple[str, str], ...] = ()
    overridden: Mapping[str, str] = field(default_factory=dict)

    def of(self, key: str) -> Optional[str]:
        """``"command-line override 'k=v'"`` or ``"file:line"`` for the dotted ``key`` (an override of
        the key, of a section holding it or of a key inside it counts); None when nothing wrote it."""
        for set_key, item in reversed(list(self.overridden.items())):
            if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
                return f"command-line override {item!r}"
        key_path = tuple(key.split("."))
        for file, text in reversed(self.texts):
            line = key_lines(text).get(key_path)
            if line is not None:
                return f"{self.path if len(self.texts) == 1 else file}:{line}"
        return None

    def lead(self, key: str, message: str) -> str:
        """``message`` led by where ``key``'s value came from (unchanged when nothing wrote it)."""
        origin = self.of(key)
        return message if origin is None else f"{origin}: {message}"
