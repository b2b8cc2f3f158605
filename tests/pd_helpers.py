"""Driving in-process prefill and decode workers the way the router does."""

from __future__ import annotations

import asyncio
import inspect
import itertools
import random
import threading
import time
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

from transfer.base import KVHandoff

_rids = itertools.count()
# a request the test ends itself (an abort, a hook), never by its length: however slow the host,
# it is still decoding when the test acts on it
ENDLESS = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


async def run_pd(prefill, decode, input_ids: List[int], params: Optional[Dict] = None, rid: Optional[str] = None,
                 attempt: Optional[Dict] = None, priority: int = 0, lora_path: Optional[str] = None, mm_inputs=None):
    """reserve → prefill + push → stream, both sides at ``priority`` under LoRA adapter
    ``lora_path`` (an image request: ``input_ids`` padded, with their ``mm_inputs``); returns
    (final result, notice, hand-offs).
    As ``cluster.pd_client`` does, the attempt's room is picked here and every abort names
    it; ``attempt`` gets it first (what a client that walks away knows)."""
    rid = rid or f"pd-{next(_rids)}"
    params = params or {"max_new_tokens": 8, "temperature": 0}
    room = random.getrandbits(63)
    if attempt is not None:
        attempt["room"] = room
    handoffs = await decode.reserve(rid, input_ids, params, room=room, priority=priority, lora_path=lora_path,
                                    mm_inputs=mm_inputs)
    assert KVHandoff.from_bytes(handoffs[0]).room == room
    try:
        notice = await prefill.prefill(rid, input_ids, params, handoffs, priority, lora_path=lora_path,
                                       mm_inputs=mm_inputs)
    except BaseException:  # as the client does: make sure no push comes, then free the slots at once
        await prefill.abort(rid, room=room)
        await decode.abort(rid, safe=True, room=room)
        raise
    final = None
    async for final in decode.stream(rid, notice):
        pass
    return final, notice, handoffs


def run_batch(prefill, decode, batch: List[List[int]], params: Optional[Dict] = None):
    async def go():
        return await asyncio.gather(*(run_pd(prefill, decode, ids, params) for ids in batch))

    return asyncio.run(go())


def prompts(n: int, lo: int, hi: int, seed: int = 0, shared=(), vocab: int = 250) -> List[List[int]]:
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_pair(path, page_size=1, prefill_args=None, decode_args=None, backend="shm", **decode_kwargs):
    """A prefill and a decode worker in this process (no Ray) over the tiny checkpoint at ``path``."""
    from actors.workers import DecodeWorker, PrefillWorker

    base = dict(max_total_tokens=2048, page_size=page_size, skip_tokenizer_init=True)
    prefill = PrefillWorker(path, dict(base, **(prefill_args or {})), backend=backend)
    decode = DecodeWorker(path, dict(base, **(decode_args or {})), backend=backend, **decode_kwargs)
    return prefill, decode


def wait_idle(worker, timeout_s: float = 30.0) -> bool:
    """Wait until ``worker``'s scheduler has no work (an abort is reported at the loop's next
    step; a quarantine ends later); whether it came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while worker.loop.run_exclusive(worker.scheduler.has_work):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def close_workers(*workers) -> None:
    """Wait until each worker is idle, check it leaks nothing, shut it down."""
    for w in workers:
        wait_idle(w, 5.0)
        w.check_integrity()
        w.shutdown()


async def until(predicate: Callable[[], bool], timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout_s`` (a test never hangs)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not come within {timeout_s}s")
        await asyncio.sleep(0.002)


def slow_push(worker, hold: Callable[[Dict], None]) -> List[float]:
    """Wrap the worker's shm agent's push: ``hold(kwargs)`` runs before each copy; returns
    the monotonic times at which copies ended."""
    agent = worker.agents["shm"]
    real, ended = agent.push, []

    def push(handoff, src_slots, src_state_slot, src_swa_slots, offset=0):
        hold(dict(handoff=handoff, num_rows=len(src_slots), offset=offset))
        moved = real(handoff, src_slots, src_state_slot, src_swa_slots, offset)
        ended.append(time.monotonic())
        return moved

    agent.push = push
    return ended


def decode_together(decode, num_reqs: int) -> None:
    """``decode`` takes no completion notice until ``num_reqs`` have come, then all of them in
    one step: the requests start decoding side by side, however slow the host (otherwise the
    first to land may be done before the last one's prefill, and a test of KV pressure sees
    none). All ``num_reqs`` must fit in the decode worker's reservations at once."""
    sched = decode.scheduler
    process = sched._process_transfers

    def gated():
        if len(sched._notices) < num_reqs:
            return []
        del sched._process_transfers
        return process()

    sched._process_transfers = gated


def pause_once(worker, predicate: Callable[[], bool]) -> threading.Event:
    """Pause ``worker``'s loop right after the first step at whose end ``predicate()`` holds
    (asked on the loop thread, so no step runs between the check and the pause: a request
    seen decoding there is still decoding, whatever its length and the host's speed).
    Returns the event set then; ``worker.loop.resume()`` goes on."""
    sched, paused = worker.scheduler, threading.Event()
    step = sched.step

    def step_then_check():
        out = step()
        if not paused.is_set() and predicate():
            worker.loop.pause()  # (the loop holds its condition: re-entrant)
            sched.step = step
            paused.set()
        return out

    sched.step = step_then_check
    return paused


class Handle:
    """A worker in this process behind a Ray-like handle: ``handle.method.remote(*args)`` awaits it."""

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        async def call(*args):
            result = getattr(self.worker, name)(*args)
            return await result if inspect.isawaitable(result) else result

        return SimpleNamespace(remote=call)
