"""Image URLs fetched into the images they name (vLLM's ``MediaConnector``), for the HTTP server (before a request
reaches a worker: :mod:`cluster.media_fetch`) and for the engine's own ``generate`` (vLLM's ``LLM.generate`` and
SGLang's ``Engine`` fetch a URL themselves): a ``data:`` URL as it is, an ``http(s)://`` one downloaded (from
``allowed_media_domains`` only, when set), a ``file://`` one read from under ``allowed_local_media_path`` (refused
without it). A request's URLs are fetched concurrently, each within ``image_fetch_timeout_s`` (vLLM's
``VLLM_IMAGE_FETCH_TIMEOUT``) and ``max_image_fetch_bytes``, a body read as it streams in (a larger one is dropped
at the limit, not held whole first). A URL that gives nothing is a ValueError naming it (the server's 400).
"""

from __future__ import annotations

import asyncio
import os
import stat
from http.cookiejar import CookieJar, DefaultCookiePolicy
from pathlib import Path
from typing import Any, List, Optional, Sequence, Union
from urllib.parse import unquote, urlsplit

import httpx
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

WEB_SCHEMES = ("http", "https")
FETCHED_SCHEMES = WEB_SCHEMES + ("file",)  # (a data URL or a path is the image's own loader's: load_image)


class MediaFetchConfig(BaseModel):
    """How image URLs are fetched: ServerConfig's fields (the server's fetches) and EngineConfig's (the engine's
    own, in ``generate``), the same rules."""

    image_fetch_timeout_s: float = Field(
        5.0, gt=0.0, description="an http(s) image URL's whole download (vLLM's VLLM_IMAGE_FETCH_TIMEOUT); past it "
        "the request is refused naming the URL")
    allowed_media_domains: Optional[List[str]] = Field(
        None, description="vLLM's --allowed-media-domains: the host names http(s) image URLs (and their redirects) "
        "may name; None: any")
    allowed_local_media_path: Optional[str] = Field(
        None, description="vLLM's --allowed-local-media-path: an existing directory whose files file:// image URLs "
        "may name (links resolved); None: file:// URLs are refused. Any client may read any image under it")
    max_image_fetch_bytes: int = Field(20 * 1024 * 1024, ge=1, description="the largest image an http(s) or file:// "
                                       "URL may give (a download stops at it: refused)")

    @field_validator("allowed_local_media_path")
    @classmethod
    def _a_directory(cls, path: Optional[str]) -> Optional[str]:
        if path is not None and not os.path.isdir(path):  # (vLLM's check at start)
            raise PydanticCustomError("not_a_directory", "{text}", {"text": f"{path!r} is not an existing directory"})
        return path


class FetchError(Exception):
    """Why one URL gave no image (the message goes into the ValueError after the URL)."""


class MediaFetcher:
    """A :class:`MediaFetchConfig`'s rules (:meth:`from_config`); ``owner``, the config its errors name ("server"
    or "engine"). Every download goes through one HTTP client (vLLM's global connection), opened at the first
    http(s) URL and closed by :meth:`aclose` (the server's shutdown): a client's start, its TLS context, is 25 ms
    and more of the event loop's, and its pool keeps connections alive across requests and bounds the downloads at
    once (httpx's 100 connections, aiohttp's in vLLM). It keeps no cookie: one client's would go with another's
    download from that host."""

    def __init__(self, timeout_s: float = 5.0, allowed_media_domains: Optional[Sequence[str]] = None,
                 allowed_local_media_path: Optional[str] = None, max_bytes: int = 20 * 1024 * 1024,
                 owner: str = "server"):
        self.timeout_s, self.max_bytes, self.owner = timeout_s, max_bytes, owner
        self.allowed_media_domains = None if allowed_media_domains is None else set(allowed_media_domains)
        self.allowed_local_media_path = (None if allowed_local_media_path is None
                                         else Path(allowed_local_media_path).resolve())
        self._client: Optional[httpx.AsyncClient] = None

    @classmethod
    def from_config(cls, config: MediaFetchConfig, owner: str = "server", **kwargs) -> "MediaFetcher":
        return cls(config.image_fetch_timeout_s, config.allowed_media_domains, config.allowed_local_media_path,
                   config.max_image_fetch_bytes, owner=owner, **kwargs)

    async def fetch_all(self, urls: Sequence[str], param: str) -> List[Union[str, bytes]]:
        """Each URL's image (a data URL as it is, the bytes of any other), in order; ValueError naming ``param``
        and the URL for the first that fails, the others' fetches cancelled."""
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
            raise FetchError(f"an image is a data URL (data:image/...;base64,...), an http(s) URL or a file:// URL "
                             f"under the {self.owner}'s allowed_local_media_path")
        except asyncio.TimeoutError:
            message = f"no answer within {self.timeout_s:g} s ({self.owner}.image_fetch_timeout_s)"
        except FetchError as exc:
            message = str(exc)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            message = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{param}: cannot fetch the image {short(url)}: {message}")

    async def _check_host(self, request: httpx.Request) -> None:
        """Every request a fetch sends, redirects included: to an allowed domain only (vLLM's check, by host name)."""
        if self.allowed_media_domains is not None and request.url.host not in self.allowed_media_domains:
            raise FetchError(f"the domain {request.url.host!r} is not in the {self.owner}'s allowed_media_domains")

    async def _download(self, url: str) -> bytes:
        async with self.client.stream("GET", url) as response:
            if not response.is_success:  # (any 2xx, as vLLM's raise_for_status after redirects)
                raise FetchError(f"HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_bytes:
                    raise FetchError(f"more than {self.max_bytes} bytes ({self.owner}.max_image_fetch_bytes)")
            return bytes(body)

    def _read_local(self, url: str) -> bytes:
        """A file:// URL's file, if it is under ``allowed_local_media_path`` (links resolved first)."""
        if self.allowed_local_media_path is None:
            raise FetchError(f"file:// URLs are read only under the {self.owner}'s allowed_local_media_path, which "
                             "is unset")
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
            raise FetchError(f"not under the {self.owner}'s allowed_local_media_path ({self.allowed_local_media_path})")
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # (a device or a FIFO: /dev/zero's read never ends)
                raise FetchError("not a regular file")
            with open(path, "rb") as file:
                image = file.read(self.max_bytes + 1)  # (the limit's bytes at most, whatever its size said)
        except OSError as exc:
            raise FetchError(f"{type(exc).__name__}: {exc.strerror}") from None
        if len(image) > self.max_bytes:
            raise FetchError(f"more than {self.max_bytes} bytes ({self.owner}.max_image_fetch_bytes)")
        return image


def scheme(url: str) -> str:
    """``url``'s scheme, lower case ("" for none: a path); never an error, as ``urlsplit``'s of a bad URL."""
    head, colon, _ = url.partition(":")
    return head.lower() if colon else ""


def short(url: str) -> str:
    """``url`` as an error names it (a data URL's base64 cut)."""
    return repr(url if len(url) <= 200 else url[:200] + "...")


def is_fetched(image: Any) -> bool:
    """``image`` is a URL a :class:`MediaFetcher` fetches (http(s), file://), not an image's own form."""
    return isinstance(image, str) and scheme(image) in FETCHED_SCHEMES


def image_urls(image_data: Sequence[Any]) -> List[str]:
    """The URLs to fetch of each request's ``image_data`` (a list of images, one image, or None each)."""
    return [image for images in image_data for image in _listed(images) if is_fetched(image)]


def _listed(images: Any) -> list:
    return images if isinstance(images, list) else [images]


async def fetch_images(config: MediaFetchConfig, image_data: Sequence[Any]) -> List[Any]:
    """Each request's ``image_data`` (as :func:`image_urls`') with its http(s) and file:// URLs fetched into their
    bytes by ``config``'s rules (an engine's), the rest as it was. A client of its own, closed after: an engine's
    calls may each run on another event loop (``generate``'s ``asyncio.run``)."""
    lists = [_listed(images) for images in image_data]
    urls = image_urls(image_data)
    fetcher = MediaFetcher.from_config(config, "engine")
    try:
        fetched = iter(await fetcher.fetch_all(urls, "image_data"))
    finally:
        await fetcher.aclose()
    got = [[next(fetched) if is_fetched(image) else image for image in images] for images in lists]
    return [images if isinstance(given, list) else images[0] for given, images in zip(image_data, got)]
