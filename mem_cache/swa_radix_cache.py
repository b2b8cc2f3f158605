"""SWARadixCache: prefix sharing for hybrid sliding-window models (seed 000 §3.4, §4.3).

Gemma3 and GPT-OSS keep every token's KV in their full-attention layers but
only the last ``sliding_window_size`` tokens' in their sliding-window (SWA)
layers. A node's ``value`` holds *full* slot numbers, the canonical ids; the
SWA slot of each is ``allocator.full_to_swa_index_mapping[slot]`` (0: none).

* Tombstones: nodes whose SWA KV is freed, their full KV still cached. SWA
  eviction tombstones internal nodes; an insert makes the tokens a request
  slid out of its window tombstones. A leaf is never a tombstone: one that
  would become one is deleted, and so are tombstone ancestors left as leaves.
* A prefix ending at P is reusable only if the ``sliding_window_size`` tokens
  before P all have SWA KV, or no token before P is a tombstone.
* Two LRU lists: ``full_lru_list`` over every node (full eviction takes
  leaves), ``swa_lru_list`` over non-tombstone nodes (any node).
* Locks: ``full_lock_ref`` covers root→node; ``swa_lock_ref`` only the nodes
  covering the path's last ``sliding_window_size`` tokens. ``full >= swa``.
* Paged (``page_size > 1``): keys match, split, insert, lock and tombstone
  by whole pages (a full page's SWA half is one SWA page, see the allocator),
  and a request keeps the SWA KV of whole pages: see :meth:`window_start`.
* ``disable`` (``disable_radix_cache``; SGLang's ``SWAChunkCache``): nothing is
  cached or matched; a request frees the SWA KV that slid out of its window
  between its prefill chunks too (no tree can evict it), and all of its slots
  when it ends.

Request bookkeeping (positions in the request's row); a request carries
``swa_evicted_seqlen`` and the ``swa_uuid_for_lock`` of its lock::

    [0, cache_protected_len)                   the tree's slots, matched and locked
    [cache_protected_len, swa_evicted_seqlen)  the request's; SWA half freed (out of the window)
    [swa_evicted_seqlen, kv_committed_len)     the request's, full and SWA KV
"""

from __future__ import annotations

import itertools
import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from mem_cache.base_prefix_cache import MatchResult, ReleasedSlots
from mem_cache.integrity import ensure
from mem_cache.kv_events import ReuseRule, WindowLost, WindowRestored
from mem_cache.lru_list import LRUList
from mem_cache.radix_cache import PathLocks, RadixCache, TreeNode
from mem_cache.radix_key import RadixKey
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_radix_checks import SWACacheChecksMixin

_swa_uuids = itertools.count(1)


class SWATreeNode(TreeNode):
    __slots__ = ("swa_tombstone", "full_lock_ref", "swa_lock_ref", "swa_uuid", "prev", "next", "swa_prev", "swa_next",
                 "swa_host_value")

    def __init__(self, key: RadixKey, value: Optional[torch.Tensor], swa_tombstone: bool = False):
        super().__init__(key, value)
        self.swa_tombstone = swa_tombstone
        self.full_lock_ref = self.swa_lock_ref = 0
        self.swa_uuid: Optional[int] = None  # set on the topmost node of a lock's SWA window
        self.prev = self.next = self.swa_prev = self.swa_next = None
        self.swa_host_value: Optional[torch.Tensor] = None  # SWAHiRadixCache: host copy of the SWA KV

    def __repr__(self) -> str:
        kind = "tombstone" if self.swa_tombstone else "swa"
        return f"SWATreeNode(id={self.id}, len={len(self.key)}, {kind}, locks={self.full_lock_ref}/{self.swa_lock_ref})"


class SWAEvictResult(NamedTuple):
    full_num_evicted: int
    swa_num_evicted: int


class SWARadixCache(SWACacheChecksMixin, RadixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
                 sliding_window_size: int, page_size: int = 1, enable_kv_events: bool = False, disable: bool = False):
        if not isinstance(token_to_kv_pool_allocator, SWATokenToKVPoolAllocator):
            got = type(token_to_kv_pool_allocator).__name__
            raise TypeError(f"SWARadixCache needs a SWATokenToKVPoolAllocator, got {got}")
        if token_to_kv_pool_allocator.page_size != page_size:
            raise ValueError(f"page_size={page_size}, the allocator's is {token_to_kv_pool_allocator.page_size}")
        if sliding_window_size < 1:
            raise ValueError(f"sliding_window_size must be >= 1, got {sliding_window_size}")
        self.sliding_window_size = sliding_window_size
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, disable, "lru", enable_kv_events)

    # ---- structure -----------------------------------------------------------
    def reset(self) -> None:
        self.root_node = SWATreeNode(RadixKey([]), self._empty())
        self.root_node.full_lock_ref = self.root_node.swa_lock_ref = 1
        self.full_lru_list = LRUList("prev", "next")
        self.swa_lru_list = LRUList("swa_prev", "swa_next")
        self.full_evictable_size_ = self.full_protected_size_ = 0
        self.swa_evictable_size_ = self.swa_protected_size_ = 0
        self.events.cleared()

    def evictable_size(self) -> int:
        raise NotImplementedError("SWARadixCache: use full_evictable_size() or swa_evictable_size()")

    def protected_size(self) -> int:
        raise NotImplementedError("SWARadixCache: use full_protected_size() or swa_protected_size()")

    def full_evictable_size(self) -> int:
        return self.full_evictable_size_

    def full_protected_size(self) -> int:
        return self.full_protected_size_

    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    def _split_node(self, child: SWATreeNode, split_len: int) -> SWATreeNode:
        """``parent → child`` becomes ``parent → upper → child``. ``upper`` copies
        the tombstone flag, both lock counts and the use counters (host eviction's
        ``last_access_time``, a write policy's ``hit_count``) and takes ``swa_uuid`` over,
        so a lock whose SWA window ended at ``child`` now ends at ``upper``. The tiers of
        :class:`SWAHiRadixCache` split alike: host copies in two, and a node off the
        device (``value is None``, in neither LRU list) stays off it."""
        upper = SWATreeNode(child.key[:split_len], None, child.swa_tombstone)
        upper.parent, upper.full_lock_ref, upper.swa_lock_ref = child.parent, child.full_lock_ref, child.swa_lock_ref
        upper.swa_uuid, child.swa_uuid = child.swa_uuid, None
        upper.last_access_time, upper.creation_time, upper.hit_count = child.last_access_time, child.creation_time, child.hit_count
        pages = split_len // self.page_size
        upper.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        for field in ("value", "host_value", "swa_host_value"):
            whole = getattr(child, field)
            if whole is not None:
                setattr(upper, field, whole[:split_len])
                setattr(child, field, whole[split_len:])
        child.key, child.parent = child.key[split_len:], upper
        upper.children = {self.child_key(child.key): child}
        upper.parent.children[self.child_key(upper.key)] = upper
        if child in self.full_lru_list:
            self.full_lru_list.insert_after(child, upper)
        if child in self.swa_lru_list:
            self.swa_lru_list.insert_after(child, upper)
        return upper

    def _refresh(self, node: SWATreeNode) -> None:
        """Make ``node`` and its ancestors the most recently used, in both lists."""
        self.full_lru_list.reset_node_and_parents_mru(node, self.root_node)
        self.swa_lru_list.reset_node_and_parents_mru(node, self.root_node)

    # ---- match -------------------------------------------------------------------
    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest cached prefix of ``key`` that has its SWA window (see the
        module docstring). May split a node; never changes lock counts."""
        if self.disable or len(key) == 0:
            return MatchResult(self._empty(), self.root_node, self.root_node)
        values, node = self._match_prefix_helper(self._page_align(key))
        self._refresh(node)
        return MatchResult(torch.cat(values) if values else self._empty(), node, node)

    def _match_prefix_helper(self, key: RadixKey) -> Tuple[List[torch.Tensor], SWATreeNode]:
        """The nodes holding ``key`` (:meth:`_held_path`) cut at their usable end (:meth:`_usable_len`)."""
        path = self._held_path(key)
        path = path[: self._usable_len(path)]
        return [n.value for n in path], path[-1] if path else self.root_node

    def _held_path(self, key: RadixKey) -> List[SWATreeNode]:
        """The root-down nodes as far as ``key`` matches, splitting the node it ends in."""
        node, path = self.root_node, []
        while len(key) > 0:
            child = node.children.get(self.child_key(key))
            if child is None:
                break
            matched = self.key_match(child.key, key)
            partial = matched < len(child.key)
            node = self._split_node(child, matched) if partial else child
            path.append(node)
            if partial:
                break
            key = key[matched:]
        return path

    def _usable_len(self, path: List[SWATreeNode]) -> int:
        """How many nodes of the root-down ``path`` a match may end after. ``run`` counts
        the tokens with SWA KV since the last tombstone (inf: none above); the usable end
        is the deepest node boundary with ``run >= window``: just above a tombstone, or the end."""
        run, best = math.inf, 0
        for i, node in enumerate(path):
            if node.swa_tombstone:
                if run >= self.sliding_window_size:
                    best = i
                run = 0
            else:
                run += len(node.key)
        return len(path) if run >= self.sliding_window_size else best

    # ---- insert ------------------------------------------------------------------
    def insert(self, key: RadixKey, value: torch.Tensor, prev_prefix_len: int = 0, swa_evicted_seqlen: int = 0) -> int:
        """Insert ``key`` with full slots ``value``; returns how many leading
        tokens were already cached.

        ``value[:prev_prefix_len]`` are the tree's own slots (the caller matched
        and locked them); every slot after them passes to the tree, kept in a
        node or freed, never lost or freed twice. ``value[:swa_evicted_seqlen]``
        had their SWA halves freed by the caller. Where the tree holds a token:

        * with SWA KV → the tree's slot is kept, the caller's freed;
        * tombstone, caller without SWA → stays a tombstone, the caller's freed;
        * tombstone, caller with SWA → revived: the node keeps its full slots
          (other rows may point at them) and adopts the caller's SWA slots
          through the mapping; the caller's full slots are freed.

        Paged: ``key`` and ``prev_prefix_len`` are whole pages; ``swa_evicted_seqlen``
        counts up to a whole page (the caller freed the SWA of whole pages: ``free_swa`` takes no part of one).
        """
        ps = self.page_size
        if len(key) % ps or prev_prefix_len % ps:
            raise ValueError(f"insert needs whole pages (page_size={ps}): {len(key)} tokens, {prev_prefix_len} the tree's")
        swa_evicted_seqlen = -(-swa_evicted_seqlen // ps) * ps
        # [0, prev_prefix_len)        the tree's own slots: left alone
        # [prev_prefix_len, done)     cached already: the caller's copies are freed, or a
        #                             tombstone adopts their SWA slots (runs are cut at both
        #                             bounds, so each run is wholly one case)
        # [done, len)                 new tokens: see _insert_new
        node, done = self.root_node, 0
        while len(key) > 0:
            child = node.children.get(self.child_key(key))
            if child is None:
                break
            matched = self._owned_run(child, done, self.key_match(child.key, key), prev_prefix_len, swa_evicted_seqlen)
            if matched < len(child.key):
                child = self._split_node(child, matched)
            if done >= prev_prefix_len:
                self._settle_cached_run(child, value[:matched], done >= swa_evicted_seqlen)
            node, done = child, done + matched
            key, value = key[matched:], value[matched:]
        if len(key) > 0:
            ensure(done >= prev_prefix_len, f"insert: caller claims {prev_prefix_len} tree tokens, tree holds {done}")
            node = self._insert_new(node, key, value, done, swa_evicted_seqlen)
        self._refresh(node)
        return done

    @staticmethod
    def _owned_run(child: SWATreeNode, done: int, matched: int, prev_prefix_len: int, swa_evicted_seqlen: int) -> int:
        """Cut a matched run so that it does not straddle ``prev_prefix_len``
        nor, in a tombstone or a node off the device, ``swa_evicted_seqlen``."""
        by_swa = child.swa_tombstone or child.value is None
        cuts = (prev_prefix_len, swa_evicted_seqlen) if by_swa else (prev_prefix_len,)
        return min([cut - done for cut in cuts if done < cut < done + matched], default=matched)

    def _settle_cached_run(self, node: SWATreeNode, incoming: torch.Tensor, with_swa: bool) -> None:
        """The caller's slots ``incoming`` for a run the tree holds in ``node``
        (``with_swa``: they have SWA KV): a tombstone is revived by them, else they are freed."""
        if node.swa_tombstone and with_swa:
            self._revive(node, incoming)
        else:
            self._free(incoming)

    def _revive(self, node: SWATreeNode, incoming: torch.Tensor) -> None:
        """Tombstone ``node`` takes over the SWA slots of ``incoming``; the
        caller's full slots are then freed (their mapping is cleared first)."""
        mapping = self.token_to_kv_pool_allocator.full_to_swa_index_mapping
        swa = mapping[incoming]
        ensure(bool((swa > 0).all()), f"insert: the caller's slots for {node} have no SWA KV to revive it with")
        mapping[node.value] = swa
        mapping[incoming] = 0
        self._free(incoming)
        node.swa_tombstone = False
        self.swa_lru_list.insert_mru(node)
        self.events.marked(WindowRestored, node.hash_value)
        self.swa_evictable_size_ += len(node.key)  # a tombstone holds no SWA lock

    def _insert_new(self, parent: SWATreeNode, key: RadixKey, value: torch.Tensor, start: int, swa_evicted: int):
        """Hang the uncached tokens ``[start, start + len(key))`` under ``parent``;
        returns the deepest node."""
        # [start, start + tomb_len)        SWA freed by the caller → a tombstone node
        # [start + tomb_len, start + len)  full and SWA KV → a leaf; if empty nothing is
        #                                  inserted (no tombstone leaf) and all is freed
        tomb_len = min(max(swa_evicted - start, 0), len(key))
        if tomb_len == len(key):
            self._free(value)
            return parent
        if tomb_len > 0:
            parent = self._add_node(parent, key[:tomb_len], value[:tomb_len], swa_tombstone=True)
        return self._add_node(parent, key[tomb_len:], value[tomb_len:], swa_tombstone=False)

    def _add_node(self, parent: SWATreeNode, key: RadixKey, value: torch.Tensor, swa_tombstone: bool) -> SWATreeNode:
        node = SWATreeNode(key, value, swa_tombstone)
        node.parent = parent
        parent.children[self.child_key(key)] = node
        self._add_device_accounts(node, with_swa=not swa_tombstone)
        self._record_stored(parent, node)
        if swa_tombstone:
            self.events.marked(WindowLost, node.hash_value)
        return node

    # ---- locks -------------------------------------------------------------------
    def inc_lock_ref(self, node: SWATreeNode) -> Optional[int]:
        """Lock the full KV of root→node and the SWA KV of the nodes covering
        the path's last ``sliding_window_size`` tokens. Returns
        ``swa_uuid_for_lock``, the id of the topmost swa-locked node (None: the
        whole path is swa-locked), for :meth:`dec_lock_ref`."""
        swa_locked, swa_uuid_for_lock = 0, None
        while node is not self.root_node:
            self._move_full_lock(node, +1)
            if swa_locked < self.sliding_window_size:
                ensure(not node.swa_tombstone, f"inc_lock_ref: {node} lies in the lock's SWA window")
                self._move_swa_lock(node, +1)
                swa_locked += len(node.key)
                if swa_locked >= self.sliding_window_size:
                    node.swa_uuid = node.swa_uuid or next(_swa_uuids)
                    swa_uuid_for_lock = node.swa_uuid
            node = node.parent
        return swa_uuid_for_lock

    def dec_lock_ref(self, node: SWATreeNode, swa_uuid_for_lock: Optional[int] = None) -> None:
        """Undo ``inc_lock_ref(node)``, which returned ``swa_uuid_for_lock``."""
        unlock_swa = True
        while node is not self.root_node:
            self._move_full_lock(node, -1)
            if unlock_swa:
                self._move_swa_lock(node, -1)
                unlock_swa = swa_uuid_for_lock is None or node.swa_uuid != swa_uuid_for_lock
            node = node.parent

    def released_by_unlock(self, reqs) -> ReleasedSlots:
        """Full and SWA tokens of the nodes only the locks ``reqs`` hold, each walked as
        :meth:`dec_lock_ref` does: its path's full KV, its window's SWA KV (up to the node of
        its ``swa_uuid_for_lock``)."""
        full, swa = PathLocks(), PathLocks()
        for req in reqs:
            node, in_window = req.last_node, True
            while node is not self.root_node:
                full.add(node)
                if in_window:
                    swa.add(node)
                    in_window = req.swa_uuid_for_lock is None or node.swa_uuid != req.swa_uuid_for_lock
                node = node.parent
        return ReleasedSlots(full.released_tokens(lambda n: n.full_lock_ref),
                             swa.released_tokens(lambda n: n.swa_lock_ref))

    def _move_full_lock(self, node: SWATreeNode, delta: int) -> None:
        """``full_lock_ref += delta`` (±1); at 0 the tokens move between evictable and protected."""
        if node.full_lock_ref == (0 if delta > 0 else 1):
            self.full_evictable_size_ -= delta * len(node.key)
            self.full_protected_size_ += delta * len(node.key)
        node.full_lock_ref += delta

    def _move_swa_lock(self, node: SWATreeNode, delta: int) -> None:
        if node.swa_lock_ref == (0 if delta > 0 else 1):
            self.swa_evictable_size_ -= delta * len(node.key)
            self.swa_protected_size_ += delta * len(node.key)
        node.swa_lock_ref += delta

    # ---- eviction ----------------------------------------------------------------
    def evict(self, full_num_tokens: int = 0, swa_num_tokens: int = 0) -> SWAEvictResult:
        """Free at least ``full_num_tokens`` full and ``swa_num_tokens`` SWA slots
        if that many are unlocked, least recently used first. Full eviction
        deletes leaves (their SWA goes too); SWA eviction tombstones internal
        nodes and deletes leaves."""
        full = swa = 0
        while full < full_num_tokens:
            leaf = self.full_lru_list.first_lru(lambda n: not n.children and n.full_lock_ref == 0)
            if leaf is None:
                break
            leaf_full, leaf_swa = self._evict_leaf(leaf)
            full, swa = full + leaf_full, swa + leaf_swa
        while swa < swa_num_tokens:
            node = self.swa_lru_list.first_lru(lambda n: n.swa_lock_ref == 0)
            if node is None:
                break
            if node.children:
                swa += self._tombstone(node)
            else:
                leaf_full, leaf_swa = self._evict_leaf(node)
                full, swa = full + leaf_full, swa + leaf_swa
        return SWAEvictResult(full, swa)

    def _tombstone(self, node: SWATreeNode) -> int:
        self.token_to_kv_pool_allocator.free_swa(node.value)
        node.swa_tombstone = True
        self.swa_lru_list.remove(node)
        self.events.marked(WindowLost, node.hash_value)
        self.swa_evictable_size_ -= len(node.key)
        return len(node.key)

    def _evict_leaf(self, leaf: SWATreeNode) -> Tuple[int, int]:
        """Delete an unlocked leaf, then each tombstone ancestor that becomes an
        unlocked leaf; returns the (full, SWA) slots freed."""
        full = swa = 0
        node = leaf
        while True:
            full, swa = full + len(node.key), swa + (0 if node.swa_tombstone else len(node.key))
            self._free(node.value)
            parent = node.parent
            self._delete_node(node)
            if parent is self.root_node or parent.children or parent.full_lock_ref or not parent.swa_tombstone:
                return full, swa
            node = parent

    def _delete_node(self, node: SWATreeNode) -> None:
        del node.parent.children[self.child_key(node.key)]
        self._drop_device_accounts(node)
        self.events.removed(node.hash_value)

    def _add_device_accounts(self, node: SWATreeNode, with_swa: bool) -> None:
        """Put unlocked ``node``, whose KV is on the device, on the full pool's LRU list and evictable size,
        and on the SWA pool's ``with_swa`` (its window KV there too)."""
        self.full_lru_list.insert_mru(node)
        self.full_evictable_size_ += len(node.key)
        if with_swa:
            self.swa_lru_list.insert_mru(node)
            self.swa_evictable_size_ += len(node.key)

    def _drop_device_accounts(self, node: SWATreeNode) -> None:
        """Take unlocked ``node``, whose KV leaves the device, off both pools' LRU lists and evictable sizes
        (the SWA pool's only where its window KV is there, not a tombstone)."""
        self.full_lru_list.remove(node)
        self.full_evictable_size_ -= len(node.key)
        if not node.swa_tombstone:
            self.swa_lru_list.remove(node)
            self.swa_evictable_size_ -= len(node.key)

    # ---- requests ----------------------------------------------------------------
    def window_start(self, seq_len: int) -> int:
        """First position whose SWA KV a sequence of ``seq_len`` tokens keeps: its
        last ``sliding_window_size`` tokens (the next token attends to all but the first).
        Paged, the window before the sequence's last page boundary, in whole pages:
        ``floor(floor(seq_len) - window)`` (floors to pages), so that the sequence,
        cached up to that boundary (the unaligned tail is not), is matchable to it.
        Non-decreasing in ``seq_len``; page size 1: ``seq_len - window``."""
        ps = self.page_size
        aligned = seq_len - seq_len % ps
        return max(0, aligned - self.sliding_window_size) // ps * ps

    def free_swa_out_of_window(self, req) -> int:
        """Free the SWA slots of a running request's tokens that slid out of its
        window, advance ``req.swa_evicted_seqlen``, return how many were freed.
        The scheduler calls it between forwards, before every decode and verify step: the
        window slides by ``kv_committed_len`` only, never by a verify step's drafts (a
        rejected one would have taken keys from the windows of the positions after it)."""
        return self._free_swa_before_window(req, req.kv_committed_len)

    def _free_swa_before_window(self, req, seq_len: int) -> int:
        """:meth:`free_swa_out_of_window` for a row holding the KV of ``seq_len`` tokens."""
        # [0, cache_protected_len)   the tree's: their SWA is the tree's to evict
        # [start, end)               slid out of the window → SWA freed now
        # [end, seq_len)             the last window (see window_start): kept, so that
        #                            the sequence, once cached, is matchable to its end
        start = max(req.swa_evicted_seqlen, req.cache_protected_len)
        end = max(start, self.window_start(seq_len))
        self.token_to_kv_pool_allocator.free_swa(self._row(req, end)[start:])
        req.swa_evicted_seqlen = end
        return end - start

    def cache_finished_req(self, req, is_insert: bool = True) -> None:
        """Hand ``[cache_protected_len, kv_committed_len)`` of the row to the tree
        (:meth:`insert` keeps or frees every slot of its whole pages; the unaligned
        tail page is freed), free the row, drop the lock. Not inserting (or disabled),
        the row's slots past the tree's are all freed."""
        committed, protected = req.kv_committed_len, req.cache_protected_len
        aligned = committed - committed % self.page_size
        kv_indices = self._row(req, committed)
        if is_insert and not self.disable:
            key = RadixKey((req.origin_input_ids + req.output_ids)[:aligned], req.extra_key)
            self.insert(key, kv_indices[:aligned], protected, req.swa_evicted_seqlen)
        else:
            self._free(kv_indices[protected:aligned])
        self._free(kv_indices[max(aligned, protected):])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node, req.swa_uuid_for_lock)

    def cache_unfinished_req(self, req) -> None:
        """Cache the progress ``fill_ids`` (a chunked prefill) up to its last page
        boundary: insert, rewrite the row with the tree's slots, move the lock to the
        boundary. Needs the window before it to have SWA KV, as
        :meth:`free_swa_out_of_window` leaves it. Disabled, the row stays the request's:
        its SWA KV before the window is freed (the next chunk reads only the window)."""
        if self.disable:
            self._free_swa_before_window(req, len(req.fill_ids))
            req.prefix_indices = self._row(req, len(req.fill_ids))
            return
        # [0, protected)          the tree's slots already
        # [protected, aligned)    inserted (kept or freed as duplicates) → the row gets the
        #                         tree's slots; the lock moves to aligned
        # [aligned, seq_len)      the unaligned tail page: stays the request's
        token_ids, protected = req.fill_ids, req.cache_protected_len
        seq_len = len(token_ids)
        aligned = seq_len - seq_len % self.page_size
        kv_indices = self._row(req, seq_len)
        key = RadixKey(token_ids[:aligned], req.extra_key)
        self.insert(key, kv_indices[:aligned], protected, req.swa_evicted_seqlen)
        match = self.match_prefix(key)
        new_indices, new_last_node = match.device_indices, match.last_device_node
        ensure(len(new_indices) == aligned, f"re-match after insert found {len(new_indices)} of {aligned} tokens")
        row = (req.req_pool_idx, slice(protected, aligned))
        self.req_to_token_pool.write(row, new_indices[protected:].to(torch.int32))
        swa_uuid_for_lock = self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(req.last_node, req.swa_uuid_for_lock)
        req.prefix_indices, req.cache_protected_len = torch.cat([new_indices, kv_indices[aligned:]]), aligned
        req.last_node, req.swa_uuid_for_lock = new_last_node, swa_uuid_for_lock

    # ---- inspection --------------------------------------------------------------
    def reuse_rule(self) -> ReuseRule:
        return ReuseRule("window", self.sliding_window_size)

    def marked_page_hashes(self) -> Tuple[List[str], List[str]]:
        return [], [h for n in self._iter_nodes() if n.swa_tombstone for h in n.hash_value]
