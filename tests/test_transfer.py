"""Transfer: run cutting, the hand-off message, layout checks, the polled state
machines, and every in-process backend moving exactly the right bytes.

Backends are held against :func:`tests.transfer_helpers.expected_after`, a
slot-by-slot, head-by-head oracle; whole buffers are compared, so a row the
push must not touch that changed fails too. Cross-process runs are in
``test_transfer_backends.py``.
"""

import subprocess
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import transfer.states
import transfer.plan
from tests.transfer_helpers import (
    SWA_SIZE,
    RankSpec,
    assert_buffers_equal,
    build_pool,
    expected_after,
    request,
    snapshot,
    push_one,
    swa_window,
)
from transfer import (
    KVHandoff,
    KVPoll,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    TransferError,
    check_compatible,
    create_agent,
    group_concurrent_contiguous,
    known_backends,
    select_backend,
)
from transfer.base import HANDOFF_VERSION


# ---- run cutting -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "src, dst, runs",
    [
        ([], [], []),
        ([5], [9], [(5, 9, 1)]),
        ([1, 2, 3], [7, 8, 9], [(1, 7, 3)]),
        ([1, 2, 3, 4], [7, 8, 20, 21], [(1, 7, 2), (3, 20, 2)]),  # dst jumps
        ([1, 2, 8, 9], [7, 8, 9, 10], [(1, 7, 2), (8, 9, 2)]),  # src jumps
        ([3, 2, 1], [1, 2, 3], [(3, 1, 1), (2, 2, 1), (1, 3, 1)]),  # descending never merges
        ([4, 4], [1, 2], [(4, 1, 1), (4, 2, 1)]),
        (list(range(32, 48)) + list(range(0, 16)), list(range(16, 48)), [(32, 16, 16), (0, 32, 16)]),  # 16-token pages
    ],
)
def test_group_concurrent_contiguous_table(src, dst, runs):
    got = group_concurrent_contiguous(src, dst)
    assert got.dtype == np.int64 and got.shape == (len(runs), 3)
    assert [tuple(r) for r in got.tolist()] == runs


def test_group_concurrent_contiguous_accepts_tensors_and_rejects_unequal_lengths():
    got = group_concurrent_contiguous(torch.tensor([4, 5, 6]), np.array([0, 1, 2]))
    assert got.tolist() == [[4, 0, 3]]
    with pytest.raises(ValueError, match="differ in length"):
        group_concurrent_contiguous([1, 2], [1])


def test_runs_are_at_least_a_page_with_page_size_16():
    rng = np.random.default_rng(3)
    src, dst = request(rng, 16, 80)
    runs = group_concurrent_contiguous(src, dst)
    assert runs[:, 2].min() >= 16 and runs[:, 2].sum() == 80


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=60))
def test_runs_cover_exactly_the_pairs_and_are_maximal(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    runs = group_concurrent_contiguous(src, dst).tolist()
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == list(zip(src, dst))
    assert all(n >= 1 for _, _, n in runs)
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):  # maximal: a cut is always needed
        assert (s1, d1) != (s0 + n0, d0 + n0)


# ---- the hand-off -----------------------------------------------------------------------
def _handoff(spec=RankSpec("hybrid", 16), **kw) -> KVHandoff:
    _, layout, _, _ = build_pool(spec)
    fields = dict(rid="r1", room=2**62 + 5, tp_rank=1, tp_size=2, layout=layout, dst_slots=[16, 17, 18],
                  dst_state_slot=3, dst_prefix_len=32, backend="shm", endpoint={"agent_id": "a", "views": {"k.0": [0, 5]}})
    fields.update(kw)
    return KVHandoff(**fields)


def test_handoff_round_trips_through_bytes():
    h = _handoff()
    assert KVHandoff.from_bytes(h.to_bytes()) == h
    swa = _handoff(RankSpec("swa"), dst_state_slot=None, dst_swa_slots=[9, 3, 4])
    assert KVHandoff.from_bytes(swa.to_bytes()) == swa
    cuda_like = _handoff(endpoint={"handles": b"\x80\x04pickled"})
    assert KVHandoff.from_bytes(cuda_like.to_bytes()).endpoint["handles"] == b"\x80\x04pickled"


def test_handoff_version_mismatch_and_malformed_bytes_are_rejected():
    with pytest.raises(TransferError, match=f"version 99, this build speaks {HANDOFF_VERSION}"):
        KVHandoff.from_bytes(_handoff(version=99).to_bytes())
    for bad in (b"\xc1\xc1garbage", b"", b"\x93\x01\x02\x03"):
        with pytest.raises(TransferError):
            KVHandoff.from_bytes(bad)
    import msgpack

    truncated = msgpack.packb({"version": HANDOFF_VERSION, "rid": "x"})
    with pytest.raises(TransferError, match="malformed"):
        KVHandoff.from_bytes(truncated)


def test_hand_offs_from_before_layer_ids_swa_slots_and_chunked_pushes_are_rejected():
    """Version 2 had no ``dst_swa_slots`` (a sliding-window model's window would silently
    not move); a version 3 peer expects one message per hand-off (it would reject chunks);
    a version 4 peer names no global layers (its rank would pair with every pipeline stage); a version 5
    peer names sliding-window and hybrid buffers by position (another stage's layers under the same names)."""
    import msgpack

    assert HANDOFF_VERSION == 6
    raw = msgpack.unpackb(_handoff().to_bytes())
    raw["version"] = 5
    with pytest.raises(TransferError, match="hand-off version 5, this build speaks 6"):
        KVHandoff.from_bytes(msgpack.packb(raw))
    raw["version"] = 4
    del raw["num_layers"]
    raw["buffers"] = [b[:7] for b in raw["buffers"]]
    with pytest.raises(TransferError, match="hand-off version 4, this build speaks 6"):
        KVHandoff.from_bytes(msgpack.packb(raw))
    raw["version"] = 3
    with pytest.raises(TransferError, match="hand-off version 3, this build speaks 6"):
        KVHandoff.from_bytes(msgpack.packb(raw))
    del raw["dst_swa_slots"]
    raw["version"] = 2
    with pytest.raises(TransferError, match="hand-off version 2, this build speaks 6"):
        KVHandoff.from_bytes(msgpack.packb(raw))


@pytest.mark.parametrize(
    "field, value",
    [
        ("dst_slots", [16.7, 17.2, 18.9]),  # the run cutter would truncate them to other slots
        ("dst_slots", "abc"),
        ("dst_slots", [16, -1, 18]),
        ("dst_swa_slots", [True]),
        ("dst_state_slot", 1.5),
        ("dst_prefix_len", -3),
        ("tp_rank", None),
        ("tp_rank", 2),  # of tp_size 2
        ("room", "2"),
        ("rid", 7),
        ("page_size", 0),
        ("endpoint", None),
        ("deadline", "soon"),
        ("backend", ["shm"]),
        ("num_layers", -1),
        ("buffers", [["k.0", "token", [4, 8], "float16", 3, 0, 4, 0]]),  # head axis past the row's axes
        ("buffers", [["k.0", "tokens", [4, 8], "float16", 0, 0, 4, 0]]),  # unknown index
        ("buffers", [["k.0", "token", [4, -8], "float16", 0, 0, 4, 0]]),
        ("buffers", [["k.0", "token", [4, 8], "float16", 0, 2, 4, 0]]),  # heads [2, 6) of 4
        ("buffers", [["k.0", "token", [4, 8], "float16", 0, 0, 4]]),  # no layer (version 4's entry)
        ("buffers", [["k.9", "token", [4, 8], "float16", 0, 0, 4, 9]]),  # layer 9 of a 4-layer model
        ("buffers", [["k.0", "token", [4, 8], "float16", 0, 0, 4, "0"]]),
    ],
)
def test_handoff_fields_of_the_wrong_type_or_range_are_rejected(field, value):
    """A hand-off is checked field by field when it is read: a wrong type or an
    impossible value must not surface later as wrong slots or a stray exception."""
    import msgpack

    raw = msgpack.unpackb(_handoff().to_bytes())
    raw[field] = value
    with pytest.raises(TransferError, match=f"malformed hand-off message: .*{field}"):
        KVHandoff.from_bytes(msgpack.packb(raw))


@pytest.mark.parametrize(
    "other, message",
    [
        (RankSpec("mha", 1, dtype="bfloat16"), "dtype=bfloat16"),
        (RankSpec("mha", 16), "page_size differs: prefill 1, decode 16"),
        (RankSpec("mha", 1, head_dim=16), r"per-head shape \(8,\) of 4 heads vs \(16,\) of 4 heads"),
        (RankSpec("mla", 1), "buffers differ"),
    ],
)
def test_layout_mismatch_is_rejected_with_a_clear_message(other, message):
    _, mine, _, _ = build_pool(RankSpec("mha", 1))
    _, theirs, _, _ = build_pool(other)
    with pytest.raises(LayoutMismatchError, match=message):
        check_compatible(mine, theirs)


def test_swa_pool_layout_names_its_sliding_window_layers_apart():
    pool, layout, tensors, _ = build_pool(RankSpec("swa", tp_rank=1, tp_size=2))
    by_name = layout.by_name()
    assert sorted(by_name) == ["k.1", "swa_k.0", "swa_k.2", "swa_v.0", "swa_v.2", "v.1"]  # (by global layer)
    assert {by_name[n].index for n in ("k.1", "v.1")} == {"token"}
    assert [by_name[n].layer for n in ("swa_k.0", "k.1", "swa_v.2")] == [0, 1, 2]
    for name in ("swa_k.0", "swa_v.2"):
        b = by_name[name]
        assert (b.index, b.head_axis, b.head_start, b.num_heads, b.total_heads) == ("swa", 0, 2, 2, 4)
        assert tensors[name].shape[0] == SWA_SIZE + 1  # rows are SWA slots
    assert tensors["swa_k.2"] is pool.swa_kv_pool.k_buffer[1] and tensors["k.1"] is pool.full_kv_pool.k_buffer[0]


def test_swa_layout_mismatch_is_rejected():
    _, mine, _, _ = build_pool(RankSpec("swa", swa_layers=(0, 2)))
    _, theirs, _, _ = build_pool(RankSpec("swa", swa_layers=(0, 1, 2)))
    with pytest.raises(LayoutMismatchError, match="split into sliding-window and full-attention layers differs"):
        check_compatible(mine, theirs)
    _, dense, _, _ = build_pool(RankSpec("mha"))  # a dense model's k.1/v.1 are not a sliding-window model's
    with pytest.raises(LayoutMismatchError, match=r"only on prefill \['swa_k.0'"):
        check_compatible(mine, replace(dense, num_layers=mine.num_layers))  # (of as many layers)


def test_missing_buffer_and_mamba_tp_mismatch_are_rejected():
    _, full, _, _ = build_pool(RankSpec("hybrid", 1))
    fewer = replace(full, buffers=tuple(b for b in full.buffers if b.name != "v.1"))
    with pytest.raises(LayoutMismatchError, match=r"only on prefill \['v.1'\]"):
        check_compatible(full, fewer)
    _, tp2, _, _ = build_pool(RankSpec("hybrid", 1, tp_rank=0, tp_size=2))
    with pytest.raises(LayoutMismatchError, match="Mamba states need the same TP size"):
        check_compatible(full, tp2)


def test_a_buffer_named_for_one_layer_but_holding_another_is_rejected():
    """Names carry the global layer (version 6) and the layers both ranks hold decide which buffers
    are compared: a peer whose ``k.1`` says it holds layer 3, or whose Mamba states say no layer (a
    version 5 layout's), no longer holds layer 1's (or the states') buffers as ours do."""
    _, full, _, _ = build_pool(RankSpec("hybrid", 1))
    relabelled = replace(full, buffers=tuple(replace(b, layer=3) if b.name in ("k.1", "v.1") else b
                                             for b in full.buffers))
    with pytest.raises(LayoutMismatchError, match=r"only on prefill \[\], only on decode \['k.1', 'v.1'\]"):
        check_compatible(full, relabelled)
    unlayered = replace(full, buffers=tuple(replace(b, layer=None) if b.index == "state" else b for b in full.buffers))
    with pytest.raises(LayoutMismatchError, match=r"only on decode \['state.0.0', 'state.0.2'"):
        check_compatible(full, unlayered)


def test_sender_init_fails_on_mismatched_layout_or_backend():
    _, mine, tensors, _ = build_pool(RankSpec("mha", 1))
    agent = create_agent("fake", mine, tensors)
    sender = KVSender(agent, "r")
    with pytest.raises(LayoutMismatchError):
        sender.init(_handoff(RankSpec("mha", 16), backend="fake"))
    assert sender.poll() == KVPoll.Failed and "page_size" in sender.failure_reason()
    other = KVSender(agent, "r")
    with pytest.raises(TransferError, match="backend 'shm'"):
        other.init(_handoff(RankSpec("mha", 1)))


# ---- registry and selection ----------------------------------------------------------------
def test_registry_and_backend_selection():
    assert {"fake", "shm", "cuda_ipc", "torch_dist"} <= set(known_backends())
    assert select_backend(True, "cpu") == "shm"
    assert select_backend(True, "cuda:1") == "cuda_ipc"
    assert select_backend(False, "cpu") == "torch_dist" == select_backend(False, "cuda")
    assert select_backend(True, "cpu", override="torch_dist") == "torch_dist"
    with pytest.raises(ValueError, match="known: cuda_ipc, fake, shm, torch_dist"):
        select_backend(True, "cpu", override="nixl")
    _, layout, tensors, _ = build_pool(RankSpec())
    with pytest.raises(ValueError, match="unknown transfer backend 'nixl'; known:"):
        create_agent("nixl", layout, tensors)


# ---- the state machines -----------------------------------------------------------------------
@pytest.fixture
def fake_pair():
    _, layout, tensors, _ = build_pool(RankSpec())
    return create_agent("fake", layout, tensors), create_agent("fake", layout, tensors)


def test_fake_round_trip_and_send_before_init_raises(fake_pair):
    prefill, decode = fake_pair
    sender, receiver = KVSender(prefill, "r"), KVReceiver(decode, "r", 1)
    assert sender.poll() == receiver.poll() == KVPoll.Bootstrapping
    with pytest.raises(TransferError, match="send\\(\\) in state Bootstrapping"):
        sender.send([1, 2])
    sender.init(receiver.send_metadata([3, 4]))
    assert sender.poll() == receiver.poll() == KVPoll.WaitingForInput
    sender.send([1, 2])
    receiver.mark_done()
    assert sender.poll() == receiver.poll() == KVPoll.Success


@pytest.mark.parametrize("stage", ["Bootstrapping", "WaitingForInput"])
def test_timeouts_end_in_failed_with_a_reason(fake_pair, stage):
    prefill, decode = fake_pair
    sender, receiver = KVSender(prefill, "r", timeout_s=0.02), KVReceiver(decode, "r", 1, timeout_s=0.02)
    if stage == "WaitingForInput":
        sender.init(receiver.send_metadata([3]))
    time.sleep(0.05)
    for machine in (sender, receiver):
        assert machine.poll() == KVPoll.Failed
        assert machine.failure_reason() == f"timed out after 0.0s in {stage}"


class _Clock:
    """The transfer state machines' clock, moved by the test: a deadline passes when the
    test says so, not when a slow host gets round to polling (30 ms is a GC pause)."""

    def __init__(self):
        self.now = time.time()

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


def test_a_sender_waiting_between_chunks_fails_at_the_decode_deadline(fake_pair, monkeypatch):
    """Between chunks (Transferring) no timeout_s applies: the hand-off's deadline bounds
    the wait, so a sender whose next chunk never comes must poll Failed once it passed
    (from then on the decode side may give the slots to another request)."""
    prefill, decode = fake_pair
    clock = _Clock()
    monkeypatch.setattr(transfer.states, "time", clock)
    for chunks in (0, 1):
        sender = KVSender(prefill, "r")
        sender.init(KVReceiver(decode, "r", 1, timeout_s=0.03).send_metadata([3, 4]))
        if chunks:
            sender.send_chunk([1], 0, False)
        clock.now += 0.02
        assert sender.poll() == (KVPoll.Transferring if chunks else KVPoll.WaitingForInput)
        clock.now += 0.02
        assert sender.poll() == KVPoll.Failed and "deadline passed" in sender.failure_reason()


def test_abort_fails_and_sticks(fake_pair):
    prefill, decode = fake_pair
    sender, receiver = KVSender(prefill, "r"), KVReceiver(decode, "r", 1)
    sender.init(receiver.send_metadata([3]))
    receiver.abort("client went away")
    sender.abort()
    assert (receiver.poll(), receiver.failure_reason()) == (KVPoll.Failed, "client went away")
    assert (sender.poll(), sender.failure_reason()) == (KVPoll.Failed, "aborted")
    receiver.mark_done()
    assert receiver.poll() == KVPoll.Failed


def test_an_abort_from_another_thread_is_never_half_overwritten_by_success(fake_pair):
    """KVPusher.cancel aborts a sender on the engine loop's thread while its transfer
    thread finishes the last chunk. An abort landing between ``_set``'s look at the state
    and its write was overwritten: Success, with failure reason "aborted". Either order
    is fine; a mix of both is not. (The interleaving is forced: the last look at the
    state, from ``_set(Success)``, runs the abort on another thread first.)"""
    import threading

    class RacySender(KVSender):
        race = False

        @property
        def _state(self):
            state = self.__dict__["_st"]
            if self.race and state == KVPoll.Transferring and threading.current_thread() is threading.main_thread():
                self.race = False
                aborter = threading.Thread(target=self.abort, args=("aborted",))
                aborter.start()
                aborter.join(0.2)  # (blocked for good only if the state machine is locked)
                self.aborter = aborter
            return state

        @_state.setter
        def _state(self, state):
            self.__dict__["_st"] = state

    prefill, decode = fake_pair
    sender = RacySender(prefill, "r")
    sender.init(KVReceiver(decode, "r", 1).send_metadata([3]))
    sender.race = True
    sender.send([1])
    sender.aborter.join()
    outcome = (sender.poll(), sender.failure_reason())
    assert outcome in ((KVPoll.Success, None), (KVPoll.Failed, "aborted")), outcome


def test_slot_count_mismatch_fails_not_raises(fake_pair):
    prefill, decode = fake_pair
    sender = KVSender(prefill, "r")
    sender.init(KVReceiver(decode, "r", 1).send_metadata([3, 4]))
    sender.send([1])
    assert sender.poll() == KVPoll.Failed and "1 source slots for 2" in sender.failure_reason()
    swa = KVSender(prefill, "r")
    swa.init(KVReceiver(decode, "r", 1).send_metadata([3, 4], dst_swa_slots=[7, 8]))
    swa.send([1, 2], None, [5])
    assert swa.poll() == KVPoll.Failed and "1 source SWA slots for 2 destination SWA slots" in swa.failure_reason()


# ---- backends in one process -----------------------------------------------------------------
def _transfer(backend, kind, page_size, src_tp, dst_tp, seed, prefix_len=3, num_tokens=37, window=16, num_chunks=1):
    """Every prefill rank pushes to every decode rank; returns per decode rank (actual, expected).
    ``kind="swa"``: the sliding-window layers take ``window`` random SWA slots. ``num_chunks``:
    the rows go in that many chunks cut at random (the state and SWA rows with the last)."""
    rng = np.random.default_rng(seed)
    srcs = [build_pool(RankSpec(kind, page_size, r, src_tp, seed=seed + r)) for r in range(src_tp)]
    dsts = [build_pool(RankSpec(kind, page_size, r, dst_tp, shared=True, seed=seed + 50 + r)) for r in range(dst_tp)]
    senders = [create_agent(backend, l, t, r, src_tp) for r, (_, l, t, _) in enumerate(srcs)]
    receivers = [create_agent(backend, l, t, r, dst_tp, allocators=a) for r, (_, l, t, a) in enumerate(dsts)]
    try:
        src_slots, dst_slots = request(rng, page_size, num_tokens, prefix_len)
        states = (2, 4) if kind == "hybrid" else (None, None)
        src_swa, dst_swa = swa_window(rng, window) if kind == "swa" else ((), ())
        before = [snapshot(t) for _, _, t, _ in dsts]
        machines = [KVReceiver(agent, "req", 11) for agent in receivers]
        handoffs = [m.send_metadata(dst_slots, states[1], prefix_len, dst_swa).to_bytes() for m in machines]
        num_rows = len(src_slots)
        cuts = [0, *sorted(rng.choice(np.arange(1, num_rows), num_chunks - 1, replace=False).tolist()), num_rows]
        for agent in senders:
            for wire in handoffs:
                sender = KVSender(agent, "req")
                sender.init(KVHandoff.from_bytes(wire))
                for lo, hi in zip(cuts, cuts[1:]):
                    last = hi == num_rows
                    sender.send_chunk(torch.as_tensor(src_slots[lo:hi]), lo, last, states[0] if last else None,
                                      src_swa if last else ())
                    assert sender.poll() == (KVPoll.Success if last else KVPoll.Transferring), sender.failure_reason()
        out = []
        for r, machine in enumerate(machines):
            machine.mark_done()
            assert machine.wait() == KVPoll.Success, machine.failure_reason()
            expected = before[r]
            for s in range(src_tp):
                expected = expected_after(
                    RankSpec(kind, page_size, s, src_tp), srcs[s][1], srcs[s][2], RankSpec(kind, page_size, r, dst_tp),
                    dsts[r][1], expected, src_slots, dst_slots, *states, src_swa, dst_swa,
                )
            out.append((dsts[r][2], expected))
        return out
    finally:
        for agent in senders + receivers:
            agent.close()


@pytest.fixture(params=["slices", "indexed"])
def copy_path(request, monkeypatch):
    """Both ways ``copy_runs`` moves rows: a slice copy per run, or one indexed
    gather/scatter (tiny test rows would otherwise always take the second)."""
    monkeypatch.setattr(transfer.plan, "SHORT_RUN_BYTES", 0 if request.param == "slices" else 1 << 40)
    return request.param


SHM_CASES = [
    (kind, page_size, src_tp, dst_tp)
    for kind in ("mha", "mla", "hybrid", "swa")
    for page_size in (1, 16)
    for src_tp, dst_tp in ((1, 1), (1, 2), (2, 1))
    if (kind != "hybrid" or src_tp == dst_tp) and (kind != "swa" or page_size == 1)  # SWA caches are per token
]
TORCH_DIST_CASES = [
    ("mha", 16, 1, 1), ("mha", 1, 1, 2), ("mha", 1, 2, 1), ("mla", 16, 2, 1), ("hybrid", 1, 1, 1), ("swa", 1, 1, 2),
]


def test_copy_runs_lands_host_rows_on_another_device(copy_path):
    """A host-staged payload scattered into a device pool (gloo between CUDA pools): the
    indices and the gathered rows must reach the destination's device. The meta device
    stands in for CUDA: it checks devices, not bytes."""
    src = torch.randn(16, 2, 4)
    dst = torch.empty(16, 2, 4, device="meta")
    runs = np.array([[1, 3, 2], [8, 9, 1]])
    assert transfer.plan.copy_runs(src.narrow(1, 0, 1), dst.narrow(1, 1, 1), runs) == 3 * 4 * src.element_size()


@pytest.mark.parametrize("kind, page_size, src_tp, dst_tp", SHM_CASES)
def test_shm_moves_exactly_the_right_rows_and_heads(kind, page_size, src_tp, dst_tp, copy_path):
    for actual, expected in _transfer("shm", kind, page_size, src_tp, dst_tp, seed=page_size * 7 + src_tp):
        assert_buffers_equal(actual, expected)


@pytest.mark.parametrize("kind, page_size, src_tp, dst_tp", TORCH_DIST_CASES)
def test_torch_dist_in_process_moves_exactly_the_right_rows_and_heads(kind, page_size, src_tp, dst_tp, copy_path):
    for actual, expected in _transfer("torch_dist", kind, page_size, src_tp, dst_tp, seed=page_size + dst_tp):
        assert_buffers_equal(actual, expected)


CHUNKED_CASES = [("mha", 1, 1, 2), ("mha", 16, 2, 1), ("mla", 4, 1, 1), ("hybrid", 1, 1, 1), ("swa", 1, 2, 1)]


@pytest.mark.parametrize("backend", ["shm", "torch_dist"])
@pytest.mark.parametrize("kind, page_size, src_tp, dst_tp", CHUNKED_CASES)
def test_chunked_pushes_land_exactly_like_one(backend, kind, page_size, src_tp, dst_tp):
    """A hand-off's rows in four chunks (state and SWA rows with the last) land the very
    bytes one push would, from every prefill rank to every decode rank."""
    for actual, expected in _transfer(backend, kind, page_size, src_tp, dst_tp, seed=3 * page_size + src_tp, num_chunks=4):
        assert_buffers_equal(actual, expected)


def test_chunks_out_of_order_or_past_the_end_fail_and_write_nothing(fake_pair):
    prefill, decode = fake_pair
    for chunks, message in (
        ([([1, 2], 1, False)], "at row 1 (chunk; 0 rows filled before)"),
        ([([1], 0, False), ([2, 3, 4], 1, True)], "3 source slots for 3 destination slots at row 1"),
        ([([1], 0, False), ([2], 1, True)], "at row 1 (last chunk; 1 rows filled before)"),
    ):
        sender = KVSender(prefill, "r")
        sender.init(KVReceiver(decode, "r", 1).send_metadata([7, 8, 9]))
        for slots, offset, last in chunks:
            sender.send_chunk(slots, offset, last)
        assert sender.poll() == KVPoll.Failed and message in sender.failure_reason()
    sender = KVSender(prefill, "r")
    sender.init(KVReceiver(decode, "r", 1).send_metadata([7, 8], dst_state_slot=2))
    sender.send_chunk([1], 0, False, src_state_slot=3)
    assert sender.poll() == KVPoll.Failed and "with the last chunk only" in sender.failure_reason()


def _landing_messages(rng, kind="mha", num_tokens=21, num_pieces=4, seed=0):
    """Prefill ranks → one decode rank (two ranks sharing the heads; hybrid: one, as Mamba
    states need equal TP): each rank's rows cut into ``num_pieces`` random ranges, one message
    each (state rows with one of them). Returns the decode layout, its buffers, the hand-off,
    the messages (rank by rank) and the expected buffers after."""
    from transfer.backends.landing import pack_rows

    src_tp = 1 if kind == "hybrid" else 2
    srcs = [build_pool(RankSpec(kind, 1, r, src_tp, seed=seed + r)) for r in range(src_tp)]
    _, dlayout, dst, _ = build_pool(RankSpec(kind, 1, 0, 1, seed=seed + 9))
    src_slots, dst_slots = request(rng, 1, num_tokens)
    state = (2, 4) if kind == "hybrid" else (None, None)
    handoff = KVHandoff("r", 1, 0, 1, dlayout, dst_slots.tolist(), state[1])
    messages, expected = [], snapshot(dst)
    for r, (_, layout, tensors, _) in enumerate(srcs):
        copies = transfer.plan.plan_copies(layout, dlayout, r, src_tp, 0, state[0] is not None)
        cuts = [0, *sorted(rng.choice(np.arange(1, num_tokens), num_pieces - 1, replace=False).tolist()), num_tokens]
        for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            with_state = i == num_pieces - 1
            mine = [c for c in copies if c.index != "state" or with_state]
            messages.append(pack_rows(layout, tensors, mine, src_slots[lo:hi], state[0] if with_state else None, (), lo))
        expected = expected_after(RankSpec(kind, 1, r, src_tp), layout, tensors, RankSpec(kind, 1, 0, 1), dlayout,
                                  expected, src_slots, dst_slots, *state)
    return dlayout, dst, handoff, messages, expected


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), num_pieces=st.integers(1, 5), kind=st.sampled_from(["mha", "hybrid"]))
def test_landing_of_partial_row_ranges_in_any_order_completes_exactly_at_the_last(seed, num_pieces, kind):
    from transfer.backends.landing import Landing

    rng = np.random.default_rng(seed)
    layout, dst, handoff, messages, expected = _landing_messages(rng, kind, num_pieces=num_pieces, seed=seed % 97)
    landing = Landing(layout, handoff)
    for i in rng.permutation(len(messages)):
        assert not landing.complete()
        landing.add(*messages[i])
        assert landing.error is None, landing.error
    assert landing.complete()
    landing.scatter(dst)
    assert_buffers_equal(dst, expected)


def test_landing_rejects_a_duplicate_or_overlapping_range_and_rows_past_the_end():
    from transfer.backends.landing import Landing

    rng = np.random.default_rng(4)
    layout, _, handoff, messages, _ = _landing_messages(rng, num_tokens=12, num_pieces=3)
    for bad, message in (
        (messages[1], "twice"),  # the same message again
        ({**messages[1][0], "ranges": {**messages[1][0]["ranges"], "token": [0, 12]}}, "twice"),  # overlapping
        ({**messages[1][0], "ranges": {**messages[1][0]["ranges"], "token": [10, 3]}}, "token rows [10, 13) for 12"),
    ):
        header, payload = bad if isinstance(bad, tuple) else (bad, messages[1][1])
        landing = Landing(layout, handoff)
        landing.add(*messages[1])
        landing.add(header, payload)
        assert message in landing.error and not landing.complete()
    landing = Landing(layout, handoff)  # a head range of the other rank's does not clash
    landing.add(*messages[1])
    landing.add(*messages[4])
    assert landing.error is None


def test_head_slicing_tp1_to_tp2_lands_each_half_at_local_offset_zero():
    (rank0, _), (rank1, _) = _transfer("shm", "mha", 1, 1, 2, seed=5, prefix_len=0, num_tokens=4)
    _, _, src, _ = build_pool(RankSpec("mha", 1, 0, 1, seed=5))
    src_slots, dst_slots = request(np.random.default_rng(5), 1, 4, 0)
    k0 = {name: t["k.0"].view(torch.uint8) for name, t in (("d0", rank0), ("d1", rank1), ("s", src))}
    for s, d in zip(src_slots, dst_slots):  # byte views: random fp16 bytes include NaNs
        assert torch.equal(k0["d0"][d], k0["s"][s, :2]) and torch.equal(k0["d1"][d], k0["s"][s, 2:])


def test_shm_push_to_a_closed_or_dead_peer_fails_not_raises():
    _, layout, src, _ = build_pool(RankSpec())
    pool, dlayout, dst, allocators = build_pool(RankSpec(shared=True))
    prefill, decode = create_agent("shm", layout, src), create_agent("shm", dlayout, dst, allocators=allocators)
    handoff = KVReceiver(decode, "r", 1).send_metadata([5, 6])
    dead = subprocess.Popen(["true"])
    dead.wait()
    ghost = KVHandoff.from_bytes(handoff.to_bytes())
    ghost.endpoint["pid"] = dead.pid
    for target in (ghost, None):
        if target is None:
            allocators[0].close()  # unlinks the files: no new peer can map them
            target = handoff
        sender = KVSender(prefill, "r")
        sender.init(target)
        sender.send([1, 2])
        assert sender.poll() == KVPoll.Failed
        assert "gone" in sender.failure_reason() or "unlinked" in sender.failure_reason()


def test_shm_endpoint_needs_shareable_buffers():
    _, layout, tensors, allocators = build_pool(RankSpec(shared=False))
    agent = create_agent("shm", layout, tensors, allocators=allocators)
    with pytest.raises(TransferError, match="cannot be mapped by another process"):
        agent.endpoint()
    with pytest.raises(TransferError, match="not in shareable memory"):
        create_agent("shm", layout, tensors).endpoint()


def test_shm_accepts_handles_instead_of_allocators():
    _, layout, src, _ = build_pool(RankSpec("hybrid", 16))
    _, dlayout, dst, allocators = build_pool(RankSpec("hybrid", 16, shared=True, seed=9))
    handles = [h for a in allocators for h in a.export_handles()]
    before = snapshot(dst)
    prefill, decode = create_agent("shm", layout, src), create_agent("shm", dlayout, dst, handles=handles)
    receiver = KVReceiver(decode, "r", 1)
    sender = KVSender(prefill, "r")
    sender.init(receiver.send_metadata(list(range(32, 48)), 1))
    sender.send(list(range(64, 80)), 0)
    receiver.mark_done()
    assert sender.poll() == receiver.poll() == KVPoll.Success
    expected = expected_after(RankSpec("hybrid", 16), layout, src, RankSpec("hybrid", 16), dlayout, before,
                              range(64, 80), range(32, 48), 0, 1)
    assert_buffers_equal(dst, expected)


def test_torch_dist_receiver_times_out_and_unreachable_peer_fails(monkeypatch):
    """A receiver whose bytes never come polls Transferring (a poll that blocked until they
    landed or timed out could not) until its land timeout passed on the test's clock."""
    _, layout, tensors, _ = build_pool(RankSpec())
    decode = create_agent("torch_dist", layout, tensors)
    prefill = create_agent("torch_dist", layout, snapshot(tensors), connect_timeout_s=0.3)
    clock = _Clock()
    monkeypatch.setattr(transfer.states, "time", clock)
    try:
        receiver = KVReceiver(decode, "r", 1, land_timeout_s=0.4)
        handoff = receiver.send_metadata([5, 6])
        receiver.mark_done()  # the completion notice came, the bytes never did
        assert receiver.poll() == KVPoll.Transferring  # polling does not block the caller
        clock.now += 0.3
        assert receiver.poll() == KVPoll.Transferring
        clock.now += 0.2
        assert receiver.poll() == KVPoll.Failed
        assert "timed out 0.4s after the completion notice waiting for 4 buffers" in receiver.failure_reason()
        ghost = KVHandoff.from_bytes(handoff.to_bytes())
        ghost.endpoint.update(port=1, agent_id="nobody")
        sender = KVSender(prefill, "r")
        sender.init(ghost)
        sender.send([1, 2])
        assert sender.poll() == KVPoll.Failed and "cannot reach the decode rank" in sender.failure_reason()
    finally:
        prefill.close()
        decode.close()


def test_torch_dist_notice_before_the_bytes_polls_without_blocking():
    """A completion notice can overtake its bytes: the receiver then reports
    Transferring (the decode loop goes on) and lands them once they arrive."""
    _, layout, src, _ = build_pool(RankSpec("mha", 16))
    _, dlayout, dst, _ = build_pool(RankSpec("mha", 16, seed=3))
    before = snapshot(dst)
    prefill, decode = create_agent("torch_dist", layout, src), create_agent("torch_dist", dlayout, dst)
    try:
        receiver = KVReceiver(decode, "r", 1)
        handoff = receiver.send_metadata(range(32, 48))
        receiver.mark_done()
        for _ in range(3):
            assert receiver.poll() == KVPoll.Transferring
        assert_buffers_equal(dst, before)  # nothing written while in flight
        sender = KVSender(prefill, "r")
        sender.init(KVHandoff.from_bytes(handoff.to_bytes()))
        sender.send(list(range(16, 32)))
        assert sender.poll() == KVPoll.Success and receiver.wait() == KVPoll.Success, receiver.failure_reason()
        expected = expected_after(RankSpec("mha", 16), layout, src, RankSpec("mha", 16), dlayout, before,
                                  range(16, 32), range(32, 48), None, None)
        assert_buffers_equal(dst, expected)
        assert not decode._landing
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("backend", ["shm", "torch_dist"])
def test_a_mamba_state_on_one_side_only_fails_the_last_chunk(backend):
    """A hybrid model's last chunk must carry the state exactly when the decode side
    reserved a state slot: without one shm reported Success over the decode slot's stale
    state and torch_dist waited for it until the landing timed out; a state the decode
    side has no slot for was skipped by shm but made torch_dist's landing fail."""
    _, layout, src, _ = build_pool(RankSpec("hybrid"))
    _, dlayout, dst, allocators = build_pool(RankSpec("hybrid", shared=True, seed=3))
    before = snapshot(dst)
    prefill = create_agent(backend, layout, src)
    decode = create_agent(backend, dlayout, dst, allocators=allocators)
    try:
        for src_state, dst_state in ((None, 2), (1, None)):
            receiver = KVReceiver(decode, "r", 1, land_timeout_s=0.2)
            sender = KVSender(prefill, "r")
            sender.init(KVHandoff.from_bytes(receiver.send_metadata([3, 4], dst_state_slot=dst_state).to_bytes()))
            sender.send([1, 2], src_state_slot=src_state)
            assert sender.poll() == KVPoll.Failed and "Mamba state" in sender.failure_reason()
            receiver.abort("the prefill side failed")
        assert_buffers_equal(dst, before)
    finally:
        prefill.close()
        decode.close()


def test_out_of_range_slots_fail_the_push():
    _, layout, src, _ = build_pool(RankSpec())
    _, dlayout, dst, allocators = build_pool(RankSpec(shared=True))
    before = snapshot(dst)
    prefill, decode = create_agent("shm", layout, src), create_agent("shm", dlayout, dst, allocators=allocators)
    for dst_slots, src_slots in (([96, 97], [1, 2]), ([1, 2], [-1, 0])):
        sender = KVSender(prefill, "r")
        sender.init(KVReceiver(decode, "r", 1).send_metadata(dst_slots))
        sender.send(src_slots)
        assert sender.poll() == KVPoll.Failed and "slots span" in sender.failure_reason()
    assert_buffers_equal(dst, before)


def test_a_push_that_fails_midway_still_waits_for_the_copies_it_issued():
    """The token rows are copied, then the state slot is out of range: the sender fails,
    and the failure must not be reported before the copies already issued ended (on CUDA
    they run asynchronously on the transfer thread's stream; the decode side frees and
    reuses the slots of a failed push at once)."""
    _, layout, src, _ = build_pool(RankSpec("hybrid"))
    _, dlayout, dst, allocators = build_pool(RankSpec("hybrid", shared=True))
    prefill, decode = create_agent("shm", layout, src), create_agent("shm", dlayout, dst, allocators=allocators)
    synced = []
    prefill._sync = lambda: synced.append(True)
    sender = KVSender(prefill, "r")
    sender.init(KVReceiver(decode, "r", 1).send_metadata([3, 4], dst_state_slot=999))
    sender.send([1, 2], src_state_slot=1)
    assert sender.poll() == KVPoll.Failed and "slots span" in sender.failure_reason()
    assert synced  # the copies of the token rows were waited for
    prefill.close()
    decode.close()


def test_torch_dist_concurrent_requests_and_cancelled_ones():
    """Four requests pushed from two threads over one pair land where they belong;
    bytes for an aborted receiver are dropped and touch nothing."""
    import threading

    _, layout, src, _ = build_pool(RankSpec("mha", 16))
    _, dlayout, dst, _ = build_pool(RankSpec("mha", 16, seed=4))
    before = snapshot(dst)
    prefill, decode = create_agent("torch_dist", layout, src), create_agent("torch_dist", dlayout, dst, timeout_s=10)
    try:
        pages = np.random.default_rng(1).permutation(np.arange(1, 7))
        jobs = []
        for i in range(5):  # request i: source page i+1 → destination page pages[i]
            receiver = KVReceiver(decode, f"r{i}", i)
            handoff = receiver.send_metadata(range(pages[i] * 16, pages[i] * 16 + 16))
            jobs.append((receiver, handoff, list(range((i + 1) * 16, (i + 2) * 16))))
        jobs[4][0].abort("client went away")

        def push(batch):
            for _, handoff, src_slots in batch:
                sender = KVSender(prefill, handoff.rid)
                sender.init(handoff)
                sender.send(src_slots)
                assert sender.poll() == KVPoll.Success, sender.failure_reason()

        threads = [threading.Thread(target=push, args=(jobs[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        expected = before
        for receiver, handoff, src_slots in jobs[:4]:
            receiver.mark_done()
            assert receiver.wait() == KVPoll.Success, receiver.failure_reason()
            expected = expected_after(RankSpec("mha", 16), layout, src, RankSpec("mha", 16), dlayout, expected,
                                      src_slots, handoff.dst_slots, None, None)
        assert_buffers_equal(dst, expected)
        assert not decode._landing  # nothing left waiting, the aborted request's bytes included
    finally:
        prefill.close()
        decode.close()


# ---- KV heads replicated across ranks (tp_size > num_kv_heads) ---------------------------------
def _replicated_heads_rank(tp_rank: int, tp_size: int, total_kv_heads: int = 2, seed: int = 0):
    """A rank of a model with ``total_kv_heads`` KV heads at TP ``tp_size``: split when
    ``tp_size <= total_kv_heads``, else every rank keeps one replicated head
    (``TPGroup.kv_heads``). Returns ``(layout, tensors)``."""

    from transfer.base import KVLayout

    per_rank = max(1, total_kv_heads // tp_size)
    start = tp_rank * per_rank if tp_size <= total_kv_heads else tp_rank // (tp_size // total_kv_heads)
    # build_pool cuts HEADS=4 heads; pick the TP size that gives ``per_rank`` of them
    _, layout, tensors, _ = build_pool(RankSpec("mha", 1, 0, 4 // per_rank, seed=seed))
    buffers = tuple(replace(b, head_start=start, total_heads=total_kv_heads) for b in layout.buffers)
    return KVLayout(layout.page_size, buffers), tensors


@pytest.mark.parametrize("src_tp, dst_tp", [(4, 1), (4, 2), (4, 4), (2, 4), (1, 4), (2, 1)])
def test_replicated_kv_heads_are_sent_by_exactly_one_prefill_rank(src_tp, dst_tp):
    """With ``tp_size > num_kv_heads`` several prefill ranks hold the same head; every
    head a decode rank holds must come from exactly one of them (torch_dist's landing
    rejects a head × row rectangle sent twice, and two ranks writing the same rows
    through shm race). ``serves`` must pick the same ranks."""
    from actors.kv_push import serves
    from transfer.plan import plan_copies

    srcs = [_replicated_heads_rank(r, src_tp) for r in range(src_tp)]
    for d in range(dst_tp):
        dlayout, _ = _replicated_heads_rank(d, dst_tp)
        handoff = KVHandoff("r", 1, d, dst_tp, dlayout, [1], backend="fake")
        for name in ("k.0", "v.1"):
            dst_b = dlayout.by_name()[name]
            sent = []
            for r, (layout, tensors) in enumerate(srcs):
                copies = [c for c in plan_copies(layout, dlayout, r, src_tp, d, False) if c.name == name]
                sent += [c.dst_head + h for c in copies for h in range(c.num_heads)]
                agent = create_agent("fake", layout, tensors, r, src_tp)
                assert serves(handoff, agent) == bool(copies), (r, d)
            assert sorted(sent) == list(range(dst_b.num_heads)), f"decode rank {d}: local heads sent {sorted(sent)}"


def test_replicated_kv_heads_land_over_torch_dist_messages():
    """Prefill TP 4 → decode TP 1 of a 2-KV-head model: the messages of every prefill
    rank it serves complete the decode rank's landing, none rejected as sent twice."""
    from actors.kv_push import serves
    from transfer.backends.landing import Landing, pack_rows
    from transfer.plan import plan_copies

    rng = np.random.default_rng(8)
    src_slots, dst_slots = request(rng, 1, 9)
    dlayout, dst = _replicated_heads_rank(0, 1, seed=50)
    handoff = KVHandoff("r", 1, 0, 1, dlayout, dst_slots.tolist(), backend="fake")
    landing = Landing(dlayout, handoff)
    for r in range(4):
        layout, tensors = _replicated_heads_rank(r, 4, seed=r)
        if not serves(handoff, create_agent("fake", layout, tensors, r, 4)):
            continue
        copies = plan_copies(layout, dlayout, r, 4, 0, False)
        landing.add(*pack_rows(layout, tensors, copies, src_slots, None))
        assert landing.error is None, landing.error
    assert landing.complete()


def test_shm_drops_the_mapping_of_a_decode_process_that_is_gone():
    """A prefill agent maps each decode rank's shared memory once. When that process
    dies its mapping must go (it pins the dead pools' memory: unlinked files live on
    while mapped): at the first push that finds it gone, and when a new peer (its
    replacement) is mapped even if nothing is pushed to the dead one again."""
    _, layout, src, _ = build_pool(RankSpec())
    _, dlayout, dst, allocators = build_pool(RankSpec(shared=True))
    prefill, decode = create_agent("shm", layout, src), create_agent("shm", dlayout, dst, allocators=allocators)
    try:
        wire = KVReceiver(decode, "r", 1).send_metadata([5, 6]).to_bytes()
        for sweep in (False, True):
            child = subprocess.Popen(["sleep", "30"])
            ghost = KVHandoff.from_bytes(wire)  # the same files, as if a decode process of pid ``child`` exported them
            ghost.endpoint.update(pid=child.pid, agent_id=f"ghost-{sweep}")
            sender = KVSender(prefill, "r")
            sender.init(ghost)
            sender.send([1, 2])
            assert sender.poll() == KVPoll.Success, sender.failure_reason()
            assert f"ghost-{sweep}" in prefill._peers
            child.kill()
            child.wait()
            if sweep:  # a push to another (live) peer maps it and forgets the dead one
                push_one(prefill, decode, [3, 4], [7, 8])
            else:
                sender = KVSender(prefill, "r")
                sender.init(ghost)
                sender.send([1, 2])
                assert sender.poll() == KVPoll.Failed and "is gone" in sender.failure_reason()
            assert f"ghost-{sweep}" not in prefill._peers
    finally:
        prefill.close()
        decode.close()


def test_torch_dist_a_bad_message_fails_its_hand_off_and_the_pair_serves_on():
    """A message the decode side cannot take (here a copy entry of the wrong arity) fails
    the hand-off it names; the pair's reader must go on serving the next messages (it
    used to die on it: every later transfer over the pair timed out)."""
    import msgpack

    _, layout, src, _ = build_pool(RankSpec("mha", 16))
    _, dlayout, dst, _ = build_pool(RankSpec("mha", 16, seed=3))
    before = snapshot(dst)
    prefill = create_agent("torch_dist", layout, src, timeout_s=2)
    decode = create_agent("torch_dist", dlayout, dst, timeout_s=2)
    try:
        victim = KVReceiver(decode, "bad", 1, land_timeout_s=5)
        handoff = victim.send_metadata(range(32, 48))
        link = prefill._link(handoff.endpoint, "gloo")
        header = {"ranges": {"token": [0, 16], "swa": [0, 0], "state": [0, 0]}, "copies": [["k.0", 0]],
                  "tag": handoff.endpoint["tag"]}
        link.send(msgpack.packb(header), torch.zeros(64, dtype=torch.uint8))
        link.send(b"\xc1 not msgpack", torch.zeros(8, dtype=torch.uint8))  # no tag to fail: dropped
        victim.mark_done()
        assert victim.wait() == KVPoll.Failed and "malformed message" in victim.failure_reason()
        push_one(prefill, decode, range(16, 32), range(48, 64))
        expected = expected_after(RankSpec("mha", 16), layout, src, RankSpec("mha", 16), dlayout, before,
                                  range(16, 32), range(48, 64), None, None)
        assert_buffers_equal(dst, expected)
    finally:
        prefill.close()
        decode.close()
