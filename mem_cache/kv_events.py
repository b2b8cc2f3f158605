"""KV cache events a worker publishes so the router's prefix index stays current.

Every event carries a monotonic ``event_id`` (per cache) so a consumer can
detect a gap and ask for a resync. Blocks are pages, named by their chained
hash (``mem_cache.radix_key.hash_pages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Union


@dataclass(frozen=True)
class BlockStored:
    event_id: int
    block_hashes: List[str]
    parent_block_hash: Optional[str]
    token_ids: List[int]
    block_size: int
    extra_key: Optional[str] = None


@dataclass(frozen=True)
class BlockRemoved:
    event_id: int
    block_hashes: List[str]


@dataclass(frozen=True)
class AllBlocksCleared:
    event_id: int


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(NamedTuple):
    """Events after a consumer's cursor, oldest first; ``last_id`` is the cursor to ask from next.
    A first event id past ``cursor + 1`` means events were dropped: resync from a snapshot."""

    events: List[KVEvent]
    last_id: int


class PageHashSnapshot(NamedTuple):
    """Every page a cache holds, as of event ``last_id``: one chain of page hashes per tree node."""

    chains: List[List[str]]
    last_id: int
    page_size: int


@dataclass
class KVEventQueue:
    """Collects events until a publisher drains them with :meth:`take`."""

    enabled: bool = False
    next_id: int = 0
    pending: List[KVEvent] = field(default_factory=list)
    max_pending: Optional[int] = None  # bound for a queue nobody drains: the older half goes (a gap in the ids)

    def stored(self, hashes: List[str], parent: Optional[str], token_ids: List[int], block_size: int, extra_key=None):
        if self.enabled and hashes:
            self._push(BlockStored(self._id(), hashes, parent, token_ids, block_size, extra_key))

    def removed(self, hashes: List[str]):
        if self.enabled and hashes:
            self._push(BlockRemoved(self._id(), hashes))

    def cleared(self):
        if self.enabled:
            self._push(AllBlocksCleared(self._id()))

    def _push(self, event: KVEvent) -> None:
        self.pending.append(event)
        if self.max_pending is not None and len(self.pending) > self.max_pending:
            del self.pending[: len(self.pending) - self.max_pending // 2]

    def take(self) -> List[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id
