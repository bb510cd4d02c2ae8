"""A sweep trial's channel between its Tune trainable and its experiment's task: one actor holding two FIFO lanes,
the rounds (experiment -> trainable) and their go-aheads (trainable -> experiment, under a scheduler), instead of
two ray.util.queue.Queue actors (a worker process each). This module imports nothing of raysim, so that the
actor's worker process imports only Ray, as a Ray queue's does."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

ROUNDS, ACKS = "rounds", "acks"


class Lanes:
    """Two asyncio queues in one actor (an asyncio actor: a waiting get blocks no put)."""

    def __init__(self) -> None:
        self.lanes: dict[str, asyncio.Queue] = {ROUNDS: asyncio.Queue(), ACKS: asyncio.Queue()}

    async def put(self, lane: str, item: Any) -> None:
        self.lanes[lane].put_nowait(item)

    async def get(self, lane: str, timeout_s: float) -> tuple[bool, Any]:
        """(True, the lane's next item), or (False, None) if none came within `timeout_s`."""
        try:
            return True, await asyncio.wait_for(self.lanes[lane].get(), timeout_s)
        except asyncio.TimeoutError:
            return False, None

    async def take(self, lane: str, wait_s: float) -> list[Any]:
        """Everything on the lane, waiting up to `wait_s` for its first item."""
        queue = self.lanes[lane]
        items = []
        if queue.empty() and wait_s > 0:
            try:
                items.append(await asyncio.wait_for(queue.get(), wait_s))
            except asyncio.TimeoutError:
                return []
        while not queue.empty():
            items.append(queue.get_nowait())
        return items

    async def clear(self) -> None:
        for queue in self.lanes.values():
            while not queue.empty():
                queue.get_nowait()


def start_lanes(scheduling_strategy: Any) -> Any:
    """A new Lanes actor (no CPU reserved) placed by `scheduling_strategy`."""
    return ray.remote(num_cpus=0)(Lanes).options(scheduling_strategy=scheduling_strategy).remote()
