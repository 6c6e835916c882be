"""Rollout metrics of one RL step, from sums all-reduced over data-parallel ranks.

Names are what TensorBoard and ``metrics.jsonl`` show (documented in the README's metrics table).
"""

from __future__ import annotations

import math


def _div(num: float, den: float) -> float:
    return num / den if den else 0.0


def rollout_metrics(total: dict[str, float], peaks: dict[str, float], prompts_per_step: int,
                    teachers: dict[str, str]) -> dict[str, float]:
    """Means, fractions and maxima of a step's rollouts.

    Args:
        total: global sums (``RolloutStage._rollout_sums`` keys, plus ``groups_trained``,
            ``advantage_abs_sum``, ``samples_trained`` for GRPO, ``mopd_rkl_sum/*``,
            ``mopd_tokens/*`` for MOPD, and ``episode*`` keys for multi-turn environments).
        peaks: global maxima (``response_length_max``, ``sampling_rounds``, ``generation_peak_requests``,
            ``generation_expected_fraction``).
        prompts_per_step: the stage's prompts per step (the batch dynamic sampling fills).
        teachers: MOPD teacher (stage name or folder) per domain; {} otherwise.
    """
    domains = sorted(k.split("/", 1)[1] for k in total if k.startswith("samples/"))
    sum_of = lambda prefix: sum(total[f"{prefix}/{d}"] for d in domains)  # noqa: E731
    samples = sum_of("samples")
    out = {
        "response/length_mean": _div(sum_of("length_sum"), samples),
        "response/length_max": peaks["response_length_max"],
        "finish/stop_frac": _div(sum_of("stop_sum"), samples),
        "groups/informative_frac": _div(total["groups_informative"], total["groups"]),
        "sampling/rounds": peaks["sampling_rounds"],
        "sampling/groups_generated": total["groups"],
        "generation/preemptions": total.get("generation_preemptions", 0.0),
        "generation/recomputed_tokens": total.get("generation_recomputed_tokens", 0.0),
        "generation/peak_requests": peaks.get("generation_peak_requests", 0.0),
    }
    if "generation_expected_fraction" in peaks:  # what admission expected of each response
        out["generation/expected_response_fraction"] = peaks["generation_expected_fraction"]
    if any(k.startswith("scored/") for k in total):  # a stage with rewards
        out.update(_reward_metrics(total, domains, samples, sum_of))
    out["finish/length_frac"] = 1.0 - out["finish/stop_frac"]
    for d in domains:
        if total[f"samples/{d}"]:
            out[f"response/length_mean/{d}"] = _div(total[f"length_sum/{d}"], total[f"samples/{d}"])
            out[f"finish/stop_frac/{d}"] = _div(total[f"stop_sum/{d}"], total[f"samples/{d}"])
    if "groups_trained" in total:
        out["batch/effective_prompts"] = total["groups_trained"]
        out["batch/effective_frac"] = total["groups_trained"] / prompts_per_step
        out["advantage/abs_mean"] = _div(total["advantage_abs_sum"], total["samples_trained"])
    out.update(_reverse_kl(total, teachers))
    if "episodes" in total:  # a stage with a multi-turn environment
        out.update(_episode_metrics(total))
    return out


def _episode_metrics(total: dict[str, float]) -> dict[str, float]:
    """Multi-turn episodes: model turns per episode, environment metrics per episode (tool calls and
    the fraction that ran), step timeouts and errors, and the reward per model turn (scored episodes:
    the reward the advantages see over their turns)."""
    episodes = total["episodes"]
    out = {
        "episode/turns_mean": _div(total["episode_turns"], episodes),
        "episode/timeouts": total["episode_timeouts"],
        "episode/env_errors": total["episode_env_errors"],
        "episode/reward_per_turn": _div(total["episode_scored_reward"], total["episode_scored_turns"]),
    }
    for key in sorted(k for k in total if k.startswith("episode_metric/")):
        out[f"episode/{key.split('/', 1)[1]}_mean"] = _div(total[key], episodes)
    if "episode_metric/tool_calls" in total and "episode_metric/tool_calls_ok" in total:
        out["episode/tool_call_success_frac"] = _div(total["episode_metric/tool_calls_ok"],
                                                     total["episode_metric/tool_calls"])
    return out


def _reward_metrics(total: dict[str, float], domains: list[str], samples: float, sum_of) -> dict[str, float]:
    """Reward mean/std over samples whose reward did not fail (after the overlong policy), the
    verifiers' raw mean, failures (infrastructure: invalid samples) and response faults (responses
    that broke their own scoring: scored 0, among the scored), in all and per domain, and the mean
    per domain."""
    scored = sum_of("scored")
    mean = _div(sum_of("reward_sum"), scored)
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(0.0, _div(sum_of("reward_sq_sum"), scored) - mean * mean)),
        "reward/raw_mean": _div(sum_of("raw_reward_sum"), scored),
        "reward/errors": samples - scored,
        "reward/error_frac": _div(samples - scored, samples),
        "reward/response_faults": sum(total.get(f"response_faults/{d}", 0.0) for d in domains),
    }
    for d in domains:
        if total[f"scored/{d}"]:
            out[f"reward/domain/{d}"] = total[f"reward_sum/{d}"] / total[f"scored/{d}"]
        if total[f"samples/{d}"]:
            out[f"reward/errors/{d}"] = total[f"samples/{d}"] - total[f"scored/{d}"]
            out[f"reward/response_faults/{d}"] = total.get(f"response_faults/{d}", 0.0)
    return out


def _reverse_kl(total: dict[str, float], teachers: dict[str, str]) -> dict[str, float]:
    """MOPD: mean sampled-token reverse KL to the teacher, per domain and per teacher (nats)."""
    out, per_teacher = {}, {}
    tags = teacher_tags(teachers.values())
    for domain, teacher in teachers.items():
        kl, tokens = total.get(f"mopd_rkl_sum/{domain}", 0.0), total.get(f"mopd_tokens/{domain}", 0.0)
        if tokens:
            out[f"reverse_kl/domain/{domain}"] = kl / tokens
        acc = per_teacher.setdefault(tags[teacher], [0.0, 0.0])
        acc[0] += kl
        acc[1] += tokens
    for tag, (kl, tokens) in per_teacher.items():
        if tokens:
            out[f"reverse_kl/teacher/{tag}"] = kl / tokens
    return out


def teacher_tags(teachers) -> dict[str, str]:
    """A metric tag per distinct teacher: a stage name as it is; a folder by the shortest tail of its
    path that tells it from the others (``.../rlhf/final`` and ``.../code_rl/final`` ->
    ``rlhf_final``, ``code_rl_final``), path separators as ``_``."""
    distinct = sorted(set(teachers))
    parts = {t: [p for p in t.split("/") if p not in ("", ".")] or [t] for t in distinct}
    tags = {}
    for t in distinct:
        for n in range(1, len(parts[t]) + 1):
            tail = parts[t][-n:]
            if sum(1 for u in distinct if parts[u][-n:] == tail) == 1:
                break
        tags[t] = "_".join(tail)
    return tags
