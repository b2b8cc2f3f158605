"""KVPusher's transfer threads, in one process over the fake backend (no workers)."""

import threading
import time

from actors.kv_push import KVPusher, PushChunk
from tests.transfer_helpers import RankSpec, build_pool
from transfer import KVReceiver, create_agent


class ThreadKilled(BaseException):
    """What a backend may let escape a push that is not an Exception (SystemExit, CancelledError)."""


def _collect(pusher, want, timeout_s=5.0):
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
