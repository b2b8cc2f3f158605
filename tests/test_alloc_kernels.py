"""The Triton kernels lay out batches exactly as the PyTorch reference does (and write an extend
batch's table rows exactly as ``ReqToTokenPool.write_extend``'s CPU path does).

On the CPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so
batches stay small; on CUDA the same cases run compiled (``gpu`` variants).
"""

import pytest
import torch

from mem_cache import alloc_kernels
from mem_cache.alloc_ops import alloc_decode_torch, alloc_extend_torch, get_num_new_pages
from mem_cache.req_to_token_kernels import write_req_to_token_triton
from mem_cache.req_to_token_pool import ReqToTokenPool, extend_table

PAGE_SIZES = [1, 4, 16, 64]
# compiled kernels need CUDA tensors; without CUDA the interpreter runs them on CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_batch(gen, bs, page_size, shape):
    """prefix/seq lens for one of the edge-case shapes, and a consistent last_loc."""
    if shape == "empty_prefix":
        prefix = torch.zeros(bs, dtype=torch.int64)
    elif shape == "page_boundary":
        prefix = torch.randint(0, 4, (bs,), generator=gen) * page_size
    else:
        prefix = torch.randint(0, 3 * page_size + 3, (bs,), generator=gen)
    if shape == "plus_one":
        extend = torch.ones(bs, dtype=torch.int64)
    else:
        extend = torch.randint(1, 2 * page_size + 5, (bs,), generator=gen)
    seq = prefix + extend
    # the prefix's last slot sits at the right offset of a page the request owns
    # (pages 1..bs, distinct per request and never in the free list)
    owned_page = torch.randperm(bs, generator=gen) + 1
    last_loc = torch.where(prefix > 0, owned_page * page_size + (prefix - 1) % page_size, -1)
    return prefix, seq, last_loc


def _free_pages(gen, n, first_page=1025):
    """``n + 8`` distinct free pages in a random order, all >= ``first_page``."""
    return torch.randperm(4 * n + 64, generator=gen)[: n + 8].to(torch.int64) + first_page


def _check_extend(prefix, seq, last_loc, page_size, device):
    gen = torch.Generator().manual_seed(0)
    need = get_num_new_pages(seq, page_size, prefix)
    free = _free_pages(gen, need).to(device)
    n = int((seq - prefix).sum())
    args = [t.to(device) for t in (prefix, seq, last_loc)]
    ref = alloc_extend_torch(*args, free, page_size, n)
    got = alloc_kernels.alloc_extend_triton(*args, free, page_size, n)
    assert got.cpu().tolist() == ref.cpu().tolist()
    assert len(set(ref.tolist())) == n, "slots of one batch are distinct"


def _check_decode(seq, last_loc, page_size, device):
    gen = torch.Generator().manual_seed(1)
    free = _free_pages(gen, seq.numel()).to(device)
    ref = alloc_decode_torch(seq.to(device), last_loc.to(device), free, page_size)
    got = alloc_kernels.alloc_decode_triton(seq.to(device), last_loc.to(device), free, page_size)
    assert got.cpu().tolist() == ref.cpu().tolist()


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("shape", ["random", "empty_prefix", "page_boundary", "plus_one"])
@pytest.mark.parametrize("bs", [1, 5])
def test_extend_kernel_matches_reference(page_size, shape, bs):
    gen = torch.Generator().manual_seed(page_size * 100 + bs)
    prefix, seq, last_loc = _random_batch(gen, bs, page_size, shape)
    _check_extend(prefix, seq, last_loc, page_size, DEVICE)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("bs", [1, 7, 33])
def test_decode_kernel_matches_reference(page_size, bs):
    gen = torch.Generator().manual_seed(page_size + bs)
    prefix, seq, last_loc = _random_batch(gen, bs, page_size, "random")
    seq = prefix + 1
    _check_decode(seq, last_loc, page_size, DEVICE)


def test_extend_kernel_long_request_crosses_blocks():
    """A request longer than one kernel block (1024 tokens) is laid out whole."""
    prefix = torch.tensor([3, 0])
    seq = torch.tensor([3 + 2500, 17])
    last_loc = torch.tensor([4 * 16 + 2, -1])
    _check_extend(prefix, seq, last_loc, 16, DEVICE)


def test_seed_worked_example():
    """Seed 000 §4.2.1: page_size 4, prefix 6 (last slot 5), extend 7 → the two
    free slots of page 1, then the whole next free page, then one slot of another."""
    free = torch.tensor([3, 5, 6], dtype=torch.int64, device=DEVICE)
    lens = [torch.tensor([x], device=DEVICE) for x in (6, 13, 5)]
    assert alloc_extend_torch(*lens, free, 4, 7).tolist() == [6, 7, 12, 13, 14, 15, 20]
    assert alloc_kernels.alloc_extend_triton(*lens, free, 4, 7).tolist() == [6, 7, 12, 13, 14, 15, 20]


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("bs", [1, 64, 1024])
def test_kernels_match_reference_on_cuda(page_size, bs):
    gen = torch.Generator().manual_seed(bs)
    for shape in ["random", "empty_prefix", "page_boundary", "plus_one"]:
        prefix, seq, last_loc = _random_batch(gen, bs, page_size, shape)
        _check_extend(prefix, seq, last_loc, page_size, "cuda")
        _check_decode(prefix + 1, last_loc, page_size, "cuda")


def _extend_batch(gen, bs, device):
    """A batch's ``write_extend`` arguments: rows half new (their prefix to write), half kept
    from an earlier chunk (prefix already in the row: nothing to write), runs past one block."""
    rows = torch.randperm(2 * bs, generator=gen)[:bs].tolist()
    prefix_lens = torch.randint(0, 700, (bs,), generator=gen).tolist()
    extend_lens = torch.randint(0, 600, (bs,), generator=gen).tolist()
    prefixes = [torch.randint(1, 1 << 20, (n,), generator=gen).to(device) if i % 2 else torch.empty(0, dtype=torch.int64)
                for i, n in enumerate(prefix_lens)]
    out = torch.randint(1, 1 << 20, (sum(extend_lens),), generator=gen).to(device)
    return rows, prefixes, prefix_lens, extend_lens, out


def _write_one_by_one(table, rows, prefixes, prefix_lens, extend_lens, out):
    offset = 0
    for row, prefix, start, num in zip(rows, prefixes, prefix_lens, extend_lens):
        table[row, : len(prefix)] = prefix
        table[row, start : start + num] = out[offset : offset + num]
        offset += num


@pytest.mark.parametrize("bs", [1, 6])
def test_write_extend_matches_per_request_copies(bs):
    """``write_extend`` and its Triton kernel write each request's prefix (where given) and then
    its new slots into its row, and nothing else: cells outside the runs keep what they held."""
    gen = torch.Generator().manual_seed(bs)
    pool = ReqToTokenPool(2 * bs, 1400)
    pool.req_to_token.copy_(torch.randint(0, 1 << 20, pool.req_to_token.shape, generator=gen))
    expected, by_kernel = pool.req_to_token.clone(), pool.req_to_token.clone().to(DEVICE)
    args = _extend_batch(gen, bs, "cpu")
    _write_one_by_one(expected, *args)
    pool.write_extend(*args)
    assert torch.equal(pool.req_to_token, expected)
    rows, prefixes, prefix_lens, extend_lens, out = args
    held = [p for p in prefixes if len(p)] or [out[:0]]
    write_req_to_token_triton(by_kernel, extend_table(*args[:4]), torch.cat(held), out)
    assert torch.equal(by_kernel.cpu(), expected)
    pool.check_integrity()


@pytest.mark.gpu
def test_write_extend_on_cuda():
    """On CUDA ``write_extend`` is the Triton launch: the same cells as the copies."""
    gen = torch.Generator().manual_seed(3)
    pool = ReqToTokenPool(128, 1400, device="cuda")
    expected = pool.req_to_token.clone()
    args = _extend_batch(gen, 64, "cuda")
    _write_one_by_one(expected, *args)
    pool.write_extend(*args)
    assert torch.equal(pool.req_to_token, expected)
