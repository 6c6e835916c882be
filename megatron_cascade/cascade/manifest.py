"""``OUTPUT_DIR/manifest.json``: which stages are complete, their final weights and their scores.

Paths in the manifest are relative to the output directory, so two runs of the same config in
different folders produce the same manifest.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from typing import Any, Optional

from megatron_cascade.training.resume_checkpoint import read_latest, write_atomically

MANIFEST = "manifest.json"


class Manifest:
    """The run's record; every write replaces the file atomically (rank 0 only)."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, MANIFEST)
        self.data: dict[str, Any] = {"stages": {}}
        if os.path.isfile(self.path):
            with open(self.path) as f:
                self.data = json.load(f)

    def stage(self, name: str) -> Optional[dict]:
        return self.data["stages"].get(name)

    def is_complete(self, name: str) -> bool:
        record = self.stage(name)
        return bool(record and record.get("status") == "complete")

    def final_weights(self, name: str) -> Optional[str]:
        """Absolute path of a complete stage's final weights."""
        record = self.stage(name)
        if not record or record.get("status") != "complete":
            return None
        return os.path.join(self.output_dir, record["final_weights"])

    def record_stage(self, name: str, record: dict) -> None:
        self.data["stages"][name] = record
        self.save()

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def record_config_change(self, changes: dict[str, dict[str, Any]], allowed: list[str]) -> None:
        """Append a resume's accepted config changes (``{key: {"recorded": old, "now": new}}``) and the
        ``--allow-config-change`` keys that accepted them to ``config_changes``."""
        entry = {"at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "allowed": list(allowed),
                 "changes": changes}
        self.record("config_changes", [*self.data.get("config_changes", []), entry])

    def save(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        write_atomically(self.path, json.dumps(self.data, indent=2, sort_keys=True))


def stage_dir(output_dir: str, stage: str) -> str:
    return os.path.join(output_dir, "stages", stage)


def checkpoint_root(output_dir: str, stage: str) -> str:
    return os.path.join(stage_dir(output_dir, stage), "checkpoints")


def stage_status(output_dir: str, stage: str) -> str:
    """complete | partial (a resumable checkpoint exists) | pending."""
    manifest = Manifest(output_dir)
    if manifest.is_complete(stage):
        return "complete"
    return "partial" if read_latest(checkpoint_root(output_dir, stage)) else "pending"
