"""HiRadixCache: a RadixCache whose nodes can live on device, host and storage
(seed 000 §6, reference §5).

A node's KV is on the device (``value``: device slots), on the host
(``host_value``: host slots), or both. Rules the tree keeps:

* a node on the device has its parent on the device (or is under the root);
  so along any path the device part comes first, then the host-only part;
* a node with ``value is None`` ("evicted") has ``host_value``; it is never
  locked (``lock_ref == 0``) and counts in neither ``evictable_size()`` nor
  ``protected_size()`` — those count device tokens only;
* ``host_ref_counter > 0`` protects a node's host copy from ``evict_host``
  while a load or a prefetch uses it;
* every node has its chained page hashes (``hash_value``): they are the keys
  of the storage tier.

Write policies say when a device node is copied to the host: on its first
hit, on its second, or only when it leaves the device. A hit is a
``match_prefix`` through the node or an ``insert`` that reaches it (the one
that creates it included) — ``hit_count``, which LFU eviction reads too. The
backup itself is decided in ``insert``, where fresh KV passes to the tree.
What ``cache_unfinished_req`` does for a chunked request (its insert)
counts no hits, as in SGLang: one request is one use, however many chunks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Optional

import torch

from mem_cache.base_prefix_cache import MatchResult
from mem_cache.hicache_controller import HiCacheController, PrefetchOp, WriteInFlight
from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.hiradix_loads import LoadBackMixin
from mem_cache.hiradix_tiers import HostTierMixin
from mem_cache.integrity import check_unique_in_range, ensure
from mem_cache.memory_pool import KVCache
from mem_cache.memory_pool_host import create_host_pool
from mem_cache.radix_cache import InsertResult, RadixCache, TreeNode
from mem_cache.radix_key import RadixKey, hash_pages, root_hash


@dataclass(frozen=True)
class WritePolicy:
    """``hits_to_backup``: back a device node up once it has this many hits
    (``None``: hits never do); ``backup_on_evict``: back it up when it leaves the device."""

    hits_to_backup: Optional[int]
    backup_on_evict: bool


WRITE_POLICIES = {
    "write_through": WritePolicy(hits_to_backup=1, backup_on_evict=False),
    "write_through_selective": WritePolicy(hits_to_backup=2, backup_on_evict=False),
    "write_back": WritePolicy(hits_to_backup=None, backup_on_evict=True),
}


def get_write_policy(name: str) -> WritePolicy:
    try:
        return WRITE_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(WRITE_POLICIES))
        raise ValueError(f"unknown hicache write policy {name!r}; known: {known}") from None


class HiRadixCache(HostTierMixin, LoadBackMixin, RadixCache):
    """RadixCache over a device KV pool, its host copy and an optional storage backend.

    Beyond :class:`RadixCache`'s contract:

    * ``evict(n)`` frees device slots of device leaves (nodes whose children are
      all off the device); a node with a host copy stays, with ``value = None``;
    * ``evict_host(n)`` deletes host-only nodes nobody uses, leaves first;
    * ``match_prefix`` also reports ``last_host_node`` and ``host_hit_length``;
    * ``init_load_back`` brings a host-only chain back to the device, all or nothing;
      with ``overlap_load`` the copy is queued: ``ready_to_load_host_cache()``
      starts it before the forward, ``loading_check()`` ends it after; with
      ``async_storage_writes`` a storage thread writes the pages of backups;
      a load that fails, and fails again when copied again, leaves its nodes' device
      slots without KV: no match finds them, and they leave the device (host copy kept)
      at their last ``dec_lock_ref`` — at once when nobody locks them; a failed load is
      raised by ``loading_check`` or kept for ``take_failed_loads`` (``evict``, and
      ``loading_check(raise_failed=False)``: the forward that read it decides);
    * with TP, a backup another rank failed to copy loses its host copy when rank 0
      hears of it (``writing_check``, ``loading_check``): a node only on the host leaves
      the tree;
    * with ``overlap_write`` a write-through backup (a hit) copies off the loop,
      its node locked meanwhile: ``writing_check()`` ends the copies done (the
      scheduler calls it every step; ``evict`` waits for them when it needs
      their slots); a backup on eviction is copied at once (its slots are freed next);
    * ``prefetch_from_storage(key)`` fetches pages past the host hit into host slots;
      ``start_prefetch(key)`` does it on the storage thread, ``finish_prefetch(op)``
      ends it and puts what was read in the tree.
    """

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        kv_cache: KVCache,
        page_size: int = 1,
        *,
        host_to_device_ratio: float = 2.0,
        host_size_gb: float = 0,
        host_layout: str = "layer_first",
        write_policy: str = "write_through",
        load_back_threshold: int = 10,
        storage_backend: Optional[HiCacheStorage] = None,
        overlap_load: bool = False,
        overlap_write: bool = False,
        async_storage_writes: bool = False,
        disable: bool = False,
        eviction_policy: str = "lru",
        enable_kv_events: bool = False,
    ):
        self.write_policy = get_write_policy(write_policy)
        self.load_back_threshold = load_back_threshold
        self.host_pool = create_host_pool(
            kv_cache, host_to_device_ratio=host_to_device_ratio, host_size_gb=host_size_gb,
            page_size=page_size, layout=host_layout,
        )
        self.cache_controller = HiCacheController(
            kv_cache, self.host_pool, storage_backend, overlap_load, async_storage_writes=async_storage_writes,
            overlap_write=overlap_write,
        )
        self._writing: List[WriteInFlight] = []  # backups in flight, in the order started: each locks its node
        self._loading_nodes: List[TreeNode] = []  # loaded back, their copy not ended: host copies held
        self._lost_slots: Optional[torch.Tensor] = None  # device slots loads failed to fill, still locked
        self._load_errors: List[str] = []  # loads failed and not raised, for take_failed_loads
        self.prefetch_ops: List[PrefetchOp] = []  # started, not finished: each owns its host slots
        self._prefetch_ids = 0
        self.prefetch_capacity = 0.5  # of the host pool, that the prefetches in flight may hold together
        super().__init__(
            req_to_token_pool, token_to_kv_pool_allocator, page_size, disable, eviction_policy, enable_kv_events
        )

    def reset(self) -> None:
        self.writing_check(wait=True)
        self.loading_check()
        self.cancel_prefetches()
        super().reset()
        self.host_pool.clear()
        self._lost_slots = None
        self.take_failed_loads()

    def _add_leaf(self, parent: TreeNode, key: RadixKey, value: torch.Tensor, priority: int, now: int) -> TreeNode:
        leaf = super()._add_leaf(parent, key, value, priority, now)
        if not leaf.hash_value:  # RadixCache hashes pages only for KV events; storage keys need them always
            leaf.hash_value = self._page_hashes(parent, key)
        return leaf

    def _page_hashes(self, parent: TreeNode, key: RadixKey) -> List[str]:
        chain_from = parent.hash_value[-1] if parent.hash_value else root_hash(key.extra_key)
        return hash_pages(key.token_ids, self.page_size, chain_from)

    # ---- match / insert ------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """Device slots of the on-device prefix; ``host_hit_length`` tokens after it
        are on the host, ending at ``last_host_node`` (the deepest node with a
        host copy on the matched path). May split a node; never locks or allocates."""
        if self.disable or len(key) == 0:
            return MatchResult(self._empty(), self.root_node, self.root_node, 0)
        values, node = self._match_prefix_helper(self._page_align(key))
        if self._lost_slots is not None:
            values, node = self._cut_before_lost(values, node)
        device_values = [v for v in values if v is not None]
        last_host_node, host_hit_length = node, 0
        while node.evicted:
            host_hit_length += len(node.host_value)
            node = node.parent
        while not last_host_node.backuped and last_host_node is not self.root_node:
            last_host_node = last_host_node.parent
        indices = torch.cat(device_values) if device_values else self._empty()
        return MatchResult(indices, node, last_host_node, host_hit_length)

    def _cut_before_lost(self, values: List[Optional[torch.Tensor]], node: TreeNode):
        """A match's ``(values, node)`` up to the first node of its path that holds lost slots."""
        path = []  # root (excluded) → node: one entry per value
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        path.reverse()
        for i, each in enumerate(path):
            if self._holds_lost_slots(each):
                return values[:i], each.parent
        return values, path[-1] if path else self.root_node

    def _insert_helper(self, key: RadixKey, value: Optional[torch.Tensor], priority: int) -> InsertResult:
        """As RadixCache's; a host-only node on the path adopts the caller's slots
        (its tokens are not counted as already cached), then the write policy runs.
        The path's slots end, as ``match_prefix``'s, before a node holding lost slots."""
        if self.disable:
            return InsertResult(0, [], self.root_node)
        if len(key) % self.page_size != 0:
            raise ValueError(f"insert needs a page-aligned key (page_size={self.page_size}), got {len(key)} tokens")
        if value is None:
            value = torch.tensor(key.token_ids, dtype=torch.int64)
        now = self._tick()
        node, total, path = self.root_node, 0, []
        node.last_access_time = now
        while len(key) > 0:
            child = node.children.get(self.child_key(key))
            if child is None:
                break
            child.last_access_time = now
            child.priority = max(child.priority, priority)
            matched = self.key_match(child.key, key)
            if matched < len(child.key):
                child = self._split_node(child, matched)
            if child.evicted:  # the request recomputed KV the tree had only on host
                child.value = value[:matched]
                self.evictable_size_ += matched
            else:
                total += matched
            path.append(child)
            key, value = key[matched:], value[matched:]
            node = child
        if len(key) > 0:
            path.append(self._add_leaf(node, key, value, priority, now))
        if self._counting_hits:
            self._count_hits(path)
        values, node = [n.value for n in path], path[-1] if path else self.root_node
        if self._lost_slots is not None:
            values, node = self._cut_before_lost(values, node)
        return InsertResult(total, values, node)

    def _count_hits(self, path: List[TreeNode]) -> None:
        threshold = self.write_policy.hits_to_backup
        for node in path:
            node.hit_count += 1
            if threshold is not None and node.hit_count >= threshold and not node.backuped:
                self._backup(node, now=False)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """As RadixCache's; a node holding lost slots leaves the device at its last unlock."""
        delta = super().dec_lock_ref(node)
        if self._lost_slots is not None:
            self._drop_lost_loads()
        return delta

    # ---- device eviction -----------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots if possible, device leaves in
        eviction-policy order; returns how many were freed."""
        if self.disable or num_tokens <= 0:
            return 0
        self.writing_check()  # backups done give their nodes back; short of room, wait for more, oldest first
        while self._writing and self.evictable_size_ < num_tokens:
            self._end_oldest_write()
        if any(n.lock_ref == 0 for n in self._loading_nodes):  # a load may still write slots about to be
            self.loading_check(raise_failed=False)  # freed (its request was not taken after all); a taken
            # one's are locked (one that failed: take_failed_loads; the forward that reads it decides)
        heap = [(self.eviction_key(n), n.id, n) for n in self._iter_nodes() if self._is_device_leaf(n)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            evicted += self._evict_device_node(node)
            parent = node.parent
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (self.eviction_key(parent), parent.id, parent))
        return evicted

    def _is_device_leaf(self, node: TreeNode) -> bool:
        if node is self.root_node or node.evicted or node.lock_ref > 0:
            return False
        return all(child.evicted for child in node.children.values())

    def _evict_device_node(self, node: TreeNode) -> int:
        """Free ``node``'s device slots: keep it as host-only if it has (or now
        gets) a host copy, else delete it. Returns the tokens freed (0 if it stays)."""
        held = node.children or node.host_ref_counter > 0  # host-only children, or a prefetch extending it,
        if not node.backuped and (self.write_policy.backup_on_evict or held):  # need it to stay in the tree
            self._backup(node)
        num_tokens = len(node.value)
        if node.backuped:
            self._free(node.value)
            node.value = None
            self.evictable_size_ -= num_tokens
            return num_tokens
        if held:  # no host room: evict_host left only children (or the node) in use
            return 0
        self._free(node.value)
        self._delete_leaf(node)
        return num_tokens

    # ---- inspection ----------------------------------------------------------
    def all_host_values(self) -> torch.Tensor:
        """Every host slot the tree holds (for conservation checks)."""
        values = [n.host_value for n in self._iter_nodes() if n.host_value is not None]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def check_integrity(self) -> None:
        """RadixCache's checks, plus: tiers ordered along paths, evicted nodes
        backed up and unlocked, nodes being loaded or backed up on the device, page
        hashes present, host slots held exactly once and never free in the host pool."""
        super().check_integrity()
        for node in self._iter_nodes():
            name = repr(node)
            ensure(len(node.hash_value) == len(node.key) // self.page_size, f"{name} page hashes out of step")
            ensure(node.host_ref_counter >= 0, f"{name} has a negative host_ref_counter")
            if node.backuped:
                ensure(len(node.host_value) == len(node.key), f"{name}: {len(node.host_value)} host slots")
            if node.evicted:
                ensure(node.backuped, f"{name} is evicted without a host copy")
                ensure(node.lock_ref == 0, f"{name} is evicted but locked")
            else:
                ensure(not node.parent.evicted, f"{name} is on the device under an evicted parent")
        for node in self._iter_nodes():  # (unlocked, it would have left the device)
            ensure(not self._holds_lost_slots(node) or node.lock_ref > 0,
                   f"{node!r} holds device slots a failed load left without KV, and nobody locks it")
        for node in self._loading_nodes:  # (its load writes the slots it holds: freed, they could be reused)
            ensure(not node.evicted, f"{node!r} is being loaded back but is off the device")
        ensure(bool(self._loading_nodes) or not self.cache_controller.load_pending,
               "host-tier loads pending that no loading node holds the slots of")
        for write in self._writing:
            ensure(not write.node.evicted and write.node.lock_ref > 0 and write.node.host_value is not None,
                   f"{write.node!r} is being backed up but is off the device, unlocked or without host slots")
        refs = {}
        for node in self._loading_nodes + [op.end for op in self.prefetch_ops]:
            refs[node.id] = refs.get(node.id, 0) + 1
        for node in self._iter_nodes():  # between calls only loads and prefetches in flight hold host refs
            ensure(node.host_ref_counter == refs.get(node.id, 0),
                   f"{node!r} holds {node.host_ref_counter} host refs, {refs.get(node.id, 0)} loads and "
                   f"prefetches in flight")
        held = torch.cat([self.all_host_values()] + [op.host_indices for op in self.prefetch_ops])
        check_unique_in_range("HiRadixCache host slots (and prefetches')", held, 0, self.host_pool.size - 1)
        self.host_pool.check_integrity(in_use=held)
