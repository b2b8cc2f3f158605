"""Image input: from the request's images to the tokens and pixels a vision-language model takes.

The tokenizer side (:class:`MultimodalProcessor`, on the caller's thread, as the tokenizer): a
prompt holds one ``<|image_pad|>`` per image (the chat template's); each image is loaded
(:func:`load_image`), turned into patches by the checkpoint's HF image processor, and its pad
token expanded into the image's token count (patches / merge²). As SGLang's ``pad_input_ids``,
those tokens' ids in ``Req.origin_input_ids`` are the image's *pad value*, derived from a hash
of its pixels and out of every vocabulary (:data:`MM_PAD_BASE`): the radix tree keys on them,
so the same image (same prompt) hits the cache and another image at the same place does not.
The real ids (the image token's) are kept for what reads the prompt as text
(``Req.origin_input_ids_unpadded``). M-RoPE positions and the request's
``mrope_position_delta`` are computed here too (the model's ``mrope_positions``).
A video (``video_data``: its frames, :mod:`actors.engine.video`) is one more such item by its
``<|video_pad|>`` (Qwen3-VL: one per temporal patch, after its timestamp's text).

The model side (:func:`image_embeddings`): in a prefill forward, each image whose tokens the
chunk computes is encoded by the vision tower once (its embedding kept on the
:class:`ImageItem`, on the request, across chunks; dropped when the prefill ends) and the
chunk's rows of it replace those tokens' text embeddings.

Under TP every rank encodes the images of its batches (the vision tower is replicated), and each
must encode an image once per prefill, as rank 0 does, though it gets each batch pickled (items
without rank 0's embedding): :class:`FollowerImages` keeps a follower's embeddings across chunks,
and :class:`ImageMirror`, on rank 0, tells it which to drop (as vLLM's scheduler tells its workers
which encoder outputs to free) and leaves out the pixels of those it holds.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import io
import os
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from actors.engine.video import ProcessedVideo, VideoProcessor

# an image token's pad value is MM_PAD_BASE + (a hash of its pixels mod MM_PAD_BASE): never a token id
# of any vocabulary, and under 2**31 (an int32 anywhere token ids are stored)
MM_PAD_BASE = 1 << 30


def load_image(image: Any):
    """A PIL image from SGLang's ``image_data`` forms: a PIL image, raw bytes, a
    ``data:image/...;base64,`` URL (its scheme in any case, as RFC 3986's), or a file path; decoded now
    (ValueError if it cannot be)."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    if isinstance(image, str) and image[:5].lower() == "data:":
        image = data_url_bytes(image, "image_data")
    elif isinstance(image, str):
        if not os.path.isfile(image):
            raise ValueError(f"image_data: {image[:80]!r} is neither a data URL nor a file")
        with open(image, "rb") as f:
            image = f.read()
    if not isinstance(image, (bytes, bytearray)):
        raise ValueError(f"image_data: {type(image).__name__} is not an image (a PIL image, bytes, a path or a "
                         "data URL)")
    try:
        decoded = Image.open(io.BytesIO(image))
        decoded.load()
    except (OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"image_data: the image cannot be decoded ({exc})") from None
    return decoded


def data_url_bytes(url: str, param: str) -> bytes:
    """A base64 ``data:`` URL's bytes (ValueError naming ``param`` if it is not one)."""
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError(f"{param}: a data URL must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"{param}: the data URL's base64 does not decode: {exc}") from None


@dataclass(eq=False)
class ImageItem:
    """One image of a request (SGLang's ``MultimodalDataItem``), or a video (Qwen3-VL: one of its temporal
    patches, whose tokens its timestamp's text parts from the next's): its patches, its grid, and where its
    tokens are in the prompt, ``[offset, offset + num_tokens)``, each holding ``pad_value``. The vision tower
    encodes either by its grid."""

    # [patches, channels * temporal_patch * patch * patch] fp32, on the CPU (None: a TP follower's copy of an
    # image it holds the embedding of, see ImageMirror)
    pixel_values: Optional[torch.Tensor]
    grid_thw: Tuple[int, int, int]  # patches along time, height, width
    pad_value: int
    offset: int
    num_tokens: int
    embedding: Optional[torch.Tensor] = None  # [num_tokens, hidden], on the model's device, once encoded

    def __getstate__(self):
        # a TP follower gets the batch's images without rank 0's embedding (its own vision tower encodes them,
        # once a prefill: FollowerImages)
        return {**self.__dict__, "embedding": None}

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(eq=False)
class MultimodalInputs:
    """A request's images and videos (``images``, in prompt order), its prompt's M-RoPE positions and
    ``mrope_position_delta`` (a token past the prompt is at its sequence position + delta), the prompt with
    their real token ids, and how many of each modality the request sent (``limit_mm_per_prompt``'s count)."""

    images: List[ImageItem]
    mrope_positions: torch.Tensor  # [3, prompt_len] int64: temporal, height, width
    mrope_position_delta: int
    unpadded_input_ids: List[int]
    counts: Dict[str, int]

    @property
    def padded_input_ids(self) -> List[int]:
        """The prompt as the cache keys it: each image's tokens its pad value."""
        ids = list(self.unpadded_input_ids)
        for item in self.images:
            ids[item.offset:item.end] = [item.pad_value] * item.num_tokens
        return ids

    def for_request(self, input_ids: Sequence[int]) -> "MultimodalInputs":
        """A request's own inputs made of these processed ones (ValueError unless ``input_ids`` are this
        prompt, padded): its own image items, whose embeddings its prefill sets and drops, the pixel
        values, positions and prompt shared (read only). One processed input can make several requests
        in a process (n samples through an in-process backend, an in-process PD pair's two sides): items
        shared, one's embedding would be another's, dropped by one's release (a decode side's
        retraction) while the other prefills, across engine threads."""
        if list(input_ids) != self.padded_input_ids:
            raise ValueError(f"the multimodal inputs are of another prompt than input_ids' (their padded prompt "
                             f"has {len(self.unpadded_input_ids)} tokens, input_ids {len(input_ids)})")
        return replace(self, images=[replace(item, embedding=None) for item in self.images])

    def images_in(self, start: int, end: int) -> List[ImageItem]:
        """The images with a token in ``[start, end)``."""
        return [item for item in self.images if item.offset < end and item.end > start]

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of tokens ``[start, end)``: the prompt's, then each one's
        sequence position + ``mrope_position_delta`` (its output, re-prefilled after a retraction)."""
        prompt_len = self.mrope_positions.shape[1]
        past = torch.arange(max(start, prompt_len), max(end, prompt_len), dtype=torch.int64) + self.mrope_position_delta
        return torch.cat([self.mrope_positions[:, start:min(end, prompt_len)], past.expand(3, -1)], dim=1)

    def release_embeddings(self) -> None:
        """Drop the images' embeddings (the prefill is over; a retraction encodes them again)."""
        for item in self.images:
            item.embedding = None


def check_mm_count(modality: str, count: int, limit_mm_per_prompt: Optional[Dict[str, int]]) -> None:
    """ValueError (vLLM's message) when a prompt holds more images (videos) than ``limit_mm_per_prompt`` allows."""
    limit = (limit_mm_per_prompt or {}).get(modality)
    if limit is not None and count > limit:
        raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt, not {count} "
                         "(limit_mm_per_prompt)")


def pad_value(pixel_values: torch.Tensor, grid_thw: Sequence[int]) -> int:
    """The image's pad value (:data:`MM_PAD_BASE` and up), from a hash of its pixels and grid."""
    digest = hashlib.sha256(pixel_values.contiguous().numpy().tobytes())
    digest.update(repr(tuple(grid_thw)).encode())
    return MM_PAD_BASE + int.from_bytes(digest.digest()[:8], "big") % MM_PAD_BASE


class MultimodalProcessor:
    """The tokenizer side of a vision-language checkpoint: its HF image processor (``AutoImageProcessor``,
    offline) and video settings (:class:`~actors.engine.video.VideoProcessor`), its image and video tokens and
    merge size, and its M-RoPE rule (``mrope_positions(prompt_len, spans, spatial_merge_size) -> ([3, len]
    positions, delta)``)."""

    @classmethod
    def for_model(cls, model_path: str, config, model,
                  limit_mm_per_prompt: Optional[Dict[str, int]] = None) -> Optional["MultimodalProcessor"]:
        """The processor of a served vision-language model (one with an ``mrope_positions`` rule: the model or
        its class); None for a text model. ``limit_mm_per_prompt``: EngineConfig's."""
        rule = getattr(model, "mrope_positions", None)
        return None if rule is None else cls(model_path, config, rule, limit_mm_per_prompt,
                                             getattr(model, "frame_timestamps", False))

    @classmethod
    def for_checkpoint(cls, model_path: Optional[str],
                       limit_mm_per_prompt: Optional[Dict[str, int]] = None) -> Optional["MultimodalProcessor"]:
        """:meth:`for_model` of the checkpoint in ``model_path`` without its weights (a server's tokenizer
        side); None for a text model or no path."""
        from actors.engine.model_loader import load_config
        from actors.engine.models import get_model_class

        config = None if model_path is None else load_config(model_path)
        if config is None or not hasattr(config, "vision_config"):
            return None
        return cls.for_model(model_path, config, get_model_class(config.architectures[0]), limit_mm_per_prompt)

    def __init__(self, model_path: str, config, mrope_positions: Callable,
                 limit_mm_per_prompt: Optional[Dict[str, int]] = None, frame_timestamps: bool = False):
        """``frame_timestamps``: Qwen3-VL's videos, each temporal patch its own item after its timestamp's text
        (``<1.5 seconds>``) and between vision start and end tokens (HF's processor's prompt); else one item,
        its temporal positions ``tokens_per_second`` a second apart (Qwen2.5-VL's)."""
        from transformers import AutoImageProcessor

        self.model_path = model_path
        self.image_processor = AutoImageProcessor.from_pretrained(model_path, local_files_only=True)
        self.video_processor = VideoProcessor.from_pretrained(model_path, qwen3=frame_timestamps)
        self.image_token_id, self.video_token_id = config.image_token_id, getattr(config, "video_token_id", None)
        self.vision_ids = (getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None))
        self.merge_size = config.vision_config.spatial_merge_size
        self.tokens_per_second = getattr(config.vision_config, "tokens_per_second", 1)
        self.frame_timestamps = frame_timestamps
        self.mrope_positions = mrope_positions
        self.limit_mm_per_prompt = limit_mm_per_prompt

    @functools.cached_property
    def tokenizer(self):
        """The checkpoint's tokenizer (Qwen3-VL's videos' timestamp text), loaded at the first such video."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)

    def check_counts(self, num_images: int, num_videos: int) -> None:
        check_mm_count("image", num_images, self.limit_mm_per_prompt)
        check_mm_count("video", num_videos, self.limit_mm_per_prompt)

    def process(self, input_ids: List[int], images: List[Any],
                videos: Sequence[Any] = ()) -> Tuple[List[int], MultimodalInputs]:
        """``input_ids`` with each image's (video's) one pad token expanded into its tokens (holding its pad
        value), and the request's :class:`MultimodalInputs`. ValueError when there are more images or videos
        than ``limit_mm_per_prompt`` allows (before any is decoded), the pad tokens and the images (videos)
        differ in number, or an image (a video) cannot be taken."""
        self.check_counts(len(images), len(videos))
        counts = {"image": len(images), "video": len(videos)}
        places = [i for i, t in enumerate(input_ids) if t in (self.image_token_id, self.video_token_id)]
        for name, token, given in (("image", self.image_token_id, images), ("video", self.video_token_id, videos)):
            num_pads = sum(input_ids[i] == token for i in places)
            if num_pads != len(given):
                raise ValueError(f"{len(given)} {name}(s) in {name}_data but {num_pads} {name} pad token(s) "
                                 f"(id {token}) in the prompt: one per {name}")
        pil = [load_image(image) for image in images]
        processed = self.image_processor(images=pil, return_tensors="pt") if pil else None
        grids = [] if not pil else [tuple(int(n) for n in g) for g in processed["image_grid_thw"].tolist()]
        pixels = iter(torch.split(processed["pixel_values"].float(), [t * h * w for t, h, w in grids]) if pil else ())
        grids, videos = iter(grids), iter([self.video_processor(video) for video in videos])
        prompt = PromptBuilder(self.merge_size)
        for place, last in zip(places, [-1] + places):
            prompt.text(input_ids[last + 1:place])
            if input_ids[place] == self.image_token_id:
                prompt.item(next(pixels), next(grids), self.image_token_id)
            else:
                self._add_video(prompt, next(videos))
        prompt.text(input_ids[places[-1] + 1 if places else 0:])
        positions, delta = self.mrope_positions(len(prompt.unpadded), prompt.spans, self.merge_size)
        return prompt.padded, MultimodalInputs(prompt.items, positions, delta, prompt.unpadded, counts)

    def _add_video(self, prompt: "PromptBuilder", video: ProcessedVideo) -> None:
        t, h, w = video.grid_thw
        if not self.frame_timestamps:
            interval = torch.tensor(video.seconds_per_grid_t, dtype=torch.float32) * self.tokens_per_second
            return prompt.item(video.pixel_values, video.grid_thw, self.video_token_id, interval)
        start, end = self.vision_ids
        for frame, pixels in enumerate(torch.split(video.pixel_values, h * w)):
            prompt.text(self.tokenizer.encode(f"<{video.timestamps[frame]:.1f} seconds>", add_special_tokens=False))
            prompt.text([start])
            prompt.item(pixels, (1, h, w), self.video_token_id)
            prompt.text([end])


class PromptBuilder:
    """A prompt built piece by piece: its padded and unpadded ids, its items and their M-RoPE spans
    (``(offset, grid_thw, temporal interval)`` each)."""

    def __init__(self, merge_size: int):
        self.merge_size = merge_size
        self.padded: List[int] = []
        self.unpadded: List[int] = []
        self.items: List[ImageItem] = []
        self.spans: List[Tuple[int, Tuple[int, int, int], Any]] = []

    def text(self, ids: Sequence[int]) -> None:
        self.padded += ids
        self.unpadded += ids

    def item(self, pixels: torch.Tensor, grid: Tuple[int, int, int], token_id: int, interval: Any = 1) -> None:
        """An image's (a video's) tokens, ``token_id`` unpadded; ``interval``: its temporal positions' step."""
        num_tokens = grid[0] * grid[1] * grid[2] // self.merge_size ** 2
        item = ImageItem(pixels, grid, pad_value(pixels, grid), len(self.padded), num_tokens)
        self.spans.append((item.offset, grid, interval))
        self.padded += [item.pad_value] * num_tokens
        self.unpadded += [token_id] * num_tokens
        self.items.append(item)


def image_embeddings(forward_batch, encode: Callable[[ImageItem], torch.Tensor]):
    """The image rows of an extend batch (SGLang's ``general_mm_embed_routine``): the flat token indices
    of the images' tokens it computes and their embeddings, in that order ([n] int64, [n, hidden]); an
    image is encoded (``encode``) at the first chunk that needs it, its embedding kept on its item.
    None when the batch computes no image token."""
    index, rows, start = [], [], 0
    for items, prefix_len, seq_len in zip(forward_batch.mm_items, forward_batch.extend_prefix_lens_cpu,
                                          forward_batch.seq_lens_cpu):
        for item in items:
            if item.embedding is None:
                item.embedding = encode(item)
            lo, hi = max(item.offset, prefix_len), min(item.end, seq_len)
            rows.append(item.embedding[lo - item.offset:hi - item.offset])
            index.extend(range(start + lo - prefix_len, start + hi - prefix_len))
        start += seq_len - prefix_len
    if not index:
        return None
    return torch.tensor(index, dtype=torch.int64, device=rows[0].device), torch.cat(rows)


class ImageMirror:
    """Rank 0's record of the image embeddings its TP followers hold, by key (the rank 0 item's ``id``).
    A follower encodes an image when rank 0 does, in the same forward, and keeps its embedding as long as
    rank 0's item keeps its own: it drops it at the first batch (or sync) after rank 0's item lost it (the
    prefill ended, a retraction or a requeue) or went away (an aborted or failed request). So a weight
    update between two chunks leaves both with the embedding of the weights then served, and a follower's
    embeddings live as long as rank 0's (and one exchange more)."""

    def __init__(self):
        self.held: Dict[int, weakref.ref] = {}

    def updates(self, mm_items: Optional[List[List[ImageItem]]]) -> Tuple[List[int], Optional[List], Optional[List]]:
        """(keys the followers drop first; the batch's items' keys and the items to send, per request, or
        None for a batch of no image): an image they hold goes without its pixels. (A dead item's id may
        be a new item's: dropped before the new one is taken, which goes with its pixels.)"""
        drops = [key for key, ref in self.held.items() if ref() is None or ref().embedding is None]
        for key in drops:
            del self.held[key]
        if mm_items is None:
            return drops, None, None
        keys = [[id(item) for item in items] for items in mm_items]
        # (copies: a follower fills in its own embeddings, rank 0's items stay rank 0's, pickled or not)
        sent = [[replace(item, embedding=None, pixel_values=None if id(item) in self.held else item.pixel_values)
                 for item in items] for items in mm_items]
        for items in mm_items:
            for item in items:
                self.held.setdefault(id(item), weakref.ref(item))
        return drops, keys, sent


class FollowerImages:
    """A TP follower's image embeddings (on its device), by rank 0's keys (:class:`ImageMirror`)."""

    def __init__(self):
        self.embeddings: Dict[int, torch.Tensor] = {}

    def drop(self, keys: Sequence[int]) -> None:
        for key in keys:  # (a later pipeline stage's rank encodes nothing, holds nothing)
            self.embeddings.pop(key, None)

    @contextlib.contextmanager
    def forward(self, keys: Optional[List[List[int]]], mm_items: Optional[List[List[ImageItem]]]):
        """Around a forward of the batch whose items are ``mm_items``: those held get their embedding
        (the vision tower skips them), those encoded in it are kept."""
        pairs = [] if keys is None else [pair for ks, items in zip(keys, mm_items) for pair in zip(ks, items)]
        for key, item in pairs:
            item.embedding = self.embeddings.get(key)
        yield
        for key, item in pairs:
            if item.embedding is not None:
                self.embeddings[key] = item.embedding
