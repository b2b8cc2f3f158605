"""What one model forward sees: the batch laid out as flat token arrays.

The scheduler builds a :class:`ForwardBatch` per step. Tokens of all
requests are concatenated (``input_ids``, ``positions``, ``out_cache_loc``
have one entry per token); per-request arrays have one entry per request.
For request ``i`` of an extend batch::

    tokens [extend_start_loc[i], extend_start_loc[i] + extend_seq_lens[i])
    sit at positions [extend_prefix_lens[i], seq_lens[i]) of its sequence

A decode batch is the special case of one token per request; a verify batch
(speculative decoding) an extend of each request's last sampled token and its
draft, whose logits are returned at every token, not only the last. K/V of every
forward token are written at ``out_cache_loc``; attention reads a request's
whole context through its ``req_to_token`` row — never a contiguous copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch


def int64_tensor(values: Sequence[int], device="cpu") -> torch.Tensor:
    """A list of ints as an int64 tensor on ``device``, through numpy: ``torch.tensor`` over a
    Python list is 3–5× slower (torch 2.13, one thread: 64 ints 10 µs against 3 µs; 20,000 ints
    4.1 ms against 0.8 ms, a prefill batch's token ids or positions)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"  # SGLang's: drafts checked by the target model, an extend on the attention side

    @property
    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    @property
    def is_target_verify(self) -> bool:
        return self is ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64 KV slot of each token
    req_pool_indices: torch.Tensor  # [bs] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [bs] context length after this forward
    extend_prefix_lens: torch.Tensor  # [bs] tokens already in the cache
    extend_seq_lens: torch.Tensor  # [bs] tokens computed now
    extend_start_loc: torch.Tensor  # [bs] offset of each request's tokens
    req_to_token_pool: Any
    token_to_kv_pool: Any
    attn_backend: Any = None
    seq_lens_cpu: Optional[List[int]] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    # hybrid (Mamba) models: per request working slot, and where to save a checkpoint
    mamba_pool_indices: Optional[torch.Tensor] = None
    mamba_track_slots: Optional[List[Optional[int]]] = None
    mamba_track_lens: Optional[List[Optional[int]]] = None
    # input (prompt) logprobs: the flat token indices whose logits give them, the next prompt token at
    # each, how many rows each request has (in batch order), and the most top logprobs a request asks
    input_logprob_indices: Optional[torch.Tensor] = None
    input_logprob_next_ids: Optional[torch.Tensor] = None
    input_logprob_counts: Optional[List[int]] = None
    input_top_logprobs_num: int = 0
    # embedding requests at their last chunk: the flat index of each one's last token, in batch order
    embed_indices: Optional[torch.Tensor] = None
    # with one that scores among them: each one's two token ids (pooling.classifier_token_ids), [n, 2] in
    # embed_indices' order; an embedding request's row is zeros, its logits unread
    classifier_token_ids: Optional[torch.Tensor] = None
    # an extend batch with embedding requests: the flat index of the last token of each other request,
    # in batch order (the logits rows; an embedding request has none: it samples nothing)
    logits_indices: Optional[torch.Tensor] = None
    # a verify batch: each request's draft tokens (after its last sampled one), what its logits are checked against
    spec_draft_tokens: Optional[List[List[int]]] = None
    # each request's LoRA adapter slot, -1 for the base model (None: no request has an adapter)
    lora_slots: Optional[List[int]] = None
    # the adapter each slot of lora_slots must hold: a rank whose slot holds another copies it in first
    lora_slot_names: Optional[Dict[int, str]] = None
    # a batch with an image request (actors.engine.multimodal): each token's M-RoPE positions [3, num_tokens]
    # (a text token's three its position), and, in an extend computing image tokens, each request's images
    # with a token in it (ImageItem lists, in batch order)
    mrope_positions: Optional[torch.Tensor] = None
    mm_items: Optional[List[List[Any]]] = None
    # Qwen3-VL's: the image tokens' flat indices and DeepStack features [n, layers, hidden], added after the
    # first decoder layers (set inside the forward, by its model's place_images: never sent to a follower)
    deepstack_embeds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.numel())

    def rope_positions(self) -> torch.Tensor:
        """The positions the rotary embeddings turn by: ``mrope_positions`` when the batch has them."""
        return self.positions if self.mrope_positions is None else self.mrope_positions

    def last_token_indices(self) -> torch.Tensor:
        """Index, in the flat token arrays, of each request's last token."""
        return self.extend_start_loc + self.extend_seq_lens - 1

    def logits_token_indices(self) -> torch.Tensor:
        """The flat token indices whose logits the forward returns: every token of a verify
        batch (each one's next token is checked against a draft), else each request's last but
        an embedding request's (``logits_indices``)."""
        if self.forward_mode.is_target_verify:
            return torch.arange(self.input_ids.numel(), device=self.input_ids.device)
        return self.last_token_indices() if self.logits_indices is None else self.logits_indices
