"""KV tensor pools: shapes, exact round trips, fp8 storage, transfer descriptions, integrity."""

import pytest
import torch

from mem_cache import buffer_allocator as buffer_allocator_module
from mem_cache.buffer_allocator import LocalBufferAllocator
from mem_cache.integrity import IntegrityError
from mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_memory_pool import SWAKVPool


def t(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def ramp(*shape, start=1.0):
    n = 1
    for s in shape:
        n *= s
    return torch.arange(start, start + n, dtype=torch.float32).reshape(shape)


def mha(**overrides):
    args = dict(size=8, page_size=4, dtype=torch.float32, head_num=2, head_dim=3, layer_num=2)
    args.update(overrides)
    return MHATokenToKVPool(**args)


# ---- MHA -------------------------------------------------------------------
def test_mha_buffers_have_size_plus_page_size_rows_and_are_named_per_layer():
    alloc = LocalBufferAllocator("cpu")
    pool = mha(v_head_dim=5, buffer_allocator=alloc)
    assert [tuple(b.shape) for b in pool.k_buffer] == [(12, 2, 3), (12, 2, 3)]
    assert [tuple(b.shape) for b in pool.v_buffer] == [(12, 2, 5), (12, 2, 5)]
    assert list(alloc.buffers()) == ["k_buffer.0", "k_buffer.1", "v_buffer.0", "v_buffer.1"]
    assert (pool.start_layer, pool.end_layer, pool.store_dtype) == (0, 1, torch.float32)
    pool.check_integrity()


def test_mha_set_get_round_trip_touches_only_the_given_rows():
    pool = mha()
    loc = t(3, 5, 6)
    k, v = ramp(3, 2, 3), ramp(3, 2, 3, start=100.0)
    pool.set_kv_buffer(1, loc, k, v)
    key, value = pool.get_kv_buffer(1)
    assert torch.equal(key[loc], k) and torch.equal(value[loc], v)
    others = [i for i in range(12) if i not in (3, 5, 6)]
    assert not key[others].any() and not value[others].any()  # dummy row 0 included
    assert not pool.get_key_buffer(0).any() and not pool.get_value_buffer(0).any()
    assert pool.get_key_buffer(1).data_ptr() == pool.k_buffer[1].data_ptr()  # a view, not a copy


def test_mha_start_layer_maps_global_layer_ids_to_local_buffers():
    alloc = LocalBufferAllocator("cpu")
    pool = mha(start_layer=4, buffer_allocator=alloc)
    assert (pool.start_layer, pool.end_layer) == (4, 5)
    assert list(alloc.buffers()) == ["k_buffer.4", "k_buffer.5", "v_buffer.4", "v_buffer.5"]
    pool.set_kv_buffer(5, t(2), ramp(1, 2, 3), ramp(1, 2, 3))
    assert torch.equal(pool.k_buffer[1][2], ramp(2, 3)) and not pool.k_buffer[0].any()
    for outside in (3, 6):
        with pytest.raises(ValueError, match=f"layer_id={outside} outside this pool's layers \\[4, 5\\]"):
            pool.get_key_buffer(outside)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_is_stored_as_uint8_and_read_back_as_fp8(fp8):
    pool = mha(dtype=fp8)
    assert pool.store_dtype == torch.uint8 and pool.k_buffer[0].dtype == torch.uint8
    k = ramp(2, 2, 3) / 4
    v = -ramp(2, 2, 3) / 8
    k_before, v_before = k.clone(), v.clone()
    pool.set_kv_buffer(0, t(1, 4), k, v, k_scale=2.0, v_scale=0.5)
    key, value = pool.get_kv_buffer(0)
    assert key.dtype == fp8 and value.dtype == fp8
    assert torch.equal(key[t(1, 4)].float(), (k_before / 2.0).to(fp8).float())
    assert torch.equal(value[t(1, 4)].float(), (v_before / 0.5).to(fp8).float())
    assert torch.equal(k, k_before) and torch.equal(v, v_before)  # caller's tensors untouched
    already_fp8 = ramp(1, 2, 3).to(fp8)
    pool.set_kv_buffer(0, t(7), already_fp8, already_fp8, k_scale=100.0)  # same dtype: no scaling
    assert torch.equal(pool.get_key_buffer(0)[7].float(), ramp(2, 3).to(fp8).float())


def test_mha_contiguous_buf_infos_by_hand():
    pool = mha(v_head_dim=5)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in (pool.k_buffer[0], pool.k_buffer[1], pool.v_buffer[0], pool.v_buffer[1])]
    # K row: 2 heads × 3 × 4 B = 24 B; V row: 2 × 5 × 4 = 40 B; 12 rows; pages of 4 rows
    assert lens == [288, 288, 480, 480]
    assert items == [96, 96, 160, 160]
    assert pool.mem_usage_bytes() == 1536


# ---- MLA -------------------------------------------------------------------
def mla(**overrides):
    args = dict(size=6, page_size=2, dtype=torch.float32, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=2)
    args.update(overrides)
    return MLATokenToKVPool(**args)


def test_mla_row_holds_nope_then_rope_and_value_is_the_nope_view():
    pool = mla()
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(8, 1, 6), (8, 1, 6)]
    loc = t(2, 5)
    k_nope, k_rope = ramp(2, 1, 4), ramp(2, 1, 2, start=50.0)
    pool.set_mla_kv_buffer(1, loc, k_nope, k_rope)
    assert torch.equal(pool.kv_buffer[1][loc], torch.cat([k_nope, k_rope], dim=-1))
    got_nope, got_rope = pool.get_mla_kv_buffer(1, loc)
    assert torch.equal(got_nope, k_nope) and torch.equal(got_rope, k_rope)
    value = pool.get_value_buffer(1)
    assert tuple(value.shape) == (8, 1, 4) and value.data_ptr() == pool.kv_buffer[1].data_ptr()
    assert torch.equal(value[loc], k_nope)
    assert not pool.kv_buffer[0].any()
    pool.set_kv_buffer(0, t(3), ramp(1, 1, 6))  # whole-row write
    assert torch.equal(pool.get_key_buffer(0)[3], ramp(1, 6))


def test_mla_fp8_and_buf_infos():
    pool = mla(dtype=torch.float8_e4m3fn)
    pool.set_mla_kv_buffer(0, t(1), ramp(1, 1, 4), ramp(1, 1, 2))
    nope, rope = pool.get_mla_kv_buffer(0, t(1))
    assert nope.dtype == torch.float8_e4m3fn and torch.equal(nope.float(), ramp(1, 1, 4))
    assert torch.equal(rope.float(), ramp(1, 1, 2))
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer]
    assert lens == [48, 48] and items == [12, 12]  # 8 rows × 6 B; 6 B × page_size 2


# ---- SWA -------------------------------------------------------------------
def swa_pool(alloc=None):
    return SWAKVPool(
        size=8, size_swa=4, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
        swa_attention_layer_ids=[1, 2], full_attention_layer_ids=[0, 3], buffer_allocator=alloc,
    )


def test_swa_pool_dispatches_layers_and_translates_locs():
    alloc = LocalBufferAllocator("cpu")
    pool = swa_pool(alloc)
    assert pool.layers_mapping == {0: (0, False), 3: (1, False), 1: (0, True), 2: (1, True)}
    assert sorted(alloc.buffers()) == sorted(
        [f"full.{kv}_buffer.{i}" for kv in "kv" for i in (0, 1)] + [f"swa.{kv}_buffer.{i}" for kv in "kv" for i in (0, 1)]
    )
    mapping = torch.zeros(8 + 1 + 1, dtype=torch.int64)
    mapping[t(5, 6)] = t(2, 4)
    pool.register_mapping(mapping)
    assert pool.translate_loc_from_full_to_swa(t(5, 6, 7)).tolist() == [2, 4, 0]
    k, v = ramp(2, 1, 2), ramp(2, 1, 2, start=10.0)
    pool.set_kv_buffer(2, t(5, 6), k, v)  # SWA layer: rows 2, 4 of swa pool layer 1
    assert torch.equal(pool.swa_kv_pool.k_buffer[1][t(2, 4)], k)
    assert torch.equal(pool.get_value_buffer(2)[t(2, 4)], v)
    pool.set_kv_buffer(3, t(5, 6), k, v)  # full layer: rows 5, 6 of full pool layer 1
    assert torch.equal(pool.full_kv_pool.k_buffer[1][t(5, 6)], k)
    pool.set_kv_buffer(1, t(5), k[:1], v[:1], swa_loc=t(3))  # explicit SWA slots win
    assert torch.equal(pool.swa_kv_pool.k_buffer[0][3], k[0])
    assert not pool.full_kv_pool.k_buffer[0].any() and not pool.swa_kv_pool.k_buffer[0][t(2, 4)].any()
    with pytest.raises(ValueError, match="layer_id=7"):
        pool.get_key_buffer(7)
    pool.check_integrity()


def test_swa_pool_buf_infos_are_full_then_swa():
    pool = swa_pool()
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    f, s = pool.full_kv_pool, pool.swa_kv_pool
    assert ptrs == [b.data_ptr() for b in f.k_buffer + f.v_buffer + s.k_buffer + s.v_buffer]
    assert lens == [72] * 4 + [40] * 4  # 9 and 5 rows of 8 B
    assert items == [8] * 8


def test_swa_pool_with_swa_allocator_writes_where_the_allocator_mapped():
    pool = swa_pool()
    allocator = SWATokenToKVPoolAllocator(size=8, size_swa=4, kvcache=pool)
    full = allocator.alloc(2)
    swa = allocator.translate_loc_from_full_to_swa(full)
    pool.set_kv_buffer(1, full, ramp(2, 1, 2), ramp(2, 1, 2))
    assert torch.equal(pool.get_key_buffer(1)[swa], ramp(2, 1, 2))
    pool.check_integrity()


def test_swa_pool_translates_attention_reads_per_layer():
    pool = swa_pool()
    allocator = SWATokenToKVPoolAllocator(size=8, size_swa=4, kvcache=pool)
    full = allocator.alloc(3)
    allocator.free_swa(full[:1])  # slid out of the window: reads the zero dummy row 0
    swa = allocator.translate_loc_from_full_to_swa(full)
    table = torch.stack([full, full.flip(0)]).to(torch.int32)
    assert pool.translate_layer_loc(0, full) is full  # a full layer reads its own slots
    assert pool.translate_layer_loc(2, full).tolist() == [0] + swa[1:].tolist()
    translated = pool.translate_layer_table(1, table)
    assert translated.dtype == torch.int32 and translated.tolist() == [swa.tolist(), swa.flip(0).tolist()]


def test_swa_pool_without_mapping_refuses_swa_writes():
    with pytest.raises(RuntimeError, match="register_mapping"):
        swa_pool().set_kv_buffer(1, t(1), ramp(1, 1, 2), ramp(1, 1, 2))


def test_overlapping_layer_lists_are_rejected():
    with pytest.raises(ValueError, match=r"layers \[2\]"):
        SWAKVPool(8, 4, 1, torch.float32, 1, 2, swa_attention_layer_ids=[1, 2], full_attention_layer_ids=[0, 2])


# ---- shared memory ---------------------------------------------------------
def test_mha_pool_on_shared_memory_allocator():
    shm_cls = buffer_allocator_module.SharedMemoryBufferAllocator
    attach = buffer_allocator_module.attach_buffers
    alloc = shm_cls("cpu")
    try:
        pool = mha(buffer_allocator=alloc)
        pool.set_kv_buffer(0, t(2), ramp(1, 2, 3), ramp(1, 2, 3))
        attached = attach(alloc.export_handles())
        assert torch.equal(attached["k_buffer.0"][2], ramp(2, 3))
        pool.check_integrity()
    finally:
        alloc.close()


# ---- integrity -------------------------------------------------------------
def test_integrity_catches_a_wrong_shape_a_missing_layer_and_a_reallocation():
    pool = mha()
    pool.k_buffer[1] = torch.zeros(11, 2, 3)
    with pytest.raises(IntegrityError, match=r"k_buffer\[1\]: shape \(11, 2, 3\), expected \(12, 2, 3\)"):
        pool.check_integrity()
    pool = mha()
    pool.v_buffer.pop()
    with pytest.raises(IntegrityError, match="2 K and 1 V buffers for 2 layers"):
        pool.check_integrity()
    pool = mha()
    pool.v_buffer[0] = pool.v_buffer[0].clone()
    with pytest.raises(IntegrityError, match="1 of 4 buffers were reallocated"):
        pool.check_integrity()
    pool = mla()
    pool.kv_buffer[0] = pool.kv_buffer[0].to(torch.float16)
    with pytest.raises(IntegrityError, match="dtype torch.float16, expected torch.float32"):
        pool.check_integrity()


def test_swa_integrity_catches_a_mapping_past_the_swa_rows():
    pool = swa_pool()
    mapping = torch.zeros(10, dtype=torch.int64)
    mapping[3] = 5  # the SWA pool has rows 0..4
    pool.register_mapping(mapping)
    with pytest.raises(IntegrityError, match=r"span \[0, 5\], SWA rows are \[0, 4\]"):
        pool.check_integrity()
