"""Frozen models (KL reference, MOPD teachers) of an FP8 policy run their GEMMs in bf16: delayed
scaling would quantize with scales from an amax history they never had (``build_frozen_model``)."""

from __future__ import annotations

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.config.model import FP8Config
from megatron_cascade.testing import run_distributed

FP8_MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, ffn_hidden_size=128,
                        max_position_embeddings=64, precision="bf16", fp8=FP8Config(format="hybrid"))


def _frozen_worker() -> dict:
    from megatron.core.utils import get_model_config

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training.policy import build_frozen_model

    initialize_model_parallel(ParallelConfig(), seed=1)
    model = build_frozen_model(FP8_MODEL, ParallelConfig())
    config = get_model_config(model)
    return {"fp8": config.fp8, "dtype": str(next(model.parameters()).dtype),
            "trainable": sum(p.requires_grad for p in model.parameters())}


def test_frozen_models_of_an_fp8_policy_run_bf16():
    """Before: the frozen model took the policy's FP8 config (here, without Transformer Engine, it could
    not even be built: "model.fp8.format is set but Transformer Engine with CUDA is not available")."""
    got = run_distributed(_frozen_worker, 1)[0]
    assert got == {"fp8": None, "dtype": "torch.bfloat16", "trainable": 0}
