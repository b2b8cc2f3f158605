"""KV cache events a worker publishes so the router's prefix index stays current.

Every event carries a monotonic ``event_id`` (per cache) so a consumer can
detect a gap and ask for a resync. Blocks are pages, named by their chained
hash (``mem_cache.radix_key.hash_pages``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Union


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


@dataclass
class KVEventQueue:
    """Collects events until a publisher drains them with :meth:`take`."""

    enabled: bool = False
    next_id: int = 0
    pending: List[KVEvent] = field(default_factory=list)

    def stored(self, hashes: List[str], parent: Optional[str], token_ids: List[int], block_size: int, extra_key=None):
        if self.enabled and hashes:
            self.pending.append(BlockStored(self._id(), hashes, parent, token_ids, block_size, extra_key))

    def removed(self, hashes: List[str]):
        if self.enabled and hashes:
            self.pending.append(BlockRemoved(self._id(), hashes))

    def cleared(self):
        if self.enabled:
            self.pending.append(AllBlocksCleared(self._id()))

    def take(self) -> List[KVEvent]:
        events, self.pending = self.pending, []
        return events

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id
