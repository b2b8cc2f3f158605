"""Sliding-window models (Gemma 3, GPT-OSS) with the hierarchical cache: a conversation's
earlier turns, their decode slid out of the window (tombstones), leave a small device pool
for host memory and come back — full KV for the whole prefix, SWA KV for its last window —
and the next turn's tokens equal HF's. Both tiers are sound after every step."""

import random

import pytest

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
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


def test_the_file_tier_is_refused_clearly(model_dir, tmp_path):
    with pytest.raises(ValueError, match="hicache_storage_dir is not supported for sliding-window"):
        make_engine(model_dir, hicache_storage_dir=str(tmp_path / "kv"))


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
