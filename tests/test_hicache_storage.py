"""The storage tier: the file backend's contract, and KV that goes device →
host → file → host → device unchanged, also through a cold cache."""

import pytest

from mem_cache.hicache_storage import HiCacheFile, create_storage_backend, rank_storage_dir
from mem_cache.kv_events import BlockStored
from mem_cache.radix_key import hash_pages
from tests.hicache_helpers import K, cached, check, make, node_of, read_kv, same, scramble


def test_file_backend_contract(tmp_path):
    store = create_storage_backend("file", directory=tmp_path)
    keys = hash_pages(list(range(12)), 4)
    assert store.batch_set(keys[:2], [b"p0", b"p1"]) == [True, True]
    assert store.batch_set(keys[:1], [b"other"]) == [True]  # content-addressed: kept as is
    assert store.batch_get(keys) == [b"p0", b"p1", None]
    assert (store.batch_exists(keys), store.batch_exists(keys[1:]), store.batch_exists(keys[2:])) == (2, 1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k}.bin" for k in keys[:2])  # no temp files
    with pytest.raises(ValueError, match="hex page hashes"):
        store.batch_get(["../etc/passwd"])
    with pytest.raises(ValueError, match="known: file"):
        create_storage_backend("s3")
    (tmp_path / f"{keys[2]}.bin").mkdir()  # a page that cannot be read (here: a folder) is absent, no error
    assert store.batch_get(keys[2:]) == [None]


def test_rank_storage_dir_gives_each_tp_rank_its_own_folder(tmp_path):
    assert rank_storage_dir(tmp_path, 0, 1) == tmp_path
    assert [rank_storage_dir(tmp_path, r, 2).name for r in (0, 1)] == ["tp2-rank0", "tp2-rank1"]
    assert rank_storage_dir(tmp_path, 0, 2) != rank_storage_dir(tmp_path, 0, 4)  # other shards, other pages


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_device_host_file_host_device_round_trip(tmp_path, layout, policy):
    store = HiCacheFile(tmp_path)
    cache, alloc, kv = make(page_size=4, layout=layout, write_policy=policy, storage_backend=store)
    tokens = list(range(200, 216))
    _, want = cached(cache, alloc, tokens)
    assert cache.evict(16) == 16 and cache.evict_host(16) == 16  # gone from device and host
    keys = hash_pages(tokens, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{k}.bin" for k in keys)
    scramble(kv)
    cache.host_pool.kv_buffer.fill_(7)  # what comes back must come from the files
    assert cache.match_prefix(K(tokens)).host_hit_length == 0
    assert cache.prefetch_from_storage(K(tokens + [1, 2])) == 16
    m = cache.match_prefix(K(tokens))
    assert m.host_hit_length == 16 and m.last_host_node.hash_value == keys
    loaded, _ = cache.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), want)
    check(cache, alloc)


@pytest.mark.parametrize("mla", [False, True])
def test_file_tier_survives_a_new_cache(tmp_path, mla):
    old, old_alloc, _ = make(page_size=4, mla=mla, storage_backend=HiCacheFile(tmp_path))
    tokens = list(range(300, 324))
    _, want = cached(old, old_alloc, tokens)
    (tmp_path / f"{hash_pages(tokens, 4)[4]}.bin").unlink()  # page 4 lost: pages [0, 4) usable
    cold, alloc, kv = make(page_size=4, mla=mla, layout="page_first", storage_backend=HiCacheFile(tmp_path))
    assert cold.prefetch_from_storage(K(tokens)) == 16
    m = cold.match_prefix(K(tokens))
    assert (m.device_indices.numel(), m.host_hit_length) == (0, 16)
    loaded, _ = cold.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), [rows[:16] for rows in want])
    check(cold, alloc)


def test_prefetch_under_device_only_node_backs_it_up_on_eviction(tmp_path):
    writer, writer_alloc, _ = make(page_size=4, storage_backend=HiCacheFile(tmp_path))
    tokens = list(range(1, 17))
    cached(writer, writer_alloc, tokens)
    cache, alloc, _ = make(
        page_size=4,
        write_policy="write_through_selective",
        storage_backend=HiCacheFile(tmp_path),
        enable_kv_events=True,
    )
    cached(cache, alloc, tokens[:8])
    head = node_of(cache, tokens[:8])
    assert not head.backuped
    cache.take_events()
    assert cache.prefetch_from_storage(K(tokens)) == 8
    tail = node_of(cache, tokens)
    assert tail.parent is head and tail.value is None
    assert cache.take_events() == [BlockStored(3, hash_pages(tokens, 4)[2:], head.hash_value[-1], tokens[8:], 4)]
    assert cache.evict(8) == 8  # head is a device leaf with a host-only child: backed up, kept
    assert head.value is None and head.backuped and cache.match_prefix(K(tokens)).host_hit_length == 16
    check(cache, alloc)
