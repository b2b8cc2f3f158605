"""Eviction policies of the radix caches, chosen by name from a registry.

A policy maps a tree node to a sort key; the node with the *smallest* key is
evicted first. Times are the cache's logical clock (a counter bumped on every
access), so orders are exact and reproducible.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

EvictionKey = Callable[[Any], Any]

EVICTION_POLICIES: Dict[str, EvictionKey] = {
    "lru": lambda node: node.last_access_time,
    "lfu": lambda node: (node.hit_count, node.last_access_time),
    "fifo": lambda node: node.creation_time,
    "mru": lambda node: -node.last_access_time,
    "filo": lambda node: -node.creation_time,
    "priority": lambda node: (node.priority, node.last_access_time),
}


def get_eviction_policy(name: str) -> EvictionKey:
    try:
        return EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None
