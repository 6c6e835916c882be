"""Reasoning-aware scoring (issue 16 item 5): with ``reward.reasoning_parser: think`` the verifier
sees only the answer after ``</think>``; reasoning that never closed scores 0 without a verifier call
and is counted as unfinished (not as a reward error).

Before the parser, ``<think>... \\boxed{3} ...</think> The answer is 7`` (gold 7) scored 0: the math
verifier took the trace's last ``\\boxed{3}``; an unclosed ``<think>... \\boxed{7}`` scored 1.
"""

from pathlib import Path

import pytest

from megatron_cascade.config import ConfigError, load_config
from megatron_cascade.rewards.reasoning import ReasoningParser, split_reasoning
from megatron_cascade.testing import run_distributed

CI = str(Path(__file__).resolve().parents[2] / "examples" / "tiny_cascade" / "ci.yaml")


@pytest.mark.parametrize("text,opened,answer,reasoning,finished", [
    ("plain answer 7", False, "plain answer 7", "", True),
    ("<think>a b</think>  final", False, "final", "a b", True),
    ("noise <think>a</think>x</think>y", False, "x</think>y", "a", True),  # the first close after the open
    ("<think>still going \\boxed{7}", False, "", "still going \\boxed{7}", False),
    ("trace only</think> ans", False, "ans", "trace only", True),  # the template opened it unseen
    ("trace \\boxed{7}", True, "", "trace \\boxed{7}", False),  # the prompt opened it
    ("trace</think>ans", True, "ans", "trace", True),
])
def test_split_reasoning(text, opened, answer, reasoning, finished):
    parsed = split_reasoning(text, opened_in_prompt=opened)
    assert (parsed.answer, parsed.reasoning, parsed.finished) == (answer, reasoning, finished)


def test_custom_markers():
    parser = ReasoningParser("[R]", "[/R]")
    assert parser.parse("[R]x[/R] y").answer == "y"
    assert not parser.parse("[R]x </think> y").finished


SEEN: list[str] = []


def _recording_reward(response: str, sample: dict) -> float:
    SEEN.append(response)
    return 1.0


CASES = [  # response text, what each parser scores with the math verifier (gold 7)
    ("<think>maybe \\boxed{3}? no</think> The answer is \\boxed{7}", 1.0, 1.0),
    ("<think>maybe \\boxed{3}, or 7</think> The answer is 7", 0.0, 1.0),  # none: the trace's boxed 3
    ("<think>it is \\boxed{7} I think", 1.0, 0.0),  # think: unfinished
    ("The answer is \\boxed{7}", 1.0, 1.0),  # no reasoning at all
]


def _scorer_worker():
    import torch

    from megatron_cascade.stages.rollout_scoring import RolloutScorer, score_responses
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.config.schema import DomainConfig, RewardSpec
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.rewards import build_reward
    from megatron_cascade.rollout import RolloutSample
    from megatron_cascade.tokenizers import CharTokenizer

    initialize_model_parallel(ParallelConfig(), seed=1)
    tok = CharTokenizer()
    out = {}
    for parser in ("none", "think"):
        domains = {"math": DomainConfig(reward=RewardSpec(name="math", timeout_s=20.0, reasoning_parser=parser)),
                   "rec": DomainConfig(reward=RewardSpec(name="rec", reasoning_parser=parser))}
        rewards = {"math": build_reward("math"), "rec": _recording_reward}
        rows = [{"prompt": "q", "answer": "7"}] * len(CASES) + [{"prompt": "q"}] * 2
        prompt_domains = ["math"] * len(CASES) + ["rec"] * 2
        texts = [c[0] for c in CASES] + ["<think>secret</think>visible", "<think>never closed"]
        samples = [RolloutSample(i, 0, tok.encode("question"), tok.encode(t), finish_reason="stop")
                   for i, t in enumerate(texts)]
        SEEN.clear()
        with RolloutScorer(rewards, domains, tok, rows, prompt_domains) as scorer:
            scores, errored, _ = scorer.collect_flags(samples)
        serial, serial_errors, _ = score_responses(rewards, domains, texts, rows, prompt_domains)
        out[parser] = (scores.tolist(), errored.tolist(), scorer.reasoning_unfinished.tolist(), sorted(SEEN),
                       serial.tolist(), serial_errors)
    # The chat template opened the trace: the response holds only its end.
    domains = {"math": DomainConfig(reward=RewardSpec(name="math", timeout_s=20.0, reasoning_parser="think"))}
    opened = [RolloutSample(i, 0, tok.encode("question <think>\n"), tok.encode(t), finish_reason="stop")
              for i, t in enumerate(["so \\boxed{3}?</think>\\boxed{7}", "so \\boxed{7}"])]
    with RolloutScorer({"math": build_reward("math")}, domains, tok, [{"answer": "7"}] * 2, ["math"] * 2) as scorer:
        scores, errored, _ = scorer.collect_flags(opened)
    out["opened"] = (scores.tolist(), errored.tolist(), scorer.reasoning_unfinished.tolist())
    assert isinstance(scorer.reasoning_unfinished, torch.Tensor)
    return out


@pytest.mark.distributed
def test_scorer_verifier_sees_only_the_answer_and_unfinished_reasoning_scores_zero():
    out = run_distributed(_scorer_worker, 1, timeout_s=180)[0]
    n = len(CASES)
    for k, parser in ((1, "none"), (2, "think")):
        scores, errored, unfinished, seen, serial, serial_errors = out[parser]
        assert scores[:n] == [c[k] for c in CASES], parser
        assert not any(errored) and serial_errors == 0  # unfinished reasoning is not a reward error
        assert serial[:n] == scores[:n]  # score_responses agrees
    scores, _, unfinished, seen, _, _ = out["think"]
    assert unfinished == [False, False, True, False, False, True]
    assert seen == ["visible"] * 2  # the scorer's and score_responses' call: the answer only, nothing unfinished
    assert scores[n:] == [1.0, 0.0]
    assert out["none"][2] == [False] * (n + 2)
    assert out["none"][3] == ["<think>never closed"] * 2 + ["<think>secret</think>visible"] * 2
    assert out["opened"] == ([1.0, 0.0], [False, False], [False, True])


MARKERS_MESSAGE = r"domains\.math\.reward\.reasoning_markers=.* must be \[start, end\]"


@pytest.mark.parametrize("override,message", [
    ("domains.math.reward.reasoning_parser=deepseek", r"reasoning_parser='deepseek' is not one of \['none', 'think'\]"),
    ("domains.math.reward.reasoning_markers=[<think>]", MARKERS_MESSAGE),
    ("domains.math.reward.reasoning_markers=[x,x]", MARKERS_MESSAGE),
])
def test_bad_reasoning_config_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CI, [override], check_paths=False)


def test_reasoning_config_loads():
    cfg = load_config(CI, ["domains.math.reward.reasoning_parser=think",
                           "domains.math.reward.reasoning_markers=[<r>,</r>]"], check_paths=False)
    assert cfg.domains["math"].reward.reasoning_parser == "think"
    assert list(cfg.domains["math"].reward.reasoning_markers) == ["<r>", "</r>"]
