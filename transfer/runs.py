"""Cutting slot lists into runs of consecutive slots (reference §1.5).

A transfer moves row ``src[i]`` to row ``dst[i]`` for every ``i``. Wherever
both lists step by exactly one, the rows form one block on each side and move
with a single slice copy (or one RDMA write); :func:`group_concurrent_contiguous`
finds those blocks with a handful of vectorised numpy passes, so a 100k-slot
list costs microseconds, not a Python loop. With ``page_size > 1`` allocators
hand out whole pages, so runs are at least one page long.

Runs are returned as an ``(n_runs, 3)`` int64 array of
``(src_start, dst_start, length)``; iterate over ``runs.tolist()`` to get
plain Python ints for slicing.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

Slots = Union[Sequence[int], np.ndarray, torch.Tensor]


def as_slot_array(slots: Slots) -> np.ndarray:
    """``slots`` as a flat int64 numpy array (tensors are moved to the CPU)."""
    if isinstance(slots, torch.Tensor):
        slots = slots.detach().to("cpu", torch.int64).numpy()
    return np.asarray(slots, dtype=np.int64).reshape(-1)


def group_concurrent_contiguous(src: Slots, dst: Slots) -> np.ndarray:
    """Maximal runs over which both ``src`` and ``dst`` step by +1.

    Returns ``(n_runs, 3)`` int64 rows ``(src_start, dst_start, length)``
    that cover the pairs ``(src[i], dst[i])`` exactly once, in order; two
    neighbouring runs are always cut because one of the lists jumps there.
    """
    s, d = as_slot_array(src), as_slot_array(dst)
    if s.shape != d.shape:
        raise ValueError(f"slot lists differ in length: {s.size} source vs {d.size} destination")
    if s.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    cuts = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [s.size])))
    return np.stack([s[starts], d[starts], lengths], axis=1)


def slot_runs(slots: Slots) -> np.ndarray:
    """Runs of one list against a packed buffer: ``(slot_start, packed_start, length)``.

    The second column is the position in a contiguous staging tensor that
    holds row ``slots[i]`` at index ``i`` (what a gather/scatter needs).
    """
    s = as_slot_array(slots)
    return group_concurrent_contiguous(s, np.arange(s.size, dtype=np.int64))
