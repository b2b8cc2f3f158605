"""The file tier of :class:`~mem_cache.swa_hiradix_cache.SWAHiRadixCache`: a sliding-window model's
pages in storage, and fetching them back into both host pools.

Each pool's copier has a backend of its own (:func:`swa_storage_backends`): the full layers' pages in
the directory, the SWA layers' in its ``swa`` folder, both keyed by the same chained page hash (a
page's key names its tokens and all before them, which fix its KV in either kind of layer). A backup
writes what it copied to the host: every page's full KV, and the SWA KV of a node that had it — so
storage holds SWA KV where the host tier did: not for the tokens a request's decode slid out of its
window (tombstones), but for a prompt's pages as well as its conversation's last window, so that a
later prompt sharing any page-aligned part of it finds that part's last window there too. (SGLang
keeps the full KV pages in storage and the SWA KV of the window only; the reference, snapshot D,
predates SWA in HiCache and says nothing of it. Writing the SWA KV of every page the host has costs
files; reading only the window's keeps a fetch's SWA slots and reads to a window.)

A hit needs SWA KV for the last window of the matched prefix only (the rule
:meth:`~mem_cache.swa_radix_cache.SWARadixCache._usable_len` keeps), so a fetch reads the full KV of
every page and the SWA KV of the pages covering the fetched prefix's last window: it hangs a
tombstone node (full KV) and under it a node with both, on the host, and ``init_load_back`` loads
them as any host part. The fetched prefix ends where storage has that window: the longest run of
leading full pages whose last window it has the SWA pages of.

Reads are synchronous, at admission (``prefetch_from_storage``); prefetches off the loop from a
request's arrival (the plain file tier's ``start_prefetch``) are not here. With TP, rank 0's storage
writes are logged tagged with their pool and replayed, and each read asks the other ranks to read the
same pages into the same host slots of that pool (``peers_read``), keeping what every rank read.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch

from mem_cache.hicache_storage import HiCacheFile
from mem_cache.kv_events import WindowLost
from mem_cache.radix_key import RadixKey, hash_pages, root_hash
from mem_cache.swa_radix_cache import SWATreeNode

logger = logging.getLogger(__name__)


def swa_storage_backends(directory: Union[str, os.PathLike]) -> Tuple[HiCacheFile, HiCacheFile]:
    """The file tier of a sliding-window model's two host pools: the full layers' pages in ``directory``
    (index 0, as :func:`~mem_cache.swa_hiradix_tiers.swa_host_controllers`), the SWA layers' in its
    ``swa`` folder (1)."""
    return HiCacheFile(directory), HiCacheFile(Path(directory) / "swa")


class SWAStorageTierMixin:
    """Relies on the cache's controllers, host pools, ``_alloc_host`` / ``_free_host``, ``_held_path``,
    ``sliding_window_size``, ``page_size``, ``events`` and ``_tick``."""

    def _write_storage(self, node: SWATreeNode, full: bool, swa: bool) -> None:
        """Write the pages of ``node``'s host copies just made (``full``, ``swa``) to storage."""
        if full and self.cache_controller.storage is not None:
            self.cache_controller.write_storage(node.hash_value, node.host_value)
        if swa and self.swa_cache_controller.storage is not None:
            self.swa_cache_controller.write_storage(node.hash_value, node.swa_host_value)

    def start_prefetch(self, key: RadixKey) -> None:
        """No prefetch off the loop here: admission reads the pages (:meth:`prefetch_from_storage`)."""
        return None

    def prefetch_from_storage(self, key: RadixKey) -> int:
        """Fetch the pages of ``key`` past what the tree holds of it (in either tier, usable or not)
        from storage into new host slots: full KV of each, SWA KV of the last window's (see the module
        docstring), stopping where storage lacks either. Returns the tokens fetched; a following
        ``match_prefix`` reports them in ``host_hit_length``. A storage failure costs the hit (logged)."""
        full_storage, swa_storage = self.cache_controller.storage, self.swa_cache_controller.storage
        if full_storage is None or self.disable:
            return 0
        key = self._page_align(key)
        path = self._held_path(key)
        end = path[-1] if path else self.root_node
        rest = key[sum(len(n.key) for n in path):]
        chain_from = end.hash_value[-1] if end.hash_value else root_hash(key.extra_key)
        keys = hash_pages(rest.token_ids, self.page_size, chain_from)
        try:
            num_pages = full_storage.batch_exists(keys)
            with_swa = [swa_storage.batch_exists([k]) == 1 for k in keys[:num_pages]]
        except Exception:
            logger.exception("asking the storage tier for %d pages failed", len(keys))
            return 0
        num_pages, window = self._fetchable_pages(end, with_swa)
        if not num_pages:
            return 0
        end.host_ref_counter += 1  # evict_host must not delete the node we attach to
        try:
            return self._fetch(end, rest, keys, with_swa[:num_pages], window)
        finally:
            end.host_ref_counter -= 1

    def _fetchable_pages(self, end: SWATreeNode, with_swa: List[bool]) -> Tuple[int, int]:
        """The most leading pages of ``with_swa`` (whether storage has each one's SWA KV) a fetch under
        ``end`` may take, and how many last ones of them need SWA KV: those covering the window, or all
        of them and the window's rest before ``end`` has SWA KV in its tier. (0, 0): none may."""
        window_pages = math.ceil(self.sliding_window_size / self.page_size)
        run, node = 0, end  # tokens with SWA KV at the end of root→end, since its last tombstone
        while node is not self.root_node and not node.swa_tombstone:
            run, node = run + len(node.key), node.parent
        run = math.inf if node is self.root_node else run
        for num_pages in range(len(with_swa), 0, -1):
            window = min(num_pages, window_pages)
            if all(with_swa[num_pages - window: num_pages]) and (
                    num_pages >= window_pages or run + num_pages * self.page_size >= self.sliding_window_size):
                return num_pages, window
        return 0, 0

    def _fetch(self, end: SWATreeNode, rest: RadixKey, keys: List[str], with_swa: List[bool], window: int) -> int:
        ps, num_pages = self.page_size, len(with_swa)
        host = self._alloc_host(self.host_pool, num_pages * ps)
        swa_host = self._alloc_host(self.swa_host_pool, window * ps) if host is not None else None
        if swa_host is None:
            self._free_host(host, None)
            return 0
        try:
            read = self.cache_controller.read_storage(keys[:num_pages], host)
            if read < num_pages:  # the window moves up with the end (no more pages than it had)
                num_pages, window = self._fetchable_pages(end, with_swa[:read])
            if window and self.swa_cache_controller.read_storage(
                    keys[num_pages - window: num_pages], swa_host[: window * ps]) < window:
                num_pages = window = 0
        except BaseException:
            self._free_host(host, swa_host)
            raise
        # host[:num_pages * ps], swa_host[:window * ps] hold the pages fetched; the rest go back
        self._free_host(host[num_pages * ps:], swa_host[window * ps:])
        if not num_pages:
            return 0
        head = (num_pages - window) * ps  # [0, head): full KV only, a tombstone; [head, num_pages * ps): both
        parent = end
        if head:
            parent = self._add_host_node(end, rest[:head], host[:head], None, keys[: head // ps])
        self._add_host_node(parent, rest[head: num_pages * ps], host[head: num_pages * ps], swa_host[: window * ps],
                            keys[head // ps: num_pages])
        return num_pages * ps

    def _add_host_node(self, parent: SWATreeNode, key: RadixKey, host_value: torch.Tensor,
                       swa_host_value: Optional[torch.Tensor], hashes: List[str]) -> SWATreeNode:
        """A node only on the host under ``parent``: a tombstone there without ``swa_host_value``."""
        node = SWATreeNode(key, None, swa_tombstone=swa_host_value is None)
        node.parent, node.host_value, node.swa_host_value, node.hash_value = parent, host_value, swa_host_value, hashes
        node.last_access_time = self._tick()
        parent.children[self.child_key(key)] = node
        self.events.stored(hashes, parent.hash_value[-1] if parent.hash_value else None, key.token_ids,
                           self.page_size, key.extra_key)
        if node.swa_tombstone:
            self.events.marked(WindowLost, hashes)
        return node
