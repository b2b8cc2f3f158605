"""Multi-LoRA serving (SGLang's ``srt/lora``, vLLM's ``--enable-lora``): PEFT adapters applied per request.

Every adapter of ``EngineConfig.lora_paths`` is read at start into host memory (those loaded at
runtime join them, up to ``max_loaded_loras``); ``max_loras_per_batch`` slots of stacked device
buffers per targeted layer (those of ``lora_target_modules``, else those the start adapters
target) — A ``[num_slots, max_lora_rank, in]``, B ``[num_slots, out, max_lora_rank]``, a smaller
rank zero-padded (the padding adds nothing) — with each slot's scaling (PEFT's ``lora_alpha / r``,
``lora_alpha / sqrt(r)`` with ``use_rslora``) hold the adapters the running requests use, swapped
in from host memory as requests need them (:meth:`LoRAManager.fetch`). A request names its adapter
(``lora_path``; None: the base model) and every token of it gets, on each targeted linear,
``scaling[s] · (x Aₛᵀ) Bₛᵀ`` of its slot ``s`` added: the forward's tokens are grouped by slot
once (:meth:`LoRAManager.prepare`), then each :class:`LoRALinear` runs two small matmuls a group,
so base requests and several adapters share one forward.

Under TP a slot is sharded as its base layer: a column-parallel layer holds its rows of B (A
whole), a row-parallel one its columns of A (B whole), whose partial delta joins the base
layer's partial output before the one all-reduce — the sum of the ranks' deltas is the whole one;
a replicated layer (MLA's latent projections) holds both whole. A layer whose weight the model reads
rather than runs (MLA's absorbed ``kv_b_proj``) applies its slots' ``B`` and ``A`` in the model's own
factors (:func:`absorbed_lora`). A MoE layer's routed experts take adapters per expert, their slots stacked
for the layer and their deltas added inside the experts' forward (:mod:`actors.engine.lora_experts`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F

from actors.engine.config import LORA_TARGET_MODULES
from actors.engine.lora_experts import (EXPERT_MODULE, FUSED_EXPERTS, ExpertLoRA, ExpertSlots, SlotCut, check_expert,
                                        expert_modules, layer_module, split_fused_experts)
from actors.engine.lora_packed import stack_packed
from actors.engine.parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

logger = logging.getLogger(__name__)

# a module of a decoder layer: model.layers.<i>.<its name in the layer> (what the model's supported_lora_modules list)
LAYER_MODULE = re.compile(r"^model\.layers\.\d+\.([\w.]+)$")
# a PEFT checkpoint's tensor name: base_model.model.<the base model's module>.lora_{A,B}.weight; a vision-language
# model's decoder layers are model.language_model.layers.* under transformers 4.52 on, model.layers.* before
ADAPTER_KEY = re.compile(r"^base_model\.model\.model\.(?:language_model\.)?(layers\.\d+\.[\w.]+)\.lora_([AB])\.weight$")
# ... and its vision tower's modules (visual.*, model.visual.*): ignored, as vLLM's (enable_tower_connector_lora off)
VISION_KEY = re.compile(r"^base_model\.model\.((?:model\.)?visual\.[\w.]+)\.lora_[AB]\.weight$")
# adapter_config.json settings that change what an adapter computes beyond y += s·B·A·x: refused, not ignored
UNSUPPORTED_SETTINGS = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
                        "alpha_pattern": "alpha_pattern"}


@dataclass(frozen=True)
class LoRAAdapter:
    """One PEFT adapter as read from its directory: ``weights`` maps a module of the base model
    (``model.layers.0.self_attn.q_proj``) to its ``(A [r, in], B [out, r])`` (this rank's shards,
    padded to the slots' rank, once :meth:`LoRAManager.shard` cut it)."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def read_adapter(name: str, path: str) -> LoRAAdapter:
    """The adapter in ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``); a
    setting or tensor this engine does not apply as PEFT would raises ValueError naming it."""
    config_path, weights_path = os.path.join(path, "adapter_config.json"), os.path.join(path, "adapter_model.safetensors")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise FileNotFoundError(f"LoRA adapter {name!r}: no {os.path.basename(needed)} in {path!r}")
    with open(config_path) as f:
        config = json.load(f)
    for key, what in UNSUPPORTED_SETTINGS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {what} ({key}) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", 8))  # (PEFT's default alpha)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(weights_path)
    vision = sorted({match[1] for key in tensors if (match := VISION_KEY.match(key))})
    if vision:
        logger.warning("LoRA adapter %r: its vision tower's modules (%s%s) are ignored: only the language model's "
                       "layers take adapters (vLLM ignores them alike unless enable_tower_connector_lora is set)",
                       name, ", ".join(vision[:4]), ", ..." if len(vision) > 4 else "")
    halves: Dict[str, Dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if VISION_KEY.match(key):
            continue
        match = ADAPTER_KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a decoder layer's module")
        halves.setdefault(f"model.{match[1]}", {})[match[2]] = tensor
    weights = {}
    for module, pair in halves.items():
        fused = FUSED_EXPERTS.match(module) is not None  # (experts·r rows: split_fused_experts checks them)
        if set(pair) != {"A", "B"} or not fused and (pair["A"].shape[0] != rank or pair["B"].shape[1] != rank):
            shapes = {half: tuple(t.shape) for half, t in pair.items()}
            raise ValueError(f"LoRA adapter {name!r}: {module} needs lora_A [r={rank}, in] and lora_B [out, r], "
                             f"got {shapes}")
        weights[module] = (pair["A"], pair["B"])
    return LoRAAdapter(name, path, rank, scaling, weights)


def lora_cache_key(name: str, num_loads: int) -> str:
    """The radix ``extra_key`` of adapter ``name``'s requests after ``num_loads`` earlier loads of the
    name: the name at its first load, ``name#k`` at its k-th reload (:class:`HostAdapter`)."""
    return name if num_loads == 0 else f"{name}#{num_loads}"


@dataclass(frozen=True)
class HostAdapter:
    """An adapter kept in host memory: its scaling, its ``(A, B)`` per module (this rank's shards,
    zero-padded to the slots' rank), and its requests' radix ``extra_key``: its name at the name's
    first load, ``name#k`` at its k-th reload — KV an unloaded adapter left in the tree is never a
    hit for another adapter loaded under its name (SGLang keys a load by its own lora_id alike). A
    PD cluster's backend counts the loads for every worker (a worker added later has loaded fewer)
    and names the key, which its router hashes the requests' prefixes under too."""

    scaling: float
    shards: Dict[str, Tuple[torch.Tensor, torch.Tensor]]
    cache_key: str


class LoRAManager:
    """The adapters in host memory (this rank's shards, zero-padded to ``max_rank``), the
    ``num_slots`` device slots that hold those a batch uses, the targeted layers of ``model``
    swapped for :class:`LoRALinear` ones, and the current forward's token groups.

    Slots are a cache (SGLang's LoRA memory pool, vLLM's ``max_loras``): the scheduler asks
    :meth:`fetch` for a request's slot when it admits it — a free slot, else the least recently
    used one whose adapter no request it still runs uses — and a request whose adapter finds
    none waits. ``slot_names`` is that assignment (TP rank 0's); a forward batch names the adapter
    each of its slots must hold and :meth:`prepare` copies in, on every rank, those its slot does
    not hold yet (``loaded``), so the other ranks follow rank 0's assignment.

    ``full_model``: the model's unsharded modules (on the meta device) that each adapter tensor's
    shape is checked against before this rank takes its shard. ``config``: the EngineConfig, whose
    ``max_loras_per_batch``, ``max_lora_rank``, ``lora_target_modules`` and ``max_loaded_loras`` it
    follows (the rank and the layers those of the start ``adapters`` where the two are None).
    The layers that may take adapters are those of the model's ``supported_lora_modules`` (its decoder layers'
    attention and dense MLP projections, a MoE's shared expert and routed experts; an expert's projection is
    targeted in all the layer's experts this rank holds at once, :class:`ExpertLoRA` stacking their slots)."""

    def __init__(self, model: nn.Module, full_model: nn.Module, adapters: List[LoRAAdapter], config,
                 dtype: torch.dtype, device: torch.device):
        self.model_name, self.supported_modules = type(model).__name__, getattr(model, "supported_lora_modules", ())
        self.packed_modules = getattr(model, "packed_modules_mapping", {})
        if not self.supported_modules:
            raise ValueError(f"LoRA adapters are not supported for {self.model_name} "
                             "(lora_paths, lora_target_modules)")
        self.full_model = full_model
        self.target_modules = config.lora_target_modules
        self.fused_taking_parts = self._fused_taking_parts(adapters)
        adapters = [self._model_modules(adapter) for adapter in adapters]
        for adapter in adapters:
            self._check_modules(adapter)
        self.max_rank = config.max_lora_rank or max(a.rank for a in adapters)
        self.max_loaded = config.max_loaded_loras
        num_slots = config.max_loras_per_batch
        self.slot_names: List[Optional[str]] = [None] * num_slots  # the adapter each slot is given to
        self.loaded: List[Optional[str]] = [None] * num_slots  # ... and the one its buffers hold
        self.last_used = [0] * num_slots
        self._clock = 0
        self.scaling = torch.zeros(num_slots, dtype=dtype, device=device)
        self.groups: List[Tuple[int, torch.Tensor]] = []  # this forward's (slot, its token indices)
        # ... and each token's slot (-1: none), with any groups, where routed experts take adapters
        self.token_slots: Optional[torch.Tensor] = None
        self.layers: Dict[str, Union[LoRALinear, ExpertSlots]] = {}
        self.experts: Dict[str, ExpertLoRA] = {}  # by the path of a MoE layer's experts
        targets = self._target_layers(model) if self.target_modules else {m for a in adapters for m in a.weights}
        self._wrap_experts(model, [m for m in targets if EXPERT_MODULE.match(m)], num_slots, dtype, device)
        for module in sorted(m for m in targets if not EXPERT_MODULE.match(m)):
            base, rank = _module(model, module), self._slot_rank(module)
            parent, _, attr = module.rpartition(".")
            lora_a = torch.zeros(num_slots, rank, base.in_features, dtype=dtype, device=device)
            lora_b = torch.zeros(num_slots, base.out_features, rank, dtype=dtype, device=device)
            cut = SlotCut.of_linear(_module(full_model, module), base)
            self.layers[module] = LoRALinear(base, cut, lora_a, lora_b, self)
            setattr(model.get_submodule(parent), attr, self.layers[module])
        self.host: Dict[str, HostAdapter] = {}
        self.retiring: Set[str] = set()  # being unloaded: refused to new requests, kept for those in flight
        self.num_loads: Dict[str, int] = {}  # by name, loads so far (the cache key of the next)
        for adapter in adapters:
            self.add(self.shard(adapter))

    def _wrap_experts(self, model: nn.Module, targets: List[str], num_slots: int, dtype: torch.dtype,
                      device: torch.device) -> None:
        """An :class:`ExpertLoRA` on each MoE layer an expert of ``targets`` is in, over the projections they
        name, for every expert this rank holds (an adapter of expert 0 alone still gets the layer's slots: a
        later one may target the others; under EP ``targets`` may name experts another rank holds)."""
        names: Dict[str, Set[str]] = {}
        for module in targets:
            check_expert(self.full_model, module)
            match = EXPERT_MODULE.match(module)
            names.setdefault(match[1], set()).add(match[3])
        for path, projections in names.items():
            experts = model.get_submodule(path)
            experts.lora = self.experts[path] = ExpertLoRA(experts, self.full_model.get_submodule(path), self,
                                                           sorted(projections), num_slots, self.max_rank, dtype, device)
            for e in experts.held:
                for name in projections:
                    self.layers[f"{path}.{e}.{name}"] = experts.lora.slots(e, name)

    def _held_elsewhere(self, module: str) -> bool:
        """Whether ``module`` is an expert's targeted projection that another EP rank holds (this rank drops it)."""
        match = EXPERT_MODULE.match(module)
        lora = self.experts.get(match[1]) if match else None
        if lora is None or match[3] not in lora.targeted or int(match[2]) in lora.experts.held:
            return False
        check_expert(self.full_model, module)
        return True

    def _model_modules(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """``adapter`` with its PEFT ``target_parameters`` wrappers over fused 3-D expert parameters taken apart
        into each expert's projections (:func:`split_fused_experts`), and its adapters of a fused projection's
        parts (Phi-3's q_proj, k_proj, v_proj) stacked into one of the fused layer (:func:`stack_packed`);
        ValueError naming one that fits no layer of the model."""
        try:
            weights = split_fused_experts(adapter.weights, adapter.rank, self.full_model)
            weights = stack_packed(weights, adapter.rank, self.packed_modules, lambda m: _module(self.full_model, m))
        except ValueError as e:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {e}") from None
        return replace(adapter, weights=weights)

    def _fused_taking_parts(self, adapters: List[LoRAAdapter]) -> Set[str]:
        """The fused projections (Phi-3's qkv_proj, gate_up_proj) whose slots are sized for adapters of their parts,
        by what is given at start (as SGLang and vLLM size their buffers): those a start adapter (as read, its parts
        not stacked yet) has a part of (q_proj), or ``lora_target_modules`` names a part of ('all' does). The others
        hold ``max_rank``, as vLLM's single slice of Phi-3's qkv_proj: most of its adapters are trained on the fused
        projections, and a slot of ``max_rank`` per part would take 2–3× their memory from the KV cache (an adapter
        of q_proj and v_proj alone, PEFT's default on Llama, leaves gate_up_proj's at ``max_rank``)."""
        named = {module.rpartition(".")[2] for adapter in adapters for module in adapter.weights}
        named |= set(self.target_modules or ())
        return {fused for fused, parts in self.packed_modules.items() if named & set(parts)}

    def _slot_rank(self, module: str) -> int:
        """The rank of ``module``'s slots: ``max_rank``, times its parts for a fused projection whose slots take
        adapters of its parts (:meth:`_fused_taking_parts`; SGLang's stacked buffers): each part's adapter takes
        its own ``max_rank`` columns of B."""
        leaf = module.rpartition(".")[2]
        return self.max_rank * (len(self.packed_modules[leaf]) if leaf in self.fused_taking_parts else 1)

    def _target_layers(self, model: nn.Module) -> Set[str]:
        """The layers of ``lora_target_modules``' projections in every decoder layer of ``model`` (of its
        ``supported_lora_modules``: ``gate_proj`` names no layer of Mixtral, whose MLPs are all experts; GPT-OSS's
        experts' ``gate_up_proj`` and ``down_proj``, no modules, by :func:`expert_modules`); a fused projection
        (``packed_modules_mapping``: Phi-3's qkv_proj) is targeted by its name or a part's, as in SGLang.
        ValueError for a name that targets no layer (it would be silently left out), unless the list is every
        name ('all')."""
        modules = [name for name, _ in model.named_modules()] + expert_modules(model)
        leaves = {name: match[1].rpartition(".")[2] for name in modules
                  if (match := LAYER_MODULE.match(name)) and layer_module(match[1]) in self.supported_modules}
        names = {leaf: {leaf, *self.packed_modules.get(leaf, ())} for leaf in set(leaves.values())}
        known, targets = set().union(*names.values()), set(self.target_modules)
        if not targets <= known and targets != set(LORA_TARGET_MODULES):
            raise ValueError(f"lora_target_modules: {', '.join(sorted(targets - known))} names no layer of "
                             f"{self.model_name} that takes adapters (those it has: {', '.join(sorted(known))})")
        return {name for name, leaf in leaves.items() if names[leaf] & targets}

    def _check_modules(self, adapter: LoRAAdapter) -> None:
        """ValueError naming the modules of ``adapter`` outside the model's ``supported_lora_modules`` (an experts'
        projection named by no expert, as GPT-OSS's 3-D parameter ``mlp.experts.gate_up_proj``): checked before
        any layer is wrapped."""
        other = sorted(m for m in adapter.weights
                       if layer_module(name := LAYER_MODULE.match(m)[1]) not in self.supported_modules
                       or ".experts." in name and not EXPERT_MODULE.match(m))
        if other:
            why = ("; a routed expert's projection is named by its expert (experts.{e}.<projection>) or, over 3-D "
                   "experts, by PEFT's target_parameters wrapper (experts.lora_A, lora_B)"
                   if any(".experts." in m and not EXPERT_MODULE.match(m) for m in other) else "")
            raise ValueError(f"LoRA adapter {adapter.name!r} targets {', '.join(other)}: {self.model_name} takes "
                             f"adapters on {', '.join(self.supported_modules)} of a decoder layer only{why}")

    def shard(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """``adapter`` with this rank's shard of each module, padded to the slots' rank, as its
        weights (what :meth:`add` keeps); ValueError when it does not fit the slots (rank, a module
        no slot layer has, shapes). It reads only what is fixed at start, so a runtime load runs it
        outside the engine loop's lock (:mod:`actors.engine.lora_updates`). Under EP the experts another rank
        holds are left out."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"max_lora_rank={self.max_rank} is below the rank of LoRA adapter(s) "
                             f"{adapter.name} (r={adapter.rank})")
        adapter = self._model_modules(adapter)
        self._check_modules(adapter)
        other = sorted(m for m in adapter.weights if m not in self.layers and not self._held_elsewhere(m))
        if other:
            layers = (f"lora_target_modules={self.target_modules}" if self.target_modules else
                      "the adapters served at start (lora_target_modules sets others)")
            raise ValueError(f"LoRA adapter {adapter.name!r} targets {', '.join(other)}, outside the layers that "
                             f"take adapters: those of {layers}")
        return replace(adapter, weights={module: self._shard(module, adapter) for module in adapter.weights
                                         if module in self.layers})

    def add(self, sharded: LoRAAdapter, cache_key: Optional[str] = None) -> None:
        """Keep ``sharded`` (:meth:`shard`'s) in host memory under ``cache_key`` (None: this manager's
        count of the name's loads gives it); ValueError when its name is served already or
        ``max_loaded_loras`` adapters are held already (SGLang refuses it too)."""
        if sharded.name in self.host:
            raise ValueError(f"LoRA adapter {sharded.name!r} is loaded already")
        if self.max_loaded is not None and len(self.host) >= self.max_loaded:
            raise ValueError(f"LoRA adapter {sharded.name!r}: max_loaded_loras={self.max_loaded} adapters are in host "
                             f"memory already ({', '.join(self.host)}); unload one first")
        loads = self.num_loads.get(sharded.name, 0)
        cache_key = cache_key or lora_cache_key(sharded.name, loads)
        self.host[sharded.name] = HostAdapter(sharded.scaling, sharded.weights, cache_key)
        self.num_loads[sharded.name] = loads + 1

    def remove(self, name: str) -> None:
        """Drop adapter ``name`` (no request uses it any more) from host memory and its slot."""
        del self.host[name]
        self.retiring.discard(name)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None
        for slot, held in enumerate(self.loaded):
            if held == name:  # (a later adapter of this name is copied in anew)
                self.loaded[slot] = None

    def _shard(self, module: str, adapter: LoRAAdapter) -> Tuple[torch.Tensor, torch.Tensor]:
        """``adapter``'s A and B of ``module``, this rank's shard, zero-padded to the slots' rank."""
        layer = self.layers[module]
        a, b = adapter.weights[module]
        rank = a.shape[0]  # (the adapter's, or its parts' stacked: read_adapter checked each A)
        want_a, want_b = (rank, layer.cut.in_features), (layer.cut.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(f"LoRA adapter {adapter.name!r}: {module} lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)} do not fit the model's layer (want {want_a} and {want_b})")
        slot_rank = self._slot_rank(module)
        if rank > slot_rank:  # (its parts stacked: shard checked the adapter's own rank)
            leaf = module.rpartition(".")[2]
            raise ValueError(f"LoRA adapter {adapter.name!r}: its adapters of the parts of {module} stack to rank "
                             f"{rank}, above its slots' {slot_rank} (max_lora_rank={self.max_rank}: sized for "
                             f"adapters of the fused {leaf}, as no start adapter nor lora_target_modules names its "
                             f"parts); serve it from the start (lora_paths) or name its parts in lora_target_modules "
                             f"({', '.join(self.packed_modules[leaf])}), whose slots then hold max_lora_rank per part")
        a, b = layer.cut.take(a, b)
        padded_a = torch.zeros(slot_rank, a.shape[1], dtype=layer.lora_a.dtype)
        padded_b = torch.zeros(b.shape[0], slot_rank, dtype=layer.lora_b.dtype)
        padded_a[:rank], padded_b[:, :rank] = a, b
        return padded_a, padded_b

    def check(self, name: str) -> None:
        """ValueError for an adapter not served (never loaded, or being unloaded)."""
        if name not in self.host or name in self.retiring:
            served = [n for n in self.host if n not in self.retiring]
            raise ValueError(f"unknown LoRA adapter {name!r}; loaded: {', '.join(served)}")

    def fetch(self, name: str, keep: Set[Optional[str]]) -> Optional[int]:
        """Adapter ``name``'s slot, given one if it has none: a free slot, else the least recently
        used whose adapter is not in ``keep`` (those of the requests still running; its host copy
        stays); None when every slot holds one of ``keep`` — the request waits."""
        if name in self.slot_names:
            slot = self.slot_names.index(name)
        else:
            free = [s for s, held in enumerate(self.slot_names) if held is None or held not in keep]
            if not free:
                return None
            slot = min(free, key=lambda s: (self.slot_names[s] is not None, self.last_used[s]))
            self.slot_names[slot] = name
        self._clock += 1
        self.last_used[slot] = self._clock
        return slot

    def batch_fields(self, names: List[Optional[str]]) -> Dict[str, object]:
        """A forward batch's ``lora_slots`` (each request's, -1: the base model) and
        ``lora_slot_names`` (the adapter each of its slots must hold); none when no request has one.
        Every adapter of the batch has its slot (:meth:`fetch` at admission)."""
        if all(name is None for name in names):
            return {}
        slots = [-1 if name is None else self.slot_names.index(name) for name in names]
        used = set(slots) - {-1}
        self._clock += 1
        for slot in used:
            self.last_used[slot] = self._clock
        return {"lora_slots": slots, "lora_slot_names": {s: self.slot_names[s] for s in used}}

    def _load(self, slot: int, name: str) -> None:
        """Copy adapter ``name`` from host memory into ``slot`` (zeros where it targets no module)."""
        adapter = self.host[name]
        for module, layer in self.layers.items():
            if module in adapter.shards:
                a, b = adapter.shards[module]
                layer.lora_a[slot].copy_(a)
                layer.lora_b[slot].copy_(b)
            else:
                layer.lora_a[slot].zero_()
                layer.lora_b[slot].zero_()
        self.scaling[slot] = adapter.scaling
        self.loaded[slot] = name

    def prepare(self, forward_batch) -> None:
        """Copy in the adapters of the batch's slots that they do not hold yet
        (``lora_slot_names``), then group the batch's tokens by their request's slot
        (``lora_slots``; -1 and None: the base model's, in no group), on the batch's device."""
        self.groups, self.token_slots = [], None
        slots = forward_batch.lora_slots
        if slots is None:
            return
        for slot, name in forward_batch.lora_slot_names.items():
            if self.loaded[slot] != name:
                self._load(slot, name)
        token_slots = torch.repeat_interleave(torch.tensor(slots), torch.tensor(forward_batch.extend_seq_lens_cpu))
        device = forward_batch.input_ids.device
        if self.experts:  # (the routed experts' adapters read each token's slot; dense layers read the groups)
            self.token_slots = token_slots.to(device)
        for slot in sorted(set(slots) - {-1}):
            self.groups.append((slot, (token_slots == slot).nonzero()[:, 0].to(device)))


def _module(model: nn.Module, name: str) -> nn.Module:
    """``model``'s linear layer ``name``; ValueError when it has none there (a layer index past its last)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        module = None
    if not isinstance(module, (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear)):
        raise ValueError(f"a LoRA adapter targets {name}, which the model has no linear layer at")
    return module


class LoRALinear(nn.Module):
    """A targeted layer: ``base(x)`` plus, for each token group of the forward, its slot's
    ``scaling · (x Aᵀ) Bᵀ`` (its slots this rank's part of an adapter: ``cut``). A row-parallel base under TP
    adds its partial delta before its all-reduce."""

    def __init__(self, base: nn.Module, cut: SlotCut, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 manager: LoRAManager):
        super().__init__()
        self.base, self.cut = base, cut
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.manager = manager  # (a plain attribute: the manager is no submodule)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.manager.groups
        if not groups:
            return self.base(x)
        partial = isinstance(self.base, RowParallelLinear) and self.base.tp.size > 1
        y = self.base.matmul(x) if partial else self.base(x)
        for slot, index in groups:
            shrunk = F.linear(x.index_select(0, index), self.lora_a[slot]) * self.manager.scaling[slot]
            y = y.index_add(0, index, F.linear(shrunk, self.lora_b[slot]))
        return self.base.reduced(y) if partial else y


def absorbed_lora(layer: nn.Module) -> Tuple[nn.Module, List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """For a layer whose weight the model reads rather than runs it (MLA's ``kv_b_proj``, absorbed into the
    query and the output): its base layer, and each token group of the forward's ``(token indices,
    scaling · A, B)`` of its slot — those tokens' weight is ``W + B (scaling · A)``, which the model applies
    in its own factors. No groups when the layer takes no adapter or the batch's requests use none."""
    if not isinstance(layer, LoRALinear):
        return layer, []
    return layer.base, [(index, layer.lora_a[slot] * layer.manager.scaling[slot], layer.lora_b[slot])
                        for slot, index in layer.manager.groups]
