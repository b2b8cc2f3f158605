"""The fused dequant-GEMM of a GPTQ / AWQ layer (:mod:`.wna16`) on CUDA: ``y = x @ W`` where each tile of
``W`` [in, out] is unpacked from its int32 words, its zeros and scales read by group, and dequantized to the
activation's dtype in registers (vLLM's Triton AWQ GEMM and GPTQ kernels): the dense weight is never
written to memory, where the torch path writes it whole every forward.

One program computes ``BLOCK_M`` rows × ``BLOCK_N`` output features, ``BLOCK_K`` input features a step,
accumulating in fp32 (IEEE fp32 products for fp32 activations and under the CPU interpreter, which computes
bf16 arithmetic wrongly, as :mod:`.fused_moe`). On the CPU it runs under ``TRITON_INTERPRET=1`` (the tests'
small shapes); the served path takes it on CUDA only.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton import knobs


@triton.jit
def dequantize_tile(QWeight, QZeros, Scales, offs_k, offs_n, g, mask, zero_add, zero_point,
                    stride_qk, stride_qn, stride_zg, stride_zn, stride_sg, stride_sn,
                    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr):
    """The fp32 tile ``(q[k, n] - zero[g, n]) · scale[g, n]`` of inputs ``offs_k`` × outputs ``offs_n``,
    ``mask``'s elements (others 0), ``g`` each element's group ([K, 1] or, where outputs differ, [K, N]), each
    tensor addressed by its (input or group, output) strides. ``q``: packed down K (GPTQ's ``[K / pack, N]``,
    compressed-tensors' ``[N, K / pack]``) or, with ``AWQ``, along N in AutoAWQ's order; the zeros packed along
    N as ``q``'s order, plus ``zero_add`` (GPTQ v1 stores them minus one); without ``HAS_ZEROS`` every zero is
    ``zero_point`` (compressed-tensors' symmetric values, stored plus it). Shared by the packed linear and the
    fused MoE (:mod:`.moe_wna16`)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if AWQ:  # feature 8c + j in nibble AWQ_REVERSE_ORDER[j] = j // 2 + (j % 2) * 4 of word c
        j = offs_n % 8
        n_shift = ((j // 2 + (j % 2) * 4) * 4).to(tl.int32)
        words = tl.load(QWeight + offs_k[:, None] * stride_qk + (offs_n // 8)[None, :] * stride_qn, mask=mask, other=0)
        q = (words >> n_shift[None, :]) & MASK
    else:
        n_shift = ((offs_n % PACK) * BITS).to(tl.int32)
        words = tl.load(QWeight + (offs_k // PACK)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask,
                        other=0)
        q = (words >> ((offs_k % PACK) * BITS).to(tl.int32)[:, None]) & MASK
    if HAS_ZEROS:
        zeros = tl.load(QZeros + g * stride_zg + (offs_n // PACK)[None, :] * stride_zn, mask=mask, other=0)
        q -= ((zeros >> n_shift[None, :]) & MASK) + zero_add
    else:
        q -= zero_point
    scales = tl.load(Scales + g * stride_sg + offs_n[None, :] * stride_sn, mask=mask, other=0.0)
    return q.to(tl.float32) * scales


@triton.jit
def _packed_gemm_kernel(
    X, QWeight, QZeros, Scales, GIdx, Y, M, N, K, group_size,
    stride_xm, stride_xk, stride_qr, stride_qc, stride_zr, stride_zc, stride_sr, stride_sc, stride_ym, stride_yn,
    BITS: tl.constexpr, AWQ: tl.constexpr, HAS_G_IDX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """``Y[m, n] = sum_k X[m, k] · (q[k, n] - zero[g(k), n]) · scale[g(k), n]``, ``g(k)`` = ``GIdx[k]`` with
    ``HAS_G_IDX`` (act-order) else ``k // group_size``. GPTQ: ``q`` packed down K in ``QWeight`` [K / pack,
    N], zeros stored minus one; ``AWQ``: ``q`` packed along N [K, N / 8] in AutoAWQ's order, as the zeros."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        k_mask = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_G_IDX:
            g = tl.load(GIdx + offs_k, mask=k_mask, other=0).to(tl.int64)
        else:
            g = offs_k // group_size
        w = dequantize_tile(QWeight, QZeros, Scales, offs_k, offs_n, g[:, None], k_mask[:, None] & n_mask[None, :],
                            0 if AWQ else 1, 0, stride_qr, stride_qc, stride_zr, stride_zc, stride_sr, stride_sc,
                            BITS, AWQ, True).to(X.dtype.element_ty)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, acc.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def packed_linear(x: torch.Tensor, module: torch.nn.Module, awq: bool,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [..., in] times packed ``module``'s weight (``awq``: AWQ's layout, else GPTQ's) plus ``bias``:
    [..., out] in ``x``'s dtype."""
    quant = module.packed
    rows = x.reshape(-1, x.shape[-1])
    (m, k), n = rows.shape, module.out_features
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m = 16 if m <= 16 else 64
        group_size = k if quant.group_size == -1 else quant.group_size
        g_idx = module.g_idx if quant.desc_act else module.scales  # (unread without act-order)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        _packed_gemm_kernel[grid](
            rows, module.qweight, module.qzeros, module.scales, g_idx, y, m, n, k, group_size,
            *rows.stride(), *module.qweight.stride(), *module.qzeros.stride(), *module.scales.stride(), *y.stride(),
            BITS=quant.bits, AWQ=awq, HAS_G_IDX=quant.desc_act, BLOCK_M=block_m, BLOCK_N=64,
            BLOCK_K=64, IEEE=knobs.runtime.interpret or x.dtype == torch.float32,
        )
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], n)
