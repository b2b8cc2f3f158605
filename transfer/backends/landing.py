"""Packing rows into one message and landing them on the other side.

For backends that move bytes as messages (``torch_dist``), not as direct
writes: the sender gathers every planned buffer's rows into one contiguous
uint8 payload (:func:`pack_rows`); the receiver tracks which heads of which
buffers a hand-off still misses (:class:`Landing`) and scatters the payloads
once everything arrived. The header counts the token and SWA rows; its
entries are ``[name, dst_head, num_heads, offset, nbytes]``, offsets 16-byte
aligned.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from transfer.base import KVHandoff, KVLayout
from transfer.plan import BufferCopy, check_slots, copy_runs
from transfer.runs import as_slot_array, slot_runs

_ALIGN = 16


def _row_bytes(view: torch.Tensor) -> int:
    return view[0].numel() * view.element_size() if view.shape[0] else 0


def pack_rows(
    layout: KVLayout, buffers: Dict[str, torch.Tensor], copies: List[BufferCopy], src_slots,
    src_state_slot: Optional[int], src_swa_slots=(),
) -> Tuple[Dict, torch.Tensor]:
    """``(header, payload)`` holding the rows of ``copies``: one slice copy per
    run of consecutive source slots into the payload."""
    token_slots, swa_slots = as_slot_array(src_slots), as_slot_array(src_swa_slots)
    state_slots = as_slot_array([] if src_state_slot is None else [src_state_slot])
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
    payload = torch.empty(offset, dtype=torch.uint8)
    entries = []
    for copy, src, slots, offset, nbytes in planned:
        stage = payload.narrow(0, offset, nbytes).view(src.dtype).view(slots.size, *src.shape[1:])
        copy_runs(src, stage, slot_runs(slots))
        entries.append([copy.name, copy.dst_head, copy.num_heads, offset, nbytes])
    return {"rows": int(token_slots.size), "swa_rows": int(swa_slots.size), "copies": entries}, payload


class Landing:
    """Decode side of one hand-off: coverage per buffer (a flag per local head,
    one flag for replicated buffers) and the payloads that arrived."""

    def __init__(self, layout: KVLayout, handoff: KVHandoff):
        self.layout = layout.by_name()
        self.token_slots = as_slot_array(handoff.dst_slots)
        self.swa_slots = as_slot_array(handoff.dst_swa_slots)
        self.state_slots = as_slot_array([] if handoff.dst_state_slot is None else [handoff.dst_state_slot])
        self.need: Dict[str, np.ndarray] = {}
        for b in layout.buffers:
            if self._slots(b.index).size:
                self.need[b.name] = np.zeros(b.num_heads if b.head_axis is not None else 1, dtype=bool)
        self.parts: List[Tuple[list, torch.Tensor]] = []
        self.error: Optional[str] = None

    def _slots(self, index: str) -> np.ndarray:
        if index == "state":
            return self.state_slots
        return self.swa_slots if index == "swa" else self.token_slots

    def add(self, header: Dict, payload: torch.Tensor) -> None:
        if header["rows"] != self.token_slots.size:
            self.error = f"prefill sent {header['rows']} token rows for {self.token_slots.size} destination slots"
            return
        if header["swa_rows"] != self.swa_slots.size:
            self.error = f"prefill sent {header['swa_rows']} SWA rows for {self.swa_slots.size} destination SWA slots"
            return
        for name, dst_head, num_heads, _, _ in header["copies"]:
            if name not in self.need:
                self.error = f"prefill sent buffer {name!r}, which this hand-off does not take"
                return
            b = self.layout[name]
            if b.head_axis is None:
                self.need[name][:] = True
            else:
                self.need[name][dst_head : dst_head + num_heads] = True
        self.parts.append((header["copies"], payload))

    def complete(self) -> bool:
        return all(flags.all() for flags in self.need.values())

    def missing(self) -> str:
        names = [name for name, flags in self.need.items() if not flags.all()]
        return f"{len(names)} buffers ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"

    def scatter(self, buffers: Dict[str, torch.Tensor]) -> int:
        """Write every payload into ``buffers``: one slice copy per run of
        consecutive destination slots. Returns the bytes written."""
        moved = 0
        for entries, payload in self.parts:
            for name, dst_head, num_heads, offset, nbytes in entries:
                b = self.layout[name]
                copy = BufferCopy(name, b.index, b.head_axis, 0, dst_head, num_heads)
                dst = copy.dst_view(buffers[name])
                slots = self._slots(b.index)
                check_slots(f"{name} destination", slots, dst.shape[0])
                if nbytes != slots.size * _row_bytes(dst):
                    raise ValueError(f"{name}: {nbytes} bytes for {slots.size} rows of {tuple(dst.shape[1:])}")
                stage = payload.narrow(0, offset, nbytes).view(dst.dtype).view(slots.size, *dst.shape[1:])
                moved += copy_runs(stage, dst, slot_runs(slots)[:, [1, 0, 2]])
        return moved
