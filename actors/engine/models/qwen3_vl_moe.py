"""Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL
(its vision tower, DeepStack, interleaved M-RoPE: :mod:`.qwen3_vl`) with Qwen3-MoE's sparse block on every
``decoder_sparse_step``-th layer but those of ``mlp_only_layers``.

The block's router is ``mlp.gate`` (top-k of the fp32 softmax, always renormalised); its experts are stored
as 3-D tensors, ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (:class:`~.moe.StackedExperts`:
transformers 5's layout, or the released checkpoints' transposed one, read transposed). Both MoE backends,
TP and EP serve them as the other MoE families'. LoRA adapters take the attention, the dense layers' MLP
(``mlp_only_layers``) and the stacked experts: PEFT's ``target_parameters`` wrappers over ``gate_up_proj`` and
``down_proj``, or per-expert names as Qwen3-MoE's (``mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj``).
"""

from __future__ import annotations

from torch import nn

from actors.engine.models.base import LORA_ATTENTION, LORA_EXPERTS, LORA_MLP
from actors.engine.models.moe import SparseMoeBlock, is_sparse_layer
from actors.engine.models.qwen3_vl import Qwen3VLDecoderLayer, Qwen3VLForConditionalGeneration
from actors.engine.parallel import TPGroup


class Qwen3VLMoeDecoderLayer(Qwen3VLDecoderLayer):
    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return SparseMoeBlock.qwen3_vl(config, tp)
        return super().build_mlp(config, layer_id, tp)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    layer_cls = Qwen3VLMoeDecoderLayer
    supported_lora_modules = LORA_ATTENTION + LORA_MLP + LORA_EXPERTS
