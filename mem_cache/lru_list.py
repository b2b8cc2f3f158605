"""An intrusive doubly-linked LRU list with O(1) move and remove.

Nodes carry their own links; one node can sit in several lists at once, each
list using its own pair of attributes (``prev``/``next`` for the full-KV list,
``mamba_prev``/``mamba_next`` for the Mamba-state list). The head side is
most recently used, the tail side least.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, Optional


class _Sentinel:
    def __init__(self):
        self.id = -1


class LRUList:
    def __init__(self, prev_attr: str = "prev", next_attr: str = "next"):
        self.prv, self.nxt = prev_attr, next_attr
        self.head, self.tail = _Sentinel(), _Sentinel()
        setattr(self.head, self.nxt, self.tail)
        setattr(self.tail, self.prv, self.head)
        self.cache: Dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.cache)

    def __contains__(self, node) -> bool:
        return node.id in self.cache

    def _link_after(self, anchor, node) -> None:
        after = getattr(anchor, self.nxt)
        setattr(node, self.prv, anchor)
        setattr(node, self.nxt, after)
        setattr(anchor, self.nxt, node)
        setattr(after, self.prv, node)

    def _unlink(self, node) -> None:
        before, after = getattr(node, self.prv), getattr(node, self.nxt)
        setattr(before, self.nxt, after)
        setattr(after, self.prv, before)
        setattr(node, self.prv, None)
        setattr(node, self.nxt, None)

    def insert_mru(self, node) -> None:
        assert node.id not in self.cache, f"{node} already in the list"
        self.cache[node.id] = node
        self._link_after(self.head, node)

    def insert_after(self, anchor, node) -> None:
        """Put ``node`` just older than ``anchor`` (used when a split creates a parent)."""
        assert node.id not in self.cache and anchor.id in self.cache
        self.cache[node.id] = node
        self._link_after(anchor, node)

    def remove(self, node) -> None:
        del self.cache[node.id]
        self._unlink(node)

    def reset_node_mru(self, node) -> None:
        self._unlink(node)
        self._link_after(self.head, node)

    def reset_node_and_parents_mru(self, node, root) -> None:
        """Move ``node`` to the head and its ancestors right behind it, so a
        parent is always older than its children."""
        anchor = self.head
        while node is not root:
            if node.id in self.cache:
                self._unlink(node)
                self._link_after(anchor, node)
                anchor = node
            node = node.parent

    def iter_lru(self) -> Iterator:
        """Nodes from least to most recently used."""
        node = getattr(self.tail, self.prv)
        while node is not self.head:
            yield node
            node = getattr(node, self.prv)

    def first_lru(self, accept: Callable[[object], bool]) -> Optional[object]:
        return next((n for n in self.iter_lru() if accept(n)), None)
