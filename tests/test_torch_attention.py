"""The batched PyTorch attention backend equals attention written out one query at a time
(random pools and slots, long prefixes, decode and extend, GQA, MLA-like narrower values, sliding
windows read through an SWA slot map, soft caps, pool dtypes, prefixes shared by families of
requests, attention sinks), however it groups and chunks; a sliding-window layer gathers only the keys in its
queries' windows, a chunk of queries at a time; a full-attention layer gathers a family's shared
prefix once."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from actors.engine.attention import torch_backend
from actors.engine.attention.torch_backend import (MAX_CHUNK_BYTES, MIN_SHARED_LEN, MIN_WINDOW_ROWS, TorchAttnBackend,
                                                   pack_requests, window_start)
from actors.engine.forward_batch import ForwardBatch, ForwardMode
from actors.engine.layers import RadixAttention
from mem_cache.req_to_token_pool import ReqToTokenPool

POOL_ROWS = 128
POISON = POOL_ROWS - 1  # a slot of NaN K/V: where keys slid out of the window point (an SWA pool frees them)
MAX_CONTEXT = 160


class OneLayerPool:
    """K/V buffers of one layer, like MLA's (values the first ``v_head_dim`` columns of the keys)
    when ``v`` is None; with ``swa_map``, full slots translate to its rows, as an SWA layer's do."""

    def __init__(self, k, v, swa_map):
        self.k, self.v, self.swa_map = k, (k if v is None else v), swa_map

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v

    def translate_layer_loc(self, layer_id, loc):
        return loc if self.swa_map is None else self.swa_map[loc]


def brute_force(q, layer, fb, sinks=None) -> torch.Tensor:
    """Each query of each request over the keys it may see, in float64; ``sinks``: a logit per head
    in the softmax with no value (GPT-OSS's attention sinks)."""
    pool, out = fb.token_to_kv_pool, torch.zeros(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=torch.float64)
    per_kv = layer.num_heads // layer.num_kv_heads
    for i, (prefix, num_q) in enumerate(zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu)):
        start = int(fb.extend_start_loc[i])
        row = fb.req_to_token_pool.req_to_token[int(fb.req_pool_indices[i])].to(torch.int64)
        for j in range(num_q):
            pos = prefix + j
            first = 0 if layer.sliding_window is None else max(0, pos - layer.sliding_window + 1)
            slots = pool.translate_layer_loc(0, row[first : pos + 1])
            for h in range(layer.num_heads):
                k = pool.k[slots, h // per_kv].to(q.dtype).double()
                v = pool.v[slots, h // per_kv, : layer.v_head_dim].to(q.dtype).double()
                scores = k @ q[start + j, h].double() * layer.scaling
                if layer.logit_cap:
                    scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                out[start + j, h] = scores.softmax(0)[: len(slots)] @ v
    return out.to(q.dtype)


@st.composite
def cases(draw):
    decode = draw(st.booleans())
    num_reqs = draw(st.integers(1, 5))
    # long extends run in several query chunks, each over its own window of keys
    extend = [1 if decode else draw(st.integers(1, 16) | st.integers(17, MAX_CONTEXT)) for _ in range(num_reqs)]
    prefix = [draw(st.integers(0, MAX_CONTEXT - e)) for e in extend]  # mostly longer than the window
    if decode:
        prefix = [max(p, 1) for p in prefix]
    head_dim = draw(st.sampled_from([4, 8]))
    return dict(
        prefix=prefix, extend=extend, kv_heads=draw(st.integers(1, 2)), per_kv=draw(st.integers(1, 3)),
        head_dim=head_dim, v_head_dim=draw(st.sampled_from([None, head_dim // 2])),  # None: own V buffer
        window=draw(st.none() | st.integers(1, 64)), cap=draw(st.none() | st.floats(0.5, 5.0)),
        swa=draw(st.booleans()), dtypes=draw(st.sampled_from([(torch.float32,) * 2, (torch.bfloat16, torch.float32),
                                                            (torch.bfloat16,) * 2])),
        max_chunk_bytes=draw(st.sampled_from([MAX_CHUNK_BYTES, 1, 2048, 16384])),
        min_window_rows=draw(st.sampled_from([MIN_WINDOW_ROWS, 1, 8])), seed=draw(st.integers(0, 2**16)),
        sinks=draw(st.booleans()),
    )


@st.composite
def family_cases(draw):
    """Full attention over requests in up to two families, each of whose rows begin with the
    family's slots, up to 16 before the request's first query (a radix-cached prefix) or past it
    (only the slots before it are a prefix to share) or far before it (a long conversation after
    a short system prompt), and requests of their own; shared prefixes shorter and longer than
    ``min_shared_len``; the two families nested in one that shares fewer (or more) slots."""
    case = draw(cases())
    decode = all(e == 1 for e in case["extend"])
    family_of = draw(st.lists(st.integers(0, 2), min_size=2, max_size=5))  # 0: a request of its own
    num_slots = [0] + [draw(st.integers(1, 112)) for _ in range(2)]
    prefix = [max(0, num_slots[f] + draw(st.integers(-16, 16) | st.integers(17, MAX_CONTEXT - 1 - num_slots[f])))
              if f else draw(st.integers(0, 128)) for f in family_of]
    extend = [1 if decode else draw(st.integers(1, min(32, MAX_CONTEXT - p))) for p in prefix]
    shared = [([i for i, f in enumerate(family_of) if f == family], num_slots[family]) for family in (1, 2)]
    if draw(st.booleans()):  # (applied last: the families' rows keep their own slots past it)
        shared.append(([i for i, f in enumerate(family_of) if f], draw(st.integers(1, 112))))
    case.update(prefix=prefix, extend=extend, window=None, shared=[(members, n) for members, n in shared if members],
                max_chunk_bytes=draw(st.sampled_from([MAX_CHUNK_BYTES, 16384, 4096, 512])),
                min_shared_len=draw(st.sampled_from([MIN_SHARED_LEN, 1, 8])))
    return case


def make_case(prefix, extend, kv_heads, per_kv, head_dim, v_head_dim, window, cap, swa, dtypes, seed, shared=(), **_):
    """``shared``: (requests, slots): the requests' rows begin with the first's slots, as many as
    all their contexts hold, up to ``slots``."""
    gen = torch.Generator().manual_seed(seed)
    pool_dtype, q_dtype = dtypes
    seq = [p + e for p, e in zip(prefix, extend)]
    k = torch.randn(POOL_ROWS, kv_heads, head_dim, generator=gen).to(pool_dtype)
    v = None if v_head_dim else torch.randn(POOL_ROWS, kv_heads, head_dim, generator=gen).to(pool_dtype)
    k[POISON] = float("nan")
    if v is not None:
        v[POISON] = float("nan")
    swa_map = None
    if swa:  # any row but the poisoned one (0 as a freed SWA slot reads), which maps to itself
        swa_map = torch.randint(0, POISON, (POOL_ROWS,), generator=gen).index_fill_(0, torch.tensor(POISON), POISON)
    rows = ReqToTokenPool(8, MAX_CONTEXT, "cpu")
    rows.req_to_token.fill_(10 * POOL_ROWS)  # past seq_len: no slot at all, so padding must not read it
    row_ids = torch.randperm(8, generator=gen)[: len(seq)]
    for row, seq_len, p in zip(row_ids.tolist(), seq, prefix):  # slots may repeat across requests (shared prefixes)
        rows.req_to_token[row, :seq_len] = torch.randint(1, POISON, (seq_len,), generator=gen, dtype=torch.int32)
    for family, num_slots in shared:
        num_slots = min([num_slots] + [seq[i] for i in family])
        rows.req_to_token[row_ids[family[1:]], :num_slots] = rows.req_to_token[row_ids[family[0]], :num_slots]
    for row, p in zip(row_ids.tolist(), prefix):
        rows.req_to_token[row, : window_start(p, window)] = POISON  # no query of this forward sees these
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    starts = [sum(extend[:i]) for i in range(len(extend))]
    mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.EXTEND
    zeros = t([0] * sum(extend))
    fb = ForwardBatch(
        mode, zeros, zeros, zeros, row_ids, t(seq), t(prefix), t(extend), t(starts), rows,
        OneLayerPool(k, v, swa_map), seq_lens_cpu=seq, extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=list(extend),
    )
    layer = RadixAttention(0, kv_heads * per_kv, head_dim, kv_heads, head_dim**-0.5, v_head_dim=v_head_dim,
                           sliding_window=window, logit_cap=cap)
    q = torch.randn(sum(extend), kv_heads * per_kv, head_dim, generator=gen).to(q_dtype)
    return q, layer, fb


def case_sinks(case):
    """The case's sink logits, one a head (about as large as its scores, so they weigh), or None."""
    if not case.get("sinks"):
        return None
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    return torch.randn(case["kv_heads"] * case["per_kv"], generator=gen) * 2


def check_against_brute_force(case, backend: TorchAttnBackend) -> None:
    q, layer, fb = make_case(**case)
    sinks = case_sinks(case)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, layer, fb, sinks)
    tol = 1e-5 if q.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out, brute_force(q, layer, fb, sinks), atol=tol, rtol=tol)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_batched_attention_equals_one_query_at_a_time(case):
    check_against_brute_force(case, TorchAttnBackend(max_chunk_bytes=case["max_chunk_bytes"],
                                                     min_window_rows=case["min_window_rows"]))


@settings(max_examples=150, deadline=None)
@given(family_cases())
def test_families_attend_their_shared_prefix_in_cascade_as_one_query_at_a_time(case):
    """Cascade (the shared prefix attended once for a family, merged with each member's own keys
    by log-sum-exp) equals attention over each request's whole context."""
    check_against_brute_force(case, TorchAttnBackend(max_chunk_bytes=case["max_chunk_bytes"],
                                                     min_shared_len=case["min_shared_len"]))


@pytest.mark.parametrize("min_shared_len, families, groups", [
    (64, [([0, 1], 0, 70), ([2, 3], 0, 80)], [[4, 1], [2], [3], [0]]),
    (16, [([0, 1, 2, 3], 0, 40), ([0, 1], 40, 70), ([2, 3], 40, 80)], [[4, 1], [2], [3], [0]]),  # nested
    (75, [([2, 3], 0, 80)], [[1, 4], [0], [2], [3]]),  # the first family's prefix is too short
    (81, [], [[1, 2, 4, 3], [0]]),  # both are
])
def test_a_family_gathers_its_shared_prefix_once_a_layer(monkeypatch, min_shared_len, families, groups):
    """Decode after 70 and 150 tokens that begin with the same 70 slots, 95 and 85 that begin
    with the same 80, the four with the same 40, and 88 of their own: each family reads its
    prefix's K/V once (one row) for all its members, however different their lengths, a nested
    one the slots past its outer one's; then requests, packed by the keys past their prefixes
    (1, 81, 16, 6 and 89 in families of 70 and 80 slots), read those."""
    reads = []
    context_kv_slots = torch_backend.context_kv_slots
    monkeypatch.setattr(torch_backend, "context_kv_slots", lambda fb, layer, slots: reads.append(
        slots.tolist()) or context_kv_slots(fb, layer, slots))
    case = dict(prefix=[70, 150, 95, 85, 88], extend=[1] * 5, kv_heads=2, per_kv=2, head_dim=8, v_head_dim=None,
                window=None, cap=None, swa=False, dtypes=(torch.float32,) * 2, seed=0,
                shared=[([0, 1], 70), ([2, 3], 80), ([0, 1, 2, 3], 40)])
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend(min_shared_len=min_shared_len)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, layer, fb), brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)
    seq = [p + 1 for p in case["prefix"]]
    shared_lens = [max([stop for members, _, stop in families if i in members], default=0) for i in range(5)]
    assert [(group.seq_lens, group.shared_lens) for group in backend.layer_groups(layer)] == [
        ([seq[i] for i in members], [shared_lens[i] for i in members]) for members in groups]
    req_rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices].tolist()
    expected = [[req_rows[members[0]][start:stop]] for members, start, stop in families]
    for members in groups:
        num_k = max(seq[i] - shared_lens[i] for i in members)
        expected.append([req_rows[i][shared_lens[i] : seq[i]] + [0] * (num_k - seq[i] + shared_lens[i])
                         for i in members])
    assert reads == expected


def test_requests_pack_by_length_within_the_padding_bound():
    """Each request pads at most 2× its score cells: like contexts share a group, a long one
    attends alone, and the memory bound splits a group of like requests."""
    fits = lambda b, max_k: True  # noqa: E731
    assert pack_requests([100, 1000, 90, 95], [1] * 4, fits) == [[1], [0, 3, 2]]
    assert pack_requests([300, 20, 24, 18], [300, 20, 24, 18], fits) == [[0], [2, 1, 3]]
    # after a prefix, one new token each: padding is over keys only
    assert pack_requests([64, 40, 33], [1, 1, 1], fits) == [[0, 1, 2]]
    assert pack_requests([10] * 4, [1] * 4, lambda b, max_k: b <= 2) == [[0, 1], [2, 3]]


def test_a_long_prompt_runs_in_query_chunks_within_the_memory_bound(monkeypatch):
    """Scores of a 48-token prompt (4 heads, fp32) are 36 KiB; at an 8 KiB bound its queries run
    in chunks of at most 10 rows, each over the keys they may see."""
    case = dict(prefix=[0], extend=[48], kv_heads=2, per_kv=2, head_dim=8, v_head_dim=None, window=None, cap=None,
                swa=False, dtypes=(torch.float32,) * 2, seed=0)
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend(max_chunk_bytes=8192)
    calls = []
    attend_rows = TorchAttnBackend.attend_rows
    monkeypatch.setattr(TorchAttnBackend, "attend_rows", staticmethod(
        lambda q, layer, fb, group, start, stop, *rest: calls.append((start, stop)) or attend_rows(
            q, layer, fb, group, start, stop, *rest)))
    backend.init_forward_metadata(fb)
    out = backend.forward(q, layer, fb)
    assert calls == [(0, 10), (10, 20), (20, 30), (30, 40), (40, 48)]
    torch.testing.assert_close(out, brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)


def test_a_sliding_window_layer_gathers_only_the_keys_its_queries_see(monkeypatch):
    """Decode after 100 and 70 tokens and a 10-token extend after 60, window 8: the sliding-window
    layer's tables hold each request's keys from its first query's window on (8 and 17 columns);
    the full layer's, whole contexts (101 and 70 columns, the shorter row padded with slot 0)."""
    reads = []
    context_kv_slots = torch_backend.context_kv_slots
    monkeypatch.setattr(torch_backend, "context_kv_slots", lambda fb, layer, slots: reads.append(
        slots.tolist()) or context_kv_slots(fb, layer, slots))
    case = dict(prefix=[100, 60, 70], extend=[1, 10, 1], kv_heads=1, per_kv=2, head_dim=8, v_head_dim=None,
                window=8, cap=None, swa=False, dtypes=(torch.float32,) * 2, seed=0)
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend()
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, layer, fb), brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)
    layer.sliding_window = None
    backend.forward(q, layer, fb)
    req_rows = fb.req_to_token_pool.req_to_token[fb.req_pool_indices].tolist()
    assert reads == [
        [req_rows[0][93:101], req_rows[2][63:71]], [req_rows[1][53:70]],  # groups [0, 2] and [1]
        [req_rows[0][:101], req_rows[2][:71] + [0] * 30], [req_rows[1][:70]],
    ]


def test_a_long_prompt_on_a_sliding_window_layer_gathers_a_chunk_of_queries_and_their_window_at_a_time(monkeypatch):
    """A 160-token prompt, window 8, chunks of 16 queries: each chunk's table holds the keys from
    its first query's window to its last query (at most 16 + 7 columns, whatever the prompt's
    length); the full layer's, the whole prompt."""
    reads = []
    context_kv_slots = torch_backend.context_kv_slots
    monkeypatch.setattr(torch_backend, "context_kv_slots", lambda fb, layer, slots: reads.append(
        slots.tolist()) or context_kv_slots(fb, layer, slots))
    case = dict(prefix=[0], extend=[MAX_CONTEXT], kv_heads=1, per_kv=2, head_dim=8, v_head_dim=None, window=8,
                cap=None, swa=True, dtypes=(torch.float32,) * 2, seed=0)
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend(min_window_rows=16)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(q, layer, fb), brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)
    layer.sliding_window = None
    backend.forward(q, layer, fb)
    row = fb.req_to_token_pool.req_to_token[fb.req_pool_indices[0]].tolist()
    assert reads == [[row[max(0, start - 7) : start + 16]] for start in range(0, MAX_CONTEXT, 16)] + [[row[:MAX_CONTEXT]]]


class LargestTensor(TorchDispatchMode):
    """Records the bytes of the largest tensor any op makes while active."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("prefix, extend, cap, shared", [
    ([0], [MAX_CONTEXT], None, []),
    ([100, 100], [60, 60], 2.0, [([0, 1], 100)]),  # scores written out: 120 queries × 100 shared keys, 47 KiB
])
def test_a_long_prompt_makes_no_tensor_larger_than_the_memory_bound(prefix, extend, cap, shared):
    """A 160-token prompt's causal mask over its keys alone is 100 KiB of fp32, and a family's
    120 new tokens over its 100 shared keys are 47 KiB of scores; at a 16 KiB bound every tensor
    the forward makes (masks included) stays within it."""
    case = dict(prefix=prefix, extend=extend, kv_heads=1, per_kv=1, head_dim=8, v_head_dim=None, window=None,
                cap=cap, swa=False, dtypes=(torch.float32,) * 2, seed=0, shared=shared)
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend(max_chunk_bytes=16384)
    backend.init_forward_metadata(fb)
    with LargestTensor() as largest:
        out = backend.forward(q, layer, fb)
    assert 0 < largest.nbytes <= 16384
    assert len(backend.batch_families()[0]) == len(shared)
    torch.testing.assert_close(out, brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)


class HostReads(TorchDispatchMode):
    """Records the ops that read tensor values back to the host (on CUDA, a sync): an output
    whose shape depends on them (``nonzero``, boolean-mask indexing) or a scalar read."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masks = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.dtype == torch.bool]
        if func in (torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                    torch.ops.aten._local_scalar_dense.default) or (
                func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default) and masks):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("window, prefix, shared", [(16, [60, 50], []), (None, [80, 75], [([0, 1], 70)])])
def test_a_layer_reads_nothing_back_to_the_host(window, prefix, shared):
    """Once the first layer has built the forward's groups, a layer (here of one group, its
    shorter request's row padded, through an SWA map; or a family, in cascade) runs on the device
    alone: nothing in it waits for CUDA."""
    case = dict(prefix=prefix, extend=[1, 2], kv_heads=1, per_kv=2, head_dim=8, v_head_dim=None, window=window,
                cap=None, swa=True, dtypes=(torch.float32,) * 2, seed=0, shared=shared)
    q, layer, fb = make_case(**case)
    backend = TorchAttnBackend()
    backend.init_forward_metadata(fb)
    backend.forward(q, layer, fb)
    with HostReads() as host_reads:
        out = backend.forward(q, layer, fb)
    assert [group.shared_lens for group in backend.layer_groups(layer)] == [[70, 70] if shared else [0, 0]]
    assert host_reads.ops == []
    torch.testing.assert_close(out, brute_force(q, layer, fb), atol=1e-5, rtol=1e-5)
