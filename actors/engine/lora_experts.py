"""LoRA on a MoE layer's routed experts (vLLM's fused-MoE LoRA, SGLang's MoE LoRA): a token routed to expert
``e`` under the adapter of slot ``s`` adds ``scaling[s] · B[s, e] (A[s, e] x)`` to that expert's gate and up
outputs (before the activation) and to its down output, which the routing weight then scales as the rest of
the expert's output.

PEFT writes such an adapter per expert, in the checkpoint's names (``mlp.experts.{e}.gate_proj``; Mixtral's
``block_sparse_moe.experts.{e}.w1``), each projection of each expert its own A and B; a layer's slots stack
them (:class:`ExpertLoRA`): per targeted projection ``A [slots, experts, r, in]`` and ``B [slots, experts,
out, r]``, which :class:`~actors.engine.lora.LoRAManager` fills through each expert's views
(:class:`ExpertSlots`) as it fills a dense layer's. Adapters on transformers 5's fused 3-D expert parameters
(PEFT's ``target_parameters``) are taken apart into those per-expert pairs as the manager checks an adapter,
at start or a runtime load (:func:`split_fused_experts`).

The eager experts add the deltas in torch, per expert over its rows of each slot (:meth:`ExpertLoRA.run`), rows
``moe.run_experts`` sorts by (expert, slot) with the layer's one host read; the fused ones by the same Triton
grouped GEMM as the experts' (vLLM's fused_moe_lora), between and after their two launches
(``FusedExperts.__call__``): the (token, expert) pairs sorted by group ``slot·experts + expert``
(:meth:`ExpertLoRA.align`, no host read), each group's ``A`` then ``B`` its matrices
(:meth:`ExpertLoRA.fused_delta`). Under TP a slot is cut as its expert's projection (gate/up: B's rows; down: A's
columns, its partial delta summed by the block's all-reduce with the experts' outputs); under EP a rank holds the
slots of its own experts, whole, and drops an adapter's other experts.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.fused_moe import BlockSizes, StackedWeight, grouped_gemm, moe_align_block_size
from actors.engine.models.moe import ExpertList

# an expert's projection in a decoder layer: <the layer's experts>.<expert index>.<projection>
EXPERT_MODULE = re.compile(r"^(model\.layers\.\d+\.[\w.]+\.experts)\.(\d+)\.(\w+)$")
# a PEFT ParamWrapper over a layer's fused 3-D expert parameters: the first targeted one the innermost
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.(?:\w+\.)*experts(?:\.base_layer)*$")
EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")

Groups = List[Tuple[int, int, slice]]  # (slot, held expert from 0, its rows among the expert's)
Pair = Tuple[torch.Tensor, torch.Tensor]  # an adapter's (A [r, in], B [out, r]) of a module


def layer_module(name: str) -> str:
    """A decoder layer's module as ``supported_lora_modules`` name it: an expert's projection without its
    index (``mlp.experts.3.gate_proj`` -> ``mlp.experts.gate_proj``)."""
    return EXPERT_INDEX.sub(".experts.", name)


def split_fused_experts(weights: Dict[str, Pair], rank: int, full_model: nn.Module) -> Dict[str, Pair]:
    """``weights`` (an adapter's ``(A, B)`` by module) with each PEFT ``target_parameters`` wrapper over a layer's
    fused expert parameters taken apart into each expert's projections of ``full_model`` (unsharded)."""
    fused = [m for m in weights if FUSED_EXPERTS.match(m)]
    if not fused:
        return weights
    experts = {name.rsplit(".", 2)[0]: (name, module) for name, module in full_model.named_modules()
               if isinstance(module, ExpertList)}
    out = {m: pair for m, pair in weights.items() if m not in fused}
    for module in fused:
        layer = FUSED_EXPERTS.match(module)[1]
        if layer not in experts:
            raise ValueError(f"{module} wraps no MoE experts that take adapters")
        out.update(_split_wrapper(module, *weights[module], rank, *experts[layer]))
    return out


def _split_wrapper(module: str, a: torch.Tensor, b: torch.Tensor, rank: int, path: str,
                   experts: ExpertList) -> Dict[str, Pair]:
    """A wrapper's ``lora_A [experts·r, d1]`` and ``lora_B [d2, experts·r]`` over transformers 5's
    ``gate_up_proj [experts, 2·inter, hidden]`` or ``down_proj [experts, hidden, inter]``, told apart by these
    shapes, as each expert's ``(A, B)`` of our projections (``experts``, at ``path``). PEFT adds ``scaling ·
    (B_e A_e)ᵀ`` to expert e's ``[d1, d2]`` slice, which the experts run as ``x @ sliceᵀ``: per expert ``Aᵀ =
    B_e`` and ``Bᵀ = A_e`` in ``y += s·B·A·x``'s terms, gate_up's rows cut into gate's and up's. ValueError when
    the shapes fit neither parameter."""
    first = experts[experts.held.start]
    gate, up, down = first.projections
    hidden, inter = getattr(first, gate).in_features, getattr(first, gate).out_features
    num_experts = a.shape[0] // rank
    if a.shape[0] != b.shape[1] or a.shape[0] % rank:
        raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are no experts·r={rank} "
                         "rows of a fused expert parameter")
    a_e = a.reshape(num_experts, rank, a.shape[1])  # [experts, r, d1]
    b_e = b.reshape(b.shape[0], rank, num_experts).permute(2, 1, 0)  # [experts, r, d2]
    if (a.shape[1], b.shape[0]) == (2 * inter, hidden):
        parts = {gate: slice(0, inter), up: slice(inter, 2 * inter)}
    elif (a.shape[1], b.shape[0]) == (hidden, inter):
        parts = {down: slice(0, hidden)}
    else:
        raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither gate_up_proj "
                         f"[experts, {2 * inter}, {hidden}] nor down_proj [experts, {hidden}, {inter}]")
    return {f"{path}.{e}.{name}": (b_e[e].contiguous(), a_e[e, :, rows].T.contiguous())
            for e in range(num_experts) for name, rows in parts.items()}


class ExpertSlots(NamedTuple):
    """One expert's projection as the manager fills its slots: the base layer (its TP shard tells how the
    adapter is cut) and views of its layer's stacked buffers, ``lora_a [slots, r, in]``, ``lora_b [slots,
    out, r]``."""

    base: nn.Module
    lora_a: torch.Tensor
    lora_b: torch.Tensor


class FusedPairs(NamedTuple):
    """A fused forward's (token, expert) pairs sorted for the LoRA grouped GEMMs: by group ``slot·experts +
    expert`` (:func:`~actors.engine.fused_moe.moe_align_block_size`'s ``aligned``, the pairs without an adapter
    or of an expert held elsewhere left out), and each pair's ``scaling`` (its slot's; 0: none)."""

    aligned: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scaling: torch.Tensor


class ExpertLoRA:
    """The adapter slots of one MoE layer's held experts (``experts``: its ExpertList), for each projection of
    ``targeted`` (of ``projections``, the experts' gate, up, down names) ``lora_a [slots, experts, r, in]`` and
    ``lora_b [slots, experts, out, r]`` (this rank's shards); the slots' scaling and the forward's token slots
    are the manager's (``scaling``, ``token_slots``)."""

    def __init__(self, experts, manager, targeted: List[str], num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.experts, self.manager, self.targeted = experts, manager, targeted
        first = experts[experts.held.start]
        self.projections = first.projections
        self.lora_a: Dict[int, torch.Tensor] = {}
        self.lora_b: Dict[int, torch.Tensor] = {}
        for p, name in enumerate(self.projections):
            if name in targeted:
                base, num = getattr(first, name), len(experts.held)
                self.lora_a[p] = torch.zeros(num_slots, num, max_rank, base.in_features, dtype=dtype, device=device)
                self.lora_b[p] = torch.zeros(num_slots, num, base.out_features, max_rank, dtype=dtype, device=device)

    def slots(self, expert: int, name: str) -> ExpertSlots:
        """Expert ``expert``'s (checkpoint index) projection ``name``'s slots."""
        p, i = self.projections.index(name), expert - self.experts.held.start
        return ExpertSlots(getattr(self.experts[expert], name), self.lora_a[p][:, i], self.lora_b[p][:, i])

    @property
    def num_slots(self) -> int:
        """The manager's slots (``max_loras_per_batch``)."""
        return self.manager.scaling.numel()

    def pair_slots(self, top_k: int) -> Optional[torch.Tensor]:
        """The slot of each (token, k) pair of the forward (a token's ``top_k`` pairs in a row; -1: none); None
        for a batch without adapters."""
        token_slots = self.manager.token_slots
        return None if token_slots is None else token_slots.repeat_interleave(top_k)

    def align(self, expert_of: torch.Tensor, top_k: int, block_m: int) -> Optional[FusedPairs]:
        """The pairs of a fused forward (``expert_of`` [pairs]: each pair's held expert from 0, ``experts`` for one
        held elsewhere; a token's ``top_k`` pairs in a row) grouped by (slot, expert), on the device (no host
        read); None for a batch without adapters."""
        slot = self.pair_slots(top_k)
        if slot is None:
            return None
        num, num_groups = len(self.experts.held), self.num_slots * len(self.experts.held)
        has = (slot >= 0) & (expert_of < num)
        key = torch.where(has, slot * num + expert_of, num_groups)
        scaling = torch.where(has, self.manager.scaling[slot.clamp(min=0)], 0)
        return FusedPairs(moe_align_block_size(key, num_groups, block_m), scaling)

    def fused_delta(self, p: int, a: torch.Tensor, pairs: FusedPairs, blocks: BlockSizes, pairs_per_row: int,
                    row_weights: Optional[torch.Tensor] = None, dtype: Optional[torch.dtype] = None
                    ) -> Optional[torch.Tensor]:
        """Projection ``p``'s delta of every pair (input row ``pair // pairs_per_row`` of ``a``) in two grouped
        GEMMs over its group's ``A`` then ``B`` (the slots' stacks seen as ``slots·experts`` matrices), times the
        pair's scaling and ``row_weights``; 0 for a pair without an adapter; None when ``p`` takes none."""
        if p not in self.lora_a:
            return None
        lora_a, lora_b = self.lora_a[p], self.lora_b[p]
        num_slots, num, rank, num_in = lora_a.shape
        num_pairs = pairs.scaling.numel()
        shrunk = a.new_zeros((num_pairs, rank))
        grouped_gemm(a, StackedWeight(lora_a.view(num_slots * num, rank, num_in)), shrunk, *pairs.aligned, blocks,
                     pairs_per_row)
        out = a.new_zeros((num_pairs, lora_b.shape[2]), dtype=dtype)
        weights = pairs.scaling if row_weights is None else pairs.scaling * row_weights
        grouped_gemm(shrunk, StackedWeight(lora_b.view(num_slots * num, lora_b.shape[2], rank)), out, *pairs.aligned,
                     blocks, 1, row_weights=weights)
        return out

    def delta(self, p: int, x: torch.Tensor, groups: Groups) -> Optional[torch.Tensor]:
        """Projection ``p``'s ``scaling[s] · B[s, e] (A[s, e] x)`` for the rows of ``x`` in ``groups``, 0 for the
        others; None when the projection takes no adapter."""
        if p not in self.lora_a:
            return None
        out = x.new_zeros(x.shape[0], self.lora_b[p].shape[2])
        for slot, e, rows in groups:
            shrunk = F.linear(x[rows], self.lora_a[p][slot, e]) * self.manager.scaling[slot]
            out[rows] = F.linear(shrunk, self.lora_b[p][slot, e])
        return out

    def add(self, p: int, y: torch.Tensor, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """``y`` plus projection ``p``'s delta of input ``x`` (``y`` itself when it takes no adapter)."""
        delta = self.delta(p, x, groups)
        return y if delta is None else y + delta

    def run(self, expert: nn.Module, x: torch.Tensor, groups: Groups) -> torch.Tensor:
        """``expert`` (its ``projections`` and ``act``) on its rows ``x``, each projection's delta added."""
        gate, up, down = (getattr(expert, name) for name in self.projections)
        h = expert.act(self.add(0, gate(x), x, groups)) * self.add(1, up(x), x, groups)
        return self.add(2, down(h), h, groups)
