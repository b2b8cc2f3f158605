"""The polled per-request state machines: :class:`KVSender` and :class:`KVReceiver`.

Per request and rank pair one :class:`KVSender` (prefill side) and one
:class:`KVReceiver` (decode side). Both are polled state machines
(:class:`KVPoll`, totally ordered as SGLang's)::

    sender:   Bootstrapping --init(handoff)--> WaitingForInput --send_chunk()--> Transferring
                  --send_chunk(..., is_last=True)--> Success
    receiver: Bootstrapping --send_metadata()--> WaitingForInput --mark_done()--> Transferring --landed--> Success
    any state --timeout / abort / peer failure--> Failed (failure_reason says why)

A sender that fails after taking the hand-off tells its decode rank where the
backend can (``TransferAgent.abort``; SGLang's sender syncs Failed to the
decode endpoint): that receiver, still waiting for the notice, fails at its
next poll with the sender's reason instead of at its timeout.

With chunked prefill a sender pushes a request's rows in several chunks as
they are computed (SGLang's ``TransferKVChunk``): each chunk names the
destination rows it fills (``offset``), in order; the last one also carries
the Mamba state and the sliding-window rows. ``send()`` is the one-chunk case.

A receiver never blocks its caller: after the completion notice
(``mark_done``) each ``poll`` asks the agent whether the bytes are in this
rank's buffers (push backends: at once; message backends: once the last part
arrived), so a decode loop keeps decoding while a transfer finishes.
"""

from __future__ import annotations

import enum
import os
import random
import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

from transfer.handoff import KVHandoff, LayoutMismatchError, TransferError, check_compatible

if TYPE_CHECKING:
    from transfer.base import TransferAgent

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

    def fail(self, reason: str) -> None:
        """Failed, and the decode rank is told (``agent.abort``) once the hand-off was taken."""
        pending = self._state not in (KVPoll.Failed, KVPoll.Success)
        super().fail(reason)
        if pending and self.handoff is not None:
            self.agent.abort(self.handoff, reason)

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
        """Before the notice, also Failed once the agent says the bytes cannot come (the
        sender gave up); after it, Success once they landed."""
        state = super().poll()
        if state == KVPoll.WaitingForInput:
            reason = self.agent.failed(self.handoff)
            if reason is not None:
                self.fail(reason)
            return self._state
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
