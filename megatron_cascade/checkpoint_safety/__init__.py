"""Checkpoint loads that never execute code: allow-listed unpickling and checked metadata.

* ``restricted_pickle``: ``restricted_loads`` (globals from an allow-list only) and ``UnsafeCheckpointError``;
* ``dcp_metadata``: ``read_dcp_metadata`` (a DCP / Megatron ``.metadata``, unpickled with the classes
  such a file holds, then structurally checked) and ``check_data_spans``;
* ``megatron_load``: ``safe_load_strategies()`` for ``dist_checkpointing.load``, and the safe DCP
  reader the converter uses (imported on demand: it imports Megatron-Core);
* ``extra_state``: ``check_extra_states``, run on loaded ``_extra_state`` values before a module's
  ``set_extra_state`` (Transformer Engine's ``pickle.loads``) sees them.
Safetensors headers are checked by ``megatron_cascade.convert.safetensors_io``.
"""

from megatron_cascade.checkpoint_safety.dcp_metadata import check_data_spans, read_dcp_metadata
from megatron_cascade.checkpoint_safety.restricted_pickle import UnsafeCheckpointError

__all__ = ["UnsafeCheckpointError", "read_dcp_metadata", "check_data_spans"]
