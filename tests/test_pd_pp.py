"""Pipeline parallelism in the PD cluster: a prefill or decode worker of pp_size stages (each
stage's ranks holding and pushing, or taking, only their layers' KV) serves a peer of another
PP size, its greedy tokens HF's (the single engine's); the prefill ranks' shares must write
every decode buffer, or the request fails instead of decoding from KV never written; models of
different depths are refused by name. Ranks are threads (tests.tp_helpers), over shm."""

import asyncio
import collections
import sys

import pytest

from actors.engine.tiny import build_tiny_checkpoint
from actors.pd_scheduler import PDRequestError
from actors.workers import DecodeWorker, PrefillWorker
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers, prompts, run_batch, run_pd, wait_idle
from tests.tp_helpers import pd_worker_ranks, thread_ranks
from transfer.base import KVHandoff, LayoutMismatchError

GREEDY = {"max_new_tokens": 6, "temperature": 0}
BASE = dict(max_total_tokens=1024, page_size=4, chunked_prefill_size=16, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("pd-pp") / "llama", seed=0))


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return str(build_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("pd-pp") / "deepseek_v3", seed=0))


def start(cls, path, pp_size=1, tp_size=1, **args):
    """A worker of ``pp_size × tp_size`` ranks (followers on threads) and its followers; ``args``: engine
    arguments over BASE."""
    if pp_size * tp_size == 1:
        return cls(path, dict(BASE, **args), backend="shm"), []
    return pd_worker_ranks(cls, path, dict(BASE, pp_size=pp_size, tp_size=tp_size, **args))


def shutdown_followers(*followers):
    for follower in followers:
        follower.shutdown()


@pytest.mark.parametrize("family, prefill_layout, decode_layout", [
    ("llama", (2, 1), (1, 1)), ("llama", (1, 1), (2, 1)), ("llama", (2, 1), (1, 2)),
    ("deepseek_v3", (2, 2), (1, 1)), ("deepseek_v3", (1, 2), (3, 1))],
    ids=["prefill_pp2-decode_pp1", "prefill_pp1-decode_pp2", "prefill_pp2-decode_tp2", "mla-prefill_pp2xtp2-decode_pp1",
         "mla-prefill_tp2-decode_pp3"])
def test_tokens_of_different_pp_layouts_equal_the_single_engines(request, monkeypatch, family, prefill_layout,
                                                                 decode_layout):
    """Prompts of several chunks, then a second batch hitting both sides' caches (the decode side
    takes only the rows past its own prefix): each stage's ranks push (or take) their layers, and
    the tokens are HF's; every rank's tables and pools check out afterwards. MLA's latent, whole on
    every TP rank, goes to a decode rank from one TP rank of each prefill stage, picked by its TP
    rank within the stage (RankHost's agents), not its global rank."""
    path = request.getfixturevalue(family)
    thread_ranks(monkeypatch)
    prefill, prefill_followers = start(PrefillWorker, path, *prefill_layout)
    decode, decode_followers = start(DecodeWorker, path, *decode_layout)
    try:
        shared = prompts(1, 20, 20, seed=5)[0]
        first, second = prompts(2, 5, 30, seed=6, shared=shared), prompts(2, 5, 30, seed=7, shared=shared)
        outs = run_batch(prefill, decode, first, GREEDY) + run_batch(prefill, decode, second, GREEDY)
        assert max(notice["cached_tokens"] for _, notice, _ in outs[2:]) >= 16
        assert prefill.scheduler.bytes_pushed > 0
        assert_greedy_parity(path, first + second, [final["output_ids"] for final, _, _ in outs],
                             GREEDY["max_new_tokens"])
        close_workers(prefill, decode)  # (every follower's index tables too)
    finally:
        shutdown_followers(*prefill_followers, *decode_followers)


@pytest.mark.parametrize("family, page_size", [("gemma3", 4), ("qwen3_next", 1)])
def test_sliding_window_and_mamba_models_from_prefill_pp2_to_decode_pp1(tmp_path, monkeypatch, family, page_size):
    """The layouts name the sliding-window KV and the Mamba states by global layer, as the full-attention KV
    (hand-off version 6): prefill stage 0 pushes layers 0 and 1 (Gemma 3's SWA layers, Qwen3-Next's Mamba
    states), stage 1 layers 2 and 3 (one of each kind), onto the decode rank's pools of all four; prompts of
    several chunks, then prefix hits on both sides: HF's tokens, every rank's pools checked."""
    path = str(build_tiny_checkpoint(family, tmp_path / family, seed=0))
    thread_ranks(monkeypatch)
    prefill, followers = start(PrefillWorker, path, 2, page_size=page_size)
    decode, _ = start(DecodeWorker, path, page_size=page_size)
    try:
        shared = prompts(1, 20, 20, seed=5)[0]
        first, second = prompts(2, 5, 30, seed=6, shared=shared), prompts(2, 5, 30, seed=7, shared=shared)
        outs = run_batch(prefill, decode, first, GREEDY) + run_batch(prefill, decode, second, GREEDY)
        assert max(notice["cached_tokens"] for _, notice, _ in outs[2:]) >= 16
        assert_greedy_parity(path, first + second, [final["output_ids"] for final, _, _ in outs],
                             GREEDY["max_new_tokens"])
        for follower in followers:
            follower.host.runner.token_to_kv_pool.check_integrity()
        close_workers(prefill, decode)
    finally:
        shutdown_followers(*followers)


def test_a_stage_that_pushes_nothing_fails_the_request(llama, monkeypatch):
    """Prefill PP 2 → decode PP 1 with the second stage's ranks serving no decode rank (as a layout
    whose layers do not fit would): every rank reports its push done, but the layers of stage 1
    were never written on the decode rank, so the request fails by name, on both sides, instead of
    decoding from garbage KV (a push backend's bytes land unseen: the notice is all it goes by)."""
    from actors import kv_push

    thread_ranks(monkeypatch)
    serves = kv_push.serves
    monkeypatch.setattr(kv_push, "serves", lambda handoff, agent: 0 in agent.layout.layers() and serves(handoff, agent))
    prefill, followers = start(PrefillWorker, llama, 2)
    decode, _ = start(DecodeWorker, llama)
    try:
        with pytest.raises(PDRequestError, match=r"KV push left 2 buffers of decode rank 0 .* k\.1, v\.1"):
            asyncio.run(run_pd(prefill, decode, prompts(1, 10, 10, seed=8)[0], GREEDY))
        assert wait_idle(decode)
        close_workers(prefill, decode)
    finally:
        shutdown_followers(*followers)


def test_the_write_check_parses_no_hand_off(llama, monkeypatch):
    """Prefill PP 2 → decode PP 2: the write check once every rank pushed reads what it needs off the
    hand-offs as prefill() parsed them, once per decode rank; it parsed each again under ``_push_lock``
    (ms per decode rank at long prompts, holding up every rank's push reports). Each prefill rank's
    pusher parses each once, as it opens its senders."""
    thread_ranks(monkeypatch)
    prefill, prefill_followers = start(PrefillWorker, llama, 2)
    decode, decode_followers = start(DecodeWorker, llama, 2)
    parse, calls = KVHandoff.from_bytes, []  # (the caller's module, whether it holds _push_lock), from any thread

    def counted(cls, data):
        calls.append((sys._getframe(1).f_globals["__name__"], prefill.scheduler._push_lock._is_owned()))
        return parse(data)

    monkeypatch.setattr(KVHandoff, "from_bytes", classmethod(counted))
    try:
        final, _, handoffs = asyncio.run(run_pd(prefill, decode, prompts(1, 10, 10, seed=8)[0], GREEDY))
        assert len(final["output_ids"]) == GREEDY["max_new_tokens"] and len(handoffs) == 2
        callers = collections.Counter(name for name, _ in calls if not name.startswith("tests."))
        assert callers == {"actors.workers": 2, "actors.kv_push": 4}
        assert not any(locked for _, locked in calls)
        close_workers(prefill, decode)
    finally:
        shutdown_followers(*prefill_followers, *decode_followers)


def test_a_decode_worker_of_another_depth_is_refused_by_name(llama, tmp_path):
    deeper = str(build_tiny_checkpoint("llama", tmp_path / "deeper", seed=0, num_hidden_layers=3))
    prefill, _ = start(PrefillWorker, llama)
    decode, _ = start(DecodeWorker, deeper)
    with pytest.raises(LayoutMismatchError, match="num_layers differs: prefill 2, decode 3"):
        asyncio.run(run_pd(prefill, decode, [5, 6, 7, 8], GREEDY))
    assert wait_idle(decode)
    close_workers(prefill, decode)
