"""Worker functions of the rollout tests (module-level so that ``run_distributed`` can pickle them).

Every worker builds the same tiny model for the built-in character tokenizer (103 ids, padded to
128 logits), runs ``generate`` and returns plain Python data; the tests compare across layouts.
"""

from __future__ import annotations

import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.rollout import KVCacheConfig, SamplingParams, generate, pack_rollouts
from megatron_cascade.tokenizers import CharTokenizer

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=103,
                    ffn_hidden_size=96, max_position_embeddings=96, init_method_std=0.05)
TOKENIZER = CharTokenizer()
# Chat prompts of different lengths (9, 15 and 28 tokens): exercises left padding.
PROMPTS = [TOKENIZER.apply_chat_template([{"role": "user", "content": text}])
           for text in ("abc", "what is 2+2?", "Write a haiku about rain.\nGo")]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=10, n=3, seed=11, ignore_eos=True)
HOT = SamplingParams(temperature=3.0, max_new_tokens=16, n=4, seed=5, ignore_eos=True)


def _setup(parallel: ParallelConfig, weights_dir: str, save: bool):
    from megatron_cascade.testing.checkpoints import model_with_shared_weights

    return model_with_shared_weights(MODEL, parallel, weights_dir, save, seed=1234)


def _summary(batch) -> dict:
    return {
        "tokens": [s.response_ids for s in batch],
        "logprobs": [s.response_logprobs for s in batch],
        "sampled_logprobs": [s.sampled_logprobs for s in batch],
        "reasons": [s.finish_reason for s in batch],
        "index": [(s.prompt_index, s.sample_index) for s in batch],
    }


def _training_check(model, batch, temperature: float) -> dict:
    """Trainer-style forward of the packed batch vs the rollout's log-probs (max abs differences)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_cascade.ops import vocab_parallel_logprobs

    packed = pack_rollouts(batch, pad_id=TOKENIZER.pad_id)
    t = temperature if temperature > 0 else 1.0
    model.eval()
    with torch.no_grad():
        logits = model(packed.tokens, packed.position_ids, None)  # [B, S, V/TP], causal
    mask = packed.loss_mask.bool()
    trainer = vocab_parallel_logprobs(logits / t, packed.targets, group=ps.get_tensor_model_parallel_group(),
                                      vocab_size=TOKENIZER.vocab_size)
    full = gather_from_tensor_model_parallel_region(logits).double()
    real = full[..., : TOKENIZER.vocab_size]
    ref = torch.log_softmax(real / t, dim=-1).gather(-1, packed.targets.unsqueeze(-1)).squeeze(-1)
    pad_mass = torch.softmax(full / t, dim=-1)[..., TOKENIZER.vocab_size:].sum(-1)[mask]
    return {
        "vs_trainer": (trainer - packed.inference_logprobs)[mask].abs().max().item(),
        "vs_float64": (ref - packed.inference_logprobs.double())[mask].abs().max().item(),
        "pad_mass_mean": pad_mass.mean().item(),
        "tokens_checked": int(mask.sum()),
    }


def _stage_trainer_check(model, batch, params: SamplingParams) -> dict:
    """The GRPO stage's own path: ``rollout_loss_spec`` from a rollout section sampling like ``params``,
    ``rollout_batch`` packing, ``token_logprobs`` — vs the log-probs of the distribution sampled from."""
    from megatron.core import parallel_state as ps

    from megatron_cascade.stages.step_batches import rollout_batch
    from megatron_cascade.stages.sampling_spec import rollout_loss_spec
    from megatron_cascade.config import LossConfig, OptimizerConfig, TrainingConfig
    from megatron_cascade.config.schema import ResolvedStage, RolloutConfig
    from megatron_cascade.training.loss_plugin import token_logprobs

    rollout = RolloutConfig(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    stage = ResolvedStage("rl", "grpo", 1, 1, 1, {"d": 1.0}, {}, OptimizerConfig(), LossConfig(), TrainingConfig(),
                          rollout)
    spec = rollout_loss_spec(stage, "grpo", TOKENIZER.vocab_size)
    train = rollout_batch(batch, TOKENIZER, keep=torch.ones(len(batch), dtype=torch.bool),
                          advantages=torch.zeros(len(batch)), truncated=spec.truncated)
    model.eval()
    with torch.no_grad():
        logits = model(train.input_ids, position_ids=_positions(train.input_ids), attention_mask=None)
    trainer, _ = token_logprobs(logits, train.target_ids, spec, ps.get_tensor_model_parallel_group())
    mask = train.loss_mask.bool()
    sampled = torch.tensor([lp for s in batch for lp in s.sampled_logprobs])
    return {"vs_sampled": (trainer[mask] - sampled).abs().max().item(),
            "vs_batch": (trainer - train.inference_logprobs)[mask].abs().max().item(),
            "tokens_checked": int(mask.sum())}


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)


def reference_worker(weights_dir: str) -> dict:
    """TP=PP=1: every single-process check; saves the weights the other layouts load."""
    model = _setup(ParallelConfig(), weights_dir, save=True)
    out = {}
    model.train()
    greedy = generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER)
    out["restored_training_mode"] = model.training
    out["greedy"] = _summary(greedy)
    out["greedy_nocache"] = _summary(generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, use_kv_cache=False))
    out["greedy_train"] = _training_check(model, greedy, 0.0)
    out["eval_stays_eval"] = not model.training
    sampled = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER)
    out["sampled"] = _summary(sampled)
    out["sampled_again"] = _summary(generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER))
    out["sampled_seed2"] = _summary(generate(model, PROMPTS, _with(SAMPLED, seed=12), tokenizer=TOKENIZER))
    out["sampled_nocache"] = _summary(generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER, use_kv_cache=False))
    out["sampled_train"] = _training_check(model, sampled, SAMPLED.temperature)
    out["sampled_stage_train"] = _stage_trainer_check(model, sampled, SAMPLED)
    out["top_k1"] = _summary(generate(model, PROMPTS, _with(GREEDY, temperature=1.0, top_k=1), tokenizer=TOKENIZER))
    hot = generate(model, PROMPTS, HOT, tokenizer=TOKENIZER)
    out["hot"] = _summary(hot)
    out["hot_train"] = _training_check(model, hot, HOT.temperature)
    out.update(_stop_checks(model, out["greedy"]["tokens"][0]))
    out["greedy_grouped"] = _summary(_generate_grouped_by_length(model))
    limit = len(PROMPTS[-1]) + 3
    out["short_limit"] = _summary(generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER, max_sequence_length=limit))
    return out


def _stop_checks(model, greedy_row0: list[int]) -> dict:
    """Stop token and stop string chosen from prompt 0's greedy response (known in advance)."""
    stop_id = greedy_row0[4]
    text = TOKENIZER.decode(greedy_row0)
    stop_string = text[3:5]
    by_id = generate(model, PROMPTS[:1], _with(GREEDY, stop_token_ids=(stop_id,)), tokenizer=TOKENIZER)
    by_str = generate(model, PROMPTS[:1], _with(GREEDY, stop_strings=("\x00never", stop_string)),
                      tokenizer=TOKENIZER)
    return {"stop_id": stop_id, "stop_string": stop_string,
            "by_id": _summary(by_id), "by_string": _summary(by_str)}


def _generate_grouped_by_length(model):
    """The static path's batching for attention that cannot mask padding (TE): one batch per prompt
    length (the paged path packs requests and never pads)."""
    from unittest import mock

    from megatron_cascade.rollout import static

    with mock.patch.object(static, "accepts_padding_mask", return_value=False) as probe:
        batch = generate(model, PROMPTS + PROMPTS[:1], GREEDY, tokenizer=TOKENIZER, use_kv_cache=False)
    assert probe.called
    return batch


def _with(params: SamplingParams, **changes) -> SamplingParams:
    from dataclasses import replace

    return replace(params, **changes)


def layout_worker(parallel: ParallelConfig, weights_dir: str) -> dict:
    """Another layout (TP=2 or PP=2), same weights: greedy and sampled runs and the trainer check."""
    model = _setup(parallel, weights_dir, save=False)
    greedy = generate(model, PROMPTS, GREEDY, tokenizer=TOKENIZER)
    sampled = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER)
    out = {"greedy": _summary(greedy), "sampled": _summary(sampled)}
    if parallel.pipeline_model_parallel_size == 1:
        out["sampled_train"] = _training_check(model, sampled, SAMPLED.temperature)
        out["sampled_stage_train"] = _stage_trainer_check(model, sampled, SAMPLED)
    else:
        overlapped = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER, overlap_pipeline_stages=True)
        out["sampled_overlapped"] = _summary(overlapped)
        out["overlapped_steps"] = overlapped.stats.steps
        # KV on demand under pressure, both schedules: 3 blocks of 16 tokens (the longest request
        # alone), and 8 blocks split over two lanes (4 each); every stage must preempt alike.
        for name, blocks, overlap in (("preempted", 3, False), ("preempted_overlapped", 8, True)):
            kv_cache = KVCacheConfig(kv_cache_bytes=(blocks + 1) * STAGE_BLOCK_BYTES, block_size_tokens=16)
            batch = generate(model, PROMPTS, SAMPLED, tokenizer=TOKENIZER, kv_cache=kv_cache,
                             overlap_pipeline_stages=overlap)
            out[name] = dict(_summary(batch), preemptions=batch.stats.preemptions)
    return out


# One KV block of 16 tokens on one of two pipeline stages (one layer): fp32 x (K, V) x 16 x 2 heads x 16.
STAGE_BLOCK_BYTES = 4 * 2 * 1 * 16 * 2 * 16
