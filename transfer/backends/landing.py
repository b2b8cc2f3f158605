"""Packing rows into one message and landing them on the other side.

For backends that move bytes as messages (``torch_dist``), not as direct
writes: the sender gathers every planned buffer's rows of one push (a
prefill chunk, or the whole prompt) into one contiguous uint8 payload
(:func:`pack_rows`); the receiver tracks which heads of which rows of which
buffers a hand-off still misses (:class:`Landing`) and scatters the payloads
once everything arrived. The header's ``ranges`` give, per row index
(``token``, ``swa``, ``state``), the destination rows ``[offset, offset +
count)`` the message fills; its ``copies`` are ``[name, dst_head, num_heads,
offset, nbytes]``, payload offsets 16-byte aligned.

Payloads live on the host (``pack_rows``' default) or on the pools' CUDA
device (the NCCL data path): a device payload must be complete on the
device before :meth:`Landing.add` takes it; :meth:`Landing.scatter` copies
on the calling thread's current stream and marks the payload used there,
so its memory is not handed out again before those copies ran.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Tuple

import torch

from transfer.base import KVHandoff, KVLayout
from transfer.plan import BufferCopy, check_slots, copy_runs
from transfer.runs import as_slot_array, slot_runs

_ALIGN = 16


def _row_bytes(view: torch.Tensor) -> int:
    return view[0].numel() * view.element_size() if view.shape[0] else 0


def pack_rows(
    layout: KVLayout, buffers: Dict[str, torch.Tensor], copies: List[BufferCopy], src_slots,
    src_state_slot: Optional[int], src_swa_slots=(), offset: int = 0, device="cpu",
) -> Tuple[Dict, torch.Tensor]:
    """``(header, payload)`` holding the rows of ``copies``: one slice copy per
    run of consecutive source slots into the payload, a uint8 tensor on
    ``device`` (gathered on that device's current stream). ``src_slots`` fill
    the hand-off's token rows from ``offset`` on; state and SWA rows go whole."""
    token_slots, swa_slots = as_slot_array(src_slots), as_slot_array(src_swa_slots)
    state_slots = as_slot_array([] if src_state_slot is None else [src_state_slot])
    ranges = {"token": [offset, int(token_slots.size)], "swa": [0, int(swa_slots.size)],
              "state": [0, int(state_slots.size)]}
    planned, offset = [], 0
    for copy in copies:
        slots = {"token": token_slots, "swa": swa_slots, "state": state_slots}[copy.index]
        if not slots.size:
            continue
        src = copy.src_view(buffers[copy.name])
        check_slots(f"{copy.name} source", slots, src.shape[0])
        nbytes = slots.size * _row_bytes(src)
        planned.append((copy, src, slots, offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    payload = torch.empty(offset, dtype=torch.uint8, device=device)
    entries = []
    for copy, src, slots, offset, nbytes in planned:
        stage = payload.narrow(0, offset, nbytes).view(src.dtype).view(slots.size, *src.shape[1:])
        copy_runs(src, stage, slot_runs(slots))
        entries.append([copy.name, copy.dst_head, copy.num_heads, offset, nbytes])
    return {"ranges": ranges, "copies": entries}, payload


def _overlapping(received: List[Tuple[int, int]], rows: Tuple[int, int]) -> Optional[Tuple[int, int]]:
    """The range of ``received`` (sorted, disjoint) that ``rows`` overlaps, if any: only
    the neighbours of its insertion point can (O(log n) per message, not O(n))."""
    i = bisect.bisect_left(received, rows)
    if i < len(received) and received[i][0] < rows[1]:
        return received[i]
    if i > 0 and received[i - 1][1] > rows[0]:
        return received[i - 1]
    return None


class Landing:
    """Decode side of one hand-off: the payloads that arrived and what they cover.

    A message fills, for each buffer it names, a rectangle of heads × rows
    (heads ``[dst_head, dst_head + num_heads)`` of this rank's, or the one
    "head" of a replicated buffer; rows from the header's range for the
    buffer's index). Rectangles of one buffer must not overlap — a part sent
    twice is an error, not a retry — so the hand-off is complete exactly when
    the cells received equal the cells needed (local heads × destination
    rows, summed over the buffers that have rows).
    """

    def __init__(self, layout: KVLayout, handoff: KVHandoff):
        self.layout = layout.by_name()
        self.slots = {
            "token": as_slot_array(handoff.dst_slots), "swa": as_slot_array(handoff.dst_swa_slots),
            "state": as_slot_array([] if handoff.dst_state_slot is None else [handoff.dst_state_slot]),
        }
        self.cells_missing: Dict[str, int] = {}  # buffer -> heads × rows not yet received
        # buffer -> (head lo, head hi) -> the row ranges received for those heads, sorted and disjoint
        self.pieces: Dict[str, Dict[Tuple[int, int], List[Tuple[int, int]]]] = {}
        for b in layout.buffers:
            rows = self.slots[b.index].size
            if rows:
                self.cells_missing[b.name] = self._heads(b) * rows
                self.pieces[b.name] = {}
        self.num_missing = sum(self.cells_missing.values())
        self.parts: List[Tuple[Dict, list, torch.Tensor]] = []
        self.error: Optional[str] = None

    @staticmethod
    def _heads(b) -> int:
        return b.num_heads if b.head_axis is not None else 1

    def add(self, header: Dict, payload: torch.Tensor) -> None:
        """Record one message; a bad one sets ``error`` (the hand-off then fails)."""
        ranges = header["ranges"]
        for index, (offset, count) in ranges.items():
            if index not in self.slots:
                self.error = f"prefill sent rows of an unknown index {index!r}"
                return
            total = self.slots[index].size
            if offset < 0 or count < 0 or offset + count > total:
                self.error = f"prefill sent {index} rows [{offset}, {offset + count}) for {total} destination slots"
                return
        for name, dst_head, num_heads, _, _ in header["copies"]:
            if name not in self.cells_missing:
                self.error = f"prefill sent buffer {name!r}, which this hand-off does not take"
                return
            b = self.layout[name]
            offset, count = ranges[b.index]
            heads = (0, 1) if b.head_axis is None else (dst_head, dst_head + num_heads)
            if heads[0] < 0 or heads[1] > self._heads(b) or heads[0] >= heads[1]:
                self.error = f"prefill sent heads [{heads[0]}, {heads[1]}) of {name!r}, which has {self._heads(b)} here"
                return
            rows = (offset, offset + count)
            by_heads = self.pieces[name]
            for (lo, hi), received in by_heads.items():  # a few head ranges (one per prefill rank)
                clash = _overlapping(received, rows) if lo < heads[1] and heads[0] < hi else None
                if clash is not None:
                    self.error = (f"prefill sent heads [{heads[0]}, {heads[1]}) × rows [{rows[0]}, {rows[1]}) of "
                                  f"{name!r} twice (overlapping heads [{lo}, {hi}) × rows [{clash[0]}, {clash[1]}))")
                    return
            bisect.insort(by_heads.setdefault(heads, []), rows)
            cells = (heads[1] - heads[0]) * count
            self.cells_missing[name] -= cells
            self.num_missing -= cells
        self.parts.append((ranges, header["copies"], payload))

    def complete(self) -> bool:
        return self.error is None and self.num_missing == 0

    def missing(self) -> str:
        names = [name for name, cells in self.cells_missing.items() if cells]
        return f"{len(names)} buffers ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"

    def scatter(self, buffers: Dict[str, torch.Tensor]) -> int:
        """Write every payload into ``buffers``: one slice copy per run of
        consecutive destination slots. Returns the bytes written."""
        moved = 0
        for ranges, entries, payload in self.parts:
            if payload.is_cuda:  # freed after this returns: not reused before the copies below ran
                payload.record_stream(torch.cuda.current_stream(payload.device))
            for name, dst_head, num_heads, offset, nbytes in entries:
                b = self.layout[name]
                copy = BufferCopy(name, b.index, b.head_axis, 0, dst_head, num_heads)
                dst = copy.dst_view(buffers[name])
                row, count = ranges[b.index]
                slots = self.slots[b.index][row : row + count]
                check_slots(f"{name} destination", slots, dst.shape[0])
                if nbytes != slots.size * _row_bytes(dst):
                    raise ValueError(f"{name}: {nbytes} bytes for {slots.size} rows of {tuple(dst.shape[1:])}")
                stage = payload.narrow(0, offset, nbytes).view(dst.dtype).view(slots.size, *dst.shape[1:])
                moved += copy_runs(stage, dst, slot_runs(slots)[:, [1, 0, 2]])
        return moved
