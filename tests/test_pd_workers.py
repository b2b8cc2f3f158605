"""Prefill and decode workers in one process (no Ray), KV moving through shared
memory: greedy tokens equal HF transformers' for the dense, hybrid (Mamba),
MLA and sliding-window (Gemma 3, GPT-OSS) families; prefix hits on either side (a hybrid
model's decode side reuses its attention KV, the state moves whole); chunked
prefill; decode retraction; layout mismatch, timeouts and aborts free everything."""

import asyncio
import random
import threading
import time

import pytest
import torch

from actors.engine.engine_loop import _run_posts
from actors.engine.tiny import build_tiny_checkpoint, tiny_config
from actors.pd_scheduler import PDRequestError
from actors.kv_push import KVPusher, PushChunk, PushResult
from actors.workers import DecodeWorker, PrefillWorker
from mem_cache.radix_key import RadixKey
from tests.hicache_helpers import break_loads, scramble, watch_requeues
from tests.parity import assert_greedy_parity
from tests.pd_helpers import close_workers as close
from tests.pd_helpers import (decode_together, make_pair, pause_once, prompts, run_batch, run_pd, slow_push, until,
                              wait_idle)
from transfer.base import KVHandoff, LayoutMismatchError

GREEDY = {"max_new_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-models")
    families = ("llama", "qwen3_next", "deepseek_v3", "gemma3", "gpt_oss")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in families}


def test_torch_dist_forced_nccl_on_a_cpu_worker_fails_at_creation(checkpoints):
    """Agent options reach the worker's agents: NCCL demanded of CPU pools is refused at once, not at a push."""
    with pytest.raises(ValueError, match="data_transport='nccl' needs NCCL between CUDA pools: the pools are on cpu"):
        PrefillWorker(checkpoints["llama"], dict(max_total_tokens=256, skip_tokenizer_init=True), backend="torch_dist",
                      agent_options={"torch_dist": {"data_transport": "nccl"}})


@pytest.mark.parametrize(
    "family,page_size",
    [("llama", 1), ("llama", 16), ("qwen3_next", 1), ("deepseek_v3", 4), ("gemma3", 4), ("gpt_oss", 4)],
)
def test_greedy_tokens_equal_hf_through_pd(checkpoints, family, page_size):
    path = checkpoints[family]
    prefill, decode = make_pair(path, page_size)
    batch = prompts(4, 3, 40, seed=1)
    results = run_batch(prefill, decode, batch, GREEDY)
    outputs = [r[0]["output_ids"] for r in results]
    assert_greedy_parity(path, batch, outputs, 8, decode.eos_token_ids)
    assert prefill.scheduler.bytes_pushed > 0
    close(prefill, decode)


def test_seeded_sampling_through_pd_equals_a_single_engine(checkpoints):
    """The decode side's generator continues from the prefill's first draw."""
    from actors.engine import Engine

    path = checkpoints["llama"]
    params = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    ids = prompts(1, 20, 20, seed=13)[0]
    prefill, decode = make_pair(path)
    (final, _, _), = run_batch(prefill, decode, [ids], params)
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True)
    try:
        expected = engine.generate(input_ids=ids, sampling_params=params)["output_ids"]
    finally:
        engine.shutdown()
    assert final["output_ids"] == expected
    close(prefill, decode)


def test_prompt_logprobs_through_pd_equal_a_single_engine(checkpoints):
    """The prefill worker scores the prompt (chunk by chunk) and sends its logprobs and ranks with the
    notice: the decode side's result carries them as a single engine's does. With ``max_new_tokens``
    0 (a prompt scored only) no decode worker takes part: the prefill worker ends the request itself
    (``prefill_only``), pushes nothing and caches the prompt, so a later request hits it there — not
    before the positions it scores. The decode worker stays as it was: no reservation, no KV, no
    event; and neither worker takes such a request the PD way."""
    from actors.engine import Engine

    path = checkpoints["llama"]
    ids = prompts(1, 40, 40, seed=17)[0]
    cases = [{"max_new_tokens": n, "temperature": 0, "return_logprob": True, "logprob_start_len": start,
              "top_logprobs_num": top} for n, start, top in ((0, 0, 2), (0, 25, 1), (3, 10, 0))]
    cases.append({"max_new_tokens": 0})  # scored for nothing: the whole prompt is a cache hit
    prefill, decode = make_pair(path, page_size=4, prefill_args={"chunked_prefill_size": 16})
    decode_before = (decode.load(), decode.scheduler.tree_cache.events.next_id)

    def run(params):
        if params["max_new_tokens"]:
            return run_batch(prefill, decode, [ids], params)[0][0]
        assert wait_idle(prefill)  # (an earlier request's push counted: its notice can come first)
        pushed = prefill.scheduler.bytes_pushed
        out = asyncio.run(prefill.prefill_only(f"scored-{len(got)}", ids, params))
        assert prefill.scheduler.bytes_pushed == pushed and not prefill.scheduler.inflight
        prefill.check_integrity()  # (ended and cached: nothing held)
        return out

    got = []
    for params in cases[:2]:
        got.append(run(params))
    assert (decode.load(), decode.scheduler.tree_cache.events.next_id) == decode_before
    for params in cases[2:]:
        got.append(run(params))
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True, page_size=4)
    try:
        want = [engine.generate(input_ids=ids, sampling_params=params) for params in cases]
    finally:
        engine.shutdown()
    for g, w in zip(got[:3], want):
        assert g["output_ids"] == w["output_ids"]
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t in g["meta_info"][key]] == [t for _, t in w["meta_info"][key]]
            assert [v for v, _ in g["meta_info"][key]] == pytest.approx([v for v, _ in w["meta_info"][key]], abs=1e-4)
        assert g["meta_info"]["input_token_ranks"] == w["meta_info"]["input_token_ranks"]
        for gt, wt in zip(g["meta_info"]["input_top_logprobs"], w["meta_info"]["input_top_logprobs"]):
            assert (gt is None) == (wt is None) and [t for t, _ in gt or []] == [t for t, _ in wt or []]
    scored = [0, 1, 3]  # (the PD request's result has the decode side's own hit, as ever)
    assert [got[i]["meta_info"]["cached_tokens"] for i in scored] == [want[i]["meta_info"]["cached_tokens"]
                                                                     for i in scored] == [0, 24, 36]
    assert got[0]["output_ids"] == [] and got[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

    async def refused():
        with pytest.raises(ValueError, match="runs on the prefill worker alone"):
            await decode.reserve("pd", ids, cases[0])
        with pytest.raises(ValueError, match="has no decode side"):
            await prefill.prefill("pd", ids, cases[0], [])
        with pytest.raises(ValueError, match="max_new_tokens 0 only"):
            await prefill.prefill_only("pd", ids, cases[2])

    asyncio.run(refused())
    close(prefill, decode)


SCORED = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}


def test_aborting_a_prompt_scored_only_between_its_chunks_frees_everything(checkpoints):
    """Aborted by its room while its prompt is half prefilled, a prompt scored only ends with the
    abort, leaving nothing held; the id may come again (another room) and is served, cached."""
    prefill = PrefillWorker(checkpoints["llama"], dict(max_total_tokens=512, page_size=4, chunked_prefill_size=16,
                                                        skip_tokenizer_init=True))
    ids = prompts(1, 40, 40, seed=18)[0]
    paused = pause_once(prefill, lambda: prefill.scheduler.chunked_req is not None)

    async def go():
        task = asyncio.ensure_future(prefill.prefill_only("s", ids, SCORED, 7))
        await until(paused.is_set, what="the first chunk prefilled")
        assert await prefill.abort("s", room=7)
        prefill.loop.resume()
        with pytest.raises(PDRequestError, match="aborted"):
            await task
        await until(lambda: not prefill.loop.run_exclusive(prefill.scheduler.has_work), what="the abort released")
        prefill.check_integrity()
        return await prefill.prefill_only("s", ids, SCORED, 8)

    again = asyncio.run(go())
    assert len(again["meta_info"]["input_token_logprobs"]) == len(ids)
    assert again["meta_info"]["cached_tokens"] == 0  # (scored from position 0: nothing before it reused)
    close(prefill)


def test_a_prompt_scored_only_on_a_tp2_prefill_worker(checkpoints, monkeypatch):
    """Rank 0 returns the result of a prompt scored only on a TP 2 prefill worker: its logprobs
    equal HF's, and every rank's tables stay in step (nothing pushed). (TP ranks as threads.)"""
    from tests.parity import assert_input_logprobs_close
    from tests.tp_helpers import pd_worker_tp2, thread_ranks

    path = checkpoints["llama"]
    thread_ranks(monkeypatch)
    prefill, follower = pd_worker_tp2(PrefillWorker, path, dict(max_total_tokens=512, page_size=4,
                                                                chunked_prefill_size=16, skip_tokenizer_init=True))
    ids = prompts(1, 40, 40, seed=19)[0]
    try:
        out = asyncio.run(prefill.prefill_only("tp", ids, {**SCORED, "top_logprobs_num": 2}))
        assert_input_logprobs_close(path, ids, out["meta_info"], 0, top_logprobs_num=2)
        assert prefill.scheduler.bytes_pushed == 0
        close(prefill)  # (the follower's index tables too)
    finally:
        follower.shutdown()


def test_logit_bias_and_min_new_tokens_hold_on_both_sides(checkpoints):
    """The first token is the prefill worker's, the rest the decode worker's: both apply the bias,
    and ``min_new_tokens`` counts the tokens of both (the stop token, biased to win every step, is
    masked for the first three — one prefill's, two decode's — and ends the fourth)."""
    prefill, decode = make_pair(checkpoints["llama"])
    forced = {"max_new_tokens": 4, "temperature": 0, "logit_bias": {"40": 100}}
    held = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [50], "min_new_tokens": 3,
            "logit_bias": {"50": 100}}

    async def go():
        return await asyncio.gather(*(run_pd(prefill, decode, [5, 6, 7], params) for params in (forced, held)))

    (forced_out, forced_notice, _), (held_out, held_notice, _) = asyncio.run(go())
    assert forced_notice["first_token"] == 40 and forced_out["output_ids"] == [40] * 4
    assert held_notice["first_token"] != 50
    assert len(held_out["output_ids"]) == 4 and 50 not in held_out["output_ids"][:3], held_out["output_ids"]
    assert held_out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 50}
    close(prefill, decode)


def test_prefix_hits_on_both_sides(checkpoints):
    """A repeated long prefix is prefilled once (prefill cache) and its KV sent once
    (the decode worker's own tree covers it the second time)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, page_size=4)
    system = prompts(1, 48, 48, seed=7)[0]
    first = prompts(1, 5, 5, seed=2, shared=system)
    run_batch(prefill, decode, first, GREEDY)
    pushed_before = prefill.scheduler.bytes_pushed
    second = prompts(2, 4, 9, seed=3, shared=system)
    results = run_batch(prefill, decode, second, GREEDY)
    for final, notice, handoffs in results:
        assert notice["cached_tokens"] >= 48  # prefill side
        dst_prefix = KVHandoff.from_bytes(handoffs[0]).dst_prefix_len
        assert dst_prefix >= 48  # decode side: only the tail moved
        assert final["meta_info"]["cached_tokens"] == dst_prefix
    per_token = pushed_before / len(first[0])
    assert prefill.scheduler.bytes_pushed - pushed_before <= per_token * sum(len(p) - 48 for p in second)
    assert_greedy_parity(path, second, [r[0]["output_ids"] for r in results], 8, decode.eos_token_ids)
    close(prefill, decode)


# ---- sliding-window layers (Gemma 3, GPT-OSS): only the window moves -------------------------------
WINDOW = 16  # the tiny Gemma 3's sliding window
PAST_WINDOW = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def row_bytes(worker):
    """Bytes one token's KV takes in the full-attention and in the sliding-window layers,
    and one Mamba state slot takes in every Mamba layer."""
    agent = next(iter(worker.agents.values()))
    per_index = {"token": 0, "swa": 0, "state": 0}
    for b in agent.layout.buffers:
        t = agent.buffers[b.name]
        per_index[b.index] += t[0].numel() * t.element_size()
    return per_index["token"], per_index["swa"], per_index["state"]


def expected_push_bytes(worker, prompt_len, dst_prefix_len, window=WINDOW):
    """``[dst_prefix_len, prompt_len)`` of the full layers; of the SWA layers only what of it is in the window."""
    full, swa, _ = row_bytes(worker)
    return (prompt_len - dst_prefix_len) * full + min(window, prompt_len - dst_prefix_len) * swa


@pytest.mark.parametrize("family,backend", [("gemma3", "shm"), ("gemma3", "torch_dist"), ("gpt_oss", "shm")])
def test_sliding_window_models_through_pd_equal_a_single_engine_past_the_window(checkpoints, family, backend):
    """Prompts longer than the window (prefilled in chunks) and generations past it: the tokens
    equal a single engine's and HF's, and per request exactly the window's SWA KV moved (GPT-OSS:
    its window is 8)."""
    from actors.engine import Engine

    path = checkpoints[family]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": 8}, backend=backend)
    batch = prompts(3, 20, 40, seed=21) + prompts(1, 5, 5, seed=22)  # and one shorter than the window
    results = run_batch(prefill, decode, batch, PAST_WINDOW)
    outputs = [r[0]["output_ids"] for r in results]
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True)
    try:
        assert outputs == [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=PAST_WINDOW)]
    finally:
        engine.shutdown()
    assert_greedy_parity(path, batch, outputs, 24)
    window = tiny_config(family).sliding_window
    assert [r[1]["transfer_bytes"] for r in results] == [expected_push_bytes(prefill, len(p), 0, window) for p in batch]
    close(prefill, decode)


def test_gemma3_prefix_hits_on_both_sides(checkpoints):
    """Follow-up turns (the first request's prompt and answer, then new tokens): the prefill
    side matches what it prefilled; the decode side, whose tree kept the answer's last window,
    matches prompt + answer, so only the new tail moves, full and SWA layers alike. The first
    prompt plus a short tail: the window reaches into the prefill side's cached prefix, while
    on the decode side that prefix slid out of the window and nothing matches."""
    path = checkpoints["gemma3"]
    prefill, decode = make_pair(path)
    first = prompts(1, 40, 40, seed=23)[0]
    (final, _, _), = run_batch(prefill, decode, [first], PAST_WINDOW)
    turn = first + final["output_ids"][:-1]  # the answer's tokens that have KV
    cases = [  # (prompt, prefill hit, decode hit), one after the other
        (turn + prompts(1, 5, 5, seed=24)[0], len(first), len(turn)),
        (first + prompts(1, 5, 5, seed=26)[0], len(first), 0),
        (turn + prompts(1, 20, 20, seed=25)[0], len(turn), len(turn)),  # the prefill side cached turn 1
    ]
    outputs = []
    for prompt, prefill_hit, decode_hit in cases:
        (final, notice, handoffs), = run_batch(prefill, decode, [prompt], PAST_WINDOW)
        assert notice["cached_tokens"] == prefill_hit
        handoff = KVHandoff.from_bytes(handoffs[0])
        assert handoff.dst_prefix_len == decode_hit == final["meta_info"]["cached_tokens"]
        assert len(handoff.dst_swa_slots) == min(WINDOW, len(prompt) - decode_hit)
        assert notice["transfer_bytes"] == expected_push_bytes(prefill, len(prompt), decode_hit)
        outputs.append(final["output_ids"])
    assert_greedy_parity(path, [c[0] for c in cases], outputs, 24)
    close(prefill, decode)


def test_gemma3_reservation_holds_the_window_only_and_aborts_free_both_pools(checkpoints):
    """A reservation takes full slots for the prompt but keeps SWA slots for its last window
    only, and names exactly those in the hand-off; a safe abort frees both pools at once, an
    unconfirmed one after its quarantine."""
    path = checkpoints["gemma3"]
    prefill, decode = make_pair(path, waiting_timeout_s=0.3)
    alloc = decode.runner.allocator
    ids = prompts(2, 40, 40, seed=26)

    def free():
        return decode.loop.run_exclusive(lambda: (alloc.full_available_size(), alloc.swa_available_size()))

    async def go():
        full, swa = free()
        handoff = KVHandoff.from_bytes((await decode.reserve("a", ids[0], GREEDY))[0])
        assert free() == (full - 40, swa - WINDOW)
        mapping = alloc.full_to_swa_index_mapping
        dst = torch.tensor(handoff.dst_slots)
        assert mapping[dst[-WINDOW:]].tolist() == handoff.dst_swa_slots and not mapping[dst[:-WINDOW]].any()
        assert await decode.abort("a", safe=True)
        assert free() == (full, swa)
        await decode.reserve("b", ids[1], GREEDY)
        assert await decode.abort("b")  # at once (its 0.3 s timeout would drop it): quarantined until its deadline
        assert free() == (full - 40, swa - WINDOW)
        for _ in range(300):
            if free() == (full, swa):
                break
            await asyncio.sleep(0.01)
        assert free() == (full, swa)

    asyncio.run(go())
    close(prefill, decode)


def test_gemma3_prompt_longer_than_the_decode_swa_pool(checkpoints):
    """The decode side's SWA pool (128 slots) is smaller than the prompts (150-200 tokens): the
    reservation takes SWA slots for the last window only, so they are served (they were
    refused), with a single engine's tokens; the decode tree's cached SWA KV is not evicted
    for tokens outside the window."""
    from actors.engine import Engine

    path = checkpoints["gemma3"]
    prefill, decode = make_pair(path, decode_args={"max_total_tokens": 512, "swa_full_tokens_ratio": 0.25,
                                                   "chunked_prefill_size": 32})
    alloc = decode.runner.allocator
    assert alloc.size_swa == 128 and decode.scheduler.context_len == 511
    warm = prompts(1, 30, 30, seed=27)
    run_batch(prefill, decode, warm, GREEDY)
    cached_swa = decode.loop.run_exclusive(decode.scheduler.tree_cache.swa_evictable_size)
    assert cached_swa > 0
    batch = prompts(2, 150, 200, seed=28)
    outputs = [r[0]["output_ids"] for r in run_batch(prefill, decode, batch, PAST_WINDOW)]
    assert decode.loop.run_exclusive(decode.scheduler.tree_cache.swa_evictable_size) >= cached_swa
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True)
    try:
        assert outputs == [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=PAST_WINDOW)]
    finally:
        engine.shutdown()
    close(prefill, decode)


def test_gemma3_paged_decode_reservations_fit_in_whole_pages(checkpoints):
    """Page size 32, the 16-token window: a decoding request holds a window of 32 SWA slots
    and its newest token's page, 64 in all. The reservations are counted so (the prompt's
    window in pages, the decode reserve up to a window's pages): of 6 requests, those that fit
    are taken and decode past the page boundary without a retraction, with HF's tokens."""
    path = checkpoints["gemma3"]
    prefill, decode = make_pair(path, page_size=32, decode_args={"max_total_tokens": 1024,
                                                                 "swa_full_tokens_ratio": 0.25})
    assert decode.runner.allocator.size_swa == 256
    batch = prompts(6, 5, 13, seed=29)
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    outputs = [r[0]["output_ids"] for r in run_batch(prefill, decode, batch, params)]
    assert_greedy_parity(path, batch, outputs, 32)
    assert decode.scheduler.num_retractions == 0
    close(prefill, decode)


def test_decode_reservations_count_each_requests_reserve_in_its_own_pages(checkpoints):
    """Pages of 16, a 256-slot decode pool, the ratio 1: twelve 10-token prompts reserving 10
    new tokens each, whose KV ends in their second page. Counted as tokens, the reserves of
    those reserved (and then of those decoding) left room for nine — eighteen pages — and the
    decode retracted; counted in each request's pages, those that fit decode to the end."""
    path = checkpoints["llama"]
    decode_args = {"max_total_tokens": 256, "init_new_token_ratio": 1.0, "min_new_token_ratio": 1.0}
    prefill, decode = make_pair(path, page_size=16, decode_args=decode_args, num_reserved_decode_tokens=10)
    batch = prompts(12, 10, 10, seed=30)
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    results = run_batch(prefill, decode, batch, params)
    assert all(len(r[0]["output_ids"]) == 10 for r in results)
    assert decode.scheduler.num_retractions == 0
    close(prefill, decode)


def test_a_window_without_swa_kv_is_not_pushed(checkpoints):
    """SWA slot 0 is the padding row: a source window with a gap fails the push, never sends it."""
    path = checkpoints["gemma3"]
    prefill, decode = make_pair(path)

    async def go():
        handoffs = await decode.reserve("gap", prompts(1, 20, 20)[0], GREEDY)
        pusher = KVPusher(prefill.agents, asynchronous=False)
        pusher.submit([PushChunk("gap", 0, list(range(1, 21)), True, None, [0] + list(range(1, WINDOW)), handoffs)])
        (result,) = pusher.take_finished()
        assert result.moved == 0 and "asks for the SWA KV of 16 tokens; this rank has it for 15" in result.error
        assert await decode.abort("gap", safe=True)

    asyncio.run(go())
    close(prefill, decode)


def test_chunked_prefill_then_transfer(checkpoints):
    path = checkpoints["qwen3_next"]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": 16})
    batch = prompts(2, 40, 60, seed=4)
    results = run_batch(prefill, decode, batch, GREEDY)
    assert_greedy_parity(path, batch, [r[0]["output_ids"] for r in results], 8, decode.eos_token_ids)
    close(prefill, decode)


# ---- hybrid (Mamba): the decode side reuses its attention KV, the state comes whole --------------
def _first_turn(prefill, decode, seed, answer_len=8):
    """A 40-token prompt and its answer; returns (prompt, answer)."""
    first = prompts(1, 40, 40, seed=seed)[0]
    (final, _, _), = run_batch(prefill, decode, [first], PAST_WINDOW | {"max_new_tokens": answer_len})
    return first, final["output_ids"]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_side_host_cache_reloads_an_evicted_prefix_and_pushes_it(checkpoints, family):
    """A prefill worker with the hierarchical cache (as SGLang's PD prefill servers often
    run): a system prompt pushed out of its small device pool comes back from host memory,
    is pushed from the reloaded slots, and the tokens still equal HF's (a sliding-window
    model's too: its window's SWA KV comes back with the full KV, and is what is pushed)."""
    path = checkpoints[family]
    prefill, decode = make_pair(path, page_size=4, prefill_args={
        "max_total_tokens": 256, "enable_hierarchical_cache": True, "hicache_ratio": 4.0})
    rng = random.Random(5)
    system = [rng.randrange(5, 250) for _ in range(96)]
    others = prompts(3, 120, 120, seed=91)
    follow = system + [rng.randrange(5, 250) for _ in range(5)]

    async def go():
        await run_pd(prefill, decode, system + [7, 8, 9, 10], GREEDY)
        for ids in others:  # the 256-slot device pool cannot keep the system prompt meanwhile
            await run_pd(prefill, decode, ids, GREEDY)
        match = prefill.loop.run_exclusive(lambda: prefill.scheduler.tree_cache.match_prefix(RadixKey(system)))
        assert len(match.device_indices) < 96 and match.host_hit_length > 0
        return await run_pd(prefill, decode, follow, GREEDY)

    before = prefill.load()["hicache"]
    final, notice, _ = asyncio.run(go())
    assert notice["cached_tokens"] >= 96
    assert_greedy_parity(path, [follow], [final["output_ids"]], 8, decode.eos_token_ids)
    stats = prefill.load()["hicache"]  # (for /metrics: raydix_worker_hicache_tokens and host usage)
    assert before["host_to_device_tokens"] == 0 and stats["host_to_device_tokens"] >= 96
    assert stats["device_to_host_tokens"] >= stats["host_to_device_tokens"] and 0 < stats["host_usage"] <= 1
    if family == "gemma3":  # its SWA host pool apart (a load brings the SWA KV of a window only)
        assert 0 < stats["swa_host_to_device_tokens"] <= stats["host_to_device_tokens"] and 0 < stats["swa_host_usage"] <= 1
        assert stats["swa_device_to_host_tokens"] >= stats["swa_host_to_device_tokens"]
    assert "hicache" not in decode.load()
    close(prefill, decode)


def test_a_failed_host_load_on_the_prefill_side_requeues_the_request_and_pushes_its_recompute(checkpoints):
    """A prefill worker's load of a system prompt back from host memory fails, and so does
    the copy again, while the forward reading it runs: the request is requeued (its slots
    freed, the lost ones off the device), recomputed without the host tier and then pushed
    (the decode side holds none of the prompt); its notice reports no cached tokens, the
    tokens equal HF's and nothing leaks on either side."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, page_size=4, prefill_args={
        "max_total_tokens": 256, "enable_hierarchical_cache": True, "hicache_ratio": 4.0})
    rng, tree = random.Random(7), prefill.scheduler.tree_cache
    system = [rng.randrange(5, 250) for _ in range(96)]
    follow = system + [rng.randrange(5, 250) for _ in range(5)]

    async def go():
        await run_pd(prefill, decode, system + [7, 8, 9, 10], GREEDY)
        await until(lambda: not prefill.loop.run_exclusive(prefill.scheduler.has_work), what="the prompt cached")
        prefill.loop.run_exclusive(lambda: tree.evict(256))
        decode.flush_cache()  # the whole prompt moves
        scramble(tree.cache_controller.device_pool)  # what a slot holds if no copy lands in it
        restore = break_loads(tree.cache_controller)
        try:
            return await run_pd(prefill, decode, follow, GREEDY)
        finally:
            restore()

    requeues = watch_requeues(prefill, system)
    final, notice, handoffs = asyncio.run(go())
    assert requeues == [([follow], [follow], 0)] and notice["cached_tokens"] == 0
    assert KVHandoff.from_bytes(handoffs[0]).dst_prefix_len == 0
    assert_greedy_parity(path, [follow], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_chunked_request_requeued_for_a_failed_host_load_had_pushed_nothing(checkpoints):
    """Chunked prefill (32 tokens) beside a failing host load. A request can only be requeued
    at its first chunk's forward, before any of it is pushed: a load fills slots allocated at
    this step's admission, for new requests, and ends (failed or not) right after the forward
    (``Scheduler._forward``), before the step's pushes are queued; a continuing chunk reads
    only slots it held through the step before. So a request whose chunk was pushed before
    the failure (``early``, its second and last chunk in the failing batch) is not requeued,
    and the one requeued (a 136-token prompt whose first chunk reads the failed 96-token
    prefix) is recomputed and pushed from token 0, chunk by chunk. Both equal HF's tokens;
    nothing leaks on either side."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, page_size=4, prefill_args={
        "max_total_tokens": 256, "enable_hierarchical_cache": True, "hicache_ratio": 4.0, "chunked_prefill_size": 32})
    rng, sched = random.Random(8), prefill.scheduler
    system = [rng.randrange(5, 250) for _ in range(96)]
    early, follow = prompts(1, 48, 48, seed=81)[0], system + [rng.randrange(5, 250) for _ in range(40)]
    pushed, requeued = [], []  # (prompt length, start, rows) of every chunk; what each requeued request had pushed
    submit, requeue = sched.pusher.submit, sched._requeue
    sched.pusher.submit = lambda chunks: (pushed.extend(
        (len(sched._pushing[c.push_id].origin_input_ids), c.start, len(c.src_slots)) for c in chunks), submit(chunks))
    sched._requeue = lambda req: (requeued.append(getattr(req, "pd_sent_upto", 0)), requeue(req))

    async def go():
        await run_pd(prefill, decode, system + [7, 8, 9, 10], GREEDY)
        await until(lambda: not prefill.loop.run_exclusive(sched.has_work), what="the prompt cached")
        prefill.loop.run_exclusive(lambda: sched.tree_cache.evict(256))
        decode.flush_cache()  # the whole prompt moves
        scramble(sched.tree_cache.cache_controller.device_pool)  # what a slot holds if no copy lands in it
        pushed.clear()
        restore = break_loads(sched.tree_cache.cache_controller)
        prefill.loop.pause()  # both queued before the loop steps: early's first chunk, then it and follow
        try:
            runs = [asyncio.ensure_future(run_pd(prefill, decode, early, GREEDY))]
            await until(lambda: len(sched.waiting) == 1, what="early queued")
            runs.append(asyncio.ensure_future(run_pd(prefill, decode, follow, GREEDY)))
            await until(lambda: len(sched.waiting) == 2, what="follow queued")
        finally:
            prefill.loop.resume()
        try:
            return await asyncio.gather(*runs)
        finally:
            restore()

    requeues = watch_requeues(prefill, system)
    results = asyncio.run(go())
    assert requeues == [([early, follow], [follow], 0)] and requeued == [0]
    assert [c for c in pushed if c[0] == len(early)] == [(48, 0, 32), (48, 32, 16)]  # the first before the failure
    assert [c for c in pushed if c[0] == len(follow)] == [(136, s, min(32, 136 - s)) for s in range(0, 136, 32)]
    assert results[1][1]["cached_tokens"] == 0
    assert_greedy_parity(path, [early, follow], [r[0]["output_ids"] for r in results], 8, decode.eos_token_ids)
    close(prefill, decode)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_side_host_cache_reloads_a_conversation_so_only_the_new_turn_moves(checkpoints, family):
    """A decode worker with the hierarchical cache: the earlier turn it cached was pushed
    out of its small device pool to host memory; the follow-up's reservation loads it back
    and asks the prefill side only for the rows past it (before, a host hit was ignored and
    the whole prompt moved again). A sliding-window model's reservation moves its lock from
    the device prefix to the loaded one (the old lock's SWA window given back)."""
    path = checkpoints[family]
    hicache = {"max_total_tokens": 256, "enable_hierarchical_cache": True, "hicache_ratio": 4.0}
    prefill, decode = make_pair(path, page_size=4, prefill_args={"max_total_tokens": 1024}, decode_args=hicache)
    rng = random.Random(6)
    first = [rng.randrange(5, 250) for _ in range(96)]

    async def go():
        final, _, _ = await run_pd(prefill, decode, first, GREEDY)
        turn = first + final["output_ids"] + [rng.randrange(5, 250) for _ in range(5)]
        prefill.flush_cache()  # the prefill side computes it all
        for ids in prompts(3, 120, 120, seed=92):  # the 256-slot decode pool cannot keep the first turn
            await run_pd(prefill, decode, ids, GREEDY)
        # (the turn's, not the first prompt's: a sliding-window model's ends with its window's SWA KV, which
        # the first answer's decode slid past the first prompt)
        match = decode.loop.run_exclusive(lambda: decode.scheduler.tree_cache.match_prefix(RadixKey(turn)))
        assert len(match.device_indices) < 96 and match.host_hit_length > 0
        return turn, await run_pd(prefill, decode, turn, GREEDY)

    turn, (final, notice, handoffs) = asyncio.run(go())
    (handoff,) = [KVHandoff.from_bytes(h) for h in handoffs]
    assert handoff.dst_prefix_len >= 96 and len(handoff.dst_slots) == len(turn) - handoff.dst_prefix_len
    assert final["meta_info"]["cached_tokens"] >= 96
    assert_greedy_parity(path, [turn], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


@pytest.mark.parametrize("times", [1, None])
def test_a_failed_host_load_on_the_decode_side_costs_the_host_part_not_the_step(checkpoints, times):
    """The decode worker's reservation loads the earlier turn back from host memory and the
    copy fails — once (the copy again lands) or every time (its slots hold no KV). The step
    goes on (it raised, failing every request of the worker): the reservation keeps what
    landed, or matches the prefix on the device only and asks the prefill side for the rest;
    the tokens equal HF's and nothing leaks."""
    path = checkpoints["llama"]
    hicache = {"max_total_tokens": 256, "enable_hierarchical_cache": True, "hicache_ratio": 4.0}
    prefill, decode = make_pair(path, page_size=4, prefill_args={"max_total_tokens": 1024}, decode_args=hicache)
    rng, tree = random.Random(6), decode.scheduler.tree_cache
    first = [rng.randrange(5, 250) for _ in range(96)]

    async def go():
        final, _, _ = await run_pd(prefill, decode, first, GREEDY)
        turn = first + final["output_ids"] + [rng.randrange(5, 250) for _ in range(5)]
        prefill.flush_cache()  # the prefill side computes it all
        decode.loop.run_exclusive(lambda: tree.evict(256))
        held = decode.loop.run_exclusive(lambda: tree.match_prefix(RadixKey(turn)).host_hit_length)
        assert held >= 96  # (the first turn and its answer's whole pages, on the host only)
        scramble(tree.cache_controller.device_pool)  # what a slot holds if no copy lands in it
        restore = break_loads(tree.cache_controller, times)
        try:
            return turn, held, await run_pd(prefill, decode, turn, GREEDY)
        finally:
            restore()

    turn, held, (final, notice, handoffs) = asyncio.run(go())
    (handoff,) = [KVHandoff.from_bytes(h) for h in handoffs]
    assert handoff.dst_prefix_len == (held if times == 1 else 0)
    assert final["meta_info"]["cached_tokens"] == handoff.dst_prefix_len
    assert_greedy_parity(path, [turn], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


EXTRA_BUFFER = {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 64}


@pytest.mark.parametrize("page_size,args,answer_len", [(1, {}, 16), (16, EXTRA_BUFFER, 40)])
def test_qwen3_next_follow_up_turns_push_only_past_the_decode_side_prefix(checkpoints, page_size, args, answer_len):
    """Follow-up turns of a hybrid model: the decode side matches its tree for the attention
    KV only (the Mamba state still comes whole from the prefill side, into the request's own
    slot), so only the rows past its prefix move, plus the state; the match reaches past the
    deepest state its tree holds (an edited answer ends inside turn 1's node, where no state
    is). Turn 1 is cached up to its end (no_buffer) or to its last decode checkpoint, at 64
    (extra_buffer). Tokens equal a single engine's and HF's."""
    from actors.engine import Engine

    path = checkpoints["qwen3_next"]
    prefill, decode = make_pair(path, page_size, prefill_args=args, decode_args=args)
    first, answer = _first_turn(prefill, decode, seed=61, answer_len=answer_len)
    turn = first + answer[:-1]  # the answer's tokens that have KV
    cached = len(turn) if page_size == 1 else 64
    cases = [  # (prompt, decode hit), one after the other
        (turn + prompts(1, 5, 5, seed=62)[0], cached),
        (first + answer[:12] + prompts(1, 6, 6, seed=63)[0], 52 // page_size * page_size),  # no state there
        (turn + prompts(1, 7, 7, seed=64)[0], cached),  # below the split the edit made
    ]
    token, _, state = row_bytes(prefill)
    outputs = []
    for prompt, decode_hit in cases:
        (final, notice, handoffs), = run_batch(prefill, decode, [prompt], GREEDY)
        handoff = KVHandoff.from_bytes(handoffs[0])
        assert handoff.dst_prefix_len == decode_hit == final["meta_info"]["cached_tokens"]
        assert handoff.dst_state_slot is not None and len(handoff.dst_slots) == len(prompt) - decode_hit
        assert notice["transfer_bytes"] == (len(prompt) - decode_hit) * token + state
        outputs.append(final["output_ids"])
    batch = [c[0] for c in cases]
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True)
    try:
        assert outputs == [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=GREEDY)]
    finally:
        engine.shutdown()
    assert_greedy_parity(path, batch, outputs, 8, decode.eos_token_ids)
    close(prefill, decode)


def test_qwen3_next_decode_prefix_lock_outlives_eviction_and_an_abort_frees_it(checkpoints):
    """A reservation's KV-only lock ends at a tombstone (no state there): evicting the whole
    decode tree takes turn 1's leaf below it but not the locked prefix, left a tombstone
    leaf (the tree's invariants still hold); the abort drops the lock, and the tombstone
    goes with it — nothing stays held."""
    path = checkpoints["qwen3_next"]
    prefill, decode = make_pair(path)
    first, answer = _first_turn(prefill, decode, seed=65)
    edited = first + answer[:3] + prompts(1, 6, 6, seed=66)[0]
    tree = decode.scheduler.tree_cache

    def evict_all():
        tree.evict(tree.full_evictable_size())
        tree.check_integrity()
        return tree.full_evictable_size(), tree.full_protected_size(), len(tree.all_mamba_values())

    async def go():
        handoff = KVHandoff.from_bytes((await decode.reserve("edited", edited, GREEDY))[0])
        assert handoff.dst_prefix_len == len(first) + 3
        assert decode.loop.run_exclusive(evict_all) == (0, len(first) + 3, 0)
        assert await decode.abort("edited", safe=True)

    asyncio.run(go())
    for _ in range(100):
        if not decode.loop.run_exclusive(decode.scheduler.has_work):
            break
        time.sleep(0.01)
    assert decode.loop.run_exclusive(lambda: (tree.full_evictable_size(), tree.full_protected_size())) == (0, 0)
    assert decode.load()["free_slots"] == decode.load()["total_slots"]
    close(prefill, decode)


def test_qwen3_next_decode_retracts_requests_holding_a_decode_side_prefix(checkpoints):
    """Follow-ups that share a conversation's first 40 tokens hold them KV-only on the decode
    side; under KV pressure some are retracted (lock dropped, state and slots freed) and
    re-prefilled locally from the deepest cached state: tokens still equal HF's."""
    path = checkpoints["qwen3_next"]
    decode_args = {"max_total_tokens": 160, "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    prefill, decode = make_pair(path, decode_args=decode_args, num_reserved_decode_tokens=2)
    first, _ = _first_turn(prefill, decode, seed=67)
    batch = prompts(6, 5, 10, seed=68, shared=first)
    decode_together(decode, len(batch))
    results = run_batch(prefill, decode, batch, PAST_WINDOW)
    assert all(KVHandoff.from_bytes(r[2][0]).dst_prefix_len >= len(first) for r in results)
    assert decode.scheduler.num_retractions > 0
    assert_greedy_parity(path, batch, [r[0]["output_ids"] for r in results], 24)
    close(prefill, decode)


def test_qwen3_next_prefill_copy_on_write_waits_while_inflight_requests_hold_every_state(checkpoints, monkeypatch):
    """A prefill worker with two Mamba slots: A and B extend a cached prompt together. A's copy
    of its state takes the free slot and A holds it (and its lock on the source) in ``inflight``
    until its push ends, so B's copy finds no slot even after eviction: a logical OOM (it raised,
    failing both). B waits, comes in after A and reuses the prefix; tokens equal HF's."""
    from actors.engine.model_runner import ModelRunner

    real = ModelRunner._num_mamba_slots
    monkeypatch.setattr(ModelRunner, "_num_mamba_slots", lambda self, n: 2 if n == 2 else real(self, n))  # prefill's
    prefill, decode = make_pair(checkpoints["qwen3_next"], prefill_args={"max_running_requests": 2})
    monkeypatch.undo()
    first = prompts(1, 20, 20, seed=69)[0]
    run_batch(prefill, decode, [first], GREEDY)
    batch = [first + [7, 8], first + [9, 10, 11]]
    results = run_batch(prefill, decode, batch, GREEDY)
    assert all(r[0]["meta_info"]["cached_tokens"] >= 20 for r in results)
    assert_greedy_parity(checkpoints["qwen3_next"], batch, [r[0]["output_ids"] for r in results], 8)
    close(prefill, decode)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_decode_retracts_under_kv_pressure_and_recomputes(checkpoints, family):
    path = checkpoints[family]
    decode_args = {"max_total_tokens": 160, "init_new_token_ratio": 0.02, "min_new_token_ratio": 0.02}
    prefill, decode = make_pair(path, decode_args=decode_args, num_reserved_decode_tokens=2)
    batch = prompts(6, 10, 20, seed=5)
    decode_together(decode, len(batch))  # 6 prompts of 10-20 tokens and 24 new tokens each: > 160 slots
    params = {"max_new_tokens": 24, "temperature": 0}
    results = run_batch(prefill, decode, batch, params)
    assert decode.scheduler.num_retractions > 0
    assert_greedy_parity(path, batch, [r[0]["output_ids"] for r in results], 24, decode.eos_token_ids)
    close(prefill, decode)


def test_layout_mismatch_is_rejected_and_frees_both_sides(checkpoints):
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, prefill_args={"page_size": 1}, decode_args={"page_size": 4})
    with pytest.raises(LayoutMismatchError, match="page_size"):
        run_batch(prefill, decode, prompts(1, 10, 10), GREEDY)
    close(prefill, decode)


def test_missing_notice_times_out_and_frees_the_reservation(checkpoints):
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=0.3)

    async def go():
        await decode.reserve("lost", prompts(1, 12, 12)[0], GREEDY)
        await until(lambda: decode.scheduler.num_transfer_failures == 1, what="the reservation's timeout")
        # the stream that comes too late is told why the request ended, not just that it did
        with pytest.raises(PDRequestError, match=r"KV transfer failed: timed out after 0.3s in WaitingForInput"):
            async for _ in decode.stream("lost", {"first_token": 5}):
                pass

    asyncio.run(go())
    assert decode.scheduler.num_transfer_failures == 1
    close(prefill, decode)


def test_abort_while_reserved_frees_slots(checkpoints):
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)

    async def go():
        await decode.reserve("gone", prompts(1, 20, 20)[0], GREEDY)
        assert await decode.abort("gone", safe=True)  # no prefill has its hand-offs
        for _ in range(100):
            if not decode.scheduler.has_work():
                break
            await asyncio.sleep(0.01)
        final, _, _ = await run_pd(prefill, decode, prompts(1, 20, 20)[0], GREEDY)
        assert final["meta_info"]["finish_reason"]["type"] == "length"

    asyncio.run(go())
    close(prefill, decode)


def test_load_names_the_requests_each_worker_holds(checkpoints):
    """What the router reconciles its routes against (a lost release): the decode worker's
    ``load()`` names the request from its reservation on, the prefill worker's while it is
    queued there (its loop paused), and neither once it ended; both name its attempt's room."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 12, 12, seed=5)[0]

    async def go():
        handoffs = await decode.reserve("held", ids, GREEDY, None, 7)
        assert (prefill.load()["rids"], decode.load()["rids"]) == ([], ["held"])
        assert decode.load()["rooms"] == {"held": 7}
        prefill.pause_generation()
        prefilling = asyncio.ensure_future(prefill.prefill("held", ids, GREEDY, handoffs))
        await until(lambda: prefill.load()["waiting"] == 1, what="the prefill queued")
        assert (prefill.load()["rids"], decode.load()["rids"]) == (["held"], ["held"])
        assert prefill.load()["rooms"] == {"held": 7}  # (from the hand-offs)
        prefill.continue_generation()
        notice = await prefilling
        assert (prefill.load()["rids"], decode.load()["rids"]) == ([], ["held"])
        async for final in decode.stream("held", notice):
            pass
        assert final["meta_info"]["finish_reason"] is not None
        assert (prefill.load()["rids"], decode.load()["rids"]) == ([], [])
        assert decode.load()["rooms"] == {}

    asyncio.run(go())
    close(prefill, decode)


def test_an_unconfirmed_abort_quarantines_the_slots_and_a_late_push_is_refused(checkpoints):
    """Dropped while a prefill may still push: the slots stay out of circulation until the
    hand-off's deadline (plus grace) has passed, and a push after the deadline is refused,
    so a late write can never land in another request's KV."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=0.5)
    ids = prompts(1, 20, 20, seed=9)[0]

    async def go():
        total = decode.load()["total_slots"]
        handoffs = await decode.reserve("late", ids, GREEDY)
        held = decode.load()["free_slots"]
        assert held <= total - len(ids)
        assert await decode.abort("late")  # not safe: the prefill side has not confirmed
        assert decode.load()["free_slots"] == held  # quarantined, not free
        await asyncio.sleep(0.6)  # past the hand-off's deadline
        with pytest.raises(PDRequestError, match="deadline"):
            await prefill.prefill("late", ids, GREEDY, handoffs)
        for _ in range(200):
            if decode.load()["free_slots"] == total:
                break
            await asyncio.sleep(0.01)
        assert decode.load()["free_slots"] == total

        # once the caller knows the prefill side is done with it, a quarantined reservation goes back at once
        await decode.reserve("late-2", ids, GREEDY)
        assert await decode.abort("late-2")
        assert decode.load()["free_slots"] < total
        assert await decode.abort("late-2", safe=True)
        assert decode.load()["free_slots"] == total

    asyncio.run(go())
    close(prefill, decode)


def _fail_next_forward(worker):
    real = worker.runner.forward

    def boom(batch):
        worker.runner.forward = real
        raise RuntimeError("injected forward failure")

    worker.runner.forward = boom


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_failed_forward_ends_its_requests_with_an_error_and_leaks_nothing(checkpoints, side):
    """The batch being run is in no queue while it runs; a failure must still find,
    release and answer every request of it (nothing hangs, nothing is freed twice)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=0.5)  # dropped reservations leave quarantine soon
    batch = prompts(3, 5, 20, seed=12)

    async def go():
        _fail_next_forward(prefill if side == "prefill" else decode)
        results = await asyncio.wait_for(
            asyncio.gather(*(run_pd(prefill, decode, ids, GREEDY) for ids in batch), return_exceptions=True), 60)
        assert any(isinstance(r, Exception) and "injected" in str(r) for r in results)
        final, _, _ = await run_pd(prefill, decode, batch[0], GREEDY)  # both workers still serve
        assert len(final["output_ids"]) == 8

    asyncio.run(go())
    close(prefill, decode)


def test_bad_requests_fail_clearly(checkpoints):
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)

    async def go():
        with pytest.raises(ValueError, match="empty"):
            await decode.reserve("empty", [], GREEDY)
        with pytest.raises(ValueError, match="KV pool"):  # could never be admitted: refused, not queued forever
            await decode.reserve("huge", list(range(3, 2050)), GREEDY)

    asyncio.run(go())
    close(prefill, decode)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3"])
def test_pd_on_cuda_with_cuda_ipc_pools(checkpoints, family):
    """The CUDA path: decode pools from a private MemPool exported over CUDA IPC,
    compiled Triton attention; tokens still equal HF's (HF on the CPU)."""
    path = checkpoints[family]
    args = dict(max_total_tokens=2048, page_size=1, skip_tokenizer_init=True, device="cuda", attention_backend="triton")
    prefill = PrefillWorker(path, args, backend="cuda_ipc")
    decode = DecodeWorker(path, args, backend="cuda_ipc")
    batch = prompts(4, 3, 40, seed=1)
    results = run_batch(prefill, decode, batch, GREEDY)
    assert_greedy_parity(path, batch, [r[0]["output_ids"] for r in results], 8, decode.eos_token_ids)
    close(prefill, decode)


# ---- chunk-wise pushes, overlapped with the next forward -------------------------------------------
CHUNK = 16


@pytest.mark.parametrize("backend", ["shm", "torch_dist"])
@pytest.mark.parametrize("family", ["llama", "qwen3_next", "gemma3"])
def test_chunked_prefill_pushes_every_chunk_and_tokens_equal_a_single_engine(checkpoints, family, backend):
    """One push per prefill chunk (the Mamba state and the SWA window with the last), the
    bytes of exactly the prompt, and the tokens a single engine and HF give."""
    from actors.engine import Engine

    path = checkpoints[family]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": CHUNK}, backend=backend)
    batch = prompts(3, 33, 60, seed=31)
    params = PAST_WINDOW if family == "gemma3" else GREEDY
    results = [run_batch(prefill, decode, [ids], params)[0] for ids in batch]  # one at a time: exact chunk counts
    assert prefill.rank.pusher.num_chunks == sum(-(-len(ids) // CHUNK) for ids in batch)
    outputs = [r[0]["output_ids"] for r in results]
    engine = Engine(model_path=path, max_total_tokens=2048, skip_tokenizer_init=True)
    try:
        assert outputs == [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=params)]
    finally:
        engine.shutdown()
    assert_greedy_parity(path, batch, outputs, params["max_new_tokens"], () if family == "gemma3" else decode.eos_token_ids)
    if family != "qwen3_next":  # (there the Mamba state's bytes come on top)
        expected = [expected_push_bytes(prefill, len(p), 0) if family == "gemma3" else len(p) * row_bytes(prefill)[0]
                    for p in batch]
        assert [r[1]["transfer_bytes"] for r in results] == expected
    close(prefill, decode)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_next_chunk_is_computed_while_the_previous_one_is_pushed(checkpoints, asynchronous):
    """The first chunk's push waits for the loop to run a forward after the one that wrote the
    chunk: with the asynchronous push it does at once (60 s: only a hang guard); with the
    synchronous one the loop is stuck in the push (3 s without one). Counted from the chunk's
    hand-over, not from when its copy begins: a transfer thread slow to start on a loaded host
    may begin it after the last chunk's forward, with none to come."""
    path = checkpoints["llama"]
    args = {"chunked_prefill_size": CHUNK, "disaggregation_async_push": asynchronous}
    prefill, decode = make_pair(path, prefill_args=args)
    pusher, handed_over, overlapped = prefill.scheduler.pusher, [], []
    submit = pusher.submit

    def count_then_submit(chunks):  # (the synchronous pusher copies them in here)
        handed_over.append(prefill.runner.num_forwards)
        submit(chunks)

    pusher.submit = count_then_submit

    def hold(_):
        if not overlapped:
            deadline = time.monotonic() + (60.0 if asynchronous else 3.0)
            while prefill.runner.num_forwards == handed_over[0] and time.monotonic() < deadline:
                time.sleep(0.005)
            overlapped.append(prefill.runner.num_forwards > handed_over[0])

    slow_push(prefill, hold)
    ids = prompts(1, 60, 60, seed=41)[0]
    (final, notice, _), = run_batch(prefill, decode, [ids], GREEDY)
    assert overlapped == [asynchronous]
    assert_greedy_parity(path, [ids], [final["output_ids"]], 8, decode.eos_token_ids)
    # the notice's transfer time is what the prefill did not hide: the last chunk's push only
    assert notice["transfer_time"] < notice["prefill_latency"]
    close(prefill, decode)


def test_a_finished_push_sends_its_notice_while_the_next_forward_runs(checkpoints):
    """TP 1: the transfer thread that ends a request's push sends its completion notice at
    once; it does not wait for the loop to finish the forward it has started meanwhile
    (another request's next chunk; here it lasts until that notice came, 30 s at most)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": CHUNK})
    real, spans, arrived = prefill.runner.forward, [], {}
    lock, state = threading.Lock(), {"forward_start": None, "short_copying": False}

    def slow_forward(batch):
        with lock:
            state["forward_start"] = start = time.monotonic()
        out = real(batch)
        with lock:  # the short request's copy began during this forward: it lasts until that notice came
            hold_on = state["short_copying"]
            if not hold_on:
                state["forward_start"] = None
                spans.append((start, time.monotonic()))
        if hold_on:
            deadline = time.monotonic() + 30.0
            while "short" not in arrived and time.monotonic() < deadline:
                time.sleep(0.002)
            with lock:
                state["forward_start"] = None
                spans.append((start, time.monotonic()))
        return out

    prefill.runner.forward = slow_forward
    short, long = prompts(1, 6, 6, seed=51)[0], prompts(1, 90, 90, seed=52)[0]
    short_pushed = []

    def hold(call):  # the short request's copy runs inside a forward of the long one's chunks
        if len(call["handoff"].dst_slots) != len(short):
            return
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with lock:
                if state["forward_start"] is not None:
                    state["short_copying"] = True
                    short_pushed.append(time.monotonic())
                    return
            time.sleep(0.002)

    slow_push(prefill, hold)

    async def go():
        first = await decode.reserve("short", short, GREEDY)
        second = await decode.reserve("long", long, GREEDY)

        async def prefill_one(rid, ids, handoffs):
            notice = await prefill.prefill(rid, ids, GREEDY, handoffs)
            arrived[rid] = time.monotonic()
            finals = [out async for out in decode.stream(rid, notice)]
            return finals[-1]["output_ids"]

        return await asyncio.gather(prefill_one("short", short, first), prefill_one("long", long, second))

    outs = asyncio.run(go())
    running = [(start, end) for start, end in spans if short_pushed and start <= short_pushed[0] <= end]
    assert running, (short_pushed, spans)
    assert arrived["short"] < running[0][1], (arrived, short_pushed, spans)  # before that forward ended
    assert_greedy_parity(path, [short, long], outs, 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_push_report_that_fails_is_left_to_the_loop(checkpoints):
    """The transfer thread's report that a request's push ended raises (as a TP follower's
    does with its rank 0 unreachable): the thread goes on, and the loop's next step collects
    the result (it was lost: the request waited in ``inflight`` for good)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    pusher = prefill.rank.pusher
    report, failed = pusher.on_finished, []

    def flaky(result):
        if not failed:
            failed.append(result.push_id)
            raise ConnectionError("rank 0 is gone")
        report(result)

    pusher.on_finished = flaky
    batch = prompts(2, 5, 20, seed=71)

    async def go():
        return [await asyncio.wait_for(run_pd(prefill, decode, ids, GREEDY), 30) for ids in batch]

    outs = [final["output_ids"] for final, _, _ in asyncio.run(go())]
    assert len(failed) == 1
    assert_greedy_parity(path, batch, outs, 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_late_report_of_an_earlier_attempt_does_not_settle_a_retry(checkpoints):
    """A push report reaches rank 0 late (a TP follower's goes as a Ray message) while the
    client already retries under the same request id: the report names the earlier attempt's
    push and is ignored. Keyed by request id it settled the retry, whose notice then went out
    before its bytes were copied."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    pusher = prefill.rank.pusher
    report, reported = pusher.on_finished, []

    def record(result):
        reported.append(result.push_id)
        report(result)

    pusher.on_finished = record
    retry, copying, gate = [], threading.Event(), threading.Event()

    def hold(call):  # the retry's copy runs until the late report has come
        if retry:
            copying.set()
            assert gate.wait(30), "the gate was never opened"

    copied = slow_push(prefill, hold)
    ids = prompts(1, 12, 12, seed=81)[0]

    async def go():
        await run_pd(prefill, decode, ids, GREEDY, rid="again")  # the earlier attempt
        retry.append(True)
        handoffs = await decode.reserve("again", ids, GREEDY)
        task = asyncio.ensure_future(prefill.prefill("again", ids, GREEDY, handoffs))
        await until(copying.is_set, what="the retry's push")
        assert any(r.rid == "again" for r in list(prefill.scheduler.inflight))  # (its last chunk is being copied)
        prefill.scheduler.on_pushed(0, [PushResult(reported[0], 0, None)])  # the late report
        await asyncio.sleep(0.05)  # a notice it let out would be here now
        early = task.done()
        gate.set()
        notice = await asyncio.wait_for(task, 30)
        noticed = time.monotonic()
        finals = [out async for out in decode.stream("again", notice)]
        return early, noticed, finals[-1]["output_ids"]

    early, noticed, out = asyncio.run(go())
    assert not early, "the late report settled the retry while its copy was still running"
    assert len(reported) == 2 and reported[0] != reported[1]
    assert noticed >= copied[-1]  # the retry's notice came after its own copy
    assert_greedy_parity(path, [ids], [out], 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_slow_decode_worker_holds_up_only_its_own_pushes(checkpoints):
    """Pushes to a decode worker whose link is slow (here a copy that lasts until the other
    request's notice came, 10 s at most) run on their own lane: a request to another decode
    worker, submitted while the slow copy runs, ends its prefill first and with its own tokens
    (one transfer thread used to queue it behind the slow push)."""
    path = checkpoints["llama"]
    prefill, slow = make_pair(path)
    fast = DecodeWorker(path, dict(max_total_tokens=2048, page_size=1, skip_tokenizer_init=True), backend="shm")
    agent = prefill.agents["shm"]
    real_push, slow_id = agent.push, slow.agents["shm"].endpoint()["agent_id"]
    slow_copying, fast_pushed = threading.Event(), threading.Event()

    def push(handoff, *args, **kwargs):
        if handoff.endpoint["agent_id"] == slow_id:
            slow_copying.set()
            fast_pushed.wait(10)
        return real_push(handoff, *args, **kwargs)

    agent.push = push
    batch, pushed = prompts(2, 10, 20, seed=81), {}

    async def timed(decode, ids, name, after=None):
        if after is not None:
            await until(after.is_set, what="the slow copy")
        handoffs = await decode.reserve(name, ids, GREEDY)
        notice = await asyncio.wait_for(prefill.prefill(name, ids, GREEDY, handoffs), 30)
        pushed[name] = time.monotonic()
        if decode is fast:
            fast_pushed.set()
        final = None
        async for final in decode.stream(name, notice):
            pass
        return final["output_ids"]

    async def go():
        return await asyncio.gather(timed(slow, batch[0], "slow"), timed(fast, batch[1], "fast", after=slow_copying))

    outs = asyncio.run(go())
    assert pushed["fast"] < pushed["slow"], pushed
    assert_greedy_parity(path, batch, outs, 8, slow.eos_token_ids)
    close(prefill, slow, fast)



def test_an_aborted_inflight_request_whose_caching_fails_is_still_told(checkpoints):
    """``abort`` of a request waiting in ``inflight`` finishes it, then caches its prompt; when
    caching raised, the request was finished and in no queue: its ``prefill()`` caller was
    never answered. It is told it was aborted however its caching went."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": CHUNK})
    ids = prompts(1, 60, 60, seed=44)[0]
    sched, started, loop_ref = prefill.scheduler, asyncio.Event(), []

    def hold(call):  # the last chunk's copy waits for the abort: the request sits in inflight
        if call["offset"] + call["num_rows"] == len(call["handoff"].dst_slots):
            loop_ref[0].call_soon_threadsafe(started.set)
            deadline = time.monotonic() + 10
            while ("lost", None) not in prefill._cancelled and time.monotonic() < deadline:
                time.sleep(0.002)

    slow_push(prefill, hold)
    real = sched.tree_cache.cache_finished_req

    def failing(req, *args, **kwargs):
        if req.rid == "lost":
            raise RuntimeError("injected release error")
        return real(req, *args, **kwargs)

    async def go():
        loop_ref.append(asyncio.get_running_loop())
        handoffs = await decode.reserve("lost", ids, GREEDY)
        task = asyncio.ensure_future(prefill.prefill("lost", ids, GREEDY, handoffs))
        await asyncio.wait_for(started.wait(), 30)
        sched.tree_cache.cache_finished_req = failing
        try:
            await prefill.abort("lost")
        except RuntimeError:
            pass  # (the abort's own caller may hear of the failure)
        finally:
            del sched.tree_cache.cache_finished_req
        try:
            await asyncio.wait_for(task, 30)
            answer = "answered"
        except PDRequestError as exc:
            answer = "told" if "aborted" in str(exc) else str(exc)
        except asyncio.TimeoutError:
            answer = "never told"
        assert await decode.abort("lost", safe=True)
        return answer

    assert asyncio.run(go()) == "told"
    prefill.shutdown()
    close(decode)


@pytest.mark.parametrize("when", ["chunk", "inflight"])
def test_abort_during_a_chunk_push_waits_for_it_and_nothing_lands_later(checkpoints, when):
    """``abort`` while a chunk of a request (``chunk``: one of its first; ``inflight``: its
    last, the request waiting in ``inflight``) is being copied: it returns once that copy
    ended, no later chunk is copied, the decode slots keep what they held, and after the
    decode side frees the reservation at once (safe) both workers are whole."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, prefill_args={"chunked_prefill_size": CHUNK})
    ids = prompts(1, 60, 60, seed=43)[0]
    started = asyncio.Event()
    loop_ref = []

    def hold(call):  # the copy lasts until the abort has begun, and a while longer: abort must wait for it
        last = call["offset"] + call["num_rows"] == len(call["handoff"].dst_slots)
        if last == (when == "inflight"):
            loop_ref[0].call_soon_threadsafe(started.set)
            deadline = time.monotonic() + 10
            while ("cut", None) not in prefill._cancelled and time.monotonic() < deadline:
                time.sleep(0.002)
            time.sleep(0.1)

    ended = slow_push(prefill, hold)

    async def go():
        loop_ref.append(asyncio.get_running_loop())
        handoffs = await decode.reserve("cut", ids, GREEDY)
        dst = KVHandoff.from_bytes(handoffs[0]).dst_slots
        task = asyncio.ensure_future(prefill.prefill("cut", ids, GREEDY, handoffs))
        await asyncio.wait_for(started.wait(), 30)
        if when == "inflight":
            assert [r.rid for r in prefill.scheduler.inflight] == ["cut"]
        assert await prefill.abort("cut")
        aborted_at = time.monotonic()
        k = decode.runner.token_to_kv_pool.k_buffer[0]
        snapshot = k[dst].clone()
        with pytest.raises(PDRequestError, match="aborted"):
            await task
        await asyncio.sleep(0.8)
        assert ended and all(t <= aborted_at for t in ended)
        assert len(ended) == (1 if when == "chunk" else -(-len(ids) // CHUNK))
        assert torch.equal(k[dst], snapshot)
        assert await decode.abort("cut", safe=True)

    asyncio.run(go())
    close(prefill, decode)


def test_a_push_that_fails_while_the_loop_delivers_the_request_is_reported_as_failed(checkpoints):
    """TP 1: the loop hands the prefill its (unfinished) output after the last chunk's
    forward while the transfer thread ends that chunk's push with an error. The
    loop's delivery must not read "no error" before and "finished" after the
    transfer thread finished the request: that is a success notice for KV that never
    arrived, and the decode side would decode garbage."""
    import threading

    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 12, 12, seed=61)[0]
    entered = threading.Event()
    real_snapshot = prefill._snapshot

    def snapshot(req, with_text):
        name = threading.current_thread().name
        if name == "raydix-engine-loop" and not req.finished:
            entered.set()  # the loop is delivering: now let the push fail
            deadline = time.monotonic() + 30.0
            while not req.finished and time.monotonic() < deadline:
                time.sleep(0.001)
        elif name.startswith("raydix-kv-push"):
            time.sleep(0.3)  # the loop's delivery reaches the caller first
        return real_snapshot(req, with_text)

    def hold(_):
        entered.wait(30.0)
        raise RuntimeError("link down")

    prefill._snapshot = snapshot
    slow_push(prefill, hold)

    async def go():
        handoffs = await decode.reserve("torn", ids, GREEDY)
        try:
            with pytest.raises(PDRequestError, match="link down"):
                await prefill.prefill("torn", ids, GREEDY, handoffs)
        finally:
            await prefill.abort("torn")
            await decode.abort("torn", safe=True)

    asyncio.run(go())
    assert entered.is_set()
    close(prefill, decode)


def test_a_decode_follower_answers_a_reused_request_id_from_its_own_bytes():
    """Decode TP: a follower remembers the shares it reported landed while rank 0 may still
    ask about them. A later request with the same id (a client's own id, sent again) must be
    answered from its own receiver: it was answered "landed" from the memory of the first
    one, before its bytes came (rank 0 then decoded without this rank's KV), and its
    receiver stayed behind for good."""
    from types import SimpleNamespace

    from actors.rank import TPFollower
    from tests.transfer_helpers import RankSpec, build_pool
    from transfer.backends.fake import FakeAgent

    class GatedAgent(FakeAgent):  # a hand-off's bytes are in once the test says so (by room)
        arrived: set = set()

        def landed(self, handoff):
            return handoff.room in self.arrived

    _, layout, tensors, _ = build_pool(RankSpec(tp_rank=1, tp_size=2))
    agent = GatedAgent(layout, tensors, 1, 2)
    follower = TPFollower.__new__(TPFollower)  # its decode handlers only: no model, no TP group
    follower.host, follower.waiting_timeout_s = SimpleNamespace(tp_rank=1, agents={"fake": agent}), 30.0
    follower._receivers, follower._landed = {}, set()

    follower._expect(("again", 1, "fake", [3, 4], None, 0, []))
    assert follower._land(["again"]) == {}  # still on its way
    agent.arrived.add(1)
    assert follower._land(["again"]) == {"again": None} == follower._land(["again"])  # asked until all answer
    # rank 0 decodes it; no other request lands meanwhile, so nothing asks about it again
    follower._expect(("again", 2, "fake", [5, 6], None, 0, []))
    assert follower._land(["again"]) == {}  # the new request's bytes are not here yet
    agent.arrived.add(2)
    assert follower._land(["again"]) == {"again": None}
    assert follower._receivers == {}


def test_a_request_id_used_again_at_once_keeps_its_own_reservation(checkpoints):
    """A request's end is told on the caller's event loop in two posts from the engine thread:
    its last output, then that it ended (``_finished``). When a new request with the same id
    (a client's own rid) reserved before the late word ran, it took the new request's queue
    for its own: the new stream() failed with "no reservation", its slots held until the
    waiting timeout. Both posts now go over in one hand-over, run back to back; the engine
    thread is held before handing it over here (where it was held between the two calls)."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 12, 12, seed=71)[0]

    async def go():
        loop = asyncio.get_running_loop()
        schedule = loop.call_soon_threadsafe

        def held(callback, *args):
            if any(post.fn.__name__ == "_finished" for post in (args[0] if callback is _run_posts else ())):
                time.sleep(0.3)  # the engine thread is preempted after handing over the last output
            return schedule(callback, *args)

        loop.call_soon_threadsafe = held
        outs = [(await run_pd(prefill, decode, ids, GREEDY, rid="again"))[0] for _ in range(2)]
        await asyncio.sleep(0.5)  # the late words have come
        return outs

    first, second = asyncio.run(go())
    assert first["output_ids"] == second["output_ids"] and len(first["output_ids"]) == 8
    close(prefill, decode)


def test_a_request_id_sent_again_right_after_an_abort_is_served(checkpoints):
    """An abort ends a request at once, but the loop reports it at its next step. The same id
    sent again meanwhile (a client retrying) was refused as "already in flight" on either side,
    and the prefill side refused every later call under the id, not only the aborted attempt's
    (a late call with that attempt's hand-offs still is). Both loops are held to keep the window open."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 12, 12, seed=72)[0]

    async def go():
        handoffs = await decode.reserve("again", ids, GREEDY)
        prefill.loop.pause()
        decode.loop.pause()
        first = asyncio.ensure_future(prefill.prefill("again", ids, GREEDY, handoffs))
        await asyncio.sleep(0)
        assert await prefill.abort("again", room=KVHandoff.from_bytes(handoffs[0]).room)
        assert await decode.abort("again", safe=True)
        reserve = asyncio.ensure_future(decode.reserve("again", ids, GREEDY))
        await asyncio.sleep(0)
        decode.loop.resume()
        handoffs_2 = await reserve
        with pytest.raises(PDRequestError, match="aborted before its prefill started"):
            await prefill.prefill("again", ids, GREEDY, handoffs)  # the aborted attempt, come late
        second = asyncio.ensure_future(prefill.prefill("again", ids, GREEDY, handoffs_2))
        await asyncio.sleep(0)
        prefill.loop.resume()
        with pytest.raises(PDRequestError, match="aborted"):
            await first
        return [out async for out in decode.stream("again", await second)][-1]

    final = asyncio.run(go())
    assert len(final["output_ids"]) == 8
    assert_greedy_parity(path, [ids], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_safe_abort_ends_the_live_request_not_a_quarantined_one_of_the_same_id(checkpoints):
    """A reservation dropped unconfirmed stays quarantined (its push may still come). When the
    client sends its id again, a safe abort is about the new request: it released the old,
    quarantined slots early and left the new reservation held until its waiting timeout."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=5.0)
    ids = prompts(1, 20, 20, seed=73)[0]

    async def go():
        total = decode.load()["total_slots"]
        await decode.reserve("same", ids, GREEDY)
        assert await decode.abort("same")  # unconfirmed: quarantined
        held = decode.load()["free_slots"]
        await decode.reserve("same", ids, GREEDY)  # the id sent again
        assert await decode.abort("same", safe=True)
        assert decode.load()["transfer"] == 0  # the new reservation went back, the old one stays
        assert decode.load()["free_slots"] == held
        assert [req.rid for _, req in decode.scheduler.quarantine] == ["same"]
        assert await decode.abort("same", safe=True)  # no request holds the id: now the quarantined one
        assert decode.load()["free_slots"] == total

    asyncio.run(go())
    close(prefill, decode)


def test_a_refused_duplicate_and_its_abort_leave_the_request_in_flight_alone(checkpoints):
    """A second reservation under an id in flight is refused. The client then aborts what it
    asked for — safely, as nothing was handed off — and by id alone that abort ended the
    first request and freed slots its prefill was about to write. Named by room, it touches
    only its own attempt: the first request's KV lands and its tokens are right."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 20, 20, seed=74)[0]

    async def go():
        handoffs = await decode.reserve("dup", ids, GREEDY, room=1)
        with pytest.raises(ValueError, match="already in flight"):
            await decode.reserve("dup", ids, GREEDY, room=2)
        assert not await decode.abort("dup", "the prefill side failed", safe=True, room=2)
        assert decode.load()["transfer"] == 1
        # a notice is the attempt's own too
        assert not decode.loop.run_exclusive(lambda: decode.scheduler.on_transfer_done("dup", {"room": 2}))
        notice = await prefill.prefill("dup", ids, GREEDY, handoffs)
        assert notice["room"] == 1
        return [out async for out in decode.stream("dup", notice)][-1]

    final = asyncio.run(go())
    assert_greedy_parity(path, [ids], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


def test_a_late_abort_of_an_earlier_attempt_leaves_the_retry_alone(checkpoints):
    """Attempt 1 is dropped unconfirmed (quarantined); the client retries under the same id.
    Aborts naming attempt 1's room release its quarantine once the prefill side is known to
    be done, and never reach attempt 2 — reserved, transferring, or decoding."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=5.0)
    ids = prompts(1, 20, 20, seed=75)[0]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def go():
        await decode.reserve("retry", ids, params, room=11)
        assert await decode.abort("retry", room=11)  # unconfirmed: quarantined
        handoffs = await decode.reserve("retry", ids, params, room=12)
        both_held = decode.load()["free_slots"]
        assert not await decode.abort("retry", room=11)  # not safe: nothing of attempt 1 can go yet
        assert await decode.abort("retry", safe=True, room=11)  # attempt 1's quarantine goes back
        assert decode.load()["transfer"] == 1 and not decode.scheduler.quarantine
        assert decode.load()["free_slots"] == both_held + len(ids)
        notice = await prefill.prefill("retry", ids, params, handoffs)
        outs = []
        async for out in decode.stream("retry", notice):
            if not outs:  # decoding now: attempt 1's abort, come late again, is not about it
                assert not await decode.abort("retry", "the client went away", safe=True, room=11)
            outs.append(out)
        return outs[-1]

    final = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 8
    assert_greedy_parity(path, [ids], [final["output_ids"]], 8, [])
    close(prefill, decode)


def test_an_old_stream_closed_late_and_a_stale_notice_leave_the_retry_alone(checkpoints):
    """Attempt 1 streams; its consumer stops reading, the client aborts it and retries under the
    same id. When attempt 1's stream is finally closed its clean-up abort named only the id and
    ended attempt 2; a stale notice of attempt 1 took attempt 2's outputs for 5 s, then its queue."""
    path = checkpoints["llama"]
    prefill, decode = make_pair(path)
    ids = prompts(1, 16, 16, seed=76)[0]
    long = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}

    async def go():
        paused = pause_once(decode, lambda: any(r.rid == "s" for r in decode.scheduler.running))
        notice_1 = await prefill.prefill("s", ids, long, await decode.reserve("s", ids, long, room=1))
        stream_1 = decode.stream("s", notice_1)
        await stream_1.__anext__()
        await until(paused.is_set, what="attempt 1 decoding")  # (its 64 tokens could all be out by now)
        assert await decode.abort("s", "the client went away", safe=True, room=1)
        decode.loop.resume()
        handoffs_2 = await decode.reserve("s", ids, GREEDY, room=2)
        await stream_1.aclose()
        with pytest.raises(PDRequestError, match="another attempt"):
            await decode.stream("s", notice_1).__anext__()
        assert decode.load()["transfer"] == 1  # attempt 2, untouched
        notice_2 = await prefill.prefill("s", ids, GREEDY, handoffs_2)
        return [out async for out in decode.stream("s", notice_2)][-1]

    final = asyncio.run(go())
    assert len(final["output_ids"]) == 8
    assert_greedy_parity(path, [ids], [final["output_ids"]], 8, decode.eos_token_ids)
    close(prefill, decode)


class _LocalActor:
    """A worker object behind a Ray-like handle (``handle.method.remote(...)`` → awaitable;
    ``.options(num_returns="streaming").remote(...)``: an async generator's items as awaitables)."""

    def __init__(self, worker):
        self._worker = worker

    def __getattr__(self, name):
        method = getattr(self._worker, name)

        async def refs(*args):
            async for item in method(*args):
                yield asyncio.sleep(0, item)

        streaming = type("Streaming", (), {"remote": staticmethod(refs)})()
        return type("Method", (), {"remote": staticmethod(lambda *args: asyncio.ensure_future(method(*args))),
                                   "options": staticmethod(lambda **_: streaming)})()


def test_the_client_keeps_a_reservation_quarantined_when_the_prefill_stop_is_unconfirmed(checkpoints):
    """The prefill call fails and the client cannot confirm the prefill side stopped: it aborts
    the decode reservation unsafely (quarantined: a late push may still come). Its clean-up on
    the way out then sent a second, safe abort for the same attempt, which freed the slots."""
    from cluster.pd_client import PDClient, WorkerRef

    path = checkpoints["llama"]
    prefill, decode = make_pair(path, waiting_timeout_s=1.0)

    async def refuse(*args):
        raise PDRequestError("prefill failed")

    async def unreachable(*args):
        raise RuntimeError("the abort could not be delivered")

    prefill.prefill, prefill.abort = refuse, unreachable
    client = PDClient([WorkerRef("p", "prefill", _LocalActor(prefill), "n")],
                      [WorkerRef("d", "decode", _LocalActor(decode), "n")], backend="shm")

    async def go():
        total = decode.load()["total_slots"]
        with pytest.raises(PDRequestError, match="prefill failed"):
            await client.generate(prompts(1, 20, 20, seed=77)[0], GREEDY, rid="q")
        await asyncio.sleep(0.2)  # anything the client left running has run
        assert len(decode.scheduler.quarantine) == 1 and decode.load()["free_slots"] < total

    asyncio.run(go())
    close(prefill, decode)


def test_a_retry_under_the_same_id_on_the_same_decode_worker_is_served_beside_the_quarantined_attempt(checkpoints):
    """The first prefill worker is unavailable (its call and its abort fail: it may still push),
    so the client quarantines the first reservation and retries on the other prefill worker,
    with the same decode worker and request id: the retry (a new room) is accepted there and
    decodes as the same request run cleanly does, the first attempt's slots kept aside."""
    from ray.exceptions import ActorUnavailableError

    from cluster.pd_client import PDClient, WorkerRef

    path = checkpoints["llama"]
    prefill, decode = make_pair(path)

    class Unavailable:
        async def prefill(self, *args):
            raise ActorUnavailableError("blip", None)

        abort = prefill

    client = PDClient([WorkerRef("p0", "prefill", _LocalActor(Unavailable()), "n"),
                       WorkerRef("p1", "prefill", _LocalActor(prefill), "n")],
                      [WorkerRef("d", "decode", _LocalActor(decode), "n")], backend="shm", retry_backoff_s=0.001)
    ids = prompts(1, 20, 20, seed=78)[0]

    async def go():
        final = await client.generate(ids, GREEDY, rid="same")
        [(_, first)] = decode.scheduler.quarantine
        assert first.rid == "same" and first.finished
        clean, _, _ = await run_pd(prefill, decode, ids, GREEDY)
        return final, clean

    final, clean = asyncio.run(go())
    assert client.num_retries == 1 and final["meta_info"]["prefill_worker"] == "p1"
    assert final["output_ids"] == clean["output_ids"] and len(final["output_ids"]) == 8
    decode.loop.run_exclusive(lambda: decode.scheduler._release_quarantine(force=True))  # (its deadline: 300 s)
    close(prefill, decode)


def test_prefill_plans_only_the_rows_its_inflight_requests_leave(checkpoints, monkeypatch):
    """A prefill worker's requests waiting in ``inflight`` hold their rows: with two rows and
    A's push held, B and C arriving are planned one at a time (the plan took both, then the
    row allocation failed — for hybrid models after evicting cached Mamba states for nothing
    — and the batch was cut down). All three still end with HF's tokens."""
    import actors.engine.schedule_policy as schedule_policy

    path = checkpoints["llama"]
    prefill, decode = make_pair(path, prefill_args={"max_running_requests": 2})
    sched, release, loop_ref, started = prefill.scheduler, threading.Event(), [], asyncio.Event()
    batch = prompts(3, 12, 12, seed=71)

    def hold(call):  # A's copy waits until B and C were planned
        if call["handoff"].rid == "a" and not release.is_set():
            loop_ref[0].call_soon_threadsafe(started.set)
            release.wait(10)

    slow_push(prefill, hold)
    planned, real = [], schedule_policy.prepare_for_extend

    def spy(reqs, *args, **kwargs):
        planned.append((len([r for r in reqs if r.req_pool_idx is None]), len(sched.inflight), len(sched.running)))
        return real(reqs, *args, **kwargs)

    monkeypatch.setattr(schedule_policy, "prepare_for_extend", spy)

    async def one(rid, ids):
        return (await run_pd(prefill, decode, ids, GREEDY, rid=rid))[0]

    async def go():
        loop_ref.append(asyncio.get_running_loop())
        first = asyncio.ensure_future(one("a", batch[0]))
        await asyncio.wait_for(started.wait(), 30)
        rest = [asyncio.ensure_future(one(rid, ids)) for rid, ids in zip("bc", batch[1:])]
        await until(lambda: len(sched.inflight) == 2 and any(r.rid == "c" for r in list(sched.waiting)),
                    what="A and B inflight, C waiting")
        await asyncio.sleep(0.3)  # (steps that could plan C)
        release.set()
        return await asyncio.gather(first, *rest)

    results = asyncio.run(go())
    assert all(new + inflight <= 2 for new, inflight, _ in planned), planned
    assert_greedy_parity(path, batch, [r["output_ids"] for r in results], GREEDY["max_new_tokens"])
    close(prefill, decode)
