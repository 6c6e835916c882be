"""Workers of the episode tests: the tiny model, ``run_episodes`` on the scripted environment, and a
hand-built reference of what the episodes' tokens, masks and log-probs must be."""

from __future__ import annotations

import dataclasses
import time

import torch

from megatron_cascade.config import ModelConfig, ParallelConfig
from megatron_cascade.environments.episode import EpisodeSettings
from megatron_cascade.environments.runner import _TURN_SEED_STRIDE, run_episodes
from megatron_cascade.environments.single_turn import SingleTurnEnvironment
from megatron_cascade.rollout import SamplingParams, generate, pack_rollouts
from megatron_cascade.tokenizers import CharTokenizer
from scripted_env import ScriptedEnv, observation

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=103, max_position_embeddings=128, init_method_std=0.05)
TOK = CharTokenizer()
PROMPTS = [TOK.apply_chat_template([{"role": "user", "content": t}]) for t in ("abc", "what is 2+2?", "hang")]
ROWS = [{"id": 0}, {"id": 1}, {"id": 2, "hang": True}]
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=7)
TURNS = 3
BUDGET = 10  # a token budget the scripted episodes run into


def _settings(env, max_turns=4, budget=60, timeout=5.0) -> EpisodeSettings:
    return EpisodeSettings(env, max_turns, budget, timeout)


def _summary(batch) -> dict:
    return {"response": [s.response_ids for s in batch], "mask": [s.response_mask for s in batch],
            "logprobs": [s.response_logprobs for s in batch], "turns": [s.turns for s in batch],
            "finish": [s.finish_reason for s in batch], "turn_rewards": [s.turn_rewards for s in batch],
            "timed_out": [s.timed_out for s in batch], "metrics": [s.metrics for s in batch]}


def hand_reference(model) -> dict:
    """The episodes built turn by turn with plain ``generate`` calls: turn 0 is the step's call,
    then each live episode's context (prompt, turns, observations) continued with the turn's seed."""
    stop = dataclasses.replace(PARAMS, stop_strings=ScriptedEnv.stop_strings)
    first = generate(model, PROMPTS[:2], stop, tokenizer=TOK)
    eps = [{"prompt": list(s.prompt_ids), "ids": list(s.response_ids), "mask": [1] * len(s.response_ids),
            "lp": list(s.response_logprobs), "turns": 1, "done": s.finish_reason == "length",
            "finish": s.finish_reason} for s in first]
    turn = 1
    while True:
        for ep in eps:  # the environment's answer to the turn just taken
            if ep["done"]:
                continue
            if ep["turns"] >= TURNS:
                ep["done"], ep["finish"] = True, "stop"
            else:
                obs = observation(TOK, ep["turns"])
                ep["ids"] += obs
                ep["mask"] += [0] * len(obs)
                ep["lp"] += [0.0] * len(obs)
        live = [ep for ep in eps if not ep["done"]]
        if not live:
            break
        params = dataclasses.replace(stop, n=1, seed=(PARAMS.seed + turn * _TURN_SEED_STRIDE) % 2**63)
        out = generate(model, [ep["prompt"] + ep["ids"] for ep in live], params, tokenizer=TOK)
        for ep, s in zip(live, out):
            ep["ids"] += s.response_ids
            ep["mask"] += [1] * len(s.response_ids)
            ep["lp"] += s.response_logprobs
            ep["turns"] += 1
            if s.finish_reason == "length":
                ep["done"], ep["finish"] = True, "length"
        turn += 1
    return {"response": [ep["ids"] for ep in eps], "mask": [ep["mask"] for ep in eps],
            "logprobs": [ep["lp"] for ep in eps], "turns": [ep["turns"] for ep in eps],
            "finish": [ep["finish"] for ep in eps]}


def trainer_check(model, batch) -> dict:
    """A full-sequence forward of the packed episodes vs the rollout's log-probs on the loss mask."""
    from megatron.core import parallel_state as ps

    from megatron_cascade.ops import vocab_parallel_logprobs

    packed = pack_rollouts(batch, pad_id=TOK.pad_id)
    model.eval()
    with torch.no_grad():
        logits = model(packed.tokens, packed.position_ids, None)
    trainer = vocab_parallel_logprobs(logits, packed.targets, group=ps.get_tensor_model_parallel_group(),
                                      vocab_size=TOK.vocab_size)
    mask = packed.loss_mask.bool()
    return {"max_diff": (trainer - packed.inference_logprobs)[mask].abs().max().item(),
            "masked_tokens": int(mask.sum()), "tokens": packed.tokens.tolist(),
            "loss_mask": packed.loss_mask.tolist(), "inference_logprobs": packed.inference_logprobs.tolist()}


def reference_checks(model) -> dict:
    """TP=1: episodes vs the hand reference and the trainer; a token budget; single-turn vs plain
    generate; a hanging step."""
    out = {}
    env = ScriptedEnv(TOK, turns=TURNS)
    batch = run_episodes(model, PROMPTS[:2], ROWS[:2], [_settings(env)] * 2, PARAMS, tokenizer=TOK)
    out["episodes"] = _summary(batch)
    out["finished"] = len(env.finished)
    out["reference"] = hand_reference(model)
    out["trainer"] = trainer_check(model, batch)
    short = run_episodes(model, PROMPTS[:2], ROWS[:2], [_settings(ScriptedEnv(TOK, turns=TURNS), budget=BUDGET)] * 2,
                         PARAMS, tokenizer=TOK)
    out["short"] = _summary(short)
    single = run_episodes(model, PROMPTS, ROWS, [_settings(SingleTurnEnvironment(TOK), 1, PARAMS.max_new_tokens)] * 3,
                          PARAMS, tokenizer=TOK)
    out["single"] = _summary(single)
    plain = generate(model, PROMPTS, PARAMS, tokenizer=TOK)
    out["plain"] = {"response": [s.response_ids for s in plain], "logprobs": [s.response_logprobs for s in plain],
                    "finish": [s.finish_reason for s in plain]}
    hang = _settings(ScriptedEnv(TOK, turns=TURNS, hang_s=60.0), timeout=1.0)
    start = time.perf_counter()
    hung = run_episodes(model, PROMPTS, ROWS, [hang] * 3, dataclasses.replace(PARAMS, n=1), tokenizer=TOK)
    out["hang_s"] = time.perf_counter() - start
    out["hang_finished"] = sorted(state["row"]["id"] for state in hang.env.finished)
    out["hang"] = _summary(hung)
    slow_start = _settings(ScriptedEnv(TOK, turns=TURNS, hang_s=1.0, hang_in="start"), timeout=0.3)
    out["slow_start"] = _summary(run_episodes(model, PROMPTS, ROWS, [slow_start] * 3, dataclasses.replace(PARAMS, n=1),
                                              tokenizer=TOK))
    time.sleep(1.5)  # the abandoned start returns meanwhile
    out["slow_start_finished"] = sorted(state["row"]["id"] for state in slow_start.env.finished)
    return out


def episodes_worker(weights_dir: str) -> dict:
    """Two ranks: first TP=2 (environment steps on the source rank, outcomes broadcast), saving its
    random init; then the same weights at TP=1 (two data-parallel replicas, each running every
    reference check; one process start for both layouts)."""
    from megatron.core import parallel_state

    from megatron_cascade.testing.checkpoints import model_with_shared_weights

    model = model_with_shared_weights(MODEL, ParallelConfig(tensor_model_parallel_size=2), weights_dir, True,
                                      seed=1234)
    tp2 = _summary(run_episodes(model, PROMPTS[:2], ROWS[:2], [_settings(ScriptedEnv(TOK, turns=TURNS))] * 2,
                                PARAMS, tokenizer=TOK))
    parallel_state.destroy_model_parallel()
    model = model_with_shared_weights(MODEL, ParallelConfig(), weights_dir, False, seed=1234)
    return {"tp2": tp2, **reference_checks(model)}
