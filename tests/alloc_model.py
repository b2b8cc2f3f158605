"""A plain-Python model of the slot allocators, used as the oracle.

It keeps the free list as a Python list with the exact reuse order of the
real allocators (token: append / FIFO; paged: prepend unique sorted pages /
LIFO; ``need_sort``: a release list merged and sorted when short), and lays
out a request's new tokens one at a time: a token that starts a page takes
the request's next fresh page, any other token takes the slot after the
previous one.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class AllocatorModel:
    def __init__(self, num_pages: int, page_size: int, paged: bool, need_sort: bool):
        self.page_size = page_size
        self.paged = paged
        self.need_sort = need_sort
        self.free: List[int] = list(range(1, num_pages + 1))
        self.release: List[int] = []
        self.group: Optional[List[int]] = None

    def available_pages(self) -> int:
        return len(self.free) + len(self.release)

    def take(self, num_pages: int) -> Optional[List[int]]:
        if self.need_sort and len(self.free) < num_pages <= len(self.free) + len(self.release):
            self.free = sorted(self.free + self.release)
            self.release = []
        if num_pages > len(self.free):
            return None
        taken, self.free = self.free[:num_pages], self.free[num_pages:]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        if not slots:
            return
        if self.group is not None:
            self.group.extend(slots)
            return
        target = self.release if self.need_sort else self.free
        if self.paged:
            pages = sorted({s // self.page_size for s in slots})
            target[:0] = pages
        else:
            target.extend(slots)

    def group_begin(self) -> None:
        self.group = []

    def group_end(self) -> None:
        pending, self.group = self.group, None
        self.give(pending or [])

    def extend(self, reqs: Sequence[Tuple[int, int, int]]) -> Optional[List[int]]:
        """``reqs``: (prefix_len, seq_len, last_loc). Slots in batch order."""
        ps = self.page_size
        need = sum(-(-s // ps) - -(-p // ps) for p, s, _ in reqs)
        pages = self.take(need)
        if pages is None:
            return None
        out: List[int] = []
        for prefix_len, seq_len, last_loc in reqs:
            prev = last_loc
            for pos in range(prefix_len, seq_len):
                if pos % ps == 0:
                    prev = pages.pop(0) * ps
                else:
                    prev = prev + 1
                out.append(prev)
        return out
