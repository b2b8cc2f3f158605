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
    setup with that decode agent time out."""
    decode = agents(seed=2, timeout_s=5, connect_timeout_s=0.5)
    _ghost(decode.endpoint())
    prefill = agents(seed=1, timeout_s=1)
    began = time.monotonic()
    push_one(prefill, decode, [3, 4, 9], [7, 8, 2])
    assert time.monotonic() - began < 1.0


def test_a_hello_later_than_the_decode_side_waits_is_refused_at_once(agents, monkeypatch):
    """A prefill stalled between its pair number and its hello past the decode side's
    ``connect_timeout_s``: the decode side gave the number up, and the prefill learns it
    from the store at once instead of waiting ``timeout_s`` for a peer that never comes.
    The next push opens a new pair."""
    decode = agents(seed=2, timeout_s=5, connect_timeout_s=0.2)
    prefill = agents(seed=1, timeout_s=5)
    real_store = dist.TCPStore

    class StallingStore:  # the prefill's store client: stalls once it took its pair number
        def __init__(self, *args, **kwargs):
            self._store = real_store(*args, **kwargs)

        def add(self, key, value):
            out = self._store.add(key, value)
            time.sleep(0.6)
            return out

        def __getattr__(self, name):
            return getattr(self._store, name)

    receiver, sender = KVReceiver(decode, "r", 1), KVSender(prefill, "r")
    handoff = receiver.send_metadata([5, 6])  # (the decode agent's store server is up)
    monkeypatch.setattr(dist_pairs.dist, "TCPStore", StallingStore)
    sender.init(KVHandoff.from_bytes(handoff.to_bytes()))
    began = time.monotonic()
    sender.send([1, 2])
    assert sender.poll() == KVPoll.Failed and "gave up" in sender.failure_reason()
    assert time.monotonic() - began < 2.0
    assert prefill._links == {}
    monkeypatch.setattr(dist_pairs.dist, "TCPStore", real_store)
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
    idle for longer than ``timeout_s`` still carries the next hand-off."""
    decode = agents(seed=2, timeout_s=0.3)
    prefill = agents(seed=1, timeout_s=0.3)
    push_one(prefill, decode, [3, 4], [7, 8])
    time.sleep(0.8)
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


def test_an_unreachable_decode_agent_holds_up_only_pushes_to_itself(agents):
    """Pairs were opened under one lock per prefill agent: while one decode agent did not
    answer, pushes to every other decode agent waited out its connect timeout."""
    prefill = agents(seed=1, connect_timeout_s=0.8)
    decode, unreachable = agents(seed=2), agents(seed=3)
    ghost = KVHandoff.from_bytes(KVReceiver(unreachable, "g", 1).send_metadata([5, 6]).to_bytes())
    ghost.endpoint.update(port=1, agent_id="nobody")
    stuck = KVSender(prefill, "g")
    stuck.init(ghost)
    thread = threading.Thread(target=stuck.send, args=([1, 2],))
    thread.start()
    try:
        time.sleep(0.1)  # it is connecting now
        began = time.monotonic()
        push_one(prefill, decode, [3, 4], [7, 8])
        assert time.monotonic() - began < 0.5 and thread.is_alive()
    finally:
        thread.join()
    assert stuck.poll() == KVPoll.Failed and "cannot reach the decode rank" in stuck.failure_reason()


def test_a_silent_peer_is_given_up_after_its_keepalives_stop(agents, monkeypatch):
    """A prefill host that vanishes without closing its sockets (power loss, a partition)
    used to leave the decode side's reader waiting for good. The prefill agent sends a
    keepalive on an idle link; the reader gives a pair up once they stop, and the prefill
    side's next push opens a fresh pair."""
    decode = agents(seed=2, timeout_s=2, keepalive_misses=2)
    prefill = agents(seed=1, timeout_s=2, keepalive_s=0.1)
    push_one(prefill, decode, [3, 4], [7, 8])
    time.sleep(0.6)  # three times the silence the reader allows: the keepalives hold the pair open
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
    unbounded wait, rather than closing a healthy idle pair."""
    decode = agents(seed=2, timeout_s=0.5, keepalive_s=0.05, keepalive_misses=1)
    ep = decode.endpoint()
    store = dist.TCPStore(ep["host"], ep["port"], None, False, datetime.timedelta(seconds=2))
    k = store.add("peers", 1)
    store.set(f"hello/{k}", msgpack.packb({"agent_id": "old", "data": "gloo"}))
    pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair/{k}", store), 1, 2, datetime.timedelta(seconds=2))
    time.sleep(0.5)
    assert len(_readers(decode)) == 1
    pg.send([torch.tensor([dist_pairs._BYE, 0], dtype=torch.int64)], 0, 0).wait()
    assert _eventually(lambda: not _readers(decode))


def test_an_idle_pair_stays_open_with_one_interval_of_silence_allowed(agents):
    """The keepalive thread looked every ``keepalive_s / 2`` for links idle ``keepalive_s``: a
    keepalive went out up to 1.5 intervals after the last message, past what a reader with
    ``keepalive_misses=1`` allows, so it closed healthy idle pairs. Each interval now holds
    one message."""
    decode = agents(seed=2, timeout_s=2, keepalive_misses=1)
    prefill = agents(seed=1, timeout_s=2, keepalive_s=0.4)
    push_one(prefill, decode, [3, 4], [7, 8])
    link = next(iter(prefill._links.values()))
    time.sleep(1.0)  # two and a half intervals of idling
    assert len(_readers(decode)) == 1 and list(prefill._links.values()) == [link]
    push_one(prefill, decode, [5, 6], [9, 10], rid="later")
    assert list(prefill._links.values()) == [link]
