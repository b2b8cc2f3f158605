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

A worker whose cache reuses a prefix only at some pages (``mem_cache.kv_events``'s
reuse rules) has its match cut back to the deepest page it can reuse from: for
``state`` (a hybrid model's prefill) the deepest page marked by StateStored — with
``prompt_state`` (the worker caches a prompt's final state at its end) the
router's own decisions mark the last page of the prompt sent, approximately; for ``window`` (sliding-window
attention) the deepest page with no WindowLost page among its last ``window``.

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

from mem_cache.kv_events import (REUSE_RULES, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, StateRemoved,
                                 StateStored, WindowLost, WindowRestored)

BIT_SHIFT = 16  # an approximate entry is ``key << BIT_SHIFT | bit``: one int, up to 65,536 workers
STATE_SALT = 0x5A17E5A17E5A17E5  # ``key ^ STATE_SALT``: the approximate "a state is cached after page key"


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
        self._state: Dict[int, int] = {}  # page key → mask of workers with a state cached after it
        self._lost: Dict[int, int] = {}  # page key → mask of workers whose window KV of it is gone
        self._marks: Dict[int, Set[int]] = {}  # bit → its keys in _state or _lost
        self._state_mask = 0  # workers under the ``state`` rule
        self._prompt_state_mask = 0  # ... of which cache a prompt's final state at its end
        self._ruled_mask = 0  # workers under any rule but ``prefix``
        self._windows: Dict[int, int] = {}  # bit → window in pages, for workers under the ``window`` rule

    # ---- workers -------------------------------------------------------------------
    def add_worker(self, worker_id: str) -> None:
        if worker_id in self._bits:
            return
        if len(self._bits) >= 1 << BIT_SHIFT:
            raise ValueError(f"the index holds at most {1 << BIT_SHIFT} workers")
        bit = next(b for b in range(len(self._bits) + 1) if b not in self._ids)
        self._bits[worker_id], self._ids[bit] = bit, worker_id
        self._pages[bit], self._marks[bit] = set(), set()

    def remove_worker(self, worker_id: str) -> None:
        """Forget the worker and every entry it had."""
        if worker_id not in self._bits:
            return
        self.clear(worker_id)
        self.set_rule(worker_id, "prefix")
        bit = self._bits.pop(worker_id)
        del self._ids[bit], self._pages[bit], self._marks[bit]

    def set_rule(self, worker_id: str, kind: str, window_pages: int = 0, prompt_state: bool = False) -> None:
        """Where the worker reuses a prefix up to (see the module docstring); ``window_pages``
        for ``window``, ``prompt_state`` for ``state``."""
        if kind not in REUSE_RULES:
            raise ValueError(f"unknown reuse rule {kind!r}; known: {', '.join(REUSE_RULES)}")
        if kind == "window" and window_pages < 1:
            raise ValueError(f"the window rule needs a window of at least one page, got {window_pages}")
        bit = self._bits[worker_id]
        flag = 1 << bit
        self._state_mask &= ~flag
        self._prompt_state_mask &= ~flag
        self._ruled_mask &= ~flag
        self._windows.pop(bit, None)
        if kind == "state":
            self._state_mask |= flag
            self._prompt_state_mask |= flag if prompt_state else 0
        elif kind == "window":
            self._windows[bit] = window_pages
        if kind != "prefix":
            self._ruled_mask |= flag

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
        elif isinstance(event, (StateStored, StateRemoved)):  # (either way what the router guessed is moot)
            keys = page_keys(event.block_hashes)
            for key in keys:
                if (key ^ STATE_SALT) << BIT_SHIFT | bit in self._deadlines:
                    self._drop_approx(key ^ STATE_SALT, bit)
            if isinstance(event, StateStored):
                self._mark(self._state, bit, keys)
            else:
                self._unmark(self._state, bit, keys)
        elif isinstance(event, WindowLost):
            self._mark(self._lost, bit, page_keys(event.block_hashes))
        elif isinstance(event, WindowRestored):
            self._unmark(self._lost, bit, page_keys(event.block_hashes))
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def replace(self, worker_id: str, chains: Iterable[Sequence[str]], state_pages: Sequence[str] = (),
                lost_pages: Sequence[str] = ()) -> None:
        """The worker holds exactly ``chains`` now (a snapshot), with these pages marked
        StateStored and WindowLost: drop what it had, store these."""
        self.clear(worker_id)
        bit = self._bits[worker_id]
        for chain in chains:
            self._store(bit, page_keys(chain))
        self._mark(self._state, bit, page_keys(state_pages))
        self._mark(self._lost, bit, page_keys(lost_pages))

    def clear(self, worker_id: str) -> None:
        bit = self._bits[worker_id]
        self._remove(bit, list(self._pages[bit]))
        marks = list(self._marks[bit])
        self._unmark(self._state, bit, marks)
        self._unmark(self._lost, bit, marks)
        mask = (1 << BIT_SHIFT) - 1
        for entry in [e for e in self._deadlines if e & mask == bit]:
            self._drop_approx(entry >> BIT_SHIFT, bit)

    def _store(self, bit: int, keys: List[int]) -> None:
        flag, exact, pages = 1 << bit, self._exact, self._pages[bit]
        stated = self._prompt_state_mask & flag
        for key in keys:
            exact[key] = exact.get(key, 0) | flag
            pages.add(key)
            if key << BIT_SHIFT | bit in self._deadlines:  # confirmed: the approximate entry is superseded
                self._drop_approx(key, bit)
            if stated and (key ^ STATE_SALT) << BIT_SHIFT | bit in self._deadlines:  # ... a state there is
                self._drop_approx(key ^ STATE_SALT, bit)  # StateStored's to tell

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
        if self._marks[bit]:
            self._unmark(self._state, bit, keys)
            self._unmark(self._lost, bit, keys)

    def _mark(self, marks: Dict[int, int], bit: int, keys: Iterable[int]) -> None:
        flag, mine = 1 << bit, self._marks[bit]
        for key in keys:
            marks[key] = marks.get(key, 0) | flag
            mine.add(key)

    def _unmark(self, marks: Dict[int, int], bit: int, keys: Iterable[int]) -> None:
        """Take ``bit`` off these keys in ``marks``; a key leaves ``_marks[bit]`` once in neither dict."""
        flag, mine, other = 1 << bit, self._marks[bit], self._lost if marks is self._state else self._state
        for key in keys:
            mask = marks.get(key, 0)
            if not mask & flag:
                continue
            if mask & ~flag:
                marks[key] = mask & ~flag
            else:
                del marks[key]
            if not other.get(key, 0) & flag:
                mine.discard(key)

    # ---- approximate entries ---------------------------------------------------------------
    def record(self, worker_id: str, keys: Sequence[int]) -> None:
        """The router sent a request with these pages to the worker: count them as held there for
        ``approx_ttl_s`` unless an event says so first."""
        bit = self._bits[worker_id]
        flag = 1 << bit
        deadline = self.clock() + self.approx_ttl_s
        exact, approx, deadlines = self._exact, self._approx, self._deadlines
        recorded = [key for key in keys if not exact.get(key, 0) & flag]
        if self._prompt_state_mask & flag and keys and not self._state.get(keys[-1], 0) & flag:
            recorded.append(keys[-1] ^ STATE_SALT)  # it caches the prompt's final state
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
        if alive & self._ruled_mask:
            return self._match_ruled(keys, alive)
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

    def _match_ruled(self, keys: Sequence[int], alive: int) -> Dict[str, int]:
        """:meth:`match` for a run that workers under a reuse rule share: each such worker's
        match ends at the deepest page its rule allows."""
        exact, approx, state, lost, windows = self._exact, self._approx, self._state, self._lost, self._windows
        state_bits = alive & self._state_mask
        window_bits = sum(1 << bit for bit in windows if alive >> bit & 1)
        ends: Dict[int, int] = {}  # bit → deepest reusable page count so far (window: before its last lost page)
        lost_at: Dict[int, int] = {}  # window bit → page count up to its last lost page
        matched: Dict[str, int] = {}

        def credit(mask: int, depth: int) -> None:
            while mask:
                low = mask & -mask
                bit = low.bit_length() - 1
                mask ^= low
                if state_bits & low:
                    depth_ok = ends.get(bit, 0)
                elif window_bits & low and bit in lost_at and depth - lost_at[bit] < windows[bit]:
                    depth_ok = ends.get(bit, 0)
                else:
                    depth_ok = depth
                if depth_ok:
                    matched[self._ids[bit]] = depth_ok

        depth = 0
        while alive and depth < len(keys):
            key = keys[depth]
            if depth:
                mask = exact.get(key, 0) | approx.get(key, 0)
                if alive & ~mask:
                    credit(alive & ~mask, depth)
                    alive &= mask
                    if not alive:
                        break
            depth += 1
            ended = (state.get(key, 0) | approx.get(key ^ STATE_SALT, 0)) & alive & state_bits
            while ended:
                low = ended & -ended
                ends[low.bit_length() - 1] = depth
                ended ^= low
            gone = lost.get(key, 0) & alive & window_bits
            while gone:
                low = gone & -gone
                bit = low.bit_length() - 1
                gone ^= low
                if bit not in lost_at or depth - 1 - lost_at[bit] >= windows[bit]:
                    ends[bit] = depth - 1
                lost_at[bit] = depth
        credit(alive, depth)
        return matched

    def _credit(self, matched: Dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            matched[self._ids[low.bit_length() - 1]] = depth
            mask ^= low
