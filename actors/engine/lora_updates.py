"""LoRA adapters loaded and unloaded while an engine serves (SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``, vLLM's runtime LoRA updating), on every TP rank: rank 0's runner under
the engine loop's lock (a load reads the adapter's files before taking it), the followers through
``call_followers``. Shared by the in-process :class:`~actors.engine.Engine` and the PD workers.

Unloading follows SGLang: the adapter is refused to new requests at once, the requests in flight
under it finish under it, then its host copy and its slot go. The KV it left in the prefix cache
is unreachable (a later adapter of its name has its own cache key, :class:`~actors.engine.lora.HostAdapter`)
and left to the eviction policy, as SGLang leaves it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, List, Optional

from actors.engine.tp_worker import FollowerError

UNLOAD_POLL_S = 0.01  # how often an unload looks whether the adapter's last request has finished

CallFollowers = Optional[Callable[[str, Any], List[Any]]]  # (None: a single rank)


def _on_followers(call_followers: CallFollowers, name: str, payload: Any) -> None:
    errors = [reply for reply in (call_followers(name, payload) if call_followers else []) if
              isinstance(reply, FollowerError)]
    if errors:
        raise ValueError("; ".join(str(e) for e in errors))


def load_lora_adapter(loop, runner, call_followers: CallFollowers, name: str, path: str,
                      cache_key: Optional[str] = None) -> None:
    """Serve the adapter in ``path`` as ``name`` on every rank, or on none (ValueError: checked as
    at start, or a name served already); ``cache_key``: its requests' radix ``extra_key`` (None: the
    count of the name's loads here gives it, :class:`~actors.engine.lora.HostAdapter`). Rank 0 reads
    it before taking the loop's lock, so the engine steps on during a slow read; the name is claimed
    under the lock (of racing loads of one name, the first to get there wins)."""
    adapter = runner.read_lora(name, path)

    def load():
        runner.add_lora(adapter, cache_key)
        try:
            _on_followers(call_followers, "lora_load", (name, path))
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
        _on_followers(call_followers, "lora_unload", name)
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
