"""What one push copies: per buffer, which heads, and which rows.

Every backend moves the same thing; only *how* differs. For one hand-off a
prefill rank copies, for each buffer of its layout the decode rank holds too
(the layers of both ranks' pipeline stages):

* head-sharded buffers (``head_axis`` set): the heads both ranks hold,
  ``head_overlap(src, dst)``, from the source's local head offset to the
  destination's (prefill TP 1 → decode TP 2: rank 0 sends heads
  ``[0, h/2)`` to decode rank 0 and ``[h/2, h)`` to decode rank 1, each at
  local offset 0);
* replicated buffers (``head_axis=None``: the MLA latent, Mamba states):
  whole rows, from exactly one prefill rank per decode rank — the one with
  ``src_tp_rank == dst_tp_rank % src_tp_size`` (see :func:`sends_replicated`);
* KV heads replicated across ranks (``tp_size > num_kv_heads``: several
  prefill ranks hold the same head): only one replica of each head is sent
  to a decode rank (see :func:`sends_heads`);
* ``"token"`` buffers: rows ``src_slots[i] → dst_slots[i]``; ``"swa"``
  buffers: rows ``src_swa_slots[j] → dst_swa_slots[j]`` (the window only);
  ``"state"`` buffers: row ``src_state_slot → dst_state_slot`` (skipped when
  either is ``None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from transfer.base import BufferLayout, KVHandoff, KVLayout, TransferError, head_overlap
from transfer.runs import Slots, group_concurrent_contiguous


@dataclass(frozen=True)
class BufferCopy:
    """One buffer's share of a push: heads ``[src_head, src_head + num_heads)``
    of the source rows land at ``[dst_head, ...)`` of the destination rows
    (``head_axis=None``: whole rows)."""

    name: str
    index: str
    head_axis: Optional[int]
    src_head: int = 0
    dst_head: int = 0
    num_heads: int = 0

    def src_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._heads(tensor, self.src_head)

    def dst_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._heads(tensor, self.dst_head)

    def _heads(self, tensor: torch.Tensor, start: int) -> torch.Tensor:
        if self.head_axis is None:
            return tensor
        return tensor.narrow(1 + self.head_axis, start, self.num_heads)


def sends_replicated(src_tp_rank: int, src_tp_size: int, dst_tp_rank: int) -> bool:
    """Whether this prefill rank is the one that copies replicated buffers to ``dst_tp_rank``."""
    return src_tp_rank == dst_tp_rank % src_tp_size


def head_replicas(b: BufferLayout, tp_size: int) -> int:
    """How many of ``tp_size`` ranks hold the same heads of head-sharded buffer ``b``
    (1 unless ``tp_size > total_heads``: then every rank keeps one replicated head)."""
    if b.head_axis is None or not b.total_heads or not b.num_heads:
        return 1
    return max(1, tp_size * b.num_heads // b.total_heads)


def sends_heads(b: BufferLayout, src_tp_rank: int, src_tp_size: int, dst_tp_rank: int) -> bool:
    """Whether this prefill rank's replica of its heads of ``b`` is the one sent to
    ``dst_tp_rank``: of the ``r`` ranks holding a head, the one with ``src_tp_rank % r
    == dst_tp_rank % r`` (exactly one per head, spread over the replicas)."""
    replicas = head_replicas(b, src_tp_size)
    return src_tp_rank % replicas == dst_tp_rank % replicas


def plan_copies(
    src: KVLayout, dst: KVLayout, src_tp_rank: int, src_tp_size: int, dst_tp_rank: int, with_state: bool
) -> List[BufferCopy]:
    """The buffers (and head ranges) a source rank copies to one destination rank,
    in the source layout's order: those both hold (pipeline stages hold their own
    layers). Layouts must have passed ``check_compatible``."""
    dst_by_name = dst.by_name()
    replicated = sends_replicated(src_tp_rank, src_tp_size, dst_tp_rank)
    copies = []
    for b in src.buffers:
        d = dst_by_name.get(b.name)
        if d is None or (b.index == "state" and not with_state):
            continue
        if b.head_axis is None:
            if replicated:
                copies.append(BufferCopy(b.name, b.index, None))
            continue
        overlap = head_overlap(b, d) if sends_heads(b, src_tp_rank, src_tp_size, dst_tp_rank) else None
        if overlap is not None:
            lo, hi = overlap
            copies.append(BufferCopy(b.name, b.index, b.head_axis, lo - b.head_start, lo - d.head_start, hi - lo))
    return copies


def copied_heads(copies: List[BufferCopy]) -> Dict[str, int]:
    """The heads of each destination buffer ``copies`` write (a replicated buffer: 1)."""
    return {c.name: c.num_heads if c.head_axis is not None else 1 for c in copies}


def expected_heads(handoff: KVHandoff) -> Dict[str, int]:
    """The buffers of ``handoff``'s decode rank that take rows (its token rows, SWA rows, state
    slot), each with the heads the prefill ranks must write there together (a replicated buffer:
    1). Read once per request, where its hand-offs are parsed: :func:`unwritten` checks against it."""
    rows = {"token": len(handoff.dst_slots), "swa": len(handoff.dst_swa_slots),
            "state": int(handoff.dst_state_slot is not None)}
    return {b.name: b.num_heads if b.head_axis is not None else 1 for b in handoff.layout.buffers if rows[b.index]}


def unwritten(expected: Mapping[str, int], written: Mapping[str, int]) -> List[str]:
    """The buffers of a decode rank (``expected``: its :func:`expected_heads`) whose heads the
    prefill ranks' :func:`copied_heads`, summed over the ranks (``written``), do not cover exactly
    once: a layer no prefill rank holds alike (two layouts whose pipeline stages do not fit
    together), or heads sent twice."""
    return [name for name, heads in expected.items() if written.get(name, 0) != heads]


def check_slots(what: str, slots: np.ndarray, num_rows: int) -> None:
    """Raise TransferError unless every slot addresses a row of a ``num_rows`` buffer."""
    if slots.size and (slots.min() < 0 or slots.max() >= num_rows):
        raise TransferError(f"{what} slots span [{slots.min()}, {slots.max()}], buffer has {num_rows} rows")


# Below this mean run size one slice copy per run costs more in dispatch than
# it saves (measured on the 2-core CPU box: 2 KiB rows, loop 22 ms vs indexed
# 9 ms for 4096 one-row runs; even at 16 KiB; the loop wins from 32 KiB on).
SHORT_RUN_BYTES = 16 * 1024


def run_indices(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Every row of the runs ``(starts[i], lengths[i])``, in order, without a Python loop."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: np.ndarray) -> int:
    """``dst[d:d+n] = src[s:s+n]`` for every run ``(s, d, n)``. Returns the bytes copied.

    Runs of at least ``SHORT_RUN_BYTES`` on average move as one slice copy
    each, with no temporary; many short runs (page size 1, scattered slots)
    move as one indexed gather + scatter, whose temporary is the moved rows."""
    if not len(runs):
        return 0
    row_bytes = src[0].numel() * src.element_size()
    num_rows = int(runs[:, 2].sum())
    if num_rows * row_bytes < len(runs) * SHORT_RUN_BYTES:
        src_rows = torch.from_numpy(run_indices(runs[:, 0], runs[:, 2])).to(src.device)
        dst_rows = torch.from_numpy(run_indices(runs[:, 1], runs[:, 2])).to(dst.device)
        dst.index_copy_(0, dst_rows, src.index_select(0, src_rows).to(dst.device))  # host-staged: one device hop
    else:
        for s, d, n in runs.tolist():
            dst.narrow(0, d, n).copy_(src.narrow(0, s, n))
    return num_rows * row_bytes


@dataclass(frozen=True)
class RowPlan:
    """The row runs of one push, per index kind: token runs, SWA runs and the
    (at most one) state run."""

    token_runs: np.ndarray
    swa_runs: np.ndarray
    state_runs: np.ndarray

    def runs_for(self, copy: BufferCopy) -> np.ndarray:
        if copy.index == "state":
            return self.state_runs
        return self.swa_runs if copy.index == "swa" else self.token_runs


def row_plan(
    src_slots: Slots, dst_slots: Slots, src_state_slot: Optional[int], dst_state_slot: Optional[int],
    src_swa_slots: Slots = (), dst_swa_slots: Slots = (),
) -> RowPlan:
    token_runs = group_concurrent_contiguous(src_slots, dst_slots)
    swa_runs = group_concurrent_contiguous(src_swa_slots, dst_swa_slots)
    has_state = src_state_slot is not None and dst_state_slot is not None
    state = [[int(src_state_slot), int(dst_state_slot), 1]] if has_state else []
    return RowPlan(token_runs, swa_runs, np.asarray(state, dtype=np.int64).reshape(-1, 3))


def push_rows(src_buffers, dst_buffers, copies: List[BufferCopy], rows: RowPlan) -> int:
    """Copy every planned buffer's rows from ``src_buffers`` into ``dst_buffers``
    (both ``{name: tensor}``, the destination possibly mapped from a peer)."""
    moved = 0
    for copy in copies:
        runs = rows.runs_for(copy)
        if not len(runs):
            continue
        src, dst = src_buffers[copy.name], dst_buffers[copy.name]
        for col, what, tensor in ((0, "source", src), (1, "destination", dst)):  # first and last row of every run
            check_slots(f"{copy.name} {what}", np.concatenate([runs[:, col], runs[:, col] + runs[:, 2] - 1]), tensor.shape[0])
        moved += copy_runs(copy.src_view(src), copy.dst_view(dst), runs)
    return moved


def sliced_row_shape(row_shape: Tuple[int, ...], copy: BufferCopy) -> Tuple[int, ...]:
    """Shape of one row as ``copy`` moves it (the head axis cut to ``num_heads``)."""
    if copy.head_axis is None:
        return tuple(row_shape)
    shape = list(row_shape)
    shape[copy.head_axis] = copy.num_heads
    return tuple(shape)


__all__ = [
    "SHORT_RUN_BYTES", "BufferCopy", "RowPlan", "check_slots", "copied_heads", "copy_runs", "run_indices",
    "plan_copies", "push_rows", "row_plan", "head_replicas", "sends_heads", "sends_replicated", "sliced_row_shape",
    "expected_heads", "unwritten",
]
