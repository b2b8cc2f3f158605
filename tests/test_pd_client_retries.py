"""PDClient retries (in-process, no Ray, no model): a request whose prefill or decode worker
died or was unavailable before its first output goes to a new pair, its route released and
made anew, its first attempt ended on the workers; nothing else is retried."""

import asyncio
from typing import Any, Dict, List, Optional

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from actors.pd_scheduler import PDRequestError, WorkerBrokenError
from actors.router import NoWorkerError, Router
from actors.routing_policies import RouterSettings
from cluster.pd_client import PDClient, WorkerRef
from tests.router_helpers import FakeDecode, FakePrefill

PS = 4
PARAMS = {"max_new_tokens": 3}


class Faults:
    """What the next calls of a method raise, whichever worker takes them (the first worker the
    router picks fails, wherever its policy sends the request)."""

    def __init__(self, **queued):
        self.queued: Dict[str, List[Any]] = {m: list(e) for m, e in queued.items()}
        self.hit: List["Worker"] = []  # the workers whose calls failed, in order

    def take(self, method: str):
        queue = self.queued.get(method)
        return queue.pop(0) if queue else None


class Worker:
    """A prefill or decode worker behind a Ray-like handle; records its calls as (method, rid, room)."""

    def __init__(self, worker_id: str, role: str, faults: Faults, tokens: int = 3):
        self.worker_id, self.role, self.faults, self.tokens = worker_id, role, faults, tokens
        self.calls: List[tuple] = []
        self.priorities: List[int] = []  # what each reserve or prefill call was given
        self.lora_paths: List[Optional[str]] = []  # ... and the adapter each was given
        self.mm_inputs: List[Any] = []  # ... and the images

    def _fail(self, method: str) -> None:
        fault = self.faults.take(method)
        if callable(fault) and not isinstance(fault, type):
            fault = fault(self)
        if fault is not None:
            self.faults.hit.append(self)
            raise fault

    async def reserve(self, rid, input_ids, params, backend, room, priority=0, lora_path=None, mm_inputs=None):
        self.calls.append(("reserve", rid, room))
        self.priorities.append(priority)
        self.lora_paths.append(lora_path)
        self.mm_inputs.append(mm_inputs)
        self._fail("reserve")
        return [room]  # (a real hand-off carries its room to the prefill side)

    async def prefill(self, rid, input_ids, params, handoffs, priority=0, lora_path=None, mm_inputs=None):
        self.calls.append(("prefill", rid, handoffs[0]))
        self.priorities.append(priority)
        self.lora_paths.append(lora_path)
        self.mm_inputs.append(mm_inputs)
        self._fail("prefill")
        return {"room": handoffs[0], "cached_tokens": 0, "prefill_latency": 0.0}

    async def prefill_only(self, rid, input_ids, params, room, priority=0, lora_path=None, mm_inputs=None):
        self.calls.append(("prefill_only", rid, room))
        self.priorities.append(priority)
        self._fail("prefill_only")
        return {"output_ids": [], "meta_info": {"cached_tokens": 4, "e2e_latency": 0.1,
                                                "finish_reason": {"type": "length", "length": 0}}}

    async def stream(self, rid, notice):
        self.calls.append(("stream", rid, notice["room"]))
        for i in range(self.tokens):
            self._fail(f"stream{i}")
            last = i == self.tokens - 1
            yield {"output_ids": list(range(i + 1)), "meta_info": {
                "cached_tokens": 0, "finish_reason": {"type": "length"} if last else None}}

    async def abort(self, rid, message, *rest):
        self.calls.append(("abort", rid, rest[-1], rest[0] if self.role == "decode" else None))
        fault = self.faults.take(f"{self.role}_abort")  # (an abort that fails ends no attempt)
        if fault is not None:
            raise fault

    async def load(self):
        return {"waiting": 0, "running": 0}

    def rooms(self, method: str) -> List[int]:
        return [c[2] for c in self.calls if c[0] == method]


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))

    def options(self, **_):
        fn = self.fn

        class Streaming:
            @staticmethod
            def remote(*args):
                async def refs():
                    outs = fn(*args)
                    while True:  # each ref raises what the generator raised, as Ray's do
                        ref = asyncio.ensure_future(outs.__anext__())
                        try:
                            await ref
                        except StopAsyncIteration:
                            return
                        except BaseException:
                            yield ref
                            return
                        yield ref
                return refs()
        return Streaming()


class _Handle:
    def __init__(self, worker: Worker):
        self._worker = worker

    def __getattr__(self, name):
        return _Method(getattr(self._worker, name))


def cluster(num_prefill: int, num_decode: int, faults: Faults, with_router: bool = True, **client_args):
    """(client, router, prefill workers, decode workers): the client routed by a real Router."""
    prefill = [Worker(f"p{i}", "prefill", faults) for i in range(num_prefill)]
    decode = [Worker(f"d{i}", "decode", faults) for i in range(num_decode)]
    router = None
    if with_router:
        router = Router(RouterSettings(page_size=PS))
        stand_ins = [FakePrefill(w.worker_id, PS) for w in prefill] + [FakeDecode(w.worker_id, PS) for w in decode]

        async def add():
            for w in stand_ins:
                await router.add_worker(w.worker_id, w.role, w)

        asyncio.run(add())
    refs = [WorkerRef(w.worker_id, w.role, _Handle(w), "n") for w in prefill + decode]
    client = PDClient(refs[:num_prefill], refs[num_prefill:], router=router, retry_backoff_s=0.001, **client_args)
    return client, router, prefill, decode


async def collect(client: PDClient, rid: str = "r", outs: Optional[list] = None, priority: int = 0,
                  params: Dict[str, Any] = PARAMS, lora_path: Optional[str] = None, mm_inputs=None) -> list:
    outs = [] if outs is None else outs
    async for out in client.generate_stream([1, 2, 3, 4, 5, 6, 7, 8, 9], params, rid, priority, lora_path, mm_inputs):
        outs.append(out)
    return outs


def assert_clean(client: PDClient, router: Optional[Router]) -> None:
    assert not client._live_rids and client.inflight == 0
    assert all(w.inflight == 0 for w in client.prefill + client.decode)
    if router is not None:  # every attempt's route released, none counted as load
        assert not router._requests and all(w.inflight == 0 for w in router.workers.values())


@pytest.mark.parametrize("fault", ["prefill died", "prefill unavailable", "decode died at reserve",
                                   "decode unavailable before its first token"])
@pytest.mark.parametrize("with_router", [True, False], ids=["router", "round_robin"])
def test_a_request_whose_worker_was_lost_before_its_first_output_goes_to_a_new_pair(fault, with_router):
    method, exc = {"prefill died": ("prefill", ActorDiedError()),
                   "prefill unavailable": ("prefill", ActorUnavailableError("blip", None)),
                   "decode died at reserve": ("reserve", ActorDiedError()),
                   "decode unavailable before its first token": ("stream0", ActorUnavailableError("blip", None)),
                   }[fault]
    faults = Faults(**{method: [exc]})
    if fault == "prefill unavailable":  # its abort does not get through either
        faults.queued["prefill_abort"] = [ActorUnavailableError("blip", None)]
    client, router, prefill, decode = cluster(2, 2, faults, with_router)
    outs = asyncio.run(collect(client))
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3]  # the whole answer, once, from the second pair
    assert client.num_retries == 1
    [lost] = faults.hit
    role = lost.role
    assert outs[-1]["meta_info"][f"{role}_worker"] != lost.worker_id
    ref = next(r for r in client.prefill + client.decode if r.worker_id == lost.worker_id)
    assert ref.dead == isinstance(exc, ActorDiedError)  # one only unavailable is left to heartbeats
    reserves = [(w.worker_id, room) for w in decode for room in w.rooms("reserve")]
    assert len(reserves) == 2 and reserves[0][1] != reserves[1][1]  # a fresh room for the retry
    first_room = reserves[0][1]
    first_decode = next(w for w in decode if first_room in w.rooms("reserve"))
    if role == "prefill":  # the first attempt's reservation was ended (by its room) before the retry
        aborts = [c for c in first_decode.calls if c[0] == "abort"]
        assert aborts and aborts[0][2] == first_room
        # a dead prefill writes nothing: freed at once; one unavailable may still push: quarantined
        assert aborts[0][3] is isinstance(exc, ActorDiedError)
    assert_clean(client, router)


@pytest.mark.parametrize("decode_abort", ["died", "timed out"])
def test_a_push_that_failed_because_its_decode_worker_died_goes_to_a_new_pair(decode_abort):
    """The decode worker died while the prefill pushed to it: the prefill call fails with a
    transfer error, not a worker death; the decode side found dead when it is told to abort
    makes it one (retried). A decode worker alive but slow to answer leaves the error as is."""
    abort_error = ActorDiedError() if decode_abort == "died" else asyncio.TimeoutError()
    faults = Faults(prefill=[PDRequestError("the KV transfer of r failed: connection reset")],
                    decode_abort=[abort_error])
    client, router, prefill, decode = cluster(2, 2, faults)
    if decode_abort == "timed out":
        with pytest.raises(PDRequestError, match="connection reset"):
            asyncio.run(collect(client))
        assert client.num_retries == 0 and not any(w.dead for w in client.decode)
    else:
        outs = asyncio.run(collect(client))
        assert [len(o["output_ids"]) for o in outs] == [1, 2, 3] and client.num_retries == 1
        dead = [w.worker_id for w in client.decode if w.dead]
        assert len(dead) == 1 and outs[-1]["meta_info"]["decode_worker"] != dead[0]
    assert_clean(client, router)


def test_the_retry_on_the_same_decode_worker_follows_the_end_of_the_first_attempt():
    """One decode worker, the prefill died: the retry reserves there again under the same id,
    only after the first attempt's reservation (its room) was aborted."""
    client, router, prefill, decode = cluster(2, 1, Faults(prefill=[ActorDiedError()]))
    outs = asyncio.run(collect(client, rid="same"))
    assert outs[-1]["meta_info"]["finish_reason"] is not None
    kinds = [(c[0], c[2]) for c in decode[0].calls]
    first, second = decode[0].rooms("reserve")
    assert kinds[:3] == [("reserve", first), ("abort", first), ("reserve", second)], kinds
    assert {c[1] for c in decode[0].calls} == {"same"}
    assert_clean(client, router)


@pytest.mark.parametrize("case", ["after the first output", "timeout", "bad input", "max_retries 0",
                                  "no other worker", "draining", "retries exhausted"])
def test_what_is_not_retried(case):
    num_prefill, args, faults = 2, {}, None
    if case == "after the first output":  # tokens already streamed: a retry would repeat them
        faults = Faults(stream1=[ActorDiedError()])
    elif case == "timeout":  # the wait was long already: a retry would double it
        async def hang(*_):
            await asyncio.sleep(10)
        faults, args = Faults(), {"waiting_timeout_s": 0.05}
    elif case == "bad input":
        faults = Faults(reserve=[ValueError("the prompt is empty")])
    elif case == "max_retries 0":
        faults, args = Faults(prefill=[ActorDiedError()]), {"max_retries": 0}
    elif case == "no other worker":
        faults, num_prefill = Faults(prefill=[ActorDiedError()]), 1
    elif case == "draining":
        client_box = []

        def drain_then_die(worker):
            client_box[0].draining = True
            return ActorDiedError()
        faults = Faults(prefill=[drain_then_die])
    else:  # every prefill worker dies in turn: two retries, then the error stands
        faults, num_prefill = Faults(prefill=[ActorDiedError()] * 3), 3
    client, router, prefill, decode = cluster(num_prefill, 2, faults, **args)
    if case == "timeout":
        for w in prefill:
            w.prefill = hang
    if case == "draining":
        client_box.append(client)
    outs: list = []
    error = ValueError if case == "bad input" else PDRequestError
    with pytest.raises(error):
        asyncio.run(collect(client, outs=outs))
    attempts = sum(len(w.rooms("reserve")) for w in decode)
    assert (attempts, client.num_retries) == ((3, 2) if case == "retries exhausted" else (1, 0))
    assert len(outs) == (1 if case == "after the first output" else 0)
    assert_clean(client, router)


def test_the_router_never_routes_a_retry_to_an_excluded_worker():
    router = Router(RouterSettings(page_size=PS))
    workers = [FakePrefill("p0", PS), FakePrefill("p1", PS), FakeDecode("d0", PS)]

    async def go():
        for w in workers:
            await router.add_worker(w.worker_id, w.role, w)
        for i in range(4):
            decision = await router.route(f"r{i}", list(range(16)), None, ["p0"])
            assert decision.prefill_id == "p1"
            await router.release(f"r{i}")
        with pytest.raises(NoWorkerError, match="no live decode"):
            await router.route("x", list(range(16)), None, ["d0"])

    asyncio.run(go())


def test_retries_are_counted_in_the_metrics():
    from prometheus_client import generate_latest

    from cluster.backend import PDBackend
    from cluster.metrics import ServerMetrics

    client, router, _, _ = cluster(2, 1, Faults(prefill=[ActorDiedError()]))
    asyncio.run(collect(client))
    metrics = ServerMetrics("m")
    metrics.set_retries(PDBackend(client).num_retries)
    assert "raydix_request_retries_total 1.0" in generate_latest(metrics.registry).decode()


class LosingRouter:
    """A real Router whose first ``lost`` releases fail without reaching it: each raises (the
    router actor was unavailable) or hangs past the client's router timeout."""

    def __init__(self, router: Router, lost: int, how: str):
        self.router, self.lost, self.how = router, lost, how

    async def route(self, *args):
        return await self.router.route(*args)

    async def release(self, *args):
        if self.lost:
            self.lost -= 1
            if self.how == "raised":
                raise ActorUnavailableError("router blip", None)
            await asyncio.sleep(10)
        await self.router.release(*args)


def test_a_retried_request_keeps_its_priority_adapter_and_images_on_both_sides():
    """``priority``, ``lora_path`` and ``mm_inputs`` (an image request's) reach the decode reservation and
    the prefill of every attempt (the retry after a lost prefill worker queues as the first attempt did),
    and the router matches the prompt's prefix under the adapter (its ``extra_key``) on each."""
    client, router, prefill, decode = cluster(2, 2, Faults(prefill=[ActorDiedError()]))
    route, extra_keys = router.route, []

    def recording(rid, input_ids, extra_key=None, *rest):
        extra_keys.append(extra_key)
        return route(rid, input_ids, extra_key, *rest)

    router.route = recording
    images = object()  # (a request's MultimodalInputs: passed as they are)
    outs = asyncio.run(collect(client, priority=7, lora_path="sql", mm_inputs=images))
    assert len(outs[-1]["output_ids"]) == 3 and client.num_retries == 1
    given = [p for w in prefill + decode for p in w.priorities]
    assert len(given) == 4 and set(given) == {7}  # two reservations, two prefills
    assert [a for w in prefill + decode for a in w.lora_paths] == ["sql"] * 4 and extra_keys == ["sql", "sql"]
    assert [m for w in prefill + decode for m in w.mm_inputs] == [images] * 4
    assert_clean(client, router)


@pytest.mark.parametrize("how", ["raised", "timed out"])
def test_a_retry_whose_first_route_release_was_lost_still_goes_ahead(how):
    """The release of the first attempt's route never reached the router: the retry is routed
    all the same (not refused as 'already routed'), and that stale route stops counting as load."""
    client, router, prefill, decode = cluster(2, 2, Faults(prefill=[ActorDiedError()]), router_timeout_s=0.5)
    client.router = LosingRouter(router, 1, how)
    outs = asyncio.run(collect(client))
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3] and client.num_retries == 1
    assert_clean(client, router)


def test_a_late_release_of_an_earlier_attempt_leaves_the_retry_routed():
    """Routes are keyed by request id and attempt: the first attempt's release that arrives
    after the retry was routed ends nothing of the retry's route."""
    router = Router(RouterSettings(page_size=PS))
    workers = [FakePrefill("p0", PS), FakePrefill("p1", PS), FakeDecode("d0", PS)]

    async def go():
        for w in workers:
            await router.add_worker(w.worker_id, w.role, w)
        first = await router.route("r", list(range(16)))
        with pytest.raises(ValueError, match="already routed"):  # the same attempt twice: a duplicate id
            await router.route("r", list(range(16)))
        retry = await router.route("r", list(range(16)), None, [first.prefill_id], 1)
        load = {w.worker_id: w.inflight for w in router.workers.values()}
        assert load == {first.prefill_id: 0, retry.prefill_id: 1, "d0": 1}  # the first route stopped counting
        await router.release("r", None, 0)  # the first attempt's release, late
        assert {w.worker_id: w.inflight for w in router.workers.values()} == load
        await router.release("r", "prefill", 1)
        await router.release("r", None, 1)
        assert not router._requests and all(w.inflight == 0 for w in router.workers.values())

    asyncio.run(go())


def test_a_client_gone_while_the_lost_prefill_is_stopped_still_ends_the_decode_reservation():
    """The prefill worker was unavailable and does not answer its abort either; the client leaves
    meanwhile. The decode side is told all the same (by the attempt's room, quarantined: that
    prefill may still push) instead of holding the slots until its own waiting timeout."""
    client, router, prefill, decode = cluster(2, 2, Faults(prefill=[ActorUnavailableError("blip", None)]))
    stopping = asyncio.Event()

    async def unanswered(*_):
        stopping.set()
        await asyncio.sleep(10)

    for w in prefill:
        w.abort = unanswered

    async def go():
        request = asyncio.ensure_future(collect(client))
        await stopping.wait()
        request.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.sleep(0)  # (what was sent without waiting arrives)

    asyncio.run(go())
    [reserved] = [w for w in decode if w.rooms("reserve")]
    assert [c for c in reserved.calls if c[0] == "abort"] == [("abort", "r", reserved.rooms("reserve")[0], False)]
    assert client.num_retries == 0
    assert_clean(client, router)


class RecordingRouter:
    """A real Router whose decisions and releases are recorded."""

    def __init__(self, router: Router):
        self.router, self.decisions, self.releases = router, [], []

    async def route(self, *args):
        decision = await self.router.route(*args)
        self.decisions.append(decision)
        return decision

    async def release(self, *args):
        self.releases.append(args)
        await self.router.release(*args)


def test_each_attempt_uses_the_room_its_route_names():
    """The workers report the rooms of the requests they hold and the router judges a route
    whose release was lost by its room: the client reserves each attempt under its route's room
    and names it in that attempt's releases."""
    client, router, prefill, decode = cluster(2, 2, Faults(prefill=[ActorDiedError()]))
    client.router = recording = RecordingRouter(router)
    asyncio.run(collect(client))
    rooms = [d.room for d in recording.decisions]
    assert len(rooms) == 2 and rooms[0] != rooms[1]
    assert [room for w in decode for room in w.rooms("reserve")] in (rooms, rooms[::-1])
    assert {args[-1] for args in recording.releases} == set(rooms)  # every release names its route's room
    assert_clean(client, router)


def _broken(worker_id: str, how: str) -> BaseException:
    error = WorkerBrokenError(f"{worker_id} is broken: the KV transfer lane raydix-kv-push-0-0 is broken: gone")
    return RayTaskError("prefill", "tb", error).as_instanceof_cause() if how == "ray" else error


@pytest.mark.parametrize("how", ["ray", "in-process"])
@pytest.mark.parametrize("method", ["prefill", "reserve"])
def test_a_request_that_hits_a_broken_worker_goes_to_a_new_pair(method, how):
    """A worker that reports itself broken (its push lane or a TP rank gone) before the heartbeat
    takes it out of the rotation: the request goes to a new pair, as when the actor died, and the
    broken worker leaves the client's rotation at once; a broken prefill is still told to abort
    (its process lives), so the first reservation goes back only once that is confirmed."""
    faults = Faults(**{method: [lambda worker: _broken(worker.worker_id, how)]})
    client, router, prefill, decode = cluster(2, 2, faults)
    outs = asyncio.run(collect(client))
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3] and client.num_retries == 1
    [broken] = faults.hit
    assert outs[-1]["meta_info"][f"{broken.role}_worker"] != broken.worker_id
    ref = next(r for r in client.prefill + client.decode if r.worker_id == broken.worker_id)
    assert not ref.alive and not ref.dead  # out of the rotation; the heartbeat finds it broken
    if method == "prefill":
        assert [c[0] for c in broken.calls] == ["prefill", "abort"]
        first_decode = next(w for w in decode if w.calls and w.calls[0][0] == "reserve")
        assert [c for c in first_decode.calls if c[0] == "abort"][0][3] is True  # confirmed stopped: freed
    assert_clean(client, router)


@pytest.mark.parametrize("method", ["prefill", "reserve"])
def test_a_heartbeat_that_finds_a_worker_broken_ends_the_calls_waiting_on_it(method):
    """A worker whose TP group lost a rank mid-call answers nothing more: the request would hold
    its other side until its timeout. The heartbeat that finds it broken ends the call at once,
    as a lost worker's: the broken prefill is still told to abort (its process lives: it is not
    taken for dead) before the decode reservation goes back, and the request goes to a new pair."""
    client, router, prefill, decode = cluster(2, 2, Faults())
    wedged: List[Worker] = []
    for worker in prefill if method == "prefill" else decode:
        def wedge(original, worker=worker):
            async def call(*args):
                result = await original(*args)
                if not wedged:
                    wedged.append(worker)
                    await asyncio.Event().wait()  # no answer comes
                return result
            return call
        setattr(worker, method, wedge(getattr(worker, method)))

    async def go():
        request = asyncio.ensure_future(collect(client))
        while not wedged:
            await asyncio.sleep(0.001)
        [broken] = wedged

        async def broken_load():
            raise _broken(broken.worker_id, "ray")

        broken.load = broken_load
        await client.heartbeat_once()
        return broken, await asyncio.wait_for(request, 5.0)

    broken, outs = asyncio.run(go())
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3] and client.num_retries == 1
    assert outs[-1]["meta_info"][f"{broken.role}_worker"] != broken.worker_id
    ref = next(r for r in client.prefill + client.decode if r.worker_id == broken.worker_id)
    assert not ref.alive and not ref.dead
    assert [c[0] for c in broken.calls] == [method, "abort"]
    if method == "prefill":  # confirmed stopped: the first reservation is freed at once
        first_decode = next(w for w in decode if w.calls and w.calls[0][0] == "reserve")
        assert [c for c in first_decode.calls if c[0] == "abort"][0][3] is True
    assert_clean(client, router)


def test_a_broken_prefill_worker_refuses_prefills_and_fails_a_push_lost_to_its_lane_as_broken():
    """Its push lane broke (or a TP rank went): a new prefill is refused, and one whose push
    failed on the broken lane fails as the worker's fault (``WorkerBrokenError``), not as a plain
    request error the client would not retry."""
    from types import SimpleNamespace

    from actors.workers import PrefillWorker

    lane_error = "the KV transfer lane raydix-kv-push-0-0 is broken: gone"
    pusher, submitted = SimpleNamespace(broken=lane_error), []
    worker = object.__new__(PrefillWorker)
    worker.worker_id, worker.broken, worker.draining, worker._cancelled = "p0", None, False, {}
    worker.tp_worker, worker.rank = SimpleNamespace(broken=None), SimpleNamespace(pusher=pusher)

    def submit(req):  # the lane breaks under this request's push
        submitted.append(req)
        pusher.broken = lane_error
        queue = asyncio.Queue()
        queue.put_nowait((None, True, PDRequestError(lane_error)))
        return queue

    made = SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=1))
    worker._make_req, worker._submit = (lambda *args: made), submit
    with pytest.raises(WorkerBrokenError, match="lane raydix-kv-push-0-0 is broken"):
        asyncio.run(worker.prefill("r", [1, 2, 3], None, []))
    assert not submitted
    pusher.broken = None
    with pytest.raises(WorkerBrokenError, match="p0 is broken: the KV transfer lane"):
        asyncio.run(worker.prefill("r", [1, 2, 3], None, []))
    assert len(submitted) == 1


SCORED = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}


@pytest.mark.parametrize("with_router", [True, False], ids=["router", "round_robin"])
def test_a_prompt_scored_only_goes_to_a_prefill_worker_alone(with_router):
    """``max_new_tokens`` 0: one call per attempt, to a prefill worker, under the attempt's room;
    no decode worker is picked, called, loaded or indexed, so none need be live. One whose prefill
    worker died is retried on another; every route is released."""
    faults = Faults(prefill_only=[ActorDiedError()])
    client, router, prefill, decode = cluster(2, 1, faults, with_router)
    if with_router:
        client.router = recording = RecordingRouter(router)
    client.decode[0].alive = False  # (out of the rotation: nothing here needs it)
    [out] = asyncio.run(collect(client, params=SCORED, priority=3))
    [lost] = faults.hit
    meta = out["meta_info"]
    assert meta["prefill_worker"] != lost.worker_id
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    assert client.num_retries == 1 and decode[0].calls == []
    assert meta["decode_worker"] is None and meta["decode_cached_tokens"] == 0 and meta["transfer_bytes"] == 0
    assert meta["prefill_cached_tokens"] == meta["cached_tokens"] == 4 and meta["ttft_pd"] == 0.1
    rooms = [room for w in prefill for room in w.rooms("prefill_only")]
    assert len(rooms) == 2 and rooms[0] != rooms[1] and {p for w in prefill for p in w.priorities} == {3}
    assert not any(c[0] == "abort" for w in prefill for c in w.calls)  # (a dead worker holds nothing)
    if with_router:
        assert [d.room for d in recording.decisions] in (rooms, rooms[::-1])
        assert all(d.decode_id is None for d in recording.decisions)
        d0 = router.workers["d0"]
        stats = router.stats()
        assert (d0.inflight, d0.dispatched_tokens) == (0, 0)
        assert (stats["routed"], stats["prefill_only"], stats["prefill_only_tokens"]) == (2, 2, 18)
        assert stats["approx_entries"] == 2 * (9 // PS)  # each attempt's prefill worker's pages, none d0's
    assert_clean(client, router)


@pytest.mark.parametrize("how", ["timed out", "cancelled"])
def test_a_prompt_scored_only_that_never_answers_is_aborted_on_its_prefill_worker(how):
    """Its call timed out (not retried) or its caller went away: the prefill worker is told to
    abort that attempt (its room), the decode worker is never called, the route is released."""
    client, router, prefill, decode = cluster(1, 1, Faults(), waiting_timeout_s=0.2 if how == "timed out" else 30)
    called = asyncio.Event()

    async def hang(rid, input_ids, params, room, priority=0, lora_path=None, mm_inputs=None):
        prefill[0].calls.append(("prefill_only", rid, room))
        called.set()
        await asyncio.sleep(10)

    prefill[0].prefill_only = hang

    async def go():
        request = asyncio.ensure_future(collect(client, params=SCORED))
        if how == "cancelled":
            await asyncio.wait_for(called.wait(), 10)
            request.cancel()
        with pytest.raises(PDRequestError if how == "timed out" else asyncio.CancelledError):
            await request

    asyncio.run(go())
    [room] = prefill[0].rooms("prefill_only")
    assert prefill[0].calls == [("prefill_only", "r", room), ("abort", "r", room, None)]
    assert decode[0].calls == [] and client.num_retries == 0
    assert_clean(client, router)
