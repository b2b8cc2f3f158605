"""The contract of a KV transfer: states, layouts, the hand-off message, agents.

One request's KV moves from a prefill rank to a decode rank by *push*: the
decode rank reserves slots and answers with a :class:`KVHandoff` (its slot
list and layout); the prefill rank, once its forward wrote the KV, copies the
rows of its source slots into the decode rank's destination slots. Control
messages (the hand-off, the completion notice) travel between the workers'
actors; the bytes travel through a backend (shared memory, CUDA IPC,
``torch.distributed``), never through Ray's object store.

Per rank process there is one :class:`TransferAgent` (it owns the backend's
connections and the attached peer buffers); per request and rank pair one
:class:`KVSender` (prefill side) and one :class:`KVReceiver` (decode side).
Both are polled state machines (:class:`KVPoll`, totally ordered as SGLang's)::

    sender:   Bootstrapping --init(handoff)--> WaitingForInput --send_chunk()--> Transferring
                  --send_chunk(..., is_last=True)--> Success
    receiver: Bootstrapping --send_metadata()--> WaitingForInput --mark_done()--> Transferring --landed--> Success
    any state --timeout / abort / peer failure--> Failed (failure_reason says why)

With chunked prefill a sender pushes a request's rows in several chunks as
they are computed (SGLang's ``TransferKVChunk``): each chunk names the
destination rows it fills (``offset``), in order; the last one also carries
the Mamba state and the sliding-window rows. ``send()`` is the one-chunk case.

A receiver never blocks its caller: after the completion notice
(``mark_done``) each ``poll`` asks the agent whether the bytes are in this
rank's buffers (push backends: at once; message backends: once the last part
arrived), so a decode loop keeps decoding while a transfer finishes.

Head ranges: every head-sharded buffer row holds heads ``[head_start,
head_start + num_heads)`` of ``total_heads``; a sender copies the
intersection of its range and the receiver's, so prefill and decode may use
different TP sizes. Replicated buffers (MLA latent, ``head_axis=None``) are
copied whole from one chosen source rank; Mamba states need equal head
ranges on both sides. Sliding-window layers (``"swa"`` buffers) move only
the prompt's last window, between SWA slot lists of their own.
"""

from __future__ import annotations

import abc
import enum
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import msgpack

# 4: a hand-off's rows may arrive in several pushes (row ranges in the pushed header)
HANDOFF_VERSION = 4
# Fault injection for tests (SGLang's DISAGGREGATION_TEST_FAILURE_PROB): each poll of a
# transfer still in flight fails it with this probability.
FAILURE_PROB_ENV = "RAYDIX_TEST_TRANSFER_FAILURE_PROB"
_fault_rng = random.Random()


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferError(RuntimeError):
    """A transfer failed (timeout, abort, dead peer, bad message)."""


class LayoutMismatchError(TransferError):
    """The two sides' KV layouts cannot be matched (dtype, row shape, heads, page size)."""


# ---- layouts ------------------------------------------------------------------------
@dataclass(frozen=True)
class BufferLayout:
    """One transferable buffer of a rank's pools.

    ``index`` says what addresses its rows: ``"token"`` (KV slot numbers),
    ``"swa"`` (SWA slot numbers: sliding-window layers) or ``"state"`` (Mamba
    state slots). ``row_shape``/``dtype`` describe one row on *this* rank;
    ``head_axis`` is the axis of ``row_shape`` that holds heads (``None``:
    replicated on every rank, e.g. the MLA latent).
    """

    name: str
    index: str
    row_shape: Tuple[int, ...]
    dtype: str
    head_axis: Optional[int] = None
    head_start: int = 0
    total_heads: int = 0

    @property
    def num_heads(self) -> int:
        return self.row_shape[self.head_axis] if self.head_axis is not None else 0

    def to_wire(self) -> list:
        return [self.name, self.index, list(self.row_shape), self.dtype, self.head_axis, self.head_start, self.total_heads]

    @classmethod
    def from_wire(cls, raw: Sequence) -> "BufferLayout":
        name, index, shape, dtype, axis, start, total = raw
        return cls(name, index, tuple(shape), dtype, axis, start, total)


@dataclass(frozen=True)
class KVLayout:
    page_size: int
    buffers: Tuple[BufferLayout, ...]

    def by_name(self) -> Dict[str, BufferLayout]:
        return {b.name: b for b in self.buffers}


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise :class:`LayoutMismatchError` naming the first difference that makes
    a transfer from ``src`` to ``dst`` impossible."""
    if src.page_size != dst.page_size:
        raise LayoutMismatchError(f"page_size differs: prefill {src.page_size}, decode {dst.page_size}")
    s, d = src.by_name(), dst.by_name()
    if set(s) != set(d):
        only_s, only_d = sorted(set(s) - set(d))[:4], sorted(set(d) - set(s))[:4]
        swa = any(b.index == "swa" for b in src.buffers + dst.buffers)
        hint = " (the split into sliding-window and full-attention layers differs)" if swa else ""
        raise LayoutMismatchError(f"buffers differ: only on prefill {only_s}, only on decode {only_d}{hint}")
    for name, a in s.items():
        b = d[name]
        if (a.index, a.dtype, a.head_axis) != (b.index, b.dtype, b.head_axis):
            raise LayoutMismatchError(
                f"{name}: prefill (index={a.index}, dtype={a.dtype}, head_axis={a.head_axis}) vs "
                f"decode (index={b.index}, dtype={b.dtype}, head_axis={b.head_axis})"
            )
        if a.head_axis is None:
            if a.row_shape != b.row_shape:
                hint = " (Mamba states need the same TP size on prefill and decode)" if a.index == "state" else ""
                raise LayoutMismatchError(f"{name}: row shape {a.row_shape} vs {b.row_shape}{hint}")
            continue
        rest_a = a.row_shape[: a.head_axis] + a.row_shape[a.head_axis + 1 :]
        rest_b = b.row_shape[: b.head_axis] + b.row_shape[b.head_axis + 1 :]
        if rest_a != rest_b or a.total_heads != b.total_heads:
            raise LayoutMismatchError(
                f"{name}: per-head shape {rest_a} of {a.total_heads} heads vs {rest_b} of {b.total_heads} heads"
            )
        if a.index == "state" and (a.head_start, a.num_heads) != (b.head_start, b.num_heads):
            raise LayoutMismatchError(
                f"{name}: Mamba state heads [{a.head_start}, +{a.num_heads}) vs [{b.head_start}, +{b.num_heads}):"
                " hybrid models need the same TP size on prefill and decode"
            )


def head_overlap(src: BufferLayout, dst: BufferLayout) -> Optional[Tuple[int, int]]:
    """Global head range ``[lo, hi)`` both ranks hold, or ``None``."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_heads, dst.head_start + dst.num_heads)
    return (lo, hi) if lo < hi else None


# ---- the hand-off ------------------------------------------------------------------
@dataclass(frozen=True)
class KVHandoff:
    """Decode rank → prefill rank: where one request's KV must land.

    ``dst_slots[i]`` receives the KV of prompt token ``dst_prefix_len + i``
    (tokens before ``dst_prefix_len`` the decode side already holds).
    ``dst_swa_slots[j]`` receives the sliding-window layers' KV of prompt token
    ``prompt_len - len(dst_swa_slots) + j``: the list is aligned to the end of
    the prompt and covers the tokens still inside the window there, less those
    the decode side holds (empty for models without sliding-window layers).
    ``endpoint`` is the backend's address of the decode rank's agent.
    ``deadline`` (epoch seconds, ``None``: none) is when the decode side stops
    waiting: a sender must not start writing after it, because from then on
    the destination slots may be given to another request (same-node push
    backends share one clock; pull backends drop late bytes anyway).
    """

    rid: str
    room: int
    tp_rank: int
    tp_size: int
    layout: KVLayout
    dst_slots: List[int]
    dst_state_slot: Optional[int] = None
    dst_prefix_len: int = 0
    backend: str = "fake"
    endpoint: Dict = field(default_factory=dict)
    deadline: Optional[float] = None
    dst_swa_slots: List[int] = field(default_factory=list)
    version: int = HANDOFF_VERSION

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "version": self.version, "rid": self.rid, "room": self.room, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "page_size": self.layout.page_size,
                "buffers": [b.to_wire() for b in self.layout.buffers], "dst_slots": list(self.dst_slots),
                "dst_state_slot": self.dst_state_slot, "dst_prefix_len": self.dst_prefix_len,
                "backend": self.backend, "endpoint": self.endpoint, "deadline": self.deadline,
                "dst_swa_slots": list(self.dst_swa_slots),
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVHandoff":
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise TransferError(f"malformed hand-off message: {exc}") from exc
        version = raw.get("version") if isinstance(raw, dict) else None
        if version != HANDOFF_VERSION:
            raise TransferError(f"hand-off version {version!r}, this build speaks {HANDOFF_VERSION}")
        try:
            _check_wire(raw)
            layout = KVLayout(raw["page_size"], tuple(BufferLayout.from_wire(b) for b in raw["buffers"]))
            return cls(
                raw["rid"], raw["room"], raw["tp_rank"], raw["tp_size"], layout, list(raw["dst_slots"]),
                raw["dst_state_slot"], raw["dst_prefix_len"], raw["backend"], raw["endpoint"], raw["deadline"],
                list(raw["dst_swa_slots"]), version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed hand-off message: {exc!r}") from exc


INDEX_KINDS = ("token", "swa", "state")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_wire(raw: Dict) -> None:
    """Raise ValueError naming the first field of a hand-off map (version checked)
    whose type or value is impossible: slots are non-negative ints (a float would be
    truncated to another slot by the run cutter), ranks lie inside the TP size, every
    buffer's head axis and head range fit its row."""

    def bad(name: str, why: str):
        raise ValueError(f"{name} {why}: {raw.get(name)!r}"[:200])

    def slot_list(name: str) -> None:
        v = raw[name]
        if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
            bad(name, "is not a list of non-negative ints")

    for name in ("rid", "backend"):
        if not isinstance(raw[name], str):
            bad(name, "is not a string")
    for name, low in (("room", None), ("tp_size", 1), ("tp_rank", 0), ("page_size", 1), ("dst_prefix_len", 0)):
        if not _is_int(raw[name]) or (low is not None and raw[name] < low):
            bad(name, "is not an int" if low is None else f"is not an int >= {low}")
    if raw["tp_rank"] >= raw["tp_size"]:
        bad("tp_rank", f"is not below tp_size {raw['tp_size']}")
    slot_list("dst_slots")
    slot_list("dst_swa_slots")
    if raw["dst_state_slot"] is not None and not (_is_int(raw["dst_state_slot"]) and raw["dst_state_slot"] >= 0):
        bad("dst_state_slot", "is neither None nor a non-negative int")
    if not isinstance(raw["endpoint"], dict):
        bad("endpoint", "is not a map")
    deadline = raw["deadline"]
    if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)):
        bad("deadline", "is neither None nor a number")
    buffers = raw["buffers"]
    if not isinstance(buffers, list):
        bad("buffers", "is not a list")
    for b in buffers:
        if not isinstance(b, list) or len(b) != 7:
            bad("buffers", f"entry {b!r} is not [name, index, shape, dtype, head_axis, head_start, total_heads]")
        name, index, shape, dtype, axis, start, total = b
        ok = (
            isinstance(name, str) and index in INDEX_KINDS and isinstance(dtype, str)
            and isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)
            and _is_int(start) and _is_int(total) and start >= 0 and total >= 0
            and (axis is None or (_is_int(axis) and 0 <= axis < len(shape)
                                  and (not total or start + shape[axis] <= total)))  # its heads fit the model's
        )
        if not ok:
            bad("buffers", f"entry {b!r} is not a valid buffer layout")


# ---- the state machines ----------------------------------------------------------------
class _Polled:
    """A state with a deadline: ``poll()`` turns an expired wait into Failed.

    Failed and Success are final, also when another thread aborts (``KVPusher.cancel``
    aborts a sender its transfer thread may be finishing): each change looks at the
    state and writes it under one lock."""

    def __init__(self, timeout_s: Optional[float]):
        self._state = KVPoll.Bootstrapping
        self._reason: Optional[str] = None
        self._timeout_s = timeout_s
        self._since = time.monotonic()
        self._change = threading.Lock()

    def _set(self, state: KVPoll) -> None:
        with self._change:
            if self._state != KVPoll.Failed:
                self._state = state
                self._since = time.monotonic()

    def fail(self, reason: str) -> None:
        with self._change:
            if self._state not in (KVPoll.Failed, KVPoll.Success):
                self._state, self._reason = KVPoll.Failed, reason

    def poll(self) -> KVPoll:
        waiting = self._state in (KVPoll.Bootstrapping, KVPoll.WaitingForInput)
        if waiting and self._timeout_s is not None and time.monotonic() - self._since > self._timeout_s:
            self.fail(f"timed out after {self._timeout_s:.1f}s in {self._state.name}")
        if self._state not in (KVPoll.Failed, KVPoll.Success):
            prob = float(os.environ.get(FAILURE_PROB_ENV) or 0.0)
            if prob and _fault_rng.random() < prob:
                self.fail(f"injected failure in {self._state.name} ({FAILURE_PROB_ENV}={prob})")
        return self._state

    def failure_reason(self) -> Optional[str]:
        return self._reason

    def abort(self, reason: str = "aborted") -> None:
        self.fail(reason)


class KVSender(_Polled):
    """Prefill side of one request's transfer to one decode rank.

    ``timeout_s`` bounds Bootstrapping (no hand-off yet) and WaitingForInput
    (hand-off taken, the first chunk not computed); between chunks the
    hand-off's deadline bounds it.
    """

    def __init__(self, agent: "TransferAgent", rid: str, timeout_s: Optional[float] = None):
        super().__init__(timeout_s)
        self.agent, self.rid = agent, rid
        self.handoff: Optional[KVHandoff] = None
        self.bytes_sent = 0
        self.rows_sent = 0  # destination rows the chunks so far filled

    def init(self, handoff: KVHandoff) -> None:
        """Take the decode rank's hand-off (layout checked) → WaitingForInput."""
        if handoff.backend != self.agent.backend_name:
            self.fail(f"hand-off is for backend {handoff.backend!r}, this rank's agent is {self.agent.backend_name!r}")
            raise TransferError(self._reason)
        try:
            check_compatible(self.agent.layout, handoff.layout)
        except LayoutMismatchError as exc:
            self.fail(str(exc))
            raise
        self.handoff = handoff
        self._set(KVPoll.WaitingForInput)

    def send(
        self, src_slots: Sequence[int], src_state_slot: Optional[int] = None, src_swa_slots: Sequence[int] = ()
    ) -> None:
        """Copy all of the request's KV in one chunk: see :meth:`send_chunk`."""
        self.send_chunk(src_slots, 0, True, src_state_slot, src_swa_slots)

    def send_chunk(
        self, src_slots: Sequence[int], offset: int = 0, is_last: bool = True, src_state_slot: Optional[int] = None,
        src_swa_slots: Sequence[int] = (),
    ) -> None:
        """Copy the KV of ``src_slots`` into ``dst_slots[offset : offset + len(src_slots)]``.

        Chunks go in order, each starting where the previous one ended; the
        last (``is_last``) ends at the end of ``dst_slots`` and alone carries
        the Mamba state slot and the SWA slots (matching ``dst_swa_slots``),
        which only then hold their final values. The hand-off's deadline is
        checked before every chunk. Failures end in Failed, not raises.
        """
        state = self.poll()  # (a passed deadline fails it here)
        if state == KVPoll.Failed:  # timed out or aborted meanwhile: the reason is recorded
            return
        if state not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            raise TransferError(f"send() in state {state.name} for {self.rid}")
        end, num_dst = offset + len(src_slots), len(self.handoff.dst_slots)
        if offset != self.rows_sent or end > num_dst or (is_last and end != num_dst):
            what = "last chunk" if is_last else "chunk"
            self.fail(f"{len(src_slots)} source slots for {num_dst} destination slots at row {offset} "
                      f"({what}; {self.rows_sent} rows filled before)")
            return
        if not is_last and (src_state_slot is not None or len(src_swa_slots)):
            self.fail("the Mamba state and the SWA rows go with the last chunk only")
            return
        if is_last and len(src_swa_slots) != len(self.handoff.dst_swa_slots):
            self.fail(f"{len(src_swa_slots)} source SWA slots for {len(self.handoff.dst_swa_slots)} destination SWA slots")
            return
        dst_state = self.handoff.dst_state_slot
        has_state = any(b.index == "state" for b in self.handoff.layout.buffers)
        if is_last and has_state and (src_state_slot is None) != (dst_state is None):
            self.fail(f"the Mamba state goes from source state slot {src_state_slot} to destination state slot "
                      f"{dst_state}: both sides need one")
            return
        self._set(KVPoll.Transferring)
        try:
            self.bytes_sent += self.agent.push(self.handoff, src_slots, src_state_slot, src_swa_slots, offset)
        except Exception as exc:  # a dead peer or unmapped buffer: the request fails, the worker lives
            self.fail(f"{type(exc).__name__}: {exc}")
            return
        self.rows_sent = end
        if is_last:
            self._set(KVPoll.Success)

    def poll(self) -> KVPoll:
        """Also Failed once the hand-off's deadline passed while waiting for a chunk
        (WaitingForInput, or Transferring between chunks)."""
        state = super().poll()
        if state in (KVPoll.WaitingForInput, KVPoll.Transferring) and self.handoff is not None:
            deadline = self.handoff.deadline
            if deadline is not None and time.time() > deadline:
                self.fail(f"the decode side's deadline passed {time.time() - deadline:.1f}s ago: its slots may be reused")
        return self._state


class KVReceiver(_Polled):
    """Decode side of one request's transfer from the prefill worker.

    ``send_metadata`` builds the hand-off (→ WaitingForInput). The sender's
    completion notice (through the workers' control plane) calls
    :meth:`mark_done` (→ Transferring); ``poll`` turns Success once the agent
    reports the bytes landed, or Failed if they have not ``land_timeout_s``
    after the notice.
    """

    def __init__(self, agent: "TransferAgent", rid: str, room: int, timeout_s: Optional[float] = None,
                 land_timeout_s: float = 30.0):
        super().__init__(timeout_s)
        self.agent, self.rid, self.room = agent, rid, room
        self.land_timeout_s = land_timeout_s
        self.handoff: Optional[KVHandoff] = None

    def send_metadata(
        self, dst_slots: Sequence[int], dst_state_slot: Optional[int] = None, dst_prefix_len: int = 0,
        dst_swa_slots: Sequence[int] = (),
    ) -> KVHandoff:
        deadline = None if self._timeout_s is None else time.time() + self._timeout_s
        self.handoff = KVHandoff(
            self.rid, self.room, self.agent.tp_rank, self.agent.tp_size, self.agent.layout, [int(s) for s in dst_slots],
            dst_state_slot, dst_prefix_len, self.agent.backend_name, self.agent.endpoint(), deadline,
            [int(s) for s in dst_swa_slots],
        )
        self.agent.expect(self.handoff)
        self._set(KVPoll.WaitingForInput)
        return self.handoff

    def fail(self, reason: str) -> None:
        """Failed, and the agent stops waiting for this hand-off's bytes."""
        pending = self._state not in (KVPoll.Failed, KVPoll.Success)
        super().fail(reason)
        if pending and self.handoff is not None:
            self.agent.cancel(self.handoff)

    def mark_done(self) -> None:
        """The prefill side says every rank pushed: from now on wait only for the bytes."""
        if self.poll() == KVPoll.WaitingForInput:
            self._set(KVPoll.Transferring)
            self.poll()

    def poll(self) -> KVPoll:
        state = super().poll()
        if state != KVPoll.Transferring:
            return state
        try:
            landed = self.agent.landed(self.handoff)
        except Exception as exc:
            self.fail(f"{type(exc).__name__}: {exc}")
            return self._state
        if landed:
            self._set(KVPoll.Success)
        elif time.monotonic() - self._since > self.land_timeout_s:
            self.fail(f"timed out {self.land_timeout_s:.1f}s after the completion notice waiting for "
                      f"{self.agent.missing(self.handoff)}")
        return self._state

    def wait(self, interval_s: float = 0.0005) -> KVPoll:
        """Poll until the transfer is no longer in flight (for callers with nothing else to do)."""
        while True:
            state = self.poll()
            if state != KVPoll.Transferring:
                return state
            time.sleep(interval_s)


class TransferAgent(abc.ABC):
    """One per rank process: this rank's transferable buffers and the backend.

    ``buffers`` maps every name of ``layout.buffers`` to the tensor whose rows
    are addressed by slot (``[rows, *row_shape]``).
    """

    backend_name = "abstract"

    def __init__(
        self,
        layout: KVLayout,
        buffers: Dict[str, "object"],
        tp_rank: int = 0,
        tp_size: int = 1,
        allocators: Sequence["object"] = (),
    ):
        missing = [b.name for b in layout.buffers if b.name not in buffers]
        if missing:
            raise ValueError(f"layout names buffers this rank does not have: {missing[:4]}")
        self.layout, self.buffers, self.tp_rank, self.tp_size = layout, buffers, tp_rank, tp_size
        # The BufferAllocators the buffers came from (``transfer.layout.pool_allocators``):
        # same-node backends export their handles in ``endpoint()``; others ignore them.
        self.allocators = tuple(allocators)

    @abc.abstractmethod
    def endpoint(self) -> Dict:
        """msgpack-able address peers use to reach this agent's buffers."""

    @abc.abstractmethod
    def push(
        self, handoff: KVHandoff, src_slots: Sequence[int], src_state_slot: Optional[int], src_swa_slots: Sequence[int],
        offset: int = 0,
    ) -> int:
        """Prefill side: copy row ``src_slots[i]`` into ``handoff.dst_slots[offset + i]`` (and
        the state and SWA rows, whole); returns bytes moved. One hand-off may take several
        pushes of disjoint row ranges; only the one with the state and SWA rows has them."""

    def expect(self, handoff: KVHandoff) -> None:
        """Decode side: get ready to receive (pull backends post their receives here)."""

    def landed(self, handoff: KVHandoff) -> bool:
        """Decode side, after the completion notice, never blocking: whether the bytes
        of ``handoff`` (every part of them) are in this rank's buffers (push backends: always). Raises
        TransferError when they cannot arrive any more."""
        return True

    def missing(self, handoff: KVHandoff) -> str:
        """What ``handoff`` still waits for, in words (for timeout messages)."""
        return "the bytes"

    def cancel(self, handoff: KVHandoff) -> None:
        """Decode side: stop waiting for ``handoff`` (its receiver failed); bytes that
        still arrive for it are dropped. Never raises."""

    def close(self) -> None:
        """Drop peer mappings and connections."""


_BACKENDS: Dict[str, type] = {}


def register_backend(name: str):
    def wrap(cls):
        cls.backend_name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def create_agent(name: str, layout: KVLayout, buffers: Dict, tp_rank: int = 0, tp_size: int = 1, **kwargs) -> TransferAgent:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](layout, buffers, tp_rank, tp_size, **kwargs)


def known_backends() -> List[str]:
    return sorted(_BACKENDS)
