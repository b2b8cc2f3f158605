"""The host → device side of :class:`~mem_cache.hiradix_cache.HiRadixCache`: loading a
host-only chain back to the device (``init_load_back``), ending the loads
(``loading_check``) and what a failed one leaves: lost slots off the device, the failure
kept for whoever ran a forward beside it (``take_failed_loads``). It relies on the cache's
``cache_controller``, ``token_to_kv_pool_allocator``, lock and eviction methods, size
counters and tree helpers.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch

from mem_cache.radix_cache import TreeNode


class FailedLoads(NamedTuple):
    """Loads from the host tier that failed (:meth:`LoadBackMixin.take_failed_loads`)."""

    error: str
    slots: torch.Tensor  # the device slots they were to fill


class LoadBackMixin:
    # ---- load back -----------------------------------------------------------
    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int, mem_quota: Optional[int] = None
    ) -> Tuple[torch.Tensor, TreeNode]:
        """Load the host-only chain ending at ``last_host_node`` (``host_hit_length``
        tokens, from the same ``match_prefix``) to the device. Returns the device
        slots now usable after the device prefix and the deepest node on the device."""
        chain = self._evicted_chain(last_host_node)
        chain_len = sum(len(n.host_value) for n in chain)
        if chain_len != host_hit_length:
            raise ValueError(f"stale match: {host_hit_length} host tokens reported, the tree has {chain_len}")
        loaded = self.load_back(chain, mem_quota) if chain else None
        if loaded is not None:
            return loaded, last_host_node
        node = last_host_node
        while node.evicted:
            node = node.parent
        return self._empty(), node

    def load_back(self, chain: List[TreeNode], mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        """Copy ``chain`` (host-only nodes, top-down) to fresh device slots, all or
        nothing: ``None`` if it is under ``load_back_threshold`` tokens, over
        ``mem_quota``, or the device has no room even after eviction."""
        num_tokens = sum(len(n.host_value) for n in chain)
        if num_tokens < self.load_back_threshold:
            return None
        ancestor = chain[0].parent
        delta = self.inc_lock_ref(ancestor)  # keep the device prefix while evicting for room
        for node in chain:
            node.host_ref_counter += 1  # and the chain's host copies (write_back eviction may evict_host)
        try:
            # the lock took -delta tokens out of what the quota could have evicted
            if mem_quota is not None and num_tokens > mem_quota + delta:
                return None
            device_indices = self._alloc_device(num_tokens)
            if device_indices is None:
                return None
            host_indices = torch.cat([n.host_value for n in chain])
            try:
                self.cache_controller.queue_load(host_indices, device_indices)
            except BaseException:  # (a copy made at once failed) the chain stays on the host, its slots go back
                self._free(device_indices)
                raise
            if self.cache_controller.load_pending:  # the host copies stay in use until loading_check
                for node in chain:
                    node.host_ref_counter += 1
                self._loading_nodes.extend(chain)
        finally:
            for node in chain:
                node.host_ref_counter -= 1
            self.dec_lock_ref(ancestor)
        offset = 0
        for node in chain:
            # [offset, offset + len(node.key)): this node's share of the new slots
            node.value = device_indices[offset : offset + len(node.key)]
            offset += len(node.key)
        self.evictable_size_ += num_tokens
        return device_indices

    def ready_to_load_host_cache(self) -> None:
        """Start the loads queued by ``load_back`` (just before the forward that reads them)."""
        self.cache_controller.start_loading()

    def loading_check(self, raise_failed: bool = True) -> None:
        """End the loads — the transfer in flight, then the queued ones, even when the first
        fails — and give their host copies back to ``evict_host``. After this, no copy writes
        device slots the tree may free. A failed transfer is copied again before the error is
        raised; if that fails too, the nodes holding its slots leave the device (see
        :meth:`_drop_lost_loads`). With TP the other ranks are asked how their copies of the
        loads ended (:meth:`HiCacheController.end_peer_loads`): one failed there is handled
        as if it had failed here. With ``raise_failed=False`` a failed load is not raised but
        kept for :meth:`take_failed_loads` (whoever ran a forward beside it decides which of
        its requests read garbage); an exchange with the other ranks that fails still raises."""
        controller = self.cache_controller
        if not (controller.load_pending or self._loading_nodes or controller.peer_loads_due):
            return
        errors: List[Exception] = []
        try:
            try:
                self._end_transfer(errors)  # the transfer in flight (raising, it has ended all the same)
            finally:
                controller.start_loading()  # the queued loads: their host refs go below, so they end too
                self._end_transfer(errors)
        finally:
            controller.log_load_sync()
            for node in self._loading_nodes:
                node.host_ref_counter -= 1
            self._loading_nodes = []
            try:
                peer_error = controller.end_peer_loads()  # (after load_sync: the other ranks end them first)
                if peer_error is not None:
                    errors.append(peer_error)
            finally:
                self._take_lost_loads()
                self._drop_failed_backups(controller.take_peer_failed_writes())
        if errors and raise_failed:
            controller.take_failed_loads()  # (raised: nobody is left to ask for them)
            raise errors[0]
        self._load_errors += [f"{type(e).__name__}: {e}" for e in errors]

    def _end_transfer(self, errors: List[Exception]) -> None:
        try:
            self.cache_controller.wait_loading()
        except Exception as exc:
            errors.append(exc)

    def take_failed_loads(self) -> Optional[FailedLoads]:
        """The loads that failed since the last call and were not raised (``loading_check``
        with ``raise_failed=False``, ``evict``): why, and the device slots they wrote — copied
        again or lost, a forward that ran beside them read garbage there. None: none failed."""
        slots = self.cache_controller.take_failed_loads()
        errors, self._load_errors = self._load_errors, []
        if slots is None and not errors:
            return None
        return FailedLoads("; ".join(errors), self._empty() if slots is None else slots)

    def _take_lost_loads(self) -> None:
        lost = self.cache_controller.take_lost_loads()
        if lost is not None:
            self._lost_slots = lost if self._lost_slots is None else torch.cat([self._lost_slots, lost])
            self._drop_lost_loads()

    def _drop_lost_loads(self) -> None:
        """Take the unlocked nodes that hold lost slots (a load that failed twice left them
        without KV) off the device, with the device nodes under them, deepest first: a node
        with a host copy stays host-only, for the next hit to load again. The lost slots of
        nodes still locked stay lost (no match finds them) until their last unlock."""
        lost = [n for n in self._iter_nodes() if self._holds_lost_slots(n)]
        for node in lost:
            if node.lock_ref == 0 and not node.evicted:  # (under an earlier one: gone with it)
                self._evict_device_subtree(node)
        kept = [n.value for n in self._iter_nodes() if self._holds_lost_slots(n)]  # (those still locked)
        self._lost_slots = torch.cat(kept) if kept else None

    def _holds_lost_slots(self, node: TreeNode) -> bool:
        lost = self._lost_slots
        return lost is not None and not node.evicted and bool(torch.isin(node.value, lost).any())

    def _evict_device_subtree(self, node: TreeNode) -> None:
        """``node`` and the device nodes under it (unlocked, as ``node`` is) leave the device."""
        order, stack = [], [node]
        while stack:
            order.append(stack.pop())
            stack.extend(child for child in order[-1].children.values() if not child.evicted)
        for each in reversed(order):  # children before their parent
            self._evict_device_node(each)

    def _evicted_chain(self, node: TreeNode) -> List[TreeNode]:
        chain = []
        while node.evicted:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def _alloc_device(self, num_tokens: int) -> Optional[torch.Tensor]:
        allocator = self.token_to_kv_pool_allocator
        indices = allocator.alloc(num_tokens)
        if indices is None:
            self.evict(num_tokens - allocator.available_size())
            indices = allocator.alloc(num_tokens)
        return indices
