"""The routed experts of an MoE layer as two grouped-GEMM launches (SGLang's and vLLM's Triton fused MoE).

:func:`moe_align_block_size` sorts the (token, slot) pairs of a batch's routing by expert, each expert's run
padded to a multiple of ``BLOCK_M``, so that one block of rows multiplies by one expert's matrix; one launch
of :func:`grouped_gemm` then computes every pair's gate and up projections at once (the experts' stacked
``w13`` [experts, 2·intermediate, hidden]), the activation runs over them, and a second launch the down
projection (``w2`` [experts, hidden, intermediate]), each pair's row times its routing weight; a sum over the
top-k slots gives each token's output. Nothing on the path reads a tensor on the host: the number of blocks
is launched for the most a batch can need (``pairs + experts·(BLOCK_M - 1)`` rows) and a block past the
batch's padded end returns at once. A batch with LoRA adapters on the experts adds each pair's deltas by the
same grouped GEMM, the pairs sorted by (adapter slot, expert) and each group's A then B its matrices
(:mod:`.lora_experts`). GPT-OSS's experts run their 3-D weights as they are stored (read transposed by strides),
its per-expert biases added in the kernel and its clamped SwiGLU between.

The GEMM accumulates in fp32. Under the CPU interpreter (which computes bf16 arithmetic wrongly) and for fp32
models, it multiplies in IEEE fp32; on CUDA a bf16/fp16 model's tiles go to the tensor cores as they are.
Block-FP8 weights (:mod:`.fp8`) are dequantized in the kernel, each weight tile times its blocks' scales and
cast to the activation's dtype (what :class:`parallel.LinearBase` does to the whole weight per forward);
compressed-tensors' FP8 / int8 values alike, their per-tensor, per-channel or group scales each a block (a
part's whole matrix, a row, a row's group: :func:`.moe_wna16.scale_block`); packed GPTQ / AWQ /
compressed-tensors ones too, each tile unpacked from its int32 words (:mod:`.moe_wna16`).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
from torch import nn
from triton import knobs

from actors.engine import moe_wna16
from actors.engine.wna16_kernels import dequantize_tile


def moe_align_block_size(expert_of: torch.Tensor, num_experts: int,
                         block_m: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (``expert_of`` [pairs]: each pair's expert, ``num_experts`` or more for one this rank does not
    hold) in expert order, for blocks of ``block_m`` rows of one expert each. Returns ``sorted_ids`` (the
    pair of each row; ``pairs`` on a padding row), ``block_expert`` (each block's expert) and
    ``num_padded`` ([1]: rows of the held experts' blocks), all on the device, sized for the most rows
    (``pairs + num_experts·(block_m - 1)``) so that nothing waits on the device for a count.

    Rows: ``[starts[e], starts[e] + counts[e])`` expert ``e``'s pairs in their order, then its padding up
    to ``starts[e + 1]``; the pairs of experts not held are left out."""
    num_pairs, device = expert_of.numel(), expert_of.device
    expert_of = expert_of.clamp(max=num_experts)  # (num_experts: not held here)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of, torch.ones_like(expert_of))
    counts = counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(expert_of, stable=True).indices
    sorted_expert = expert_of[order]
    held = sorted_expert < num_experts
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in ``order``
    sorted_expert = sorted_expert.clamp(max=num_experts - 1)
    max_rows = num_pairs + num_experts * (block_m - 1)
    row = torch.where(held, starts[sorted_expert] + torch.arange(num_pairs, device=device) - first[sorted_expert],
                      max_rows)  # (not held: the spare row, cut off)
    sorted_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[row] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp(max=num_experts - 1).to(torch.int32)
    return sorted_ids[:max_rows], block_expert, ends[-1:]


@triton.jit
def _grouped_gemm_kernel(
    A, B, C, Bias, Scale, Zeros, GIdx, SortedIds, BlockExpert, NumPadded, RowWeights,
    num_pairs, N, K, pairs_per_row, n_part, scale_rows_part, group_size, zero_add, zero_point,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_biase,
    stride_se, stride_sn, stride_sk, stride_ze, stride_zn, stride_zk, stride_ge,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr, PACKED: tl.constexpr, BITS: tl.constexpr, AWQ: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
):
    """Rows ``BLOCK_M`` of one block (one expert) × columns ``BLOCK_N``: ``C[pair] = A[pair // pairs_per_row]
    @ B[expert].T (+ Bias[expert])`` (times ``RowWeights[pair]`` when ``MUL_WEIGHT``). With ``HAS_SCALE``,
    ``B`` is FP8 or int8 and column ``n``, input ``k`` of it is scaled by ``Scale[expert, (n // n_part)·
    scale_rows_part + (n % n_part) // SCALE_N, k // SCALE_K]``: the scales of several matrices stacked
    along N (gate, up), each its own blocks. With ``PACKED``, ``B`` is int32 words (:mod:`.moe_wna16`), each
    tile dequantized by :func:`dequantize_tile` with ``Zeros`` and ``Scale`` by group of ``group_size``
    inputs (``HAS_G_IDX``, act-order: input ``k`` of matrix ``n // n_part`` in group ``GIdx[expert,
    (n // n_part)·K + k]``), every stride (expert, output, input or group)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(NumPadded):
        pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        is_pair = pairs < num_pairs
        expert = tl.load(BlockExpert + pid_m).to(tl.int64)
        # (int64 offsets: no overflow on large weights, and none for the interpreter to check)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        n_mask = offs_n < N
        a_ptrs = A + (pairs // pairs_per_row)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        if HAS_SCALE:
            scale_rows = (offs_n // n_part) * scale_rows_part + (offs_n % n_part) // SCALE_N
            s_ptrs = Scale + expert * stride_se + scale_rows[None, :] * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=is_pair[:, None] & k_mask[None, :], other=0.0)
            if PACKED:
                kn_mask = k_mask[:, None] & n_mask[None, :]
                if HAS_G_IDX:
                    g = tl.load(GIdx + expert * stride_ge + (offs_n // n_part)[None, :] * K + (k0 + offs_k)[:, None],
                                mask=kn_mask, other=0).to(tl.int64)
                else:
                    g = ((k0 + offs_k) // group_size)[:, None]
                b = dequantize_tile(
                    B + expert * stride_be, Zeros + expert * stride_ze, Scale + expert * stride_se, k0 + offs_k,
                    offs_n, g, kn_mask, zero_add, zero_point, stride_bk, stride_bn, stride_zk, stride_zn, stride_sk,
                    stride_sn, BITS, AWQ, HAS_ZEROS,
                ).to(A.dtype.element_ty)
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if HAS_SCALE:
                scale = tl.load(s_ptrs + ((k0 + offs_k) // SCALE_K)[:, None] * stride_sk,
                                mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                b = (b.to(tl.float32) * scale).to(A.dtype.element_ty)
            if IEEE:
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            acc += tl.load(Bias + expert * stride_biase + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if MUL_WEIGHT:
            acc = acc * tl.load(RowWeights + pairs, mask=is_pair, other=0.0).to(tl.float32)[:, None]
        tl.store(C + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to(C.dtype.element_ty),
                 mask=is_pair[:, None] & n_mask[None, :])


class BlockSizes(NamedTuple):
    """A launch's tile: ``m`` rows (of one expert), ``n`` output columns, ``k`` inputs a step."""

    m: int
    n: int
    k: int


def block_sizes(num_tokens: int, num_experts: int, device: torch.device) -> BlockSizes:
    """vLLM's default tile (no tuned table): 16 rows while a batch has no more tokens than experts (each
    expert gets a few rows: decode), else 64. Interpreted, 64 columns and inputs (fewer programs)."""
    if device.type != "cuda":
        return BlockSizes(16, 64, 64)
    return BlockSizes(16 if num_tokens <= num_experts else 64, 64, 64)


class StackedWeight(NamedTuple):
    """One projection of every held expert: ``weight`` [experts, N, K] (any strides: GPT-OSS's are its
    stored [experts, K, N] transposed), FP8, int8 or in the model's dtype; ``bias`` [experts, N] or None;
    FP8 or int8, its ``scale`` [experts, ·, ·] in blocks of ``block_size``, the matrices stacked along N ``part``
    rows each (gate, up: each its own blocks). Packed (``packed``: how its tensors are read), ``weight`` is the
    stacked int32 words, ``scale`` and ``zeros`` (None: symmetric) the stacked scales and zeros, ``g_idx``
    (act-order) each matrix's input groups one after the other [experts, parts·K], and ``features`` (N, K),
    which the words do not say."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    block_size: Optional[Tuple[int, int]] = None
    part: Optional[int] = None
    zeros: Optional[torch.Tensor] = None
    packed: Optional[moe_wna16.PackedLayout] = None
    features: Optional[Tuple[int, int]] = None
    g_idx: Optional[torch.Tensor] = None

    @property
    def shape(self) -> Tuple[int, int]:
        """(N, K): output and input features of one expert's matrix."""
        return self.features or tuple(self.weight.shape[1:])


def grouped_gemm(a: torch.Tensor, w: StackedWeight, out: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, blocks: BlockSizes, pairs_per_row: int,
                 row_weights: Optional[torch.Tensor] = None) -> None:
    """``out[pair] = a[pair // pairs_per_row] @ w[expert of pair].T (+ its bias)`` for every pair of
    ``sorted_ids`` (:func:`moe_align_block_size`'s, with ``blocks.m`` rows a block), times
    ``row_weights[pair]`` when given."""
    num_pairs, (n, k), packed = out.shape[0], w.shape, w.packed
    n_part = w.part or n
    bn, bk = w.block_size or (n, k)
    if packed is None:
        weight_strides, zero_strides = w.weight.stride(), (0, 0, 0)
        scale_strides = w.scale.stride() if w.scale is not None else (0, 0, 0)
    else:
        weight_strides, scale_strides, zero_strides = (moe_wna16.strides(packed, t)
                                                       for t in (w.weight, w.scale, w.zeros))
    layout = packed or moe_wna16.PackedLayout((), 0, 8, 1)  # (unpacked: the kernel reads none of it)
    ieee = knobs.runtime.interpret or a.dtype == torch.float32
    grid = (triton.cdiv(sorted_ids.numel(), blocks.m), triton.cdiv(n, blocks.n))
    _grouped_gemm_kernel[grid](
        a, w.weight, out, _or(w.bias, out), _or(w.scale, out), _or(w.zeros, out), _or(w.g_idx, out), sorted_ids,
        block_expert, num_padded, _or(row_weights, out), num_pairs, n, k, pairs_per_row, n_part,
        triton.cdiv(n_part, bn), layout.group_size, layout.zero_add, layout.zero_point,
        a.stride(0), a.stride(1), *weight_strides, out.stride(0), out.stride(1),
        w.bias.stride(0) if w.bias is not None else 0, *scale_strides, *zero_strides,
        w.g_idx.stride(0) if w.g_idx is not None else 0,
        BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=blocks.k, SCALE_N=bn, SCALE_K=bk, HAS_BIAS=w.bias is not None,
        HAS_SCALE=w.scale is not None and packed is None, MUL_WEIGHT=row_weights is not None, IEEE=ieee,
        PACKED=packed is not None, BITS=layout.bits, AWQ=layout.awq, HAS_ZEROS=w.zeros is not None,
        HAS_G_IDX=w.g_idx is not None,
    )


def _plus(y: torch.Tensor, delta: Optional[torch.Tensor]) -> torch.Tensor:
    """``y`` plus a LoRA delta (``y`` where its projection takes none)."""
    return y if delta is None else y + delta


def _or(tensor: Optional[torch.Tensor], unused: torch.Tensor) -> torch.Tensor:
    """A kernel's tensor argument, or any tensor where its flag leaves it unread."""
    return tensor if tensor is not None else unused


def stack_linears(linears: Sequence[Sequence[nn.Linear]]) -> StackedWeight:
    """The weights (and FP8 / int8 scales) of ``linears[e]`` (expert ``e``'s matrices, stacked along N in this
    order, of one shape) in one tensor, each layer's weight then a view of its part: a weight update
    copying into the layers writes the stacked tensor, and the memory is held once. Packed layers'
    (:mod:`.moe_wna16`): each of their tensors so, along the dim holding the output features."""
    first = linears[0][0]
    if moe_wna16.is_packed(first):
        layout = moe_wna16.packed_layout(first)
        words, zeros, scales, g_idx = (name and _stack([[getattr(m, name) for m in parts] for parts in linears],
                                                       dim) for name, dim in zip(layout.names, layout.dims))
        return StackedWeight(words, scale=scales, part=first.out_features, zeros=zeros, packed=layout,
                             features=(first.out_features * len(linears[0]), first.in_features), g_idx=g_idx)
    stacked = StackedWeight(_stack([[m.weight for m in parts] for parts in linears]), part=first.out_features)
    if first.scheme is not None:  # (compressed-tensors' FP8 / int8 values: each scale a block, a part's rows)
        scale = _stack([[m.weight_scale for m in parts] for parts in linears])
        return stacked._replace(scale=scale.view(*scale.shape[:2], -1), block_size=moe_wna16.scale_block(first))
    if first.weight_block_size is None:
        return stacked
    scale = _stack([[m.weight_scale_inv for m in parts] for parts in linears])
    return stacked._replace(scale=scale, block_size=first.weight_block_size)


def _stack(params: List[List[nn.Parameter]], dim: int = 0) -> torch.Tensor:
    """``params[e]`` stacked along their ``dim`` in ``[e]`` of one new tensor; each parameter then a view of it.
    A scalar (AutoFP8's per-tensor scale) takes one entry, as one of shape [1]."""
    first = params[0]
    rows = [[p.shape[dim] if p.dim() else 1 for p in parts] for parts in params]
    shape = list(first[0].shape) or [1]
    shape[dim] = sum(rows[0])
    out = first[0].new_empty((len(params), *shape))
    for e, parts in enumerate(params):
        row = 0
        for p, size in zip(parts, rows[e]):
            view = out[e].narrow(dim, row, size)
            view.copy_(p.detach())
            p.data = view.view(p.shape)
            row += size
    return out


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """``act(gate) · up`` of rows holding gate's columns then up's (:func:`stack_linears`' order)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


class FusedExperts(NamedTuple):
    """The held experts of one layer as two stacked projections (``w13``: gate and up; ``w2``: down) and
    the ``activation`` that takes a pair's gate/up row to down's input."""

    w13: StackedWeight
    w2: StackedWeight
    activation: Callable[[torch.Tensor], torch.Tensor]

    def __call__(self, x: torch.Tensor, expert_of: torch.Tensor, weights: torch.Tensor, lora=None) -> torch.Tensor:
        """``sum_k weights[t, k] · expert[expert_of[t, k]](x[t])`` in fp32 [tokens, hidden], each weighted
        output taken in ``weights``' dtype (as ``moe.run_experts``); ``expert_of`` [tokens, top_k] counts
        the held experts from 0 (outside ``[0, experts)``: not held, 0 here). No tokens, no launch (an
        empty batch's tensors hold no memory to point a kernel at). ``lora``: the experts' LoRA slots
        (``lora_experts.ExpertLoRA``), whose deltas each pair of a token under an adapter gets on its gate/up
        row before the activation and on its down row (times its routing weight)."""
        num_tokens, top_k = expert_of.shape
        if num_tokens == 0:
            return x.new_zeros(x.shape, dtype=torch.float32)
        num_experts, num_pairs = self.w13.weight.shape[0], expert_of.numel()
        blocks = block_sizes(num_tokens, num_experts, x.device)
        expert_of = torch.where(expert_of < 0, num_experts, expert_of).flatten()
        aligned = moe_align_block_size(expert_of, num_experts, blocks.m)
        gate_up = x.new_empty((num_pairs, self.w13.shape[0]))
        grouped_gemm(x, self.w13, gate_up, *aligned, blocks, top_k)
        pairs = lora.align(expert_of, top_k, blocks.m) if lora is not None else None
        if pairs is not None:  # (the projections before the activation: gate's columns, then up's; GPT-OSS's one)
            gate_up = torch.cat([_plus(part, lora.fused_delta(p, x, pairs, blocks, top_k))
                                 for p, part in enumerate(gate_up.chunk(lora.down, dim=-1))], dim=-1)
        hidden = self.activation(gate_up)
        out = x.new_zeros((num_pairs, x.shape[1]), dtype=weights.dtype)  # (pairs not held: 0)
        grouped_gemm(hidden, self.w2, out, *aligned, blocks, 1, row_weights=weights.flatten())
        if pairs is not None:
            out = _plus(out, lora.fused_delta(lora.down, hidden, pairs, blocks, 1, weights.flatten(), out.dtype))
        return out.view(num_tokens, top_k, -1).sum(1, dtype=torch.float32)


class FusableExperts(nn.Module):
    """A layer's experts that can run as :class:`FusedExperts`: :meth:`fuse` sets ``fused``, which their
    forward then runs (``moe_backend='triton'``). ``lora``: their LoRA slots (``lora_experts.ExpertLoRA``), set
    when adapters may target them. ``projections``: each expert's projections that take adapters, for experts
    held stacked (GPT-OSS's 3-D parameters; ``StackedExperts``' gate, up and down); none by default (an
    ``ExpertList``'s are its experts' linear layers). ``is_transposed``: HF holds the experts' 3-D parameters
    ``[experts, in, out]`` (GPT-OSS's; transformers' flag, which PEFT's ``target_parameters`` reads), not
    transformers 5's ``[experts, out, in]`` (Qwen3-MoE's, Mixtral's, Qwen3-VL-MoE's)."""

    fused: Optional[FusedExperts] = None
    lora = None
    projections: Tuple[str, ...] = ()
    is_transposed = False

    def unfused_reason(self) -> Optional[str]:
        """Why :meth:`fuse` would refuse these experts, or None (``moe_backend='auto'`` then runs them eagerly)."""
        return None

    def fuse(self) -> None:
        raise NotImplementedError


def fp8_unfused_reason(device: torch.device, experts: Sequence[nn.Module]) -> Optional[str]:
    """Why ``experts`` cannot run fused on ``device`` for their FP8 weights, or None: Triton types e4m3fn
    (``fp8e4nv``) on CUDA from compute capability 8.9 only (Ada, Hopper), so on an A100 (8.0) or an 8.6 GPU
    the kernel fails to compile at the first forward; the eager experts dequantize with torch there (as vLLM
    serves FP8 on them: weight-only)."""
    if device.type != "cuda" or not any(p.dtype == torch.float8_e4m3fn for m in experts for p in m.parameters()):
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability >= (8, 9):
        return None
    return (f"FP8 experts are not fused on a GPU of compute capability {capability[0]}.{capability[1]} "
            "(Triton compiles e4m3 from 8.9: Ada, Hopper)")


def fuse_experts(model: nn.Module) -> int:
    """:meth:`FusableExperts.fuse` every layer's experts, once the model is on its device in its dtype (a
    later cast or move would give the parameters new tensors and leave the fused ones behind). The number
    of layers fused."""
    layers = [m for m in model.modules() if isinstance(m, FusableExperts)]
    for experts in layers:
        experts.fuse()
    return len(layers)
