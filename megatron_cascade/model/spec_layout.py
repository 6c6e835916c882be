"""One on-disk naming for GPT weights, whatever layer spec (local on CPU, Transformer Engine on GPU) built the model.

**Canonical names are the Transformer Engine (TE) spec's sharded-state-dict keys**
(``get_gpt_layer_with_transformer_engine_spec`` in megatron-core 0.16.1). Why TE and not local:
every GPU run — ours, Megatron-LM's and NeMo 2's ``weights/`` folders — builds the TE spec, so with
TE names their checkpoints load here unchanged and ours load there; the local spec is the CPU-only
exception, and it already writes TE names for almost every tensor:

* megatron-core's local spec carries a ``sharded_state_dict_keys_map`` that stores
  ``input_layernorm.*`` as ``self_attention.linear_qkv.layer_norm_*`` and ``pre_mlp_layernorm.*`` as
  ``mlp.linear_fc1.layer_norm_*`` — the names of TE's fused ``TELayerNormColumnParallelLinear``.
* The local spec applies that map to MoE layers too, but the TE MoE layer does not fuse its pre-MLP
  norm (its experts' ``linear_fc1`` are plain linears): it keeps a separate ``TENorm`` stored as
  ``pre_mlp_layernorm.*``. That is the one tensor the local spec names differently.
  ``canonical_sharded_state_dict`` decides each norm's key from the module names alone (fused into
  the next linear when TE fuses it, else separate), so a local spec without megatron-core's keys map
  (a custom CPU norm) still saves TE names.
* ``_extra_state`` objects hold TE's FP8 metadata, no weights. Local linears store ``None`` under the
  same keys as TE linears; TE norms (``q_layernorm``, ``k_layernorm``, MoE ``pre_mlp_layernorm``,
  ``final_layernorm``) have ones local norms lack. Loading tolerates both directions
  (``weights_checkpoint.load_model_weights``): a missing one keeps the module's own, an unknown one is unread.

Checkpoints written before this naming (local-spec names) still load: ``resolve_legacy_keys`` falls
back to the local-spec key of a tensor the checkpoint does not hold under its canonical key.
"""

from __future__ import annotations

import copy
import re
from typing import Any

EXTRA_STATE_SUFFIX = "_extra_state"

# A layer's norm as a module name: "<...>layers.<i>.<input_layernorm|pre_mlp_layernorm>.<weight|bias>".
_LAYER_NORM = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+\.)(?P<norm>input_layernorm|pre_mlp_layernorm)\.(?P<param>weight|bias)$")
# Where a norm's parameter can sit in a checkpoint key: its own module, or fused into the next linear (TE).
_NORM_TAILS = {
    "input_layernorm": ("input_layernorm.{param}", "self_attention.linear_qkv.layer_norm_{param}"),
    "pre_mlp_layernorm": ("pre_mlp_layernorm.{param}", "mlp.linear_fc1.layer_norm_{param}"),
}
_SEPARATE_SUFFIX, _FUSED_SUFFIX = _NORM_TAILS["pre_mlp_layernorm"]


def is_extra_state(key: str) -> bool:
    """Whether the checkpoint key ``key`` is a module's ``_extra_state`` (TE FP8 metadata, no weights)."""
    return key.rsplit(".", 1)[-1].startswith(EXTRA_STATE_SUFFIX)


def canonical_sharded_state_dict(sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
    """The model's flat ``sharded_state_dict()`` with every checkpoint key in the canonical (TE) naming.

    A layer norm is stored fused, as TE's ``TELayerNormColumnParallelLinear`` holds it, when the next
    linear is one TE fuses (``self_attention.linear_qkv``; a dense MLP's ``linear_fc1``), else under
    its own module (MoE ``pre_mlp_layernorm``). Decided from the module names, so it does not depend on
    the spec's own ``sharded_state_dict_keys_map``. Dict keys (module names) are unchanged; an entry
    whose checkpoint key changes is a shallow copy, the input is not modified; a TE-spec model's dict
    (no separate norm modules but the MoE one) comes back unchanged.
    """
    out = dict(sharded_state_dict)
    for name, entry in sharded_state_dict.items():
        match = _LAYER_NORM.match(name)
        if match is None:
            continue
        separate, fused = (t.format(param=match["param"]) for t in _NORM_TAILS[match["norm"]])
        next_linear = "self_attention.linear_qkv" if match["norm"] == "input_layernorm" else "mlp.linear_fc1"
        target = fused if f"{match['layer']}{next_linear}.weight" in sharded_state_dict else separate
        current = next((t for t in (separate, fused) if entry.key.endswith(t)), None)
        if current is not None and current != target:
            renamed = copy.copy(entry)
            renamed.key = entry.key[: -len(current)] + target
            out[name] = renamed
    return out


def legacy_key(key: str) -> str | None:
    """The key a local-spec checkpoint of an earlier version stored canonical ``key`` under, or None."""
    for param in ("weight", "bias"):
        separate = _SEPARATE_SUFFIX.format(param=param)
        if key.endswith(separate) and (len(key) == len(separate) or key[-len(separate) - 1] == "."):
            return key[: -len(separate)] + _FUSED_SUFFIX.format(param=param)
    return None


def resolve_legacy_keys(sharded_state_dict: dict[str, Any], checkpoint_keys: set[str]) -> dict[str, Any]:
    """Point entries at their legacy local-spec key where the checkpoint lacks the canonical one.

    ``checkpoint_keys`` are the tensor keys a checkpoint holds. An entry keeps its canonical key when
    the checkpoint has it (or has neither key: strict checking then reports it missing).
    """
    out = dict(sharded_state_dict)
    for name, entry in sharded_state_dict.items():
        old = legacy_key(entry.key)
        if old is not None and entry.key not in checkpoint_keys and old in checkpoint_keys:
            renamed = copy.copy(entry)
            renamed.key = old
            out[name] = renamed
    return out
