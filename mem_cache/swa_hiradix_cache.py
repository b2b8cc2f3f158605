"""SWAHiRadixCache: the host tier (hierarchical cache) for sliding-window models.

An :class:`SWARadixCache` whose nodes can also live in host memory, as
:class:`HiRadixCache` does for one pool. The device pool has two halves (full-attention
layers, sliding-window layers), so the host tier has two host pools, allocated once:
``host_pool`` mirrors the full layers' pool and ``swa_host_pool`` the SWA layers'
(each ``host_to_device_ratio`` times its device pool), with a copier each
(``cache_controller``, ``swa_cache_controller``). A node holds

* ``value`` / ``host_value``: full KV slots on the device / the host (``value is None``:
  off the device, "evicted", then ``host_value`` is set);
* ``swa_host_value``: host slots of its SWA KV, or None. A backup copies the SWA KV of a
  node that still has it on the device; a node that is an SWA tombstone there backs up
  its full KV only, and is a tombstone on the host as well.

``swa_tombstone`` means "no SWA KV in the tier the node is in": on the device as in
:class:`SWARadixCache`, off it "no host copy of its SWA KV". So matching keeps its one
rule over both tiers (a match ends with the last window's SWA KV, here on the device or
loadable from the host), and every leaf of either tier has SWA KV.

* Along a path the device nodes come first; an evicted node is unlocked, in neither LRU
  list and counted in no size (those count device tokens).
* ``evict`` takes device leaves (children all off the device) as :class:`SWARadixCache`
  takes leaves: a node with a host copy (made now with ``write_back``, or to keep its host
  children reachable) leaves the device and stays in the tree; SWA eviction tombstones on
  the device only, the host copy of the SWA KV stays.
* ``init_load_back`` brings a match's host part back: the full KV of every node, the SWA
  KV of the nodes covering the last ``sliding_window_size`` tokens only (what a lock
  there holds; the rest is loaded as tombstones), so a long host prefix needs SWA slots
  for a window, not for the prefix. All or nothing.
* ``evict_host`` deletes host-only leaves, least recently used first. A backup short of SWA host
  slots first frees the SWA host copies of device tombstones (no host eviction reaches them).

Backups, host eviction and loads are in ``swa_hiradix_tiers.py``; the file tier
(``storage_backends``: a backup's pages written to files, a prefix fetched from them into
both host pools) in ``swa_hiradix_storage.py``. The copies are
synchronous: backups when decided, loads in ``init_load_back``; so the
scheduler's calls that end copies in flight (``writing_check``, ``loading_check``) find
none. With TP > 1 rank 0's copies are logged tagged with their pool (``PoolOpLog``) and each
follower replays them into its head shards of both host pools (``SWAHostReplay``). Every
node has its chained page hashes (``hash_value``, KV events or not): the file tier's keys.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from mem_cache.base_prefix_cache import MatchResult
from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.hiradix_cache import get_write_policy
from mem_cache.integrity import check_unique_in_range, ensure
from mem_cache.kv_events import WindowLost, WindowRestored
from mem_cache.radix_key import RadixKey, hash_pages, root_hash
from mem_cache.swa_hiradix_storage import SWAStorageTierMixin
from mem_cache.swa_hiradix_tiers import SWAHostTierMixin, swa_host_controllers
from mem_cache.swa_memory_pool import SWAKVPool
from mem_cache.swa_radix_cache import SWAEvictResult, SWARadixCache, SWATreeNode


class SWAHiRadixCache(SWAStorageTierMixin, SWAHostTierMixin, SWARadixCache):
    writes_pending = False  # (backups copy at once: none is ever in flight)

    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, kv_cache: SWAKVPool, sliding_window_size: int,
                 page_size: int = 1, *, host_to_device_ratio: float = 2.0, write_policy: str = "write_through",
                 load_back_threshold: int = 10,
                 storage_backends: Tuple[Optional[HiCacheStorage], Optional[HiCacheStorage]] = (None, None),
                 async_storage_writes: bool = False, enable_kv_events: bool = False, disable: bool = False):
        self.write_policy = get_write_policy(write_policy)
        self.load_back_threshold = load_back_threshold
        self.cache_controller, self.swa_cache_controller = swa_host_controllers(
            kv_cache, host_to_device_ratio, page_size, storage_backends, async_storage_writes)
        self.host_pool, self.swa_host_pool = self.cache_controller.host_pool, self.swa_cache_controller.host_pool
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, sliding_window_size, page_size,
                         enable_kv_events, disable)

    def reset(self) -> None:
        super().reset()
        self._clock = 0  # host eviction order: last_access_time
        self.host_pool.clear()
        self.swa_host_pool.clear()

    # ---- the scheduler's host-tier calls: nothing is in flight between them ----------
    def writing_check(self, wait: bool = False) -> int:
        return 0

    def ready_to_load_host_cache(self) -> None:
        pass

    def loading_check(self, raise_failed: bool = True) -> None:
        pass

    def take_failed_loads(self) -> None:
        return None  # (a failed copy raises from init_load_back: its tokens are computed instead)

    def cancel_prefetches(self) -> None:
        pass

    # ---- match / insert ----------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest usable prefix over both tiers ends at ``last_host_node`` when its
        end is off the device (``host_hit_length`` tokens after the device part), and the
        device part is cut to its own usable end: a load that does not happen leaves the
        request a prefix with its window. May split a node; never changes lock counts."""
        if self.disable or len(key) == 0:
            return MatchResult(self._empty(), self.root_node, self.root_node, 0)
        _, end = self._match_prefix_helper(self._page_align(key))
        path = self._path_to(end)
        on_device = [n for n in path if n.value is not None]
        device_path = on_device[: self._usable_len(on_device)]
        last_device = device_path[-1] if device_path else self.root_node
        self._refresh(end)
        now = self._tick()
        for node in path:
            node.last_access_time = now
        host_hit_length = sum(len(n.key) for n in path[len(device_path):])
        values = [n.value for n in device_path]
        indices = torch.cat(values) if values else self._empty()
        return MatchResult(indices, last_device, end if host_hit_length else last_device, host_hit_length)

    def _path_to(self, node: SWATreeNode) -> List[SWATreeNode]:
        path = []
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        return path[::-1]

    def insert(self, key: RadixKey, value: torch.Tensor, prev_prefix_len: int = 0, swa_evicted_seqlen: int = 0) -> int:
        """As :class:`SWARadixCache`'s (a node off the device on the way adopts the caller's
        slots: see :meth:`_settle_cached_run`); then the write policy backs up the nodes of
        ``key`` that reached their hits (an insert reaching a node is a hit)."""
        done = super().insert(key, value, prev_prefix_len, swa_evicted_seqlen)
        threshold = self.write_policy.hits_to_backup
        if self._counting_hits and threshold is not None:
            for node in self._nodes_of(key):
                node.hit_count += 1
                if node.hit_count >= threshold:
                    self._backup(node)
        return done

    def _nodes_of(self, key: RadixKey) -> List[SWATreeNode]:
        """The nodes holding ``key``'s tokens, as far as the tree holds them whole."""
        node, nodes = self.root_node, []
        while len(key) > 0:
            child = node.children.get(self.child_key(key))
            if child is None or self.key_match(child.key, key) < len(child.key):
                break
            nodes.append(child)
            node, key = child, key[len(child.key):]
        return nodes

    def cache_unfinished_req(self, req) -> None:
        """As :class:`SWARadixCache`'s; a chunk's insert counts no hit (one request is one use)."""
        self._counting_hits = False
        try:
            super().cache_unfinished_req(req)
        finally:
            self._counting_hits = True

    def _settle_cached_run(self, node: SWATreeNode, incoming: torch.Tensor, with_swa: bool) -> None:
        """A node off the device takes the caller's slots (the request recomputed KV the tree
        had on the host only): back on the device, a tombstone there if they lack SWA KV."""
        if node.value is not None:
            super()._settle_cached_run(node, incoming, with_swa)
            return
        node.value = incoming
        self._enter_device(node, with_swa)

    def _enter_device(self, node: SWATreeNode, with_swa: bool) -> None:
        """``node`` (its ``value`` just set) joins the device's lists and sizes."""
        self._add_device_accounts(node, with_swa)
        self._set_tombstone(node, not with_swa)

    def _record_stored(self, parent: SWATreeNode, node: SWATreeNode) -> None:
        """As :class:`SWARadixCache`'s, and the pages are hashed with KV events off too (storage keys)."""
        super()._record_stored(parent, node)
        if not node.hash_value:
            chain_from = parent.hash_value[-1] if parent.hash_value else root_hash(node.key.extra_key)
            node.hash_value = hash_pages(node.key.token_ids, self.page_size, chain_from)

    def _set_tombstone(self, node: SWATreeNode, tombstone: bool) -> None:
        if node.swa_tombstone != tombstone:
            node.swa_tombstone = tombstone
            self.events.marked(WindowLost if tombstone else WindowRestored, node.hash_value)

    # ---- device eviction --------------------------------------------------------------------
    def evict(self, full_num_tokens: int = 0, swa_num_tokens: int = 0) -> SWAEvictResult:
        """As :class:`SWARadixCache`'s over the device tier: full eviction takes unlocked device
        leaves (children all off the device), SWA eviction tombstones a node with children and
        takes a leaf. A node leaving the device keeps its host copy (see :meth:`_evict_device_node`);
        with ``write_back`` a node's KV is backed up before either pool's eviction frees it."""
        full = swa = 0
        stuck = set()  # nodes that cannot leave (their host children need a host copy, no room)
        while full < full_num_tokens:
            node = self.full_lru_list.first_lru(lambda n: n.id not in stuck and self._is_device_leaf(n))
            if node is None:
                break
            node_full, node_swa = self._evict_device_node(node)
            stuck.update([node.id] if node_full == 0 else [])
            full, swa = full + node_full, swa + node_swa
        while swa < swa_num_tokens:
            node = self.swa_lru_list.first_lru(lambda n: n.id not in stuck and n.swa_lock_ref == 0)
            if node is None:
                break
            if node.children:
                if self.write_policy.backup_on_evict:  # (the SWA KV leaves the device: write_back copies it first)
                    self._backup(node)
                swa += self._tombstone(node)
                continue
            node_full, node_swa = self._evict_device_node(node)
            stuck.update([node.id] if node_full == 0 else [])
            full, swa = full + node_full, swa + node_swa
        return SWAEvictResult(full, swa)

    def _is_device_leaf(self, node: SWATreeNode) -> bool:
        return node.full_lock_ref == 0 and all(child.value is None for child in node.children.values())

    def _evict_device_node(self, node: SWATreeNode) -> Tuple[int, int]:
        """Free an unlocked device leaf's device slots; returns the (full, SWA) slots freed.
        It stays in the tree, off the device, if it has (or now gets: ``write_back``, or host
        children to keep reachable) a host copy; else it goes, with its tombstone ancestors
        left as leaves (:meth:`_tidy`)."""
        if self.write_policy.backup_on_evict or node.children:
            self._backup(node)
        freed = (len(node.key), 0 if node.swa_tombstone else len(node.key))
        parent = node.parent
        if node.host_value is not None:
            self._leave_device(node)
            self._tidy(node)  # (a tombstone on the host too: no match can use it as a leaf)
        elif node.children:
            return 0, 0
        else:
            self._remove(node)
            self._tidy(parent)
        return freed

    def _leave_device(self, node: SWATreeNode) -> None:
        self._free(node.value)
        self._drop_device_accounts(node)
        node.value = None
        node.last_access_time = self._tick()
        self._set_tombstone(node, node.swa_host_value is None)

    def _remove(self, node: SWATreeNode) -> None:
        """Delete a childless node from the tree, freeing whatever it holds in either tier."""
        if node.value is not None:
            self._free(node.value)
            self._drop_device_accounts(node)
        self._free_host(node.host_value, node.swa_host_value)
        del node.parent.children[self.child_key(node.key)]
        self.events.removed(node.hash_value)

    def _tidy(self, node: SWATreeNode) -> SWATreeNode:
        """Walking up from ``node``: a childless tombstone (no SWA KV in its tier) nobody
        uses cannot end a match; it leaves the device if it has a full host copy with SWA KV
        (a usable host leaf), else it leaves the tree. Returns the first node left."""
        while (node is not self.root_node and not node.children and node.swa_tombstone
               and node.full_lock_ref == 0 and node.host_ref_counter == 0):
            if node.value is not None and node.host_value is not None and node.swa_host_value is not None:
                self._leave_device(node)
                return node
            parent = node.parent
            self._remove(node)
            node = parent
        return node

    # ---- inspection ---------------------------------------------------------------------------
    def all_host_values(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Every host slot the tree holds: (full, SWA)."""
        nodes = list(self._iter_nodes())
        full = [n.host_value for n in nodes if n.host_value is not None]
        swa = [n.swa_host_value for n in nodes if n.swa_host_value is not None]
        empty = torch.empty(0, dtype=torch.int64)
        return (torch.cat(full) if full else empty), (torch.cat(swa) if swa else empty)

    def check_integrity(self) -> None:
        """:class:`SWARadixCache`'s checks over the device tier, plus: device nodes before host
        ones along paths; a node off the device backed up, unlocked, a tombstone exactly when its
        host copy lacks SWA KV; an SWA host copy only beside a full one; no host ref left; page
        hashes present; every slot of both host pools held by exactly one node or free."""
        super().check_integrity()
        for node in self._iter_nodes():
            ensure(len(node.hash_value) == len(node.key) // self.page_size, f"{node!r} page hashes out of step")
            ensure(node.host_ref_counter == 0, f"{node!r} holds {node.host_ref_counter} host refs between calls")
            for host in (node.host_value, node.swa_host_value):
                ensure(host is None or len(host) == len(node.key), f"{node!r}: host slots and tokens differ in number")
            ensure(node.swa_host_value is None or node.host_value is not None, f"{node!r}: an SWA host copy alone")
            if node.value is None:
                ensure(node.host_value is not None, f"{node!r} is off the device without a host copy")
                ensure(node.full_lock_ref == node.swa_lock_ref == 0, f"{node!r} is off the device but locked")
                ensure(node.swa_tombstone == (node.swa_host_value is None), f"{node!r}: tombstone flag and host copy")
            else:
                ensure(node.parent is self.root_node or node.parent.value is not None,
                       f"{node!r} is on the device under a parent off it")
        for pool, held in zip((self.host_pool, self.swa_host_pool), self.all_host_values()):
            check_unique_in_range(f"SWAHiRadixCache host slots of {pool.layer_num} layers", held, 0, pool.size - 1)
            pool.check_integrity(in_use=held)
