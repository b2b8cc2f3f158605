"""Batched page-slot layout for ``alloc_extend`` / ``alloc_decode``: PyTorch reference.

The layout of one request of a batch (seed 000 §4.2, reference §1.3), for
``page_size = ps`` and positions counted in tokens::

    [0, prefix_len)                         already allocated; last slot is last_loc
    [prefix_len, ceil(prefix_len/ps)*ps)    part 1: continue the partial page in place,
                                            slot = last_loc + 1 + j
    [ceil(prefix_len/ps)*ps, seq_len)       parts 2 and 3: fresh pages taken from the
                                            free list in batch order, whole pages first,
                                            the tail page (partial) last

Request ``i`` consumes exactly ``ceil(seq/ps) - ceil(prefix/ps)`` pages and the
pages of request ``i`` sit right after those of requests ``< i`` in the free
list. These functions only *compute* the slots; the caller checks that the
free list holds enough pages and then drops the consumed ones. They are
vectorised over the whole batch (no per-request Python loop) and are what the
Triton kernels in ``alloc_kernels`` are tested against.
"""

from __future__ import annotations

from typing import Optional

import torch


def ceil_div(a, b):
    return (a + b - 1) // b


def num_new_pages_per_req(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    return ceil_div(seq_lens, page_size) - ceil_div(prefix_lens, page_size)


def get_num_new_pages(
    seq_lens: torch.Tensor, page_size: int, prefix_lens: Optional[torch.Tensor] = None
) -> int:
    """Pages an extend (``prefix_lens`` given) or a decode step needs in total.

    Pass CPU tensors when you have them: on CUDA this ``.item()`` synchronises.
    """
    if prefix_lens is None:
        return int(((seq_lens - 1) % page_size == 0).sum().item())
    return int(num_new_pages_per_req(prefix_lens, seq_lens, page_size).sum().item())


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def alloc_extend_torch(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Slots of every new token of the batch, in batch order (int64).

    ``free_pages`` must hold at least ``sum(num_new_pages_per_req)`` pages.
    """
    device = seq_lens.device
    prefix_lens = prefix_lens.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    last_loc = last_loc.to(torch.int64)
    extend_lens = seq_lens - prefix_lens
    bs = seq_lens.numel()

    # token t of the output belongs to request req[t] and is its j-th new token
    req = torch.repeat_interleave(torch.arange(bs, device=device), extend_lens, output_size=extend_num_tokens)
    j = torch.arange(extend_num_tokens, device=device) - _exclusive_cumsum(extend_lens)[req]
    pos = prefix_lens[req] + j
    old_page_end = (ceil_div(prefix_lens, page_size) * page_size)[req]
    page_start = _exclusive_cumsum(num_new_pages_per_req(prefix_lens, seq_lens, page_size))[req]

    fresh = pos >= old_page_end  # parts 2 and 3 take fresh pages; part 1 continues last_loc
    if free_pages.numel() == 0:
        return last_loc[req] + 1 + j
    page_idx = page_start + (pos - old_page_end).clamp_min(0) // page_size
    page_ids = free_pages[page_idx.clamp_max(free_pages.numel() - 1)]
    return torch.where(fresh, page_ids * page_size + pos % page_size, last_loc[req] + 1 + j)


def alloc_decode_torch(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Slot of the one new token per request: ``last_loc + 1`` unless the token
    (at position ``seq_len - 1``) starts a page, which then takes the next free page."""
    seq_lens = seq_lens.to(torch.int64)
    starts_page = (seq_lens - 1) % page_size == 0
    next_slot = last_loc.to(torch.int64) + 1
    if free_pages.numel() == 0:
        return next_slot
    page_idx = _exclusive_cumsum(starts_page.to(torch.int64)).clamp_max(free_pages.numel() - 1)
    return torch.where(starts_page, free_pages[page_idx] * page_size, next_slot)
