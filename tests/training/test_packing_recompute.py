"""Activation recompute (``model.recompute``) changes memory, not results, padded and packed.

``selective`` recomputes the core attention and ``full`` whole layers in the backward pass; both
re-run attention outside the forward, where CPU mode's device rewrite is not active (a causal mask
built on ``device="cuda"`` failed there: "Torch not compiled with CUDA enabled"). One process, the
same weights: the losses and gradients with recompute equal those without (1e-6, fp32), padded and
packed; the layout wires the setting into the TransformerConfig.
"""

from dataclasses import replace

import torch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

from test_packing import MODEL, VOCAB, make_batch


def _recompute_worker():
    from megatron.core import parallel_state

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients

    out, weights = {}, None
    for recompute in ("none", "selective", "full"):
        parallel_state.destroy_model_parallel()
        initialize_model_parallel(ParallelConfig(), seed=11)
        model = replace(MODEL, recompute=recompute, recompute_num_layers=1)
        policy = build_policy(model, ParallelConfig(), OptimizerConfig(lr=1e-3), total_steps=10)
        config = policy.module.config
        out[f"{recompute}/config"] = (config.recompute_granularity, config.recompute_method)
        if weights is None:
            weights = {k: v.clone() for k, v in policy.module.state_dict().items() if not k.endswith("_extra_state")}
        policy.module.load_state_dict(weights, strict=False)
        spec = LossSpec("mopd", LossConfig(), temperature=0.7, vocab_size=VOCAB)
        for packed in (False, True):
            training = TrainingConfig(micro_batch_size=4, sequence_packing=packed)
            metrics = compute_gradients(policy, make_batch(), spec, training)
            grads = [p.main_grad.detach().clone() for p in policy.chunks[0].parameters()]
            out[recompute, packed] = (metrics["loss"], grads)
    return out


def test_recompute_gives_the_same_gradients_padded_and_packed():
    out = run_distributed(_recompute_worker, 1)[0]
    assert out["none/config"] == (None, None)
    assert out["selective/config"] == ("selective", None)
    assert out["full/config"] == ("full", "uniform")
    for packed in (False, True):
        ref_loss, ref_grads = out["none", packed]
        for recompute in ("selective", "full"):
            loss, grads = out[recompute, packed]
            assert abs(loss - ref_loss) < 1e-6
            for grad, ref in zip(grads, ref_grads):
                torch.testing.assert_close(grad, ref, atol=1e-6, rtol=1e-5)
