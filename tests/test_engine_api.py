"""The offline API around the loop thread: streaming, abort, stop ids, errors."""

import asyncio

import pytest
import torch

from actors.engine import Engine
from actors.engine.engine_loop import Post, hand_over
from tests.pd_helpers import pause_once


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=128, vocab_size=384, max_position_embeddings=256, dtype="float32")
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    eng = Engine(model_path=str(path), skip_tokenizer_init=True, max_total_tokens=2048)
    yield eng
    eng.shutdown()


GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def test_stream_yields_growing_outputs_ending_in_the_full_result(engine):
    async def collect():
        chunks = []
        async for chunk in await engine.async_generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY, stream=True):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(collect())
    full = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
    assert chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    engine.check_integrity()


def test_each_streamed_output_keeps_its_own_top_logprobs(engine):
    """A streamed output is the request as that step left it, its top logprobs too: they were the
    request's own list, which later steps grew (a worker's Ray packed a result while the engine
    thread appended to it: msgpack wrote more items than it had counted, a RaySystemError, a 500)."""
    params = {**GREEDY, "return_logprob": True, "top_logprobs_num": 2}

    async def collect():
        return [chunk async for chunk in await engine.async_generate(input_ids=[5, 6, 7], sampling_params=params,
                                                                    stream=True)]

    chunks = asyncio.run(collect())
    assert len(chunks) == 12
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"]) == len(chunk["output_ids"])
    engine.check_integrity()


def test_concurrent_async_requests(engine):
    async def many():
        return await asyncio.gather(*(engine.async_generate(input_ids=[i + 3, 9, 9], sampling_params=GREEDY) for i in range(6)))

    outs = asyncio.run(many())
    singles = [engine.generate(input_ids=[i + 3, 9, 9], sampling_params=GREEDY) for i in range(6)]
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in singles]
    engine.check_integrity()


def test_a_step_wakes_each_event_loop_once_not_once_per_stream(engine, monkeypatch):
    """Every ``call_soon_threadsafe`` writes the event loop's self-pipe and wakes it: a decode
    step handed over per stream cost one wakeup per request; a step's outputs go in one."""
    num_streams, params = 16, {**GREEDY, "max_new_tokens": 6}
    steps = []  # per step: whether it produced output
    step = engine.scheduler.step
    monkeypatch.setattr(engine.scheduler, "step", lambda: steps.append(bool(out := step())) or out)

    async def stream(i):
        return [c async for c in await engine.async_generate(input_ids=[i + 3, 7, 7], sampling_params=params,
                                                             stream=True)]

    async def many():
        loop, wakeups = asyncio.get_running_loop(), []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wakeups.append(args) or schedule(*args)
        engine.loop.pause()  # all submitted before the first step: they prefill and decode together
        streams = [asyncio.ensure_future(stream(i)) for i in range(num_streams)]
        await asyncio.sleep(0)
        engine.loop.resume()
        chunks = await asyncio.gather(*streams)
        del loop.call_soon_threadsafe
        return chunks, len(wakeups)

    chunks, wakeups = asyncio.run(many())
    assert [len(c) for c in chunks] == [6] * num_streams  # every step's output, in order
    assert all([len(x["output_ids"]) for x in c] == list(range(1, 7)) for c in chunks)
    assert wakeups == sum(steps) <= 7
    engine.check_integrity()


def test_hand_over_drops_a_closed_event_loops_posts_and_keeps_the_others():
    """A caller's event loop that is gone loses its outputs only; a post that raises does not
    keep the step's later posts from their callers."""
    gone = asyncio.new_event_loop()
    gone.close()
    got = []

    async def deliver():
        loop = asyncio.get_running_loop()
        hand_over([Post(gone, got.append, ("lost",)), Post(loop, got.append, (1,)), Post(loop, int, ("x",)),
                   Post(loop, got.append, (2,))])
        await asyncio.sleep(0)

    asyncio.run(deliver())
    assert got == [1, 2]


def test_stop_token_ids_end_generation_on_that_token(engine):
    ref = engine.generate(input_ids=[11, 12, 13], sampling_params=GREEDY)["output_ids"]
    stop = ref[4]
    out = engine.generate(input_ids=[11, 12, 13], sampling_params={**GREEDY, "stop_token_ids": [stop]})
    assert out["output_ids"] == ref[: ref.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_logit_bias_forces_tokens_and_min_new_tokens_holds_off_eos_and_stop_token_ids(engine):
    """One batch: a +100 bias forces its token at every step; a plain row beside it is unchanged;
    with ``min_new_tokens`` 4 the stop token greedy emits first and EOS — both biased up to win
    every step — are masked for the first 4 tokens (prefill's and decode's), then the stop token
    ends it at once."""
    ids = [11, 12, 13]
    ref = engine.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    stop, eos = ref[0], engine.eos_token_ids[0]
    forced = 40 if 40 not in ref[:6] else 41
    held = {**GREEDY, "ignore_eos": False, "stop_token_ids": [stop], "min_new_tokens": 4,
            "logit_bias": {str(stop): 100, str(eos): 90}}
    outs = engine.generate(input_ids=[ids, ids, ids], sampling_params=[
        {**GREEDY, "max_new_tokens": 6, "logit_bias": {str(forced): 100}}, {**GREEDY, "max_new_tokens": 6}, held])
    assert outs[0]["output_ids"] == [forced] * 6 and outs[1]["output_ids"] == ref[:6]
    held_ids = outs[2]["output_ids"]
    assert len(held_ids) == 5 and not {stop, eos} & set(held_ids[:4]) and held_ids[4] == stop, held_ids
    assert outs[2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    alone = engine.generate(input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [stop]})
    assert alone["output_ids"] == [stop]  # without min_new_tokens the first token ends it
    with pytest.raises(ValueError, match="logit_bias: token id 384 is out of the vocabulary"):
        engine.generate(input_ids=ids, sampling_params={**GREEDY, "logit_bias": {"384": 1}})
    engine.check_integrity()


def test_a_seeded_request_samples_the_same_alone_or_batched_with_its_logprobs(engine):
    """Sampled on the device in one batch (prefill's and decode's): a seeded request gives the
    same tokens and raw logprobs alone as beside greedy, unseeded and other seeded requests
    (in another position); its top logprobs come best first, with its token's own value."""
    ids = [21, 22, 23]
    seeded = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 123, "max_new_tokens": 10, "ignore_eos": True,
              "return_logprob": True, "top_logprobs_num": 3}
    alone = engine.generate(input_ids=ids, sampling_params=seeded)
    outs = engine.generate(input_ids=[[5, 6, 7], [9, 8], ids, ids], sampling_params=[
        GREEDY, {**GREEDY, "temperature": 0.8}, seeded, {**seeded, "seed": 124}])
    assert outs[2]["output_ids"] == alone["output_ids"] and outs[3]["output_ids"] != alone["output_ids"]
    assert outs[1]["output_ids"] != engine.generate(input_ids=[9, 8], sampling_params=GREEDY)["output_ids"]
    got, want = outs[2]["meta_info"], alone["meta_info"]
    assert [t for _, t in got["output_token_logprobs"]] == alone["output_ids"]
    assert [lp for lp, _ in got["output_token_logprobs"]] == pytest.approx(
        [lp for lp, _ in want["output_token_logprobs"]], abs=1e-4)
    for (logprob, token), top in zip(got["output_token_logprobs"], got["output_top_logprobs"]):
        values = [v for _, v in top]
        assert len(top) == 3 and values == sorted(values, reverse=True) and logprob <= values[0]
        assert dict(top).get(token, logprob) == logprob  # (its own logprob when it is among them)
    engine.check_integrity()


def test_abort_a_running_request(engine):
    # the loop holds the victim after its third token (200 could all be out before a slow host's reader saw three)
    paused = pause_once(engine, lambda: any(len(r.output_ids) >= 3 for r in engine.scheduler.running))

    async def run_and_abort():
        stream = await engine.async_generate(input_ids=[1, 2, 3], rid="victim", stream=True,
                                             sampling_params={**GREEDY, "max_new_tokens": 200})
        seen, aborted = [], False
        async for chunk in stream:
            seen.append(chunk)
            if paused.is_set() and not aborted:  # held: still running
                assert engine.abort("victim")
                aborted = True
                engine.loop.resume()
        return seen

    seen = asyncio.run(run_and_abort())
    assert seen[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(seen[-1]["output_ids"]) < 200
    engine.check_integrity()


def test_bad_requests_fail_clearly_and_lose_nothing(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate(input_ids=[])
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=list(range(1, 300)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(input_ids=[1], sampling_params={"max_new_tokens": -1})
    with pytest.raises(ValueError, match="pass input_ids"):
        engine.generate(prompt="hello")
    engine.check_integrity()


@pytest.mark.parametrize("argument, value, fits", [
    ("sampling_params", [GREEDY, GREEDY], [GREEDY] * 3), ("rid", ["a", "b"], ["a", "b", "c"]),
    ("priority", [0, 0, 0, 0], [0, 0, 0]), ("lora_path", [None], [None] * 3)])
def test_a_per_request_list_of_another_length_than_the_batch_is_refused(engine, argument, value, fits):
    """A list of one per request shorter or longer than the batch names itself (a zip dropped the prompts
    past the shortest: three prompts with two sampling_params answered two)."""
    with pytest.raises(ValueError, match=f"^{argument}: {len(value)} entries for 3 prompt"):
        engine.generate(input_ids=[[5, 6], [7, 8], [9]], **{argument: value})
    with pytest.raises(ValueError, match="sampling_params: 2 entries for 1 prompt"):
        engine.generate(input_ids=[5, 6], sampling_params=[GREEDY, GREEDY])
    assert len(engine.generate(input_ids=[[5, 6], [7, 8], [9]], **{argument: fits})) == 3
    engine.check_integrity()


def test_a_request_is_held_to_what_the_kv_pool_holds(engine):
    """A 128-slot pool under a 256-token context: a request may be 127 tokens long. Asking for
    1000 new tokens ends at that length with the big engine's tokens (such a request used to
    wait forever for a reservation no pool could give); a longer prompt is refused clearly."""
    small = Engine(model_path=engine.runner.config.model_path, skip_tokenizer_init=True, max_total_tokens=128)
    try:
        assert small.scheduler.context_len == 127 < small.runner.context_len
        prompt = [(7 * i) % 380 + 3 for i in range(100)]

        async def bounded():
            return await asyncio.wait_for(small.async_generate(
                input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}), 60)

        out = asyncio.run(bounded())
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 27}
        want = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 27, "ignore_eos": True})
        assert out["output_ids"] == want["output_ids"]
        with pytest.raises(ValueError, match="context length 127 .*KV pool"):
            small.generate(input_ids=prompt + prompt[:27])
        small.check_integrity()
    finally:
        small.shutdown()


def test_a_failing_forward_fails_its_requests_and_releases_their_memory(engine, monkeypatch):
    real_forward = engine.runner.forward
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device error")
        return real_forward(batch)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected device error"):
        engine.generate(input_ids=[[7, 8, 9], [10, 11]], sampling_params=GREEDY)
    engine.check_integrity()
    assert len(engine.generate(input_ids=[7, 8, 9], sampling_params=GREEDY)["output_ids"]) == 12


def test_a_failure_while_planning_a_batch_unlocks_the_prefixes_it_locked(engine, monkeypatch):
    """Admission locks each new request's cached prefix before it plans the batch; if planning
    raises after that (here: making the forward batch), the requests have no row yet, so the
    loop's failure path cannot release them: the plan gives their locks back itself."""
    import actors.engine.schedule_policy as scheduler_module

    prefix = list(range(20, 60))
    engine.generate(input_ids=[prefix + [1, 2]], sampling_params=GREEDY)  # the prefix is cached now

    def broken(*args, **kwargs):
        raise RuntimeError("injected planning error")

    monkeypatch.setattr(scheduler_module, "prepare_for_extend", broken)
    with pytest.raises(RuntimeError, match="injected planning error"):
        engine.generate(input_ids=[prefix + [3, 4], prefix + [5, 6]], sampling_params=GREEDY)
    monkeypatch.undo()
    engine.check_integrity()  # (a lock left on the prefix: protected tokens, "slot leak")
    out = engine.generate(input_ids=prefix + [3, 4], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] >= 40 and len(out["output_ids"]) == 12


def test_a_failure_while_planning_fails_a_chunked_request_in_progress_too(engine, monkeypatch):
    """A chunked prefill in progress sits in no queue while the next batch is planned; a failure
    then must still end it (and give its row back), not lose it."""
    import actors.engine.schedule_policy as scheduler_module

    chunked = Engine(model_path=engine.config.model_path, skip_tokenizer_init=True, max_total_tokens=512,
                     chunked_prefill_size=32)
    try:
        real, calls = scheduler_module.prepare_for_extend, {"n": 0}

        def second_chunk_fails(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected planning error")
            return real(*args, **kwargs)

        monkeypatch.setattr(scheduler_module, "prepare_for_extend", second_chunk_fails)
        with pytest.raises(RuntimeError, match="injected planning error"):
            chunked.generate(input_ids=list(range(10, 110)), sampling_params=GREEDY)  # 100 tokens: 4 chunks
        monkeypatch.undo()
        chunked.check_integrity()  # (lost, it held its row: "request-row leak")
        assert len(chunked.generate(input_ids=list(range(10, 110)), sampling_params=GREEDY)["output_ids"]) == 12
    finally:
        chunked.shutdown()


def test_a_request_is_equal_only_to_itself():
    """The queues' ``in`` and ``remove`` find a request by identity: another request with the
    same fields is a different request (compared field by field, they cost every prefill batch
    milliseconds, and the tensors among the fields made the comparison raise)."""
    from actors.engine.req import Req
    from actors.engine.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=4)
    first, twin = Req("r", [5, 6, 7], params), Req("r", [5, 6, 7], params)
    queue = [first, twin]
    queue.remove(twin)
    assert queue == [first] and queue[0] is first
    assert twin not in queue and first in queue
    assert len({first, twin}) == 2
