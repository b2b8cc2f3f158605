"""KV cache events a worker publishes so the router's prefix index stays current.

Every event carries a monotonic ``event_id`` (per cache) so a consumer can
detect a gap and ask for a resync. Blocks are pages, named by their chained
hash (``mem_cache.radix_key.hash_pages``).

A plain radix cache can reuse any cached prefix. Two caches cannot, and say where
a reused prefix may end (their :class:`ReuseRule`):

* ``state`` (``MambaRadixCache``'s prefill): only at a page after which a recurrent
  state is cached — :class:`StateStored` / :class:`StateRemoved` name those pages;
* ``window`` (``SWARadixCache``): only at a page whose last ``window`` tokens all hold
  sliding-window KV — :class:`WindowLost` / :class:`WindowRestored` name the pages
  that lose it (tombstones) or get it back.

A page's BlockRemoved drops its marks too.
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


@dataclass(frozen=True)
class PageMark:
    """The base of the events that mark pages for a reuse rule (each kind its own subclass)."""

    event_id: int
    block_hashes: List[str]


class StateStored(PageMark):
    """A recurrent (Mamba) state is cached after each of these pages."""


class StateRemoved(PageMark):
    """The states after these pages are gone (evicted)."""


class WindowLost(PageMark):
    """These pages' sliding-window KV is gone (tombstones): no reused prefix ends within a
    window after them."""


class WindowRestored(PageMark):
    """These pages have their sliding-window KV again (a tombstone revived)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared, StateStored, StateRemoved, WindowLost, WindowRestored]

REUSE_RULES = ("prefix", "state", "window")


class ReuseRule(NamedTuple):
    """Where a prefix a cache holds may be reused up to: ``prefix`` anywhere, ``state`` only at a
    page with a cached state, ``window`` only where the last ``window`` tokens have sliding-window KV."""

    kind: str = "prefix"
    window: int = 0  # tokens, for ``window``
    prompt_state: bool = False  # ``state``: a prompt's final state is cached at its end (not at a chunk boundary)


class KVEventBatch(NamedTuple):
    """Events after a consumer's cursor, oldest first; ``last_id`` is the cursor to ask from next.
    A first event id past ``cursor + 1`` means events were dropped: resync from a snapshot."""

    events: List[KVEvent]
    last_id: int


class PageHashSnapshot(NamedTuple):
    """Every page a cache holds, as of event ``last_id``: one chain of page hashes per tree node;
    with its reuse rule and the pages marked for it (``state_pages``: StateStored, ``lost_pages``:
    WindowLost)."""

    chains: List[List[str]]
    last_id: int
    page_size: int
    rule: ReuseRule = ReuseRule()
    state_pages: List[str] = []
    lost_pages: List[str] = []


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

    def marked(self, kind, hashes: List[str]):
        """``kind``: StateStored, StateRemoved, WindowLost or WindowRestored."""
        if self.enabled and hashes:
            self._push(kind(self._id(), hashes))

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
