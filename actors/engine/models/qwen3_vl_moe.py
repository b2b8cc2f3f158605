"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL
(its vision tower, DeepStack, interleaved M-RoPE: :mod:`.qwen3_vl`) with Qwen3-MoE's sparse block on every
``decoder_sparse_step``-th layer but those of ``mlp_only_layers``.

The block's router is ``mlp.gate`` (top-k of the fp32 softmax, always renormalised). The bf16 releases store its
experts as 3-D tensors, ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (:class:`~.moe.StackedExperts`:
transformers 5's layout, or the released checkpoints' transposed one, read transposed); the quantized ones (Qwen's
block FP8, community GPTQ / AWQ / compressed-tensors) per expert, ``mlp.experts.{e}.gate_proj.weight`` ... as
Qwen3-MoE's, which :class:`Qwen3VLMoePerExpertForConditionalGeneration` holds as Qwen3-MoE does
(:class:`~.moe.ExpertList`), so that the per-expert quantized layers serve them (:meth:`for_checkpoint` picks the
class by the checkpoint's names; vLLM's one loader takes both). Both MoE backends, TP and EP serve either as the
other MoE families'. LoRA adapters take the attention, the dense layers' MLP (``mlp_only_layers``) and the
experts: PEFT's ``target_parameters`` wrappers over ``gate_up_proj`` and ``down_proj``, or per-expert names as
Qwen3-MoE's (``mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj``).
"""

from __future__ import annotations

import re
from typing import Iterable

from torch import nn

from actors.engine.models.base import LORA_ATTENTION, LORA_EXPERTS, LORA_MLP
from actors.engine.models.moe import SparseMoeBlock, is_sparse_layer
from actors.engine.models.qwen3_vl import Qwen3VLDecoderLayer, Qwen3VLForConditionalGeneration
from actors.engine.parallel import TPGroup

# a tensor of one expert of a checkpoint storing them per expert (served names)
PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


class Qwen3VLMoeDecoderLayer(Qwen3VLDecoderLayer):
    stacked_experts = True  # (the experts as the checkpoint stores them: in 3-D tensors, or per expert)

    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return SparseMoeBlock.qwen3_vl(config, tp, self.stacked_experts)
        return super().build_mlp(config, layer_id, tp)


class Qwen3VLMoePerExpertDecoderLayer(Qwen3VLMoeDecoderLayer):
    stacked_experts = False


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    layer_cls = Qwen3VLMoeDecoderLayer
    supported_lora_modules = LORA_ATTENTION + LORA_MLP + LORA_EXPERTS

    @staticmethod
    def for_checkpoint(names: Iterable[str]) -> type:
        """The class serving a checkpoint of these tensor names (served names): this one where it stores the
        experts stacked, :class:`Qwen3VLMoePerExpertForConditionalGeneration` where per expert."""
        if any(PER_EXPERT.search(name) for name in names):
            return Qwen3VLMoePerExpertForConditionalGeneration
        return Qwen3VLMoeForConditionalGeneration


class Qwen3VLMoePerExpertForConditionalGeneration(Qwen3VLMoeForConditionalGeneration):
    """A checkpoint's with its experts stored per expert: Qwen3-MoE's experts (:class:`~.moe.ExpertList`), each
    expert's layers block FP8, packed or compressed as stored (fused by the MoE backend as Qwen3-MoE's)."""

    layer_cls = Qwen3VLMoePerExpertDecoderLayer
