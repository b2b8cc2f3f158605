"""Sliding-window models (Gemma 3, GPT-OSS) with the hierarchical cache: a conversation's
earlier turns, their decode slid out of the window (tombstones), leave a small device pool
for host memory and come back — full KV for the whole prefix, SWA KV for its last window —
and the next turn's tokens equal HF's. Both tiers are sound after every step."""

import random

import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from actors.workers import hicache_stats
from mem_cache.radix_key import RadixKey
from mem_cache.swa_hiradix_cache import SWAHiRadixCache
from tests.parity import assert_greedy_parity
from tests.tp_helpers import thread_ranks

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    return str(build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=0))


def make_engine(model_dir, **kwargs):
    """A 256-slot full pool, a 128-slot SWA pool, prompts in 16-token chunks."""
    return Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256, page_size=4,
                  swa_full_tokens_ratio=0.5, chunked_prefill_size=16, enable_hierarchical_cache=True,
                  hicache_ratio=4.0, **kwargs)


def checked_steps(engine):
    """Check the tree (device and host tiers) after every scheduler step."""
    sched = engine.scheduler
    step = sched.step

    def step_and_check():
        out = step()
        sched.tree_cache.check_integrity()
        return out

    sched.step = step_and_check


def flush_files(engine):
    """Wait for both pools' storage writes (the file tier is written off the loop)."""
    tree = engine.scheduler.tree_cache
    engine.loop.run_exclusive(lambda: [c.flush_storage() for c in (tree.cache_controller, tree.swa_cache_controller)])


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_conversation_reloaded_from_the_host_tier_equals_hf(model_dir, policy):
    engine = make_engine(model_dir, hicache_write_policy=policy)
    tree = engine.scheduler.tree_cache
    assert isinstance(tree, SWAHiRadixCache) and tree.swa_host_pool.size == 4 * 128
    checked_steps(engine)
    rng = random.Random(0)
    turn = [rng.randrange(5, 261) for _ in range(40)]
    first = engine.generate(input_ids=[turn], sampling_params={**GREEDY, "max_new_tokens": 32})[0]
    history = turn + first["output_ids"]
    assert any(n.swa_tombstone for n in tree._iter_nodes())  # its decode slid out of the window
    for _ in range(3):  # other prompts fill the device pool: the conversation leaves it for the host
        engine.generate(input_ids=[[rng.randrange(5, 261) for _ in range(100)]],
                        sampling_params={**GREEDY, "max_new_tokens": 4})
        engine.check_integrity()
    match = tree.match_prefix(RadixKey(history))
    assert match.host_hit_length >= 64 and len(match.device_indices) < 8
    chain = [n for n in tree._path_to(match.last_host_node) if n.value is None]
    assert any(n.swa_tombstone for n in chain)  # a tombstone on the host too: only its full KV backed up
    loaded, loaded_swa = tree.cache_controller.loaded_tokens, tree.swa_cache_controller.loaded_tokens
    follow = history + [rng.randrange(5, 261) for _ in range(5)]
    out = engine.generate(input_ids=[follow], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
    assert out["meta_info"]["cached_tokens"] >= 64
    assert tree.cache_controller.loaded_tokens - loaded >= 64
    assert 0 < tree.swa_cache_controller.loaded_tokens - loaded_swa <= 32  # the window's nodes only
    assert_greedy_parity(model_dir, [follow], [out["output_ids"]], 8)
    engine.check_integrity()
    engine.flush_cache()  # the host copies go too
    assert tree.host_pool.available_size() == tree.host_pool.size
    assert tree.swa_host_pool.available_size() == tree.swa_host_pool.size
    engine.check_integrity()
    engine.shutdown()


def test_a_conversation_from_the_file_tier_equals_hf_after_eviction_and_a_restart(model_dir, tmp_path):
    """With a file tier the conversation's pages go to files: full KV of every page, SWA KV of the
    pages that had it on the host (not the tokens its decode slid out of the window). Its device
    and host copies flushed, the next turn fetches it from the files (full KV of all, SWA KV of
    the last window's pages), and so does a new engine on the same folder; tokens equal HF's (before:
    the file tier was refused for sliding-window models)."""
    storage = tmp_path / "kv-files"
    engine = make_engine(model_dir, hicache_storage_dir=str(storage))
    checked_steps(engine)
    rng = random.Random(5)
    turn = [rng.randrange(5, 261) for _ in range(40)]
    first = engine.generate(input_ids=[turn], sampling_params={**GREEDY, "max_new_tokens": 32})[0]
    history = turn + first["output_ids"]
    engine.flush_cache()  # device and host copies gone; the files stay
    flush_files(engine)
    tree = engine.scheduler.tree_cache
    assert tree.match_prefix(RadixKey(history)).host_hit_length == 0
    window_pages = -(-tree.sliding_window_size // 4)
    follow = [history + [rng.randrange(5, 261) for _ in range(5)], history + [rng.randrange(5, 261) for _ in range(3)]]
    outs = [engine.generate(input_ids=[follow[0]], sampling_params={**GREEDY, "max_new_tokens": 8})[0]]
    assert outs[0]["meta_info"]["cached_tokens"] >= 64
    assert tree.cache_controller.read_pages >= 16 and 0 < tree.swa_cache_controller.read_pages <= window_pages
    stats = hicache_stats(tree)  # (a worker's load report: the SWA pool's pages apart)
    assert stats["swa_storage_to_host_pages"] == tree.swa_cache_controller.read_pages
    assert stats["swa_host_to_storage_pages"] == tree.swa_cache_controller.stored_pages > 0
    engine.check_integrity()
    engine.shutdown()  # (waits for its storage writes)
    full_pages, swa_pages = len(list(storage.glob("*.bin"))), len(list((storage / "swa").glob("*.bin")))
    assert full_pages >= 18 and 0 < swa_pages < full_pages  # (the prompt's tombstones: no SWA KV)

    engine = make_engine(model_dir, hicache_storage_dir=str(storage))  # its device and host tiers empty
    checked_steps(engine)
    outs.append(engine.generate(input_ids=[follow[1]], sampling_params={**GREEDY, "max_new_tokens": 8})[0])
    assert outs[1]["meta_info"]["cached_tokens"] >= 64
    engine.check_integrity()
    engine.shutdown()
    assert_greedy_parity(model_dir, follow, [o["output_ids"] for o in outs], 8)


def test_a_device_prefix_continued_from_the_host_tier_equals_hf(model_dir):
    """Only the conversation's last node leaves the device: the next turn's device prefix (ending
    before the tombstones, with its window) is continued by the host part, its lock moved there
    (the old lock's SWA window given back, not the whole path's)."""
    engine = make_engine(model_dir)
    tree = engine.scheduler.tree_cache
    checked_steps(engine)
    rng = random.Random(1)
    turn = [rng.randrange(5, 261) for _ in range(40)]
    first = engine.generate(input_ids=[turn], sampling_params={**GREEDY, "max_new_tokens": 32})[0]
    history = turn + first["output_ids"]
    leaf = tree.match_prefix(RadixKey(history)).last_device_node
    assert not leaf.children and tree.evict(len(leaf.key)).full_num_evicted == len(leaf.key)
    match = tree.match_prefix(RadixKey(history))
    assert len(match.device_indices) >= 32 and match.host_hit_length >= len(leaf.key)
    follow = history + [rng.randrange(5, 261) for _ in range(5)]
    out = engine.generate(input_ids=[follow], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
    assert out["meta_info"]["cached_tokens"] == len(match.device_indices) + match.host_hit_length
    assert_greedy_parity(model_dir, [follow], [out["output_ids"]], 8)
    engine.check_integrity()
    engine.shutdown()


def test_tp2_ranks_replay_both_host_pools_copies(model_dir, monkeypatch):
    """TP 2 (the ranks are threads): a conversation evicted to the host and continued is loaded back
    on both ranks, each into its head shard of both pools (the follower replays rank 0's copies, each
    tagged with its pool), and the tokens equal HF's (before: TP > 1 was refused)."""
    thread_ranks(monkeypatch)
    engine = make_engine(model_dir, tp_size=2)
    try:
        tree, rng = engine.scheduler.tree_cache, random.Random(2)
        turn = [rng.randrange(5, 261) for _ in range(40)]
        first = engine.generate(input_ids=[turn], sampling_params={**GREEDY, "max_new_tokens": 16})[0]
        history = turn + first["output_ids"]
        engine.loop.run_exclusive(lambda: tree.evict(256))
        follow = history + [rng.randrange(5, 261) for _ in range(5)]
        out = engine.generate(input_ids=[follow], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
        assert out["meta_info"]["cached_tokens"] >= 48
        worker = engine.tp_group.worker  # the last backups go with the next batch: sent now, and replied
        engine.loop.run_exclusive(lambda: (worker.sync(), worker.check_followers()))
        follower = engine.tp_group.followers[0]._host_tier
        moved = lambda cs: [(c.written_tokens, c.loaded_tokens) for c in cs]  # noqa: E731
        assert moved(follower.controllers) == moved([tree.cache_controller, tree.swa_cache_controller])
        assert tree.swa_cache_controller.loaded_tokens > 0
        assert_greedy_parity(model_dir, [follow], [out["output_ids"]], 8)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_weight_update_moves_both_pools_file_tiers_to_the_new_version(model_dir, tmp_path, request):
    """After a weight update both pools' pages go to (and come from) the new version's folder: a
    prompt computed on the new weights, flushed, comes back from files with the new weights' SWA KV
    too (the SWA layers' file tier left on the old folder gave the old weights' SWA KV)."""
    family = request.node.callspec.params["model_dir"]
    new = str(build_tiny_checkpoint(family, tmp_path / "new", seed=1))
    storage = tmp_path / "kv-files"
    engine = make_engine(model_dir, hicache_storage_dir=str(storage))
    prompt = [random.Random(9).randrange(5, 261) for _ in range(60)]
    params = {**GREEDY, "max_new_tokens": 8}
    try:
        engine.generate(input_ids=[prompt], sampling_params=params)
        engine.update_weights_from_disk(new, weight_version="v1")
        outs = []
        for _ in range(2):
            outs.append(engine.generate(input_ids=[prompt], sampling_params=params)[0])
            engine.flush_cache()
            flush_files(engine)
        assert outs[0]["meta_info"]["cached_tokens"] == 0 and outs[1]["meta_info"]["cached_tokens"] >= 48
        versions = storage / "weights"  # (storage_dir_for: the new version's folder)
        assert list(versions.glob("*/swa/*.bin")) and list(versions.glob("*/*.bin"))
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert_greedy_parity(new, [prompt, prompt], [o["output_ids"] for o in outs], 8)


def test_tp2_ranks_write_and_read_both_pools_pages_in_their_own_folders(model_dir, monkeypatch, tmp_path):
    """TP 2 with a file tier (the ranks are threads): each rank writes its head shard's pages of both
    pools into its own folder (the follower replays rank 0's storage writes, tagged with their pool);
    a new engine on the same folder reads them on both ranks (rank 0 asks the follower to read the
    same pages into the same slots of the same pool) and the next turn's tokens equal HF's."""
    thread_ranks(monkeypatch)
    storage, rng = tmp_path / "kv-files", random.Random(6)
    turn = [rng.randrange(5, 261) for _ in range(40)]
    engine = make_engine(model_dir, tp_size=2, hicache_storage_dir=str(storage))
    try:
        first = engine.generate(input_ids=[turn], sampling_params={**GREEDY, "max_new_tokens": 16})[0]
    finally:
        engine.shutdown()  # (every rank waits for its storage writes)
    pages = [sorted(p.relative_to(storage / rank).as_posix() for p in (storage / rank).rglob("*.bin"))
             for rank in ("tp2-rank0", "tp2-rank1")]
    assert pages[0] == pages[1] and any(p.startswith("swa/") for p in pages[0])
    follow = turn + first["output_ids"] + [rng.randrange(5, 261) for _ in range(5)]
    engine = make_engine(model_dir, tp_size=2, hicache_storage_dir=str(storage))
    try:
        out = engine.generate(input_ids=[follow], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
        assert out["meta_info"]["cached_tokens"] >= 48
        tree, follower = engine.scheduler.tree_cache, engine.tp_group.followers[0]._host_tier
        read = lambda cs: [c.read_pages for c in cs]  # noqa: E731
        assert read(follower.controllers) == read([tree.cache_controller, tree.swa_cache_controller])
        assert tree.swa_cache_controller.read_pages > 0
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert_greedy_parity(model_dir, [follow], [out["output_ids"]], 8)


def test_tp2_a_weight_update_moves_the_followers_file_tiers_too(model_dir, monkeypatch, tmp_path, request):
    """TP 2 (the ranks are threads): a weight update moves the follower's file tiers of both pools to
    the new version's folder with rank 0's. The prompt computed on the new weights, flushed, comes back
    from files on both ranks, and the tokens equal the new weights' HF's (a follower left on its old
    folder reads the old weights' pages of the same prompt there)."""
    thread_ranks(monkeypatch)
    family = request.node.callspec.params["model_dir"]
    new = str(build_tiny_checkpoint(family, tmp_path / "new", seed=1))
    storage, rng = tmp_path / "kv-files", random.Random(9)
    prompt, params = [rng.randrange(5, 261) for _ in range(60)], {**GREEDY, "max_new_tokens": 8}
    engine = make_engine(model_dir, tp_size=2, hicache_storage_dir=str(storage))
    try:
        engine.generate(input_ids=[prompt], sampling_params=params)  # the old weights' pages on both ranks
        engine.update_weights_from_disk(new, weight_version="v1")
        outs = [engine.generate(input_ids=[prompt], sampling_params=params)[0]]
        engine.flush_cache()
        tree, worker = engine.scheduler.tree_cache, engine.tp_group.worker
        follower = engine.tp_group.followers[0]._host_tier
        engine.loop.run_exclusive(lambda: (worker.sync(), worker.check_followers()))  # (its writes replayed)
        for controller in [tree.cache_controller, tree.swa_cache_controller] + follower.controllers:
            controller.flush_storage()
        outs.append(engine.generate(input_ids=[prompt], sampling_params=params)[0])
        assert outs[0]["meta_info"]["cached_tokens"] == 0 and outs[1]["meta_info"]["cached_tokens"] >= 48
        folders = lambda cs: [c.storage.directory.relative_to(storage).as_posix() for c in cs]  # noqa: E731
        ranks0, ranks1 = folders([tree.cache_controller, tree.swa_cache_controller]), folders(follower.controllers)
        assert [f.replace("tp2-rank1", "tp2-rank0") for f in ranks1] == ranks0 and ranks1[0].startswith("weights/")
        assert follower.controllers[1].read_pages > 0
        engine.check_integrity()
    finally:
        engine.shutdown()
    assert_greedy_parity(new, [prompt, prompt], [o["output_ids"] for o in outs], 8)


def test_random_conversations_through_a_small_device_pool_equal_hf(model_dir):
    """Conversations that come back at random, in batches, through a 192-slot device pool (their
    turns leave it for the host and are loaded back, some retracted): every answer is HF's, the
    tree is sound after every step and the idle engine after every batch."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=192, page_size=4,
                    swa_full_tokens_ratio=0.5, chunked_prefill_size=16, enable_hierarchical_cache=True,
                    hicache_ratio=2.0)
    checked_steps(engine)
    rng = random.Random(4)
    conversations = [[rng.randrange(5, 261) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    runs = []
    for _ in range(8):
        batch = rng.sample(range(len(conversations)), rng.randrange(1, 4))
        prompts = [(conversations[i] + [rng.randrange(5, 261) for _ in range(rng.randrange(1, 12))])[-100:]
                   for i in batch]
        max_new = rng.choice([4, 12, 24])
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
        for i, prompt, out in zip(batch, prompts, outs):
            conversations[i] = prompt + out["output_ids"]
            runs.append((prompt, out["output_ids"], max_new))
        engine.check_integrity()
    assert engine.scheduler.tree_cache.cache_controller.loaded_tokens > 0
    for prompt, output, max_new in runs:
        assert_greedy_parity(model_dir, [prompt], [output], max_new)
    engine.shutdown()
