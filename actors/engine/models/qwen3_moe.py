"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with the
sparse MoE block (:mod:`actors.engine.models.moe`) on every ``decoder_sparse_step``-th layer but those
in ``mlp_only_layers``, which keep a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from torch import nn

from actors.engine.models.base import LORA_ATTENTION, LORA_EXPERTS, LORA_MLP
from actors.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from actors.engine.models.moe import SparseMoeBlock, is_sparse_layer
from actors.engine.parallel import TPGroup


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return SparseMoeBlock.qwen(config, tp)
        return super().build_mlp(config, layer_id, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    # Llama's (the MLP's on the dense layers, mlp_only_layers, only) and the routed experts'
    supported_lora_modules = LORA_ATTENTION + LORA_MLP + LORA_EXPERTS
    layer_cls = Qwen3MoeDecoderLayer
