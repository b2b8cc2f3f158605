"""The storage tier: the file backend's contract, and KV that goes device →
host → file → host → device unchanged, also through a cold cache."""

import threading
import time

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


class GatedFile(HiCacheFile):
    """A file backend whose writes wait for ``gate`` (a slow remote store)."""

    def __init__(self, directory):
        super().__init__(directory)
        self.gate, self.started = threading.Event(), threading.Event()

    def batch_set(self, keys, values):
        self.started.set()
        assert self.gate.wait(10), "the gate was never opened"
        return super().batch_set(keys, values)


def test_async_storage_writes_take_the_bytes_at_once_and_write_them_off_the_caller(tmp_path):
    """With ``async_storage_writes`` a backup returns while the store is still writing; the
    host slots may change at once (the bytes were taken), the pages land as they were, and
    ``flush_storage`` waits for them. With ``max_pending_writes=1`` the next backup waits
    for the one before (a slow store slows backups instead of piling up page copies)."""
    store = GatedFile(tmp_path)
    cache, alloc, kv = make(page_size=4, storage_backend=store, async_storage_writes=True)
    controller = cache.cache_controller
    controller.max_pending_writes = 1
    tokens = list(range(200, 216))
    _, want = cached(cache, alloc, tokens)  # write_through: backed up, storage write queued
    assert store.started.wait(10) and list(tmp_path.glob("*.bin")) == []
    cache.host_pool.kv_buffer.fill_(7)  # the store has its own copy of the bytes
    second = threading.Thread(target=lambda: cached(cache, alloc, list(range(300, 308)), seed=1), daemon=True)
    second.start()
    second.join(0.1)
    assert second.is_alive()  # the second backup waits for the first write (max_pending_writes=1)
    store.gate.set()
    second.join(10)
    controller.flush_storage()
    assert controller.stored_pages == 6 and len(list(tmp_path.glob("*.bin"))) == 6
    cold, cold_alloc, cold_kv = make(page_size=4, storage_backend=HiCacheFile(tmp_path))
    assert cold.prefetch_from_storage(K(tokens)) == 16
    m = cold.match_prefix(K(tokens))
    loaded, _ = cold.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(cold_kv, loaded), want)
    check(cold, cold_alloc)
    controller.close()


def test_a_failed_async_storage_write_loses_its_pages_not_the_engine(tmp_path, caplog):
    class Broken(HiCacheFile):
        def batch_set(self, keys, values):
            raise OSError("disk full")

    cache, alloc, kv = make(page_size=4, storage_backend=Broken(tmp_path), async_storage_writes=True)
    tokens = list(range(200, 216))
    cached(cache, alloc, tokens)
    cache.cache_controller.flush_storage()
    assert "writing 4 pages to the storage tier failed" in caplog.text
    assert cache.cache_controller.stored_pages == 0
    cold, _, _ = make(page_size=4, storage_backend=HiCacheFile(tmp_path))
    assert cold.prefetch_from_storage(K(tokens)) == 0  # nothing landed, and nothing half-written
    check(cache, alloc)
    cached(cache, alloc, list(range(300, 308)))  # the cache goes on backing up
    cache.cache_controller.flush_storage()
    check(cache, alloc)


# ---- prefetch off the loop ---------------------------------------------------------------
class SlowReads(HiCacheFile):
    """A file backend whose reads after the first ``free_batches`` wait for ``gate``."""

    def __init__(self, directory, free_batches=0):
        super().__init__(directory)
        self.gate, self.reads, self.free_batches = threading.Event(), 0, free_batches

    def batch_get(self, keys):
        self.reads += 1
        if self.reads > self.free_batches:
            assert self.gate.wait(10), "the gate was never opened"
        return super().batch_get(keys)


def stored(tmp_path, tokens, page_size=4):
    """Write ``tokens``' pages to files through a cache that is then dropped; returns their KV."""
    old, old_alloc, _ = make(page_size=page_size, size=128, storage_backend=HiCacheFile(tmp_path))
    _, want = cached(old, old_alloc, tokens)
    return want


def test_prefetch_reads_on_the_storage_thread_and_enters_the_tree_when_finished(tmp_path):
    tokens = list(range(300, 372))  # 18 pages: 3 batches of 8 (the last short)
    want = stored(tmp_path, tokens)
    store = SlowReads(tmp_path)
    cold, alloc, kv = make(page_size=4, size=128, storage_backend=store)
    op = cold.start_prefetch(K(tokens))
    assert op is not None and len(op.keys) == 18 and cold.prefetch_ops == [op]
    assert cold.match_prefix(K(tokens)).host_hit_length == 0  # nothing in the tree while it reads
    cold.check_integrity()  # its host slots count as held
    store.gate.set()
    assert cold.finish_prefetch(op, wait=True) == 72 and cold.prefetch_ops == [] and op.pages_read == 18
    m = cold.match_prefix(K(tokens))
    assert m.host_hit_length == 72
    loaded, _ = cold.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), want)
    assert cold.finish_prefetch(op) == 0  # ended once
    check(cold, alloc)


def test_a_prefetch_ended_early_keeps_the_pages_it_read_and_frees_the_rest(tmp_path):
    tokens = list(range(300, 372))
    want = stored(tmp_path, tokens)
    store = SlowReads(tmp_path, free_batches=1)  # the first 8 pages come at once, the rest wait
    cold, alloc, kv = make(page_size=4, size=128, storage_backend=store)
    op = cold.start_prefetch(K(tokens))
    deadline = time.monotonic() + 10
    while op.pages_read < 8 and time.monotonic() < deadline:
        time.sleep(0.005)
    ender = threading.Thread(target=lambda: cold.finish_prefetch(op), daemon=True)
    ender.start()  # cancels: the thread stops after the batch it is in (held at the gate), waits for it
    ender.join(0.05)
    assert ender.is_alive()
    store.gate.set()
    ender.join(10)
    m = cold.match_prefix(K(tokens))  # the batch in flight when it was ended lands; the third is never read
    assert m.host_hit_length == 64 and op.pages_read == 16 and store.reads == 2
    loaded, _ = cold.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), [rows[:64] for rows in want])
    check(cold, alloc)


def test_a_prefetch_gives_back_what_the_tree_got_meanwhile_and_keeps_the_node_it_extends(tmp_path):
    """While the pages are read the tree goes on: a request computed the first pages (the
    prefetch's copies of those are given back, the rest hang under them). The cached prefix
    the prefetch extends may leave the device, but not the host: the op holds a host ref on
    it (before, the op's own host allocation could evict it, and every page read was lost)."""
    head, tail = list(range(300, 316)), list(range(316, 348))
    stored(tmp_path, head + tail)
    store = SlowReads(tmp_path)
    cache, alloc, kv = make(page_size=4, size=128, storage_backend=store)
    op = cache.start_prefetch(K(head + tail))
    cached(cache, alloc, head + tail[:8])  # computed meanwhile: head and 2 pages of tail
    store.gate.set()
    assert cache.finish_prefetch(op, wait=True) == 24
    m = cache.match_prefix(K(head + tail))
    assert (m.device_indices.numel(), m.host_hit_length) == (24, 24)
    check(cache, alloc)

    cache2, alloc2, _ = make(page_size=4, size=128, storage_backend=HiCacheFile(tmp_path))
    cached(cache2, alloc2, head)
    op = cache2.start_prefetch(K(head + tail))
    assert op.matched == 16
    assert cache2.evict(16) == 16 and cache2.evict_host(16) == 0  # off the device; kept on the host
    cache2.check_integrity()  # (the op's host ref is accounted for)
    assert cache2.finish_prefetch(op, wait=True) == 32
    assert cache2.match_prefix(K(head + tail)).host_hit_length == 48
    assert cache2.evict_host(48) == 48  # the ref went with the op
    check(cache2, alloc2)

    # a device node with no host copy yet (selective: one hit is not enough) leaves the device
    # through a backup while a prefetch extends it, not deleted
    cache3, alloc3, _ = make(page_size=4, size=128, storage_backend=HiCacheFile(tmp_path),
                             write_policy="write_through_selective")
    cached(cache3, alloc3, head)
    op = cache3.start_prefetch(K(head + tail))
    assert not op.end.backuped and cache3.evict(16) == 16 and op.end.backuped
    assert cache3.finish_prefetch(op, wait=True) == 32
    assert cache3.match_prefix(K(head + tail)).host_hit_length == 48
    check(cache3, alloc3)


def test_ending_a_prefetch_the_thread_has_not_reached_does_not_wait_for_the_ones_before(tmp_path):
    """One thread reads the prefetches in arrival order; ending a later one (its request was
    aborted, or admitted first under lpm) returns at once with nothing, it does not wait
    for the earlier ones to read all their pages."""
    a, b = list(range(300, 332)), list(range(400, 432))
    stored(tmp_path, a)
    stored(tmp_path, b)
    store = SlowReads(tmp_path)
    cache, alloc, _ = make(page_size=4, size=128, storage_backend=store)
    op_a, op_b = cache.start_prefetch(K(a)), cache.start_prefetch(K(b))
    start = time.monotonic()  # (held up behind op_a, it would end once op_a's read gave up: 10 s)
    assert cache.finish_prefetch(op_b) == 0 and time.monotonic() - start < 5.0
    assert op_b.state == "done" and op_a.state in ("queued", "running")
    store.gate.set()
    assert cache.finish_prefetch(op_a, wait=True) == 32
    check(cache, alloc)


def test_prefetch_failures_cost_the_hit_and_leak_nothing(tmp_path, caplog):
    """Storage that cannot be asked: no prefetch (logged), no error for the request. Other TP
    ranks that cannot answer when a prefetch ends: its host slots go back, the error is raised.
    Prefetches in flight hold at most ``prefetch_capacity`` of the host pool."""
    tokens = list(range(300, 332))
    stored(tmp_path, tokens)

    class Unreachable(HiCacheFile):
        def batch_exists(self, keys):
            raise PermissionError("storage unreachable")

    cache, alloc, _ = make(page_size=4, size=128, storage_backend=Unreachable(tmp_path))
    assert cache.start_prefetch(K(tokens)) is None and cache.prefetch_from_storage(K(tokens)) == 0
    assert "asking the storage tier for 8 pages failed" in caplog.text

    cache, alloc, _ = make(page_size=4, size=128, storage_backend=HiCacheFile(tmp_path))
    op = cache.start_prefetch(K(tokens))

    def broken_peers(name, payload):
        raise RuntimeError("TP group gone")

    cache.cache_controller.peers_prefetch = broken_peers
    with pytest.raises(RuntimeError, match="TP group gone"):
        cache.finish_prefetch(op, wait=True)
    assert cache.prefetch_ops == [] and op.end.host_ref_counter == 0
    cache.cache_controller.peers_prefetch = None
    check(cache, alloc)

    class FailingReads(HiCacheFile):  # its first read raises, its second answers for 2 of the pages asked
        def batch_get(self, keys):
            self.reads = getattr(self, "reads", 0) + 1
            if self.reads == 1:
                raise ConnectionError("storage went away")
            return super().batch_get(keys)[:2]

    cache, alloc, _ = make(page_size=4, size=128, storage_backend=FailingReads(tmp_path))
    assert cache.prefetch_from_storage(K(tokens)) == 0 and "reading 8 pages from the storage tier failed" in caplog.text
    check(cache, alloc)
    assert cache.prefetch_from_storage(K(tokens)) == 8 and cache.match_prefix(K(tokens)).host_hit_length == 8
    check(cache, alloc)

    cache, alloc, _ = make(page_size=4, size=128, storage_backend=HiCacheFile(tmp_path))
    cache.prefetch_capacity = 16 / cache.host_pool.size  # room for 4 of the 8 pages
    op = cache.start_prefetch(K(tokens))
    assert len(op.keys) == 4 and cache.start_prefetch(K(tokens)) is None
    assert cache.finish_prefetch(op, wait=True) == 16
    check(cache, alloc)


def test_a_prefetch_keeps_only_the_pages_before_the_first_one_storage_gave_no_answer_for(tmp_path):
    """A backend that answers a batch read for fewer pages than asked: the pages after the
    last answered one count as absent (read, the next batches' pages would have hidden the
    unread ones behind them: host slots never written, taken as fetched)."""
    tokens = list(range(300, 372))  # 18 pages: batches of 8
    want = stored(tmp_path, tokens)

    class ShortAnswers(HiCacheFile):
        def batch_get(self, keys):
            return super().batch_get(keys)[:5]

    cold, alloc, kv = make(page_size=4, size=128, storage_backend=ShortAnswers(tmp_path))
    op = cold.start_prefetch(K(tokens))
    assert cold.finish_prefetch(op, wait=True) == 20 and op.pages_read == 5
    m = cold.match_prefix(K(tokens))
    loaded, _ = cold.init_load_back(m.last_host_node, m.host_hit_length)
    assert same(read_kv(kv, loaded), [part[:20] for part in want])
    check(cold, alloc)
