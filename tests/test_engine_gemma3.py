"""Gemma 3 (sliding-window + full layers) through the engine on its real SWA pools:
parity with HF when prompts and generations run past the window, with chunks,
prefix hits (the window still there, or slid out), retraction, both backends.

The tiny checkpoint's window is 16 tokens, so 20–50-token sequences exceed it.
"""

import random

import pydantic
import pytest
import torch

from actors.engine import Engine
from actors.engine.tiny import build_tiny_checkpoint
from mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from mem_cache.swa_memory_pool import SWAKVPool
from mem_cache.swa_radix_cache import SWARadixCache
from tests.parity import assert_greedy_parity
from tests.test_spec_decode_swa import verify_steps  # noqa: F401 (a fixture)

WINDOW = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3") / "m", seed=0))


def make_engine(model_dir, backend="torch", **kwargs):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    kwargs.setdefault("max_total_tokens", 2048)
    return Engine(model_path=model_dir, skip_tokenizer_init=True, attention_backend=backend, device=device, **kwargs)


def run_and_check(engine, model_dir, prompts, max_new_tokens):
    """Generate greedily, hold the tokens against HF's, check the idle engine; returns the results."""
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert_greedy_parity(model_dir, prompts, [o["output_ids"] for o in outs], max_new_tokens)
    engine.check_integrity()
    return outs


def tombstones(tree: SWARadixCache):
    return [n for n in tree._iter_nodes() if n.swa_tombstone]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])  # ~20 s interpreted
def test_gemma3_parity_on_swa_pools_past_the_window(model_dir, backend):
    rng = random.Random(1)
    system = [rng.randrange(5, 261) for _ in range(24)]  # longer than the window
    batch = [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 9)] + [[7, 8, 9]]
    engine = make_engine(model_dir, backend, chunked_prefill_size=8, swa_full_tokens_ratio=0.5)
    pool, alloc = engine.runner.token_to_kv_pool, engine.runner.allocator
    assert isinstance(pool, SWAKVPool) and isinstance(alloc, SWATokenToKVPoolAllocator)
    assert (alloc.size, alloc.size_swa, pool.swa_layer_nums, pool.full_layer_nums) == (2048, 1024, 3, 1)
    assert isinstance(engine.scheduler.tree_cache, SWARadixCache)
    run_and_check(engine, model_dir, batch, 20)
    assert tombstones(engine.scheduler.tree_cache)  # decoded tokens slid out of the window: SWA freed
    again = run_and_check(engine, model_dir, [system + [11, 12]], 8)
    assert again[0]["meta_info"]["cached_tokens"] == 24  # the system prompt's window still has SWA KV
    engine.shutdown()


def test_gemma3_prompts_longer_than_the_swa_pool(model_dir):
    """The SWA pool holds prefill chunks plus windows, not the prompt: prompts of 150-200
    tokens through a 128-slot SWA pool in 32-token chunks (earlier chunks' SWA KV is evicted
    from the tree as the prompt goes on) give HF's tokens; they used to wait forever. Without
    chunks a request is held to what the SWA pool holds besides a window (longer: a clear error)."""
    rng = random.Random(3)
    batch = [[rng.randrange(5, 261) for _ in range(n)] for n in (150, 200)]
    engine = make_engine(model_dir, max_total_tokens=512, swa_full_tokens_ratio=0.25, chunked_prefill_size=32)
    assert engine.runner.allocator.size_swa == 128 and engine.scheduler.context_len == 511
    run_and_check(engine, model_dir, batch, 12)
    engine.shutdown()
    engine = make_engine(model_dir, max_total_tokens=512, swa_full_tokens_ratio=0.25, chunked_prefill_size=-1)
    assert engine.scheduler.context_len == 128 - WINDOW - 1
    with pytest.raises(ValueError, match="context length 111 .*KV pool"):
        engine.generate(input_ids=batch[0])
    run_and_check(engine, model_dir, [batch[0][:100]], 11)  # held to the 111 tokens
    engine.shutdown()


def test_gemma3_prefix_match_stops_where_the_window_slid_out(model_dir):
    rng = random.Random(2)
    prompt = [rng.randrange(5, 261) for _ in range(20)]
    engine = make_engine(model_dir)
    first = run_and_check(engine, model_dir, [prompt], 30)[0]
    seq = prompt + first["output_ids"][:29]  # 49 tokens with KV; the last sampled one has none
    # cached: [0, 20) prompt with SWA, [20, 32) slid out of the window (a tombstone), [32, 49) with SWA
    tree = engine.scheduler.tree_cache
    assert [len(n.key) for n in tombstones(tree)] == [49 - 20 - WINDOW - 1]
    cases = {26: 20, 40: 20, 49: 49}  # matched length → usable prefix: a window of SWA KV before its end
    prompts = [seq[:n] + [99] for n in cases]
    outs = run_and_check(engine, model_dir, prompts, 6)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == list(cases.values())
    engine.shutdown()


def test_gemma3_swa_eviction_tombstones_a_shared_prefix_while_requests_run(model_dir):
    """Two requests reuse a cached 24-token system prompt. Once their chunks are cached their
    locks cover only their windows (their own 20-token suffixes), so when decode runs short
    of SWA slots the system prompt's SWA KV is evicted: it becomes a tombstone. A match
    through it is usable only where a whole window with SWA KV follows; the next request
    that computes the system prompt revives it."""
    rng = random.Random(3)
    system = [rng.randrange(5, 261) for _ in range(24)]
    shared = [system + [rng.randrange(5, 261) for _ in range(20)] for _ in range(2)]
    # 80 SWA slots: 25 cached + 2 × 20 prefilled, then 2 × 16 decode slots do not fit
    engine = make_engine(model_dir, max_total_tokens=320, swa_full_tokens_ratio=0.25, init_new_token_ratio=0.1)
    tree = engine.scheduler.tree_cache
    run_and_check(engine, model_dir, [system + [4]], 1)
    outs = run_and_check(engine, model_dir, shared, 17)  # 17: no decoded token leaves the window
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [24, 24]
    assert engine.scheduler.num_retractions == 0
    assert [len(n.key) for n in tombstones(tree)] == [24]
    outs = run_and_check(engine, model_dir, [shared[0] + [5], system + [6, 7]], 4)
    # a window of 20 tokens with SWA after the tombstone → usable; ending in the tombstone → nothing
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [44, 0]
    system_node = tree.root_node.children[system[0]]  # the second request computed it: revived
    assert len(system_node.key) == 24 and not system_node.swa_tombstone
    engine.flush_cache()  # full eviction takes the tombstones with their last children
    assert not tree.root_node.children
    engine.check_integrity()
    engine.shutdown()


@pytest.mark.parametrize("disable_radix_cache, swa_full_tokens_ratio", [(False, 0.5), (True, 1.0)])
def test_gemma3_retraction_when_a_pool_runs_short(model_dir, monkeypatch, verify_steps, disable_radix_cache,
                                                  swa_full_tokens_ratio):
    """With the tree the SWA pool runs short, full slots to spare (the chunks' SWA KV is cached until
    evicted); without it a decoding request's SWA KV stays one window (each step frees a slot as it
    takes one), so the full pool runs short. Either way the retracted requests come back: HF's tokens."""
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 261) for _ in range(n)] for n in (18, 22, 26, 20)]
    engine = make_engine(model_dir, max_total_tokens=120, swa_full_tokens_ratio=swa_full_tokens_ratio,
                         chunked_prefill_size=8, init_new_token_ratio=0.1,  # admit optimistically: decode runs short
                         disable_radix_cache=disable_radix_cache)
    sched, alloc = engine.scheduler, engine.runner.allocator
    free_at_retraction, retract = [], sched._retract_decode

    def recording_retract():
        free = (alloc.full_available_size(), alloc.swa_available_size())
        free_at_retraction.append(free if disable_radix_cache else free[::-1])  # (the short pool's, the other's)
        return retract()

    monkeypatch.setattr(sched, "_retract_decode", recording_retract)
    run_and_check(engine, model_dir, prompts, 30)
    assert sched.num_retractions > 0
    assert all(short < len(prompts) <= spare for short, spare in free_at_retraction), free_at_retraction
    engine.shutdown()


@pytest.mark.parametrize("page_size", [1, 4])
def test_gemma3_without_the_prefix_cache(model_dir, verify_steps, page_size):
    """disable_radix_cache (SGLang's SWAChunkCache): HF's tokens for prompts of 150-200 tokens through a
    128-slot SWA pool in 32-token chunks — each chunk frees the SWA KV its prompt slid out of the window
    (no tree evicts it), as every decode step does — beside two prompts sharing 24 tokens, which nothing
    reuses. Every forward's rows hold SWA KV only from their windows on (``verify_steps``); at the end
    every slot of both pools is free."""
    rng = random.Random(7)
    system = [rng.randrange(5, 261) for _ in range(24)]
    batch = [[rng.randrange(5, 261) for _ in range(n)] for n in (150, 200)]
    batch += [system + [rng.randrange(5, 261) for _ in range(n)] for n in (3, 9)]
    engine = make_engine(model_dir, page_size=page_size, max_total_tokens=512, swa_full_tokens_ratio=0.25,
                         chunked_prefill_size=32, disable_radix_cache=True)
    outs = run_and_check(engine, model_dir, batch, 12)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * 4
    alloc = engine.runner.allocator
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (512, 128)
    engine.shutdown()


def test_gemma3_memory_budget_is_spread_over_both_pools(model_dir, monkeypatch):
    from actors.engine import model_runner

    # 1,000 tokens of its 4 fp32 layers (1,024 B each), as if every layer were full
    total = 8 * 2**30
    monkeypatch.setattr(model_runner, "get_device_memory", lambda device: (total // 2 + 1000 * 1024, total))
    engine = make_engine(model_dir, max_total_tokens=None, swa_full_tokens_ratio=0.5, mem_fraction_static=0.5)
    alloc = engine.runner.allocator
    assert (alloc.size, alloc.size_swa) == (1600, 800)  # 1 full + 3 SWA layers: 1600 + 3 × 800 = 4 × 1000
    engine.shutdown()


def test_gemma3_paged_parity_with_a_window_hit_and_swa_eviction(model_dir, monkeypatch):
    """page_size 4 (SGLang serves SWA models paged) in 8-token chunks: decoding past the window
    tombstones whole pages; a match reaching past them is reused to its last page boundary (a
    whole window of SWA pages before it), one ending in them up to the page boundary before the
    tombstone (a window of SWA pages before it too); a 64-slot SWA pool makes the next batch
    evict the tree's SWA pages. HF's tokens throughout."""
    rng = random.Random(5)
    prompt = [rng.randrange(5, 261) for _ in range(21)]
    engine = make_engine(model_dir, page_size=4, max_total_tokens=256, swa_full_tokens_ratio=0.25,
                         chunked_prefill_size=8)
    tree = engine.scheduler.tree_cache
    assert (tree.page_size, engine.runner.allocator.size_swa) == (4, 64)
    first = run_and_check(engine, model_dir, [prompt], 30)[0]
    seq = prompt + first["output_ids"][:29]  # 50 tokens with KV: [0, 48) cached, the tail page freed
    # chunks cached [0, 8) [8, 16) [16, 20) with SWA; decoding slid [20, 32) out; [32, 48) the last window
    chain = [(len(n.key), n.swa_tombstone) for n in tree._iter_nodes()]  # one path: root to leaf
    assert chain == [(8, False), (8, False), (4, False), (12, True), (16, False)]
    swa_evicted, evict = [], tree.evict

    def recording_evict(*args):
        result = evict(*args)
        swa_evicted.append(result.swa_num_evicted)
        return result

    monkeypatch.setattr(tree, "evict", recording_evict)
    prompts = [seq[:50] + [99], seq[:26] + [99], [rng.randrange(5, 261) for _ in range(40)]]
    outs = run_and_check(engine, model_dir, prompts, 6)
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [48, 20, 0]
    assert sum(swa_evicted) > 0
    engine.flush_cache()
    assert not tree.root_node.children
    engine.check_integrity()
    engine.shutdown()


def test_gemma3_rejects_what_the_swa_cache_cannot_serve(model_dir):
    with pytest.raises(pydantic.ValidationError, match="swa_full_tokens_ratio"):
        make_engine(model_dir, swa_full_tokens_ratio=0.0)
    with pytest.raises(ValueError, match="24 SWA slots for a window of 16, page_size 8.* cannot hold a single request"):
        make_engine(model_dir, max_total_tokens=96, swa_full_tokens_ratio=0.25, page_size=8)  # (it served nothing)


def test_gemma3_final_soft_cap_runs_in_the_model_dtype(model_dir, monkeypatch):
    """bf16: the capped logits are HF's bit for bit — ``tanh(logits / cap) * cap`` rounded
    in bf16, then cast to fp32 for the sampler (capping after the cast differs in the low bits).
    Both models get the same final hidden states; only ``lm_head`` and the cap run. A score's two
    logits (``classifier_token_ids``) are capped as well: HF's at those ids."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from actors.engine.model_loader import load_model

    cap = 2.0
    ours, config, _ = load_model(model_dir, "bfloat16", "cpu")
    ours.final_logit_softcap = cap
    hf = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.bfloat16,
                                              final_logit_softcapping=cap).eval()
    gen = torch.Generator().manual_seed(0)
    hidden = (4 * torch.randn(3, config.hidden_size, generator=gen)).to(torch.bfloat16)
    monkeypatch.setattr(ours.model, "forward", lambda forward_batch, input_embeds=None: hidden)
    monkeypatch.setattr(hf.model, "forward", lambda **kw: BaseModelOutputWithPast(last_hidden_state=hidden[None]))
    with torch.no_grad():
        out = ours(SimpleNamespace(logits_token_indices=lambda: torch.arange(3), input_logprob_indices=None,
                                   embed_indices=torch.arange(3), classifier_token_ids=torch.tensor([[3, 9]] * 3)))
        got = out.next_token_logits
        want = hf(input_ids=torch.zeros(1, 3, dtype=torch.long)).logits[0]
        fp32_capped = torch.tanh(ours.lm_head(hidden).float() / cap) * cap
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16
    assert torch.equal(got, want.float())
    assert not torch.equal(got, fp32_capped)  # (the two orders differ on these logits)
    torch.testing.assert_close(out.classifier_logits, want.float()[:, [3, 9]], rtol=0, atol=0.02)
    assert out.classifier_logits.abs().max() <= cap


@pytest.mark.parametrize("page_size, lens, max_new_tokens, pools", [
    (4, (5,) * 10, 1, (256, 64)),  # a 5-token prompt takes 8 SWA slots: two pages, not 5 tokens and a slack page
    (32, (5, 9, 13, 3, 7, 11), 32, (1024, 256)),  # the 16-token window in 32-slot pages: 64 slots at decode
    (4, (7,) * 10, 3, (256, 64)),  # a running request's last 2 tokens start a page: 4 SWA slots each, not 2
])
def test_gemma3_paged_admission_plans_only_what_allocates(model_dir, monkeypatch, page_size, lens, max_new_tokens,
                                                          pools):
    """Paged, a request's SWA KV is whole pages: its prompt's (rounded up) and at decode a window
    from ``window_start``, ``ceil(window / page)`` pages, plus the newest token's page. The
    admission estimate counts them so, with each request's decode reserve in its own pages
    and taken whole (ratio 1): every
    planned prefill batch allocates as planned and no decode step retracts."""
    import actors.engine.schedule_policy as schedule_policy

    rng = random.Random(6)
    prompts = [[rng.randrange(5, 261) for _ in range(n)] for n in lens]
    size, size_swa = pools
    engine = make_engine(model_dir, page_size=page_size, max_total_tokens=size, swa_full_tokens_ratio=size_swa / size,
                         init_new_token_ratio=1.0, min_new_token_ratio=1.0)
    assert engine.runner.allocator.size_swa == size_swa
    sched, planned, prepare = engine.scheduler, [], schedule_policy.prepare_for_extend

    def recording_prepare(reqs, *args):
        out = prepare(reqs, *args)
        planned.append((len(reqs), out is not None))
        return out

    monkeypatch.setattr(schedule_policy, "prepare_for_extend", recording_prepare)
    run_and_check(engine, model_dir, prompts, max_new_tokens)
    assert all(ok for _, ok in planned) and len(planned) > 1, planned  # the pool held back some of them
    assert sched.num_retractions == 0
    engine.shutdown()
