"""Video input: a video's frames to the patches and grid a Qwen-VL vision tower takes.

What HF's ``Qwen2VLVideoProcessor`` and ``Qwen3VLVideoProcessor`` compute for given frames (a video
already decoded: without a rate, HF's 24 fps is assumed), without their torchvision backend (not a
dependency): frames sampled as the checkpoint's processor samples them (Qwen2-VL's: all of them;
Qwen3-VL's: ``fps`` a second, ``min_frames`` to ``max_frames``), resized to a multiple of
``patch_size · merge_size`` within the pixel budget (its ``smart_resize``; torchvision's resize of a uint8
tensor on the CPU, which is torch's antialiased bicubic on the uint8 tensor: PIL's bicubic is up to several
levels apart, most where a frame is enlarged), rescaled and
normalized, padded to ``temporal_patch_size`` frames with the last one, and cut into patches in the
image processor's layout (merge blocks row-major, each patch ``channels · temporal · patch · patch``).

The settings are the checkpoint's video processor config (the file HF loads) over the family's class defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

HF_DEFAULT_FPS = 24  # what HF's processors take a video's fps to be when its frames come without metadata

_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# the processors' class defaults (transformers' Qwen2VLVideoProcessor, Qwen3VLVideoProcessor)
QWEN2_VL_DEFAULTS = dict(size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, patch_size=14,
                         temporal_patch_size=2, merge_size=2, image_mean=_CLIP_MEAN, image_std=_CLIP_STD,
                         do_sample_frames=False, fps=None, min_frames=4, max_frames=768, cap_pixels_per_frame=False,
                         max_video_tokens=128000)
QWEN3_VL_DEFAULTS = dict(size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, patch_size=16,
                         temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                         do_sample_frames=True, fps=2, min_frames=4, max_frames=768, cap_pixels_per_frame=False,
                         max_video_tokens=768)


class ProcessedVideo(NamedTuple):
    """``pixel_values`` [t·h·w, channels · temporal_patch · patch²] fp32, ``grid_thw`` (t, h, w) in patches,
    ``timestamps``, each temporal patch's time in seconds (the mean of its frames': Qwen3-VL's prompt text),
    and ``seconds_per_grid_t``, a temporal patch's seconds at the kept frames' rate (Qwen2.5-VL's
    ``second_per_grid_ts``: its M-RoPE's temporal step)."""

    pixel_values: torch.Tensor
    grid_thw: Tuple[int, int, int]
    timestamps: List[float]
    seconds_per_grid_t: float


def video_frames(video: Any) -> np.ndarray:
    """A video's frames as a uint8 array [T, H, W, 3]: a list of PIL images (of one size) or such an array.
    ValueError for anything else."""
    from PIL import Image

    if isinstance(video, (list, tuple)) and video and all(isinstance(f, Image.Image) for f in video):
        if len({f.size for f in video}) > 1:
            raise ValueError(f"video_data: a video's frames are of one size, not {sorted({f.size for f in video})}")
        video = np.stack([np.asarray(f.convert("RGB")) for f in video])
    if not (isinstance(video, np.ndarray) and video.dtype == np.uint8 and video.ndim == 4 and video.shape[-1] == 3
            and len(video)):
        raise ValueError("video_data: a video is its frames, a list of PIL images or a uint8 array [T, H, W, 3] "
                         f"(not {type(video).__name__}{getattr(video, 'shape', '')})")
    return video


@dataclass(frozen=True)
class VideoProcessor:
    """One checkpoint's video settings (HF's names) and the processing of a video's frames."""

    size: Dict[str, int]
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    image_mean: List[float]
    image_std: List[float]
    do_sample_frames: bool
    fps: Optional[float]
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    # Qwen3VLVideoProcessor's rules (smart_resize holds t·h·w to the size's pixel range; do_sample_frames samples
    # fps a second), else Qwen2VLVideoProcessor's (h·w; its do_sample_frames, which needs a decoded file's
    # metadata, is not followed: all frames kept)
    qwen3: bool

    @classmethod
    def from_pretrained(cls, model_path: str, qwen3: bool) -> "VideoProcessor":
        """The settings HF's video processor loads: the file ``AutoVideoProcessor`` reads (processor_config.json's
        ``video_processor``, else video_preprocessor_config.json, else the image processor's
        preprocessor_config.json: Qwen2.5-VL's checkpoints ship only that one) over the class defaults, and
        Qwen2-VL's ``min_pixels`` / ``max_pixels`` as its size's shortest / longest edge (its ``__init__``)."""
        from transformers.video_processing_utils import BaseVideoProcessor

        settings = dict(QWEN3_VL_DEFAULTS if qwen3 else QWEN2_VL_DEFAULTS)
        saved, _ = BaseVideoProcessor.get_video_processor_dict(model_path, local_files_only=True)
        settings.update({key: saved[key] for key in settings if saved.get(key) is not None})
        if not qwen3:
            edges = {"shortest_edge": saved.get("min_pixels"), "longest_edge": saved.get("max_pixels")}
            settings["size"] = dict(settings["size"], **{edge: n for edge, n in edges.items() if n is not None})
        return cls(**settings, qwen3=qwen3)

    def sample(self, num_frames: int) -> np.ndarray:
        """The indices of the frames HF's processor keeps of ``num_frames`` given ones (their fps taken as
        :data:`HF_DEFAULT_FPS`)."""
        if not (self.qwen3 and self.do_sample_frames):
            return np.arange(num_frames)
        keep = int(num_frames / HF_DEFAULT_FPS * self.fps)
        keep = min(max(keep, self.min_frames), self.max_frames, num_frames)
        return np.linspace(0, num_frames - 1, keep).round().astype(int)

    def resized_size(self, num_frames: int, height: int, width: int):
        """HF's ``smart_resize``: (height, width) multiples of ``patch_size · merge_size``, the aspect kept,
        the pixels (a frame's, or Qwen3-VL's the whole video's) within ``size`` (:meth:`max_pixels`)."""
        factor, t_bar = self.patch_size * self.merge_size, 1
        lo, hi = self.size["shortest_edge"], self.max_pixels(num_frames)
        if self.qwen3:
            if height < factor or width < factor:
                scale = max(factor / height, factor / width)
                height, width = int(height * scale), int(width * scale)
            t_bar = round(num_frames / self.temporal_patch_size) * self.temporal_patch_size
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"video_data: a frame's aspect ratio is over 200 ({width} x {height})")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        scale_frames = num_frames if self.qwen3 else 1
        if t_bar * h * w > hi:
            beta = math.sqrt(scale_frames * height * width / hi)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif t_bar * h * w < lo:
            beta = math.sqrt(lo / (scale_frames * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def sampled(self, video: Any) -> Tuple[np.ndarray, np.ndarray, float, int]:
        """The frames kept of ``video``, their indices in it, its rate and its frame count (HF's ``VideoMetadata``'s
        ``frames_indices``, ``fps`` and ``total_num_frames``). Bare frames (:func:`video_frames`) are sampled at
        :data:`HF_DEFAULT_FPS`; ``{"frames": ..., "fps": rate}`` are taken as they are (HF's processor given
        metadata, not sampling again): a video's frames at that rate, or with ``"frames_indices"`` and
        ``"total_num_frames"`` a file's frames at those indices of its frames at that rate (a decoded file's)."""
        if not isinstance(video, dict):
            frames = video_frames(video)
            indices = self.sample(len(frames))
            return frames[indices], indices, HF_DEFAULT_FPS, len(frames)
        frames = video_frames(video["frames"])
        indices = np.asarray(video.get("frames_indices", range(len(frames))), dtype=np.int64)
        if indices.shape != (len(frames),):
            raise ValueError(f"video_data: {indices.size} frames_indices for {len(frames)} frames")
        return frames, indices, float(video["fps"]), int(video.get("total_num_frames", len(frames)))

    def max_pixels(self, num_frames: int) -> int:
        """The size's longest edge, or with ``cap_pixels_per_frame`` HF's bound of it as qwen-vl-utils bounds it (each
        processor's ``resize``): a frame's even share of ``max_video_tokens`` (Qwen2-VL's: 90% of them over the
        video; Qwen3-VL's: that many a frame at most), never under 1.05 times the shortest edge."""
        factor, lo, hi = self.patch_size * self.merge_size, self.size["shortest_edge"], self.size["longest_edge"]
        if not self.cap_pixels_per_frame:
            return hi
        if self.qwen3:
            return max(min(self.max_video_tokens * factor ** 2, hi // num_frames), int(lo * 1.05)) * num_frames
        total_pixels = int(self.max_video_tokens * factor * factor * 0.9)
        return max(min(hi, total_pixels * self.temporal_patch_size // num_frames), int(lo * 1.05))

    def __call__(self, video: Any) -> ProcessedVideo:
        """``video``: its frames, or them with their rate (:meth:`sampled`)."""
        frames, indices, fps, total = self.sampled(video)
        sampled_fps = fps * len(indices) / total  # (HF's VideoMetadata.sampled_fps)
        if self.qwen3 and len(frames) < self.temporal_patch_size:
            raise ValueError(f"video_data: a video of {len(frames)} frame(s); this model takes "
                             f"{self.temporal_patch_size} at least")
        h, w = self.resized_size(len(frames), *frames.shape[1:3])
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
        if (h, w) != x.shape[-2:]:  # (torchvision's resize_image of a uint8 tensor on the CPU: this call)
            x = F.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
        # (rescaled and normalized in one, as HF's torchvision backend: the mean and std times 255)
        mean, std = (torch.tensor(v)[:, None, None] * 255 for v in (self.image_mean, self.image_std))
        x = (x.float() - mean) / std
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -len(x) % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
            indices = np.concatenate([indices, indices[-1:].repeat(pad)])
        t, gh, gw = len(x) // tp, h // p, w // p
        patches = x.view(t, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        seconds = [int(i) / fps for i in indices]
        timestamps = [(seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp)]
        return ProcessedVideo(patches.reshape(t * gh * gw, 3 * tp * p * p), (t, gh, gw), timestamps,
                              tp / sampled_fps)
