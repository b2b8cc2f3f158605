"""The Triton paged-attention kernel equals the PyTorch reference backend
(extend with prefixes, decode, GQA, sliding window, soft cap, attention sinks)."""

import pytest
import torch

from actors.engine.attention import create_attention_backend
from actors.engine.forward_batch import ForwardBatch, ForwardMode
from actors.engine.layers import RadixAttention
from mem_cache.memory_pool import MHATokenToKVPool
from mem_cache.req_to_token_pool import ReqToTokenPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(prefix, extend, heads=4, kv_heads=2, head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pool = MHATokenToKVPool(512, 1, torch.float32, kv_heads, head_dim, 1, device=DEVICE)
    rows = ReqToTokenPool(4, 256, DEVICE)
    seq = [p + e for p, e in zip(prefix, extend)]
    slots = (torch.randperm(511, generator=gen)[: sum(seq)] + 1).tolist()
    offset = 0
    for i, s in enumerate(seq):
        rows.req_to_token[i, :s] = torch.tensor(slots[offset : offset + s], dtype=torch.int32)
        offset += s
    pool.k_buffer[0].copy_(torch.randn(513, kv_heads, head_dim, generator=gen))  # size + page_size rows
    pool.v_buffer[0].copy_(torch.randn(513, kv_heads, head_dim, generator=gen))
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    starts = [sum(extend[:i]) for i in range(len(extend))]
    mode = ForwardMode.DECODE if all(e == 1 for e in extend) else ForwardMode.EXTEND
    fb = ForwardBatch(
        mode, t([0] * sum(extend)), t([0] * sum(extend)), t([0] * sum(extend)), t(list(range(len(seq)))), t(seq),
        t(prefix), t(extend), t(starts), rows, pool, seq_lens_cpu=seq, extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=list(extend),
    )
    q = torch.randn(sum(extend), heads, head_dim, generator=gen).to(DEVICE)
    return q, fb


@pytest.mark.parametrize(
    "prefix, extend, window, cap, sinks",
    [
        ([0, 5, 17], [9, 3, 20], None, None, False),  # extend, with and without prefixes
        ([12, 40, 1], [1, 1, 1], None, None, False),  # decode
        ([0, 30], [25, 2], 8, None, False),  # sliding window
        ([3], [18], None, 3.0, False),  # soft cap
        # a window far past the first 64-slot block (the kernel starts each query block's walk at its
        # first query's window), for extend (two 16-row query blocks) and decode, soft-capped
        ([190, 80], [20, 1], 8, 2.0, False),
        # attention sinks (GPT-OSS): extend and decode, full and sliding-window
        ([0, 5, 70], [9, 3, 1], None, None, True),
        ([0, 90], [25, 1], 8, None, True),
    ],
)
def test_triton_matches_torch(prefix, extend, window, cap, sinks):
    q, fb = make_batch(prefix, extend)
    layer = RadixAttention(0, 4, 16, 2, 16**-0.5, sliding_window=window, logit_cap=cap)
    sink_logits = torch.tensor([-1.0, 0.5, 2.0, 4.0], device=DEVICE) if sinks else None  # some outweigh the keys
    outs = []
    for name in ("torch", "triton"):
        backend = create_attention_backend(name)
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, layer, fb, sink_logits))
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5)


def test_unknown_backend_lists_known_ones():
    with pytest.raises(ValueError, match="torch, triton"):
        create_attention_backend("flashinfer")


def test_triton_on_the_cpu_without_its_interpreter_is_refused_at_build(monkeypatch):
    """Without ``TRITON_INTERPRET=1`` a Triton kernel on the CPU failed at its first launch,
    deep in a forward, with Triton's "0 active drivers"; now the backend (attention or the
    paged allocator's) refuses to be built, naming the fix."""
    from mem_cache.allocator import PagedTokenToKVPoolAllocator

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend='triton'.*TRITON_INTERPRET=1"):
        create_attention_backend("triton", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="backend='triton'.*TRITON_INTERPRET=1"):
        PagedTokenToKVPoolAllocator(64, 4, device="cpu", backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert create_attention_backend("triton", device=torch.device("cpu")) is not None


@pytest.mark.parametrize("value", ["true", "on", "yes"])
def test_triton_interpret_spelled_as_triton_reads_it_is_taken(monkeypatch, value):
    """Triton turns its interpreter on for ``TRITON_INTERPRET`` 1, true, on or yes (any case);
    the build check took only "1" and refused a CPU setup that runs."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert create_attention_backend("triton", device=torch.device("cpu")) is not None


def _reference(q, k, v, slots, prefix, sm_scale):
    """One request: queries at positions ``prefix + j`` over keys ``slots[: prefix + j + 1]``."""
    keys, values = k[slots, 0].float(), v[slots, 0].float()
    scores = torch.einsum("thd,sd->ths", q.float(), keys) * sm_scale
    pos = torch.arange(len(slots), device=q.device)
    visible = pos[None, :] <= (prefix + torch.arange(q.shape[0], device=q.device))[:, None]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("ths,sd->thd", scores.softmax(-1), values)


@pytest.mark.parametrize("head_dim,v_dim", [(128, 128), (256, 256), (576, 512)])
def test_triton_kernel_at_real_head_sizes(head_dim, v_dim):
    """Llama's 128, Gemma 3's 256 and DeepSeek's MLA (576-wide latent + rope keys, 512-wide
    values read from the same rows): on a GPU this is the launch configuration the tiny test
    models never reach (tiles that must fit shared memory)."""
    from actors.engine.attention.triton_kernels import paged_attention

    gen = torch.Generator().manual_seed(head_dim)
    prefix, extend, heads = 10, 20, 2
    kv = torch.randn(64, 1, head_dim, generator=gen).to(DEVICE)
    v = kv[..., :v_dim] if v_dim != head_dim else torch.randn(64, 1, v_dim, generator=gen).to(DEVICE)
    slots = (torch.randperm(63, generator=gen)[: prefix + extend] + 1).to(DEVICE)
    table = torch.zeros(1, 64, dtype=torch.int32, device=DEVICE)
    table[0, : prefix + extend] = slots.to(torch.int32)
    q = torch.randn(extend, heads, head_dim, generator=gen).to(DEVICE)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    out = paged_attention(q, kv, v, table, t([0]), t([prefix + extend]), t([prefix]), t([extend]), t([0]), extend,
                          head_dim**-0.5, v_head_dim=v_dim)
    torch.testing.assert_close(out, _reference(q, kv, v, slots, prefix, head_dim**-0.5), atol=1e-4, rtol=1e-4)
