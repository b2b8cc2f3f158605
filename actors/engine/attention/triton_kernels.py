"""Triton attention over the paged KV cache, for extend and decode alike.

One program computes ``BLOCK_M`` query tokens of one request and one head:
it walks the request's context ``[lo, hi)`` in blocks of ``BLOCK_N`` slots read
from its ``req_to_token`` row, gathers K and V by slot, and keeps an online
softmax. Query ``j`` of the request sits at position ``prefix_len + j`` and sees
keys at positions ``<= its own`` (and ``> position - window`` with a sliding
window). A layer's attention sinks (GPT-OSS: a logit per head that joins the
softmax's denominator, with no value) start each query's online softmax: its
running max at the sink, its sum at ``e^0 = 1``. Arithmetic is fp32 throughout
(the CPU interpreter computes bf16 wrongly; on GPU the dot products run in IEEE
fp32, which keeps greedy parity with the PyTorch reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out, ReqToToken, ReqIdx, SeqLens, PrefixLens, ExtendLens, StartLoc, Sinks,
    sm_scale, logit_cap, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_r,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b)
    if m_block * BLOCK_M < extend_len:
        prefix = tl.load(PrefixLens + b)
        seq_len = tl.load(SeqLens + b)
        start = tl.load(StartLoc + b)
        row = tl.load(ReqIdx + b).to(tl.int64)
        kv_head = h // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_ptrs = Q + (start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        q_pos = prefix + offs_m

        if USE_SINKS:
            m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(Sinks + h).to(tl.float32)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        hi = tl.minimum(seq_len, prefix + (m_block + 1) * BLOCK_M)
        lo = 0
        if USE_WINDOW:
            lo = tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            slots = tl.load(ReqToToken + row * stride_r + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(K + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                        mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
            if USE_CAP:
                qk = logit_cap * (2.0 * tl.sigmoid(2.0 * qk / logit_cap) - 1.0)
            visible = mask_m[:, None] & mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(V + slots[:, None] * stride_vs + kv_head * stride_vh + offs_dv[None, :],
                        mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = Out + (start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & (offs_dv[None, :] < DV))


def paged_attention(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
    start_loc: torch.Tensor, max_extend_len: int, sm_scale: float, sliding_window=None, logit_cap=None,
    v_head_dim=None, sinks=None,
) -> torch.Tensor:
    """``q`` [tokens, heads, D] → [tokens, heads, Dv] attention over each request's context
    (``sinks``: the layer's per-head sink logits, or None)."""
    num_tokens, num_heads, head_dim = q.shape
    dv = v_head_dim or v_buffer.shape[-1]
    out = q.new_empty(num_tokens, num_heads, dv)
    block_m = 16
    block_d, block_dv = max(16, triton.next_power_of_2(head_dim)), max(16, triton.next_power_of_2(dv))
    block_n, launch = _launch_config(q.device.type, max(block_d, block_dv))
    grid = (seq_lens.numel(), num_heads, triton.cdiv(max_extend_len, block_m))
    _paged_attention_kernel[grid](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens, prefix_lens, extend_lens, start_loc,
        q if sinks is None else sinks.contiguous(), sm_scale, float(logit_cap or 0.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        GROUP=num_heads // k_buffer.shape[1], D=head_dim, DV=dv,
        BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_M=block_m, BLOCK_N=block_n, USE_WINDOW=bool(sliding_window), USE_CAP=bool(logit_cap),
        USE_SINKS=sinks is not None, **launch,
    )
    return out


def _launch_config(device_type: str, block_d: int):
    """``(BLOCK_N, launch options)``. On a GPU the K / V tiles (fp32, ``BLOCK_N × BLOCK_D``) are
    held to 16K elements, so wide heads — Gemma 3's 256, MLA's 576-wide latent + rope — do not
    outgrow shared memory and registers; those also get more warps and no software pipelining
    (each stage would hold another tile). The interpreter (CPU) runs a program's loop in Python,
    so its cost is per iteration, nearly whatever the tile: it takes 64-slot blocks, as a GPU does
    for heads up to 256 wide (contexts of a few hundred tokens still span several blocks, so the
    tests run the online softmax across blocks). 16-slot blocks made the interpreted tests 2-4x
    slower."""
    if device_type == "cpu":
        return 64, {}
    block_n = max(16, min(64, 16384 // block_d))
    wide = block_d >= 512
    return block_n, {"num_warps": 8 if wide else 4, "num_stages": 1 if wide else 2}
