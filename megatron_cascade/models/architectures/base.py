"""``MegatronArchitecture``: a Megatron-Core model class as the generic machinery sees it.

A model config's ``architecture`` names one (``gpt``: ``GPTModel``; ``hybrid``: ``MambaModel``). What
differs between them is asked of it: the blocks each layer holds (from which the dry run counts
parameters, activations, KV and per-request Mamba state), how tensor and context parallelism may
split them, the ``TransformerConfig`` fields they add, and the CUDA extensions their GPU kernels
need. The builder, the plan, the converter and the doctor never test which architecture it is.
"""

from __future__ import annotations

from typing import Any, ClassVar

from megatron_cascade.config.model import ModelConfig

# A layer's blocks, in megatron-core's hybrid-pattern symbols: every block is a pre-norm residual block.
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# Blocks that keep per-token (KV) or per-request (conv + SSM) state while generating.
STATEFUL_BLOCKS = (MAMBA, ATTENTION)


class MegatronArchitecture:
    """One Megatron-Core model class. Subclasses set the class attributes and the hooks below.

    Attributes:
        name: the ``model.architecture`` value (``gpt``, ``hybrid``).
        gpu_packages: pip names of the CUDA extensions its layers' GPU kernels need (``doctor``).
        kv_heads_replicate: whether TP may be a multiple of the key/value heads (replicated on
            ``TP / heads`` ranks) rather than only a divisor (checked when converting).
    """

    name: ClassVar[str]
    gpu_packages: ClassVar[tuple[str, ...]] = ()
    kv_heads_replicate: ClassVar[bool] = False

    def layer_blocks(self, model: ModelConfig) -> list[str]:
        """Per decoder layer, the blocks it holds in order (``*-``: attention then a dense MLP)."""
        raise NotImplementedError

    def validate_layout(self, model: ModelConfig, tensor_parallel: int, context_parallel: int,
                        prefix: str = "parallel.") -> None:
        """``ConfigError`` when ``model`` cannot be split ``tensor_parallel`` / ``context_parallel`` ways
        beyond the rules every architecture shares (heads, vocab, layers); ``prefix`` names the keys."""

    def transformer_config_fields(self, model: ModelConfig) -> dict[str, Any]:
        """``TransformerConfig`` fields this architecture adds to the common ones."""
        return {}

    def describe(self, model: dict[str, Any]) -> str:
        """Its own sizes in a checkpoint summary line (``model`` as saved: a plain dict), or ''."""
        return ""

    # -- derived from the blocks: the same for every architecture ---------------------------------
    def stage_layers(self, model: ModelConfig, pipeline_parallel: int) -> list[str]:
        """The layers (their blocks) of the most loaded of ``pipeline_parallel`` even stages: the one
        with the most stateful blocks (attention and Mamba), then the most MoE blocks."""
        layers = self.layer_blocks(model)
        per = len(layers) // pipeline_parallel
        stages = [layers[i * per:(i + 1) * per] for i in range(pipeline_parallel)]
        return max(stages, key=lambda st: (count_blocks(st, *STATEFUL_BLOCKS), count_blocks(st, MOE)))

    def has_blocks(self, model: ModelConfig, *blocks: str) -> bool:
        """Whether some layer of ``model`` holds one of ``blocks``."""
        return count_blocks(self.layer_blocks(model), *blocks) > 0

    def __repr__(self) -> str:
        return f"<Megatron architecture {self.name}>"


def count_blocks(layers: list[str], *blocks: str) -> int:
    """How many of ``blocks`` the ``layers`` (as ``layer_blocks`` gives them) hold in all."""
    return sum(layer.count(block) for layer in layers for block in blocks)
