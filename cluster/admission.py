"""Admission control of the HTTP server: at most ``max_concurrent`` requests in
flight, at most ``max_queue_size`` waiting for a slot, each for at most
``queue_timeout_s``.

    async with admission.slot():      # QueueFullError (429) / QueueTimeoutError (408)
        ...

A streaming response holds its slot until the stream ends: take it with
``acquire()`` and give it back with ``release()`` in the stream's ``finally``.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from cluster.aio import wait_for


class QueueFullError(RuntimeError):
    """Every slot is taken and the queue is full."""


class QueueTimeoutError(RuntimeError):
    """No slot came free within the queue timeout."""


class Admission:
    def __init__(self, max_concurrent: int, max_queue_size: int, queue_timeout_s: float):
        self.max_concurrent, self.max_queue_size, self.queue_timeout_s = max_concurrent, max_queue_size, queue_timeout_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self.running = 0
        self.waiting = 0

    async def acquire(self) -> None:
        if self._slots.locked() and self.waiting >= self.max_queue_size:
            raise QueueFullError(f"{self.running} requests running and {self.waiting} queued "
                                 f"(max_queue_size {self.max_queue_size}); retry later")
        self.waiting += 1
        try:
            # (a slot that came as the caller was cancelled goes back: asyncio.wait_for would keep it)
            await wait_for(self._slots.acquire(), self.queue_timeout_s, on_lost=lambda _: self._slots.release())
        except asyncio.TimeoutError:
            raise QueueTimeoutError(f"no request slot came free within {self.queue_timeout_s}s") from None
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()

    @asynccontextmanager
    async def slot(self):
        await self.acquire()
        try:
            yield
        finally:
            self.release()
