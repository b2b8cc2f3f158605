"""ReqToTokenPool: the request → token → KV-slot map (seed 000 §2).

Row ``r`` of ``req_to_token`` holds, for every token position of the request
that owns row ``r``, the KV slot number its K/V live in. The scheduler reads
a request's row as its page table; it never copies KV per request.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import torch

from mem_cache.integrity import check_not_free, check_unique_in_range, debug_enabled, ensure

Rows = Union[int, Sequence[int], torch.Tensor]


def as_row_list(rows: Rows) -> List[int]:
    if isinstance(rows, int):
        return [rows]
    if isinstance(rows, torch.Tensor):
        return [int(r) for r in rows.reshape(-1).tolist()]
    return [int(r) for r in rows]


class ReqToTokenPool:
    """A fixed table of ``size`` request rows, each ``max_context_len`` long.

    * ``alloc(n)`` → ``n`` row numbers, or ``None`` when fewer than ``n`` are
      free (nothing is taken then).
    * ``free(rows)`` returns rows; the table contents are not cleared (the next
      owner overwrites what it uses). In debug mode (``debug=True`` or
      ``RAYDIX_DEBUG_MEMORY_POOL``) a row freed twice raises ``IntegrityError``.
    * ``write(indices, values)`` is ``req_to_token[indices] = values``.
    """

    def __init__(
        self, size: int, max_context_len: int, device: Union[str, torch.device] = "cpu", debug: Optional[bool] = None
    ):
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size=}, {max_context_len=}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self.free_slots: List[int] = list(range(size))
        self.debug = debug_enabled(debug)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[List[int]]:
        if need_size > len(self.free_slots):
            return None
        rows = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return rows

    def free(self, rows: Rows) -> None:
        row_list = as_row_list(rows)
        if self.debug:
            freed = torch.tensor(row_list, dtype=torch.int64)
            check_unique_in_range("freed rows", freed, 0, self.size - 1)
            check_not_free("rows", freed, torch.tensor(self.free_slots, dtype=torch.int64))
        self.free_slots.extend(row_list)

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def check_integrity(self, live_rows: Optional[Iterable[int]] = None) -> None:
        """Free rows are unique and in range; with ``live_rows`` (the rows held
        by running requests) the two sets partition ``range(size)`` exactly."""
        free = torch.tensor(self.free_slots, dtype=torch.int64)
        check_unique_in_range("ReqToTokenPool.free_slots", free, 0, self.size - 1)
        if live_rows is None:
            return
        live = torch.tensor(sorted(int(r) for r in live_rows), dtype=torch.int64)
        check_unique_in_range("ReqToTokenPool live rows", live, 0, self.size - 1)
        both = torch.cat([free, live])
        ensure(
            int(torch.unique(both).numel()) == both.numel(),
            f"ReqToTokenPool: {both.numel() - int(torch.unique(both).numel())} rows are both free and live",
        )
        ensure(
            both.numel() == self.size,
            f"ReqToTokenPool leak: {free.numel()} free + {live.numel()} live != {self.size} rows",
        )
