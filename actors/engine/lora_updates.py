"""LoRA adapters loaded and unloaded while an engine serves (SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``, vLLM's runtime LoRA updating), on every TP rank: rank 0's runner under
the engine loop's lock, the followers through ``call_followers``. A load reads the adapter's files
before it takes the lock, rank 0 on the caller's thread and each follower on a thread of its own
(:class:`FollowerReads`), so the engine steps on during a slow read. Shared by the in-process
:class:`~actors.engine.Engine` and the PD workers.

Unloading follows SGLang: the adapter is refused to new requests at once, the requests in flight
under it finish under it, then its host copy and its slot go. The KV it left in the prefix cache
is unreachable (a later adapter of its name has its own cache key, :class:`~actors.engine.lora.HostAdapter`)
and left to the eviction policy, as SGLang leaves it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional

from actors.engine.tp_worker import FollowerError

UNLOAD_POLL_S = 0.01  # how often an unload looks whether the adapter's last request has finished

CallFollowers = Optional[Callable[[str, Any], List[Any]]]  # (None: a single rank)
_load_ids = itertools.count()  # (a follower tells the reads of racing loads apart by them)


def on_followers(call_followers: CallFollowers, name: str, payload: Any) -> List[Any]:
    """``call_followers(name, payload)`` on every follower rank: their replies, in rank order; ValueError
    naming the ranks that failed."""
    replies = call_followers(name, payload) if call_followers else []
    errors = [reply for reply in replies if isinstance(reply, FollowerError)]
    if errors:
        raise ValueError("; ".join(str(e) for e in errors))
    return replies


def _tell_followers(loop, call_followers: CallFollowers, name: str, payload: Any) -> None:
    """A call on every follower, under the loop's lock (between two steps' broadcasts)."""
    if call_followers:
        loop.run_exclusive(lambda: call_followers(name, payload))


def load_lora_adapter(loop, runner, call_followers: CallFollowers, name: str, path: str,
                      cache_key: Optional[str] = None) -> None:
    """Serve the adapter in ``path`` as ``name`` on every rank, or on none (ValueError: checked as
    at start, or a name served already); ``cache_key``: its requests' radix ``extra_key`` (None: the
    count of the name's loads here gives it, :class:`~actors.engine.lora.HostAdapter`). Every rank
    reads it outside the loop's lock; the name is claimed under it (of racing loads of one name, the
    first to get there wins), where a follower's read not done yet is waited for."""
    load_id = next(_load_ids)
    _tell_followers(loop, call_followers, "lora_read", (load_id, name, path))
    try:
        adapter = runner.read_lora(name, path)
    except BaseException:
        _tell_followers(loop, call_followers, "lora_drop", load_id)
        raise

    def load():
        try:
            runner.add_lora(adapter, cache_key)
        except BaseException:
            if call_followers:
                call_followers("lora_drop", load_id)
            raise
        try:
            on_followers(call_followers, "lora_add", (load_id, cache_key))
        except BaseException:  # (a rank that read it drops it again)
            runner.unload_lora(name)
            if call_followers:
                call_followers("lora_unload", name)
            raise

    loop.run_exclusive(load)


def _unload_if_unused(loop, runner, call_followers: CallFollowers, name: str) -> bool:
    """Unload the retiring adapter ``name`` on every rank once no request the loop holds uses it."""
    def unload() -> bool:
        if any(r.lora_path == name and not r.finished for r in loop.held_reqs()):
            return False
        runner.unload_lora(name)
        on_followers(call_followers, "lora_unload", name)
        return True

    return loop.run_exclusive(unload)


def unload_lora_adapter(loop, runner, call_followers: CallFollowers, name: str) -> None:
    """Stop serving adapter ``name`` (ValueError if it is not served); returns once its requests
    in flight have finished and it is gone from every rank."""
    loop.run_exclusive(lambda: runner.retire_lora(name))
    while not _unload_if_unused(loop, runner, call_followers, name):
        time.sleep(UNLOAD_POLL_S)


async def async_unload_lora_adapter(loop, runner, call_followers: CallFollowers, name: str) -> None:
    """:func:`unload_lora_adapter` for an asyncio caller (a worker actor, whose event loop delivers
    the outputs of the very requests the unload waits for)."""
    loop.run_exclusive(lambda: runner.retire_lora(name))
    while not _unload_if_unused(loop, runner, call_followers, name):
        await asyncio.sleep(UNLOAD_POLL_S)


class FollowerReads:
    """A follower rank's side of :func:`load_lora_adapter`: ``lora_read`` starts the adapter's read
    on a thread of its own and returns, so the follower's loop runs rank 0's steps meanwhile;
    ``lora_add`` serves it once read (a failed read raises there) and ``lora_drop`` forgets it (rank
    0 refused the load)."""

    def __init__(self, runner):
        self.runner = runner
        self.reads: Dict[int, Future] = {}  # by load id

    def handlers(self) -> Dict[str, Callable[[Any], Any]]:
        return {"lora_read": self.read, "lora_add": self.add, "lora_drop": self.drop,
                "lora_unload": self.runner.unload_lora}

    def read(self, payload) -> None:
        load_id, name, path = payload
        future = self.reads[load_id] = Future()

        def run():
            try:
                future.set_result(self.runner.read_lora(name, path))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, name=f"lora-read-{name}", daemon=True).start()

    def add(self, payload) -> None:
        load_id, cache_key = payload
        self.runner.add_lora(self.reads.pop(load_id).result(), cache_key)

    def drop(self, load_id: int) -> None:
        self.reads.pop(load_id, None)
