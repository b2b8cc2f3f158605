"""A minimal request object and pool fixtures for driving the tree caches the
way the scheduler will: match → allocate → write the row → insert / cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from actors.prefix_index import PrefixIndex, page_keys
from mem_cache.radix_key import hash_pages


@dataclass
class FakeReq:
    """Carries exactly the fields ``CacheableReq`` names."""

    origin_input_ids: List[int]
    req_pool_idx: int = -1
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    kv_committed_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    extra_key: Optional[str] = None
    priority: int = 0
    # hybrid (Mamba) models only
    mamba_pool_idx: Optional[int] = None
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: Optional[int] = None
    mamba_branching_seqlen: Optional[int] = None
    kv_only_lock: bool = False
    # sliding-window (SWA) models only
    swa_evicted_seqlen: int = 0
    swa_uuid_for_lock: Optional[int] = None


def start_req(cache, req_pool, allocator, req: FakeReq, upto: Optional[int] = None) -> FakeReq:
    """Match the prompt (its first ``upto`` tokens), lock the match, take a
    row and slots for the rest, and write the row — a prefill's bookkeeping.
    Returns the request, or raises if the pool is out of slots."""
    from mem_cache.radix_key import RadixKey

    tokens = req.origin_input_ids[: upto if upto is not None else len(req.origin_input_ids)]
    match = cache.match_prefix(RadixKey(tokens, req.extra_key))
    req.prefix_indices, req.last_node = match.device_indices, match.last_device_node
    req.cache_protected_len = len(match.device_indices)
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = req_pool.alloc(1)[0]
    prefix_len = len(req.prefix_indices)
    extend(cache, req_pool, allocator, req, prefix_len, tokens)
    return req


def extend(cache, req_pool, allocator, req: FakeReq, prefix_len: int, tokens: List[int]) -> None:
    """Allocate slots for ``tokens[prefix_len:]`` after ``prefix_len`` and write them."""
    seq_len = len(tokens)
    row = req_pool.req_to_token[req.req_pool_idx]
    last_loc = int(row[prefix_len - 1]) if prefix_len > 0 else -1
    new = allocator.alloc_extend(
        torch.tensor([prefix_len]), torch.tensor([seq_len]), torch.tensor([last_loc]), seq_len - prefix_len
    )
    if new is None:
        cache.evict(seq_len - prefix_len + allocator.page_size)
        new = allocator.alloc_extend(
            torch.tensor([prefix_len]), torch.tensor([seq_len]), torch.tensor([last_loc]), seq_len - prefix_len
        )
    assert new is not None, "test pool too small"
    row[prefix_len:seq_len] = new.to(torch.int32)
    req.fill_ids = list(tokens)
    req.kv_committed_len = seq_len


def conservation(allocator, cache, private_slots: int = 0) -> None:
    """Idle-time accounting: every slot is free, cached, or private to a live request."""
    total = allocator.num_pages * allocator.page_size
    got = allocator.available_size() + cache.evictable_size() + cache.protected_size() + private_slots
    assert got == total, (
        f"available {allocator.available_size()} + evictable {cache.evictable_size()} + "
        f"protected {cache.protected_size()} + private {private_slots} != {total}"
    )


def machine_case(machine, suffix: str, max_examples: int, steps: int, **attrs):
    """A hypothesis ``TestCase`` of state machine ``machine`` with class attributes ``attrs``."""
    from hypothesis import settings

    cls = type(f"{machine.__name__}_{suffix}", (machine,), attrs)
    cls.TestCase.settings = settings(max_examples=max_examples, stateful_step_count=steps, deadline=None)
    return cls.TestCase


class IndexMirror:
    """The router's prefix index for one worker, fed by ``cache``'s KV events: its match must be the
    cache's own (``check``), and an index rebuilt from the cache's snapshot the same (``check_snapshot``)."""

    def __init__(self, cache, page_size: int):
        self.cache, self.page_size = cache, page_size
        self.index = self._new_index()

    def _new_index(self) -> PrefixIndex:
        index = PrefixIndex()
        index.add_worker("w")
        rule = self.cache.reuse_rule()
        index.set_rule("w", rule.kind, -(-rule.window // self.page_size), rule.prompt_state)
        return index

    def _sync(self) -> None:
        for event in self.cache.take_events():
            self.index.apply("w", event)

    def check(self, tokens, extra, matched_tokens: int) -> None:
        self._sync()
        pages = self.index.match(page_keys(hash_pages(tokens, self.page_size, extra_key=extra))).get("w", 0)
        assert pages * self.page_size == matched_tokens, f"the index says {pages} pages, the cache {matched_tokens} tokens"

    def check_snapshot(self) -> None:
        self._sync()
        fresh = self._new_index()
        fresh.replace("w", self.cache.stored_page_hashes(), *self.cache.marked_page_hashes())
        for name in ("_exact", "_state", "_lost", "_marks"):
            assert getattr(fresh, name) == getattr(self.index, name), f"snapshot and events disagree on {name}"
