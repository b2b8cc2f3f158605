"""Failures inside a PD worker's step end the requests they touch and leak nothing
(in-process workers, no Ray): a completion notice the decode side cannot take, a
failure while reserving, a request aborted just before a failed step, a broken decode
TP group; a retracted decode request is not overtaken by new reservations; and a
prefilled request whose push some rank (a TP follower: tests.tp_helpers) never reports
fails at the waiting timeout."""

import asyncio
import threading
import time

import pytest

from actors.engine.tiny import build_tiny_checkpoint
from actors.pd_scheduler import PDRequestError
from tests.pd_helpers import ENDLESS, make_pair, pause_once, prompts, run_pd, slow_push, until, wait_idle

GREEDY = {"max_new_tokens": 8, "temperature": 0}
LONG = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
# how long a test waits for an answer that comes at once unless the bug is back ("never told"): only a
# hang guard, generous for a loaded CI host (other test processes on two cores)
HANG_S = 30.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-failures")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in ("llama",)}


def leaks(*workers):
    """What ``check_integrity`` says of each worker once idle (None: whole); shuts them down."""
    out = []
    for w in workers:
        wait_idle(w)
        try:
            w.check_integrity()
            out.append(None)
        except Exception as exc:  # noqa: BLE001
            out.append(f"{type(exc).__name__}: {exc}")
    for w in workers:
        w.shutdown()
    return out


class _GoneFollowers:
    """A decode TP group whose follower ranks are gone (in-process, no Ray)."""

    def call_followers(self, name, payload):
        raise RuntimeError(f"{name}: connection closed by peer")


def hold_pushes(prefill) -> threading.Event:
    """``prefill``'s pushes wait for the event returned (30 s at most): a step's requests are
    all still in ``inflight`` at its end, however soon the transfer thread would have been done
    (the step's last ``_process_inflight`` would cache a request whose push had ended)."""
    go = threading.Event()
    slow_push(prefill, lambda _: go.wait(30))
    return go


def _fail_releasing_once(tree, rid):
    """The next release of ``rid``'s KV into ``tree`` raises; later ones work."""
    real = tree.cache_finished_req

    def once(req, *args, **kwargs):
        if req.rid == rid:
            del tree.cache_finished_req
            raise RuntimeError("injected release error")
        return real(req, *args, **kwargs)

    tree.cache_finished_req = once


# ---- 1. a notice that _start_decoding cannot take -------------------------------------------------
@pytest.mark.parametrize("bad", ["no_first_token", "bad_generator_state"])
def test_a_notice_the_decode_side_cannot_take_fails_its_request_only_and_leaks_nothing(checkpoints, bad):
    """A landed request whose notice cannot be taken (no first token, a generator state that
    does not fit) fails alone, with a clear error, its row and slots back; a request decoding
    beside it goes on."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids, other = prompts(2, 20, 20, seed=3)
    params = dict(GREEDY, seed=5) if bad == "bad_generator_state" else GREEDY

    async def go():
        running = asyncio.ensure_future(run_pd(prefill, decode, other, LONG))  # an innocent bystander
        await until(lambda: decode.loop.run_exclusive(lambda: bool(decode.scheduler.running)), what="the bystander")
        handoffs = await decode.reserve("bad", ids, params)
        notice = await prefill.prefill("bad", ids, params, handoffs)
        if bad == "no_first_token":
            notice.pop("first_token")
        else:
            notice["generator_state"] = b"\x00" * 8
        try:
            await asyncio.wait_for(decode.stream("bad", notice).__anext__(), 5)
            answer = "accepted"
        except asyncio.TimeoutError:
            answer = "no answer (hangs)"
        except PDRequestError:
            answer = "refused"
        try:
            final, _, _ = await asyncio.wait_for(running, 60)
            bystander = len(final["output_ids"])
        except Exception as exc:  # noqa: BLE001
            bystander = f"{type(exc).__name__}: {exc}"
        return answer, bystander

    answer, bystander = asyncio.run(go())
    state = leaks(prefill, decode)
    assert (answer, bystander, state) == ("refused", LONG["max_new_tokens"], [None, None])


# ---- 2. a failure while reserving ------------------------------------------------------------------
def test_a_failure_while_reserving_gives_back_the_row_and_the_prefix_lock(checkpoints):
    """A failure while reserving (here the allocator's) gives back the row and the lock on the
    decode tree's prefix it had taken: nothing is held by nobody afterwards."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    shared = prompts(1, 40, 40, seed=4)[0]
    alloc = decode.runner.allocator
    real = alloc.alloc_extend

    def broken(*args, **kwargs):
        alloc.alloc_extend = real
        raise RuntimeError("injected allocation error")

    async def go():
        await run_pd(prefill, decode, shared + [5, 6, 7], GREEDY)  # the decode tree holds the prefix now
        alloc.alloc_extend = broken
        with pytest.raises(Exception, match="injected allocation error|engine step failed"):
            await decode.reserve("r", shared + [8, 9], GREEDY)

    asyncio.run(go())
    wait_idle(decode)
    pool, tree = decode.runner.req_to_token_pool, decode.scheduler.tree_cache
    held = decode.loop.run_exclusive(lambda: (pool.size - pool.available_size(), tree.protected_size()))
    state = leaks(prefill, decode)
    assert (held, state) == ((0, 0), [None, None])  # (rows held, tokens locked) by nobody


# ---- 3. an aborted running request when the next step fails ----------------------------------------
def test_a_running_request_aborted_just_before_a_failed_step_is_released(checkpoints):
    """An abort marks a running request finished; its row and slots go back at the next step.
    If that step fails before the engine's part (here in the decode side's own phases), the
    failure path still gives them back."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 20, 20, seed=5)[0]
    sched = decode.scheduler
    real = sched._release_quarantine

    def broken(*args, **kwargs):
        sched._release_quarantine = real
        raise RuntimeError("injected step error")

    async def go():
        attempt = {}
        paused = pause_once(decode, lambda: bool(sched.running))  # "a" decoding, the loop held between steps
        task = asyncio.ensure_future(run_pd(prefill, decode, ids, LONG, rid="a", attempt=attempt))
        await until(paused.is_set, what="a decoding")
        assert await decode.abort("a", "the client went away", safe=True, room=attempt["room"])
        sched._release_quarantine = broken  # the next step fails before the engine's own part
        decode.loop.resume()
        final, _, _ = await asyncio.wait_for(task, 10)  # told of its abort, as after any step
        assert final["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(go())
    assert leaks(prefill, decode) == [None, None]


# ---- 4. a broken decode TP group ------------------------------------------------------------------
def test_a_broken_decode_tp_group_fails_the_requests_instead_of_killing_the_loop(checkpoints):
    """Decode TP > 1 with a follower rank gone: the step's call to the followers fails, and so
    does the failure path's ("cancel"); the loop must survive it and fail the request at once,
    not leave every request on the worker waiting for its client's timeout. (A stub TP worker
    stands for the broken group: in-process, no Ray.)"""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    ids = prompts(1, 20, 20, seed=8)[0]

    async def go():
        handoffs = await decode.reserve("t", ids, GREEDY)
        notice = await prefill.prefill("t", ids, GREEDY, handoffs)

        def break_group():  # rank 0's own share landed; the followers are asked next
            sched.has_followers, sched.tp_worker = True, _GoneFollowers()

        decode.loop.run_exclusive(break_group)
        start = time.monotonic()
        try:
            await asyncio.wait_for(decode.stream("t", notice).__anext__(), 5)
            answer = "answered"
        except Exception:  # noqa: BLE001 - an error is the right answer, if it comes at once
            answer = "failed"
        return answer if time.monotonic() - start < 4 else "no answer within 4 s"

    answer = asyncio.run(go())
    alive = decode.loop._thread.is_alive()
    sched.has_followers = False  # (to shut down)
    prefill.shutdown()
    decode.shutdown()
    assert (answer, alive) == ("failed", True)


# ---- failures inside a batch and a step; retracted requests before reservations ---------------
def test_a_request_finished_earlier_in_a_failed_decode_batch_is_not_released_twice(checkpoints):
    """Decode batch [x, y]: x's last token is sampled (x finishes, its row and slots go back at
    once), then sampling y raises. x is told it finished; y fails; nothing is given back twice
    (a slot on the free list twice would let two later requests share KV)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    ids_x, ids_y = prompts(2, 20, 20, seed=11)
    real = sched._sample
    seen = {}

    def sample(req, *args, **kwargs):
        if req.rid == "y" and seen.get("x_done") == decode.runner.num_forwards:
            sched._sample = real
            raise RuntimeError("injected sampling error")
        if req.rid == "x":  # x's last token is this one (x joined first, so it is sampled before y)
            req.sampling_params.max_new_tokens = len(req.output_ids) + 1
        real(req, *args, **kwargs)
        if req.rid == "x" and req.finished:
            seen["x_done"] = decode.runner.num_forwards  # x ended in this batch

    def hook_once_y_decodes():  # (on the loop's lock: no step between the check and the hook)
        if not any(r.rid == "y" for r in sched.running):
            return False
        sched._sample = sample
        return True

    async def go():
        # x is ended by the hook only, in a batch that holds y (a fixed length could end x
        # before y joins on a slow host)
        x = asyncio.ensure_future(run_pd(prefill, decode, ids_x, ENDLESS, rid="x"))
        await until(lambda: decode.loop.run_exclusive(lambda: any(r.rid == "x" for r in sched.running)),
                    what="x decoding")
        y = asyncio.ensure_future(run_pd(prefill, decode, ids_y, LONG, rid="y"))
        await until(lambda: decode.loop.run_exclusive(hook_once_y_decodes), what="y decoding")
        results = await asyncio.gather(x, y, return_exceptions=True)
        return results, decode.loop.run_exclusive(lambda: [r.rid for r in sched.running])

    (x_result, y_result), running = asyncio.run(go())
    assert running == [] and "x_done" in seen
    assert x_result[0]["meta_info"]["finish_reason"]["type"] == "length"  # x is told it finished
    assert isinstance(y_result, Exception) and "injected sampling error" in str(y_result)
    assert leaks(prefill, decode) == [None, None]


def test_a_failure_inside_a_decode_batch_gives_back_what_its_requests_held(checkpoints):
    """Sampling raises inside a decode batch, between the allocator's free_group_begin and
    free_group_end: the group still ends, so the failure path's frees (the request's row and
    slots) are made, not parked in a group the next step's begin would drop."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    ids = prompts(1, 20, 20, seed=12)[0]
    real = sched._sample

    def sample(req, *args, **kwargs):
        sched._sample = real
        raise RuntimeError("injected sampling error")

    def hook_once_y_decodes():  # (on the loop's lock: y cannot end between the check and the hook)
        if not any(r.rid == "y" for r in sched.running):
            return False
        sched._sample = sample
        return True

    async def go():
        task = asyncio.ensure_future(run_pd(prefill, decode, ids, LONG, rid="y"))
        await until(lambda: decode.loop.run_exclusive(hook_once_y_decodes), what="y decoding")
        with pytest.raises(Exception):
            await asyncio.wait_for(task, 10)
        await run_pd(prefill, decode, ids, GREEDY)  # the next request: its decode steps begin new free groups

    asyncio.run(go())
    assert leaks(prefill, decode) == [None, None]


def test_a_reservation_that_ended_earlier_in_a_failed_step_is_told(checkpoints):
    """A broken decode TP group: in one step the reservation of "a" fails (its followers cannot
    be asked to "expect": it is dropped, finished and released), then "t"'s landing asks the
    followers and raises. "a" is in no queue any more, yet its caller is told."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    ids, other = prompts(2, 20, 20, seed=13)

    async def go():
        handoffs = await decode.reserve("t", ids, GREEDY)
        notice = await prefill.prefill("t", ids, GREEDY, handoffs)
        decode.loop.pause()
        await asyncio.sleep(0.05)  # the step in progress ends

        def break_group():
            sched.has_followers, sched.tp_worker = True, _GoneFollowers()

        decode.loop.run_exclusive(break_group)
        reserving = asyncio.ensure_future(decode.reserve("a", other, GREEDY))
        streaming = asyncio.ensure_future(decode.stream("t", notice).__anext__())
        await asyncio.sleep(0.05)  # "a" queued for a reservation, "t"'s notice in: one step takes both
        decode.loop.resume()
        try:
            await asyncio.wait_for(reserving, HANG_S)
            answer = "reserved"
        except asyncio.TimeoutError:
            answer = "no answer (hangs)"
        except Exception:  # noqa: BLE001 - failing is the right answer
            answer = "failed"
        await asyncio.gather(asyncio.wait_for(streaming, HANG_S), return_exceptions=True)
        return answer

    answer = asyncio.run(go())
    sched.has_followers = False  # (to shut down)
    prefill.shutdown()
    decode.shutdown()
    assert answer == "failed"


@pytest.mark.parametrize("chunk", [None, 8])
def test_a_retracted_request_is_not_starved_by_new_reservations(checkpoints, chunk):
    """A decode request retracted under KV pressure waits to be re-prefilled locally. It was
    decoding before any reservation queued since, so the room that frees is its first (as
    SGLang's decode resumes its retracted queue before it pre-allocates): under a steady
    stream of new requests it comes back. Re-prefilled in chunks (``chunk``), after its first
    chunk it is the scheduler's ``chunked_req``, no longer in ``waiting``, and still no
    reservation takes the room its next chunks need."""
    path = checkpoints["llama"]
    decode_args = {"max_total_tokens": 128, "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02,
                   "chunked_prefill_size": chunk}
    prefill, decode = make_pair(path, decode_args=decode_args, num_reserved_decode_tokens=2)
    sched = decode.scheduler
    first = prompts(1, 30, 30, seed=6)[0]
    big = prompts(4, 100, 100, seed=7)
    short = {"max_new_tokens": 4, "temperature": 0}

    def back(task):  # A re-prefilled: decoding again (or done)
        return task.done() or decode.loop.run_exclusive(lambda: any(r.rid == "A" for r in sched.running))

    async def go():
        # the loop holds A after its third token (60 would all be out before a slow host's poll saw three)
        paused = pause_once(decode, lambda: any(len(r.output_ids) >= 3 for r in sched.running))
        task = asyncio.ensure_future(run_pd(prefill, decode, first, {"max_new_tokens": 60, "temperature": 0,
                                                                     "ignore_eos": True}, rid="A"))
        await until(paused.is_set, what="A's third token")
        decode.loop.run_exclusive(lambda: sched._retract(sched.running[-1]))  # as KV pressure does
        held = [asyncio.ensure_future(decode.reserve("n0", big[0], short))]
        decode.loop.resume()
        await asyncio.wait_for(held[0], 10)
        history = [back(task)]
        for i in range(1, 4):  # one newcomer queued, then the one holding the room goes away
            held.append(asyncio.ensure_future(decode.reserve(f"n{i}", big[i], short)))
            await asyncio.sleep(0.05)
            assert await decode.abort(f"n{i - 1}", safe=True)
            await asyncio.wait_for(held[i], 10)
            history.append(back(task))
        assert await decode.abort("n3", safe=True)
        await asyncio.wait_for(task, 60)
        return history

    history = asyncio.run(go())
    assert leaks(prefill, decode) == [None, None]
    assert history == [True] * 4, f"A re-admitted before each newcomer's reservation: {history}"


# ---- a retracted request that cannot come back; failures releasing aborted requests --------------
def test_a_retracted_request_that_can_never_come_back_does_not_stop_new_reservations(checkpoints):
    """Pages of 8, a 64-slot decode pool (requests held to 56 tokens). R is retracted while S
    decodes, which raises the new-token ratio to about 1: R's page-rounded re-prefill plus its
    full decode reserve plus a page of slack exceed even the empty pool. With nothing else
    running its reserve protects nobody, so it is capped and R comes back; new reservations,
    held while R waits, are made again."""
    path = checkpoints["llama"]
    decode_args = {"max_total_tokens": 64, "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    prefill, decode = make_pair(path, page_size=8, decode_args=decode_args, num_reserved_decode_tokens=2)
    sched = decode.scheduler
    s_ids, r_ids, n_ids = prompts(1, 9, 9, seed=21)[0], prompts(1, 17, 17, seed=22)[0], prompts(1, 5, 5, seed=23)[0]
    s_params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}

    def running(rid):
        return decode.loop.run_exclusive(lambda: any(r.rid == rid for r in sched.running))

    async def consume(rid, notice):
        final = None
        async for final in decode.stream(rid, notice):
            pass
        return final

    async def go():
        hs = await decode.reserve("S", s_ids, s_params)
        hr = await decode.reserve("R", r_ids, LONG)
        ns = await prefill.prefill("S", s_ids, s_params, hs)
        nr = await prefill.prefill("R", r_ids, LONG, hr)
        # both notices in while the loop is held: S and R start decoding in one step, and the loop
        # stops right after it (S, 20 tokens, could end before R joined on a slow host)
        decode.loop.pause()
        paused = pause_once(decode, lambda: running("S") and running("R"))
        s_task = asyncio.ensure_future(consume("S", ns))
        r_task = asyncio.ensure_future(consume("R", nr))
        await until(lambda: decode.loop.run_exclusive(lambda: {"S", "R"} <= set(sched._notices)), what="both notices")
        decode.loop.resume()
        await until(paused.is_set, what="S and R decoding")

        def retract():
            assert [r.rid for r in sched.running] == ["S", "R"]  # S decoding: the ratio goes up
            req = sched.running[-1]
            assert sched._retract_decode() == [req]  # as KV pressure does (the longer prompt goes)
            return len(req.origin_input_ids) + len(req.output_ids)

        fill = decode.loop.run_exclusive(retract)
        decode.loop.resume()
        await asyncio.wait_for(s_task, 30)
        await asyncio.sleep(0.2)
        state = decode.loop.run_exclusive(lambda: ([r.rid for r in sched.waiting], round(sched.new_token_ratio, 3),
                                                   sched.available_tokens()))
        try:
            await asyncio.wait_for(decode.reserve("N", n_ids, {"max_new_tokens": 4, "temperature": 0}), 5)
            outcome = "reserved"
        except asyncio.TimeoutError:
            outcome = "never reserved"
        await decode.abort("R", "test over", safe=True)
        await asyncio.gather(r_task, return_exceptions=True)
        await decode.abort("N", "test over", safe=True)
        return outcome, fill, state

    outcome, fill, state = asyncio.run(go())
    prefill.shutdown()
    decode.shutdown()
    assert outcome == "reserved", (f"a newcomer is never reserved on an empty decode pool: R (fill {fill}) waits "
                                   f"forever; waiting, ratio, free slots = {state}")


def test_a_failure_releasing_one_aborted_request_does_not_release_the_others_twice(checkpoints):
    """Two running requests aborted before a step; giving back the second one's KV fails (once).
    The first is given back once, the second by the failure path: nothing twice, nothing lost."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    a_ids, b_ids = prompts(2, 20, 20, seed=31)

    async def go():
        attempts = {"a": {}, "b": {}}
        paused = pause_once(decode, lambda: {r.rid for r in sched.running} == {"a", "b"})
        tasks = [asyncio.ensure_future(run_pd(prefill, decode, ids, ENDLESS, rid=rid, attempt=attempts[rid]))
                 for rid, ids in (("a", a_ids), ("b", b_ids))]
        await until(paused.is_set, what="a and b decoding")
        for rid in ("a", "b"):
            assert await decode.abort(rid, "the client went away", safe=True, room=attempts[rid]["room"])
        _fail_releasing_once(sched.tree_cache, "b")
        decode.loop.resume()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    asyncio.run(go())
    assert leaks(prefill, decode) == [None, None]


def test_a_request_aborted_while_queued_is_told_when_releasing_another_aborted_one_fails(checkpoints):
    """C's reservation is queued and aborted, B (running) is aborted too; the next step fails
    giving back B. C, in no queue any more, is still told (its reserve() fails at once)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = decode.scheduler
    b_ids, c_ids = prompts(2, 20, 20, seed=32)

    async def go():
        attempt = {}
        paused = pause_once(decode, lambda: any(r.rid == "b" for r in sched.running))
        b = asyncio.ensure_future(run_pd(prefill, decode, b_ids, LONG, rid="b", attempt=attempt))
        await until(paused.is_set, what="b decoding")
        c = asyncio.ensure_future(decode.reserve("c", c_ids, GREEDY, room=7))
        await asyncio.sleep(0.05)  # queued for a reservation (the loop is paused)
        assert await decode.abort("c", "the client went away", safe=True, room=7)
        assert await decode.abort("b", "the client went away", safe=True, room=attempt["room"])
        _fail_releasing_once(sched.tree_cache, "b")
        decode.loop.resume()
        try:
            await asyncio.wait_for(c, HANG_S)
            answer = "reserved"
        except asyncio.TimeoutError:
            answer = "never told"
        except Exception:  # noqa: BLE001 - the abort, the right answer
            answer = "failed"
        await asyncio.wait_for(asyncio.gather(b, return_exceptions=True), 10)
        return answer

    answer = asyncio.run(go())
    prefill.shutdown()
    decode.shutdown()
    assert answer == "failed"


# ---- 8. a decode follower's receivers --------------------------------------------------------------
def test_rank_0_ends_a_follower_receiver_before_it_expects_the_same_id_again(checkpoints):
    """A follower's ``_expect`` replaces ``_receivers[rid]`` without aborting the one there:
    harmless only if rank 0 never asks again for an id whose earlier receiver is live. It
    does not: every end of a reservation (abort, safe or not; landing) cancels or lands
    the followers' shares first. (A stub TP group forwards rank 0's calls to a follower's
    decode handlers over a fake agent: in-process, no Ray.)"""
    from types import SimpleNamespace

    from actors.rank import TPFollower
    from tests.transfer_helpers import RankSpec, build_pool
    from transfer.backends.fake import FakeAgent

    _, layout, tensors, _ = build_pool(RankSpec(tp_rank=1, tp_size=2))
    follower = TPFollower.__new__(TPFollower)  # its decode handlers only
    follower.host = SimpleNamespace(tp_rank=1, agents={"shm": FakeAgent(layout, tensors, 1, 2)})
    follower.waiting_timeout_s, follower._receivers, follower._landed = 30.0, {}, set()
    expects, overwritten = [], []

    class Group:
        def call_followers(self, name, payload):
            if name == "expect":
                expects.append(payload[0])
                if payload[0] in follower._receivers:
                    overwritten.append(payload[0])
            reply = getattr(follower, f"_{name}")(payload)
            return [] if name == "expect" else [reply]  # (no push for its share: the fake agent has it at once)

    prefill, decode = make_pair(checkpoints["llama"])
    sched = decode.scheduler
    decode.loop.run_exclusive(lambda: setattr(sched, "tp_worker", Group()) or setattr(sched, "has_followers", True))
    ids = prompts(1, 20, 20, seed=3)[0]

    async def go():
        for safe in (False, True):
            await decode.reserve("x", ids, GREEDY, room=7 + safe)
            await decode.abort("x", safe=safe, room=7 + safe)
        await run_pd(prefill, decode, ids, GREEDY, rid="x")
        await run_pd(prefill, decode, ids, GREEDY, rid="x")

    asyncio.run(go())
    decode.loop.run_exclusive(lambda: setattr(sched, "has_followers", False))  # (to shut down)
    prefill.shutdown()
    decode.shutdown()  # (the unsafe abort's slots are still quarantined: no integrity check)
    assert expects == ["x"] * 4 and overwritten == [] and follower._receivers == {}


# ---- 9. prefill: a failure caching one pushed request --------------------------------------------
def test_a_failure_caching_one_pushed_prefill_request_does_not_leak_the_others(checkpoints):
    """a and b end their pushes (notices out) before the prefill loop's next step caches them;
    caching a fails (once). b, finished too, was out of ``inflight`` already and no failure
    path released it: its row, slots and prefix lock leaked. Both go back now."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched = prefill.scheduler
    a_ids, b_ids = prompts(2, 20, 20, seed=33)

    pushes = hold_pushes(prefill)

    async def go():
        prefill.loop.pause()  # both admitted in one step
        tasks = [asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid=rid))
                 for rid, ids in (("a", a_ids), ("b", b_ids))]
        await until(lambda: len(prefill.loop.run_exclusive(lambda: list(sched.waiting))) == 2, what="a and b queued")
        paused = pause_once(prefill, lambda: len(sched.inflight) == 2)
        prefill.loop.resume()
        await until(paused.is_set, what="a and b pushing")
        pushes.set()
        await until(lambda: all(r.finished for r in list(sched.inflight)), what="both notices")
        _fail_releasing_once(sched.tree_cache, "a")
        prefill.loop.resume()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)

    results = asyncio.run(go())
    assert [len(r[0]["output_ids"]) for r in results] == [8, 8], results
    assert leaks(prefill, decode) == [None, None]


def test_a_failure_caching_a_pushed_request_in_fail_all_still_tells_the_others(checkpoints):
    """Two pushed requests are cached at one step (the second one's report reached the loop,
    not the early notice); caching the first fails, and fails again in the failure path's
    fail_all. The second must still be released and told: the exception left fail_all before
    it, and its caller waited forever."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    sched, pusher = prefill.scheduler, prefill.rank.pusher
    batch = prompts(2, 20, 20, seed=34)
    report, state = pusher.on_finished, {"first": None, "left_to_loop": [], "reported": []}

    def report_later(result):  # (one lane: in ``inflight`` order) the second one's result waits for the loop
        if state["reported"]:
            state["left_to_loop"].append(result.push_id)
            raise ConnectionError("report lost")
        state["reported"].append(result.push_id)
        report(result)

    real_cache = sched.tree_cache.cache_finished_req
    pushes = hold_pushes(prefill)

    def failing(req, *args, **kwargs):
        if req.rid == state["first"]:
            raise RuntimeError("injected release error")
        return real_cache(req, *args, **kwargs)

    async def go():
        prefill.loop.pause()  # both admitted in one step
        tasks = [asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid=rid))
                 for rid, ids in zip(("a", "b"), batch)]
        await until(lambda: len(prefill.loop.run_exclusive(lambda: list(sched.waiting))) == 2, what="a and b queued")
        paused = pause_once(prefill, lambda: len(sched.inflight) == 2)
        pusher.on_finished = report_later

        def first_rid():
            state["first"] = sched.inflight[0].rid
            return state["first"]

        prefill.loop.resume()
        await until(paused.is_set, what="a and b pushing")
        first = prefill.loop.run_exclusive(first_rid)
        pushes.set()
        await until(lambda: len(pusher._finished) == 1 and sched.inflight[0].finished, what="both pushes")
        sched.tree_cache.cache_finished_req = failing
        prefill.loop.resume()
        other = tasks[1] if first == "a" else tasks[0]
        try:
            final, _, _ = await asyncio.wait_for(asyncio.shield(other), HANG_S)
            answer = len(final["output_ids"])
        except asyncio.TimeoutError:
            answer = "never told"
        del sched.tree_cache.cache_finished_req
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        return answer

    answer = asyncio.run(go())
    prefill.shutdown()  # (the first one's row is lost to the failed releases: no integrity check)
    decode.shutdown()
    assert answer == 8, answer


# ---- 10. prefill: a rank's push report that never comes --------------------------------------------
@pytest.mark.parametrize("tp_size, how", [(2, "report_lost"), (2, "thread_gone"), (1, "thread_gone")])
def test_a_push_never_reported_fails_its_request_at_the_waiting_timeout(checkpoints, monkeypatch, tp_size, how):
    """A rank never reports that its share of a request's push ended: a TP follower's report
    is lost on its way to rank 0 (a Ray message whose call failed there: the follower's hook
    returned, so no later reply brings it), or the rank's transfer thread is gone (its chunks
    queued for good). The request waited in ``inflight`` for good, its row and slots locked and
    its caller never answered; at ``waiting_timeout_s`` (measured here by a clock the test
    moves) it fails with the timeout, every rank's push of it stopped (nothing queued is
    pushed later into slots the decode side has freed), released once; a late report is then
    ignored, and the worker serves the next request. (TP ranks as threads: tests.tp_helpers.)"""
    from actors.kv_push import PushResult
    from actors.workers import DecodeWorker, PrefillWorker
    from tests.tp_helpers import pd_worker_tp2, thread_ranks

    path, lost = checkpoints["llama"], []

    def report(worker, rank, results):
        if how == "report_lost" and not lost:
            lost.append(results[0])  # (the Ray call's failure is rank 0's: the follower goes on)
            return
        worker.followers_pushed(rank, results)

    base = dict(max_total_tokens=512, skip_tokenizer_init=True)
    if tp_size == 2:
        thread_ranks(monkeypatch)
        prefill, follower = pd_worker_tp2(PrefillWorker, path, base, report, waiting_timeout_s=60.0)
    else:
        prefill, follower = PrefillWorker(path, base, backend="shm", waiting_timeout_s=60.0), None
    decode = DecodeWorker(path, base, backend="shm")
    sched, now, silent = prefill.scheduler, [0.0], tp_size - 1
    pusher = (follower.host if follower else prefill.rank).pusher  # the silent rank's
    if how == "thread_gone":
        pusher._start = lambda lane: None
    sched.clock = lambda: now[0]
    ids = prompts(1, 20, 20, seed=41)[0]

    def waits_on_the_silent_rank():
        return [r.pd_pending for r in list(sched.inflight)] == [{silent}] and (lost or how != "report_lost")

    async def go():
        task = asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid="lost"))
        await until(waits_on_the_silent_rank, what="the other ranks' shares pushed, the silent one's not reported")
        push_id = sched.inflight[0].pd_push_id
        await asyncio.sleep(0.05)
        waited = not task.done()
        now[0] += 60.0
        try:
            await asyncio.wait_for(task, 10)
            answer = "served"
        except asyncio.TimeoutError:
            answer = "never answered"
        except PDRequestError as exc:
            answer = str(exc)
        left = (dict(pusher._jobs), [item for lane in pusher._lanes for item in lane.queue])
        pusher.__dict__.pop("_start", None)  # (the transfer thread back)
        prefill.followers_pushed(silent, [PushResult(push_id, 0, None)])  # the late report: settles nothing
        final, _, _ = await asyncio.wait_for(run_pd(prefill, decode, ids, GREEDY), 30)
        return waited, answer, left, len(final["output_ids"])

    waited, answer, left, served = asyncio.run(go())
    state = leaks(prefill, decode)  # (with TP 2, the follower's index tables too)
    if follower is not None:
        follower.shutdown()
    assert waited
    assert f"KV push timed out: TP rank(s) [{silent}] did not report" in answer, answer
    assert (left, served, state) == (({}, []), 8, [None, None])

# ---- 11. decode: a release that fails partway -----------------------------------------------------
def _fail_after_releasing_once(tree, rid):
    """The next release of ``rid``'s KV into ``tree`` frees all it holds, then raises (a
    release failing partway); later ones work. Releasing it again frees it twice."""
    real = tree.cache_finished_req

    def once(req, *args, **kwargs):
        real(req, *args, **kwargs)
        if req.rid == rid:
            del tree.cache_finished_req
            raise RuntimeError("injected error after the release")

    tree.cache_finished_req = once


async def _first_answer(decode, rid, notice, timeout_s=HANG_S):
    """What ``rid``'s stream says first: the finish reason of its result, or that it failed."""
    try:
        result = await asyncio.wait_for(decode.stream(rid, notice).__anext__(), timeout_s)
        return result["meta_info"]["finish_reason"]["type"]
    except asyncio.TimeoutError:
        return "never told"
    except PDRequestError:
        return "failed"


def test_caching_a_request_ended_by_its_first_token_fails_the_step_not_the_notice(checkpoints):
    """The notice's first token ends a landed request, which is cached at once; that caching
    fails partway (its frees made). An internal failure, not a bad notice: the step fails and
    the request is told its own end — not dropped as a bad notice, whose release freed its
    row and slots a second time."""
    prefill, decode = make_pair(checkpoints["llama"])
    ids = prompts(1, 20, 20, seed=41)[0]
    one = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}

    async def go():
        notice = await prefill.prefill("x", ids, one, await decode.reserve("x", ids, one))
        decode.loop.run_exclusive(lambda: _fail_after_releasing_once(decode.scheduler.tree_cache, "x"))
        return await _first_answer(decode, "x", notice)

    answer = asyncio.run(go())
    assert (answer, leaks(prefill, decode)) == ("length", [None, None])


def test_a_transfer_failing_after_its_notice_is_told_when_giving_back_its_slots_fails(checkpoints):
    """After the notice the bytes cannot land (the agent raises): the transfer fails and its
    slots go back at once, which fails partway. The request, out of ``transfer`` by then, is
    still told — it was not among those the failed step's path tells, and its stream waited
    forever."""
    prefill, decode = make_pair(checkpoints["llama"])
    agent, tree = decode.scheduler.agents["shm"], decode.scheduler.tree_cache
    ids = prompts(1, 20, 20, seed=42)[0]

    def cannot_land(handoff):
        raise ConnectionError("injected landing error")

    def break_landing():
        agent.landed = cannot_land
        _fail_after_releasing_once(tree, "x")

    async def go():
        notice = await prefill.prefill("x", ids, GREEDY, await decode.reserve("x", ids, GREEDY))
        decode.loop.run_exclusive(break_landing)
        return await _first_answer(decode, "x", notice)

    answer = asyncio.run(go())
    del agent.landed
    assert (answer, leaks(prefill, decode)) == ("failed", [None, None])


def test_a_reservation_aborted_in_transfer_is_told_when_giving_back_its_slots_fails(checkpoints):
    """A safe abort of a reservation waiting for its KV gives its slots back at once, which
    fails partway (the abort's caller hears of it). The request, finished and in no queue, is
    still told of its abort (before, its stream waited in vain for an answer)."""
    prefill, decode = make_pair(checkpoints["llama"])
    ids = prompts(1, 20, 20, seed=43)[0]

    async def go():
        await decode.reserve("x", ids, GREEDY, room=7)
        decode.loop.run_exclusive(lambda: _fail_after_releasing_once(decode.scheduler.tree_cache, "x"))
        with pytest.raises(RuntimeError, match="injected error after the release"):
            await decode.abort("x", "the client went away", safe=True, room=7)
        return await _first_answer(decode, "x", {"room": 7})

    answer = asyncio.run(go())
    assert (answer, leaks(prefill, decode)) == ("failed", [None, None])


def test_a_failed_step_ends_every_queued_reservation_when_giving_back_one_fails(checkpoints):
    """No hand-off deadline (``waiting_timeout_s=None``): a failed step gives back the
    reservations in transfer at once. Giving back x fails partway. y is still given back, z
    (queued for a reservation) is still ended, each told; x is not given back again. (The
    exception left both queues as they were: x was freed a second time as a failed transfer,
    z reserved slots though finished, which nobody gave back.)"""
    prefill, decode = make_pair(checkpoints["llama"], waiting_timeout_s=None)
    sched = decode.scheduler
    batch = prompts(3, 20, 20, seed=44)

    def broken_step():
        del sched._release_quarantine
        raise RuntimeError("injected step error")

    async def go():
        for rid, ids in zip("xy", batch):
            await decode.reserve(rid, ids, GREEDY, room=7)
        decode.loop.pause()
        z = asyncio.ensure_future(decode.reserve("z", batch[2], GREEDY))
        await until(lambda: decode.loop.run_exclusive(lambda: bool(sched.prealloc)), what="z queued")

        def break_step():
            _fail_after_releasing_once(sched.tree_cache, "x")
            sched._release_quarantine = broken_step

        decode.loop.run_exclusive(break_step)
        decode.loop.resume()
        try:
            await asyncio.wait_for(z, HANG_S)
            answers = ["reserved"]
        except asyncio.TimeoutError:
            answers = ["never told"]
        except Exception:  # noqa: BLE001 - the step's error, the right answer
            answers = ["failed"]
        return answers + [await _first_answer(decode, rid, {"room": 7}) for rid in "xy"]

    answers = asyncio.run(go())
    assert (answers, leaks(prefill, decode)) == (["failed"] * 3, [None, None])


def test_a_quarantined_reservation_whose_release_fails_partway_is_not_released_again(checkpoints):
    """A reservation that timed out waits in quarantine until its hand-off's deadline plus a
    grace period; giving it back then fails partway (its frees made) and fails the step. The
    next step does not give it back again: a row and slots freed twice could go to two
    requests at once."""
    prefill, decode = make_pair(checkpoints["llama"], waiting_timeout_s=0.1)
    decode.loop.run_exclusive(lambda: _fail_after_releasing_once(decode.scheduler.tree_cache, "x"))
    asyncio.run(decode.reserve("x", prompts(1, 20, 20, seed=45)[0], GREEDY))  # (no push comes: it times out)
    assert leaks(prefill, decode) == [None, None]


def test_a_retraction_whose_release_fails_partway_still_tells_the_request(checkpoints):
    """KV pressure retracts a decoding request; giving back its KV fails partway and fails the
    step. The request is requeued all the same, holding nothing, so the failed step's path
    tells it (it was out of ``running`` and in no other queue: its stream waited forever)."""
    import actors.engine.schedule_batch as engine_scheduler

    prefill, decode = make_pair(checkpoints["llama"])
    sched, real = decode.scheduler, engine_scheduler.prepare_for_decode
    ids = prompts(1, 20, 20, seed=46)[0]

    def no_room_once(*args, **kwargs):  # the decode batch does not fit: its last request is retracted
        engine_scheduler.prepare_for_decode = real
        return None

    def squeeze():
        _fail_after_releasing_once(sched.tree_cache, "x")
        engine_scheduler.prepare_for_decode = no_room_once

    async def go():
        paused = pause_once(decode, lambda: any(r.rid == "x" for r in sched.running))
        task = asyncio.ensure_future(run_pd(prefill, decode, ids, ENDLESS, rid="x"))
        await until(paused.is_set, what="x decoding")
        decode.loop.run_exclusive(squeeze)
        decode.loop.resume()
        try:
            await asyncio.wait_for(task, HANG_S)
            return "finished"
        except asyncio.TimeoutError:
            return "never told"
        except Exception:  # noqa: BLE001 - the step's error, the right answer
            return "failed"

    try:
        answer = asyncio.run(go())
    finally:
        engine_scheduler.prepare_for_decode = real
    assert (answer, leaks(prefill, decode)) == ("failed", [None, None])


def test_a_failed_step_gives_back_at_once_a_reservation_whose_notice_came(checkpoints):
    """A failed step ends the reservations in transfer. x's completion notice came (every
    prefill rank ended its push: nothing writes its slots any more), so they go back at once;
    y's did not, so its slots wait in quarantine for its hand-off's deadline (x's waited there
    too, some 310 s by default, a pool's worth of slots held for nothing after a bad step)."""
    prefill, decode = make_pair(checkpoints["llama"])
    sched = decode.scheduler
    x_ids, y_ids = prompts(2, 20, 20, seed=47)

    async def go():
        for rid, ids in (("x", x_ids), ("y", y_ids)):
            await decode.reserve(rid, ids, GREEDY, room=7)
        decode.loop.pause()
        noticed = sched.on_transfer_done("x", {"room": 7, "first_token": 5})
        ended = [r.rid for r in sched.fail_all("injected step error")]
        held = [r.rid for _, r in sched.quarantine]
        decode.loop.resume()
        return noticed, ended, held

    noticed, ended, held = asyncio.run(go())
    assert (noticed, sorted(ended), held) == (True, ["x", "y"], ["y"])
    decode.loop.run_exclusive(lambda: sched.abort("y", safe=True))  # (the prefill side confirmed y's stop)
    assert leaks(prefill, decode) == [None, None]


# ---- 12. prefill: a KV transfer lane that dies with a push open --------------------------------------
class ThreadKilled(BaseException):
    """What a backend may let escape a push that is not an Exception (SystemExit, CancelledError)."""


def test_a_push_lane_that_dies_tells_the_decode_side_without_the_clients_abort(checkpoints):
    """The prefill rank's transfer thread dies after a request's first chunk went (its push
    still open), twice: the first death and the one after the lane's restart. The prefill
    call fails, and the client never aborts the decode side: its receiver waited for the
    notice until its waiting timeout (300 s), slots and row held. The failed sender now tells
    it (torch_dist: an abort message), so the reservation fails at once with the thread's
    push's failure as the reason and its slots and row go back (torch_dist writes nothing in
    place)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, backend="torch_dist", prefill_args={"chunked_prefill_size": 16})
    agent = prefill.agents["torch_dist"]
    real_push, calls = agent.push, []

    def push(handoff, *args, **kwargs):
        calls.append(handoff.rid)
        if calls.count(handoff.rid) == 2:  # the second chunk: the first one opened the pair
            raise ThreadKilled("the backend's event loop went away")
        return real_push(handoff, *args, **kwargs)

    agent.push = push

    async def one(rid, ids):
        handoffs = await decode.reserve(rid, ids, GREEDY)
        with pytest.raises(PDRequestError, match="ThreadKilled"):
            await prefill.prefill(rid, ids, GREEDY, handoffs)
        await until(lambda: rid in decode._ended_early, what="the decode side's reservation ended")
        _, finished, error = decode._ended_early[rid].get_nowait()
        return finished, str(error)

    async def go():
        return [await one(f"lane-{i}", ids) for i, ids in enumerate(prompts(2, 40, 40, seed=43))]

    answers = asyncio.run(go())
    del agent.push
    state = leaks(prefill, decode)
    for finished, error in answers:
        assert finished, answers
        assert "the prefill side gave up: KV push failed: ThreadKilled: the backend's event loop" in error, answers
    assert state == [None, None]
