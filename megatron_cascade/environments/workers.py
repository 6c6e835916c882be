"""Environment calls in daemon threads with deadlines: a tool that hangs is abandoned at its deadline
(its episode ends) instead of stalling the step, and never keeps the trainer from exiting.

Python cannot stop a thread: an abandoned call runs on until it returns. Tools that can run away
(model-written programs) must bound themselves — the ``python`` tool runs in the code sandbox, which
kills the program's process tree at its own timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Pending:
    """One call ``fn(*args)`` running in a daemon thread, due ``timeout_s`` seconds from now."""

    def __init__(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.value: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(fn, args), daemon=True, name="environment-step").start()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self.value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, whatever it is
            self.error = exc
        finally:
            self._done.set()

    def wait(self) -> bool:
        """Block until the call returned (True) or its deadline passed (False: abandoned)."""
        return self._done.wait(max(0.0, self.deadline - time.monotonic()))

    @property
    def done(self) -> bool:
        return self._done.is_set()
