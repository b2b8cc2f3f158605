"""The images of a request's URLs, fetched by the server before the request reaches a worker (vLLM's
``MediaConnector``): a ``data:`` URL as it is, an ``http(s)://`` one downloaded (from
``allowed_media_domains`` only, when set), a ``file://`` one read from under ``allowed_local_media_path``
(refused without it). A request's URLs are fetched concurrently, each within ``image_fetch_timeout_s``
(vLLM's ``VLLM_IMAGE_FETCH_TIMEOUT``) and ``max_image_fetch_bytes``, a body read as it streams in (a larger
one is dropped at the limit, not held whole first). Any failure, an image that does not decode
(:func:`decoded`) too, is a 400 naming the URL: the workers only ever see images.

A video comes as its frames' image URLs, or as a video file's URL, decoded here with PyAV (``av``, not a
dependency: imported when a file comes, a 400 naming it when it is not installed) and sampled as vLLM's video
loader samples: ``video_fps`` frames a second, at most ``video_num_frames``, evenly over the video.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import os
import stat
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union
from urllib.parse import unquote, urlsplit

import httpx
import numpy as np

from actors.engine.multimodal import data_url_bytes, load_image
from cluster.api_errors import APIError


WEB_SCHEMES = ("http", "https")
# vLLM's (V1) limit_mm_per_prompt of a modality left unset: a request's URLs are bounded before any is fetched
DEFAULT_MM_PER_PROMPT = 999


class FetchError(Exception):
    """Why one URL gave no image (the message goes into the 400 after the URL)."""


class MediaFetcher:
    """``ServerConfig``'s media fields (:meth:`from_config`). Every download goes through one HTTP client (vLLM's
    global connection), opened at the first http(s) URL and closed by :meth:`aclose` (the server's shutdown): a
    client's start, its TLS context, is 25 ms and more of the event loop's, and its pool keeps connections alive
    across requests and bounds the downloads at once (httpx's 100 connections, aiohttp's in vLLM). It keeps no
    cookie: one client's would go with another's download from that host."""

    def __init__(self, timeout_s: float = 5.0, allowed_media_domains: Optional[Sequence[str]] = None,
                 allowed_local_media_path: Optional[str] = None, max_bytes: int = 20 * 1024 * 1024,
                 video_num_frames: int = 32, video_fps: float = 2.0):
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.video_num_frames, self.video_fps = video_num_frames, video_fps
        self.allowed_media_domains = None if allowed_media_domains is None else set(allowed_media_domains)
        self.allowed_local_media_path = (None if allowed_local_media_path is None
                                         else Path(allowed_local_media_path).resolve())
        self._client: Optional[httpx.AsyncClient] = None

    @classmethod
    def from_config(cls, server) -> "MediaFetcher":
        return cls(server.image_fetch_timeout_s, server.allowed_media_domains, server.allowed_local_media_path,
                   server.max_image_fetch_bytes, server.video_num_frames, server.video_fps)

    async def fetch_all(self, urls: Sequence[str], param: str) -> List[Union[str, bytes]]:
        """Each URL's image (a data URL as it is, the bytes of any other), in order; a 400 (``param``) for the
        first that fails, the others' fetches cancelled."""
        tasks = [asyncio.ensure_future(self._fetch(url, param)) for url in urls]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # (one failed, or the request went away: the rest stop)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Close the HTTP client and its connections (a later download opens another)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=True, timeout=self.timeout_s,
                                             event_hooks={"request": [self._check_host]},
                                             cookies=CookieJar(DefaultCookiePolicy(allowed_domains=())))
        return self._client

    async def _fetch(self, url: str, param: str) -> Union[str, bytes]:
        kind = scheme(url)
        try:
            if kind == "data":
                return url
            if kind in WEB_SCHEMES:
                return await asyncio.wait_for(self._download(url), self.timeout_s)
            if kind == "file":
                return await asyncio.to_thread(self._read_local, url)
            raise FetchError("an image is a data URL (data:image/...;base64,...), an http(s) URL or a file:// URL "
                             "under the server's allowed_local_media_path")
        except asyncio.TimeoutError:
            message = f"no answer within {self.timeout_s:g} s (server.image_fetch_timeout_s)"
        except FetchError as exc:
            message = str(exc)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            message = f"{type(exc).__name__}: {exc}"
        raise APIError(400, f"{param}: cannot fetch the image {short(url)}: {message}", param=param)

    async def _check_host(self, request: httpx.Request) -> None:
        """Every request a fetch sends, redirects included: to an allowed domain only (vLLM's check, by host name)."""
        if self.allowed_media_domains is not None and request.url.host not in self.allowed_media_domains:
            raise FetchError(f"the domain {request.url.host!r} is not in the server's allowed_media_domains")

    async def _download(self, url: str) -> bytes:
        async with self.client.stream("GET", url) as response:
            if not response.is_success:  # (any 2xx, as vLLM's raise_for_status after redirects)
                raise FetchError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise FetchError(f"more than {self.max_bytes} bytes (server.max_image_fetch_bytes)")
            return bytes(body)

    def _read_local(self, url: str) -> bytes:
        """A file:// URL's file, if it is under ``allowed_local_media_path`` (links resolved first)."""
        if self.allowed_local_media_path is None:
            raise FetchError("file:// URLs are read only under the server's allowed_local_media_path, which is unset")
        try:
            parts = urlsplit(url)
        except ValueError as exc:
            raise FetchError(str(exc)) from None
        if parts.netloc not in ("", "localhost"):
            raise FetchError(f"a file:// URL of another host ({parts.netloc!r})")
        try:
            path = Path(unquote(parts.path)).resolve()
        except (OSError, RuntimeError, ValueError) as exc:  # (a link loop; a NUL byte)
            raise FetchError(f"{type(exc).__name__}: {exc}") from None
        if not path.is_relative_to(self.allowed_local_media_path):
            raise FetchError(f"not under the server's allowed_local_media_path ({self.allowed_local_media_path})")
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # (a device or a FIFO: /dev/zero's read never ends)
                raise FetchError("not a regular file")
            with open(path, "rb") as file:
                image = file.read(self.max_bytes + 1)  # (the limit's bytes at most, whatever its size said)
        except OSError as exc:
            raise FetchError(f"{type(exc).__name__}: {exc.strerror}") from None
        if len(image) > self.max_bytes:
            raise FetchError(f"more than {self.max_bytes} bytes (server.max_image_fetch_bytes)")
        return image


def server_mm_limits(limit_mm_per_prompt: Optional[Dict[str, int]]) -> Dict[str, int]:
    """The server's ``limit_mm_per_prompt``: the workers', a modality they leave unset held to
    :data:`DEFAULT_MM_PER_PROMPT` (the workers' context length bounds it only once every URL is fetched)."""
    return {"image": DEFAULT_MM_PER_PROMPT, "video": DEFAULT_MM_PER_PROMPT, **(limit_mm_per_prompt or {})}


def scheme(url: str) -> str:
    """``url``'s scheme, lower case ("" for none: a path); never an error, as ``urlsplit``'s of a bad URL."""
    head, colon, _ = url.partition(":")
    return head.lower() if colon else ""


def short(url: str) -> str:
    """``url`` as an error names it (a data URL's base64 cut)."""
    return repr(url if len(url) <= 200 else url[:200] + "...")


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
    """A video file's frames, ``fps`` a second and at most ``num_frames`` of them, evenly over it, with the rate
    they stand for (the engine's ``{"frames": ..., "fps": ...}``); ValueError naming the URL if it does not decode
    (off the event loop). ``data``: the file, or its data URL."""
    import av  # (not a dependency: check_video_decoder)

    try:
        raw = data_url_bytes(data, "video") if isinstance(data, str) else data
        with av.open(io.BytesIO(raw)) as container:
            stream = container.streams.video[0]
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            rate = float(stream.average_rate or 0) or 24.0
    except Exception as exc:  # (PyAV's errors' classes differ across its versions)
        raise ValueError(f"the video {short(url)} cannot be decoded ({exc})") from None
    if not frames:
        raise ValueError(f"the video {short(url)} has no frames")
    duration = len(frames) / rate
    keep = min(num_frames, len(frames), max(1, round(duration * fps)))
    indices = np.linspace(0, len(frames) - 1, keep).round().astype(int)
    return {"frames": np.stack([frames[i] for i in indices]), "fps": keep / duration}
