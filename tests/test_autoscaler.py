"""The autoscaler: its policy (cluster/autoscaling_policy.py) as a pure function of samples and an
injected clock — Ray Serve's numbers, the delays, the factors, Dynamo's signals, and hypothesis
properties (desired within [min, max], no change before the delay, monotone in load) — and its loop
(cluster/autoscaler.py) over an in-process backend: one change in flight per side, the idlest worker
drained, a failed start backed off, then given up for a cool-down and tried again (a start refused
for the cluster's state is no failure), workers added or removed by hand during a change, no delay
counted while the workers sleep, requests queued for admission counted as load, the state and the
desired-workers gauge."""

import asyncio
import time
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.admission import Admission
from cluster.autoscaler import Autoscaler, load_sample
from cluster.autoscaling_policy import SIGNALS, Decision, LoadSample, ScalingPolicy
from cluster.backend import WorkerNotAddedError
from cluster.config import AutoscalingConfig, ServerConfig
from cluster.http_server import BackgroundServer
from cluster.metrics import ServerMetrics
from cluster.openai_serving import GenerationService
from cluster.server import build_app
from tests.backend_stubs import StubBackend


def scaling(**fields) -> AutoscalingConfig:
    return AutoscalingConfig(**dict(dict(min_workers=1, max_workers=8, upscale_delay_s=0, downscale_delay_s=0),
                                    **fields))


def decide(config, current, *samples, now=10.0):
    policy = ScalingPolicy(config)
    for sample in samples:
        policy.record(sample)
    return policy.decide(now, current)


def test_ray_serves_numbers_smoothed_by_the_factors_and_clamped():
    # desired = ceil(current × average per worker / target): 2 workers holding 10 requests, 2 each wanted
    assert decide(scaling(), 2, LoadSample(9.0, ongoing_requests=10)).target == 5
    # the average over the look-back (30 s): samples of 4 and 12 requests ask for 4 workers
    assert decide(scaling(), 2, LoadSample(1.0, ongoing_requests=4), LoadSample(9.0, ongoing_requests=12)).target == 4
    # a sample older than the look-back counts no more
    assert decide(scaling(look_back_period_s=5), 2, LoadSample(1.0, ongoing_requests=40),
                  LoadSample(9.0, ongoing_requests=4)).target == 2
    # upscaling_factor 0.5: half of the way from 2 to 5, rounded up
    assert decide(scaling(upscaling_factor=0.5), 2, LoadSample(9.0, ongoing_requests=10)).target == 4
    # downscaling_factor 0.1 from 4 towards 0.5 rounds back to 4: one worker down all the same (Ray Serve's)
    assert decide(scaling(downscaling_factor=0.1), 4, LoadSample(9.0, ongoing_requests=1)).target == 3
    # clamped: no load keeps min_workers; a flood stops at max_workers
    assert decide(scaling(min_workers=2), 4, LoadSample(9.0)).target == 2
    assert decide(scaling(max_workers=3), 1, LoadSample(9.0, ongoing_requests=100)).target == 3
    # no sample in the look-back: the count holds
    assert decide(scaling(), 3).target == 3


def test_dynamos_signals_and_the_most_any_asks_for():
    # decode on KV usage: two workers at 0.9 each against 0.8 want 3 (2.25 rounded up)
    kv = decide(scaling(target_ongoing_requests=None, target_kv_usage=0.8), 2, LoadSample(9.0, kv_usage=1.8))
    assert kv.target == 3 and "kv_usage" in kv.reason
    # prefill on queued prompt tokens and waiting requests, beside ongoing requests: the largest ask wins
    sample = LoadSample(9.0, ongoing_requests=2, waiting_requests=3, queued_prefill_tokens=5000)
    both = decide(scaling(target_queued_prefill_tokens=1000, target_waiting_requests=1), 1, sample)
    assert both.target == 5 and both.reason.startswith("queued_prefill_tokens")
    assert decide(scaling(target_waiting_requests=1), 1, sample).target == 3


def test_a_change_waits_out_its_delay_and_a_turn_restarts_it():
    policy = ScalingPolicy(scaling(upscale_delay_s=5, downscale_delay_s=20, look_back_period_s=2))

    def step(t, current, requests):
        policy.record(LoadSample(t, ongoing_requests=requests))
        return policy.decide(t, current)

    busy = [step(t, 1, 6) for t in range(5)]
    assert [d.target for d in busy] == [1] * 5 and {d.desired for d in busy} == {3}
    assert step(5, 1, 6).target == 3
    # wanted down from t=10; wanted up again at t=20 (a burst), which restarts the downscale's 20 s
    assert [step(t, 3, 0).target for t in range(10, 20)] == [3] * 10
    assert step(20, 3, 30).desired > 3
    assert [step(t, 3, 0).target for t in range(22, 42)] == [3] * 20
    assert step(42, 3, 0).target == 1


def configs():
    return st.builds(
        lambda lo, span, delays, factors, targets: scaling(
            min_workers=lo, max_workers=lo + span, upscale_delay_s=delays[0], downscale_delay_s=delays[1],
            upscaling_factor=factors[0], downscaling_factor=factors[1], **targets),
        st.integers(1, 4), st.integers(0, 6), st.tuples(*[st.just(0.0) | st.floats(0.01, 20)] * 2),
        st.tuples(st.none() | st.floats(0.05, 3), st.none() | st.floats(0.05, 3)),
        st.fixed_dictionaries({"target_ongoing_requests": st.none() | st.floats(0.1, 4),
                               "target_waiting_requests": st.none() | st.floats(0.1, 4),
                               "target_queued_prefill_tokens": st.none() | st.integers(1, 4),
                               "target_kv_usage": st.none() | st.floats(0.1, 1)}).filter(
            lambda t: any(v is not None for v in t.values())))


def loads():
    value = st.floats(0, 50, allow_nan=False)
    return st.lists(st.tuples(*[value] * len(SIGNALS)), min_size=0, max_size=6)


def _policy(config, rows):
    policy = ScalingPolicy(config)
    for i, row in enumerate(rows):
        policy.record(LoadSample(float(i), *row))
    return policy


@settings(max_examples=150, deadline=None)
@given(configs(), loads(), st.integers(1, 12))
def test_desired_is_always_within_min_and_max(config, rows, current):
    decision = _policy(config, rows).decide(len(rows) + 0.5, current)
    assert config.min_workers <= decision.desired <= config.max_workers
    assert decision.target in (current, decision.desired)


@settings(max_examples=150, deadline=None)
@given(configs(), loads(), st.integers(1, 12), st.floats(0, 1))
def test_no_change_before_the_delay(config, rows, current, fraction):
    policy = _policy(config, rows)
    start = len(rows) + 0.5
    first = policy.decide(start, current)
    up = first.desired > current
    delay = config.upscale_delay_s if up else config.downscale_delay_s
    if first.desired == current or delay == 0:
        assert first.target == first.desired
        return
    assert first.target == current
    assert policy.decide(start + fraction * delay * 0.999, current).target == current
    assert policy.decide(start + delay, current).target == first.desired


@settings(max_examples=150, deadline=None)
@given(configs(), loads(), st.integers(1, 12), st.lists(st.floats(0, 30), min_size=len(SIGNALS),
                                                        max_size=len(SIGNALS)))
def test_desired_is_monotone_in_load(config, rows, current, extra):
    more = [tuple(v + e for v, e in zip(row, extra)) for row in rows]
    now = len(rows) + 0.5
    assert _policy(config, more).desired(now, current)[0] >= _policy(config, rows).desired(now, current)[0]


# --- the loop ---------------------------------------------------------------------------------------------
class ScaledBackend(StubBackend):
    """Decode workers in a list; ``starts`` gates add_worker (one future per start, set by the test)."""

    cluster = object()

    def __init__(self, loads):
        self.decode = [{"id": f"d-{i}", "role": "decode", "node": "n", "alive": True, "inflight": 0, "load": load}
                       for i, load in enumerate(loads)]
        self.starts, self.removed, self.refreshes = [], [], 0
        self.starting = {"decode": 0}  # (PDBackend's: the starts under way)
        self.drains = None  # a list: one future per drain, set by the test (None: a drain ends at once)

    def workers(self, include_dead=False):
        return list(self.decode)

    async def refresh_loads(self):
        self.refreshes += 1

    async def add_worker(self, role):
        started = asyncio.get_running_loop().create_future()
        self.starts.append(started)
        self.starting[role] += 1
        try:
            await started  # (raises what the test sets)
        finally:
            self.starting[role] -= 1
        worker = {"id": f"d-{len(self.decode)}", "role": role, "node": "n", "alive": True, "load": {}}
        self.decode.append(worker)
        return worker

    async def remove_worker(self, worker_id, drain_timeout_s=120.0):
        assert drain_timeout_s == 600.0  # the config's: a long generation is not cut by a scale-down
        next(w for w in self.decode if w["id"] == worker_id)["alive"] = False  # (out of the rotation at once)
        if self.drains is not None:
            drained = asyncio.get_running_loop().create_future()
            self.drains.append(drained)
            await drained
        self.decode = [w for w in self.decode if w["id"] != worker_id]
        self.removed.append(worker_id)


def run_loop(backend, config, script, service=None):
    """``script(autoscaler, clock)`` (a coroutine) with the decode side under ``config``; a list holds
    the clock's one value, moved by the script."""
    clock = [0.0]
    metrics = ServerMetrics("m")
    autoscaler = Autoscaler(backend, {"decode": config}, metrics, clock=lambda: clock[0], service=service)
    asyncio.run(script(autoscaler, clock))
    return autoscaler, metrics


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_change_in_flight_then_the_delay_again_and_the_idlest_drained():
    backend = ScaledBackend([{"num_requests": 3}, {"num_requests": 3}])
    config = scaling(target_ongoing_requests=1, upscale_delay_s=2, downscale_delay_s=4, max_workers=4)

    async def script(autoscaler, clock):
        backend.is_sleeping = True  # (memory released: nothing sampled, nothing decided)
        await autoscaler.tick()
        assert backend.refreshes == 0 and autoscaler.state()["decode"]["reason"] == "no decision yet"
        backend.is_sleeping = False
        await autoscaler.tick()
        assert not backend.starts  # wanted up (6 requests: 6 workers, 4 at most) for 0 s of 2
        clock[0] = 2.0
        await autoscaler.tick()
        await settle()
        assert len(backend.starts) == 1 and autoscaler.state()["decode"]["changing"]
        for t in (3.0, 4.0, 5.0):  # no decision while the change runs: one start at a time
            clock[0] = t
            await autoscaler.tick()
            await settle()
            assert len(backend.starts) == 1
        backend.starts[0].set_result(None)
        await settle()
        assert len(backend.starts) == 2  # the same change's second start
        backend.starts[1].set_result(None)
        await settle()
        state = autoscaler.state()["decode"]
        assert not state["changing"] and state["last_change"]["result"] == "done"
        assert (state["last_change"]["from"], state["last_change"]["to"]) == (2, 4)
        # the load goes; the new workers hold nothing, the old ones one request each: 2 wanted
        for worker in backend.decode:
            worker["load"] = {"num_requests": 1 if worker["id"] in ("d-0", "d-1") else 0, "kv_usage": 0.1}
        backend.decode[0]["load"]["kv_usage"] = 0.0
        clock[0] = 40.0  # (past the look-back of the busy samples)
        await autoscaler.tick()
        clock[0] = 44.0
        await autoscaler.tick()
        await settle()

    autoscaler, metrics = run_loop(backend, config, script)
    assert sorted(backend.removed) == ["d-2", "d-3"]  # the idle ones, not a worker holding a request
    assert [w["id"] for w in backend.decode] == ["d-0", "d-1"]
    assert metrics.registry.get_sample_value("raydix_autoscaler_desired_workers", {"role": "decode"}) == 2
    assert autoscaler.state()["decode"]["last_change"]["action"] == "down"


def test_a_failed_start_is_backed_off_then_given_up_while_downscaling_still_works():
    backend = ScaledBackend([{"num_requests": 5}])
    config = scaling(target_ongoing_requests=1, max_workers=3, start_retry_backoff_s=10, max_start_failures=2,
                     start_failure_cooldown_s=500)

    async def fail_next_start(autoscaler, at):
        await autoscaler.tick()
        await settle()
        assert backend.starts and not backend.starts[-1].done(), at
        backend.starts[-1].set_exception(RuntimeError("no node fits"))
        await settle()

    async def script(autoscaler, clock):
        await fail_next_start(autoscaler, 0)
        assert autoscaler.state()["decode"]["start_failures"] == 1
        clock[0] = 9.0
        await autoscaler.tick()
        await settle()
        assert len(backend.starts) == 1  # backing off: 10 s after the first failure
        assert "waits" in autoscaler.state()["decode"]["reason"]
        clock[0] = 10.0
        await fail_next_start(autoscaler, 10)
        for t in (30.0, 100.0, 400.0):  # 20 s after the second: given up for the cool-down (500 s)
            clock[0] = t
            backend.decode[0]["load"] = {"num_requests": 5}
            await autoscaler.tick()
            await settle()
        assert len(backend.starts) == 2
        state = autoscaler.state()["decode"]
        assert "stopped after 2 failed starts in a row, tried again in 110.0s" in state["reason"]
        assert "no node fits" in state["last_change"]["result"]
        backend.decode += [{"id": "d-9", "role": "decode", "alive": True, "load": {}}]  # (one added by hand)
        backend.decode[0]["load"] = {}
        clock[0] = 450.0
        await autoscaler.tick()
        await settle()

    run_loop(backend, config, script)
    assert backend.removed == ["d-9"]


def test_scaling_up_given_up_is_tried_again_after_the_cool_down_and_a_start_clears_the_count():
    backend = ScaledBackend([{"num_requests": 5}])
    config = scaling(target_ongoing_requests=1, max_workers=2, start_retry_backoff_s=10, max_start_failures=1,
                     start_failure_cooldown_s=100)

    async def tick_at(autoscaler, clock, t):
        clock[0] = t
        await autoscaler.tick()
        await settle()

    async def script(autoscaler, clock):
        await tick_at(autoscaler, clock, 0.0)
        backend.starts[0].set_exception(RuntimeError("no node fits"))
        await settle()
        for t in (10.0, 99.0):  # given up: not the backoff's 10 s, the cool-down's 100
            await tick_at(autoscaler, clock, t)
        assert len(backend.starts) == 1 and "tried again in 1.0s" in autoscaler.state()["decode"]["reason"]
        await tick_at(autoscaler, clock, 100.0)
        assert len(backend.starts) == 2  # one start again: it fails too, a cool-down more
        backend.starts[1].set_exception(RuntimeError("no node fits"))
        await settle()
        assert autoscaler.state()["decode"]["start_failures"] == 2
        await tick_at(autoscaler, clock, 199.0)
        assert len(backend.starts) == 2
        await tick_at(autoscaler, clock, 200.0)
        backend.starts[2].set_result(None)  # (the node came back)
        await settle()

    autoscaler, _ = run_loop(backend, config, script)
    state = autoscaler.state()["decode"]
    assert len(backend.decode) == 2 and state["start_failures"] == 0 and state["last_change"]["result"] == "done"


class ServedBackend(ScaledBackend):
    """A ScaledBackend the HTTP app serves: its start ends at once."""

    model_name, context_len, max_prompt_len, generate_stream = "m", 64, 63, None

    async def add_worker(self, role):
        self.decode.append({"id": f"d-{len(self.decode)}", "role": role, "node": "n", "alive": True, "load": {}})
        return self.decode[-1]


def test_a_worker_added_by_hand_clears_the_failed_starts_of_a_side_that_stopped_scaling_up():
    """An operator's POST /workers that starts a worker shows the node or quota came back: the side that stopped
    scaling up after failed starts starts the next at once, not after the rest of its cool-down."""
    backend = ServedBackend([{"num_requests": 0}])
    config = SimpleNamespace(server=ServerConfig(), prefill=SimpleNamespace(autoscaling=None),
                             decode=SimpleNamespace(autoscaling=scaling(max_start_failures=2)))
    app = build_app(backend, None, config)
    side = app.state.autoscaler.sides["decode"]
    with BackgroundServer(app, "127.0.0.1", 0) as server:
        for _ in range(2):
            side.start_failed(time.monotonic())
        up = Decision(current=2, desired=3, target=3, reason="load")
        assert "scaling up stopped after 2 failed starts" in side.hold_back(up, time.monotonic())
        assert httpx.post(server.url + "/workers", json={"role": "decode"}).status_code == 200
        assert side.hold_back(up, time.monotonic()) is None
        assert httpx.get(server.url + "/workers").json()["autoscaler"]["decode"]["start_failures"] == 0


@pytest.mark.parametrize("paused", [False, True])
def test_requests_queued_for_admission_count_as_load(paused):
    """One decode worker holding the one admitted request, four more waiting for a slot, or with generation
    paused (/pause_generation: they wait in the server until it continues, as /load counts them): 5 requests,
    1 each."""
    backend = ScaledBackend([{"num_requests": 1}])
    admission = Admission(max_concurrent=1 + paused * 4, max_queue_size=8, queue_timeout_s=60)
    service = GenerationService(backend, None, ServerMetrics("s"), admission)

    async def script(autoscaler, clock):
        await admission.acquire()
        if paused:
            service.resumed.clear()
        queued = [asyncio.ensure_future(service._admit(asyncio.Event())) for _ in range(4)]
        await settle()
        assert (service.num_paused, admission.waiting) == ((4, 0) if paused else (0, 4))
        await autoscaler.tick()
        await settle()
        for request in queued:
            request.cancel()
        for start in backend.starts:
            start.set_exception(RuntimeError("stopped"))
        await asyncio.wait(queued)

    autoscaler, _ = run_loop(backend, scaling(target_ongoing_requests=1), script, service)
    assert autoscaler.state()["decode"]["desired"] == 5
    # a prefill side's queue too (Dynamo's waiting requests); a decode side's waits for no batch of its own
    worker = [{"load": {"num_requests": 2, "waiting": 1}}]
    assert load_sample(0.0, "prefill", worker, queued=3)[1:3] == (5, 4)
    assert load_sample(0.0, "decode", worker, queued=3)[1:3] == (5, 1)


def test_only_sides_with_autoscaling_and_a_cluster_get_an_autoscaler():
    group = SimpleNamespace(autoscaling=None)
    config = SimpleNamespace(prefill=group, decode=SimpleNamespace(autoscaling=scaling()))
    assert set(Autoscaler.from_config(ScaledBackend([]), config).sides) == {"decode"}
    assert Autoscaler.from_config(StubBackend(), config) is None  # no cluster to start workers in
    assert Autoscaler.from_config(ScaledBackend([]), SimpleNamespace(prefill=group, decode=group)) is None
    assert Autoscaler.from_config(ScaledBackend([]), None) is None


@pytest.mark.parametrize("fields,error", [
    ({"min_workers": 3, "max_workers": 2}, r"decode.autoscaling.max_workers: must be >= min_workers \(3\)"),
    ({"target_ongoing_requests": None}, "decode.autoscaling: set at least one of target_ongoing_requests"),
    ({"target_kv_usage": 1.5}, "decode.autoscaling.target_kv_usage: Input should be less than or equal to 1"),
    ({"min_workers": 2, "max_workers": 4}, r"decode.num_workers: 1 is outside decode.autoscaling's "
                                           r"\[min_workers, max_workers\] = \[2, 4\]"),
])
def test_config_errors_name_the_field(fields, error):
    from cluster.config import ConfigError, parse_config

    data = {"model": {"builtin": "llama"}, "prefill": {}, "decode": {"autoscaling": fields}}
    with pytest.raises(ConfigError, match=error):
        parse_config(data)
    defaults = parse_config({**data, "decode": {"autoscaling": {}}}).decode.autoscaling
    assert (defaults.target_ongoing_requests, defaults.upscale_delay_s, defaults.downscale_delay_s,
            defaults.look_back_period_s, defaults.max_workers) == (2.0, 30.0, 600.0, 30.0, 1)  # Ray Serve's


def test_workers_added_or_removed_by_hand_during_a_change_count():
    # a scale-up to max_workers (3) while a worker is added by hand (POST /workers): one start, not two
    backend = ScaledBackend([{"num_requests": 5}])

    async def up(autoscaler, clock):
        await autoscaler.tick()
        await settle()
        backend.decode.append({"id": "d-9", "role": "decode", "alive": True, "load": {}})
        backend.starts[0].set_result(None)
        await settle()

    run_loop(backend, scaling(target_ongoing_requests=1, max_workers=3), up)
    assert len(backend.starts) == 1 and len(backend.decode) == 3
    # a scale-down to min_workers (1) while one is removed by hand (DELETE /workers/{id}): one drain, not two
    backend = ScaledBackend([{}, {}, {}])
    backend.drains = []

    async def down(autoscaler, clock):
        await autoscaler.tick()
        await settle()
        backend.decode = [w for w in backend.decode if w["id"] != "d-0"]
        backend.drains[0].set_result(None)
        await settle()

    autoscaler, _ = run_loop(backend, scaling(), down)
    assert len(backend.drains) == 1 and backend.removed == ["d-2"] and [w["id"] for w in backend.decode] == ["d-1"]
    assert autoscaler.state()["decode"]["last_change"]["result"] == "done"


def test_a_worker_starting_by_hand_counts():
    # POST /workers starting one (not live yet) as the load asks for max_workers (3): one more start, not two
    backend = ScaledBackend([{"num_requests": 5}])

    async def script(autoscaler, clock):
        by_hand = asyncio.ensure_future(backend.add_worker("decode"))
        await settle()
        await autoscaler.tick()
        await settle()
        assert autoscaler.state()["decode"]["current"] == 2
        backend.starts[1].set_result(None)
        await settle()
        assert len(backend.starts) == 2  # the scale-up's one start, done: the side is at 3 with the one starting
        backend.starts[0].set_result(None)
        await by_hand

    autoscaler, _ = run_loop(backend, scaling(target_ongoing_requests=1, max_workers=3), script)
    assert len(backend.decode) == 3 and autoscaler.state()["decode"]["last_change"]["result"] == "done"


def test_a_start_held_back_by_the_backoff_goes_once_it_ends_its_delay_waited_out():
    backend = ScaledBackend([{"num_requests": 5}])
    config = scaling(target_ongoing_requests=1, max_workers=2, upscale_delay_s=5, start_retry_backoff_s=10)

    async def script(autoscaler, clock):
        await autoscaler.tick()
        clock[0] = 5.0
        await autoscaler.tick()  # (wanted up since 0 s: the delay waited out)
        await settle()
        backend.starts[0].set_exception(RuntimeError("no node fits"))
        await settle()
        for t in range(6, 16):  # more wanted since 6 s (after the failure), held back until 15 s
            clock[0] = float(t)
            await autoscaler.tick()
            await settle()
            assert len(backend.starts) == (2 if t == 15 else 1), t

    run_loop(backend, config, script)


def test_a_start_the_clusters_state_refuses_is_no_failed_start():
    # (a release or an update from tensors overtook it: a trainer's cycle is not a bad node, never given up)
    backend = ScaledBackend([{"num_requests": 5}])
    config = scaling(target_ongoing_requests=1, max_workers=2, start_retry_backoff_s=10, max_start_failures=1)

    async def script(autoscaler, clock):
        await autoscaler.tick()
        await settle()
        backend.starts[0].set_exception(WorkerNotAddedError("the workers are sleeping", "sleeping"))
        await settle()
        state = autoscaler.state()["decode"]
        assert state["start_failures"] == 0 and state["last_change"]["result"] == "refused: the workers are sleeping"
        clock[0] = 1.0
        await autoscaler.tick()
        await settle()
        assert len(backend.starts) == 2

    run_loop(backend, config, script)


def test_the_time_the_workers_sleep_counts_for_no_delay():
    # (an RL loop: the rollouts end, the workers sleep while the trainer runs, wake for the next rollouts)
    backend = ScaledBackend([{}, {}])
    config = scaling(target_ongoing_requests=1, downscale_delay_s=10)

    async def script(autoscaler, clock):
        await autoscaler.tick()  # one worker wanted from 0 s
        backend.is_sleeping = True
        for t in (1.0, 500.0):
            clock[0] = t
            await autoscaler.tick()
        backend.is_sleeping = False
        for t in (501.0, 510.0, 511.0):  # awake: 10 s of loads sampled before one drains
            clock[0] = t
            await autoscaler.tick()
            await settle()
            assert backend.removed == ([] if t < 511 else ["d-1"]), t

    run_loop(backend, config, script)
