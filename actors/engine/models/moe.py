"""The sparse mixture-of-experts block of Qwen3-MoE, Qwen3-Next, Qwen3-VL-MoE and Mixtral (HF parameter names).

A router (``gate``: a linear layer to one logit per expert) takes the fp32 softmax over the experts
and keeps each token's ``top_k``; every chosen expert (a SiLU-gated MLP) runs on the tokens that chose
it, weighted by its probability — renormalised over the token's ``top_k`` when ``norm_topk_prob``
(Qwen's config field; Mixtral always). Qwen3-Next adds a shared expert that every token runs, scaled by
``sigmoid(shared_expert_gate(x))``. DeepSeek-V3's grouped, biased gate is its own
(``deepseek_v3.DeepseekV3MoE``) but sums its experts with :func:`run_experts` too.

Under TP each rank holds every expert's slice of the intermediate dim (gate/up column parallel,
down row parallel without its own reduce); the router is replicated, so every rank routes each token
alike, and one all-reduce sums the routed and shared partial outputs of the whole block. Under EP
(``TPGroup.expert_parallel``) each rank holds its share of the experts whole (:class:`ExpertList`)
and runs only those; the same all-reduce adds up the ranks' experts. The shared expert stays TP
(sliced on every rank), its partial sum in the same reduce.

``EngineConfig.moe_backend`` picks how the routed experts run: ``torch`` (:func:`run_experts`, HF's eager
loop: one small matmul per chosen expert, and a host sync a layer for the experts chosen) or ``triton``
(:meth:`ExpertList.fuse` stacks each layer's experts for :mod:`actors.engine.fused_moe`'s grouped GEMMs; packed
GPTQ / AWQ / compressed-tensors experts too, and compressed-tensors' FP8 / int8 ones, :mod:`actors.engine.moe_wna16`).
Qwen3-VL-MoE's bf16 checkpoints hold each layer's experts stacked already (:class:`StackedExperts`).
"""

from __future__ import annotations

import itertools
from functools import partial
from typing import Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine import moe_wna16
from actors.engine.fused_moe import FusableExperts, FusedExperts, StackedWeight, gated, stack_linears
from actors.engine.layers import GatedMLP, get_activation
from actors.engine.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear, TPGroup, shard_param


def is_sparse_layer(config, layer_id: int) -> bool:
    """Whether layer ``layer_id`` of a Qwen MoE model has the MoE block (HF's rule): every
    ``decoder_sparse_step``-th layer but those in ``mlp_only_layers``, which keep a dense MLP."""
    return (layer_id not in config.mlp_only_layers and config.num_experts > 0
            and (layer_id + 1) % config.decoder_sparse_step == 0)


class ExpertList(FusableExperts):
    """The experts of one layer this rank holds (``held``: :meth:`TPGroup.experts`), each under its
    checkpoint index (``experts.{e}.…``), made by ``make()``. The loader leaves the tensors of the
    experts it does not hold unread (``model_loader.held_elsewhere``). ``fused``: set by :meth:`fuse`."""

    def __init__(self, held: range, make: Callable[[], nn.Module]):
        super().__init__()
        self.held = held
        for e in held:
            self.add_module(str(e), make())

    def __getitem__(self, e: int) -> nn.Module:
        return self._modules[str(e)]

    def unfused_reason(self) -> Optional[str]:
        """Why the experts cannot be fused (biases; quantized ones :mod:`.moe_wna16` does not take), or None."""
        experts = [self[e] for e in self.held]
        gate, up, down = experts[0].projections
        if any(getattr(expert, name).bias is not None for expert in experts for name in (gate, up, down)):
            return "experts with biases are not fused"
        return moe_wna16.unfused_reason([[getattr(m, name) for m in experts for name in (gate, up)],
                                         [getattr(m, down) for m in experts]])

    def fuse(self) -> None:
        """Run the experts as :class:`FusedExperts`: their gate and up weights (FP8 / int8 scales; packed words,
        zeros and scales) stacked in one tensor each, their down weights in another, each expert's
        parameters then views of them (a weight update still copies into them)."""
        reason = self.unfused_reason()
        if reason is not None:
            raise ValueError(f"moe_backend='triton': {reason} (moe_backend='torch' serves them)")
        experts = [self[e] for e in self.held]
        gate, up, down = experts[0].projections
        self.fused = FusedExperts(stack_linears([(getattr(m, gate), getattr(m, up)) for m in experts]),
                                  stack_linears([(getattr(m, down),) for m in experts]),
                                  partial(gated, experts[0].act))


class StackedExpert(NamedTuple):
    """One expert of :class:`StackedExperts`: its rows of ``gate_up_proj`` [2 × intermediate, hidden] (this rank's
    gate rows, then its up rows) and its ``down_proj`` [hidden, intermediate]. Called, its MLP in two matmuls;
    ``lora_experts.ExpertLoRA.run`` calls its projections one by one, as an :class:`ExpertList`'s expert's."""

    gate_up: torch.Tensor
    down: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]

    def gate_proj(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate_up[:self.gate_up.shape[0] // 2])

    def up_proj(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.gate_up[self.gate_up.shape[0] // 2:])

    def down_proj(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated(self.act, F.linear(x, self.gate_up)))


class StackedExperts(FusableExperts):
    """The experts of one layer as transformers 5 holds them (Qwen3-VL-MoE's ``mlp.experts``): every held
    expert's gate and up matrices in one 3-D ``gate_up_proj`` [experts, 2 × intermediate, hidden] (gate's rows,
    then up's), its down matrix in ``down_proj`` [experts, hidden, intermediate] — :class:`FusedExperts`' own
    layout, so :meth:`fuse` stacks nothing. Under TP each rank holds every expert's share of the intermediate
    dim (gate's rows ``[start, stop)`` and up's ``[I + start, I + stop)``, down's columns); under EP its
    experts (``held``) whole. ``experts[e]``: expert ``e``'s MLP, as an :class:`ExpertList`'s (:func:`run_experts`):
    a :class:`StackedExpert`, whose gate, up and down projections (``projections``: Qwen3-MoE's names) take LoRA
    adapters as an ExpertList's experts' linear layers (``actors.engine.lora_experts``).

    Released checkpoints (saved by transformers before 5) store each matrix transposed, [experts, in, out]:
    :meth:`stored_transposed` tells the loader which to read so."""

    projections = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, hidden_act: str, tp: TPGroup,
                 field: str, experts_field: str):
        super().__init__()
        self.held, self.act = tp.experts(num_experts, experts_field), get_activation(hidden_act)
        part = tp.expert_tp.split(intermediate_size, field)
        self.in_features = {"gate_up_proj": hidden_size, "down_proj": intermediate_size}  # (the whole tensors')
        self.gate_up_proj = nn.Parameter(torch.empty(len(self.held), 2 * len(part), hidden_size))
        self.down_proj = nn.Parameter(torch.empty(len(self.held), hidden_size, len(part)))
        if tp.expert_parallel:
            shard_param(self, "gate_up_proj", 0, [self.held])
            shard_param(self, "down_proj", 0, [self.held])
        else:
            shard_param(self, "gate_up_proj", 1, [part, range(intermediate_size + part.start,
                                                              intermediate_size + part.stop)])
            shard_param(self, "down_proj", 2, [part])

    def __getitem__(self, e: int) -> StackedExpert:
        i = e - self.held.start  # (its place in this rank's tensors)
        return StackedExpert(self.gate_up_proj[i], self.down_proj[i], self.act)

    def stored_transposed(self, name: str, shape: Sequence[int], released: bool = False) -> bool:
        """Whether checkpoint tensor ``name`` of ``shape`` is a matrix (``gate_up_proj``, ``down_proj``) stored
        [experts, in, out]: its last dim is not the matrix's input, or it is square (2 × intermediate or
        intermediate equal to hidden: either layout fits) and ``released``, saved by transformers before 5, which
        stored them so (transformers 5 reads a square one as it is whoever saved it, its
        ``Transpose(check_dims=True)``; vLLM transposes every one, ``is_fused_checkpoint_transposed``)."""
        if name not in self.in_features:
            return False
        return shape[-1] != self.in_features[name] or (released and shape[-1] == shape[-2])

    def fuse(self) -> None:
        self.fused = FusedExperts(StackedWeight(self.gate_up_proj), StackedWeight(self.down_proj),
                                  partial(gated, self.act))


def run_experts(experts: FusableExperts, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k weights[t, k] * experts[idx[t, k]](x[t])`` over the held experts for every token ``t``, in
    fp32 (the caller casts once): each expert runs once, on the tokens that chose it (:func:`routed_pairs`); each
    weighted output is taken in ``weights``' dtype (HF's experts: Qwen's cast to the model's dtype, Mixtral's and
    DeepSeek's fp32). Under EP the other ranks' experts are left to them (the block's reduce sums all).
    Fused (:meth:`ExpertList.fuse`), the same sum in two grouped-GEMM launches over every held expert. A token
    under a LoRA adapter gets its expert's deltas (``experts.lora``)."""
    start, lora = experts.held.start, experts.lora
    if experts.fused is not None:
        return experts.fused(x, idx - start, weights, lora)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    top_k, pair_weights = idx.shape[1], weights.flatten()
    for e, pairs, groups in routed_pairs(experts.held, idx, lora):
        token = pairs // top_k
        y = lora.run(experts[e], x[token], groups) if groups else experts[e](x[token])
        out.index_add_(0, token, (y * pair_weights[pairs, None]).float())
    return out


def routed_pairs(held: range, idx: torch.Tensor,
                 lora) -> Iterator[Tuple[int, torch.Tensor, List[Tuple[int, int, slice]]]]:
    """Each held expert ``e`` that a (token, k) pair of ``idx`` [tokens, top_k] chose, in order, with its pairs
    (indices into ``idx`` flattened) and their LoRA groups (``lora``: the experts' ``ExpertLoRA`` or None):
    ``(slot, e - held.start, its rows among the pairs)`` per slot, none without adapters.

    The pairs are sorted on the device by expert and, within an expert, by their token's LoRA slot (the base
    model's first): the counts of these groups are the layer's one host read, each expert's rows and each slot's
    among them then slices of that order (an expert's in token order without adapters, as HF's)."""
    top_k = idx.shape[1]
    pair_slot = lora.pair_slots(top_k) if lora is not None else None
    width = 1 if pair_slot is None else lora.num_slots + 1  # (the groups of an expert: none, then each slot)
    key = (idx.flatten() * width + (0 if pair_slot is None else pair_slot + 1)).clamp(max=held.stop * width)
    counts = torch.zeros(held.stop * width + 1, dtype=torch.int64, device=idx.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    bounds = [0, *itertools.accumulate(counts.tolist())]  # group g: rows [bounds[g], bounds[g + 1]) of order
    order = torch.sort(key, stable=True).indices
    for e in held:
        first = bounds[e * width]
        if first == bounds[(e + 1) * width]:
            continue
        groups = [(s, e - held.start, slice(bounds[g] - first, bounds[g + 1] - first))
                  for s, g in enumerate(range(e * width + 1, (e + 1) * width)) if bounds[g] < bounds[g + 1]]
        yield e, order[first:bounds[(e + 1) * width]], groups


class MixtralExpert(nn.Module):
    """One Mixtral expert: :class:`GatedMLP`'s math under Mixtral's checkpoint names
    (``w1`` gate, ``w3`` up, ``w2`` down); a rank's partial sum under TP (the block reduces)."""

    projections = ("w1", "w3", "w2")  # (gate, up, down: ExpertList.fuse stacks them)

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, tp: TPGroup, field: str):
        super().__init__()
        self.w1 = ColumnParallelLinear.split(hidden_size, intermediate_size, tp, field)
        self.w3 = ColumnParallelLinear.split(hidden_size, intermediate_size, tp, field)
        self.w2 = RowParallelLinear(intermediate_size, hidden_size, tp, field, reduce=False)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))


def qwen_expert(hidden_size: int, intermediate_size: int, hidden_act: str, tp: TPGroup, field: str) -> GatedMLP:
    """One Qwen expert (``gate_proj``, ``up_proj``, ``down_proj``): a rank's partial sum under TP."""
    return GatedMLP(hidden_size, intermediate_size, hidden_act, tp, reduce=False, field=field)


class SparseMoeBlock(nn.Module):
    """``num_experts`` experts of ``intermediate_size`` (``field``: the config field a TP error names;
    ``experts_field``: the one an EP error names), made by ``expert`` (:func:`qwen_expert` or
    :class:`MixtralExpert`), or held stacked (``expert=StackedExperts``). ``fp32_weights``: the routing weights stay fp32 (Mixtral's router);
    otherwise they are cast to the model's dtype first (Qwen's).
    A config with ``shared_expert_intermediate_size`` (Qwen3-Next) adds the gated shared expert."""

    def __init__(self, config, num_experts: int, intermediate_size: int, field: str, experts_field: str,
                 norm_topk_prob: bool, tp: TPGroup = SINGLE, expert: Callable[..., nn.Module] = qwen_expert,
                 fp32_weights: bool = False):
        super().__init__()
        self.tp, self.top_k = tp, config.num_experts_per_tok
        self.norm_topk_prob, self.fp32_weights = norm_topk_prob, fp32_weights
        hidden, act = config.hidden_size, config.hidden_act
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        if expert is StackedExperts:
            self.experts = StackedExperts(num_experts, hidden, intermediate_size, act, tp, field, experts_field)
        else:
            self.experts = ExpertList(tp.experts(num_experts, experts_field),
                                      lambda: expert(hidden, intermediate_size, act, tp.expert_tp, field))
        shared = getattr(config, "shared_expert_intermediate_size", 0)
        self.shared_expert = qwen_expert(hidden, shared, act, tp, "shared_expert_intermediate_size") if shared else None
        if shared:
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @classmethod
    def qwen(cls, config, tp: TPGroup = SINGLE) -> "SparseMoeBlock":
        """Qwen3-MoE's and Qwen3-Next's block: ``num_experts`` of ``moe_intermediate_size``."""
        return cls(config, config.num_experts, config.moe_intermediate_size, "moe_intermediate_size", "num_experts",
                   config.norm_topk_prob, tp)

    @classmethod
    def qwen3_vl(cls, config, tp: TPGroup = SINGLE, stacked: bool = True) -> "SparseMoeBlock":
        """Qwen3-VL-MoE's: Qwen3-MoE's block, top-k always renormalised (HF's router), its experts'
        matrices stacked (:class:`StackedExperts`), or Qwen3-MoE's experts (not ``stacked``: a checkpoint storing
        them per expert)."""
        return cls(config, config.num_experts, config.moe_intermediate_size, "moe_intermediate_size", "num_experts",
                   True, tp, expert=StackedExperts if stacked else qwen_expert)

    @classmethod
    def mixtral(cls, config, tp: TPGroup = SINGLE) -> "SparseMoeBlock":
        """Mixtral's: ``num_local_experts`` of ``intermediate_size``, always renormalised, fp32 weights."""
        return cls(config, config.num_local_experts, config.intermediate_size, "intermediate_size",
                   "num_local_experts", True, tp, expert=MixtralExpert, fp32_weights=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if not self.fp32_weights:
            weights = weights.to(x.dtype)
        out = run_experts(self.experts, x, idx, weights).to(x.dtype)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)
