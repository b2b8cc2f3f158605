"""SWATokenToKVPoolAllocator: both halves move together; free_swa drops only the window's KV."""

import pytest
import torch

from mem_cache.integrity import IntegrityError
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def test_alloc_maps_full_to_swa_and_free_swa_keeps_full():
    a = SWATokenToKVPoolAllocator(size=8, size_swa=4)
    full = a.alloc(3)
    assert full.tolist() == [1, 2, 3]
    assert a.translate_loc_from_full_to_swa(full).tolist() == [1, 2, 3]
    a.free_swa(full[:2])  # the first two tokens slid out of the window
    assert a.translate_loc_from_full_to_swa(full).tolist() == [0, 0, 3]
    assert (a.full_available_size(), a.swa_available_size()) == (5, 3)
    a.check_integrity(full)
    a.free(full)  # SWA slot 3 and all three full slots come back, once
    assert (a.full_available_size(), a.swa_available_size()) == (8, 4)
    a.check_integrity(torch.empty(0, dtype=torch.int64))


def test_short_swa_pool_fails_whole_allocation_without_side_effects():
    a = SWATokenToKVPoolAllocator(size=8, size_swa=2)
    assert a.alloc(3) is None
    assert (a.full_available_size(), a.swa_available_size()) == (8, 2)
    a.check_integrity(torch.empty(0, dtype=torch.int64))


def test_available_size_is_ambiguous():
    with pytest.raises(NotImplementedError, match="full_available_size"):
        SWATokenToKVPoolAllocator(size=8, size_swa=4).available_size()


def test_paged_swa_extend_decode_and_page_granular_free_swa():
    a = SWATokenToKVPoolAllocator(size=32, size_swa=16, page_size=4)
    full = a.alloc_extend(t(0), t(6), t(-1), 6)
    assert full.tolist() == [4, 5, 6, 7, 8, 9]
    swa = a.translate_loc_from_full_to_swa(full)
    assert swa.tolist() == [4, 5, 6, 7, 8, 9]
    nxt = a.alloc_decode(t(7), t(9))  # position 6 continues the page
    assert nxt.tolist() == [10]
    assert a.translate_loc_from_full_to_swa(nxt).tolist() == [10]
    a.free_swa(full[:4])  # the first page slid out of the window: its SWA page is freed
    assert a.translate_loc_from_full_to_swa(full).tolist() == [0, 0, 0, 0, 8, 9]
    assert a.swa_available_size() == 12
    a.check_integrity(torch.cat([full, nxt]))


def test_paged_free_swa_refuses_part_of_a_page():
    """An SWA page is freed whole: given part of one, free_swa would free its other, live
    tokens' SWA KV. It raises and frees nothing; ``free`` (a request's unaligned tail) may."""
    a = SWATokenToKVPoolAllocator(size=32, size_swa=16, page_size=4)
    full = a.alloc_extend(t(0), t(7), t(-1), 7)  # pages [4, 8) and [8, 11)
    swa = a.translate_loc_from_full_to_swa(full).tolist()
    for part in (full[:1], full[1:4], full[:6], torch.cat([full[:4], full[:1]])):
        with pytest.raises(ValueError, match=r"whole pages \(page_size=4\).*page\(s\) \[[12]\]"):
            a.free_swa(part)
        assert a.translate_loc_from_full_to_swa(full).tolist() == swa and a.swa_available_size() == 8
    a.free(full[4:])  # the tail page's three tokens: both halves of the page go
    assert (a.full_available_size(), a.swa_available_size()) == (28, 12)
    a.check_integrity(full[:4])


def test_restore_state_forgets_mappings_of_rolled_back_slots():
    a = SWATokenToKVPoolAllocator(size=8, size_swa=8)
    kept = a.alloc(2)
    state = a.backup_state()
    a.alloc(3)
    a.restore_state(state)
    a.check_integrity(kept)


def test_integrity_detects_stale_mapping():
    a = SWATokenToKVPoolAllocator(size=8, size_swa=8)
    full = a.alloc(2)
    a.full_attn_allocator.free(full)  # bypassing the SWA allocator leaks the SWA half
    with pytest.raises(IntegrityError, match="still map"):
        a.check_integrity(torch.empty(0, dtype=torch.int64))


def _leak_swa(a, full):
    a.full_to_swa_index_mapping[full] = 0  # the SWA half forgotten, never freed
    a.full_attn_allocator.free(full)


def _free_swa_twice(a, full):
    a.swa_attn_allocator.free(a.full_to_swa_index_mapping[full])  # on its own, then with the pair
    a.free(full)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("free, error", [(SWATokenToKVPoolAllocator.free, None), (_leak_swa, "leak"),
                                         (_free_swa_twice, "duplicate")])
def test_integrity_detects_an_swa_slot_leaked_or_freed_twice(page_size, free, error):
    """What a verify step's rejected draft (a page past the kept one) could do wrong in the SWA
    pool: its SWA half leaked, or freed twice. Both raise; freed as a pair, the allocator is sound."""
    a = SWATokenToKVPoolAllocator(size=16, size_swa=16, page_size=page_size)
    kept, draft = a.alloc(2 * page_size).split(page_size)
    free(a, draft)
    if error is None:
        a.check_integrity(kept)
    else:
        with pytest.raises(IntegrityError, match=error):
            a.check_integrity(kept)


def test_restore_state_undoes_free_swa_and_free_after_the_backup():
    a = SWATokenToKVPoolAllocator(size=8, size_swa=8)
    kept = a.alloc(4)
    state = a.backup_state()
    sizes = (a.full_available_size(), a.swa_available_size())
    a.free_swa(kept[:2])  # slid out of the window after the backup
    a.free(kept[2:3])
    a.alloc(2)
    a.restore_state(state)
    assert (a.full_available_size(), a.swa_available_size()) == sizes
    assert a.translate_loc_from_full_to_swa(kept).tolist() == [1, 2, 3, 4]
    a.check_integrity(kept)
    a.free(kept)  # every SWA slot comes back once, none leaked by the round trip
    assert (a.full_available_size(), a.swa_available_size()) == (8, 8)
    a.check_integrity(torch.empty(0, dtype=torch.int64))
