"""The integrity checks of :class:`~mem_cache.swa_radix_cache.SWARadixCache`.

Split out of ``swa_radix_cache.py`` to keep each file to one concern: this mixin
checks the tree against both pools (accounting, structure, locks, LRU lists, the
full→SWA mapping); the tree operations stay there. It relies on the cache's
``root_node``, ``page_size``, ``token_to_kv_pool_allocator``, ``events``, both LRU
lists, the four size counters and ``_iter_nodes`` / ``all_values`` / ``child_key``.
"""

from __future__ import annotations

import torch

from mem_cache.integrity import check_unique_in_range, ensure


class SWACacheChecksMixin:
    def check_accounting(self, private_full: int = 0, private_swa: int = 0) -> None:
        """Every slot of both pools is free, cached (evictable or protected) or private
        to a running request: ``available + evictable + protected + private == size``
        for the full pool and for the SWA pool alike."""
        alloc = self.token_to_kv_pool_allocator
        full = (alloc.full_available_size(), self.full_evictable_size_, self.full_protected_size_, private_full)
        swa = (alloc.swa_available_size(), self.swa_evictable_size_, self.swa_protected_size_, private_swa)
        for name, parts, total in (("full", full, alloc.size), ("SWA", swa, alloc.size_swa)):
            ensure(sum(parts) == total, f"{name} pool: available + evictable + protected + private = {parts}, size {total}")

    def check_integrity(self) -> None:
        """Structure, both LRU lists, no tombstone leaf, lock and size counters,
        unique slots, and the SWA mapping: > 0 for every slot of a non-tombstone
        node, 0 for every slot of a tombstone. Slots, lists and counters are the
        device's: a node off the device (``value is None``) holds none of them."""
        nodes = list(self._iter_nodes())
        counts = dict.fromkeys(("full_evictable", "full_protected", "swa_evictable", "swa_protected"), 0)
        mapping = self.token_to_kv_pool_allocator.full_to_swa_index_mapping
        for node in nodes:
            self._check_swa_node(node)
        nodes = [n for n in nodes if n.value is not None]  # on the device (SWAHiRadixCache: others on the host)
        for node in nodes:
            counts["full_protected" if node.full_lock_ref else "full_evictable"] += len(node.key)
            if not node.swa_tombstone:
                counts["swa_protected" if node.swa_lock_ref else "swa_evictable"] += len(node.key)
            has_swa = (mapping[node.value] > 0).tolist()
            ensure(set(has_swa) == {not node.swa_tombstone}, f"{node}: SWA mapping {mapping[node.value].tolist()}")
        for name, value in counts.items():
            held = getattr(self, f"{name}_size_")
            ensure(held == value, f"{name}_size_={held}, tree has {value}")
        root_locks = (self.root_node.full_lock_ref, self.root_node.swa_lock_ref)
        ensure(root_locks == (1, 1), f"root locks are {root_locks}, expected (1, 1)")
        ensure({n.id for n in nodes} == set(self.full_lru_list.cache), "full LRU list and tree disagree")
        live = {n.id for n in nodes if not n.swa_tombstone}
        ensure(live == set(self.swa_lru_list.cache), "SWA LRU list and the non-tombstone nodes disagree")
        for lru in (self.full_lru_list, self.swa_lru_list):
            walked = sum(1 for _ in lru.iter_lru())
            ensure(walked == len(lru), f"LRU list links reach {walked} nodes, its index holds {len(lru)}")
        allocator, ps = self.token_to_kv_pool_allocator, self.page_size
        slots = self.all_values().cpu()
        check_unique_in_range("SWARadixCache slots", slots, ps, (allocator.size // ps + 1) * ps - 1)
        both = int(torch.isin(torch.unique(slots // ps), allocator.full_attn_allocator.free_page_ids()).sum())
        ensure(both == 0, f"SWARadixCache holds slots in {both} full pages the allocator lists as free")
        swa_slots = mapping[slots.to(mapping.device)].cpu()
        swa_last = (allocator.size_swa // ps + 1) * ps - 1
        check_unique_in_range("SWARadixCache SWA slots", swa_slots[swa_slots > 0], ps, swa_last)
        page_offsets = swa_slots[swa_slots > 0] % ps == slots[swa_slots > 0] % ps
        ensure(bool(page_offsets.all()), "SWARadixCache: a full slot maps to an SWA slot at another page offset")

    def _check_swa_node(self, node) -> None:
        ensure(len(node.key) > 0 and len(node.key) % self.page_size == 0, f"{node}: key not whole pages")
        ensure(node.parent.children.get(self.child_key(node.key)) is node, f"{node} is not its parent's child")
        ensure(node.value is None or len(node.value) == len(node.key), f"{node}: slots and tokens differ in number")
        ensure(node.children or not node.swa_tombstone, f"{node} is a tombstone leaf")
        ensure(node.full_lock_ref >= node.swa_lock_ref >= 0, f"{node}: lock counts out of order")
        ensure(not node.swa_tombstone or node.swa_lock_ref == 0, f"{node}: tombstone with an SWA lock")
        # every lock swa-locks its own node, and only locks on a leaf reach a leaf
        ensure(node.children or node.full_lock_ref == node.swa_lock_ref, f"{node}: a leaf's two lock counts differ")
        child_locks = sum(c.full_lock_ref for c in node.children.values())
        ensure(node.full_lock_ref >= child_locks, f"{node} full_lock_ref < its children's {child_locks}")
        if self.events.enabled:
            ensure(len(node.hash_value) == len(node.key) // self.page_size, f"{node} page hashes out of step")
