"""``wait_for`` that never loses a cancellation.

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
        if task.done():
            if on_lost is not None and not task.cancelled() and task.exception() is None:
                on_lost(task.result())
        else:
            task.cancel()
            if on_lost is not None:
                task.add_done_callback(lambda t: not t.cancelled() and t.exception() is None and on_lost(t.result()))
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError()
    return task.result()
