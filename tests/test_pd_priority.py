"""Priority scheduling on in-process PD workers (no Ray): the decode worker grants its
reservations by priority, and one short of a row or of KV room preempts a running request of a
much lower priority (never one whose KV is still moving); greedy tokens stay HF's."""

import asyncio
import random

import pytest

from actors.engine.tiny import build_tiny_checkpoint
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers as close
from tests.pd_helpers import decode_together, make_pair, pause_once, prompts, run_pd, until

GREEDY = {"max_new_tokens": 8, "temperature": 0}
PRIORITY = {"enable_priority_scheduling": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-priority")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in ("llama", "gemma3", "qwen3_next")}


def log_grants(sched):
    """``[(rid, the retracted requests waiting then)]`` of every reservation taken, in order."""
    granted, reserve = [], sched._reserve

    def logged(req):
        taken = reserve(req)
        if taken:
            granted.append((req.rid, sorted(r.rid for r in sched.waiting)))
        return taken

    sched._reserve = logged
    return granted


def test_decode_reservations_are_granted_by_priority(checkpoints):
    """One decode row, held by a decoding request: a priority-0 then a priority-5 request (sent to
    both workers at their priority, as the client does) queue for it, the later one ahead; the row
    goes to it first. Greedy tokens are HF's; nothing is left reserved."""
    llama = checkpoints["llama"]
    prefill, decode = make_pair(llama, prefill_args=PRIORITY, decode_args=dict(PRIORITY, max_running_requests=1))
    sched = decode.scheduler
    granted = log_grants(sched)
    paused = pause_once(decode, lambda: any(r.rid == "first" for r in sched.running))
    batch = prompts(3, 10, 20, seed=40)

    async def go():
        first = asyncio.ensure_future(run_pd(prefill, decode, batch[0], GREEDY, rid="first"))
        await until(paused.is_set, what="the first request decoding")
        rest = [asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid=rid, priority=p))
                for ids, rid, p in [(batch[1], "low", 0), (batch[2], "high", 5)]]
        await until(lambda: len(sched.prealloc) == 2, what="both reservations queued")
        assert [r.rid for r in sched.prealloc] == ["high", "low"]
        decode.loop.resume()
        return await asyncio.gather(first, *rest)

    results = asyncio.run(go())
    assert [rid for rid, _ in granted] == ["first", "high", "low"]
    assert sched.num_preemptions == 0
    assert_greedy_parity(llama, batch, [r[0]["output_ids"] for r in results], 8, decode.eos_token_ids)
    close(prefill, decode)


# the decode worker full by its rows (two), or by its KV: 128 slots, prompts of 30 tokens, 16 new
# tokens each reserved whole (a ratio of 1): two requests take ~92 slots, a third needs 47
FULL = {
    "rows": dict(max_running_requests=2),
    "room": dict(max_total_tokens=128, init_new_token_ratio=1.0, min_new_token_ratio=1.0),
}


@pytest.mark.parametrize("family,full,priority,preempts", [
    ("llama", "rows", 11, True),  # more than the threshold (10) above the running request's 0
    ("llama", "room", 11, True),
    ("gemma3", "room", 11, True),  # (the SWA pool's room too)
    ("qwen3_next", "room", 11, True),  # (Mamba state slots too)
    ("llama", "rows", 10, False),  # at the threshold
    ("llama", "rows", 0, False),  # equal
])
def test_a_higher_priority_reservation_preempts_a_running_request_never_a_moving_one(checkpoints, family, full,
                                                                                     priority, preempts):
    """A full decode worker holds a priority-0 request decoding ("running") and a later one whose
    prefill has not come ("moving": in transfer, its slots a push may write). A request more than
    ``priority_scheduling_preemption_threshold`` above them preempts "running" — the only one
    preemptible, though preemption takes the latest first — and is granted while it waits retracted;
    it resumes once room comes back. At the threshold or at an equal priority nothing is preempted:
    the arrival waits for "running" to end. Either way every greedy output is HF's and nothing leaks."""
    path, params = checkpoints[family], {"max_new_tokens": 16, "temperature": 0}
    prefill, decode = make_pair(path, prefill_args=PRIORITY, decode_args=dict(PRIORITY, **FULL[full]))
    sched = decode.scheduler
    granted = log_grants(sched)
    batch = prompts(3, 30, 30, seed=41)
    decoding = pause_once(decode, lambda: any(r.rid == "running" and r.output_ids for r in sched.running))

    async def moving_after(handoffs):  # its prefill comes last: it stays in transfer until then
        notice = await prefill.prefill("moving", batch[1], params, await handoffs)
        async for final in decode.stream("moving", notice):
            pass
        return final, notice

    async def go():
        running = asyncio.ensure_future(run_pd(prefill, decode, batch[0], params, rid="running"))
        await until(decoding.is_set, what="the first request decoding")
        reserved = pause_once(decode, lambda: any(r.rid == "moving" for r in sched.transfer))
        handoffs = asyncio.ensure_future(decode.reserve("moving", batch[1], params, room=random.getrandbits(63)))
        decode.loop.resume()
        await until(reserved.is_set, what="the second request reserved")
        assert [r.rid for r in sched.running] == ["running"] and sched.running[0].output_ids
        high = asyncio.ensure_future(run_pd(prefill, decode, batch[2], params, rid="high", priority=priority))
        await until(lambda: len(sched.prealloc) == 1, what="the arrival queued")
        decode.loop.resume()
        return await asyncio.gather(running, moving_after(handoffs), high)

    results = asyncio.run(go())
    assert granted == [("running", []), ("moving", []), ("high", ["running"] if preempts else [])]
    assert (sched.num_preemptions, sched.num_retractions) == ((1, 1) if preempts else (0, 0))
    assert decode.load()["preemptions"] == sched.num_preemptions
    assert_greedy_parity(path, batch, [r[0]["output_ids"] for r in results], 16, decode.eos_token_ids)
    close(prefill, decode)


def test_arrivals_preempt_one_each_and_go_ahead_of_those_they_retracted(checkpoints):
    """Two priority-0 requests decoding fill the decode worker's KV; two priority-20 arrivals
    preempt one each, in one step: the second is not held behind the first one's victim (a
    retracted request waits for those of a higher priority; of its own or lower, it goes first).
    The victims resume after them; greedy tokens are HF's."""
    llama, params = checkpoints["llama"], {"max_new_tokens": 16, "temperature": 0}
    prefill, decode = make_pair(llama, prefill_args=PRIORITY, decode_args=dict(PRIORITY, **FULL["room"]))
    sched = decode.scheduler
    granted = log_grants(sched)
    batch = prompts(4, 30, 30, seed=42)
    decode_together(decode, 2)
    decoding = pause_once(decode, lambda: sum(bool(r.output_ids) for r in sched.running) == 2)

    async def go():
        low = [asyncio.ensure_future(run_pd(prefill, decode, ids, params, rid=f"low{i}"))
               for i, ids in enumerate(batch[:2])]
        await until(decoding.is_set, what="both low-priority requests decoding")
        high = [asyncio.ensure_future(run_pd(prefill, decode, ids, params, rid=f"high{i}", priority=20))
                for i, ids in enumerate(batch[2:])]
        await until(lambda: len(sched.prealloc) == 2, what="both arrivals queued")
        decode.loop.resume()
        return await asyncio.gather(*low, *high)

    results = asyncio.run(go())
    assert sorted(rid for rid, _ in granted[:2]) == ["low0", "low1"] and len(granted) == 4
    (first, victim), (second, victims) = granted[2:]
    assert {first, second} == {"high0", "high1"} and len(victim) == 1 and victims == ["low0", "low1"]
    assert sched.num_preemptions == 2
    assert_greedy_parity(llama, batch, [r[0]["output_ids"] for r in results], 16, decode.eos_token_ids)
    close(prefill, decode)
