"""Mixtral: Llama's attention (``sliding_window``, when set, on every layer: ``llama.layer_window``)
with the sparse MoE block on every layer, named ``block_sparse_moe`` in its checkpoints, its experts'
projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from __future__ import annotations

from torch import nn

from actors.engine.models.base import LORA_ATTENTION
from actors.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from actors.engine.models.moe import SparseMoeBlock
from actors.engine.parallel import TPGroup


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_name = "block_sparse_moe"

    def build_mlp(self, config, layer_id: int, tp: TPGroup) -> nn.Module:
        return SparseMoeBlock.mixtral(config, tp)


class MixtralForCausalLM(LlamaForCausalLM):
    # (every layer's MLP is its experts: w1 gate, w3 up, w2 down)
    supported_lora_modules = LORA_ATTENTION + tuple(f"block_sparse_moe.experts.{p}" for p in ("w1", "w3", "w2"))
    layer_cls = MixtralDecoderLayer
