"""The host side of :class:`~mem_cache.swa_hiradix_cache.SWAHiRadixCache`: backing a node's
KV up to both host pools, deleting host-only nodes for room, and loading a match's host part
back — the full KV of every node, the SWA KV of the last window's.

Split out of ``swa_hiradix_cache.py`` to keep each file to one concern (as ``hiradix_tiers.py``
is from ``hiradix_cache.py``): the tree walks (match, insert, device eviction) stay there. It
relies on the cache's ``host_pool``, ``swa_host_pool``, both controllers,
``token_to_kv_pool_allocator``, ``load_back_threshold``, lock and eviction methods and tree
helpers (``_remove``, ``_tidy``, ``_enter_device``). Also here: the two pools' copiers
(:func:`swa_host_controllers`) and their TP side, rank 0's tagged op log (:class:`PoolOpLog`) and a
follower's replay (:class:`SWAHostReplay`).
"""

from __future__ import annotations

import heapq
import logging
from typing import List, Optional, Tuple

import torch

from mem_cache.hicache_controller import HiCacheController
from mem_cache.hicache_storage import HiCacheStorage
from mem_cache.memory_pool_host import HostKVCache, MHATokenToKVPoolHost
from mem_cache.swa_memory_pool import SWAKVPool
from mem_cache.swa_radix_cache import SWATreeNode

logger = logging.getLogger(__name__)


def swa_host_controllers(kv_cache: SWAKVPool, host_to_device_ratio: float, page_size: int,
                         storage: Tuple[Optional[HiCacheStorage], Optional[HiCacheStorage]] = (None, None),
                         async_storage_writes: bool = False) -> List[HiCacheController]:
    """The copiers of a sliding-window model's two host pools, each ``host_to_device_ratio`` times its
    device pool: the full layers' (index 0), the SWA layers' (1), each with its file tier of
    ``storage`` (see :func:`~mem_cache.swa_hiradix_storage.swa_storage_backends`). Copies between host
    and device are made at once (no overlap)."""
    return [HiCacheController(pool, MHATokenToKVPoolHost(pool, host_to_device_ratio, page_size=page_size), store,
                              overlap_load=False, async_storage_writes=async_storage_writes)
            for pool, store in zip((kv_cache.full_kv_pool, kv_cache.swa_kv_pool), storage)]


class PoolOpLog:
    """One host pool's share of a TP rank 0's op log (``HiCacheController.op_log``): its copies go
    into the one log the followers replay, tagged with the pool's index in :func:`swa_host_controllers`
    (``(pool, entry)``). Only appended to: the copies are made at once, so no sync point is logged."""

    def __init__(self, log: list, pool: int):
        self.log, self.pool = log, pool

    def append(self, entry: Tuple) -> None:
        self.log.append((self.pool, entry))


class SWAHostReplay:
    """A TP follower's side of :class:`~mem_cache.swa_hiradix_cache.SWAHiRadixCache`: its head shard of
    both host pools, with the slot counts of rank 0's, into and out of which it replays rank 0's tagged
    copies (:class:`PoolOpLog`) before the forward that reads them, its storage writes into its own
    file tier (``storage``); rank 0's reads from storage it makes when asked (:meth:`read_storage`).
    A copy failing here raises (the follower's loop ends and the group with it): unlike the plain
    host tier's, rank 0 does not ask the followers how their copies ended, so one going on would
    compute with garbage KV."""

    def __init__(self, kv_cache: SWAKVPool, host_to_device_ratio: float, page_size: int,
                 storage: Tuple[Optional[HiCacheStorage], Optional[HiCacheStorage]] = (None, None)):
        self.controllers = swa_host_controllers(kv_cache, host_to_device_ratio, page_size, storage,
                                                async_storage_writes=True)

    def replay(self, ops: List[Tuple[int, Tuple]]) -> None:
        for pool, entry in ops:
            self.controllers[pool].replay([entry])

    def read_storage(self, keys: List[str], host_indices: torch.Tensor, pool: int) -> int:
        """Rank 0's read of pages ``keys`` into ``host_indices`` of host pool ``pool``, here; returns
        the pages read."""
        return self.controllers[pool].read_storage(keys, host_indices)

    def use_storage(self, storage: Tuple[HiCacheStorage, HiCacheStorage]) -> None:
        for controller, backend in zip(self.controllers, storage):
            controller.use_storage(backend)

    @property
    def load_pending(self) -> bool:
        return any(c.load_pending for c in self.controllers)

    @property
    def load_failures_pending(self) -> bool:
        return any(c.load_failures_pending for c in self.controllers)

    def start_loading(self) -> None:
        for controller in self.controllers:
            controller.start_loading()

    def wait_loading(self) -> None:
        for controller in self.controllers:
            controller.wait_loading()

    def close(self) -> None:
        for controller in self.controllers:
            controller.close()


class SWAHostTierMixin:
    # ---- device → host -------------------------------------------------------------------
    def _backup(self, node: SWATreeNode) -> bool:
        """Complete ``node``'s host copy: its full KV if not there yet, and its SWA KV if it has
        some on the device and not on the host (and the pages copied to storage). All or nothing;
        False when the host pools have no room even after ``evict_host``, or a copy fails (logged
        and counted)."""
        need_full, need_swa = node.host_value is None, not node.swa_tombstone and node.swa_host_value is None
        if not (need_full or need_swa):
            return True
        node.host_ref_counter += 1  # evict_host must not tidy it away meanwhile
        try:
            host = self._alloc_host(self.host_pool, len(node.key)) if need_full else None
            swa_host = self._alloc_host(self.swa_host_pool, len(node.key)) if need_swa else None
        finally:
            node.host_ref_counter -= 1
        if (need_full and host is None) or (need_swa and swa_host is None):
            self._free_host(host, swa_host)
            return False
        try:
            if need_full:
                self.cache_controller.write(host, node.value)
            if need_swa:
                swa = self.token_to_kv_pool_allocator.full_to_swa_index_mapping[node.value]
                self.swa_cache_controller.write(swa_host, swa)
        except Exception as exc:  # it costs the host copy, not the step
            logger.error("backing up %d tokens to the host tier failed: %r", len(node.key), exc)
            self.cache_controller.failed_written_tokens += len(node.key)
            self._free_host(host, swa_host)
            return False
        node.host_value = host if need_full else node.host_value
        node.swa_host_value = swa_host if need_swa else node.swa_host_value
        self._write_storage(node, need_full, need_swa)
        return True

    def _alloc_host(self, pool: HostKVCache, num_tokens: int) -> Optional[torch.Tensor]:
        indices = pool.alloc(num_tokens)
        if indices is None and pool is self.swa_host_pool:
            self._drop_tombstone_swa_backups(num_tokens - pool.available_size())
            indices = pool.alloc(num_tokens)
        if indices is None:
            short = num_tokens - pool.available_size()
            self.evict_host(*((short, 0) if pool is self.host_pool else (0, short)))
            indices = pool.alloc(num_tokens)
        return indices

    def _drop_tombstone_swa_backups(self, num_tokens: int) -> int:
        """Free the SWA host copies of device tombstones, least recently used first, until
        ``num_tokens`` are freed or none is left; returns how many were. ``evict_host`` never
        reaches them (their nodes are on the device), and the full pool can hold more tombstones
        than the SWA host pool has slots (``hicache_ratio * swa_full_tokens_ratio < 1``): kept,
        they filled it and every later backup with SWA KV failed. Such a copy serves a match only
        once its node leaves the device, so it goes before a host-only prefix does."""
        freed = 0
        for node in self.full_lru_list.iter_lru():
            if freed >= num_tokens:
                break
            if node.swa_tombstone and node.swa_host_value is not None and node.host_ref_counter == 0:
                self.swa_host_pool.free(node.swa_host_value)
                node.swa_host_value = None
                freed += len(node.key)
        return freed

    def _free_host(self, host: Optional[torch.Tensor], swa_host: Optional[torch.Tensor]) -> None:
        if host is not None:
            self.host_pool.free(host)
        if swa_host is not None:
            self.swa_host_pool.free(swa_host)

    # ---- host eviction --------------------------------------------------------------------
    def evict_host(self, num_tokens: int, swa_num_tokens: int = 0) -> int:
        """Delete host-only leaves nobody uses, least recently used first, until
        ``num_tokens`` full and ``swa_num_tokens`` SWA host slots are freed or none is left;
        returns the full host slots freed."""
        heap = [(n.last_access_time, n.id, n) for n in self._iter_nodes() if self._is_host_leaf(n)]
        heapq.heapify(heap)
        freed = swa_freed = 0
        while (freed < num_tokens or swa_freed < swa_num_tokens) and heap:
            _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            swa_freed += 0 if node.swa_host_value is None else len(node.key)
            parent = node.parent
            self._remove(node)
            left = self._tidy(parent)
            if self._is_host_leaf(left):
                heapq.heappush(heap, (left.last_access_time, left.id, left))
        return freed

    def _is_host_leaf(self, node: SWATreeNode) -> bool:
        return node is not self.root_node and node.value is None and not node.children and node.host_ref_counter == 0

    # ---- host → device ----------------------------------------------------------------------
    def init_load_back(self, last_host_node: SWATreeNode, host_hit_length: int) -> Tuple[torch.Tensor, SWATreeNode]:
        """Bring a match's host part back (``last_host_node``, ``host_hit_length``: from the same
        ``match_prefix``). Returns the device slots of those ``host_hit_length`` tokens, after the
        match's device part, and ``last_host_node``; or no slots and the match's device end when
        the part is under ``load_back_threshold`` tokens or the device has no room. A copy that
        fails raises, the nodes stay on the host."""
        chain = []
        node = last_host_node
        while node.value is None:
            chain.append(node)
            node = node.parent
        chain.reverse()
        between = []  # device nodes after the match's device end, before the chain (tombstones among them)
        rest = host_hit_length - sum(len(n.key) for n in chain)
        while rest > 0 and node is not self.root_node:
            between.append(node)
            rest -= len(node.key)
            node = node.parent
        if rest != 0 or not chain:
            raise ValueError(f"stale match: {host_hit_length} host-hit tokens do not end at {last_host_node}")
        # (the threshold counts the tokens the load saves computing: the device tombstones before the chain too)
        loaded = self._load_back(chain) if host_hit_length >= self.load_back_threshold else None
        if loaded is None:
            return self._empty(), node
        return torch.cat([n.value for n in reversed(between)] + [loaded]), last_host_node

    def _load_back(self, chain: List[SWATreeNode]) -> Optional[torch.Tensor]:
        """Copy ``chain`` (off the device, top-down) to fresh device slots: full KV for all,
        SWA KV for those in the last window. None if the window lost its SWA KV since the
        match, or the device has no room even after eviction."""
        num_tokens = sum(len(n.key) for n in chain)
        window = self._window_nodes(chain[-1])
        if any(n.swa_tombstone for n in window):
            return None
        with_swa = [n for n in chain if n in window]  # (the chain's last nodes)
        swa_tokens = sum(len(n.key) for n in with_swa)
        self._hold(chain[0].parent, window, +1)  # the device prefix and its window stay while evicting for room
        for node in chain:
            node.host_ref_counter += 1  # and the chain's host copies (a write_back eviction may evict_host)
        try:
            device = self._alloc_loaded(num_tokens, swa_tokens)
            if device is None:
                return None
            try:
                self.cache_controller.load(torch.cat([n.host_value for n in chain]), device)
                if with_swa:
                    swa = self.token_to_kv_pool_allocator.full_to_swa_index_mapping[device[num_tokens - swa_tokens:]]
                    self.swa_cache_controller.load(torch.cat([n.swa_host_value for n in with_swa]), swa)
            except BaseException:
                self._free(device)
                raise
        finally:
            for node in chain:
                node.host_ref_counter -= 1
            self._hold(chain[0].parent, window, -1)
        offset = 0
        for node in chain:
            # [offset, offset + len(node.key)): this node's share of the new slots
            node.value = device[offset: offset + len(node.key)]
            offset += len(node.key)
            self._enter_device(node, node in with_swa)
        self._refresh(chain[-1])
        return device

    def _window_nodes(self, node: SWATreeNode) -> List[SWATreeNode]:
        """The nodes a lock on ``node`` swa-locks: those covering the path's last window."""
        nodes, covered = [], 0
        while node is not self.root_node and covered < self.sliding_window_size:
            nodes.append(node)
            covered += len(node.key)
            node = node.parent
        return nodes

    def _hold(self, node: SWATreeNode, window: List[SWATreeNode], delta: int) -> None:
        """Lock (``delta`` +1) or unlock the full KV of root→``node`` and the SWA KV of
        ``window``'s device nodes (a tombstone on the path may end it: no ``inc_lock_ref``)."""
        while node is not self.root_node:
            self._move_full_lock(node, delta)
            node = node.parent
        for each in window:
            if each.value is not None:
                self._move_swa_lock(each, delta)

    def _alloc_loaded(self, num_tokens: int, swa_tokens: int) -> Optional[torch.Tensor]:
        """Full slots for ``num_tokens``, the last ``swa_tokens`` of them with SWA slots, evicting
        for room; None (nothing taken) when there is none."""
        alloc = self.token_to_kv_pool_allocator
        device = alloc.alloc_without_swa(num_tokens)
        if device is None:
            self.evict(full_num_tokens=num_tokens - alloc.full_available_size())
            device = alloc.alloc_without_swa(num_tokens)
        if device is None or not swa_tokens:
            return device
        if alloc.swa_available_size() < swa_tokens:
            self.evict(swa_num_tokens=swa_tokens - alloc.swa_available_size())
        if not alloc.alloc_swa(device[num_tokens - swa_tokens:]):
            alloc.free(device)
            return None
        return device
