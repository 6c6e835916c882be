"""Run by tests/model/test_checkpoint_writer_signals.py in its own process group: SIGTERM to the whole
group every 2 ms while the checkpoint writer's manager starts, then a round trip through its queue."""

import os
import signal
import sys
import threading
import time

if __name__ == "__main__":
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_cascade.model import weights_checkpoint as checkpoint

    received = []
    signal.signal(signal.SIGTERM, lambda *_: received.append(1))  # the trainer's handler: note, stop later
    stop = threading.Event()

    def burst() -> None:
        while not stop.is_set():
            os.killpg(os.getpgrp(), signal.SIGTERM)
            time.sleep(0.002)

    thread = threading.Thread(target=burst)
    thread.start()
    try:
        checkpoint._signal_safe_writer_queue()
        queue = filesystem_async._results_queue
        queue.put("alive")
        print("queue:", queue.get(), "trainer saw SIGTERM:", bool(received))
    except Exception as exc:  # noqa: BLE001 - the result the test reads
        print(f"writer died: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        thread.join()
    sys.exit(0)
