"""Group rewards (issue 16 item 4): ``pairwise_judge`` scores all responses of a prompt together
against a real local HTTP judge (a thread on 127.0.0.1) that decides by a rule, and the rollout
scorer calls a group reward once per prompt with all of its responses.

The judge's rule: the response holding the larger number wins; magic responses make it misbehave
(no verdict, too slow, a huge reply, HTTP 500) and only those responses become invalid samples.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_cascade.rewards import build_reward
from megatron_cascade.rewards.outcome import ResponseFault
from megatron_cascade.rewards.pairwise_judge import pairs_for, parse_verdict, render_conversation
from megatron_cascade.rewards.scoring import finalize_outcomes
from megatron_cascade.testing import run_distributed

_STOP = threading.Event()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a handler still sleeping must not hold the test at shutdown

    def handle_error(self, request, client_address):  # the client hanging up on a hostile reply is the point
        pass


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        self.server.contents.append(content)
        self.server.behavior(self, content)

    def reply_text(self, text: str) -> None:
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _sides(content: str) -> tuple[str, str]:
    a = re.search(r"\[Response A\]\n(.*?)\n\[End of response A\]", content, re.S).group(1)
    b = re.search(r"\[Response B\]\n(.*?)\n\[End of response B\]", content, re.S).group(1)
    return a, b


def larger_number_wins(handler, content: str) -> None:
    a, b = _sides(content)
    for side in (a, b):
        if side == "MALFORMED":
            return handler.reply_text("Both are fine, I cannot decide.")
        if side == "SLOW":
            _STOP.wait(30)
            return handler.reply_text("Winner: A")
        if side == "HUGE":
            handler.send_response(200)
            handler.end_headers()  # no Content-Length: the client must stop at its cap
            for _ in range(256):
                handler.wfile.write(b"x" * 65536)
            return None
        if side == "FAIL":
            handler.send_response(500)
            handler.send_header("Content-Length", "0")
            return handler.end_headers()
    x, y = float(a), float(b)
    handler.reply_text("Reasoning...\nWinner: " + ("A" if x > y else "B" if y > x else "tie"))


def always_a(handler, content: str) -> None:
    handler.reply_text("**Winner:** [[A]]")


@pytest.fixture
def judge():
    servers = []

    def start(behavior):
        server = _Server(("127.0.0.1", 0), _Handler)
        server.behavior, server.contents = behavior, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    _STOP.clear()
    yield start
    _STOP.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def _group(url: str, responses, sample, **kwargs):
    reward = build_reward("pairwise_judge", {"url": url, "backoff_s": 0.0, **kwargs})
    assert reward.has_group
    return reward.group(responses, sample)


def test_round_robin_win_rate(judge):
    server, url = judge(larger_number_wins)
    assert _group(url, ["3", "1", "2", "0"], {"prompt": "q"}) == [1.0, pytest.approx(1 / 3), pytest.approx(2 / 3), 0.0]
    assert len(server.contents) == 12  # 6 pairs, each in both orders


def test_swap_cancels_a_position_biased_judge(judge):
    _, url = judge(always_a)
    assert _group(url, ["3", "1", "2"], {"prompt": "q"}) == [0.5, 0.5, 0.5]
    assert _group(url, ["3", "1", "2"], {"prompt": "q"}, swap=False) == [1.0, 0.5, 0.0]  # biased: order decides


def test_against_the_reference_answer(judge):
    server, url = judge(larger_number_wins)
    assert _group(url, ["3", "2", "1"], {"prompt": "q", "answer": "2"}, compare="reference") == [1.0, 0.5, 0.0]
    assert len(server.contents) == 6
    # A single response (a group of one, e.g. evaluation) is judged against the reference.
    reward = build_reward("pairwise_judge", {"url": url})
    assert reward("5", {"prompt": "q", "answer": "2"}) == 1.0
    with pytest.raises(ValueError, match="a group of one and no reference answer"):
        reward("5", {"prompt": "q"})


def test_limited_opponents():
    assert pairs_for(4, "peers", 0, False) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert pairs_for(5, "peers", 1, False) == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]  # a ring: G pairs
    assert pairs_for(3, "reference", 0, True) == [(0, -1), (1, -1), (2, -1)]


def test_messages_rows_render_the_whole_conversation(judge):
    server, url = judge(larger_number_wins)
    row = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "pick a number"},
                        {"role": "assistant", "content": "7?"}, {"role": "user", "content": "a bigger one"}]}
    assert _group(url, ["9", "8"], row) == [1.0, 0.0]
    rendered = "[system]\nbe brief\n\n[user]\npick a number\n\n[assistant]\n7?\n\n[user]\na bigger one"
    assert rendered in server.contents[0]
    assert render_conversation({"prompt": "plain"}) == "plain"


def test_verdict_parsing():
    assert parse_verdict("winner = b") == 0.0 and parse_verdict("Winner: tie.") == 0.5
    assert parse_verdict("Winner: B ... on reflection Winner: A") == 1.0  # the last verdict
    with pytest.raises(ValueError, match="no verdict"):
        parse_verdict("Winner: C")
    start = time.perf_counter()
    with pytest.raises(ValueError):
        parse_verdict("winner" + " " * 50_000 + "x")  # no backtracking blow-up
    assert time.perf_counter() - start < 0.5


def test_hostile_judge_makes_only_its_responses_invalid_and_stays_bounded(judge):
    _, url = judge(larger_number_wins)
    start = time.perf_counter()
    # timeout_s leaves a loaded CI machine time for the fast replies (an HTTP 500 must not time out).
    out = _group(url, ["5", "1", "MALFORMED", "SLOW", "HUGE", "FAIL"], {"prompt": "q"},
                 timeout_s=2.0, max_retries=1, max_reply_bytes=1 << 16)
    elapsed = time.perf_counter() - start
    assert out[:2] == [1.0, 0.0]  # judged against each other; every comparison with a hostile one failed
    assert "no verdict" in str(out[2]) and isinstance(out[2], ValueError)
    assert re.search(r"timed out|within timeout_s=2 s", str(out[3])) and "max_reply_bytes" in str(out[4])
    assert "HTTP 500" in str(out[5])
    assert elapsed < 15.0  # 2 attempts x 2 s per slow judgment, concurrently; the server would hold 30 s


@pytest.mark.parametrize("kwargs,key", [
    ({"compare": "everyone"}, "compare"), ({"opponents": -1}, "opponents"), ({"swap": "yes"}, "swap"),
    ({"concurrency": 0}, "concurrency"), ({"timeout_s": 0}, "timeout_s"), ({"url": "ftp://x"}, "url"),
    ({"judge_template": "only {response_a}"}, "judge_template"), ({"judge_template": "{nope}"}, "judge_template"),
])
def test_bad_kwargs_fail_when_the_reward_is_built(kwargs, key):
    with pytest.raises(ValueError, match=key):
        build_reward("pairwise_judge", {"url": "http://127.0.0.1:9", **kwargs})


# -- in the rollout scorer --------------------------------------------------------------------------------

def _scorer_worker(url: str):
    from megatron_cascade.stages.rollout_scoring import RolloutScorer
    from megatron_cascade.config import ParallelConfig
    from megatron_cascade.config.schema import DomainConfig, RewardSpec
    from megatron_cascade.model import initialize_model_parallel
    from megatron_cascade.rollout import RolloutSample
    from megatron_cascade.tokenizers import CharTokenizer

    initialize_model_parallel(ParallelConfig(), seed=1)
    tok = CharTokenizer()
    kwargs = {"url": url, "backoff_s": 0.0, "timeout_s": 5.0, "max_retries": 0}
    domains = {"rlhf": DomainConfig(reward=RewardSpec(name="pairwise_judge", kwargs=kwargs, timeout_s=10.0,
                                                      reasoning_parser="think"))}
    rewards = {"rlhf": build_reward("pairwise_judge", kwargs)}
    texts = [["3", "<think>x</think>1", "2"], ["0", "<think>never closed 9", "8"], ["MALFORMED", "FAIL", "4"]]
    rows = [{"prompt": f"q{p}"} for p in range(3)]
    samples = [RolloutSample(p, k, tok.encode("q"), tok.encode(t), finish_reason="stop")
               for p, group in enumerate(texts) for k, t in enumerate(group)]
    out = {}
    for group_size in (None, 3):
        with RolloutScorer(rewards, domains, tok, rows, ["rlhf"] * 3, group_size=group_size) as scorer:
            for i, sample in enumerate(samples[:6]):  # generation finished the first two groups
                scorer.on_finished(i, sample)
            early = len(scorer.group_tickets)
            scores, errored, _ = scorer.collect_flags(samples)
        out[group_size] = (scores.tolist(), errored.tolist(), scorer.reasoning_unfinished.tolist(), early)
    return out


@pytest.mark.distributed
def test_scorer_calls_a_group_reward_once_per_prompt_with_all_its_responses(judge):
    server, url = judge(larger_number_wins)
    out = run_distributed(_scorer_worker, 1, url, timeout_s=120)[0]
    for group_size, early in ((None, 0), (3, 2)):
        scores, errored, unfinished, got_early = out[group_size]
        assert got_early == early  # a known group size sends a group as soon as its last response finished
        assert scores == [1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
        # The unfinished one is not judged (0, not an error); the hostile ones are invalid, and so is "4",
        # whose every comparison was against them.
        assert errored == [False] * 6 + [True] * 3
        assert unfinished == [False, False, False, False, True, False, False, False, False]
    judged = [_sides(c) for c in server.contents]
    assert ("3", "1") in judged and ("0", "8") in judged  # the answer after </think>; "9" never shown
    assert not any("9" in a or "9" in b for a, b in judged)


def _small_context_judge(handler, content: str) -> None:
    """A judge with a 200-character context, refusing longer prompts as vLLM words it (HTTP 400)."""
    if len(content) > 600:
        payload = json.dumps({"object": "error", "message": "This model's maximum context length is 200 tokens. "
                              f"However, you requested {len(content)} tokens.", "code": 400}).encode()
        handler.send_response(400)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        return handler.wfile.write(payload)
    return larger_number_wins(handler, content)


def test_a_losing_answer_padded_past_the_judge_context_loses_instead_of_escaping(judge):
    """Before: "1" padded to 2,000 characters got HTTP 400 in every judgment and was returned as an
    exception (an invalid sample: advantage 0 instead of the loser's negative one)."""
    _, url = judge(_small_context_judge)
    padded = "1" + " " * 2000
    out = _group(url, ["5", padded, "3"], {"prompt": "which is larger"})
    assert out[0] == 1.0 and out[2] == 0.5  # the padded answer forfeits: "3" beats it, loses to "5"
    assert isinstance(out[1], ResponseFault)  # lost every judgment by being too long: a verdict
    scores, errored, faulted = finalize_outcomes(out, "pairwise_judge")
    assert scores == [1.0, 0.0, 0.5] and errored == [False, False, False] and faulted == [False, True, False]
    # A judge that is down is still no verdict on anyone: every response an invalid sample.
    _, down = judge(lambda handler, content: (handler.send_response(404), handler.send_header("Content-Length", "0"),
                                              handler.end_headers()))
    out = _group(down, ["5", "3"], {"prompt": "which is larger"}, max_retries=0)
    assert finalize_outcomes(out, "pairwise_judge")[1] == [True, True]
