"""In-process stand-ins for the workers a router talks to (no Ray, no model).

``FakePrefill`` (and ``FakeDecode``) holds a real ``RadixCache`` with KV events
on and serves ``kv_events`` / ``cached_page_hashes`` with the real worker's
methods, so the router sees exactly the events and snapshots a worker sends.
"""

from __future__ import annotations

import random
from typing import Any, Dict, List

from actors.workers import _Worker
from mem_cache.radix_cache import RadixCache
from mem_cache.radix_key import RadixKey


class _NullAllocator:
    device = "cpu"

    def free(self, indices) -> None:
        pass


class _InlineLoop:
    def run_exclusive(self, fn):
        return fn()


class _Scheduler:
    def __init__(self, cache):
        self.tree_cache = cache

    def reuse_rule(self):
        return self.tree_cache.reuse_rule()


class _Config:
    def __init__(self, page_size):
        self.page_size = page_size


class FakePrefill:
    """A prefill worker reduced to its tree cache; ``serve`` caches a prompt the way a prefill does."""

    role = "prefill"
    _init_kv_log = _Worker._init_kv_log
    _drain_kv_events = _Worker._drain_kv_events
    kv_events = _Worker.kv_events
    cached_page_hashes = _Worker.cached_page_hashes

    def __init__(self, worker_id: str, page_size: int, cache=None):
        """``cache``: a tree cache with KV events on (a RadixCache without KV slots by default)."""
        self.worker_id = worker_id
        self.cache = cache or RadixCache(None, _NullAllocator(), page_size=page_size, enable_kv_events=True)
        self.scheduler, self.loop, self.config = _Scheduler(self.cache), _InlineLoop(), _Config(page_size)
        self._init_kv_log()
        self.failing = False
        self.reported: Dict[str, Any] = {"waiting": 0, "running": 0, "queued_prefill_tokens": 0}

    def serve(self, input_ids: List[int]) -> int:
        """Match then insert the page-aligned prompt; returns the tokens that were cached."""
        ps = self.cache.page_size
        aligned = len(input_ids) - len(input_ids) % ps
        hit = len(self.cache.match_prefix(RadixKey(input_ids)).device_indices)
        self.cache.insert(RadixKey(input_ids[:aligned]))
        return hit

    def load(self) -> Dict[str, Any]:
        if self.failing:
            raise ConnectionError("no answer")
        return dict(self.reported, worker_id=self.worker_id)


class FakeDecode(FakePrefill):
    """A decode worker reduced to its tree cache (``serve``: it cached a finished request)."""

    role = "decode"

    def __init__(self, worker_id: str, page_size: int, free_slots: int = 100_000, cache=None):
        super().__init__(worker_id, page_size, cache)
        self.reported = {"waiting": 0, "running": 0, "free_slots": free_slots, "total_slots": free_slots}


def group_prompts(num_groups: int, per_group: int, prefix_len: int, suffix_len: int, seed: int = 0,
                  vocab: int = 250) -> List[List[List[int]]]:
    """``num_groups`` lists of ``per_group`` prompts, each a group's shared prefix + a unique suffix."""
    rng = random.Random(seed)
    groups = []
    for _ in range(num_groups):
        prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
        groups.append([prefix + [rng.randrange(3, vocab) for _ in range(suffix_len)] for _ in range(per_group)])
    return groups
