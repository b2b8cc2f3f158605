"""Tiny pools, slot lists and brute-force expectations for the transfer tests.

A rank's pools are described by a small picklable :class:`RankSpec` so that a
peer process can build the very same pools; every buffer is filled with
seeded random bytes, and :func:`expected_after` computes, one slot at a time,
what the destination must hold after a push (the oracle the vectorised
backends are held against).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

from mem_cache.buffer_allocator import LocalBufferAllocator, SharedMemoryBufferAllocator, create_buffer_allocator
from mem_cache.mamba_pool import HybridLinearKVPool, MambaPool
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.swa_memory_pool import SWAKVPool
from transfer.base import KVHandoff, KVPoll, KVReceiver, KVSender
from transfer.layout import pool_allocators, pool_layout
from transfer.plan import plan_copies

SIZE = 96  # slots per pool (plus one page of dummy rows)
SWA_SIZE = 40  # slots of a sliding-window pool's SWA half
HEADS, HEAD_DIM, LAYERS = 4, 8, 2
STATE_SLOTS = 6


@dataclass(frozen=True)
class RankSpec:
    """One rank's pools: ``kind`` is "mha", "mla", "hybrid" or "swa" (3 layers,
    ``swa_layers`` of them sliding-window), on ``device`` (``shared``: in POSIX shared
    memory on the CPU, from a CUDA IPC-exportable MemPool on CUDA)."""

    kind: str = "mha"
    page_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    dtype: str = "float16"
    shared: bool = False
    seed: int = 0
    head_dim: int = HEAD_DIM
    swa_layers: Tuple[int, ...] = (0, 2)
    device: str = "cpu"

    def at(self, **changes) -> "RankSpec":
        return replace(self, **changes)


def build_pool(spec: RankSpec):
    """``(pool, layout, tensors, allocators)`` for ``spec``, every byte seeded-random."""
    if spec.shared and spec.device != "cpu":
        alloc = create_buffer_allocator(spec.device, shareable=True)
    else:
        alloc = SharedMemoryBufferAllocator(prefix=f"t{spec.tp_rank}") if spec.shared else LocalBufferAllocator(spec.device)
    dtype, device = getattr(torch, spec.dtype), spec.device
    heads = HEADS // spec.tp_size
    start = spec.tp_rank * heads
    if spec.kind == "mha":
        pool = MHATokenToKVPool(SIZE, spec.page_size, dtype, heads, spec.head_dim, LAYERS, device, buffer_allocator=alloc)
    elif spec.kind == "mla":
        pool = MLATokenToKVPool(SIZE, spec.page_size, dtype, 12, 4, LAYERS, device, buffer_allocator=alloc)
    elif spec.kind == "hybrid":
        mamba = MambaPool(
            STATE_SLOTS, [(3, 4 // spec.tp_size)], (2 // spec.tp_size, 3, 4), 2, dtype, torch.float32, device,
            buffer_allocator=alloc, layer_ids=[0, 2],
        )
        pool = HybridLinearKVPool(SIZE, spec.page_size, dtype, heads, spec.head_dim, [1, 3], mamba, device,
                                  buffer_allocator=alloc)
    elif spec.kind == "swa":
        full = [i for i in range(3) if i not in spec.swa_layers]
        pool = SWAKVPool(SIZE, SWA_SIZE, spec.page_size, dtype, heads, spec.head_dim, spec.swa_layers, full, device,
                         buffer_allocator=alloc)
    else:
        raise ValueError(spec.kind)
    layout, tensors = pool_layout(pool, kv_head_start=start, total_kv_heads=HEADS)
    gen = torch.Generator().manual_seed(spec.seed)
    for t in tensors.values():
        raw = torch.randint(0, 256, (t.numel() * t.element_size(),), generator=gen, dtype=torch.uint8)
        t.view(torch.uint8).view(-1).copy_(raw)
    return pool, layout, tensors, pool_allocators(pool)


def slot_lists(rng: np.random.Generator, page_size: int, num_tokens: int, sequential: bool = False) -> np.ndarray:
    """``num_tokens`` slots on distinct pages of a ``SIZE``-slot pool (real pages start at 1)."""
    num_pages = SIZE // page_size
    need = -(-num_tokens // page_size)
    pages = np.arange(1, need + 1) if sequential else rng.choice(np.arange(1, num_pages + 1), need, replace=False)
    slots = (pages[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)
    return slots[:num_tokens]


def snapshot(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tensors.items()}


def expected_after(
    src_spec: RankSpec, src_layout, src: Dict[str, torch.Tensor], dst_spec: RankSpec, dst_layout,
    dst_before: Dict[str, torch.Tensor], src_slots, dst_slots, src_state: Optional[int], dst_state: Optional[int],
    src_swa: Sequence[int] = (), dst_swa: Sequence[int] = (),
) -> Dict[str, torch.Tensor]:
    """The destination buffers after the push, row by row and head by head."""
    out = snapshot(dst_before)
    with_state = src_state is not None and dst_state is not None
    pairs_by_index = {"token": list(zip(src_slots, dst_slots)), "swa": list(zip(src_swa, dst_swa)),
                      "state": [(src_state, dst_state)]}
    for copy in plan_copies(src_layout, dst_layout, src_spec.tp_rank, src_spec.tp_size, dst_spec.tp_rank, with_state):
        pairs = pairs_by_index[copy.index]
        for s, d in pairs:
            if copy.head_axis is None:
                out[copy.name][int(d)] = src[copy.name][int(s)]
                continue
            for h in range(copy.num_heads):
                out[copy.name][int(d)].select(copy.head_axis, copy.dst_head + h).copy_(
                    src[copy.name][int(s)].select(copy.head_axis, copy.src_head + h)
                )
    return out


def assert_buffers_equal(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        a, e = actual[name].view(torch.uint8), expected[name].view(torch.uint8)
        bad = (a != e).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{name}: rows {bad[:8]} differ"


def swa_window(rng: np.random.Generator, num_tokens: int) -> Tuple[np.ndarray, np.ndarray]:
    """Random source and destination SWA slots (distinct, real rows) of a window of ``num_tokens``."""
    src, dst = (rng.choice(np.arange(1, SWA_SIZE + 1), num_tokens, replace=False) for _ in range(2))
    return src, dst


def request(rng: np.random.Generator, page_size: int, num_tokens: int, prefix_len: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Source and destination slots of one request's tokens after ``prefix_len``."""
    src = slot_lists(rng, page_size, num_tokens)
    dst = slot_lists(rng, page_size, num_tokens)
    return src[prefix_len:], dst[prefix_len:]


def push_one(prefill, decode, src_slots, dst_slots, rid: str = "r") -> None:
    """One request from agent ``prefill`` to agent ``decode``: hand-off (through its wire
    form), push, completion notice, landing; both ends must succeed."""
    receiver, sender = KVReceiver(decode, rid, 1), KVSender(prefill, rid)
    sender.init(KVHandoff.from_bytes(receiver.send_metadata(list(dst_slots)).to_bytes()))
    sender.send(list(src_slots))
    receiver.mark_done()
    assert sender.poll() == receiver.wait() == KVPoll.Success, receiver.failure_reason() or sender.failure_reason()
