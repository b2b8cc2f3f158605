"""Exact-ID unit cases for the token and paged allocators."""

import pytest
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.integrity import IntegrityError
from mem_cache.req_to_token_pool import ReqToTokenPool


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_token_allocator_never_hands_out_slot_zero_and_reuses_fifo():
    a = TokenToKVPoolAllocator(8)
    assert a.alloc(3).tolist() == [1, 2, 3]
    assert a.alloc(4).tolist() == [4, 5, 6, 7]
    a.free(t(1, 2, 3))
    assert a.alloc(3).tolist() == [8, 1, 2]  # freed slots go to the back
    assert a.available_size() == 1
    a.check_integrity(t(1, 2, 4, 5, 6, 7, 8))


def test_short_alloc_returns_none_and_consumes_nothing():
    a = TokenToKVPoolAllocator(4)
    a.alloc(3)
    before = a.free_page_list().clone()
    assert a.alloc(2) is None
    assert torch.equal(a.free_page_list(), before)
    p = PagedTokenToKVPoolAllocator(16, 4)
    p.alloc(8)
    assert p.alloc_extend(t(0, 0), t(4, 5), t(-1, -1), 9) is None  # needs 3 pages, 2 left
    assert p.alloc_decode(t(5, 9, 13), t(3, 7, 11)) is None  # all three start a page
    assert p.available_size() == 8


def test_paged_free_releases_whole_pages_lifo():
    p = PagedTokenToKVPoolAllocator(16, 4)
    assert p.alloc(8).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    p.free(t(9, 5))  # any token of a page frees the page; unique, sorted, prepended
    assert p.free_page_list().tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="multiple of page_size"):
        p.alloc(6)


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_group_batches_frees_into_one(page_size):
    a = PagedTokenToKVPoolAllocator(8 * page_size, page_size) if page_size > 1 else TokenToKVPoolAllocator(8)
    x, y = a.alloc(2 * page_size), a.alloc(2 * page_size)
    before = a.available_size()
    a.free_group_begin()
    a.free(x)
    a.free(y)
    assert a.available_size() == before  # nothing returned yet
    a.check_integrity(torch.empty(0, dtype=torch.int64))  # pending frees count as free
    a.free_group_end()
    assert a.available_size() == before + 4 * page_size
    a.check_integrity(torch.empty(0, dtype=torch.int64))


def test_need_sort_defers_reuse_until_short_then_sorts():
    a = TokenToKVPoolAllocator(6, need_sort=True)
    a.alloc(4)
    a.free(t(3, 1))
    assert a.release_page_list().tolist() == [3, 1]
    assert a.alloc(2).tolist() == [5, 6]  # released slots are not reused yet
    assert a.alloc(2).tolist() == [1, 3]  # short → merge and sort
    p = PagedTokenToKVPoolAllocator(24, 4, need_sort=True)
    p.alloc(16)
    p.free(t(13, 4))
    out = p.alloc_extend(t(0), t(10), t(-1), 10)  # 3 pages: 5, 6 free; 1 and 3 released
    assert out.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]


def test_backup_restore_undoes_allocations():
    p = PagedTokenToKVPoolAllocator(32, 4)
    state = p.backup_state()
    p.alloc_extend(t(0, 0), t(5, 9), t(-1, -1), 14)
    p.alloc_decode(t(6), t(8))
    p.restore_state(state)
    assert p.free_page_list().tolist() == list(range(1, 9))


def test_check_integrity_catches_leaks_double_frees_and_dummy_page():
    p = PagedTokenToKVPoolAllocator(16, 4)
    held = p.alloc(8)
    p.check_integrity(held)
    with pytest.raises(IntegrityError, match="leak"):
        p.check_integrity(held[:4])  # a page is neither free nor in use
    with pytest.raises(IntegrityError, match="both free and in use"):
        p.check_integrity(torch.cat([held, t(12)]))
    p.free(held[:4])
    p.free(held[:4])  # double free without debug mode: integrity finds it
    with pytest.raises(IntegrityError, match="duplicate"):
        p.check_integrity()
    q = TokenToKVPoolAllocator(4)
    q.free(t(0))
    with pytest.raises(IntegrityError, match=r"span \[0, 4\], allowed \[1, 4\]"):
        q.check_integrity()


def test_debug_mode_rejects_double_free_and_bad_last_loc():
    p = PagedTokenToKVPoolAllocator(16, 4, debug=True)
    x = p.alloc(4)
    p.free(x)
    with pytest.raises(IntegrityError, match="double free"):
        p.free(x)
    with pytest.raises(IntegrityError, match="page offset"):
        p.alloc_extend(t(6), t(8), t(6), 2)  # slot 6 is offset 2, prefix 6 ends at offset 1


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match="auto, torch, triton"):
        PagedTokenToKVPoolAllocator(16, 4, backend="cuda")


def test_req_to_token_pool_rows():
    pool = ReqToTokenPool(3, 8)
    rows = pool.alloc(2)
    assert rows == [0, 1]
    assert pool.alloc(2) is None and pool.available_size() == 1
    pool.write((rows[1], slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[1, :4].tolist() == [7, 8, 9, 0]
    pool.check_integrity(live_rows=rows)
    with pytest.raises(IntegrityError, match="leak"):
        pool.check_integrity(live_rows=[0])
    pool.free(rows)
    pool.free(0)
    with pytest.raises(IntegrityError, match="duplicate"):
        pool.check_integrity()
    pool.clear()
    pool.check_integrity(live_rows=[])


@pytest.mark.parametrize("page_size", [1, 4])
def test_check_integrity_catches_a_slot_held_twice(page_size):
    """Two holders of one slot (the tree and a request, say) free it twice later; the page
    count alone cannot see it, as the slot's page is in use either way."""
    a = PagedTokenToKVPoolAllocator(8 * page_size, page_size) if page_size > 1 else TokenToKVPoolAllocator(8)
    held = a.alloc(8 * page_size)
    a.check_integrity(held)
    with pytest.raises(IntegrityError, match="slots in use: 1 duplicate"):
        a.check_integrity(torch.cat([held, held[-1:]]))


def test_pending_frees_of_one_page_in_two_calls_are_not_a_double_free():
    """``free_group_end`` frees the union of the group's pages: two frees of slots of one
    page inside a group are one free of that page, so integrity must not flag them."""
    p = PagedTokenToKVPoolAllocator(16, 4)
    x = p.alloc(4)
    p.free_group_begin()
    p.free(x[:2])
    p.free(x[2:])
    p.check_integrity(torch.empty(0, dtype=torch.int64))
    p.free_group_end()
    assert p.free_page_list().tolist() == [1, 2, 3, 4]
    p.check_integrity(torch.empty(0, dtype=torch.int64))


def test_a_slot_freed_twice_inside_a_group_is_found_before_the_group_ends():
    """With one-slot pages ``free_group_end`` appends every pending slot as given: one
    slot twice in a pending free is a double free that integrity must see already."""
    a = TokenToKVPoolAllocator(4)
    x = a.alloc(2)
    a.free_group_begin()
    a.free(torch.cat([x, x[:1]]))
    with pytest.raises(IntegrityError, match="duplicate"):
        a.check_integrity(torch.empty(0, dtype=torch.int64))


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_nested_free_group_keeps_the_open_groups_frees(page_size):
    """A ``free_group_begin`` while a group is open used to reset the pending list: the
    frees made before it were dropped (a leak). Groups nest; the outermost end frees."""
    a = PagedTokenToKVPoolAllocator(8 * page_size, page_size) if page_size > 1 else TokenToKVPoolAllocator(8)
    x, y = a.alloc(page_size), a.alloc(page_size)
    a.free_group_begin()
    a.free(x)
    a.free_group_begin()
    a.free(y)
    a.free_group_end()
    assert a.available_size() == 6 * page_size  # the outer group is still open
    a.free_group_end()
    assert a.available_size() == 8 * page_size
    a.check_integrity(torch.empty(0, dtype=torch.int64))


def test_req_to_token_pool_debug_mode_rejects_a_row_freed_twice():
    pool = ReqToTokenPool(3, 8, debug=True)
    rows = pool.alloc(2)
    pool.free(rows[0])
    with pytest.raises(IntegrityError, match="double free of 1 rows"):
        pool.free(rows)
    with pytest.raises(IntegrityError, match="duplicate"):
        pool.free([rows[1], rows[1]])
    assert pool.available_size() == 2
    pool.check_integrity(live_rows=[rows[1]])
