"""Generating ranks meet outside every collective before the first collective after generation.

Data-parallel replicas (and decode-copy replicas) generate and score independently. A replica that
finishes early would wait for the slowest inside the next collective, whose timeout
(``distributed.timeout_minutes``, 120) is sized for training: one 121K-token straggler, or a slow
remote judge, makes the watchdog kill the job. Here each rank counts itself in at the process
group's key-value store and waits for the last arrival's key: no collective runs while ranks wait, so
no collective timeout can fire. The wait has its own bound (``distributed.generation_wait_minutes``),
after which the error names the ranks still generating.
"""

from __future__ import annotations

import itertools
import time

import torch.distributed as dist

_PREFIX = "megatron_cascade/generation_meeting"
_meetings = itertools.count()  # every rank meets in the same order (each rollout round, each eval domain)
_POLL_S = (0.005, 1.0)  # first and longest pause between looks at the store


class GenerationStragglerError(RuntimeError):
    """Ranks still generating when the meeting's bound ran out."""


def meet_after_generation(wait_minutes: float, what: str = "generation") -> float:
    """Wait, outside any collective, until every rank of the job has called this (collective in the
    sense that every rank must call it the same number of times). Returns the seconds waited.

    Raises:
        GenerationStragglerError: some rank had not arrived after ``wait_minutes``; names them.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    key = f"{_PREFIX}/{next(_meetings)}"
    start = time.monotonic()
    store.set(f"{key}/rank{rank}", "1")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/all", "1")
    deadline, pause = start + 60.0 * wait_minutes, _POLL_S[0]
    while not store.check([f"{key}/all"]):
        if time.monotonic() > deadline:
            late = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
            raise GenerationStragglerError(
                f"rank(s) {late} still in {what} after distributed.generation_wait_minutes={wait_minutes:g} "
                f"(rank {rank} had finished); raise it for longer responses, or look at those ranks' logs")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S[1])
    return time.monotonic() - start
