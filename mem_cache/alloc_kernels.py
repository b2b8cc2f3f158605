"""Triton kernels for ``alloc_extend`` / ``alloc_decode`` (same layout as ``alloc_ops``).

The kernels compute the slot layout of a whole batch in one launch; the
caller has already checked that the free list holds enough pages, so no
kernel ever reads past the pages it is entitled to. Arithmetic is int64
throughout. On the CPU they run under ``TRITON_INTERPRET=1`` (which must be
set before this module is imported: ``triton.jit`` reads it at decoration).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton import knobs

EXTEND_BLOCK = 1024
MAX_DECODE_BATCH = 1 << 20


def triton_device_error(device: torch.device, what: str) -> Optional[str]:
    """Why ``what`` (Triton kernels) cannot run on ``device``, or None. On the CPU Triton has
    no driver: a launch fails with "0 active drivers" unless the interpreter is on."""
    if device.type == "cpu" and not knobs.runtime.interpret:  # (TRITON_INTERPRET as Triton reads it: 1, true, on..)
        return (f"{what} runs Triton kernels, which on the CPU run only under Triton's interpreter: set "
                f"TRITON_INTERPRET=1 before the process starts, or use the torch backend")
    return None


@triton.jit
def _alloc_extend_kernel(
    prefix_lens_ptr,
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    BS_POW2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per request: offsets from the requests before it, then the
    request's new slots, ``BLOCK`` tokens at a time."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BS_POW2)
    before = offs < pid
    seqs = tl.load(seq_lens_ptr + offs, mask=before, other=0)
    pres = tl.load(prefix_lens_ptr + offs, mask=before, other=0)
    out_start = tl.sum(seqs - pres, axis=0)
    new_pages = (seqs + PAGE_SIZE - 1) // PAGE_SIZE - (pres + PAGE_SIZE - 1) // PAGE_SIZE
    page_start = tl.sum(new_pages, axis=0)

    seq_len = tl.load(seq_lens_ptr + pid)
    prefix_len = tl.load(prefix_lens_ptr + pid)
    last_loc = tl.load(last_loc_ptr + pid)
    old_page_end = (prefix_len + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    extend_len = seq_len - prefix_len
    for block_start in range(0, extend_len, BLOCK):
        j = block_start + tl.arange(0, BLOCK).to(tl.int64)
        valid = j < extend_len
        pos = prefix_len + j
        fresh = pos >= old_page_end
        page_offset = tl.maximum(pos - old_page_end, 0) // PAGE_SIZE
        page = tl.load(free_pages_ptr + page_start + page_offset, mask=valid & fresh, other=0)
        slot = tl.where(fresh, page * PAGE_SIZE + pos % PAGE_SIZE, last_loc + 1 + j)
        tl.store(out_ptr + out_start + j, slot, mask=valid)


@triton.jit
def _alloc_decode_kernel(
    seq_lens_ptr,
    last_loc_ptr,
    free_pages_ptr,
    out_ptr,
    bs,
    BS_POW2: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """One program for the batch: a prefix sum over "token starts a page"."""
    offs = tl.arange(0, BS_POW2)
    valid = offs < bs
    seq_len = tl.load(seq_lens_ptr + offs, mask=valid, other=0)
    last_loc = tl.load(last_loc_ptr + offs, mask=valid, other=0)
    starts_page = ((seq_len - 1) % PAGE_SIZE == 0) & valid
    flag = starts_page.to(tl.int64)
    page_idx = tl.cumsum(flag, axis=0) - flag
    page = tl.load(free_pages_ptr + page_idx, mask=starts_page, other=0)
    slot = tl.where(starts_page, page * PAGE_SIZE, last_loc + 1)
    tl.store(out_ptr + offs, slot, mask=valid)


def alloc_extend_triton(
    prefix_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    last_loc: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    bs = seq_lens.numel()
    out = torch.empty(extend_num_tokens, dtype=torch.int64, device=seq_lens.device)
    if bs == 0 or extend_num_tokens == 0:
        return out
    _alloc_extend_kernel[(bs,)](
        prefix_lens.to(torch.int64),
        seq_lens.to(torch.int64),
        last_loc.to(torch.int64),
        free_pages,
        out,
        BS_POW2=triton.next_power_of_2(bs),
        PAGE_SIZE=page_size,
        BLOCK=min(EXTEND_BLOCK, triton.next_power_of_2(max(extend_num_tokens, 16))),
    )
    return out


def alloc_decode_triton(
    seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    bs = seq_lens.numel()
    if bs > MAX_DECODE_BATCH:
        raise ValueError(f"alloc_decode: batch of {bs} exceeds {MAX_DECODE_BATCH}")
    out = torch.empty(bs, dtype=torch.int64, device=seq_lens.device)
    if bs == 0:
        return out
    _alloc_decode_kernel[(1,)](
        seq_lens.to(torch.int64),
        last_loc.to(torch.int64),
        free_pages,
        out,
        bs,
        BS_POW2=triton.next_power_of_2(bs),
        PAGE_SIZE=page_size,
    )
    return out
