"""Issue 13 item 2: the reward-model client against hostile servers (real local HTTP servers).

A server that trickles bytes cannot hold a call past ``timeout_s``; a huge reply is refused, not
read whole; a redirect never carries the API key to another host; one item the server rejects
fails alone; bad kwargs fail when the reward is built, naming the kwarg.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_cascade.rewards import build_reward, score_batch
from megatron_cascade.rewards.reward_model import RewardModelClient
from megatron_cascade.rewards.scoring import ScoringPool, finalize_outcomes


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client hanging up mid-reply is the point here
        pass


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.requests.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                     "body": body})
        self.server.behavior(self, body)

    do_POST = do_GET = _handle


@pytest.fixture
def serve():
    """Start servers with a behavior(handler, body) function; all are shut down after."""
    servers = []

    def start(behavior):
        server = _Server(("127.0.0.1", 0), _Handler)
        server.behavior, server.requests, server.stop = behavior, [], threading.Event()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.stop.set()
        server.shutdown()
        server.server_close()


def _reply(handler, status: int, payload: bytes, headers: dict | None = None) -> None:
    handler.send_response(status)
    for key, value in {"Content-Length": str(len(payload)), **(headers or {})}.items():
        handler.send_header(key, value)
    handler.end_headers()
    handler.wfile.write(payload)


def _trickle(handler, data: bytes, every_s: float) -> None:
    for i in range(len(data)):
        if handler.server.stop.is_set():
            return
        handler.wfile.write(data[i:i + 1])
        time.sleep(every_s)


@pytest.mark.parametrize("where", ["body", "headers"])
def test_trickling_server_is_cut_off_at_the_deadline(serve, where):
    """Before: each byte came within the 1 s socket timeout, so the call took the server's 8 s and
    returned its score."""
    payload = json.dumps({"score": 0.75}).encode() + b" " * 20

    def trickle(handler, body):
        head = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload)}\r\nContent-Type: application/json\r\n\r\n"
                ).encode()
        if where == "body":
            handler.wfile.write(head)
            _trickle(handler, payload, 0.2)
        else:
            _trickle(handler, head + payload, 0.1)

    _, url = serve(trickle)
    client = RewardModelClient(url, timeout_s=1.0, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout_s=1 s"):
        client.score("p", "x")
    assert time.monotonic() - start < 2.5


def test_trickle_is_retried_and_each_attempt_is_bounded(serve):
    server, url = serve(lambda handler, body: _trickle(handler, b"HTTP/1.1 200 OK\r\n" * 10, 0.2))
    reward = build_reward("reward_model", {"url": url, "timeout_s": 0.5, "max_retries": 1, "backoff_s": 0.01})
    start = time.monotonic()
    assert score_batch(reward, ["x", "y"], [{"prompt": "p"}] * 2) == ([0.0, 0.0], 2)
    assert time.monotonic() - start < 3.0 and len(server.requests) == 2


def _flood(handler, announce: bool) -> None:
    handler.send_response(200)
    if announce:
        handler.send_header("Content-Length", str(400 * 2**20))
    handler.end_headers()
    chunk = b"0" * 2**20
    sent = 0
    try:
        while sent < 400 * 2**20 and not handler.server.stop.is_set():
            handler.wfile.write(chunk)
            sent += len(chunk)
    except OSError:
        pass
    handler.server.sent = sent


def test_huge_announced_reply_is_refused_unread(serve):
    """Before: the 400 MiB were read whole, then 'reply is not JSON'."""
    server, url = serve(lambda handler, body: _flood(handler, announce=True))
    client = RewardModelClient(url, max_retries=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="max_reply_bytes=16777216"):
        client.score("p", "x")
    assert time.monotonic() - start < 5.0


def test_huge_unannounced_reply_stops_at_the_cap(serve):
    server, url = serve(lambda handler, body: _flood(handler, announce=False))
    client = RewardModelClient(url, max_retries=0, max_reply_bytes=2**20)
    with pytest.raises(RuntimeError, match="max_reply_bytes=1048576"):
        client.score("p", "x")
    deadline = time.monotonic() + 5
    while not hasattr(server, "sent") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.sent < 100 * 2**20  # the client hung up long before the 400 MiB


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_redirect_never_carries_the_api_key_to_another_host(serve, monkeypatch, code):
    """Before: on 301/302/303 urllib re-sent the request (as GET) with 'Authorization: Bearer ...' to
    the other server."""
    other, other_url = serve(lambda handler, body: _reply(handler, 200, b'{"score": 1.0}'))
    _, url = serve(lambda handler, body: _reply(handler, code, b"", {"Location": other_url + "/score"}))
    monkeypatch.setenv("MC_TEST_RM_KEY", "sekrit-key")
    client = RewardModelClient(url, max_retries=2, backoff_s=0.01, api_key_env="MC_TEST_RM_KEY")
    with pytest.raises(RuntimeError, match="redirect") as info:
        client.score("p", "x")
    assert other_url in str(info.value)  # the error names where it was sent
    assert other.requests == []


def test_rejected_item_fails_alone(serve):
    """Before: the server's 400 for the batch made all four items errors."""

    def picky(handler, body):
        responses = body.get("responses") or [body["response"]]
        if "BAD" in responses:
            return _reply(handler, 400, b"unsupported characters in response")  # a refusal not about length
        scores = [len(r) / 10 for r in responses]
        _reply(handler, 200, json.dumps({"scores": scores} if "responses" in body else {"score": scores[0]}).encode())

    server, url = serve(picky)
    reward = build_reward("reward_model", {"url": url, "batch_size": 4, "max_retries": 0})
    scores, errors = score_batch(reward, ["a", "BAD", "abc", "abcd"], [{"prompt": "p"}] * 4)
    assert scores == pytest.approx([0.1, 0.0, 0.3, 0.4]) and errors == 1


def test_one_malformed_score_fails_its_item_only(serve):
    """Before: a null (or NaN) among the batch's scores made every item an error (NaN: scored 0)."""
    _, url = serve(lambda handler, body: _reply(handler, 200, b'{"scores": [0.5, null, NaN, 0.25]}'))
    reward = build_reward("reward_model", {"url": url, "batch_size": 4, "max_retries": 0})
    scores, errors = score_batch(reward, ["a", "b", "c", "d"], [{"prompt": "p"}] * 4)
    assert scores == [0.5, 0.0, 0.0, 0.25] and errors == 2


@pytest.mark.parametrize("kwargs,key", [
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": float("nan")}, "timeout_s"),
    ({"score_range": [1, 1]}, "score_range"), ({"max_score": 0}, "max_score"),
    ({"max_reply_bytes": 0}, "max_reply_bytes"), ({"batch_size": 0}, "batch_size"),
    ({"max_retries": -1}, "max_retries"), ({"backoff_s": -1}, "backoff_s"), ({"mode": "judge"}, "mode"),
    ({"url": "file:///etc/passwd"}, "url"), ({"url": "127.0.0.1:8000"}, "url"),
])
def test_bad_kwargs_fail_when_the_reward_is_built(kwargs, key):
    """Before: build_reward accepted them; every scoring call then failed (or, for a NaN timeout or a
    file:// URL, did something else)."""
    with pytest.raises(ValueError, match=f"{key} must be"):
        build_reward("reward_model", {"url": "http://127.0.0.1:9", **kwargs})


@pytest.mark.parametrize("status, body", [(413, b""), (400, b'{"error": {"message": "The input (9000 tokens) is '
                                                                b'longer than the model\'s context length (4096 tokens)."}}')])
def test_a_response_too_long_for_the_reward_model_scores_zero_as_a_verdict(serve, status, body):
    """Before: the 413 / context-length 400 was the item's error (an invalid sample, advantage 0):
    padding a bad answer past the reward model's context escaped its low score."""

    def small_context(handler, body_in):
        responses = body_in.get("responses") or [body_in["response"]]
        if any(len(r) > 100 for r in responses):
            return _reply(handler, status, body)
        scores = [len(r) / 10 for r in responses]
        _reply(handler, 200, json.dumps({"scores": scores} if "responses" in body_in else {"score": scores[0]}).encode())

    _, url = serve(small_context)
    reward = build_reward("reward_model", {"url": url, "batch_size": 4, "max_retries": 0})
    responses = ["a", "b" * 5000, "abc"]
    scores, errors = score_batch(reward, responses, [{"prompt": "p"}] * 3)
    assert scores == pytest.approx([0.1, 0.0, 0.3]) and errors == 0
    pool = ScoringPool(max_workers=1)
    for response in responses:
        pool.submit(reward, response, {"prompt": "p"}, timeout_s=10)
    assert finalize_outcomes(pool.results(), "reward_model")[1:] == ([False] * 3, [False, True, False])
