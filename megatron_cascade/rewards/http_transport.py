"""One JSON POST with a total deadline, a reply size cap and no redirects (the reward-model client).

Plain ``urllib.request.urlopen`` is unsafe against a slow or hostile server: its ``timeout`` bounds
each socket operation, so a server trickling a byte a second keeps a request alive indefinitely;
``read()`` takes a reply of any size whole (a 400 MiB reply, 400 MiB of memory); and its redirect
handler re-sends the request's headers, the API key included, to whatever host ``Location`` names.
Here:

* the deadline covers the whole attempt (connect, TLS, request, status, headers, body): a timer
  shuts the connection's socket down when it passes, which ends any blocked read at once. Name
  resolution (DNS) happens before the socket exists and is not covered;
* the reply is read in chunks and refused past ``max_reply_bytes`` (at once when its
  ``Content-Length`` announces more);
* a redirect is never followed: a 3xx reply is an error naming its ``Location``, so credentials
  never leave the configured host (configure the final address instead);
* a request refused for its size (HTTP 413, or 400/422 whose body speaks of the context length, as
  vLLM, SGLang and OpenAI word it) raises :class:`RequestTooLongError`: the caller knows which text
  made it long (a response padded past a judge's context is that response's fault, not the server's).

Proxies from the environment (``https_proxy``, ``no_proxy``) apply as with plain urllib.
"""

from __future__ import annotations

import functools
import http.client
import json
import re
import socket
import threading
import urllib.error
import urllib.request
from typing import Any, Mapping


class RetryableError(RuntimeError):
    """A transient failure (deadline passed, connection error, HTTP 429/5xx)."""


class ReplyTooLargeError(RuntimeError):
    """The reply is larger than ``max_reply_bytes``."""


class RedirectRefusedError(RuntimeError):
    """The server answered with a redirect, which is not followed."""


class RequestTooLongError(RuntimeError):
    """The server refused the request for its length (HTTP 413, or 400/422 about the context length)."""


# How OpenAI-compatible servers word a prompt longer than the model's context (vLLM: "This model's
# maximum context length is 4096 tokens. However, you requested ..."; SGLang: "The input (5000 tokens)
# is longer than the model's context length (4096 tokens)."; others: "prompt is too long").
_CONTEXT_LENGTH = re.compile(r"context[ _-]?(length|window|size)|too long|too many tokens|maximum .{0,40}length",
                             re.IGNORECASE)
_ERROR_BODY_BYTES = 16384  # of a 4xx reply, read to tell a context-length refusal from another one


class _Deadline:
    """Shuts down every socket registered with :meth:`watch` once ``seconds`` have passed."""

    def __init__(self, seconds: float) -> None:
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shutdown(sock)
        return sock

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # a blocked recv() in another thread returns at once
    except OSError:
        pass


def _watched(connection_class: type) -> type:
    """``connection_class`` whose TCP socket is registered with a :class:`_Deadline` as soon as it
    connects (before TLS and any proxy tunnel, so that those are covered too)."""

    class Watched(connection_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            create = self._create_connection
            self._create_connection = lambda *a, **k: deadline.watch(create(*a, **k))

    return Watched


_WatchedHTTP = _watched(http.client.HTTPConnection)
_WatchedHTTPS = _watched(http.client.HTTPSConnection)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTP, deadline=self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTPS, deadline=self._deadline), req, context=self._context)


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        fp.close()
        raise RedirectRefusedError(
            f"{req.full_url} answered HTTP {code}, a redirect to {newurl}; redirects are not followed so that "
            "the request (and its API key) never goes to another address: configure the final URL")


def post_json(url: str, body: Any, *, headers: Mapping[str, str], timeout_s: float, max_reply_bytes: int) -> Any:
    """POST ``body`` as JSON to ``url``; the decoded JSON reply.

    Args:
        timeout_s: total deadline of the attempt in seconds, from connecting to the reply's last byte.
        max_reply_bytes: largest reply body accepted.
    Raises:
        RetryableError: the deadline passed, the connection failed, or HTTP 429 / 5xx.
        RequestTooLongError: HTTP 413, or 400 / 422 whose body names the context length.
        urllib.error.HTTPError: another HTTP error status (4xx).
        RedirectRefusedError: a 3xx reply.
        ReplyTooLargeError: the reply exceeds ``max_reply_bytes``.
        ValueError: the reply is not JSON.
    """
    deadline = _Deadline(timeout_s)
    opener = urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline), _RefuseRedirects())
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=dict(headers))
    try:
        with opener.open(request, timeout=timeout_s) as resp:
            payload = _read_capped(resp, max_reply_bytes)
    except urllib.error.HTTPError as e:
        try:
            detail = e.read(_ERROR_BODY_BYTES).decode("utf-8", "replace") if e.code in (400, 422) else ""
        except (OSError, http.client.HTTPException):
            detail = ""
        finally:
            e.close()
        if e.code == 429 or e.code >= 500:
            raise RetryableError(f"HTTP {e.code}") from e
        if e.code == 413 or _CONTEXT_LENGTH.search(detail):
            raise RequestTooLongError(f"HTTP {e.code}: the request is too long for the server: {detail[:300]!r}") from e
        raise
    except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, resets, truncated replies
        raise RetryableError(_expired(timeout_s) if deadline.expired else f"{type(e).__name__}: {e}") from e
    finally:
        deadline.cancel()
    if deadline.expired:  # a reply without Content-Length cut by the shutdown reads as a short one
        raise RetryableError(_expired(timeout_s))
    try:
        return json.loads(payload)
    except ValueError as e:
        raise ValueError(f"reply is not JSON: {payload[:200]!r}") from e


def _expired(timeout_s: float) -> str:
    return f"no complete reply within timeout_s={timeout_s:g} s (total deadline of the attempt)"


def _read_capped(resp: http.client.HTTPResponse, max_bytes: int) -> bytes:
    length = resp.headers.get("Content-Length", "").strip()
    if length.isdigit() and int(length) > max_bytes:
        raise ReplyTooLargeError(f"reply of {int(length)} bytes (Content-Length) exceeds "
                                 f"max_reply_bytes={max_bytes}; not read")
    chunks, size = [], 0
    while True:
        chunk = resp.read(min(1 << 16, max_bytes + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise ReplyTooLargeError(f"reply exceeds max_reply_bytes={max_bytes}; stopped reading")
