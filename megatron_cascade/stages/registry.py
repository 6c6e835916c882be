"""The implementation of a stage type (``config/stage_types.py`` declares them): imported when a stage runs."""

from __future__ import annotations

import importlib

from megatron_cascade.config.stage_types import stage_type


def stage_class(name: str) -> type:
    """Import and return the ``StageType`` subclass registered as ``name``."""
    module, _, attr = stage_type(name).target.partition(":")
    return getattr(importlib.import_module(module), attr)
