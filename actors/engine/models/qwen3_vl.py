"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): Qwen3's decoder with interleaved M-RoPE, and a
vision tower whose intermediate features are added to the first decoder layers (DeepStack).

The vision tower (``visual``, HF's names): a patch embedding (with a bias) plus a learned position
table resampled bilinearly to the image's grid, blocks of LayerNorm, 2-D rotary attention over the
whole frame and a GELU MLP, then a patch merger (``merger``). The blocks of
``deepstack_visual_indexes`` also feed a merger of their own (``deepstack_merger_list``, normed after
the merge): the i-th one's output is added to the image tokens' hidden states after decoder layer i.
An image's encoding is those merged features side by side, ``[tokens, hidden · (1 + deepstack)]``,
kept and cut per chunk as Qwen2.5-VL's (:func:`actors.engine.multimodal.image_embeddings`): a chunk's
rows carry their DeepStack features with them.

M-RoPE is interleaved (``mrope_interleaved``): the frequency bands take the temporal, height and
width positions in turn (:class:`~actors.engine.layers.MRotaryEmbedding`); the prompt's positions
are Qwen2.5-VL's for images (:func:`~actors.engine.models.qwen2_5_vl.mrope_positions`). A video's temporal
patches are items of their own (``frame_timestamps``), each after its timestamp's text (HF's processor's
``<1.5 seconds>``) and at positions of one frame: the prompt's text tells the time, as in HF's
``get_rope_index``. The tower encodes a frame alone as in a video (its attention, rotary and position table are
per frame).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.layers import MRotaryEmbedding, get_activation
from actors.engine.models.llama import LlamaAttention, LlamaDecoderLayer, rope_settings
from actors.engine.models.qwen2_5_vl import (PatchEmbed, Qwen2_5_VLForConditionalGeneration, Segments,
                                             VisionAttention, merge_block_order, vision_rotary)
from actors.engine.parallel import SINGLE, TPGroup


class VisionMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``spatial_merge_size²`` neighbouring patches → one token of the decoder's width; normed per patch,
    or (``postshuffle``: a DeepStack merger) over the merged patches."""

    def __init__(self, config, postshuffle: bool = False):
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle else config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.linear_fc2 = nn.Linear(self.hidden_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden_size) if self.postshuffle else x).view(-1, self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.side = int(config.num_position_embeddings ** 0.5)  # the learned position table's grid side
        self.patch_embed = PatchEmbed(config, bias=True)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self.deepstack_visual_indexes = list(config.deepstack_visual_indexes)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, postshuffle=True)
                                                   for _ in self.deepstack_visual_indexes)

    def forward(self, pixels: torch.Tensor, grid_thw: Tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t·h·w, patch_dim] → its tokens' features [t·h·w / merge², out_hidden ·
        (1 + deepstack)]: the merger's, then each DeepStack merger's."""
        t, h, w = grid_thw
        x = self.patch_embed(pixels) + self._positions(t, h, w).to(pixels.device)
        cos, sin = vision_rotary(t, h, w, self.merge, self.head_dim, self.rope_theta, pixels.device)
        frames = Segments.of([i * h * w for i in range(t + 1)], pixels.device)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.deepstack_visual_indexes:
                features.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x)] + features, dim=-1)

    def _positions(self, t: int, h: int, w: int) -> torch.Tensor:
        """[t·h·w, hidden]: the position table resampled to h x w (bilinear, corners aligned: HF's
        ``fast_pos_embed_interpolate``), patches in merge-block order, each frame alike."""
        table = self.pos_embed.weight.view(self.side, self.side, -1).permute(2, 0, 1)[None]
        grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        return merge_block_order(grid, h, w, self.merge).to(table.dtype).repeat(t, 1)


class Qwen3VLAttention(LlamaAttention):
    """Qwen3's attention (per-head q/k RMSNorm) with interleaved M-RoPE."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__(config, layer_id, tp)
        theta, rope_type, params = rope_settings(config)
        self.rotary = MRotaryEmbedding(self.head_dim, theta, params["mrope_section"], rope_type, params,
                                       interleaved=True)


class Qwen3VLDecoderLayer(LlamaDecoderLayer):
    """After the layer, the image tokens' hidden states take its DeepStack features (layers below the count)."""

    attention_cls = Qwen3VLAttention

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__(config, layer_id, tp)
        self.layer_id = layer_id

    def forward(self, positions, x, forward_batch):
        x = super().forward(positions, x, forward_batch)
        deepstack = forward_batch.deepstack_embeds
        if deepstack is not None and self.layer_id < deepstack[1].shape[1]:
            index, rows = deepstack
            x = x.index_add(0, index, rows[:, self.layer_id].to(x.dtype))
        return x


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    """The decoder is built from ``text_config`` (Qwen3's), ``visual`` from ``vision_config``."""

    layer_cls = Qwen3VLDecoderLayer
    vision_cls = VisionTransformer
    frame_timestamps = True  # (multimodal.MultimodalProcessor: a video's temporal patches, each after its time)

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__(config, tp)
        # (the features come from the first stage's vision tower; a later stage's layers may add them)
        self.model.deepstack_layers = len(config.vision_config.deepstack_visual_indexes)

    def place_images(self, x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, forward_batch) -> None:
        """Qwen2.5-VL's with the rows' first ``hidden`` features; the rest, [rows, deepstack, hidden], go to the
        decoder layers (``forward_batch.deepstack_embeds``)."""
        hidden = x.shape[1]
        x[index] = rows[:, :hidden].to(x.dtype)
        forward_batch.deepstack_embeds = (index, rows[:, hidden:].view(rows.shape[0], -1, hidden))
