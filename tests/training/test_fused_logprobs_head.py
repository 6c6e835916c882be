"""Training and forward-only log-probs through the fused head equal the logits path.

Each worker builds one policy and runs the same batch twice, ``LossSpec.output_head="logits"`` and
``"fused"``: forward-only log-probs (the teacher / reference / old-policy pass), then the training
forward+backward (``compute_gradients``). Loss, metrics (the entropy too), log-probs and every
parameter's ``main_grad`` on every rank are compared, fp32 to 1e-5. Layouts: TP=1 (untied
embeddings, vocabulary 100 padded to 128), TP=2 + sequence parallel (tied embeddings), PP=2 (tied
embeddings across the stages), MoE with EP=2 (alltoall), and bf16 with the distributed optimizer at
DP=2 (the same tolerance: both paths round the logits and their gradient to bf16 at the same places).
A spy on ``fused_output_logprobs`` proves which path ran.
"""

from dataclasses import replace

import pytest
import torch

from megatron_cascade.config import ModelConfig, MoEConfig, ParallelConfig
from megatron_cascade.config.training import LossConfig, OptimizerConfig, TrainingConfig
from megatron_cascade.testing import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                    ffn_hidden_size=64)
TIED = replace(MODEL, tie_embeddings=True)
MOE = replace(MODEL, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32, token_dispatcher_type="alltoall",
                                   router_load_balancing_type="seq_aux_loss", aux_loss_coeff=0.5))
BF16 = replace(MODEL, precision="bf16")
BATCH, SEQ, VOCAB = 8, 23, 100


def _global_batch():
    from megatron_cascade.testing.batches import UNEVEN_SPANS, random_rl_batch

    return random_rl_batch(UNEVEN_SPANS, SEQ, VOCAB)


class _Spy:
    """Counts calls of ``fused_output_logprobs`` by the head (and calls through)."""

    def __init__(self):
        from megatron_cascade.training import output_head

        self.module, self.calls, self.real = output_head, 0, output_head.fused_output_logprobs
        output_head.fused_output_logprobs = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def _both_heads_worker(model_cfg, parallel, micro_batch_size, kind):
    """{head: (metrics, forward-only log-probs, {param name: main_grad}, spy calls)} and whether this
    rank is the last pipeline stage (the only one that calls the head)."""
    from megatron.core import parallel_state as ps

    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.training import LossSpec, build_policy
    from megatron_cascade.training.step import compute_gradients, forward_logprobs

    initialize_model_parallel(parallel, seed=11)
    policy = build_policy(model_cfg, parallel, OptimizerConfig(lr=1e-3), total_steps=10)
    batch = _global_batch()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = batch.select(slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp))
    loss = LossConfig(kl_coef=0.1, importance_correction="icepop", is_low=0.05, is_high=50.0)
    spy, out = _Spy(), {}
    for head in ("logits", "fused"):
        spec = LossSpec(kind, loss, temperature=0.7, vocab_size=VOCAB, output_head=head)
        before = spy.calls
        logprobs = forward_logprobs(policy.chunks, share, spec, micro_batch_size)
        metrics = compute_gradients(policy, share, spec, TrainingConfig(micro_batch_size=micro_batch_size))
        grads = {name: p.main_grad.detach().float().clone() for name, p in policy.chunks[0].named_parameters()}
        out[head] = (metrics, logprobs, grads, spy.calls - before)
    return out, ps.is_pipeline_last_stage()


def _assert_heads_agree(results, tol=1e-5):
    for rank, (out, last_stage) in enumerate(results):
        metrics, logprobs, grads, calls = out["fused"]
        ref_metrics, ref_logprobs, ref_grads, ref_calls = out["logits"]
        assert ref_calls == 0 and (calls > 0) == last_stage, (rank, calls, ref_calls, last_stage)
        assert metrics.keys() == ref_metrics.keys() and metrics["entropy_mean"] > 0
        for key, ref in ref_metrics.items():
            assert abs(metrics[key] - ref) <= tol * max(1.0, abs(ref)), f"rank {rank} {key}: {metrics[key]} vs {ref}"
        torch.testing.assert_close(logprobs, ref_logprobs, atol=tol, rtol=tol)
        assert grads.keys() == ref_grads.keys()
        nonzero = 0
        for name, ref in ref_grads.items():
            scale = float(ref.abs().max())
            err = float((grads[name] - ref).abs().max())
            assert err <= tol * max(scale, 1e-3), f"rank {rank} {name}: max error {err:.3g}, largest {scale:.3g}"
            nonzero += int(scale > 0)
        assert nonzero > len(ref_grads) // 2, "most gradients are zero: the comparison would prove nothing"


LAYOUTS = [
    ("tp1-untied-padded-vocab", MODEL, 1, ParallelConfig(), 4, "grpo"),
    ("tp2-sp-tied", TIED, 2, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), 4, "mopd"),
    ("pp2-tied", TIED, 2, ParallelConfig(pipeline_model_parallel_size=2), 2, "grpo"),
    ("moe-ep2", MOE, 2, ParallelConfig(expert_model_parallel_size=2), 2, "grpo"),
]


@pytest.mark.parametrize("name,model_cfg,world,parallel,mbs,kind", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_fused_head_equals_logits_path(name, model_cfg, world, parallel, mbs, kind):
    _assert_heads_agree(run_distributed(_both_heads_worker, world, model_cfg, parallel, mbs, kind))


def test_fused_head_equals_logits_path_in_bf16_with_the_distributed_optimizer():
    """bf16 (Float16Module, fp32 main_grad): the fused op rounds logits and their gradient to bf16
    where the output layer does and sums its weight gradient over chunks in fp32 (one chunk here), so
    gradients equal the logits path's (bit for bit on this machine, once the logits path divided by
    the temperature in fp32; before, log-probs differed by 9e-4 and gradients by ~1%)."""
    parallel = ParallelConfig(use_distributed_optimizer=True)
    _assert_heads_agree(run_distributed(_both_heads_worker, 2, BF16, parallel, 2, "grpo"))


@pytest.mark.parametrize("truncated", [False, True])
def test_logits_path_divides_16_bit_logits_by_the_temperature_in_float32(truncated):
    """The sampler upcasts the logits, then divides by T (``rollout/sampling.py``); bf16 logits divided
    in bf16 are rounded to 8 bits after the division (log-prob errors ~1e-3 at T=0.7)."""
    from megatron_cascade.training.loss_plugin import LossSpec, token_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 50, 128, generator=gen) * 4).bfloat16()
    targets = torch.randint(0, VOCAB, (3, 50), generator=gen)
    spec = LossSpec("sft", LossConfig(), temperature=0.7, vocab_size=VOCAB, top_k=128 if truncated else 0)
    logprobs, entropy = token_logprobs(logits, targets, spec, None, with_entropy=True)
    ref = torch.log_softmax(logits[..., :VOCAB].double() / 0.7, dim=-1)
    torch.testing.assert_close(logprobs.double(), ref.gather(-1, targets[..., None])[..., 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), -(ref.exp() * ref).sum(-1), atol=1e-4, rtol=0)


def _head_choice_worker():
    """{case: use_fused_head(...) or the error it raised} on a real GPTModel."""
    from megatron_cascade.model import build_gpt_model, initialize_model_parallel
    from megatron_cascade.training.output_head import use_fused_head

    initialize_model_parallel(ParallelConfig(), seed=1)
    model = build_gpt_model(MODEL, ParallelConfig())

    def choice(head, truncated):
        try:
            return use_fused_head(head, truncated, model)
        except Exception as err:  # noqa: BLE001 - the message is what the test checks
            return f"{type(err).__name__}: {err}"

    out = {(head, truncated): choice(head, truncated) for head in ("auto", "fused", "logits")
           for truncated in (False, True)}
    model.config.defer_embedding_wgrad_compute = True
    out["deferred", "auto"], out["deferred", "fused"] = choice("auto", False), choice("fused", False)
    model.config.defer_embedding_wgrad_compute, model.config.mtp_num_layers = False, 1
    out["mtp", "logits"] = choice("logits", False)
    return out


def test_head_choice_and_refusals():
    from megatron_cascade.training.loss_plugin import LossSpec

    out = run_distributed(_head_choice_worker, 1)[0]
    assert out["auto", False] is True and out["fused", False] is True
    assert out["auto", True] is False  # top-k / top-p: the logits path (LossSpec refuses "fused" with them)
    assert out["logits", False] is False and out["logits", True] is False
    assert out["deferred", "auto"] is False
    assert "ConfigError" in out["deferred", "fused"] and "defer_embedding_wgrad_compute" in out["deferred", "fused"]
    assert "ConfigError" in out["mtp", "logits"] and "mtp_num_layers" in out["mtp", "logits"]
    with pytest.raises(ValueError, match="output_head='fused' cannot give top-k / top-p.*rollout.top_k"):
        LossSpec("grpo", LossConfig(), top_p=0.9, output_head="fused")
    with pytest.raises(ValueError, match="output_head must be one of"):
        LossSpec("grpo", LossConfig(), output_head="on")
