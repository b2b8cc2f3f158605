"""``wait_for`` that never loses a cancellation, and ``unless_set``: a wait an event ends (an abort).

Before Python 3.12, ``asyncio.wait_for`` returns the inner result when the cancel of the
task awaiting it arrives in the same instant as that result: the cancellation is swallowed.
For the server that means a request whose client left (``cancel_on_disconnect``) goes on
for nobody — admitted as a slot frees, or decoded to its end as its next token comes.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional


async def wait_for(aw: Awaitable, timeout: Optional[float], on_lost: Optional[Callable[[Any], None]] = None) -> Any:
    """``await aw`` within ``timeout`` seconds (``asyncio.TimeoutError`` past it, ``aw`` cancelled).
    Cancelled meanwhile, this raises ``CancelledError``, always; a result ``aw`` had produced by
    then goes to ``on_lost`` (to give back what it took)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except BaseException:
        _cancel(task, on_lost)
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError()
    return task.result()


async def unless_set(aw: Awaitable, event: asyncio.Event, on_lost: Optional[Callable[[Any], None]] = None) -> bool:
    """``await aw`` unless ``event`` is set first: True once ``aw`` is done (its exception raised);
    False when ``event`` came first, ``aw`` cancelled. Cancelled meanwhile, this raises
    ``CancelledError``, as :func:`wait_for`; either way a result ``aw`` produced and nobody took
    goes to ``on_lost``."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _cancel(task, on_lost)
        raise
    finally:
        watcher.cancel()
    if not task.done():
        _cancel(task, on_lost)
        return False
    task.result()
    return True


def _cancel(task: asyncio.Future, on_lost: Optional[Callable[[Any], None]]) -> None:
    """``task`` cancelled; what it produced (by now, or before the cancel reaches it) to ``on_lost``."""
    if task.done():
        if on_lost is not None and not task.cancelled() and task.exception() is None:
            on_lost(task.result())
        return
    task.cancel()
    if on_lost is not None:
        task.add_done_callback(lambda t: not t.cancelled() and t.exception() is None and on_lost(t.result()))
