"""KVPusher's transfer threads, in one process over the fake backend (no workers)."""

import threading
import time

import pytest

from actors.kv_push import KVPusher, PushChunk
from tests.transfer_helpers import RankSpec, build_pool
from transfer import KVReceiver, create_agent


class ThreadKilled(BaseException):
    """What a backend may let escape a push that is not an Exception (SystemExit, CancelledError)."""


def _collect(pusher, want, timeout_s=30.0):
    """The results of ``want`` pushes (fewer after ``timeout_s``: only a hang guard)."""
    results = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < want and time.monotonic() < deadline:
        results.update((r.push_id, r) for r in pusher.take_finished())
        time.sleep(0.002)
    return results


def test_a_lane_whose_thread_died_is_restarted_and_its_open_requests_fail():
    """A push raises a BaseException: the lane's transfer thread ends. That push must report
    its failure (it reported success: only Exceptions set the error), the request queued
    behind it on the lane must fail with what killed the thread, and a later request must be
    pushed by a new thread (the dead one was never replaced: every later push on the lane
    waited for good)."""
    _, layout, tensors, _ = build_pool(RankSpec())
    prefill, decode = create_agent("fake", layout, tensors), create_agent("fake", layout, tensors)
    pushed = []

    def push(handoff, src_slots, *rest, **kw):
        if handoff.rid == "dies":
            raise ThreadKilled("the backend's event loop went away")
        pushed.append(handoff.rid)
        return 8

    prefill.push = push
    name = "test-dead-lane"
    pusher = KVPusher({"fake": prefill}, name=name, num_lanes=1)

    def handoffs(rid, slots):
        return [KVReceiver(decode, rid, 1).send_metadata(slots).to_bytes()]

    pusher.submit([PushChunk("dies#1", 0, [1], True, handoffs=handoffs("dies", [3]), dest="d"),
                   PushChunk("behind#1", 0, [2], False, handoffs=handoffs("behind", [4, 5]), dest="d")])
    deadline = time.monotonic() + 5
    while any(t.name.startswith(name) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.002)
    pusher.submit([PushChunk("behind#1", 1, [6], True, dest="d"),
                   PushChunk("after#1", 0, [7, 8], True, handoffs=handoffs("after", [9, 10]), dest="d")])
    results = _collect(pusher, 3)
    pusher.close()
    assert set(results) == {"dies#1", "behind#1", "after#1"}, results
    assert "ThreadKilled: the backend's event loop went away" in (results["dies#1"].error or ""), results
    assert f"transfer thread {name}-0 died (ThreadKilled" in (results["behind#1"].error or ""), results
    assert (results["after#1"].error, results["after#1"].moved, pushed) == (None, 8, ["after"])


class DeviceGone(RuntimeError):
    """What a transfer thread's set-up raises when its CUDA device is gone."""


def test_a_lane_whose_thread_dies_at_start_up_restarts_with_backoff_then_is_broken_and_fails_pushes_at_once():
    """The lane's set-up raises on every new thread. Each death fails the pushes open on the
    lane at once; the lane is restarted a bounded number of times with a growing backoff (it
    was restarted at every submit/take_finished, died again, and its requests ended only at the
    waiting timeout); then it is broken: a later push fails inside ``submit`` without a new
    thread, naming the cause, and ``broken`` (what the worker's health check raises with) says why."""
    _, layout, tensors, _ = build_pool(RankSpec())
    prefill, decode = create_agent("fake", layout, tensors), create_agent("fake", layout, tensors)
    name, backoff = "test-setup-dies", 0.02
    pusher = KVPusher({"fake": prefill}, name=name, num_lanes=1, max_restarts=3, restart_backoff_s=backoff)
    starts = []

    def setup():
        starts.append(time.monotonic())
        raise DeviceGone("CUDA error: no CUDA-capable device is detected")

    pusher._lane_setup = setup

    def submit(rid):
        handoffs = [KVReceiver(decode, rid, 1).send_metadata([3, 4]).to_bytes()]
        pusher.submit([PushChunk(f"{rid}#1", 0, [1, 2], True, handoffs=handoffs, dest="d")])

    results = {}
    for i in range(4):  # each push's thread dies before pushing it: the push fails, not waits
        submit(f"r{i}")
        results.update(_collect(pusher, 1))
        assert f"r{i}#1" in results, (i, results, len(starts))
    assert len(starts) == 4, starts  # the first start and 3 restarts, no more
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[1] >= backoff and gaps[2] >= 2 * backoff, gaps
    for r in results.values():
        assert f"transfer thread {name}-0 died (DeviceGone: CUDA error" in (r.error or ""), r
    assert pusher.broken is not None and "DeviceGone: CUDA error: no CUDA-capable device" in pusher.broken
    submit("later")
    later = pusher.take_finished()  # at once: no thread is started for it
    assert [(r.push_id, r.moved) for r in later] == [("later#1", 0)], later
    assert later[0].error == pusher.broken and f"lane {name}-0 is broken" in later[0].error, later
    time.sleep(4 * backoff)
    assert pusher.take_finished() == [] and len(starts) == 4, starts
    pusher.close()


def test_a_prefill_worker_whose_push_lane_is_broken_fails_its_health_check_and_load():
    """Heartbeats (``load``) and health checks must take the worker out of rotation, and a TP
    follower with a broken lane reports itself not alive to rank 0's watch."""
    import pytest
    from types import SimpleNamespace

    from actors.pd_scheduler import WorkerBrokenError
    from actors.rank import TPFollower
    from actors.workers import PrefillWorker

    pusher = SimpleNamespace(broken="the KV transfer lane raydix-kv-push-0-2 is broken: device gone")
    worker = object.__new__(PrefillWorker)
    worker.worker_id, worker.broken, worker.draining = "prefill-x", None, False
    worker.tp_worker, worker.rank = SimpleNamespace(broken=None), SimpleNamespace(pusher=pusher)
    for call in (worker.health, worker.load):
        with pytest.raises(WorkerBrokenError, match="lane raydix-kv-push-0-2 is broken: device gone"):
            call()
    pusher.broken = None
    assert worker.health()["worker_id"] == "prefill-x"
    follower = object.__new__(TPFollower)
    follower._thread = SimpleNamespace(is_alive=lambda: True)
    follower.host = SimpleNamespace(pusher=pusher)
    assert follower.alive()
    pusher.broken = "the KV transfer lane raydix-kv-push-1-0 is broken: device gone"
    assert not follower.alive()


def test_a_transfer_thread_that_cannot_be_started_fails_its_pushes_and_close_still_works(monkeypatch):
    """``Thread.start`` raising (the process is out of threads) counts as a death: the push fails
    at the next ``take_finished``, the lane ends broken, and ``close`` does not trip over the
    thread that never ran (joining it raised)."""
    import actors.kv_push as kv_push

    class Unstartable(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(kv_push.threading, "Thread", Unstartable)
    _, layout, tensors, _ = build_pool(RankSpec())
    prefill, decode = create_agent("fake", layout, tensors), create_agent("fake", layout, tensors)
    pusher = KVPusher({"fake": prefill}, name="test-no-threads", num_lanes=1, max_restarts=0)
    handoffs = [KVReceiver(decode, "r", 1).send_metadata([3]).to_bytes()]
    pusher.submit([PushChunk("r#1", 0, [1], True, handoffs=handoffs, dest="d")])
    results = pusher.take_finished()
    assert [r.push_id for r in results] == ["r#1"] and "can't start new thread" in results[0].error, results
    assert "can't start new thread" in (pusher.broken or "")
    pusher.close()


@pytest.mark.parametrize("how", ["cancel", "lane death"])
def test_a_slow_abort_of_a_failed_push_holds_up_no_other_lane(how):
    """A push on lane 0 ends with its senders open — cancelled, or its transfer thread died — and
    telling its decode rank (``agent.abort``: torch_dist sends a message over the pair) takes a
    while. Lane 1's push goes on meanwhile: the abort ran under the pusher's lock, so no lane
    could take a chunk and ``submit`` waited, the engine loop with it, until the abort returned."""
    _, layout, tensors, _ = build_pool(RankSpec())
    prefill, decode = create_agent("fake", layout, tensors), create_agent("fake", layout, tensors)
    pushed, aborting, release = [], threading.Event(), threading.Event()

    def push(handoff, src_slots, *rest, **kw):
        if handoff.rid == "a" and "a" in pushed:  # its second chunk
            raise ThreadKilled("the backend's event loop went away")
        pushed.append(handoff.rid)
        return 8

    def abort(handoff, reason):
        aborting.set()
        release.wait(30.0)  # (until the test ends: a submit held up behind it outlasts the 10 s waits below)

    prefill.push, prefill.abort = push, abort
    pusher = KVPusher({"fake": prefill}, name=f"test-slow-abort-{how.replace(' ', '-')}", num_lanes=2)
    first = [KVReceiver(decode, "a", 1).send_metadata([3, 4, 5]).to_bytes()]
    pusher.submit([PushChunk("a#1", 0, [1], False, handoffs=first, dest="d0")])
    ended = threading.Thread(target=pusher.cancel, args=("a#1",)) if how == "cancel" else \
        threading.Thread(target=lambda: (pusher.submit([PushChunk("a#1", 1, [2], False, dest="d0")]),
                                         _collect(pusher, 1)))  # (not its last chunk: the push stays open)
    try:
        deadline = time.monotonic() + 5
        while "a" not in pushed and time.monotonic() < deadline:
            time.sleep(0.002)
        ended.start()
        assert aborting.wait(5.0)
        other = [KVReceiver(decode, "b", 1).send_metadata([6]).to_bytes()]
        submitting = threading.Thread(
            target=pusher.submit, args=([PushChunk("b#1", 0, [7], True, handoffs=other, dest="d1")],))
        submitting.start()
        submitting.join(10.0)
        deadline = time.monotonic() + 10
        while "b" not in pushed and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not submitting.is_alive() and "b" in pushed, pushed
    finally:
        release.set()
        ended.join(5.0)
    pusher.close()
