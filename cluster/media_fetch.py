"""The media of a request's URLs, fetched by the server before the request reaches a worker
(:mod:`actors.engine.media_connector`'s rules, ServerConfig's fields; any failure, an image that does not decode
(:func:`decoded`) too, is a 400 naming the URL: the workers only ever see images), and how many one request may
hold (:func:`server_mm_limits`).

A video comes as its frames' image URLs, or as a video file's URL, decoded here with PyAV (``av``, not a
dependency: imported when a file comes, a 400 naming it when it is not installed) and sampled as vLLM's video
loader samples: ``video_fps`` frames a second, at most ``video_num_frames``, evenly over the video.
"""

from __future__ import annotations

import importlib.util
import io
from typing import Dict, Optional, Sequence, Union

import numpy as np

from actors.engine.media_connector import MediaFetcher, short
from actors.engine.multimodal import data_url_bytes, load_image
from cluster.api_errors import APIError

# vLLM's (V1) limit_mm_per_prompt of a modality left unset: a request's URLs are bounded before any is fetched
DEFAULT_MM_PER_PROMPT = 999


class ServerMediaFetcher(MediaFetcher):
    """The server's fetcher (ServerConfig's media fields: ``from_config(server, video_num_frames=...,
    video_fps=...)``), with how it samples a video file's frames (:func:`decode_video`)."""

    def __init__(self, *args, video_num_frames: int = 32, video_fps: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.video_num_frames, self.video_fps = video_num_frames, video_fps


def server_mm_limits(limit_mm_per_prompt: Optional[Dict[str, int]]) -> Dict[str, int]:
    """The server's ``limit_mm_per_prompt``: the workers', a modality they leave unset held to
    :data:`DEFAULT_MM_PER_PROMPT` (the workers' context length bounds it only once every URL is fetched)."""
    return {"image": DEFAULT_MM_PER_PROMPT, "video": DEFAULT_MM_PER_PROMPT, **(limit_mm_per_prompt or {})}


def decoded(urls: Sequence[str], images: Sequence[Union[str, bytes]]) -> list:
    """The PIL images of :meth:`MediaFetcher.fetch_all`'s ``images``; ValueError naming the URL of one that
    does not decode (off the event loop: decoding is CPU work)."""
    pil = []
    for url, image in zip(urls, images):
        try:
            pil.append(load_image(image))
        except ValueError as exc:
            raise ValueError(f"the image {short(url)}: {exc}") from None
    return pil


def check_video_decoder(param: str) -> None:
    """A 400 when a video file came and PyAV, its decoder, is not installed (before anything is fetched)."""
    if importlib.util.find_spec("av") is None:
        raise APIError(400, f"{param}: decoding a video file needs PyAV (the 'av' package), which this server does "
                       "not have: install it, or send the video as a list of its frames' image URLs", param=param)


def decode_video(url: str, data: Union[str, bytes], num_frames: int, fps: float) -> dict:
    """A video file's frames, ``fps`` a second and at most ``num_frames`` of them, evenly over it, with the file's
    rate, their indices and its frame count (the engine's ``{"frames", "fps", "frames_indices",
    "total_num_frames"}``, HF's video metadata: Qwen3-VL's timestamps are the indices over the rate); ValueError
    naming the URL if it does not decode (off the event loop). ``data``: the file, or its data URL. Only the kept
    frames become arrays, the decode stopping at the last: an hour of video decoded whole first would be hundreds
    of GB of RGB (the frame count is the stream's, or its packets' where the file does not state it)."""
    import av  # (not a dependency: check_video_decoder)

    kept = {}
    try:
        raw = data_url_bytes(data, "video") if isinstance(data, str) else data
        with av.open(io.BytesIO(raw)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0) or 24.0
            total = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        duration = total / rate
        keep = min(num_frames, total, max(1, round(duration * fps)))
        indices = set(np.linspace(0, total - 1, keep).round().astype(int).tolist())
        with av.open(io.BytesIO(raw)) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in indices:
                    kept[index] = frame.to_ndarray(format="rgb24")
                if len(kept) == len(indices):
                    break
    except Exception as exc:  # (PyAV's errors' classes differ across its versions)
        raise ValueError(f"the video {short(url)} cannot be decoded ({exc})") from None
    if not kept:
        raise ValueError(f"the video {short(url)} has no frames")
    return {"frames": np.stack(list(kept.values())), "fps": rate, "frames_indices": list(kept),
            "total_num_frames": total}
