"""The router's routes past their release (in-process, no Ray): a route is judged by its attempt's
bootstrap room, not only its request id, and a worker removed from the router, or whose actor
died, ends its routes' sides at once."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from actors.pd_scheduler import WorkerBrokenError
from actors.router import Router
from actors.routing_policies import RouterSettings
from tests.router_helpers import FakeDecode, FakePrefill

PS = 4
PROMPT = list(range(16))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run(coro):
    return asyncio.run(coro)


def _router(clock, prefills=("p0",), decodes=("d0", "d1")):
    """A router over fakes whose load reports name what they hold (``rids``: none yet)."""
    router = Router(RouterSettings(page_size=PS, route_grace_s=30.0), clock=clock)
    workers = {w: FakePrefill(w, PS) for w in prefills}
    workers.update({w: FakeDecode(w, PS) for w in decodes})
    for w in workers.values():
        w.reported.update(rids=[], rooms={})
        run(router.add_worker(w.worker_id, w.role, w))
    return router, workers


def _rounds(router, clock, n):
    for _ in range(n):
        clock.now += 5.0
        run(router.heartbeat_once())


def test_routes_have_rooms_of_their_own():
    clock = Clock()
    router, _ = _router(clock)
    first = run(router.route("r1", PROMPT))
    retry = run(router.route("r1", PROMPT, None, [first.decode_id], 1))
    other = run(router.route("r2", PROMPT))
    assert len({first.room, retry.room, other.room}) == 3
    assert all(0 <= d.room < 2**63 for d in (first, retry, other))


def test_a_leftover_of_an_earlier_attempt_does_not_hold_the_retry_s_route():
    """Attempt 0 on (p0, d0): d0 was unavailable, and the prefill's abort did not get through,
    so p0 still runs attempt 0's prefill. The retry runs on (p0, d1) and ends, both its releases
    lost. p0 names the id, but with attempt 0's room: the retry's route is dropped after the
    grace and two rounds, not kept as long as the leftover runs (or an hour)."""
    clock = Clock()
    router, workers = _router(clock)
    first = run(router.route("r1", PROMPT))
    retry = run(router.route("r1", PROMPT, None, [first.decode_id], 1))
    assert retry.prefill_id == first.prefill_id == "p0"
    workers["p0"].reported.update(rids=["r1"], rooms={"r1": retry.room})  # the retry's own prefill
    clock.now = 31.0
    _rounds(router, clock, 3)
    assert router.stats()["inflight"] == 1  # held: it is this attempt
    workers["p0"].reported.update(rids=["r1"], rooms={"r1": first.room})  # only attempt 0's leftover now
    _rounds(router, clock, 2)
    assert router.stats()["inflight"] == 0 and router.stats()["reconciled"] == 1
    assert router.workers["p0"].inflight == 0 and router.workers[retry.decode_id].inflight == 0


def test_a_request_named_without_a_room_may_be_any_attempt():
    """A worker that names the id but no room for it (a request outside PD, an older worker):
    the route stays."""
    clock = Clock()
    router, workers = _router(clock)
    decision = run(router.route("r1", PROMPT))
    workers[decision.decode_id].reported.update(rids=["r1"], rooms={})
    clock.now = 31.0
    _rounds(router, clock, 3)
    assert router.stats()["inflight"] == 1 and router.stats()["reconciled"] == 0


def test_a_late_release_of_an_earlier_request_under_the_id_ends_nothing_of_the_new_route():
    """Request A's final release was delayed (its call timed out at the client, and runs later);
    A's route was reconciled meanwhile and request B routed under the same id, attempt 0 too.
    A's release names A's room: B's route and load stay."""
    clock = Clock()
    router, _ = _router(clock)
    a = run(router.route("r1", PROMPT))
    clock.now = 31.0
    _rounds(router, clock, 2)
    assert router.stats()["reconciled"] == 1
    b = run(router.route("r1", PROMPT))
    run(router.release("r1", None, 0, a.room))  # A's, late
    assert router.stats()["inflight"] == 1 and router.workers[b.decode_id].inflight == 1
    run(router.release("r1", None, 0, b.room))
    assert router.stats()["inflight"] == 0 and all(w.inflight == 0 for w in router.workers.values())


def test_a_removed_worker_ends_its_routes_sides_at_once():
    """Deregistered: its load is not counted any more, a route with no other side open ends (its id
    may be routed again at once), and one whose prefill is still open keeps that side. Registered
    again, the worker starts from no load: the routes' later releases never take it below zero."""
    clock = Clock()
    router, workers = _router(clock, decodes=("d0",))
    run(router.route("r1", PROMPT))
    run(router.route("r2", PROMPT))
    run(router.release("r2", "prefill"))
    assert router.workers["d0"].inflight == 2
    assert run(router.remove_worker("d0"))
    assert sorted(router._requests) == ["r1"] and router.stats()["ended_with_worker"] == 1
    assert (router.workers["p0"].inflight, router._requests["r1"].decode_open) == (1, False)
    run(router.add_worker("d0", "decode", workers["d0"]))
    assert router.workers["d0"].inflight == 0
    run(router.route("r2", PROMPT))  # accepted again at once, not after route_ttl_s
    run(router.release("r1"))
    p0 = router.workers["p0"]
    assert (p0.inflight, p0.pending_prefill_tokens) == (1, router._requests["r2"].uncached_tokens)
    assert router.workers["d0"].inflight == 1  # r2's new route only
    run(router.release("r2"))
    assert all((w.inflight, w.pending_prefill_tokens) == (0, 0) for w in router.workers.values())


def test_a_worker_whose_actor_died_ends_its_routes_sides_at_once():
    """A heartbeat finds the decode actor dead: the routes on it stop loading it and end where no
    other side is open — no grace, no reconciliation rounds."""
    clock = Clock()
    router, workers = _router(clock)
    decision = run(router.route("r1", PROMPT))
    run(router.release("r1", "prefill"))

    def dead():
        raise ActorDiedError()

    workers[decision.decode_id].load = dead
    run(router.heartbeat_once())
    dead_state = router.workers[decision.decode_id]
    assert dead_state.dead and dead_state.inflight == 0
    assert router.stats()["inflight"] == 0 and router.stats()["ended_with_worker"] == 1
    assert run(router.route("r1", PROMPT)).decode_id != decision.decode_id


@pytest.mark.parametrize("how", ["in-process", "ray"])
def test_a_broken_worker_leaves_the_rotation_but_keeps_its_routes_and_comes_back_once_healthy(how):
    """A heartbeat finds a decode worker broken (its KV push lane): nothing new goes to it and it
    leaves the index at once, but it is no dead actor — its process lives and may still hold the
    request, which the client aborts and releases — so its routes stay, counted as its load, however
    many rounds it stays broken. Found healthy again, it is back in the rotation, its pages indexed
    afresh."""
    clock = Clock()
    router, workers = _router(clock)
    decision = run(router.route("r1", PROMPT))
    worker = workers[decision.decode_id]
    worker.serve(PROMPT)  # what it cached meanwhile
    error = WorkerBrokenError(f"{worker.worker_id} is broken: the KV transfer lane raydix-kv-push-0-0 is broken")

    def broken():
        raise RayTaskError("load", "tb", error) if how == "ray" else error

    worker.load = broken
    _rounds(router, clock, 3)  # (more than heartbeat_max_failures)
    state = router.workers[worker.worker_id]
    assert not state.alive and not state.dead and state.inflight == 1
    assert worker.worker_id not in router.index.workers()
    assert router.stats()["inflight"] == 1 and router.stats()["ended_with_worker"] == 0
    assert (router.stats()["broken"], router.stats()["dead"]) == (1, 0)
    assert run(router.route("r2", PROMPT)).decode_id != worker.worker_id
    del worker.load  # healthy again
    _rounds(router, clock, 1)
    assert state.alive and router.index.num_pages(worker.worker_id) == len(PROMPT) // PS
    run(router.release("r1"))
    assert state.inflight == 0 and router.stats()["broken"] == 1


def test_tokens_routed_while_a_load_report_is_out_still_count():
    """A decode worker's ``load()`` queued behind a burst (seconds at an actor's max_concurrency):
    the report cannot cover what was routed after it was asked for, so those tokens still count
    against its free slots — only what was dispatched before the ask is replaced by the report."""
    clock = Clock()
    router, workers = _router(clock, decodes=("d0",))
    run(router.route("before", PROMPT))

    async def scenario():
        asked, answer, report = asyncio.Event(), asyncio.Event(), workers["d0"].load()

        async def slow_load():
            asked.set()
            await answer.wait()
            return report

        workers["d0"].load = slow_load
        heartbeat = asyncio.ensure_future(router.heartbeat_once())
        await asyncio.wait_for(asked.wait(), 5.0)
        await router.route("during", PROMPT + [7, 7, 7, 7])
        answer.set()
        await heartbeat

    run(scenario())
    assert router.workers["d0"].free_slots() == workers["d0"].reported["free_slots"] - 20  # "during"'s 20


def test_a_route_a_worker_still_reports_outlives_route_ttl_s():
    """A generation running longer than ``route_ttl_s``: its decode worker names it (under its
    room) in every report, so the route stays — its load counted, its id refused to another
    request. Once no worker names it, it expires; so does a route no worker reports on (workers
    that name no ids)."""
    clock = Clock()
    router, workers = _router(clock)
    router.settings = RouterSettings(page_size=PS, route_grace_s=30.0, route_ttl_s=100.0)
    decision = run(router.route("long", PROMPT))
    run(router.release("long", "prefill"))
    workers[decision.decode_id].reported.update(rids=["long"], rooms={"long": decision.room})
    _rounds(router, clock, 30)  # 150 s
    assert router.stats()["inflight"] == 1 and router.stats()["expired"] == 0
    assert router.workers[decision.decode_id].inflight == 1
    with pytest.raises(ValueError, match="already routed"):
        run(router.route("long", PROMPT))
    workers[decision.decode_id].reported.update(rids=[], rooms={})  # it ended; its release was lost
    _rounds(router, clock, 1)
    assert router.stats()["inflight"] == 0 and router.workers[decision.decode_id].inflight == 0
    for worker in workers.values():  # they name no ids from now on
        worker.reported.pop("rids")
    run(router.route("other", PROMPT))
    _rounds(router, clock, 21)
    assert router.stats()["inflight"] == 0 and router.stats()["expired"] == 2


class _SlowSnapshot(FakePrefill):
    """A FakePrefill whose snapshot waits for ``gate`` (an ``add_worker`` in flight)."""

    def __init__(self, worker_id, page_size):
        super().__init__(worker_id, page_size)
        self.gate = asyncio.Event()

    async def cached_page_hashes(self):
        await self.gate.wait()
        return await FakePrefill.cached_page_hashes(self)


async def _add_overtaken_by(router, slow, call):
    """``add_worker("p1", slow)`` while ``call("p1")`` (a remove or a drain) runs during its
    snapshot; the add's result."""
    adding = asyncio.ensure_future(router.add_worker("p1", "prefill", slow))
    for _ in range(5):
        await asyncio.sleep(0)
    assert await call("p1")
    slow.gate.set()
    return await adding


@pytest.mark.parametrize("known", [False, True], ids=["new", "registered_again"])
def test_a_removal_during_an_add_s_snapshot_wins(known):
    """``remove_worker`` runs while an ``add_worker`` of the same id waits on its snapshot (a new
    worker, or one registered again with a new handle): the removal is the later call, so the
    add, finishing afterwards, changes nothing — the worker stays out of the rotation and the
    index, and no route goes to it."""
    clock = Clock()
    router, _ = _router(clock, prefills=("p0", "p1") if known else ("p0",))
    slow = _SlowSnapshot("p1", PS)
    slow.serve(PROMPT)  # it holds the prompt: the router would send it there

    assert run(_add_overtaken_by(router, slow, router.remove_worker)) is False
    assert "p1" not in router.workers and "p1" not in router.index.workers()
    assert all(run(router.route(f"r{i}", PROMPT)).prefill_id == "p0" for i in range(3))
    assert not run(router.remove_worker("p1"))


def test_a_draining_worker_takes_nothing_new_but_keeps_its_routes_until_its_requests_end():
    """Drained ahead of its removal: no new request goes to it, but the requests it still runs
    keep their routes — their load counted, their ids refused to another request (as while it
    serves them) — until released or reported done; removed after the drain, it is forgotten."""
    clock = Clock()
    router, workers = _router(clock)
    first = run(router.route("r1", PROMPT))
    draining = first.decode_id
    assert run(router.drain_worker(draining)) and not run(router.drain_worker("nobody"))
    with pytest.raises(ValueError, match="already routed"):
        run(router.route("r1", PROMPT))
    assert all(run(router.route(f"n{i}", PROMPT)).decode_id != draining for i in range(3))
    assert router.workers[draining].inflight == 1
    [listed] = [w for w in router.list_workers() if w["worker_id"] == draining]
    assert listed["draining"] and listed["alive"]
    workers[draining].reported.update(rids=[], rooms={})  # r1 ended there; its release was lost
    clock.now = 31.0
    _rounds(router, clock, 2)
    assert "r1" not in router._requests and router.workers[draining].inflight == 0
    assert run(router.route("r1", PROMPT)).decode_id != draining
    assert run(router.remove_worker(draining)) and draining not in router.workers


def test_removing_a_worker_drains_it_before_the_router_forgets_it():
    """``PDBackend.remove_worker``: while the cluster drains the worker, the router routes
    nothing new to it and still holds the routes of the requests it runs (another client's
    request under one of their ids is refused); once drained and stopped, the router forgets it."""
    from types import SimpleNamespace

    from cluster.backend import PDBackend
    from cluster.pd_client import WorkerRef

    clock = Clock()
    router, workers = _router(clock, decodes=("d0", "d1"))
    decision = run(router.route("r1", PROMPT))
    run(router.release("r1", "prefill"))  # it decodes on its decode worker
    seen = []

    class Cluster:
        def remove_worker(self, worker_id, timeout_s):  # (in a thread, as the real one drains)
            assert timeout_s == 120.0  # (PDBackend.remove_worker's drain: DELETE /workers/{id}'s)
            seen.append(("r1" in router._requests, [w.worker_id for w in router._live("decode")]))
            return SimpleNamespace(worker_id=worker_id, role="decode")

    refs = [WorkerRef(w.worker_id, w.role, w, "n") for w in workers.values()]
    client = SimpleNamespace(router=router, prefill=[r for r in refs if r.role == "prefill"],
                             decode=[r for r in refs if r.role == "decode"])
    assert run(PDBackend(client, Cluster()).remove_worker(decision.decode_id))["removed"]
    other = "d1" if decision.decode_id == "d0" else "d0"
    assert seen == [(True, [other])]
    assert decision.decode_id not in router.workers and "r1" not in router._requests


def test_a_round_its_worker_missed_does_not_expire_a_route_it_reports():
    """Past ``route_ttl_s`` a long generation's route stays while its decode worker names it; a
    heartbeat that worker misses (a long step) says nothing, so the route stays. A worker silent
    for ``route_ttl_s`` (out of the rotation, not dead) names nothing: then it expires."""
    clock = Clock()
    router, workers = _router(clock)
    router.settings = RouterSettings(page_size=PS, route_grace_s=30.0, route_ttl_s=100.0)
    decision = run(router.route("long", PROMPT))
    run(router.release("long", "prefill"))
    decode = workers[decision.decode_id]
    decode.reported.update(rids=["long"], rooms={"long": decision.room})
    _rounds(router, clock, 20)  # 100 s: the route is as old as the TTL
    decode.failing = True
    _rounds(router, clock, 1)  # the round past the TTL: missed
    assert router.stats()["inflight"] == 1 and router.stats()["expired"] == 0
    decode.failing = False
    _rounds(router, clock, 1)
    assert router.stats()["inflight"] == 1 and router.workers[decision.decode_id].inflight == 1
    decode.failing = True
    _rounds(router, clock, 19)  # 95 s of silence: its last report (naming the route) is recent enough
    assert router.stats()["inflight"] == 1
    _rounds(router, clock, 1)
    assert router.stats()["inflight"] == 0 and router.stats()["expired"] == 1


@pytest.mark.parametrize("add", ["done", "pending"])
def test_a_heartbeat_s_resync_racing_a_removal_and_an_add_changes_nothing_of_the_new_worker(add):
    """p1 answers again after missed heartbeats; while its snapshot is taken it is removed and its
    new actor added under the id (its add done, or still waiting on its own snapshot). The
    heartbeat's snapshot, of the old actor, comes back late: the new worker's registration and
    index are its own (it holds the prompt; the old actor nothing)."""
    clock = Clock()
    router, workers = _router(clock, prefills=("p0", "p1"))
    old = workers["p1"] = _SlowSnapshot("p1", PS)
    old.gate.set()
    run(router.add_worker("p1", "prefill", old))
    old.gate.clear()
    old.failing = True
    _rounds(router, clock, 2)
    assert not router.workers["p1"].alive
    old.failing = False
    new = _SlowSnapshot("p1", PS)
    new.serve(PROMPT)

    async def scenario():
        beat = asyncio.ensure_future(router.heartbeat_once())
        for _ in range(10):
            await asyncio.sleep(0)  # its resync waits on the old actor's snapshot
        assert await router.remove_worker("p1")
        adding = asyncio.ensure_future(router.add_worker("p1", "prefill", new))
        if add == "done":
            new.gate.set()
            assert await adding
        for _ in range(10):
            await asyncio.sleep(0)
        old.gate.set()
        await beat
        new.gate.set()
        return await adding

    assert run(scenario()) is True
    assert router.workers["p1"].handle is new and router.workers["p1"].alive
    assert router.index.num_pages("p1") == len(PROMPT) // PS
    decision = run(router.route("r1", PROMPT + [7]))
    assert (decision.prefill_id, decision.matched_tokens) == ("p1", len(PROMPT))


def test_a_drain_during_an_add_s_snapshot_wins():
    """The worker is registered again (a new handle) and drained while that add waits on its
    snapshot: the drain is the later call, so the add changes nothing — the worker stays draining
    and no new request goes to it."""
    clock = Clock()
    router, _ = _router(clock, prefills=("p0", "p1"))
    slow = _SlowSnapshot("p1", PS)
    slow.serve(PROMPT)  # it holds the prompt: the router would send it there

    assert run(_add_overtaken_by(router, slow, router.drain_worker)) is False
    assert router.workers["p1"].draining
    assert all(run(router.route(f"r{i}", PROMPT)).prefill_id == "p0" for i in range(3))


@pytest.mark.parametrize("resync", ["heartbeat", "add"])
def test_a_drain_during_a_suspended_worker_s_snapshot_leaves_it_no_index_entry(resync):
    """p1 is out of the rotation (missed heartbeats) and out of the index. It answers again, or is
    registered again with a new handle, and is drained while that resync waits on its snapshot:
    the drain is the later call, so the snapshot changes nothing — and the index entry made for it
    goes too (it stays out of the rotation; a later heartbeat takes it back, draining)."""
    clock = Clock()
    router, workers = _router(clock, prefills=("p0", "p1"))
    workers["p1"].failing = True
    _rounds(router, clock, 2)
    assert not router.workers["p1"].alive and "p1" not in router.index.workers()
    slow = router.workers["p1"].handle = _SlowSnapshot("p1", PS)  # (it answers now)
    slow.serve(PROMPT)

    async def heartbeat_overtaken():
        beat = asyncio.ensure_future(router.heartbeat_once())
        for _ in range(10):
            await asyncio.sleep(0)  # its resync waits on the snapshot
        assert await router.drain_worker("p1")
        slow.gate.set()
        await beat

    if resync == "heartbeat":
        run(heartbeat_overtaken())
    else:
        assert run(_add_overtaken_by(router, slow, router.drain_worker)) is False
    assert "p1" not in router.index.workers() and router.index.num_pages("p1") == 0
    assert router.workers["p1"].draining and not router.workers["p1"].alive
    _rounds(router, clock, 1)
    assert router.workers["p1"].alive and router.index.num_pages("p1") == len(PROMPT) // PS
    assert all(run(router.route(f"r{i}", PROMPT)).prefill_id == "p0" for i in range(3))


def test_a_prompt_scored_only_is_routed_to_a_prefill_worker_alone():
    """``prefill_only`` (``max_new_tokens`` 0): no decode worker is picked, loaded or indexed (none
    need be live); the route's decode side is closed from the start, so the prefill worker alone
    is asked at reconciliation and one release ends it; the predicted decode hit rate counts the
    routes with a decode side only."""
    clock = Clock()
    router, workers = _router(clock, decodes=("d0",))
    scored = run(router.route("s", PROMPT, None, (), 0, True))
    assert scored.prefill_id == "p0" and scored.decode_id is None and scored.decode_matched_tokens == 0
    assert (router.workers["d0"].inflight, router.workers["d0"].dispatched_tokens) == (0, 0)
    assert router.stats()["approx_entries"] == len(PROMPT) // PS  # p0's pages only
    generated = run(router.route("g", PROMPT))
    workers[generated.decode_id].serve(PROMPT)  # (it cached the prompt: a hit for the next one)
    run(router.release("g"))
    run(router.pull_events())
    assert run(router.route("g2", PROMPT)).decode_matched_tokens == 12
    stats = router.stats()
    assert (stats["prefill_only"], stats["prefill_only_tokens"], stats["inflight"]) == (1, 16, 2)
    assert stats["predicted_decode_hit_rate"] == 12 / 32  # (not over the 48 prompt tokens routed)
    run(router.release("g2"))
    workers["p0"].reported.update(rids=["s"], rooms={"s": scored.room})
    clock.now = 31.0
    _rounds(router, clock, 3)
    assert router.stats()["inflight"] == 1  # its prefill worker holds it
    run(router.release("s", None, 0, scored.room))
    assert router.stats()["inflight"] == 0 and all(w.inflight == 0 for w in router.workers.values())
    assert router.workers["p0"].pending_prefill_tokens == 0

    lone, _ = _router(clock, decodes=())
    assert run(lone.route("s", PROMPT, None, (), 0, True)).decode_id is None
