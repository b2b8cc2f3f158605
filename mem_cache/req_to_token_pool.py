"""ReqToTokenPool: the request → token → KV-slot map (seed 000 §2).

Row ``r`` of ``req_to_token`` holds, for every token position of the request
that owns row ``r``, the KV slot number its K/V live in. The scheduler reads
a request's row as its page table; it never copies KV per request.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Union

import numpy as np
import torch

from mem_cache.integrity import check_not_free, check_unique_in_range, debug_enabled, ensure

Rows = Union[int, Sequence[int], torch.Tensor]


def as_row_list(rows: Rows) -> List[int]:
    if isinstance(rows, int):
        return [rows]
    if isinstance(rows, torch.Tensor):
        return [int(r) for r in rows.reshape(-1).tolist()]
    return [int(r) for r in rows]


def extend_table(rows: Sequence[int], prefixes: Sequence[torch.Tensor], prefix_lens: Sequence[int],
                 extend_lens: Sequence[int]) -> torch.Tensor:
    """``write_extend``'s arguments as its Triton kernel reads them, ``[6, bs]`` int64: row,
    prefix slots to write and their offset in the prefixes' concatenation, prefix length,
    new slots and their offset in ``out_cache_loc``."""
    written = np.fromiter((len(p) for p in prefixes), dtype=np.int64, count=len(prefixes))
    extend = np.asarray(extend_lens, dtype=np.int64)
    return torch.from_numpy(np.stack([np.asarray(rows, dtype=np.int64), written, np.cumsum(written) - written,
                                      np.asarray(prefix_lens, dtype=np.int64), extend, np.cumsum(extend) - extend]))


class ReqToTokenPool:
    """A fixed table of ``size`` request rows, each ``max_context_len`` long.

    * ``alloc(n)`` → ``n`` row numbers, or ``None`` when fewer than ``n`` are
      free (nothing is taken then).
    * ``free(rows)`` returns rows; the table contents are not cleared (the next
      owner overwrites what it uses). In debug mode (``debug=True`` or
      ``RAYDIX_DEBUG_MEMORY_POOL``) a row freed twice raises ``IntegrityError``.
    * ``write(indices, values)`` is ``req_to_token[indices] = values``;
      ``write_extend`` writes an extend batch's rows at once.
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

    def write_extend(self, rows: Sequence[int], prefixes: Sequence[torch.Tensor], prefix_lens: Sequence[int],
                     extend_lens: Sequence[int], out_cache_loc: torch.Tensor) -> None:
        """An extend batch's table writes (SGLang's ``write_req_to_token_pool``): for each request
        ``i``, ``prefixes[i]`` into columns ``[0, len(prefixes[i]))`` of row ``rows[i]`` (empty where
        the row holds its prefix already), then its ``extend_lens[i]`` slots of ``out_cache_loc``
        (in batch order) into ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])``.

        On CUDA one Triton launch (and one ``cat`` of the prefixes), not a copy kernel per run. On
        the CPU, where a copy launches nothing, slice assignments of numpy views: a third of the
        time of torch's per-run copies, whose dispatch is most of their cost here; one ``index_put_``
        (or numpy's) over all the runs' cells was no faster than those, paying per cell for
        its index arrays (measured in docs/benchmarks.md)."""
        if self.device.type == "cuda":
            from mem_cache.req_to_token_kernels import write_req_to_token_triton  # (Triton only where it compiles)

            held = [p for p in prefixes if len(p)] or [out_cache_loc[:0]]
            write_req_to_token_triton(self.req_to_token, extend_table(rows, prefixes, prefix_lens, extend_lens),
                                      torch.cat(held), out_cache_loc)
            return
        table, out, offset = self.req_to_token.numpy(), out_cache_loc.numpy(), 0
        for row, prefix, start, num in zip(rows, prefixes, prefix_lens, extend_lens):
            if len(prefix):
                table[row, : len(prefix)] = prefix.numpy()
            table[row, start : start + num] = out[offset : offset + num]
            offset += num

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
