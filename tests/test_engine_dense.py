"""Engine on a dense GQA model: greedy tokens equal HF transformers' through
every path (batching, prefix hits, chunked prefill, retraction, paging)."""

import random
import threading

import pytest
import torch

from actors.engine import Engine
from actors.engine.attention import torch_backend
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from mem_cache.integrity import IntegrityError
from tests.parity import assert_greedy_parity


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                  intermediate_size=128, vocab_size=384, max_position_embeddings=512, dtype="float32")
    torch.manual_seed(0)
    if request.param == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return str(path)


def prompts(n, lo, hi, seed=0, shared=()):
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(3, 384) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(model_dir, batch, max_new_tokens=12, **engine_args):
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, **engine_args)
    outs = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in outs], max_new_tokens, engine.eos_token_ids)
    engine.check_integrity()
    return engine, outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_batch_of_different_lengths(model_dir, page_size):
    run(model_dir, prompts(5, 1, 40), page_size=page_size, max_total_tokens=4096)


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_is_reused(model_dir, page_size, monkeypatch):
    """The cached system prompt is long enough that the torch backend attends it in cascade,
    once for the whole batch's query tokens, in prefill (all the new ones) and decode (one each)."""
    cascades = []
    attend_shared = torch_backend.attend_shared
    monkeypatch.setattr(torch_backend, "attend_shared",
                        lambda q, *kv_layer: cascades.append(q.shape[0]) or attend_shared(q, *kv_layer))
    system = prompts(1, 80, 80, seed=7)[0]
    engine, first = run(model_dir, prompts(1, 5, 5, shared=system), page_size=page_size, max_total_tokens=4096)
    batch = prompts(3, 3, 9, seed=1, shared=system)
    second = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": 8, "temperature": 0})
    assert all(o["meta_info"]["cached_tokens"] >= 80 // page_size * page_size for o in second)
    new_tokens = sum(len(p) - o["meta_info"]["cached_tokens"] for p, o in zip(batch, second))
    assert set(cascades) == {new_tokens, 3}  # all three requests a family, on every layer
    assert_greedy_parity(model_dir, batch, [o["output_ids"] for o in second], 8, engine.eos_token_ids)
    engine.check_integrity()


def test_no_cache(model_dir):
    system = prompts(1, 30, 30, seed=3)[0]
    engine, outs = run(model_dir, prompts(3, 2, 6, shared=system), disable_radix_cache=True, max_total_tokens=4096)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert engine.scheduler.tree_cache.evictable_size() == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_smaller_than_prompt(model_dir, page_size):
    engine, _ = run(model_dir, prompts(3, 30, 60), chunked_prefill_size=8, page_size=page_size, max_total_tokens=4096)


def test_a_kept_row_that_lost_its_prefix_stops_the_step_in_debug_mode(model_dir, monkeypatch):
    """A continuing chunk's row gets no prefix written (``write_extend``: ``cache_unfinished_req``
    pointed it at the tree's slots). In debug mode a kept row that does not hold its prefix stops
    the step before anything is allocated — its forward would have read other KV, silently; the
    row as the cache left it passes, and the greedy tokens are HF's."""
    monkeypatch.setenv("RAYDIX_DEBUG_MEMORY_POOL", "1")
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=1024, page_size=4,
                    chunked_prefill_size=8)
    try:
        sched, prompt = engine.scheduler, prompts(1, 30, 30, seed=11)[0]
        req = Req("r", prompt, SamplingParams(max_new_tokens=6, temperature=0.0))
        req.eos_token_ids = engine.eos_token_ids
        table, allocator = sched.runner.req_to_token_pool.req_to_token, sched.runner.allocator

        def scenario():
            sched.add_request(req)
            sched.step()
            assert sched.chunked_req is req and len(req.prefix_indices) == 8
            kept, free = int(table[req.req_pool_idx, 3]), allocator.available_size()
            table[req.req_pool_idx, 3] = kept + 1
            with pytest.raises(IntegrityError, match="does not hold its 8-token prefix"):
                sched.step()
            assert sched.chunked_req is req and allocator.available_size() == free
            table[req.req_pool_idx, 3] = kept
            while sched.has_work():
                sched.step()

        engine.loop.run_exclusive(scenario)
        assert_greedy_parity(model_dir, [prompt], [req.output_ids], 6, engine.eos_token_ids)
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_retraction_when_the_pool_is_small(model_dir):
    engine, outs = run(model_dir, prompts(6, 8, 12, seed=5), max_new_tokens=40, max_total_tokens=160,
                       max_running_requests=6, chunked_prefill_size=-1)
    assert engine.scheduler.num_retractions > 0
    assert all(o["meta_info"]["completion_tokens"] == 40 or o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    # idle again, the ratio a retraction raised goes back to its start (SGLang's idle self-check): left
    # high, it decays 0.001 a decode step and every later admission over-reserves for hundreds of steps
    assert engine.scheduler.new_token_ratio == engine.config.init_new_token_ratio


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "lof", "random"])
def test_schedule_policies(model_dir, policy):
    """Each policy admits in its own order (three rows: the order decides which batch a request is in)."""
    system = prompts(1, 20, 20, seed=9)[0]
    run(model_dir, prompts(4, 2, 5, shared=system) + prompts(2, 4, 8, seed=2), schedule_policy=policy,
        max_total_tokens=4096, max_running_requests=3)


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_attention_backend(model_dir, page_size):
    system = prompts(1, 20, 20, seed=4)[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled kernels need CUDA tensors
    engine, _ = run(model_dir, prompts(2, 3, 8, shared=system), max_new_tokens=4, page_size=page_size,
                    attention_backend="triton", device=device, max_total_tokens=1024)
    again = engine.generate(input_ids=prompts(1, 4, 4, seed=8, shared=system), sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert again[0]["meta_info"]["cached_tokens"] >= 16
    engine.check_integrity()


def test_the_auto_attention_backend_is_torch_on_the_cpu(model_dir):
    """``auto`` (the default) takes triton on CUDA, where the torch backend would copy each
    layer's K/V into padded fp32 tables, and torch on the CPU, where Triton runs interpreted."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256)
    try:
        assert engine.config.attention_backend == "auto"
        assert type(engine.runner.attn_backend).__module__.endswith("torch_backend")
    finally:
        engine.shutdown()


def test_bad_engine_args_name_the_field(model_dir):
    with pytest.raises(ValueError, match="page_size"):
        Engine(model_path=model_dir, page_size=0)
    with pytest.raises(ValueError, match="schedule_policy"):
        Engine(model_path=model_dir, schedule_policy="shortest-first")
    with pytest.raises(ValueError, match="schedule_policy 'dfs-weight' .* disable_radix_cache"):
        Engine(model_path=model_dir, schedule_policy="dfs-weight", disable_radix_cache=True)


def test_the_hf_reference_sees_a_pad_id_inside_the_prompt(model_dir):
    """The oracle itself: a follow-up turn holds the model's earlier answer, which may contain
    the pad id (0). HF's generate, given no attention mask, made one that hid those tokens, so
    its reference was another prompt's (hybrid-model conversations failed parity on it)."""
    from tests.parity import hf_greedy, hf_model

    prompt = prompts(1, 20, 20, seed=9)[0]
    prompt[7] = 0
    _, logits = hf_greedy(model_dir, prompt, 1, ())
    with torch.no_grad():
        expected = hf_model(model_dir)(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], expected)


def test_next_turns_whose_locked_prefixes_leave_too_little_room_are_admitted_in_turn(model_dir):
    """Four conversations' next turns arrive together. Their cached first turns count as
    evictable room when the batch is planned, but admitting a turn locks its prefix: the
    scheduler picked all four, the allocation failed, the locks went back — and the same
    plan was made at every step, forever. Room taken by each lock now counts at once."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, max_total_tokens=256, page_size=4,
                    chunked_prefill_size=-1)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = prompts(4, 32, 32, seed=21)
    answers = engine.generate(input_ids=first, sampling_params=params)
    follow = [p + a["output_ids"] + q for p, a, q in zip(first, answers, prompts(4, 32, 32, seed=22))]
    done = []
    worker = threading.Thread(target=lambda: done.append(engine.generate(input_ids=follow, sampling_params=params)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "the next turns were never admitted"
    assert all(o["meta_info"]["cached_tokens"] >= 32 for o in done[0][:1])
    assert_greedy_parity(model_dir, follow, [o["output_ids"] for o in done[0]], 8, [])
    engine.check_integrity()
    engine.shutdown()
