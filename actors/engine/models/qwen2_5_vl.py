"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): Qwen2's decoder with M-RoPE, and a vision tower.

The vision tower (``visual``, HF's names) turns an image's patches into one embedding per
``spatial_merge_size²`` patches: a patch embedding, blocks with 2-D rotary attention — within
windows of ``window_size`` pixels, but for the ``fullatt_block_indexes`` blocks over the whole
image — and a patch merger. The patches are attended in window order (HF's ``window_index``)
and put back in the image's order after the merger. It runs in a prefill forward, once per
image (:func:`actors.engine.multimodal.image_embeddings`); under TP it is replicated on every
rank (its weights whole), the decoder sharded as Qwen2's.

A video (``video_data``) is one item of ``t`` temporal patches (two frames each), encoded as an image
of ``t`` frames (windows within each frame, full attention over each).

M-RoPE: each token has a (temporal, height, width) position (:func:`mrope_positions`, HF's
``get_rope_index``; a video's temporal patches ``tokens_per_second · second_per_grid_t`` apart); the
rotary's frequency bands are split by ``mrope_section``, each taking one of the three (:class:`~actors.engine.layers.MRotaryEmbedding`). A text token's three are
equal, which is plain RoPE: a batch without image requests runs as Qwen2.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from actors.engine.layers import GatedMLP, MRotaryEmbedding, RMSNorm, apply_rotary, band_periods
from actors.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, rope_settings
from actors.engine.multimodal import ImageItem, image_embeddings
from actors.engine.parallel import SINGLE, TPGroup
from actors.engine.pipeline import PPMissingLayer


def mrope_positions(prompt_len: int, spans: Sequence[Tuple[int, Tuple[int, int, int], Any]],
                    spatial_merge_size: int) -> Tuple[torch.Tensor, int]:
    """HF's ``get_rope_index`` for a prompt of text, images and videos whose tokens are ``spans`` ((offset, grid,
    temporal interval) each, in order): ([3, len] int64 positions, the request's ``mrope_position_delta``).
    Text counts on from the position after what came before; an image's (a video's) tokens, its merged grid
    frame by frame, row by row, are at that position + (frame · interval, truncated, row, column), and the text
    after it starts past its larger side. (A video's interval, Qwen2.5-VL's ``tokens_per_second ·
    second_per_grid_t``, is HF's fp32 tensor: its products truncate as HF's do.) The delta: the last position
    + 1 - the prompt's length."""
    chunks, pos, i = [], 0, 0
    for offset, (t, h, w), interval in spans:
        chunks.append(torch.arange(pos, pos + offset - i).expand(3, -1))
        pos += offset - i
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        frame, row, col = torch.meshgrid((torch.arange(t) * interval).long(), torch.arange(rows), torch.arange(cols),
                                         indexing="ij")
        chunks.append(torch.stack([frame.flatten(), row.flatten(), col.flatten()]) + pos)
        pos += max(rows, cols)
        i = offset + t * rows * cols
    chunks.append(torch.arange(pos, pos + prompt_len - i).expand(3, -1))
    positions = torch.cat(chunks, dim=1).to(torch.int64)
    return positions, int(positions.max()) + 1 - prompt_len


class Segments(NamedTuple):
    """The rows of each segment of a ``cu_seqlens`` (a window, or a whole frame) padded to the longest one, for
    one batched attention over all of them (vLLM's and SGLang's varlen attention, without a varlen kernel):
    ``index`` [segments, longest] the row at each place (a padding place repeats its segment's first row),
    ``rows`` [tokens] each row's place in the flattened padding, ``mask`` [segments, 1, 1, longest] the
    keys each segment attends, its own (None when the segments are alike: no padding)."""

    index: torch.Tensor
    rows: torch.Tensor
    mask: Optional[torch.Tensor]

    @classmethod
    def of(cls, cu_seqlens: List[int], device) -> "Segments":
        """Made on the host (no device sync), once an image for all its blocks."""
        starts = torch.tensor(cu_seqlens[:-1])
        lens = torch.tensor(cu_seqlens[1:]) - starts
        steps = torch.arange(int(lens.max()))
        valid = steps < lens[:, None]
        mask = None if bool(valid.all()) else valid[:, None, None, :].to(device)
        return cls((starts[:, None] + steps * valid).to(device), valid.flatten().nonzero()[:, 0].to(device), mask)


class VisionAttention(nn.Module):
    """Bidirectional attention within each of its :class:`Segments` (windows, or whole frames)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        # rotated in fp32, as HF's apply_rotary_pos_emb_vision
        q, k = (apply_rotary(t.float(), cos, sin, self.head_dim).to(x.dtype) for t in (q, k))
        # every segment in one SDPA: [segments, heads, longest, head_dim], a shorter one's padding masked as keys
        # (a padding place's query attends to its segment's keys: computed, never read)
        q, k, v = (t[segments.index].transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.mask).transpose(1, 2).flatten(0, 1)
        return self.proj(out[segments.rows].reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``spatial_merge_size²`` neighbouring patches (consecutive rows) → one token of the decoder's width."""

    def __init__(self, out_dim: int, context_dim: int, spatial_merge_size: int):
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size ** 2
        self.ln_q = RMSNorm(context_dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class PatchEmbed(nn.Module):
    """HF's Conv3d over one (temporal, height, width) patch per row: a kernel as large as its input,
    so a matrix product with the flattened kernel."""

    def __init__(self, config, bias: bool = False):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class VisionTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.merge = config.spatial_merge_size
        self.window = config.window_size // config.spatial_merge_size // config.patch_size  # merged tokens a side
        self.full_attention_blocks = set(config.fullatt_block_indexes)
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config.out_hidden_size, config.hidden_size, config.spatial_merge_size)

    def forward(self, pixels: torch.Tensor, grid_thw: Tuple[int, int, int]) -> torch.Tensor:
        """One image's (or video's) patches [t·h·w, patch_dim] → its tokens [t·h·w / merge², out_hidden]."""
        t, h, w = grid_thw
        unit = self.merge ** 2
        order, window_lens = self._window_order(t, h // self.merge, w // self.merge)
        order = order.to(pixels.device)
        patches = (order[:, None] * unit + torch.arange(unit, device=pixels.device)).flatten()  # window order
        x = self.patch_embed(pixels)[patches]
        cos, sin = vision_rotary(t, h, w, self.merge, self.head_dim, self.rope_theta, pixels.device)
        cos, sin = cos[patches], sin[patches]
        frames = Segments.of([i * h * w for i in range(t + 1)], pixels.device)
        windows = Segments.of([0] + torch.tensor(window_lens).mul(unit).cumsum(0).tolist(), pixels.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in self.full_attention_blocks else windows)
        return self.merger(x)[torch.argsort(order)]

    def _window_order(self, t: int, rows: int, cols: int) -> Tuple[torch.Tensor, List[int]]:
        """HF's ``get_vision_window_index`` for one grid of merged tokens: their indices window by
        window (frame, window row, window column; row-major inside), and each window's size."""
        index = torch.arange(t * rows * cols).view(t, rows, cols)
        order, lens = [], []
        for frame in range(t):
            for r in range(0, rows, self.window):
                for c in range(0, cols, self.window):
                    window = index[frame, r:r + self.window, c:c + self.window].flatten()
                    order.append(window)
                    lens.append(window.numel())
        return torch.cat(order), lens


def merge_block_order(x: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """``x`` [h, w, ...] of a frame's patches, row by row → [h·w, ...] in the patches' order: merge
    block by merge block (row-major), row-major inside each (HF's image processor's)."""
    return x.reshape(h // merge, merge, w // merge, merge, *x.shape[2:]).transpose(1, 2).reshape(h * w, *x.shape[2:])


def vision_rotary(t: int, h: int, w: int, merge: int, head_dim: int, theta: float,
                  device) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t·h·w, head_dim] (fp32) of each patch's (row, column), patches in merge-block order:
    half the bands turn with the row, half with the column (HF's axial vision RoPE)."""
    row, col = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    row, col = (merge_block_order(p, h, w, merge).repeat(t) for p in (row, col))
    inv_freq = 1.0 / band_periods(head_dim // 2, theta)
    freqs = torch.cat([row[:, None] * inv_freq, col[:, None] * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1).to(device)
    return emb.cos(), emb.sin()


class Qwen2_5_VLAttention(LlamaAttention):
    """Qwen2's attention (q/k/v biases) with M-RoPE."""

    def __init__(self, config, layer_id: int, tp: TPGroup = SINGLE):
        super().__init__(config, layer_id, tp)
        theta, rope_type, params = rope_settings(config)
        self.rotary = MRotaryEmbedding(self.head_dim, theta, params["mrope_section"], rope_type, params)


class Qwen2_5_VLDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2_5_VLAttention


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """The decoder is built from ``text_config``; ``visual`` from ``vision_config``, on the first
    pipeline stage only (the one that reads the input embeddings). LoRA adapters take the decoder's
    layers (Llama's modules), never the vision tower (``lora.read_adapter`` ignores, warning, an adapter's
    modules of it)."""

    layer_cls = Qwen2_5_VLDecoderLayer
    mrope_positions = staticmethod(mrope_positions)  # (the tokenizer side's: multimodal.MultimodalProcessor)
    # transformers' names since 4.52 (HF's model.named_parameters(), a checkpoint it saved) → the released ones
    checkpoint_renames = (("model.language_model.", "model."), ("model.visual.", "visual."))

    vision_cls = VisionTransformer

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__(config.get_text_config(), tp)
        self.visual = self.vision_cls(config.vision_config) if tp.pp.is_first else PPMissingLayer()

    def input_embeds(self, forward_batch):
        """The text embeddings with the rows of the images' tokens replaced by theirs; None (the
        embedding lookup of ``input_ids``) when the batch computes no image token."""
        if forward_batch.mm_items is None:
            return None
        # (an image token's id is its pad value: any id will do, its row is replaced)
        x = self.model.embed_tokens(forward_batch.input_ids.clamp(max=self.config.vocab_size - 1))
        images = image_embeddings(forward_batch, self.encode_image)
        if images is not None:
            self.place_images(x, *images, forward_batch)
        return x

    def place_images(self, x: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, forward_batch) -> None:
        """The image tokens' rows of ``x`` (flat ``index``) become their encodings' ``rows``."""
        x[index] = rows.to(x.dtype)

    def encode_image(self, item: ImageItem) -> torch.Tensor:
        return self.visual(item.pixel_values.to(self.model.embed_tokens.weight.device), item.grid_thw)
