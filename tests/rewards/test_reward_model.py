"""Reward-model client against real local HTTP servers (127.0.0.1, ephemeral ports)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_cascade.rewards import build_reward, score_batch
from megatron_cascade.rewards.reward_model import RewardModelClient, parse_judge_score


class _Handler(BaseHTTPRequestHandler):
    behavior = "ok"  # replaced per server via a subclass

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.path, body))
        self.server.behavior(self, body)

    def reply(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def serve():
    """Start servers with a behavior(handler, body) function; all are shut down after."""
    servers = []

    def start(behavior):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.behavior = behavior
        server.requests = []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _score_len(handler, body):
    """Scalar server: score = len(response) / 10, single or batched."""
    if "responses" in body:
        handler.reply(200, json.dumps({"scores": [len(r) / 10 for r in body["responses"]]}).encode())
    else:
        handler.reply(200, json.dumps({"score": len(body["response"]) / 10}).encode())


def test_score_mode_single_and_batched(serve):
    server, url = serve(_score_len)
    reward = build_reward("reward_model", {"url": url, "batch_size": 2})
    assert reward("abcde", {"prompt": "p"}) == 0.5
    scores, errors = score_batch(reward, ["a", "ab", "abc", "abcdefghijkl"], [{"prompt": "p"}] * 4)
    assert errors == 0 and scores == pytest.approx([0.1, 0.2, 0.3, 1.0])
    batched = [b for _, b in server.requests if "responses" in b]
    assert [len(b["responses"]) for b in batched] == [2, 2]


def test_chat_mode_parses_judge_score(serve):
    def judge(handler, body):
        assert "Response:\nfine answer" in body["messages"][0]["content"]
        reply = {"choices": [{"message": {"role": "assistant", "content": "Solid work.\nScore: 8"}}]}
        handler.reply(200, json.dumps(reply).encode())

    server, url = serve(judge)
    reward = build_reward("reward_model", {"url": url, "mode": "chat"})
    assert reward("fine answer", {"prompt": "q"}) == pytest.approx(0.8)
    assert server.requests[0][0] == "/v1/chat/completions"


def test_retries_then_succeeds(serve):
    calls = []

    def flaky(handler, body):
        calls.append(1)
        if len(calls) < 3:
            handler.reply(503, b"busy")
        else:
            _score_len(handler, body)

    _, url = serve(flaky)
    client = RewardModelClient(url, max_retries=3, backoff_s=0.01)
    assert client.score("p", "abc") == pytest.approx(0.3)
    assert len(calls) == 3


def test_hanging_server_times_out(serve):
    release = threading.Event()
    _, url = serve(lambda handler, body: release.wait(10))
    reward = build_reward("reward_model", {"url": url, "timeout_s": 0.3, "max_retries": 1,
                                           "backoff_s": 0.01})
    start = time.monotonic()
    scores, errors = score_batch(reward, ["x", "y"], [{"prompt": "p"}] * 2)
    elapsed = time.monotonic() - start
    release.set()
    assert scores == [0.0, 0.0] and errors == 2
    assert elapsed < 6.0  # the server holds each request 10 s


@pytest.mark.parametrize("payload", [b"<html>oops</html>", b'{"nope": 1}', b'{"score": "high"}'])
def test_garbage_reply_scores_zero(serve, payload):
    _, url = serve(lambda handler, body: handler.reply(200, payload))
    reward = build_reward("reward_model", {"url": url, "max_retries": 0})
    scores, errors = score_batch(reward, ["x"], [{"prompt": "p"}])
    assert scores == [0.0] and errors == 1


def test_client_error_is_not_retried(serve):
    server, url = serve(lambda handler, body: handler.reply(400, b"bad request"))
    reward = build_reward("reward_model", {"url": url, "max_retries": 3, "backoff_s": 0.01})
    assert score_batch(reward, ["x"], [{"prompt": "p"}]) == ([0.0], 1)
    assert len(server.requests) == 1


def test_parse_judge_score():
    assert parse_judge_score("I'd say 3... no, Score: 7.5") == 7.5
    assert parse_judge_score("rating 9") == 9.0
    with pytest.raises(ValueError):
        parse_judge_score("excellent")


def test_missing_url_is_a_clear_error():
    with pytest.raises(TypeError, match="url"):
        build_reward("reward_model", {})
