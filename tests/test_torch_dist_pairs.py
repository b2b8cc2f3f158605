"""Setting up and tearing down torch_dist pairs (in-process, gloo on the CPU).

A pair starts with the prefill agent taking a pair number ``k`` from the decode
agent's store and saying hello under ``hello/{k}``; both then build the pair's
group. Every wait of that setup is bounded, a setup that fails fails only the
hand-offs that need it, and nothing of a pair outlives it: no reader thread, no
store key. The "ghost" prefill below is a bare store client that does only part
of the protocol, as a prefill process dying at that point would.
"""

import datetime
import threading
import time

import msgpack
import pytest
import torch
import torch.distributed as dist

import transfer.backends.dist_pairs as dist_pairs
from tests.transfer_helpers import RankSpec, build_pool
from transfer import KVHandoff, KVPoll, KVReceiver, KVSender, create_agent


@pytest.fixture
def agents():
    """``make(**options)`` builds torch_dist agents over small CPU pools; all closed at the end."""
    made = []

    def make(seed=0, **options):
        _, layout, tensors, _ = build_pool(RankSpec(seed=seed))
        made.append(create_agent("torch_dist", layout, tensors, **options))
        return made[-1]

    yield make
    for agent in made:
        agent.close()


def _ghost(endpoint, hello=False):
    """Take a pair number on ``endpoint``'s store (and, with ``hello``, say hello), then vanish."""
    store = dist.TCPStore(endpoint["host"], endpoint["port"], None, False, datetime.timedelta(seconds=2))
    k = store.add("peers", 1)
    if hello:
        store.set(f"hello/{k}", msgpack.packb({"agent_id": "ghost", "data": "gloo"}))
    return k


def push_one(prefill, decode, src_slots, dst_slots, rid="r"):
    """One hand-off, the sender's outcome checked first (a failed setup fails fast)."""
    receiver, sender = KVReceiver(decode, rid, 1, land_timeout_s=2), KVSender(prefill, rid)
    sender.init(KVHandoff.from_bytes(receiver.send_metadata(dst_slots).to_bytes()))
    sender.send(src_slots)
    assert sender.poll() == KVPoll.Success, sender.failure_reason()
    receiver.mark_done()
    assert receiver.wait() == KVPoll.Success, receiver.failure_reason()


def _readers(agent):
    return [t for t in agent._readers if t.is_alive()]


def _eventually(check, timeout_s=30.0):
    """Whether ``check()`` came to hold (``timeout_s``: only a hang guard, for a loaded host)."""
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def test_a_prefill_gone_before_its_hello_holds_up_no_later_pair(agents):
    """The acceptor used to wait for ``hello/1`` before it looked at ``hello/2``: one
    prefill dying between its pair number and its hello made every later prefill's
    setup with that decode agent time out. The decode side waits for the ghost's hello
    longer than the prefill side's setup may take: held up, the push fails."""
    decode = agents(seed=2, connect_timeout_s=30)
    _ghost(decode.endpoint())
    prefill = agents(seed=1, timeout_s=10)
    push_one(prefill, decode, [3, 4, 9], [7, 8, 2])


def test_a_hello_later_than_the_decode_side_waits_is_refused_at_once(agents, monkeypatch):
    """A prefill stalled between its pair number and its hello past the decode side's
    ``connect_timeout_s``: the decode side gave the number up, and the prefill learns it
    from the store at once instead of waiting ``timeout_s`` for a peer that never comes.
    The next push opens a new pair."""
    decode = agents(seed=2, connect_timeout_s=0.2)
    prefill = agents(seed=1, timeout_s=10)
    real_store = dist.TCPStore
    stalled = []  # when the stall ended

    class StallingStore:  # the prefill's store client: stalls until the decode side gave its pair number up
        def __init__(self, *args, **kwargs):
            self._store = real_store(*args, **kwargs)

        def add(self, key, value):
            k = self._store.add(key, value)
            assert _eventually(lambda: self._store.check([f"hello/{k}"]))
            stalled.append(time.monotonic())
            return k

        def __getattr__(self, name):
            return getattr(self._store, name)

    receiver, sender = KVReceiver(decode, "r", 1), KVSender(prefill, "r")
    handoff = receiver.send_metadata([5, 6])  # (the decode agent's store server is up)
    monkeypatch.setattr(dist_pairs.dist, "TCPStore", StallingStore)
    sender.init(KVHandoff.from_bytes(handoff.to_bytes()))
    sender.send([1, 2])
    assert sender.poll() == KVPoll.Failed and "gave up" in sender.failure_reason()
    assert time.monotonic() - stalled[0] < prefill.timeout_s / 2  # it did not wait for a peer
    assert prefill._links == {}
    monkeypatch.setattr(dist_pairs.dist, "TCPStore", real_store)
    decode.connect_timeout_s = 30  # (a loaded host's pause between number and hello is no late hello)
    push_one(prefill, decode, [3, 4], [7, 8])


def test_a_prefill_gone_after_its_hello_leaves_no_reader_behind(agents):
    """The decode side's reader built its group with a year-long timeout: a prefill that
    said hello and died left the thread (and its sockets) waiting for good."""
    decode = agents(seed=2, timeout_s=0.5, connect_timeout_s=0.5)
    _ghost(decode.endpoint(), hello=True)
    assert _eventually(lambda: decode._readers)  # the hello was answered
    assert _eventually(lambda: not _readers(decode)), [t.name for t in _readers(decode)]


def test_an_idle_pair_outlives_its_timeouts(agents):
    """Bounding the setup must not bound the wait for a pair's next message: a pair
    idle for longer than ``timeout_s`` still carries the next hand-off. (The setup must
    fit in ``timeout_s`` too: a shorter one fails it on a loaded host.)"""
    decode = agents(seed=2, timeout_s=1.0)
    prefill = agents(seed=1)
    push_one(prefill, decode, [3, 4], [7, 8])
    time.sleep(1.3)
    push_one(prefill, decode, [5, 6], [9, 10], rid="later")
    assert len(_readers(decode)) == 1


def test_closed_pairs_leave_no_store_keys_and_no_threads(agents):
    """Every pair wrote its hello and its groups' rendezvous keys into the decode
    agent's store for good, and its finished reader stayed in the agent's list: both
    grew with every pair ever opened."""
    decode = agents(seed=2)
    decode.endpoint()
    store = decode._store
    for i in range(4):
        prefill = agents(seed=1)
        push_one(prefill, decode, [3, 4], [7, 8], rid=f"r{i}")
        prefill.close()
        assert _eventually(lambda: not _readers(decode))
        assert _eventually(lambda: store.list_keys() == ["peers"]), store.list_keys()
    assert len(decode._readers) <= 1


def test_an_unreachable_decode_agent_holds_up_only_pushes_to_itself(agents, monkeypatch):
    """Pairs were opened under one lock per prefill agent: while one decode agent did not
    answer, pushes to every other decode agent waited out its connect timeout. Here the
    connect to the unreachable one lasts until the other push is done (30 s at most: held
    up behind it, that push ends only then)."""
    prefill = agents(seed=1, connect_timeout_s=0.5)
    decode, unreachable = agents(seed=2), agents(seed=3)
    ghost = KVHandoff.from_bytes(KVReceiver(unreachable, "g", 1).send_metadata([5, 6]).to_bytes())
    ghost.endpoint.update(port=1, agent_id="nobody")
    real_store, connecting, pushed = dist.TCPStore, threading.Event(), threading.Event()
    outlasted = []  # whether the other push was done while this connect went on

    def store(host, port, *args, **kwargs):
        if port == 1:
            connecting.set()
            outlasted.append(pushed.wait(30))
        return real_store(host, port, *args, **kwargs)

    monkeypatch.setattr(dist_pairs.dist, "TCPStore", store)
    stuck = KVSender(prefill, "g")
    stuck.init(ghost)
    thread = threading.Thread(target=stuck.send, args=([1, 2],))
    thread.start()
    try:
        assert connecting.wait(30)
        push_one(prefill, decode, [3, 4], [7, 8])
    finally:
        pushed.set()
        thread.join()
    assert outlasted == [True]
    assert stuck.poll() == KVPoll.Failed and "cannot reach the decode rank" in stuck.failure_reason()


def test_a_silent_peer_is_given_up_after_its_keepalives_stop(agents, monkeypatch):
    """A prefill host that vanishes without closing its sockets (power loss, a partition)
    used to leave the decode side's reader waiting for good. The prefill agent sends a
    keepalive on an idle link; the reader gives a pair up once they stop, and the prefill
    side's next push opens a fresh pair. (The reader allows a second of silence: a loaded
    host's pause of a keepalive is no silent peer.)"""
    decode = agents(seed=2, keepalive_misses=10)
    prefill = agents(seed=1, keepalive_s=0.1)
    push_one(prefill, decode, [3, 4], [7, 8])
    time.sleep(1.2)  # more silence than the reader allows: the keepalives hold the pair open
    assert len(_readers(decode)) == 1
    monkeypatch.setattr(dist_pairs._Link, "keepalive", lambda link, idle_s: None)  # the host goes silent
    assert _eventually(lambda: not _readers(decode))
    assert _eventually(lambda: decode._store.list_keys() == ["peers"]), decode._store.list_keys()
    monkeypatch.undo()
    assert _eventually(lambda: not prefill._links)  # its keepalive on the closed pair failed: dropped
    push_one(prefill, decode, [5, 6], [9, 10], rid="later")
    assert len(_readers(decode)) == 1


def test_a_peer_without_keepalives_keeps_an_unbounded_wait(agents):
    """A hello that names no keepalive interval (an agent that sends none) keeps the old
    unbounded wait, rather than closing a healthy idle pair after the decode agent's own
    ``keepalive_s * keepalive_misses``."""
    decode = agents(seed=2, keepalive_s=0.05, keepalive_misses=1)
    ep = decode.endpoint()
    store = dist.TCPStore(ep["host"], ep["port"], None, False, datetime.timedelta(seconds=2))
    k = store.add("peers", 1)
    store.set(f"hello/{k}", msgpack.packb({"agent_id": "old", "data": "gloo"}))
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", store), 1, 2, datetime.timedelta(seconds=2))
    time.sleep(0.5)
    assert len(_readers(decode)) == 1
    pg.send([torch.tensor([dist_pairs._BYE, 0], dtype=torch.int64)], 0, 0).wait()
    assert _eventually(lambda: not _readers(decode))


class _FakeClock:
    """``time`` for :mod:`dist_pairs`, and the condition its keepalive thread waits on:
    a wait moves the clock on by its timeout; the thread stops at ``end``."""

    def __init__(self, pairs, end):
        self.now, self.pairs, self.end = 0.0, pairs, end

    def monotonic(self):
        return self.now

    def wait(self, timeout):
        self.now += timeout
        self.pairs._closed = self.now > self.end

    def acquire(self):  # (one thread: nothing to lock)
        pass

    release = __enter__ = acquire

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("pushed_at", [0.001, 0.05, 0.099])
def test_every_keepalive_interval_holds_a_message(monkeypatch, pushed_at):
    """The keepalive thread looked every ``keepalive_s / 2`` for links idle ``keepalive_s``: a
    keepalive went out up to 1.5 intervals after the last message, past what a reader with
    ``keepalive_misses=1`` allows, so it closed healthy idle pairs. On a clock the test
    moves, a push just after (or between) the thread's looks is followed by a message within
    each interval."""
    pairs = dist_pairs.PairConnections()
    clock = _FakeClock(pairs, end=10.0)
    monkeypatch.setattr(dist_pairs, "time", clock)
    sent = [pushed_at]

    class Group:  # the link's gloo group: each send is a message at the clock's time
        def send(self, tensors, dst, tag):
            sent.append(clock.now)
            return self

        def wait(self):
            pass

    link = dist_pairs._Link(None, Group(), None)
    link.last_sent = pushed_at
    pairs.keepalive_s, pairs._closed, pairs._lock, pairs._links = 0.4, False, clock, {"decode": link}
    pairs._keep_alive()
    assert len(sent) > 20 and max(b - a for a, b in zip(sent, sent[1:])) < pairs.keepalive_s
