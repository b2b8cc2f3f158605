"""Prefill and decode workers (in one process) under injected faults.

Many concurrent requests — shared prefixes, prompts prefilled and pushed in
chunks, a decode pool small enough to make reservations wait and running
requests retract — while transfers (any chunk of them) fail at
random (``RAYDIX_TEST_TRANSFER_FAILURE_PROB``, as SGLang's
``DISAGGREGATION_TEST_FAILURE_PROB``) and clients walk away at random moments.
Every request must end: with exactly the tokens a single engine gives, or with
a clear error. Afterwards both workers serve again and, once the quarantines
of dropped reservations ran out, hold no leaked slot, row or tree lock.
"""

import asyncio
import random

import pytest

from actors.engine.tiny import build_tiny_checkpoint
from actors.pd_scheduler import PDRequestError
from actors.workers import DecodeWorker, PrefillWorker
import transfer.base
from tests.parity import assert_greedy_parity
from tests.pd_helpers import prompts, run_pd
from transfer.base import FAILURE_PROB_ENV

MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-chaos")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in ("llama", "gemma3")}


async def _client(prefill, decode, rid, ids, walk_away_after):
    """One request as the HTTP layer drives it; a client that goes away mid-way
    aborts both sides (not knowing whether a push is still coming)."""
    task = asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid=rid))
    if walk_away_after is None:
        return await task
    done, _ = await asyncio.wait([task], timeout=walk_away_after)
    if done:
        return task.result()
    task.cancel()
    await prefill.abort(rid)
    await decode.abort(rid)
    raise asyncio.CancelledError()


async def _wait_idle(worker, timeout_s):
    for _ in range(int(timeout_s / 0.02)):
        if not worker.loop.run_exclusive(worker.scheduler.has_work):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{type(worker).__name__} still busy after {timeout_s}s")


@pytest.mark.parametrize("family,backend", [("llama", "shm"), ("llama", "torch_dist"), ("gemma3", "shm")])
def test_random_transfer_failures_and_walkaways_lose_nothing(checkpoints, family, backend, monkeypatch):
    """(Gemma 3: sliding-window layers, so both the full and the SWA pool are checked.)"""
    path = checkpoints[family]
    base = dict(max_total_tokens=2048, skip_tokenizer_init=True, chunked_prefill_size=16)
    prefill = PrefillWorker(path, base, backend=backend)
    decode = DecodeWorker(
        path, dict(base, max_total_tokens=400, init_new_token_ratio=0.05, min_new_token_ratio=0.05),
        backend=backend, num_reserved_decode_tokens=2, waiting_timeout_s=1.0,
    )
    rng = random.Random(7)
    shared = prompts(1, 24, 24, seed=70)[0]
    batch = prompts(14, 4, 40, seed=71) + prompts(14, 4, 30, seed=72, shared=shared)
    rng.shuffle(batch)
    walkaways = [rng.choice([None] * 6 + [0.0, 0.05, 0.3]) for _ in batch]
    monkeypatch.setattr(transfer.base, "_fault_rng", random.Random(family + backend))

    async def go():
        monkeypatch.setenv(FAILURE_PROB_ENV, "0.04")
        results = await asyncio.wait_for(asyncio.gather(
            *(_client(prefill, decode, f"chaos-{i}", ids, w) for i, (ids, w) in enumerate(zip(batch, walkaways))),
            return_exceptions=True), timeout=120)
        monkeypatch.delenv(FAILURE_PROB_ENV)
        await _wait_idle(decode, 10)  # dropped reservations leave quarantine (deadline + grace)
        await _wait_idle(prefill, 10)
        prefill.check_integrity()
        decode.check_integrity()
        after = await asyncio.gather(*(run_pd(prefill, decode, ids, GREEDY) for ids in batch[:4]))
        return results, after

    try:
        results, after = asyncio.run(go())
        finished, errors = [], []
        for ids, walkaway, result in zip(batch, walkaways, results):
            if isinstance(result, asyncio.CancelledError):
                assert walkaway is not None
            elif isinstance(result, BaseException):
                assert isinstance(result, PDRequestError), repr(result)
                errors.append(str(result))
            else:
                finished.append((ids, result[0]["output_ids"]))
        assert errors and all(e.strip() for e in errors)  # faults did happen, and say what happened
        assert any("injected failure" in e for e in errors), errors
        assert finished
        assert decode.scheduler.num_retractions > 0 or decode.scheduler.num_transfer_failures > 0
        assert prefill.rank.pusher.num_chunks > len(batch)  # long prompts moved in several chunks
        finished += [(ids, r[0]["output_ids"]) for ids, r in zip(batch[:4], after)]
        assert_greedy_parity(path, [f[0] for f in finished], [f[1] for f in finished], MAX_NEW, decode.eos_token_ids)
        prefill.check_integrity()
        decode.check_integrity()
    finally:
        prefill.shutdown()
        decode.shutdown()
