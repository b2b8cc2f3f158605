"""The router in-process (no Ray): the prefix index against a brute-force oracle, the policy
registry, the prefill cost and the per-request imbalance guard, dispatch-time load, bursts
before any event, KV events and snapshots from real tree caches, a restarted router, a
worker that stops answering heartbeats, and routes whose release was lost reconciled against
the workers' reports."""

import asyncio
import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.prefix_index import PrefixIndex, page_keys
from actors.router import NoWorkerError, Router
from actors.routing_policies import (CacheAware, RouteRequest, RouterSettings, WorkerState, create_policy,
                                     known_policies)
from mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, StateRemoved, StateStored
from mem_cache.radix_key import hash_pages
from tests.router_helpers import FakeDecode, FakePrefill, group_prompts

PS = 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stored(event_id, tokens, page_size=PS):
    return BlockStored(event_id, hash_pages(tokens, page_size), None, list(tokens), page_size)


# ---- the index ------------------------------------------------------------------------------
def test_index_follows_stored_removed_and_cleared():
    index = PrefixIndex()
    index.add_worker("a")
    index.add_worker("b")
    seq = list(range(10, 30))  # 5 pages
    keys = page_keys(hash_pages(seq, PS))
    index.apply("a", stored(1, seq))
    index.apply("b", stored(1, seq[:8]))
    assert index.match(keys) == {"a": 5, "b": 2}
    index.apply("a", BlockRemoved(2, hash_pages(seq, PS)[3:]))
    assert index.match(keys) == {"a": 3, "b": 2}
    index.apply("b", AllBlocksCleared(2))
    assert index.match(keys) == {"a": 3}
    assert index.match(page_keys(hash_pages([99] + seq[1:], PS))) == {}  # chained: page 0 differs, nothing
    index.remove_worker("a")
    assert index.match(keys) == {} and len(index) == 0


def test_approximate_entries_expire_and_yield_to_events():
    clock = Clock()
    index = PrefixIndex(approx_ttl_s=10.0, clock=clock)
    index.add_worker("a")
    seq = list(range(40))
    keys = page_keys(hash_pages(seq, PS))
    index.record("a", keys)
    assert index.match(keys) == {"a": 10} and index.num_pages("a") == 0
    index.apply("a", stored(1, seq[:16]))  # confirms 4 pages: they are exact now
    assert index.num_approx() == 6 and index.num_pages("a") == 4
    clock.now = 10.0
    assert index.match(keys) == {"a": 4}  # the unconfirmed rest lapsed
    assert index.num_approx() == 0


def _oracle(held, query_hashes):
    out = {}
    for worker, pages in held.items():
        n = 0
        while n < len(query_hashes) and query_hashes[n] in pages:
            n += 1
        if n:
            out[worker] = n
    return out


_ops = st.lists(st.tuples(st.sampled_from(["store", "remove", "clear"]), st.integers(0, 2), st.integers(0, 3),
                          st.integers(1, 6), st.integers(0, 6)), max_size=30)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, query=st.tuples(st.integers(0, 3), st.integers(0, 6)))
def test_matched_length_equals_brute_force_oracle(ops, query):
    """Per worker: the longest run of the query's page hashes all among the hashes it stored and
    did not remove — whatever order events came in, gaps included."""
    base = [[(s * 7 + i) % 11 for i in range(6 * PS)] for s in range(4)]  # 4 sequences, some pages shared
    index, held = PrefixIndex(), {w: set() for w in "abc"}
    for w in "abc":
        index.add_worker(w)
    for event_id, (kind, w, s, pages, start) in enumerate(ops, 1):
        worker = "abc"[w]
        hashes = hash_pages(base[s][: pages * PS], PS)[min(start, pages - 1):]
        if kind == "store":
            index.apply(worker, BlockStored(event_id, hashes, None, [], PS))
            held[worker] |= set(hashes)
        elif kind == "remove":
            index.apply(worker, BlockRemoved(event_id, hashes))
            held[worker] -= set(hashes)
        else:
            index.apply(worker, AllBlocksCleared(event_id))
            held[worker].clear()
    seq, pages = query
    query_hashes = hash_pages(base[seq][: max(pages, 1) * PS], PS)
    assert index.match(page_keys(query_hashes)) == _oracle(held, query_hashes)


# ---- policies ----------------------------------------------------------------------------------
def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="known: cache_aware, power_of_two, random, round_robin"):
        create_policy("least_regret", RouterSettings())
    assert known_policies() == ["cache_aware", "power_of_two", "random", "round_robin"]


def _workers(*loads, role="prefill"):
    return [WorkerState(f"w{i}", role, None, inflight=load, pending_prefill_tokens=10 * load)
            for i, load in enumerate(loads)]


def test_prefill_cost_trades_uncached_tokens_against_queued_ones():
    policy = CacheAware(RouterSettings(page_size=16, uncached_token_weight=2.0))
    workers = _workers(3, 0)  # queued prefill tokens: w0 30, w1 0
    req = RouteRequest("r", 160, 16, {"w0": 8})  # w0 holds 128 tokens
    assert policy.select("prefill", workers, req) == (workers[0], "hit")  # 2·32 + 30 < 2·160
    workers[0].pending_prefill_tokens = 400  # 2·32 + 400 > 2·160 + 0: recomputing is cheaper
    assert policy.select("prefill", workers, req) == (workers[1], "miss")


def test_imbalance_guard_is_per_request():
    """w0 is overloaded: the request whose prefix w0 holds goes elsewhere, the one whose prefix
    w2 holds keeps its affinity although the fleet as a whole is imbalanced."""
    s = RouterSettings(page_size=16, balance_abs_threshold=4, balance_rel_threshold=1.5)
    policy = CacheAware(s)
    workers = _workers(10, 0, 2)
    for w in workers:
        w.pending_prefill_tokens = 0
    assert policy.select("prefill", workers, RouteRequest("a", 160, 16, {"w0": 10})) == (workers[1], "guard")
    assert policy.select("prefill", workers, RouteRequest("b", 160, 16, {"w2": 10})) == (workers[2], "hit")


def test_decode_choice_by_free_slots_and_running_requests():
    policy = create_policy("cache_aware", RouterSettings())
    workers = _workers(2, 1, 1, role="decode")
    for w, free in zip(workers, (5000, 100, 3000)):
        w.report = {"free_slots": free}
    assert policy.select("decode", workers, RouteRequest("r", 500, 1, {})).worker is workers[2]  # w1 lacks room
    p2 = create_policy("power_of_two", RouterSettings(), seed=3)
    assert {p2.select("decode", workers, RouteRequest("r", 10, 1, {})).worker.worker_id for _ in range(20)} <= {
        "w1", "w2"}  # the busier w0 can lose every draw
    rr = create_policy("round_robin", RouterSettings())
    assert [rr.select("decode", workers, None).worker.worker_id for _ in range(4)] == ["w0", "w1", "w2", "w0"]


def test_decode_affinity_holds_within_the_load_slack_only():
    """A decode worker holding the conversation wins while it is at most ``decode_affinity_slack``
    requests busier than the least loaded; the hit also lowers the room the prompt needs there."""
    policy = CacheAware(RouterSettings(page_size=16, decode_affinity_slack=2))
    workers = _workers(3, 1, role="decode")
    for w in workers:
        w.report = {"free_slots": 10_000}
    req = RouteRequest("r", 320, 16, {"w0": 18})  # w0 holds 288 of 320 tokens
    assert policy.select("decode", workers, req) == (workers[0], "hit")
    workers[0].inflight = 4  # 3 above the least loaded: a hit saves a transfer, not decode compute
    assert policy.select("decode", workers, req) == (workers[1], "load")
    workers[0].inflight = 3
    workers[0].report = {"free_slots": 40}  # room for the 32 uncached tokens, not for all 320
    workers[1].report = {"free_slots": 300}
    assert policy.select("decode", workers, req) == (workers[0], "hit")
    assert policy.select("decode", workers, RouteRequest("r", 320, 16, {"w0": 2})) == (workers[1], "load")
    # a short shared header (every conversation's chat template) is no reason to pile up
    workers[0].inflight, workers[0].report = 2, {"free_slots": 10_000}
    assert policy.select("decode", workers, RouteRequest("r", 60, 16, {"w0": 3})) == (workers[1], "load")
    assert policy.select("decode", workers, RouteRequest("r", 90, 16, {"w0": 5})) == (workers[0], "hit")


# ---- the router over in-process workers -----------------------------------------------------------
def make_router(prefills, decodes, **kw):
    router = Router(RouterSettings(page_size=PS, heartbeat_max_failures=2, **kw))

    async def add():
        for w in prefills + decodes:
            await router.add_worker(w.worker_id, w.role, w)

    asyncio.run(add())
    return router


def run(coro):
    return asyncio.run(coro)


def test_load_counts_from_dispatch_and_release_takes_it_back():
    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    first = run(router.route("r1", list(range(64))))
    state = router.workers[first.prefill_id]
    assert (state.inflight, state.pending_prefill_tokens, router.workers["d0"].inflight) == (1, 64, 1)
    run(router.release("r1", "prefill"))
    assert (state.inflight, state.pending_prefill_tokens, router.workers["d0"].inflight) == (0, 0, 1)
    run(router.release("r1"))
    assert router.workers["d0"].inflight == 0 and router.stats()["inflight"] == 0
    run(router.route("r2", [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="already routed"):
        run(router.route("r2", [1, 2, 3, 4]))


def test_a_burst_of_similar_requests_follows_the_first_before_any_event():
    p, d = [FakePrefill(f"p{i}", PS) for i in range(3)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    groups = group_prompts(3, 5, prefix_len=64, suffix_len=8, seed=1)
    placed = {}
    for g, group in enumerate(groups):
        for i, ids in enumerate(group):
            placed.setdefault(g, set()).add(run(router.route(f"{g}-{i}", ids)).prefill_id)
    assert all(len(ws) == 1 for ws in placed.values())  # each group on one worker ...
    assert len(set.union(*placed.values())) == 3  # ... and the three groups spread over three workers


def test_events_and_a_restarted_router_route_to_the_worker_holding_the_prefix():
    p, d = [FakePrefill(f"p{i}", PS) for i in range(2)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    workers = {w.worker_id: w for w in p}
    groups = group_prompts(4, 4, prefix_len=48, suffix_len=6, seed=2)
    home = {}
    for g, group in enumerate(groups):
        for i, ids in enumerate(group):
            decision = run(router.route(f"{g}-{i}", ids))
            workers[decision.prefill_id].serve(ids)
            d[0].serve(ids)  # the decode worker caches it when it ends
            run(router.release(f"{g}-{i}"))
            home.setdefault(g, decision.prefill_id)
    assert run(router.pull_events()) > 0
    assert router.index.num_approx() == 0  # every recorded page was confirmed by an event
    fresh = make_router(p, d)  # a restart: the new router knows nothing but what the workers report
    assert len(fresh.index) == len(router.index) > 0
    for g, group in enumerate(groups):
        decision = run(fresh.route(f"again-{g}", group[0][:48] + [7, 7, 7, 7]))
        assert decision.prefill_id == home[g] and decision.matched_tokens == 48 and decision.reason == "hit"


def test_an_event_gap_resyncs_from_a_snapshot():
    p, d = [FakePrefill("p0", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    p[0].serve(list(range(32)))
    p[0]._drain_kv_events()
    p[0]._kv_log.clear()  # the worker's log moved on past what the router has seen
    p[0].serve(list(range(100, 132)))
    resyncs = router.counters["resyncs"]
    run(router.pull_events())
    assert router.counters["resyncs"] == resyncs + 1
    assert router.index.match(page_keys(hash_pages(list(range(32)), PS))) == {"p0": 8}


def test_a_silent_worker_leaves_the_rotation_and_the_index():
    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    ids = list(range(40))
    p[0].serve(ids)
    run(router.pull_events())
    p[0].failing = True
    run(router.heartbeat_once())
    assert router.workers["p0"].alive  # one miss is not enough
    run(router.heartbeat_once())
    assert not router.workers["p0"].alive and router.index.num_pages("p0") == 0
    assert run(router.route("r", ids)).prefill_id == "p1"
    assert run(router.remove_worker("p1")) and [w["worker_id"] for w in router.list_workers()] == ["p0", "d0"]
    with pytest.raises(NoWorkerError, match="no live prefill worker"):
        run(router.route("r2", ids))
    run(router.add_worker("p2", "prefill", FakePrefill("p2", PS)))
    assert run(router.route("r3", ids)).prefill_id == "p2"


def test_page_size_mismatch_is_refused():
    router = Router(RouterSettings(page_size=16))
    with pytest.raises(ValueError, match="page_size 4"):
        run(router.add_worker("p0", "prefill", FakePrefill("p0", 4)))
    assert router.list_workers() == [] and router.index.workers() == []


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(-2**40, 2**40) | st.integers(0, 300), max_size=40), page_size=st.sampled_from([1, 3, 16]),
       extra=st.none() | st.text(max_size=3))
def test_hash_pages_is_hash_page_chained(ids, page_size, extra):
    """The router and the workers share hash_pages; its fast path must equal the per-page definition."""
    from mem_cache.radix_key import hash_page, root_hash

    prev, expected = root_hash(extra), []
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = hash_page(ids[start:start + page_size], prev)
        expected.append(prev)
    assert hash_pages(ids, page_size, extra_key=extra) == expected


def test_an_undrained_event_queue_stays_bounded_and_the_gap_shows_in_the_ids():
    from mem_cache.kv_events import KVEventQueue

    queue = KVEventQueue(enabled=True, max_pending=8)
    for i in range(20):
        queue.removed([f"{i:064x}"])
    assert [e.event_id for e in queue.take()] == [16, 17, 18, 19, 20]  # the older half went, twice


def test_a_conversation_returns_to_the_decode_worker_that_holds_it():
    """Turn 2 of each conversation goes to the decode worker that decoded (and cached) turn 1,
    so only the new tail's KV moves; the conversations themselves spread over the decode workers."""
    p, d = [FakePrefill("p0", PS)], [FakeDecode(f"d{i}", PS) for i in range(3)]
    router = make_router(p, d)
    decoders = {w.worker_id: w for w in d}
    first_turns = [ids for group in group_prompts(6, 1, prefix_len=40, suffix_len=0, seed=5) for ids in group]
    home = {}
    for c, ids in enumerate(first_turns):
        decision = run(router.route(f"c{c}-t1", ids))
        home[c] = decision.decode_id
        decoders[decision.decode_id].serve(ids + [9, 9, 9, 9])  # prompt and answer cached when it ends
        run(router.release(f"c{c}-t1"))
    assert sorted(collections.Counter(home.values()).values()) == [2, 2, 2]
    run(router.pull_events())
    for c, ids in enumerate(first_turns):
        decision = run(router.route(f"c{c}-t2", ids + [9, 9, 9, 9] + [5, 6, 7, 8]))
        assert (decision.decode_id, decision.decode_matched_tokens) == (home[c], 44)
        run(router.release(f"c{c}-t2"))
    assert router.stats()["predicted_decode_hit_rate"] > 0.4


# ---- liveness, leaked routes, re-registration, event holes -----------------------------------------
def _dies(worker, exc_factory):
    """``worker``'s actor is gone: every call the router makes raises ``exc_factory()``."""
    def fail(*args, **kwargs):
        raise exc_factory()

    worker.kv_events = worker.cached_page_hashes = worker.load = fail


def test_a_worker_dead_to_event_pulls_is_not_chosen():
    """An event pull (every 50 ms) that finds the worker's actor dead takes it out of the
    rotation and the index at once, not at the next heartbeat (5 s), during which every request
    of the prefix it held would go to it and fail."""
    from ray.exceptions import ActorDiedError

    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    ids = list(range(40))
    p[0].serve(ids)
    run(router.pull_events())
    _dies(p[0], ActorDiedError)
    run(router.pull_events())  # the pull saw the actor die
    assert run(router.route("r", ids)).prefill_id == "p1"


def test_a_transiently_unavailable_worker_is_not_dropped_at_the_first_miss():
    """Ray's ActorUnavailableError ("temporarily unavailable but may be available later") is a
    RayActorError but no death: one blip is one missed heartbeat of ``heartbeat_max_failures``."""
    from ray.exceptions import ActorUnavailableError

    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    _dies(p[0], lambda: ActorUnavailableError("network blip", None))
    run(router.heartbeat_once())
    assert router.workers["p0"].alive  # one miss of heartbeat_max_failures=2


def test_a_worker_that_answers_again_returns_to_the_rotation():
    """Missed heartbeats (a long step, a GC pause) take a worker out of the rotation until it
    answers again (a circuit breaker, as SGLang's router has); then its pages are indexed afresh."""
    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    p[0].failing = True
    run(router.heartbeat_once())
    run(router.heartbeat_once())
    assert not router.workers["p0"].alive
    p[0].failing = False
    for _ in range(3):
        run(router.heartbeat_once())
    assert router.workers["p0"].alive


def test_a_route_never_released_does_not_load_its_worker_forever():
    """A client that dies (or whose release is lost) never releases its route; load counts the
    larger of the router's own count and the worker's report, so without an end the worker would
    look busy for good. A route stops counting after ``route_ttl_s``."""
    clock = Clock()
    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = Router(RouterSettings(page_size=PS), clock=clock)
    for w in p + d:
        run(router.add_worker(w.worker_id, w.role, w))
    for i in range(10):
        run(router.route(f"lost-{i}", [1000 + i] * 8))  # routed; the client died; never released
    clock.now += 3600.0  # an hour on, the workers have long reported being idle
    run(router.heartbeat_once())
    assert [router.workers[w].load() for w in ("p0", "p1", "d0")] == [0, 0, 0]
    assert router.stats()["inflight"] == 0


def _reconciling(clock, holds=(), **kw):
    """A router over p0, p1 and d0 whose load reports name the ids in ``holds`` (None: no ids)."""
    p, d = [FakePrefill("p0", PS), FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = Router(RouterSettings(page_size=PS, route_grace_s=30.0, **kw), clock=clock)
    for w in p + d:
        run(router.add_worker(w.worker_id, w.role, w))
        if holds is not None:
            w.reported["rids"] = list(holds)
    return router, {w.worker_id: w for w in p + d}


def test_a_lost_release_is_reconciled_once_neither_worker_holds_the_request():
    """The client's final release was lost (the router call timed out): the route is dropped
    once neither worker holds the request in two heartbeats in a row past the grace — its load
    is gone and its id may be routed again — not after ``route_ttl_s``."""
    clock = Clock()
    router, workers = _reconciling(clock)
    first = run(router.route("r1", list(range(16))))
    clock.now = 31.0
    run(router.heartbeat_once())  # one report without it: it may have arrived since
    assert router.stats()["inflight"] == 1 and router.workers["d0"].inflight == 1
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 0 and router.stats()["reconciled"] == 1
    assert (router.workers[first.prefill_id].inflight, router.workers[first.prefill_id].pending_prefill_tokens,
            router.workers["d0"].inflight) == (0, 0, 0)
    assert all("rids" not in w["report"] for w in router.list_workers())  # (the ids are the reconciliation's)
    run(router.route("r1", list(range(16))))  # the same id again: no longer "already routed"


def test_a_missed_report_restarts_the_count():
    """Two reports in a row: a round whose decode report did not come tells nothing."""
    clock = Clock()
    router, workers = _reconciling(clock)
    run(router.route("r1", list(range(16))))
    clock.now = 31.0
    run(router.heartbeat_once())
    workers["d0"].failing = True  # one miss of heartbeat_max_failures=2: still in rotation
    run(router.heartbeat_once())
    workers["d0"].failing = False
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 1
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 0


def test_a_worker_whose_actor_died_holds_nothing():
    """Its decode worker died under the request and the client's release was lost: the dead actor
    sends no report, but holds nothing either; the prefill worker's reports settle the route."""
    from ray.exceptions import ActorDiedError

    clock = Clock()
    router, workers = _reconciling(clock)
    run(router.route("r1", list(range(16))))
    _dies(workers["d0"], ActorDiedError)
    clock.now = 31.0
    run(router.heartbeat_once())
    assert router.workers["d0"].dead and router.stats()["inflight"] == 1
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 0 and router.stats()["reconciled"] == 1


def test_a_request_its_decode_worker_holds_is_never_dropped():
    """Decoding (or waiting for its KV) long after its prefill was released: the decode worker's
    reports name it, so its route stays however old (below ``route_ttl_s``). Its prefill worker,
    released, is not asked (here it has left the router, which cannot see what it holds)."""
    clock = Clock()
    router, workers = _reconciling(clock)
    first = run(router.route("r1", list(range(16))))
    run(router.release("r1", "prefill"))
    run(router.remove_worker(first.prefill_id))
    workers["d0"].reported["rids"] = ["other", "r1"]
    for _ in range(5):
        clock.now += 600.0
        run(router.heartbeat_once())
    assert router.stats()["inflight"] == 1 and router.workers["d0"].inflight == 1
    assert router.stats()["reconciled"] == 0
    workers["d0"].reported["rids"] = ["other"]  # it ended; the final release was lost
    run(router.heartbeat_once())
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 0 and router.workers["d0"].inflight == 0


def test_a_route_younger_than_the_grace_is_not_dropped():
    """Between routing and the client's reserve landing on the decode worker no worker holds the
    request: reports taken within the grace count for nothing, so a single one past it drops nothing."""
    clock = Clock()
    router, _ = _reconciling(clock)
    run(router.route("r1", list(range(16))))
    for now in (5.0, 15.0, 29.0):
        clock.now = now
        run(router.heartbeat_once())
    clock.now = 31.0
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 1 and router.stats()["reconciled"] == 0


@pytest.mark.parametrize("ids_from", ["none", "prefill_only"])
def test_a_report_without_ids_changes_nothing(ids_from):
    """A worker whose report names no ids (these fakes, an older worker) may hold anything: its
    routes last until ``route_ttl_s``."""
    clock = Clock()
    router, workers = _reconciling(clock, holds=None)
    if ids_from == "prefill_only":
        workers["p0"].reported["rids"] = workers["p1"].reported["rids"] = []
    run(router.route("r1", list(range(16))))
    for _ in range(4):
        clock.now += 600.0
        run(router.heartbeat_once())
    assert router.stats()["inflight"] == 1 and router.stats()["reconciled"] == 0
    clock.now = 3600.0
    run(router.heartbeat_once())
    assert router.stats()["inflight"] == 0 and router.stats()["expired"] == 1


def test_route_grace_must_be_positive():
    with pytest.raises(ValueError, match="route_grace_s must be > 0"):
        RouterSettings(route_grace_s=0.0)


def test_re_adding_a_worker_keeps_its_dispatched_load():
    """A worker registered again (a retried registration) keeps the load routed to it: its
    releases then bring the counts to 0, not below."""
    p, d = [FakePrefill("p0", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    run(router.route("r1", list(range(64))))
    run(router.add_worker("p0", "prefill", p[0]))  # registered again (a retried registration)
    assert router.workers["p0"].inflight == 1
    run(router.release("r1"))
    assert (router.workers["p0"].inflight, router.workers["p0"].pending_prefill_tokens) == (0, 0)


def test_a_failed_re_add_leaves_the_worker_in_the_index():
    """A re-registration whose snapshot fails (here a page size that does not match) leaves the
    worker in rotation as it was, still in the index."""
    p, d = [FakePrefill("p0", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    with pytest.raises(ValueError, match="page_size 8"):
        run(router.add_worker("p0", "prefill", FakePrefill("p0", 8)))
    assert router.workers["p0"].alive
    assert run(router.route("r1", list(range(16)))).prefill_id == "p0"


def test_a_hole_inside_an_event_batch_resyncs():
    """A worker's event queue drops its oldest events when it overflows; when another consumer
    had drained the events before the hole, a batch starts at the cursor yet misses events in
    its middle: the router sees the hole and re-indexes the worker from its snapshot."""
    p, d = [FakePrefill("p0", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    run(router.pull_events())
    p[0].serve(list(range(100, 108)))
    p[0]._drain_kv_events()  # another router's pull moved this event into the log
    p[0].cache.events.max_pending = 4
    for s in range(10):  # 10 stores: the queue keeps only the newest
        p[0].serve([200 + s] * 8)
    run(router.pull_events())
    held = {h for chain in p[0].cache.stored_page_hashes() for h in chain}
    assert router.index.num_pages("p0") == len(held)


def _hybrid_cache(strategy="no_buffer"):
    """A MambaRadixCache with KV events on, and ``put(tokens)``: cache them with a state at their end."""
    import torch

    from mem_cache.allocator import TokenToKVPoolAllocator
    from mem_cache.mamba_pool import HybridReqToTokenPool, MambaPool
    from mem_cache.mamba_radix_cache import MambaRadixCache
    from mem_cache.radix_key import RadixKey

    mamba = MambaPool(4, [(2, 2)], (2,), 1, torch.float32, torch.float32)
    alloc = TokenToKVPoolAllocator(512)
    cache = MambaRadixCache(HybridReqToTokenPool(2, 256, "cpu", mamba, [0]), alloc, enable_kv_events=True,
                            mamba_scheduler_strategy=strategy)
    return cache, lambda tokens: cache.insert(RadixKey(tokens), alloc.alloc(len(tokens)), mamba.alloc(1))


def _rule_index(kind="state", **kw):
    index = PrefixIndex(approx_ttl_s=30.0)
    index.add_worker("a")
    index.set_rule("a", kind, **kw)
    return index


def test_a_hybrid_prefill_worker_is_credited_only_up_to_a_cached_state():
    """A Mamba prefill worker reuses a prefix only up to a cached recurrent state. Worker a cached
    system prompt S + question q as one node (a state after q only), worker b cached S alone. For
    S + the first half of q + something else, a holds more pages but could reuse none; b can
    reuse S: the router sends it to b as a hit. Then a caches a state at the end of S too (a split
    and an insert there): it is credited S, from its events."""
    system, question = list(range(100, 132)), list(range(200, 216))
    (a_cache, a_put), (b_cache, b_put) = _hybrid_cache(), _hybrid_cache()
    a_put(system + question)
    b_put(system)
    router = Router(RouterSettings(page_size=1, cache_threshold=0.1))
    run(router.add_worker("a", "prefill", FakePrefill("a", 1, a_cache)))
    run(router.add_worker("b", "prefill", FakePrefill("b", 1, b_cache)))
    run(router.add_worker("d", "decode", FakeDecode("d", 1)))
    prompt = system + question[:8] + [7] * 8
    assert router.index.match(page_keys(hash_pages(prompt, 1))) == {"b": 32}  # a: no state within its 40
    decision = run(router.route("r1", prompt))
    assert (decision.prefill_id, decision.matched_tokens, decision.reason) == ("b", 32, "hit")
    run(router.release("r1"))
    a_put(system)  # a state after S now too (the node is split: S is no longer a tombstone)
    run(router.pull_events())
    # b and d hold the routed prompt approximately now (b with its final state, as it will cache it)
    assert router.index.match(page_keys(hash_pages(prompt, 1))) == {"a": 32, "b": 48, "d": 48}


def test_a_repeated_prompt_is_credited_what_its_match_of_all_but_the_last_token_reuses():
    """Every worker computes a prompt's last token at least: a hybrid prefill worker that cached
    prompt P with its final state (at P's end) reuses nothing of P again, and a sliding-window
    decode worker whose cached P has only its last window of SWA KV reuses nothing either. The
    router matches P less its last token: a is credited 0 and b, with a state after 16 tokens,
    16; the decode worker 0."""
    from mem_cache.radix_key import RadixKey
    from mem_cache.req_to_token_pool import ReqToTokenPool
    from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
    from mem_cache.swa_radix_cache import SWARadixCache

    prompt = list(range(100, 132))
    (a_cache, a_put), (b_cache, b_put) = _hybrid_cache(), _hybrid_cache()
    a_put(prompt)
    b_put(prompt[:16])
    alloc = SWATokenToKVPoolAllocator(64, 48)
    swa = SWARadixCache(ReqToTokenPool(2, 64), alloc, sliding_window_size=4, enable_kv_events=True)
    slots = alloc.alloc(len(prompt))
    alloc.free_swa(slots[:28])  # slid out of the window: tombstones but for the last 4 tokens
    swa.insert(RadixKey(prompt), slots, 0, 28)
    router = Router(RouterSettings(page_size=1, cache_threshold=0.1, decode_affinity_min_tokens=1))
    run(router.add_worker("a", "prefill", FakePrefill("a", 1, a_cache)))
    run(router.add_worker("b", "prefill", FakePrefill("b", 1, b_cache)))
    run(router.add_worker("d", "decode", FakeDecode("d", 1, cache=swa)))
    decision = run(router.route("r1", prompt))
    assert (decision.prefill_id, decision.matched_tokens, decision.decode_matched_tokens) == ("b", 16, 0)


def test_approximate_states_only_where_the_worker_caches_a_prompts_final_state():
    """``prompt_state`` (no_buffer): a routed prompt counts as cached with its final state until
    events say otherwise, so a longer prompt routed right after is a hit. An extra_buffer worker
    checkpoints at chunk boundaries instead: no state is assumed at the end."""
    prompt = list(range(1000, 1100))
    keys, longer = page_keys(hash_pages(prompt, 1)), page_keys(hash_pages(prompt + [7] * 20, 1))
    guessing, chunked = _rule_index(prompt_state=True), _rule_index(prompt_state=False)
    for index in (guessing, chunked):
        index.record("a", keys)
    assert guessing.match(longer) == {"a": 100} and chunked.match(longer) == {}


def test_a_workers_state_events_overrule_the_approximate_state():
    """The prompt's pages were cached already (a tombstone at its end), so routing it records only
    an approximate state there and no BlockStored will come. The worker's StateStored and then
    StateRemoved (evict_mamba) for that page are what counts from then on."""
    prompt = list(range(100, 132))
    hashes = hash_pages(prompt, 1)
    keys, longer = page_keys(hashes), page_keys(hash_pages(prompt + [1, 2, 3], 1))
    index = _rule_index(prompt_state=True)
    index.apply("a", BlockStored(1, hashes, None, prompt, 1))
    index.apply("a", StateStored(2, hashes[15:16]))  # a state after 16 tokens only
    index.record("a", keys)
    assert index.match(longer) == {"a": 32}
    index.apply("a", StateStored(3, hashes[-1:]))
    index.apply("a", StateRemoved(4, hashes[-1:]))
    assert index.match(longer) == {"a": 16}


# ---- races of liveness with removal and replacement; the client's view of a worker -------------------
class _GatedPrefill(FakePrefill):
    """A FakePrefill whose next ``load`` / ``kv_events`` waits for ``gate`` (an answer in flight)."""

    def __init__(self, worker_id, page_size):
        super().__init__(worker_id, page_size)
        self.gate_load = self.gate_events = None
        self.events_raise = None

    async def load(self):
        if self.gate_load is not None:
            await self.gate_load.wait()
        return FakePrefill.load(self)

    async def kv_events(self, since_id=0, max_events=4096):
        if self.gate_events is not None:
            await self.gate_events.wait()
            if self.events_raise is not None:
                raise self.events_raise()
        return await FakePrefill.kv_events(self, since_id, max_events)


async def _settle():
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_worker_removed_while_its_heartbeat_is_in_flight_stays_out_of_the_index():
    """A worker removed while a heartbeat to it is out: its answer does not bring it back into
    the rotation or the index (it is no longer the router's)."""
    p0 = _GatedPrefill("p0", PS)
    p, d = [p0, FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    p0.serve(list(range(40)))

    async def scenario():
        p0.gate_load = asyncio.Event()
        beat = asyncio.ensure_future(router.heartbeat_once())
        await _settle()  # p0's load() is in flight
        assert await router.remove_worker("p0")
        p0.gate_load.set()
        await beat

    run(scenario())
    assert "p0" not in router.workers
    assert "p0" not in router.index.workers() and router.index.num_pages("p0") == 0


def test_a_stale_pull_that_finds_the_old_actor_dead_does_not_unindex_its_replacement():
    """A worker registered again under its id (a new actor) while a pull to the old actor is out:
    that pull finding the old actor dead leaves the new registration, and its index, alone."""
    from ray.exceptions import ActorDiedError

    old = _GatedPrefill("p0", PS)
    router = make_router([old], [FakeDecode("d0", PS)])

    async def scenario():
        old.gate_events, old.events_raise = asyncio.Event(), ActorDiedError
        pull = asyncio.ensure_future(router.pull_events())
        await _settle()  # the pull of the old actor is in flight
        await router.add_worker("p0", "prefill", FakePrefill("p0", PS))  # its new actor registers
        old.gate_events.set()  # the old actor's pull fails: it died
        await pull
        assert router.workers["p0"].alive
        assert "p0" in router.index.workers()
        return await router.route("r", list(range(16)))

    assert run(scenario()).prefill_id == "p0"


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            result = self.fn(*args)
            return await result if asyncio.iscoroutine(result) else result
        return call()


class _ClientHandle:
    """What a PDClient calls on a worker: ``load`` and ``abort`` of a FakePrefill, with ``.remote``."""

    def __init__(self, worker, abort_exc=None):
        self.worker, self.aborts, self.abort_exc = worker, [], abort_exc
        self.load = _Remote(lambda: worker.load())
        self.abort = _Remote(self._abort)

    def _abort(self, *args):
        if self.abort_exc is not None:
            raise self.abort_exc()
        self.aborts.append(args)


def test_a_worker_the_router_takes_back_is_not_dead_to_the_client():
    """A worker out of the rotation for missed heartbeats, not dead, is no process that writes
    nothing: the client still stops its prefill (an abort) before the decode side may free the
    slots, and takes it back into its own rotation once it answers."""
    from cluster.pd_client import PDClient, WorkerRef

    p0 = FakePrefill("p0", PS)
    p, d = [p0, FakePrefill("p1", PS)], [FakeDecode("d0", PS)]
    router = make_router(p, d)
    refs = [WorkerRef(w.worker_id, w.role, _ClientHandle(w), "n") for w in p + d]
    client = PDClient(refs[:2], refs[2:], router=router, heartbeat_max_failures=2)
    p0.failing = True
    for _ in range(2):  # a long pause: both the router and the client drop it
        run(router.heartbeat_once())
        run(client.heartbeat_once())
    p0.failing = False
    for _ in range(2):
        run(router.heartbeat_once())
        run(client.heartbeat_once())
    assert router.workers["p0"].alive  # the router routes to it again
    run(client._stop_prefill(refs[0], "r", 1))  # a request on it fails (its client left during prefill)
    assert refs[0].handle.aborts, "the live prefill worker was never told to stop"


def test_stop_prefill_does_not_take_an_unavailable_prefill_for_dead():
    """An abort that meets ActorUnavailableError (a blip: the actor may come back and push) is
    no certainty that the prefill writes nothing."""
    from ray.exceptions import ActorUnavailableError

    from cluster.pd_client import PDClient, WorkerRef

    p0 = FakePrefill("p0", PS)
    ref = WorkerRef("p0", "prefill", _ClientHandle(p0, abort_exc=lambda: ActorUnavailableError("blip", None)), "n")
    client = PDClient([ref], [])
    assert run(client._stop_prefill(ref, "r", 1)) is False


def test_drain_waits_for_a_request_the_router_is_still_placing():
    """An accepted request still being routed is in flight: drain waits for it (it counted only
    requests with a pair, so the workers could stop under it)."""
    from cluster.pd_client import PDClient, PDRequestError

    async def scenario():
        placed = asyncio.Event()

        class SlowRouter:
            async def route(self, rid, input_ids):
                await placed.wait()
                raise NoWorkerError("no live decode worker")

            async def release(self, rid, role=None, attempt=None):
                return None

        client = PDClient([], [], router=SlowRouter())
        request = asyncio.ensure_future(client.generate([1, 2, 3]))
        await asyncio.sleep(0.01)
        drain = asyncio.ensure_future(client.drain(timeout_s=5.0))
        await asyncio.sleep(0.1)
        assert not drain.done(), "drain returned while a request was being routed"
        placed.set()
        with pytest.raises(PDRequestError, match="could not place"):
            await request
        await asyncio.wait_for(drain, 30.0)

    run(scenario())


def test_a_router_that_does_not_answer_fails_the_request_in_time_and_its_route_is_released():
    """A hung router: the request fails after ``router_timeout_s`` instead of waiting for its
    client's timeout, and the route, once the router makes it, is released (its id free again)."""
    from cluster.pd_client import PDClient, PDRequestError

    async def scenario():
        placed, released = asyncio.Event(), []

        class SlowRouter:
            async def route(self, rid, input_ids):
                await placed.wait()
                return None  # (a decision; never looked at: the request is gone)

            async def release(self, rid, role=None, attempt=None):
                released.append(rid)

        client = PDClient([], [], router=SlowRouter(), router_timeout_s=0.1)
        with pytest.raises(PDRequestError, match="did not place"):
            await asyncio.wait_for(client.generate([1, 2, 3], rid="r1"), 5.0)
        assert "r1" in client._unreleased and not released
        placed.set()
        for _ in range(50):
            await asyncio.sleep(0.01)
        assert released == ["r1"] and not client._unreleased

    run(scenario())


def test_a_route_refused_after_its_request_was_given_up_releases_nothing():
    """The router refuses, late, a route its client gave up on (the id is routed already,
    by another client): the client must not release it — that would end the other
    request's route and its workers' load."""
    from cluster.pd_client import PDClient, PDRequestError

    async def scenario():
        placed, released = asyncio.Event(), []

        class RefusingRouter:
            async def route(self, rid, input_ids):
                await placed.wait()
                raise ValueError(f"request {rid!r} is already routed")

            async def release(self, rid, role=None, attempt=None):
                released.append(rid)

        client = PDClient([], [], router=RefusingRouter(), router_timeout_s=0.1)
        with pytest.raises(PDRequestError, match="did not place"):
            await asyncio.wait_for(client.generate([1, 2, 3], rid="r1"), 5.0)
        assert "r1" in client._unreleased
        placed.set()
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not released and not client._unreleased

    run(scenario())
