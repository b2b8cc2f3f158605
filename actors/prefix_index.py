"""The router's global prefix index: which worker holds which KV pages.

A page is named by its chained hash (``mem_cache.radix_key.hash_pages``), so
one hash stands for the whole prefix up to and including that page, and a
request's match on a worker is the longest run of its page hashes, from the
first, that the worker holds. The index keeps, per page key, a bit mask of the
workers holding it:

* ``exact``  — what the workers' KV events said (BlockStored sets a bit,
  BlockRemoved clears it, AllBlocksCleared clears the worker), or a snapshot
  of a worker's tree (:meth:`replace`, for a router that restarts);
* ``approx`` — the router's own decisions (:meth:`record`): the pages a request
  was sent to a worker with, until an event confirms them (they move to
  ``exact``) or ``approx_ttl_s`` passes. So a burst of similar requests follows
  the first one before any event has come back.

Keys are the first 64 bits of the hex hash as an int: a third of the memory of
the string, and a collision needs ~2^32 pages. Matching is one dict lookup per
page and bit operations over all workers at once. Nothing per page is an object
the garbage collector tracks (ints only; approximate entries expire one
decision at a time), so a large index adds nothing to the collector's passes.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, Iterable, List, Sequence, Set, Tuple

BIT_SHIFT = 16  # an approximate entry is ``key << BIT_SHIFT | bit``: one int, up to 65,536 workers

from mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def page_keys(page_hashes: Iterable[str]) -> List[int]:
    """Index keys of chained page hashes (hex strings)."""
    return [int(h[:16], 16) for h in page_hashes]


class PrefixIndex:
    def __init__(self, approx_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.approx_ttl_s = approx_ttl_s
        self.clock = clock
        self._bits: Dict[str, int] = {}  # worker id → bit number
        self._ids: Dict[int, str] = {}
        self._exact: Dict[int, int] = {}  # page key → mask of workers
        self._approx: Dict[int, int] = {}
        self._deadlines: Dict[int, float] = {}  # key << BIT_SHIFT | bit → when the approximate entry lapses
        self._expiry: Deque[Tuple[float, int, List[int]]] = deque()  # (deadline, bit, keys) per decision
        self._pages: Dict[int, Set[int]] = {}  # bit → its exact keys

    # ---- workers -------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._bits:
            return
        if len(self._bits) >= 1 << BIT_SHIFT:
            raise ValueError(f"the index holds at most {1 << BIT_SHIFT} workers")
        bit = next(b for b in range(len(self._bits) + 1) if b not in self._ids)
        self._bits[worker_id], self._ids[bit] = bit, worker_id
        self._pages[bit] = set()

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and every entry it had."""
        if worker_id not in self._bits:
            return
        self.clear(worker_id)
        bit = self._bits.pop(worker_id)
        del self._ids[bit], self._pages[bit]

    def workers(self) -> List[str]:
        return list(self._bits)

    def num_pages(self, worker_id: str) -> int:
        """Exact pages the worker holds (its tree's size in pages)."""
        bit = self._bits.get(worker_id)
        return 0 if bit is None else len(self._pages[bit])

    def __len__(self) -> int:
        """Distinct pages held exactly by any worker."""
        return len(self._exact)

    # ---- exact entries -----------------------------------------------------------------
    def apply(self, worker_id: str, event: KVEvent) -> None:
        bit = self._bits[worker_id]
        if isinstance(event, BlockStored):
            self._store(bit, page_keys(event.block_hashes))
        elif isinstance(event, BlockRemoved):
            self._remove(bit, page_keys(event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            self.clear(worker_id)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def replace(self, worker_id: str, chains: Iterable[Sequence[str]]) -> None:
        """The worker holds exactly ``chains`` now (a snapshot): drop what it had, store these."""
        self.clear(worker_id)
        bit = self._bits[worker_id]
        for chain in chains:
            self._store(bit, page_keys(chain))

    def clear(self, worker_id: str) -> None:
        bit = self._bits[worker_id]
        self._remove(bit, list(self._pages[bit]))
        mask = (1 << BIT_SHIFT) - 1
        for entry in [e for e in self._deadlines if e & mask == bit]:
            self._drop_approx(entry >> BIT_SHIFT, bit)

    def _store(self, bit: int, keys: List[int]) -> None:
        flag, exact, pages = 1 << bit, self._exact, self._pages[bit]
        for key in keys:
            exact[key] = exact.get(key, 0) | flag
            pages.add(key)
            if key << BIT_SHIFT | bit in self._deadlines:  # confirmed: the approximate entry is superseded
                self._drop_approx(key, bit)

    def _remove(self, bit: int, keys: List[int]) -> None:
        flag, exact, pages = 1 << bit, self._exact, self._pages[bit]
        for key in keys:
            mask = exact.get(key, 0) & ~flag
            if mask:
                exact[key] = mask
            else:
                exact.pop(key, None)
            pages.discard(key)
            if key << BIT_SHIFT | bit in self._deadlines:
                self._drop_approx(key, bit)

    # ---- approximate entries ---------------------------------------------------------------
    def record(self, worker_id: str, keys: Sequence[int]) -> None:
        """The router sent a request with these pages to the worker: count them as held there for
        ``approx_ttl_s`` unless an event says so first."""
        bit = self._bits[worker_id]
        flag = 1 << bit
        deadline = self.clock() + self.approx_ttl_s
        exact, approx, deadlines = self._exact, self._approx, self._deadlines
        recorded = [key for key in keys if not exact.get(key, 0) & flag]
        for key in recorded:
            approx[key] = approx.get(key, 0) | flag
            deadlines[key << BIT_SHIFT | bit] = deadline
        if recorded:
            self._expiry.append((deadline, bit, recorded))
        self.expire()

    def expire(self) -> None:
        now = self.clock()
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            deadline, bit, keys = expiry.popleft()
            for key in keys:
                if self._deadlines.get(key << BIT_SHIFT | bit) == deadline:  # not renewed nor superseded since
                    self._drop_approx(key, bit)

    def _drop_approx(self, key: int, bit: int) -> None:
        del self._deadlines[key << BIT_SHIFT | bit]
        mask = self._approx.get(key, 0) & ~(1 << bit)
        if mask:
            self._approx[key] = mask
        else:
            self._approx.pop(key, None)

    def num_approx(self) -> int:
        return len(self._deadlines)

    # ---- matching -----------------------------------------------------------------------
    def match(self, keys: Sequence[int]) -> Dict[str, int]:
        """Pages each worker holds of ``keys``, counted from the first: ``{worker_id: pages}``
        for every worker that holds at least the first one."""
        self.expire()
        if not keys:
            return {}
        exact, approx = self._exact, self._approx
        alive = exact.get(keys[0], 0) | approx.get(keys[0], 0)
        matched: Dict[str, int] = {}
        depth = 1
        while alive and depth < len(keys):
            key = keys[depth]
            mask = exact.get(key, 0) | approx.get(key, 0)
            dropped = alive & ~mask
            if dropped:
                self._credit(matched, dropped, depth)
                alive &= mask
            depth += 1
        self._credit(matched, alive, depth)
        return matched

    def _credit(self, matched: Dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            matched[self._ids[low.bit_length() - 1]] = depth
            mask ^= low
