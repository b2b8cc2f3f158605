"""Prefill and decode workers (in one process) under injected faults.

Many concurrent requests — shared prefixes, prompts prefilled and pushed in
chunks, a decode pool small enough to make reservations wait and running
requests retract — while transfers (any chunk of them) fail at
random (``RAYDIX_TEST_TRANSFER_FAILURE_PROB``, as SGLang's
``DISAGGREGATION_TEST_FAILURE_PROB``) and clients walk away at random moments.
Every request must end: with exactly the tokens a single engine gives, or with
a clear error. Afterwards both workers serve again and, once the quarantines
of dropped reservations ran out, hold no leaked slot, row, Mamba slot or tree lock.

Beyond single requests, clients hold conversations (each turn's prompt is the
last prompt, its answer and new text, so the decode side reuses what it cached
of the conversation — for a hybrid model its attention KV only, under a KV-only
lock; with a host tier, loaded back from host memory) and send a failed or
abandoned request again at once under the same id.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from actors.engine.tiny import build_tiny_checkpoint
from actors.pd_scheduler import PDRequestError
from actors.workers import DecodeWorker, PrefillWorker
import transfer.states
from tests.parity import assert_greedy_parity
from tests.pd_helpers import prompts, run_pd, wait_idle
from transfer.base import FAILURE_PROB_ENV, KVHandoff

MAX_NEW = 10
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
FAMILIES = ("llama", "gemma3", "qwen3_next", "deepseek_v3")
HICACHE = {"enable_hierarchical_cache": True, "hicache_ratio": 4.0}
EXTRA_BUFFER = {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-chaos")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in FAMILIES}


@dataclass(frozen=True)
class Case:
    """One chaos run: the workers' set-up and what the clients do."""

    family: str
    backend: str = "shm"
    page_size: int = 1
    prefill_args: dict = field(default_factory=dict)
    decode_args: dict = field(default_factory=dict)
    decode_tokens: int = 400  # the decode pool: small, so reservations wait and running requests retract
    turns: int = 1  # >1: conversations, each turn extending the last prompt and its answer
    first_len: tuple = (4, 40)  # (lo, hi) of the first prompts' length: of half of them
    shared_len: tuple = (4, 30)  # and of the other half's past their shared 24-token prefix
    retry: bool = False  # a failed or abandoned request is sent again at once under its id
    failure_prob: float = 0.04  # per poll of a transfer in flight: a slower model polls more per transfer
    waiting_timeout_s: float = 1.0  # the decode side's; a dropped reservation's quarantine lasts as long again
    seed: int = 7
    clients: int = field(default=14, repr=False)  # per half of the batch (not in the repr that seeds the faults)


@dataclass
class Outcome:
    prompt: List[int]
    result: object  # (final, notice, hand-offs), or the exception it ended with
    walkaway: Optional[float]


async def _client(prefill, decode, rid, ids, walk_away_after):
    """One request as the HTTP layer drives it; a client that goes away mid-way
    aborts both sides (not knowing whether a push is still coming), naming its attempt's
    room (the id may be sent again)."""
    attempt = {}
    task = asyncio.ensure_future(run_pd(prefill, decode, ids, GREEDY, rid=rid, attempt=attempt))
    if walk_away_after is None:
        return await task
    done, _ = await asyncio.wait([task], timeout=walk_away_after)
    if done:
        return task.result()
    task.cancel()
    if "room" in attempt:  # (otherwise it never started: nothing was asked of either side)
        await prefill.abort(rid, room=attempt["room"])
        await decode.abort(rid, room=attempt["room"])
    raise asyncio.CancelledError()


async def _conversation(prefill, decode, case: Case, rid: str, first: List[int], rng: random.Random) -> List[Outcome]:
    """``case.turns`` turns, one after the other; with ``case.retry`` a turn that failed or was
    abandoned is sent again at once under the same id (twice at most). A turn that did not
    finish ends the conversation."""
    out: List[Outcome] = []
    prompt = first
    for turn in range(case.turns):
        turn_rid = rid if turn == 0 else f"{rid}.{turn}"
        for _ in range(3 if case.retry else 1):
            walkaway = rng.choice([None] * 6 + [0.0, 0.05, 0.3])
            try:
                result = await _client(prefill, decode, turn_rid, prompt, walkaway)
            except (PDRequestError, asyncio.CancelledError) as exc:
                out.append(Outcome(prompt, exc, walkaway))
                continue
            except Exception as exc:  # noqa: BLE001 - reported (and failed) below, with the others
                out.append(Outcome(prompt, exc, walkaway))
                return out
            out.append(Outcome(prompt, result, walkaway))
            break
        else:
            return out
        answer = result[0]["output_ids"]
        prompt = prompt + answer + [rng.randrange(3, 250) for _ in range(rng.randint(3, 12))]
    return out


async def _wait_idle(worker, timeout_s):
    """:func:`~tests.pd_helpers.wait_idle` off the event loop (the requests' streams run on it)."""
    idle = await asyncio.to_thread(wait_idle, worker, timeout_s)
    assert idle, f"{type(worker).__name__} still busy after {timeout_s}s"


def _count_load_backs(worker) -> List[int]:
    """Tokens each host-tier load of ``worker``'s tree brought back (appended as it happens)."""
    tree, loads = worker.scheduler.tree_cache, []
    real = tree.init_load_back

    def counted(*args, **kwargs):
        loaded, node = real(*args, **kwargs)
        loads.append(int(loaded.numel()))
        return loaded, node

    tree.init_load_back = counted
    return loads


def run_chaos(path: str, case: Case, monkeypatch):
    """Runs ``case``; returns (outcomes, the workers' stats). Checks what every case must hold."""
    base = dict(max_total_tokens=2048, page_size=case.page_size, skip_tokenizer_init=True, chunked_prefill_size=16)
    prefill = PrefillWorker(path, dict(base, **case.prefill_args), backend=case.backend)
    decode = DecodeWorker(
        path, dict(base, max_total_tokens=case.decode_tokens, init_new_token_ratio=0.05, min_new_token_ratio=0.05,
                   **case.decode_args),
        backend=case.backend, num_reserved_decode_tokens=2, waiting_timeout_s=case.waiting_timeout_s,
    )
    loads = {w.role: _count_load_backs(w) for w in (prefill, decode) if hasattr(w.scheduler.tree_cache, "init_load_back")}
    rng = random.Random(case.seed)
    shared = prompts(1, 24, 24, seed=case.seed * 10)[0]
    batch = prompts(case.clients, *case.first_len, seed=case.seed * 10 + 1)
    batch += prompts(case.clients, *case.shared_len, seed=case.seed * 10 + 2, shared=shared)
    rng.shuffle(batch)
    monkeypatch.setattr(transfer.states, "_fault_rng", random.Random(repr(case)))

    async def go():
        monkeypatch.setenv(FAILURE_PROB_ENV, str(case.failure_prob))
        runs = await asyncio.wait_for(asyncio.gather(*(
            _conversation(prefill, decode, case, f"chaos-{i}", ids, random.Random(rng.random()))
            for i, ids in enumerate(batch))), timeout=120)
        monkeypatch.delenv(FAILURE_PROB_ENV)
        await _wait_idle(decode, 10 + 2 * case.waiting_timeout_s)  # dropped reservations leave quarantine (deadline + grace)
        await _wait_idle(prefill, 10)
        prefill.check_integrity()
        decode.check_integrity()
        after = await asyncio.gather(*(run_pd(prefill, decode, ids, GREEDY) for ids in batch[:4]))
        # and one next turn with no faults: which turns of the chaos finished depends on the machine's
        # speed (a fault is drawn per poll), this one reaches the decode side's cache on any machine
        follow = batch[0] + after[0][0]["output_ids"] + [5, 6, 7]
        after.append(await run_pd(prefill, decode, follow, GREEDY))
        return [o for run in runs for o in run], after, batch[:4] + [follow]

    try:
        outcomes, after, after_prompts = asyncio.run(go())
        outcomes += [Outcome(ids, r, None) for ids, r in zip(after_prompts, after)]
        finished, errors = [], []
        for o in outcomes:
            if isinstance(o.result, asyncio.CancelledError):
                assert o.walkaway is not None
            elif isinstance(o.result, BaseException):
                assert isinstance(o.result, PDRequestError), repr(o.result)
                errors.append(str(o.result))
            else:
                finished.append(o)
        assert errors and all(e.strip() for e in errors)  # faults did happen, and say what happened
        assert any("injected failure" in e for e in errors), errors
        assert finished
        assert decode.scheduler.num_retractions > 0 or decode.scheduler.num_transfer_failures > 0
        assert prefill.rank.pusher.num_chunks > len(batch)  # long prompts moved in several chunks
        outputs = [o.result[0]["output_ids"] for o in finished]
        assert_greedy_parity(path, [o.prompt for o in finished], outputs, MAX_NEW, decode.eos_token_ids)
        prefill.check_integrity()
        decode.check_integrity()
        dst_prefix = [KVHandoff.from_bytes(o.result[2][0]).dst_prefix_len for o in finished]
        return outcomes, {"dst_prefix": dst_prefix, "loads": loads, "retractions": decode.scheduler.num_retractions}
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("family,backend", [("llama", "shm"), ("llama", "torch_dist"), ("gemma3", "shm")])
def test_random_transfer_failures_and_walkaways_lose_nothing(checkpoints, family, backend, monkeypatch):
    """(Gemma 3: sliding-window layers, so both the full and the SWA pool are checked.)"""
    run_chaos(checkpoints[family], Case(family, backend), monkeypatch)


def test_mla_under_chaos(checkpoints, monkeypatch):
    """DeepSeek V3 (MLA: one latent KV buffer per layer) with pages of 4, clients retrying."""
    run_chaos(checkpoints["deepseek_v3"], Case("deepseek_v3", page_size=4, retry=True), monkeypatch)


HYBRID_CASES = {
    "no_buffer": Case("qwen3_next", turns=3, retry=True, decode_tokens=600, failure_prob=0.005,
                      waiting_timeout_s=3.0, clients=10),
    "extra_buffer": Case("qwen3_next", page_size=16, prefill_args=EXTRA_BUFFER, decode_args=EXTRA_BUFFER,
                         turns=3, first_len=(54, 62), shared_len=(30, 38), retry=True, decode_tokens=1024, failure_prob=0.005,
                         waiting_timeout_s=3.0, clients=10),
}


@pytest.mark.parametrize("strategy", sorted(HYBRID_CASES))
def test_hybrid_conversations_under_chaos(checkpoints, strategy, monkeypatch):
    """Qwen3-Next: follow-up turns hold their decode-side attention KV under KV-only locks
    while the Mamba state comes whole from the prefill side; failures, walk-aways and
    retraction must free every lock, slot and Mamba slot."""
    _, stats = run_chaos(checkpoints["qwen3_next"], HYBRID_CASES[strategy], monkeypatch)
    assert any(stats["dst_prefix"]), "no turn reused the decode side's cache"


def test_host_tier_on_both_sides_under_chaos(checkpoints, monkeypatch):
    """Small device pools with host tiers on both sides: reservations load conversations back
    from host memory (decode), prefills reload prefixes (prefill), while transfers fail,
    clients walk away and retry, and running requests retract."""
    case = Case("llama", page_size=4, prefill_args=dict(HICACHE, max_total_tokens=256),
                decode_args=HICACHE, decode_tokens=256, turns=3, retry=True)
    _, stats = run_chaos(checkpoints["llama"], case, monkeypatch)
    assert any(stats["dst_prefix"]), "no turn reused the decode side's cache"
    assert any(stats["loads"]["decode"]), "the decode side loaded nothing back from its host tier"
