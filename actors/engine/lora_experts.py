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
at start or a runtime load (:func:`split_fused_experts`), in the layout of the PEFT that wrote them (0.19 swapped
the in and out dims it reads transformers 5's Qwen3-MoE and Mixtral experts by). Qwen3-VL-MoE's experts are held
in transformers 5's layout in our model too (:class:`~actors.engine.models.moe.StackedExperts`): their adapters,
either form, take each expert's gate and up rows of ``gate_up_proj`` and its ``down_proj`` as Qwen3-MoE's
``gate_proj``, ``up_proj``, ``down_proj``. GPT-OSS's experts are such parameters in our model too
(``gate_up_proj [experts, hidden, 2·inter]``, gate and up interleaved, and ``down_proj``): an adapter on them (only
PEFT's ``target_parameters`` form: they are no modules) has two projections per expert, ``gate_up_proj`` (its B
over the interleaved columns, before the clamped SwiGLU) and ``down_proj``, named ``mlp.experts.{e}.gate_up_proj``
once taken apart.

The eager experts add the deltas in torch, per expert over its rows of each slot (:meth:`ExpertLoRA.run`), rows
``moe.run_experts`` sorts by (expert, slot) with the layer's one host read; the fused ones by the same Triton
grouped GEMM as the experts' (vLLM's fused_moe_lora), between and after their two launches
(``FusedExperts.__call__``): the (token, expert) pairs sorted by group ``slot·experts + expert``
(:meth:`ExpertLoRA.align`, no host read), each group's ``A`` then ``B`` its matrices
(:meth:`ExpertLoRA.fused_delta`); GPT-OSS's eager experts sort their pairs as ``moe.run_experts`` and add the
deltas between their matmuls. Under TP a slot is cut as its expert's projection (gate/up: B's rows, GPT-OSS's
interleaved pairs of its intermediate slice; down: A's columns, its partial delta summed by the block's all-reduce
with the experts' outputs); under EP a rank holds the
slots of its own experts, whole, and drops an adapter's other experts.
"""

from __future__ import annotations

import re
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.fused_moe import BlockSizes, FusableExperts, StackedWeight, grouped_gemm, moe_align_block_size
from actors.engine.models.moe import ExpertList, StackedExperts
from actors.engine.parallel import ColumnParallelLinear, RowParallelLinear

# an expert's projection in a decoder layer: <the layer's experts>.<expert index>.<projection>
EXPERT_MODULE = re.compile(r"^(model\.layers\.\d+\.[\w.]+\.experts)\.(\d+)\.(\w+)$")
# a PEFT ParamWrapper over a layer's fused 3-D expert parameters: the first targeted one the innermost
FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.(?:\w+\.)*experts(?:\.base_layer)*$")
EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")
# the fused 3-D expert parameters PEFT's target_parameters wrap (transformers 5's names, GPT-OSS's too)
FUSED_PARAMETERS = ("gate_up_proj", "down_proj")

Groups = List[Tuple[int, int, slice]]  # (slot, held expert from 0, its rows among the expert's)
Pair = Tuple[torch.Tensor, torch.Tensor]  # an adapter's (A [r, in], B [out, r]) of a module


def layer_module(name: str) -> str:
    """A decoder layer's module as ``supported_lora_modules`` name it: an expert's projection without its
    index (``mlp.experts.3.gate_proj`` -> ``mlp.experts.gate_proj``)."""
    return EXPERT_INDEX.sub(".experts.", name)


class SlotCut(NamedTuple):
    """How an adapter's ``(A [r, in], B [out, r])`` of one projection (a dense layer's or an expert's) fits this
    rank's slots: the projection's whole ``in_features`` and ``out_features``, which the adapter's shapes are
    checked against, and this rank's part of them, A's input columns ``a_cols`` (a row-parallel projection's) or
    B's output rows ``b_rows`` (a column-parallel one's); None: all of them."""

    in_features: int
    out_features: int
    a_cols: Optional[List[range]] = None
    b_rows: Optional[List[range]] = None

    @classmethod
    def of_linear(cls, full: nn.Module, base: nn.Module) -> "SlotCut":
        """Linear layer ``base``'s (``full``: the unsharded model's): a row-parallel one holds its weight's input
        columns, a column-parallel one its output rows, a replicated one all."""
        row, column = isinstance(base, RowParallelLinear), isinstance(base, ColumnParallelLinear)
        ranges = base.param_shards["weight"].ranges if row or column else None
        return cls(full.in_features, full.out_features, ranges if row else None, ranges if column else None)

    def take(self, a: torch.Tensor, b: torch.Tensor) -> Pair:
        """This rank's part of an adapter's ``(A, B)``."""
        if self.a_cols is not None:
            a = torch.cat([a[:, r.start:r.stop] for r in self.a_cols], dim=1)
        if self.b_rows is not None:
            b = torch.cat([b[r.start:r.stop] for r in self.b_rows], dim=0)
        return a, b


class ExpertProjection(NamedTuple):
    """One projection of a layer's held experts as their slots see it: its ``name`` (the checkpoint's:
    ``gate_proj``, Mixtral's ``w1``, GPT-OSS's ``gate_up_proj``), this rank's ``in_features`` and ``out_features``
    (every expert's alike) and its :class:`SlotCut`."""

    name: str
    in_features: int
    out_features: int
    cut: SlotCut


def projection_names(experts: FusableExperts) -> Tuple[str, ...]:
    """The projections of a layer's experts, those before the activation first (their outputs side by side, as
    the fused experts' first launch computes them), down last: an ExpertList's experts' linear layers (gate, up,
    down), or those of experts held stacked (StackedExperts' gate, up, down; GPT-OSS's 3-D parameters
    ``gate_up_proj``, ``down_proj``)."""
    return experts[experts.held.start].projections if isinstance(experts, ExpertList) else experts.projections


def expert_projections(experts: FusableExperts, full: FusableExperts) -> List[ExpertProjection]:
    """The projections of :func:`projection_names` (``full``: the unsharded model's experts). :class:`StackedExperts`'
    gate and up are the rows of ``gate_up_proj [experts, 2·inter, hidden]``, down ``down_proj [experts, hidden,
    inter]``, a TP rank's part their intermediate slice (``down_proj``'s shard of dim 2: B's rows of gate and up, A's
    columns of down). GPT-OSS's 3-D parameters are ``[experts, in, out]`` (run as ``x @ weight[e]``), a TP rank's
    part of them its ``param_shards``: of dim 1, A's input columns (down's); of dim 2, B's output rows (gate_up's);
    of dim 0 (EP), its experts whole."""
    if isinstance(experts, ExpertList):
        first, full_first = experts[experts.held.start], full[full.held.start]
        return [ExpertProjection(name, getattr(first, name).in_features, getattr(first, name).out_features,
                                 SlotCut.of_linear(getattr(full_first, name), getattr(first, name)))
                for name in first.projections]
    if isinstance(experts, StackedExperts):
        (_, hidden, inter), full_inter = experts.down_proj.shape, full.down_proj.shape[2]
        shard = experts.param_shards["down_proj"]
        part = shard.ranges if shard.dim == 2 else None
        gate, up, down = experts.projections
        return [ExpertProjection(gate, hidden, inter, SlotCut(hidden, full_inter, None, part)),
                ExpertProjection(up, hidden, inter, SlotCut(hidden, full_inter, None, part)),
                ExpertProjection(down, inter, hidden, SlotCut(full_inter, hidden, part, None))]
    out = []
    for name in experts.projections:
        shard, (_, num_in, num_out) = experts.param_shards[name], getattr(experts, name).shape
        cut = SlotCut(*getattr(full, name).shape[1:], shard.ranges if shard.dim == 1 else None,
                      shard.ranges if shard.dim == 2 else None)
        out.append(ExpertProjection(name, num_in, num_out, cut))
    return out


def expert_modules(model: nn.Module) -> List[str]:
    """The projection of each held expert of every MoE layer of ``model``, as adapters name it
    (``<experts>.<e>.<projection>``): GPT-OSS's are no modules of their own."""
    return [f"{path}.{e}.{name}" for path, experts in model.named_modules() if isinstance(experts, FusableExperts)
            for e in experts.held for name in projection_names(experts)]


def check_expert(full_model: nn.Module, module: str) -> None:
    """ValueError unless ``module`` (``<experts>.<e>.<projection>``) is an expert's projection of ``full_model``
    (not a layer or an expert past the model's last: the error then says how many experts the layer has, as an
    adapter of another base model names experts this one has not)."""
    match = EXPERT_MODULE.match(module)
    try:
        experts = full_model.get_submodule(match[1])
    except AttributeError:
        experts = None
    if not (isinstance(experts, FusableExperts) and int(match[2]) in experts.held
            and match[3] in projection_names(experts)):
        count = (f" ({match[1]} has {len(experts.held)} experts: an adapter of another base model?)"
                 if isinstance(experts, FusableExperts) and int(match[2]) not in experts.held else "")
        raise ValueError(f"a LoRA adapter targets {module}, which the model has no expert projection at{count}")


def split_fused_experts(weights: Dict[str, Pair], rank: int, full_model: nn.Module) -> Dict[str, Pair]:
    """``weights`` (an adapter's ``(A, B)`` by module) with each PEFT ``target_parameters`` wrapper over a layer's
    fused expert parameters taken apart into each expert's projections of ``full_model`` (unsharded). One PEFT wrote
    all of an adapter's wrappers, so they share its layout (:func:`_wrapper_fits`): a wrapper whose shapes fit both
    (gate_up_proj where hidden = 2·intermediate) takes the one the others' shapes tell; ValueError where none does."""
    fused = [m for m in weights if FUSED_EXPERTS.match(m)]
    if not fused:
        return weights
    experts = {name.rsplit(".", 2)[0]: (name, module) for name, module in full_model.named_modules()
               if isinstance(module, FusableExperts) and projection_names(module)}
    fits = {}
    for module in fused:
        layer = FUSED_EXPERTS.match(module)[1]
        if layer not in experts:
            raise ValueError(f"{module} wraps no MoE experts that take adapters")
        fits[module] = _wrapper_fits(module, *weights[module], rank, experts[layer][1])
    told = {swapped for fit in fits.values() if len(fit) == 1 for swapped in fit}
    out = {m: pair for m, pair in weights.items() if m not in fused}
    for module in fused:
        fit = fits[module]
        if len(fit) > 1:
            if len(told) != 1:
                a, b = weights[module]
                raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit "
                                 f"{', '.join(fit[False])} as PEFT writes it before 0.19 and since (its in and out "
                                 "swapped), and no other wrapper of the adapter tells which (target down_proj too)")
            fit = {swapped: fit[swapped] for swapped in told}
        [(swapped, parts)] = fit.items()
        out.update(_split_wrapper(*weights[module], rank, swapped, parts, *experts[FUSED_EXPERTS.match(module)[1]]))
    return out


def _wrapper_fits(module: str, a: torch.Tensor, b: torch.Tensor, rank: int,
                  experts: FusableExperts) -> Dict[bool, Dict[str, slice]]:
    """The projections of ``experts`` (each with its rows of the parameter's ``[experts, out, in]`` out dim, or of
    GPT-OSS's ``[experts, in, out]``) that a wrapper's ``lora_A [experts·r, d_A]`` and ``lora_B [d_B, experts·r]``
    fit, by whether PEFT swapped the parameter's dims: PEFT reads a 3-D parameter ``[experts, d1, d2]`` as
    ``[experts, in, out]`` (``d_A, d_B = d1, d2``: ``ParamWrapper.__init__``), and since 0.19 (huggingface/peft#3165,
    ``_did_swap_in_out_features``) that of experts not marked ``is_transposed`` — transformers 5's Qwen3-MoE and
    Mixtral, ``gate_up_proj [experts, 2·inter, hidden]``, ``down_proj [experts, hidden, inter]`` — as
    ``[experts, out, in]`` (``d_A, d_B = d2, d1``); GPT-OSS's, ``is_transposed``, never. ValueError when none fits,
    or when the wrapper's rows are not ``experts·r`` of the layer's (unsharded) experts: an adapter of a model with
    fewer experts would leave the rest without one, silently."""
    if a.shape[0] != b.shape[1] or a.shape[0] % rank:
        raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are no experts·r={rank} "
                         "rows of a fused expert parameter")
    projections = expert_projections(experts, experts)  # (whole: the unsharded model's)
    if len(projections) == 3:  # (gate, up, down: transformers 5's gate_up_proj their rows, one after the other)
        gate, up, down = (projection.name for projection in projections)
        hidden, inter = projections[0].in_features, projections[0].out_features
        dims = {(2 * inter, hidden): {gate: slice(0, inter), up: slice(inter, 2 * inter)},
                (hidden, inter): {down: slice(None)}}
    else:
        dims = {(p.in_features, p.out_features): {p.name: slice(None)} for p in projections}
    layouts = (False,) if experts.is_transposed else (False, True)
    fits = {swapped: parts for swapped in layouts for (d1, d2), parts in dims.items()
            if (a.shape[1], b.shape[0]) == ((d2, d1) if swapped else (d1, d2))}
    if not fits:
        wants = " nor ".join(f"{name} [experts, {d1}, {d2}]" for name, (d1, d2) in zip(FUSED_PARAMETERS, dims))
        raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit neither {wants}"
                         f"{' (nor as PEFT 0.19 reads them, [experts, out, in])' if len(layouts) > 1 else ''}")
    num_experts = len(experts.held)  # (the unsharded model's: every expert of the layer)
    if a.shape[0] != num_experts * rank:
        raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are {a.shape[0] // rank} "
                         f"experts of r={rank}, and the layer has {num_experts} (an adapter of another base model?)")
    return fits


def _split_wrapper(a: torch.Tensor, b: torch.Tensor, rank: int, swapped: bool, parts: Dict[str, slice], path: str,
                   experts: FusableExperts) -> Dict[str, Pair]:
    """Each expert's ``(A, B)`` of our projections ``parts`` (:func:`_wrapper_fits`'s, of ``experts`` at ``path``)
    from a wrapper PEFT wrote ``swapped`` or not. PEFT's ``A_e`` are lora_A's rows ``[e·r, (e+1)·r)`` and ``B_e``
    lora_B's columns ``k·experts + e`` (rank-major), and expert e's slice, read as ``[in, out]``, gets
    ``scaling · (B_e A_e)ᵀ`` (``ParamWrapper.get_delta_weight``). Where PEFT's in is the dim ``x`` multiplies
    (GPT-OSS's ``x @ slice``; transformers 5's ``x @ sliceᵀ`` swapped) ``A = A_e`` and ``B = B_e`` in
    ``y += s·B·A·x``'s terms, otherwise (transformers 5's unswapped) ``A = B_eᵀ`` and ``B = A_eᵀ``; gate_up's parts
    cut B's rows."""
    num_experts = a.shape[0] // rank
    a_e = a.reshape(num_experts, rank, a.shape[1])  # [experts, r, d_A]
    b_e = b.reshape(b.shape[0], rank, num_experts).permute(2, 1, 0)  # [experts, r, d_B]
    ours_a, ours_b = (a_e, b_e) if swapped != experts.is_transposed else (b_e, a_e)
    return {f"{path}.{e}.{name}": (ours_a[e].contiguous(), ours_b[e, :, rows].T.contiguous())
            for e in range(num_experts) for name, rows in parts.items()}


class ExpertSlots(NamedTuple):
    """One expert's projection as the manager fills its slots: how an adapter is cut for them
    (:class:`SlotCut`) and views of its layer's stacked buffers, ``lora_a [slots, r, in]``, ``lora_b [slots,
    out, r]``."""

    cut: SlotCut
    lora_a: torch.Tensor
    lora_b: torch.Tensor


class FusedPairs(NamedTuple):
    """A fused forward's (token, expert) pairs sorted for the LoRA grouped GEMMs: by group ``slot·experts +
    expert`` (:func:`~actors.engine.fused_moe.moe_align_block_size`'s ``aligned``, the pairs without an adapter
    or of an expert held elsewhere left out), and each pair's ``scaling`` (its slot's; 0: none)."""

    aligned: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    scaling: torch.Tensor


class ExpertLoRA:
    """The adapter slots of one MoE layer's held experts (``experts``: its ExpertList, StackedExperts or GPT-OSS's
    3-D experts; ``full``: the unsharded model's), for each projection of ``targeted`` (of ``projections``,
    :func:`expert_projections`; ``down``: the last, after the activation) ``lora_a [slots, experts, r, in]`` and
    ``lora_b [slots, experts, out, r]`` (this rank's shards); the slots' scaling and the forward's token slots
    are the manager's (``scaling``, ``token_slots``)."""

    def __init__(self, experts: FusableExperts, full: FusableExperts, manager, targeted: List[str], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        self.experts, self.manager, self.targeted = experts, manager, targeted
        self.projections = expert_projections(experts, full)
        self.names = [projection.name for projection in self.projections]
        self.down = len(self.projections) - 1
        self.lora_a: Dict[int, torch.Tensor] = {}
        self.lora_b: Dict[int, torch.Tensor] = {}
        num = len(experts.held)
        for p, (name, num_in, num_out, _) in enumerate(self.projections):
            if name in targeted:
                self.lora_a[p] = torch.zeros(num_slots, num, max_rank, num_in, dtype=dtype, device=device)
                self.lora_b[p] = torch.zeros(num_slots, num, num_out, max_rank, dtype=dtype, device=device)

    def slots(self, expert: int, name: str) -> ExpertSlots:
        """Expert ``expert``'s (checkpoint index) projection ``name``'s slots."""
        p, i = self.names.index(name), expert - self.experts.held.start
        return ExpertSlots(self.projections[p].cut, self.lora_a[p][:, i], self.lora_b[p][:, i])

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
        gate, up, down = (getattr(expert, name) for name in self.names)
        h = expert.act(self.add(0, gate(x), x, groups)) * self.add(1, up(x), x, groups)
        return self.add(2, down(h), h, groups)
