"""``model.recompute: full`` on a hybrid Mamba-2 / attention / MoE model (``model/hybrid_model.py``).

The tiny ``M*ME`` model and GRPO batch of ``test_hybrid_training.py`` (8 sequences, 2 micro-batches of
4), built four times in one process with the same weights: recompute none, full in chunks of one
layer, full in chunks of 3 (an uneven last chunk), and full in chunks of 2 over padding-free packed
rows (sequence boundaries reach the recomputed Mamba and attention layers). Loss, every gradient and
(unpacked) the routers' expert biases after the step (their token counts are taken in the recomputed
forward) equal recompute=none to 1e-6 (fp32), at TP=1, at TP=2 + sequence parallelism and at PP=2 (the
second stage recomputes from the activations it received). Every layer's forward runs twice per
micro-batch under full recompute (once more in backward) and once in the log-prob pass (no grad) and
in generation (the SSM-state path keeps its single forward, and its tokens are those of recompute=none).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from test_hybrid_training import HYBRID, VOCAB, _global_batch

from megatron_cascade.config import ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

# (recompute, recompute_num_layers, padding-free packing)
SETTINGS = [("none", 1, False), ("full", 1, False), ("full", 3, False), ("full", 2, True)]
MICRO_BATCH = 4


class _LayerCalls:
    """Counts forward calls of each ``decoder.layers.N`` module of a model (hooks fire on recompute too)."""

    def __init__(self, module: torch.nn.Module):
        self.counts: dict[str, int] = {}
        self.handles = [layer.register_forward_hook(self._hook(name)) for name, layer in module.named_modules()
                        if re.search(r"decoder\.layers\.\d+$", name)]

    def _hook(self, name: str):
        def hook(*_):
            self.counts[name] = self.counts.get(name, 0) + 1
        return hook

    def take(self) -> list[int]:
        counts = [self.counts[k] for k in sorted(self.counts)]
        self.counts = {}
        return counts


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in module.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        out[name] = torch.zeros_like(param) if grad is None else grad.detach().clone()
    return out


def _generated_tokens(module: torch.nn.Module) -> list[list[int]]:
    from megatron_cascade.rollout import SamplingParams, generate
    from megatron_cascade.tokenizers import CharTokenizer

    tokenizer = CharTokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in ("abc", "2+2?")]
    params = SamplingParams(temperature=0.0, max_new_tokens=3, n=1, ignore_eos=True)
    return [s.response_ids for s in generate(module, prompts, params, tokenizer=tokenizer, use_kv_cache=True)]


def _worker(parallel: ParallelConfig):
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    initialize_model_parallel(parallel, seed=11)
    batch = _global_batch()
    spec = LossSpec("grpo", LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0),
                    temperature=0.7, vocab_size=VOCAB)
    weights, results = None, {}
    for recompute, chunk, packing in SETTINGS:
        model = replace(HYBRID, vocab_size=VOCAB, recompute=recompute, recompute_num_layers=chunk)
        policy = build_policy(model, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
        if weights is None:
            weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in policy.module.state_dict().items()}
        else:
            policy.module.load_state_dict(weights)
        calls = _LayerCalls(policy.module)
        training = TrainingConfig(micro_batch_size=MICRO_BATCH, sequence_packing=packing)
        metrics = compute_gradients(policy, batch, spec, training)
        train_calls = calls.take()
        forward_logprobs(policy.chunks, batch, spec, MICRO_BATCH)
        logprob_calls = calls.take()
        # Generation runs the whole model on each rank: not with pipeline stages.
        tokens = _generated_tokens(policy.module) if parallel.pipeline_model_parallel_size == 1 else []
        results[(recompute, chunk, packing)] = dict(
            loss=metrics["loss"], grads=_grads(policy.module), train_calls=train_calls, logprob_calls=logprob_calls,
            generation_calls=calls.take(), tokens=tokens,
            biases={n: b.detach().clone() for n, b in policy.module.named_buffers() if n.endswith("expert_bias")})
    return results


LAYOUTS = {"tp1": ParallelConfig(), "tp2-sp": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
           "pp2": ParallelConfig(pipeline_model_parallel_size=2)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_full_recompute_equals_no_recompute_and_runs_each_layer_twice(name):
    parallel = LAYOUTS[name]
    world = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    layers = 4 // parallel.pipeline_model_parallel_size
    ranks = run_distributed(_worker, world, parallel)
    # The MoE layer (the last of "M*ME") is on the last pipeline stage.
    assert ranks[-1][SETTINGS[0]]["biases"]
    for results in ranks:
        ref = results[SETTINGS[0]]
        micro_batches = 8 // MICRO_BATCH
        assert ref["train_calls"] == [micro_batches] * layers
        assert sum(g.abs().sum() > 0 for g in ref["grads"].values()) > len(ref["grads"]) // 2
        assert all(b.abs().sum() > 0 for b in ref["biases"].values())
        for setting in SETTINGS[1:]:
            got = results[setting]
            packed = setting[2]
            # Forward, then once more in backward: the layer's activations were not kept (packed: per row).
            rows = got["train_calls"][0] // 2 if packed else micro_batches
            assert got["train_calls"] == [2 * rows] * layers, setting
            assert got["logprob_calls"] == ref["logprob_calls"] == [micro_batches] * layers, setting
            assert got["generation_calls"] == ref["generation_calls"] and got["tokens"] == ref["tokens"], setting
            assert abs(got["loss"] - ref["loss"]) < 1e-6, setting
            assert got["grads"].keys() == ref["grads"].keys()
            for key, grad in ref["grads"].items():
                torch.testing.assert_close(got["grads"][key], grad, atol=1e-6, rtol=1e-5,
                                           msg=lambda m: f"{setting} {key}: {m}")
            if packed:
                # Packing runs no position after a sequence's last loss token: its routers count fewer
                # tokens, so the bias update legitimately differs (as in test_hybrid_training.py).
                continue
            for key, bias in ref["biases"].items():
                torch.testing.assert_close(got["biases"][key], bias, atol=0, rtol=0)
