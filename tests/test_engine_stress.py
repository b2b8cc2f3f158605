"""The engine under memory pressure it must work its way through: conversations whose
next turns arrive together, each with a cached history, in a pool too small for all of
them at once (prefixes locked while others wait, eviction, retraction, chunked prefill,
the host tier), and a random mix of requests arriving and aborted over time. Every round
must finish — a scheduler that plans what it cannot allocate repeats the plan forever — with
tokens equal to HF's and nothing leaked."""

import random
import string
import threading
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.engine import Engine
from actors.engine.finish import decode_after
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.schedule_policy import PrefillAdmissionMixin
from actors.engine.tiny import VOCAB_SIZE, build_tiny_checkpoint
from tests.parity import assert_greedy_parity

ROUND_TIMEOUT_S = 90
CASES = {  # name: (family, engine args)
    "llama": ("llama", {"page_size": 4, "max_total_tokens": 320}),
    "llama-chunked-lpm": ("llama", {"page_size": 4, "max_total_tokens": 320, "chunked_prefill_size": 16,
                                    "schedule_policy": "lpm"}),
    "llama-host-tier": ("llama", {"page_size": 4, "max_total_tokens": 320, "enable_hierarchical_cache": True,
                                  "hicache_ratio": 3.0, "hicache_write_policy": "write_back"}),
    "deepseek_v3": ("deepseek_v3", {"page_size": 1, "max_total_tokens": 300}),
    "qwen3_next": ("qwen3_next", {"page_size": 1, "max_total_tokens": 300, "max_running_requests": 4}),
    "gemma3": ("gemma3", {"page_size": 1, "max_total_tokens": 320}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stress")
    families = sorted({family for family, _ in CASES.values()})
    return {family: str(build_tiny_checkpoint(family, root / family, seed=3)) for family in families}


def generate_within(engine, prompts, params):
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(input_ids=prompts, sampling_params=params)),
                              daemon=True)
    worker.start()
    worker.join(ROUND_TIMEOUT_S)
    assert done, f"a round of {len(prompts)} requests did not finish in {ROUND_TIMEOUT_S}s: the scheduler is stuck"
    return done[0]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", list(CASES))
def test_conversations_outgrowing_the_pool_all_finish(checkpoints, case, seed):
    family, args = CASES[case]
    model_dir = checkpoints[family]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, **args)
    rng = random.Random(seed)
    out_len = 6
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    histories = [[] for _ in range(8)]
    try:
        for _ in range(3):  # eight conversations, three turns, each turn's requests arriving together
            prompts = [h + [rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(10, 40))] for h in histories]
            outs = generate_within(engine, prompts, params)
            assert all(len(o["output_ids"]) == out_len for o in outs)
            engine.check_integrity()
            histories = [p + o["output_ids"] for p, o in zip(prompts, outs)]
        assert sum(len(p) + out_len for p in prompts) > args["max_total_tokens"]  # the last round did not fit at once
        assert_greedy_parity(model_dir, prompts, [o["output_ids"] for o in outs], out_len, [])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family, args", [
    ("llama", {}),
    ("qwen3_next", {"mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 16}),
])
def test_a_batch_of_short_prompts_is_planned_in_whole_pages(checkpoints, family, args):
    """Thirty 3-token prompts on 16-token pages: each takes a whole page, which admission counted
    as 3 tokens — it planned batches that could never be allocated and repeated them forever.
    A failed batch is now planned shorter at once, whose rows give back their Mamba slots once."""
    model_dir = checkpoints[family]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256, page_size=16, **args)
    rng = random.Random(4)
    batch = [[rng.randrange(5, VOCAB_SIZE) for _ in range(3)] for _ in range(30)]
    try:
        outs = generate_within(engine, batch, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        engine.check_integrity()
        assert_greedy_parity(model_dir, batch[:4], [o["output_ids"] for o in outs[:4]], 8, [])
    finally:
        engine.shutdown()


def test_decode_reserves_are_counted_in_each_requests_pages(checkpoints, monkeypatch):
    """Twelve 10-token prompts with 10 new tokens each on 16-token pages, the reserve taken whole
    (ratio 1): each request's KV ends in its second page. Counted as a total of tokens (10 a
    request), nine were admitted at once, their decode ran out of pages and retracted; counted
    in each request's pages, the first batch is the seven whose two pages fit with the slack
    page, and nothing retracts."""
    import actors.engine.schedule_policy as schedule_policy

    engine = Engine(model_path=checkpoints["llama"], skip_tokenizer_init=True, page_size=16, max_total_tokens=256,
                    init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    rng, batches, prepare = random.Random(2), [], schedule_policy.prepare_for_extend

    def recording_prepare(reqs, *args):
        batches.append(len(reqs))
        return prepare(reqs, *args)

    monkeypatch.setattr(schedule_policy, "prepare_for_extend", recording_prepare)
    prompts = [[rng.randrange(5, VOCAB_SIZE) for _ in range(10)] for _ in range(12)]
    try:
        outs = generate_within(engine, prompts, {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert all(len(o["output_ids"]) == 10 for o in outs)
        assert batches[0] == 7 and engine.scheduler.num_retractions == 0, (batches, engine.scheduler.num_retractions)
        engine.check_integrity()
    finally:
        engine.shutdown()


class _Room(PrefillAdmissionMixin):
    """The admission mixin's reserve arithmetic over ``FREE`` free slots (as many SWA slots with
    a ``window``) while ``running`` decode."""

    FREE = 1 << 20

    def __init__(self, page_size, ratio, running, window=None):
        self.page_size, self.new_token_ratio, self.running, self.swa = page_size, ratio, running, window is not None
        self.tree_cache = SimpleNamespace(sliding_window_size=window)

    def _free_room(self):
        return self.FREE, self.FREE if self.swa else None


def _pages(ps, start, end):
    return {p // ps for p in range(start, end)}


def _swa_peak(ps, window, kv_len, num_tokens):
    """SWA slots a decoding request takes over what it holds now, at its fullest: decoding the
    token at ``p`` first frees what slid out of the window (``window_start(p)``: the window before
    ``p``'s page, floored to pages), then takes ``p``'s page."""
    def window_start(n):
        return max(0, n - n % ps - window) // ps * ps

    held = len(_pages(ps, window_start(kv_len), kv_len))
    return max([0] + [len(_pages(ps, window_start(p), p + 1)) - held for p in range(kv_len, kv_len + num_tokens)]) * ps


@settings(max_examples=150, deadline=None)
@given(page_size=st.sampled_from([1, 2, 4, 16]), ratio=st.floats(0.05, 1.0), window=st.sampled_from([None, 4, 16]),
       reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 30), st.integers(0, 40)), max_size=8))
def test_the_decode_reserve_is_the_pages_each_request_fills(page_size, ratio, window, reqs):
    """The decode reserve is, request by request, the slots of the pages its expected new tokens
    (remaining × ratio) touch past the pages its KV holds — a decoding request's last sampled
    token has none yet, a PD reservation's prompt all of it — counted by brute force over its
    positions; one being admitted counts from its whole sequence. With sliding-window layers,
    each request's SWA reserve covers what its decode takes at its fullest."""
    running, full_need, swa_peak = [], 0, 0
    for prompt_len, num_out, more in reqs:
        req = Req(f"r{len(running)}", [1] * prompt_len, SamplingParams(max_new_tokens=num_out + more),
                  output_ids=[1] * num_out)
        req.kv_allocated_len = req.seqlen - 1 if num_out else req.seqlen
        running.append(req)
        expected, kv = int(more * ratio), req.kv_allocated_len
        full_need += len(_pages(page_size, kv, kv + expected) - _pages(page_size, 0, kv)) * page_size
        if window is not None:
            swa_peak += _swa_peak(page_size, window, kv, expected)
    room = _Room(page_size, ratio, running, window)
    full, swa = room._prefill_room()
    assert room.FREE - full == full_need
    if page_size == 1:  # each request's expected tokens
        assert full_need == sum(int(more * ratio) for *_, more in reqs)
    if window is not None:
        assert swa_peak <= room.FREE - swa <= full_need
    for req in running:
        expected = int((req.sampling_params.max_new_tokens - len(req.output_ids)) * ratio)
        pages = _pages(page_size, req.seqlen, req.seqlen + expected) - _pages(page_size, 0, req.seqlen)
        assert room._request_reserve(req) == len(pages) * page_size


def test_a_failed_batch_gives_back_a_copied_mamba_state_once(checkpoints, monkeypatch):
    """A hybrid request that matched a cached state holds its own copy (copy-on-write); when its
    batch cannot be allocated, freeing its row frees that copy too — the request kept naming it,
    and its next match or an abort freed the slot a second time (two requests could then share it)."""
    from actors.engine.schedule_batch import prepare_for_extend

    engine = Engine(model_path=checkpoints["qwen3_next"], skip_tokenizer_init=True, max_total_tokens=256)
    try:
        prompt = [random.Random(5).randrange(5, VOCAB_SIZE) for _ in range(24)]
        engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 2, "temperature": 0})
        sched, runner = engine.scheduler, engine.runner

        def fail_to_allocate():
            req = engine._make_req({"max_new_tokens": 2, "temperature": 0}, None, prompt + [7, 8, 9], "cow")
            sched._match_prefix(req, admit=True)
            assert req.mamba_pool_idx is not None  # its own copy of the cached state
            sched._lock(req)
            monkeypatch.setattr(runner.allocator, "alloc_extend", lambda *a, **k: None)
            assert prepare_for_extend([req], runner, sched.tree_cache) is None
            monkeypatch.undo()
            sched._unlock(req)
            return req

        req = engine.loop.run_exclusive(fail_to_allocate)
        assert req.mamba_pool_idx is None and req.req_pool_idx is None
        engine.check_integrity()  # every Mamba slot free once
    finally:
        engine.shutdown()


STOP_CHARS = string.ascii_letters + string.digits  # the byte-level model emits any byte: some stop it


def random_mix(rng, n):
    """``n`` greedy requests: prompts sharing three prefixes (some exact repeats, some one
    token, some long), ``max_new_tokens`` from 0 up, some with stop strings, stop ids or
    logprobs; each with the step it arrives at and, for a fifth, the step it is aborted at."""
    prefixes = [[rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    specs = []
    for _ in range(n):
        head = rng.choice(prefixes)[: rng.randint(0, 24)] if rng.random() < 0.8 else []
        prompt = head + [rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(1, 20))]
        if specs and rng.random() < 0.15:
            prompt = list(rng.choice(specs)[0])
        prompt = prompt[:1] if rng.random() < 0.1 else prompt
        params = {"temperature": 0, "max_new_tokens": rng.choice([0, 1, 2, 5, 8, 12, 16, 24]),
                  "ignore_eos": rng.random() < 0.7, "return_logprob": rng.random() < 0.2}
        kind = rng.random()
        if kind < 0.25:
            params["stop"] = rng.sample(STOP_CHARS, rng.randint(4, 8))
        elif kind < 0.4:
            params["stop_token_ids"] = [rng.randrange(5, VOCAB_SIZE) for _ in range(8)]
        arrive = rng.randint(0, 12)
        specs.append((prompt, params, arrive, arrive + rng.randint(0, 15) if rng.random() < 0.25 else None))
    return specs


def drive(engine, specs, max_steps=1000):
    """Step the scheduler by hand (the loop paused): each request arrives and is aborted at
    its step. Returns the requests and the tokens eviction freed once all are done."""
    sched, reqs, evicted = engine.scheduler, [None] * len(specs), [0]
    evict = sched.tree_cache.evict

    def counted_evict(*args, **kwargs):
        freed = evict(*args, **kwargs)
        evicted[0] += sum(freed) if isinstance(freed, tuple) else freed  # an SWA tree's: (full, SWA) freed
        return freed

    def run():
        for step in range(max_steps):
            for i, (prompt, params, arrive, abort) in enumerate(specs):
                if step == arrive:
                    reqs[i] = engine._make_req(params, None, prompt, f"r{i}")
                    sched.add_request(reqs[i])
                if step == abort:
                    sched.abort(f"r{i}")
            if step > max(s[2] for s in specs) and not sched.has_work():
                return
            sched.step()
        raise AssertionError(f"requests still queued after {max_steps} steps: the scheduler is stuck")

    sched.tree_cache.evict = counted_evict
    engine.loop.pause()
    try:
        engine.loop.run_exclusive(run)
    finally:
        engine.loop.resume()
        del sched.tree_cache.evict
    return reqs, evicted[0]


def check_ending(engine, req, prompt, params, aborted):
    """The request ended as its parameters say, at the first token that could end it."""
    out, reason, tokenizer = req.output_ids, req.finished_reason, engine.tokenizer
    stop_ids = set(params.get("stop_token_ids", [])) | (set() if params["ignore_eos"] else set(engine.eos_token_ids))
    assert not stop_ids.intersection(out[:-1]), f"{req.rid} went past a stop token: {out}"
    if reason["type"] == "abort":
        assert aborted, f"{req.rid} was not aborted: {reason}"
    elif reason["type"] == "length":
        assert len(out) == min(params["max_new_tokens"], engine.scheduler.context_len - len(prompt))
    elif isinstance(reason["matched"], int):
        assert out[-1] == reason["matched"] and out[-1] in stop_ids
    else:
        text_before = decode_after(tokenizer, prompt, out[:-1], True)
        assert reason["matched"] in decode_after(tokenizer, prompt, out, True)
        assert not any(s in text_before for s in params["stop"]), f"{req.rid} went past a stop string"
    if params["return_logprob"]:
        assert len(req.output_logprobs) == len(out)


def check_served_alone(engine, model_dir, specs, reqs):
    """Each request of ``drive`` ended as its parameters say, with HF's greedy tokens (and logprobs)."""
    for (prompt, params, _, abort), req in zip(specs, reqs):
        check_ending(engine, req, prompt, params, abort is not None)
        if not req.output_ids:
            continue
        logprobs = [req.output_logprobs] if params["return_logprob"] else None
        stop_ids = params.get("stop_token_ids", []) + ([] if params["ignore_eos"] else engine.eos_token_ids)
        assert_greedy_parity(model_dir, [prompt], [req.output_ids], len(req.output_ids), stop_ids, logprobs=logprobs)


def assert_nothing_held(engine):
    """Flushed, the idle engine holds nothing: every KV slot (of both pools with a sliding
    window), request row and Mamba state is free."""
    engine.flush_cache()  # (checks integrity first)
    engine.check_integrity()
    sched, runner = engine.scheduler, engine.runner
    alloc, rows = runner.allocator, runner.req_to_token_pool
    if sched.swa:
        assert (alloc.full_available_size(), alloc.swa_available_size()) == (alloc.size, alloc.size_swa)
    else:
        assert alloc.available_size() == alloc.num_pages * alloc.page_size
    assert sched.evictable_tokens() == 0 and rows.available_size() == rows.size
    if sched.hybrid:
        assert runner.mamba_pool.available_size() == runner.mamba_pool.size


@pytest.mark.parametrize("page_size, seed", [(1, 42), (4, 30)])  # a stop string / aborts while chunked, each retracting
def test_a_random_mix_under_memory_pressure_is_served_as_each_request_alone(checkpoints, page_size, seed):
    """Requests sharing prefixes arrive over time at a pool far too small for them (chunked
    prefill, prefix hits, eviction, retraction with a low decode reserve), some aborted while
    waiting, prefilling or decoding: each ends as its parameters say with HF's greedy tokens
    (and logprobs), and once idle nothing is held — every slot is free after a flush. (To hunt,
    run ``random_mix`` and ``drive`` over many seeds, pools, policies and model families.)"""
    model_dir = checkpoints["llama"]
    engine = Engine(model_path=model_dir, page_size=page_size, max_total_tokens=72,
                    chunked_prefill_size=8, init_new_token_ratio=0.2)
    try:
        specs = random_mix(random.Random(seed), 14)
        reqs, evicted = drive(engine, specs)
        assert engine.scheduler.num_retractions and evicted  # the mix did strain the pool
        check_served_alone(engine, model_dir, specs, reqs)
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


SWA_AND_HYBRID = {  # name: (family, engine args); each on 72 KV slots (57 SWA ones), in 8-token chunks
    "gemma3": ("gemma3", {"page_size": 1}),
    "gemma3-paged": ("gemma3", {"page_size": 4}),
    "qwen3_next": ("qwen3_next", {"page_size": 1, "max_running_requests": 3}),
    "qwen3_next-extra-buffer": ("qwen3_next", {"page_size": 4, "max_running_requests": 3,
                                               "mamba_scheduler_strategy": "extra_buffer", "mamba_track_interval": 8}),
}


@pytest.mark.parametrize("case", list(SWA_AND_HYBRID))
def test_a_random_mix_on_swa_and_hybrid_pools_is_served_as_each_request_alone(checkpoints, case):
    """The mix above on a sliding-window model (a full and an SWA pool, windows sliding out
    while requests decode, tombstones) and on a hybrid Mamba model (a state per request,
    cached states copied on a hit and evicted on their own list; with extra_buffer, states
    tracked on ping-pong slots as requests decode): each request ends as its
    parameters say with HF's tokens, and once idle nothing is held. Some example evicts and
    retracts (the explicit one does)."""
    family, args = SWA_AND_HYBRID[case]
    model_dir, strains = checkpoints[family], []

    @settings(max_examples=4, deadline=None)
    @given(rng=st.randoms(use_true_random=False))
    @example(rng=random.Random(1))
    def served_alone(rng):
        engine = Engine(model_path=model_dir, max_total_tokens=72, chunked_prefill_size=8, init_new_token_ratio=0.2,
                        **args)
        try:
            specs = random_mix(rng, 14)
            reqs, evicted = drive(engine, specs)
            check_served_alone(engine, model_dir, specs, reqs)
            assert_nothing_held(engine)
            strains.append((engine.scheduler.num_retractions, evicted))
        finally:
            engine.shutdown()

    served_alone()
    assert any(retracted and evicted for retracted, evicted in strains), strains


def test_retraction_frees_room_for_the_next_decode_steps_at_once(checkpoints):
    """Six requests admitted optimistically (a low decode reserve) outgrow a 128-slot pool of
    4-token pages. A decode step that does not fit retracts — fewest output tokens first, then
    the longest prompt (SGLang's ``retract_decode``) — until the rest have room for
    ``RETRACT_DECODE_STEPS`` more steps each: the next retraction comes no sooner than that
    (one at a time, it came every few steps). Tokens equal HF's; once flushed, nothing is held."""
    from actors.engine.schedule_batch import RETRACT_DECODE_STEPS

    model_dir = checkpoints["llama"]
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, page_size=4, max_total_tokens=128,
                    init_new_token_ratio=0.05, chunked_prefill_size=-1)
    sched, rng, out_len = engine.scheduler, random.Random(1), 40
    prompts = [[rng.randrange(5, VOCAB_SIZE) for _ in range(rng.randint(6, 20))] for _ in range(6)]

    def run():
        reqs = [engine._make_req({"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}, None, p, f"r{i}")
                for i, p in enumerate(prompts)]
        for req in reqs:
            sched.add_request(req)
        rounds = []  # (step, the running batch before it, those it retracted)
        for step in range(400):
            if not sched.has_work():
                return reqs, rounds
            before = list(sched.running)
            sched.step()
            retracted = [r for r in before if any(r is w for w in sched.waiting)]
            if retracted:
                rounds.append((step, before, retracted))
        raise AssertionError("the requests did not finish in 400 steps")

    engine.loop.pause()
    try:
        reqs, rounds = engine.loop.run_exclusive(run)
    finally:
        engine.loop.resume()
    try:
        assert rounds and sched.num_retractions > len(rounds)  # some round retracted several at once
        for step, before, retracted in rounds:
            by_rule = sorted(before, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
            assert {r.rid for r in retracted} == {r.rid for r in by_rule[: len(retracted)]}
        steps = [step for step, _, _ in rounds]
        assert all(b - a >= RETRACT_DECODE_STEPS for a, b in zip(steps, steps[1:])), f"retracted at steps {steps}"
        assert_greedy_parity(model_dir, prompts, [r.output_ids for r in reqs], out_len, [])
        assert_nothing_held(engine)
    finally:
        engine.shutdown()


def test_retracting_the_last_running_request_keeps_the_decode_reserve(checkpoints):
    """The only running request cannot get its next decode slot (the rest of the pool is held
    elsewhere: a PD decode worker's transfer reservations, say): it is retracted and waits. The
    ratio is then estimated from it, not from an empty batch — that gave 0, below
    ``min_new_token_ratio``, and the next admissions reserved nothing for decode right after an
    out-of-memory. Once the slots are given back it finishes with HF's tokens."""
    engine = Engine(model_path=checkpoints["llama"], skip_tokenizer_init=True, page_size=4, max_total_tokens=64)
    sched, alloc, out_len = engine.scheduler, engine.runner.allocator, 12
    prompt = list(range(5, 13))

    def run():
        req = engine._make_req({"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}, None, prompt, "a")
        sched.add_request(req)
        while len(req.output_ids) < 5:  # its KV fills its pages to the brim: its next token starts a page
            sched.step()
        before = sched.new_token_ratio
        assert sched.evictable_tokens() == 0  # (its prompt's pages are locked by it)
        held = alloc.alloc(alloc.available_size())
        sched.step()
        retracted = (list(sched.running), [r.rid for r in sched.waiting], sched.num_retractions, sched.new_token_ratio)
        alloc.free(held)
        while sched.has_work():
            sched.step()
        return req, before, retracted

    engine.loop.pause()
    try:
        req, before, (running, waiting, retractions, ratio) = engine.loop.run_exclusive(run)
    finally:
        engine.loop.resume()
    try:
        assert (running, waiting, retractions) == ([], ["a"], 1)
        assert ratio >= max(before, engine.config.min_new_token_ratio), (before, ratio)
        assert_greedy_parity(checkpoints["llama"], [prompt], [req.output_ids], out_len, [])
        assert_nothing_held(engine)
    finally:
        engine.shutdown()
