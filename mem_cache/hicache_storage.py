"""The storage tier of the hierarchical cache (reference §5, "Third tier").

Pages of KV that reached host memory are written behind to a storage backend,
keyed by their chained page hash (``radix_key.hash_pages``), and fetched back
into host memory when a later request misses on device and host. A page's key
names its tokens and everything before them, so equal keys mean equal KV — for
one model, KV layout and tensor-parallel rank. A backend never interprets the
bytes; ``HostKVCache.get_page_bytes`` / ``set_page_bytes`` produce and consume them.
"""

from __future__ import annotations

import abc
import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

_PAGE_KEY = re.compile(r"[0-9a-f]+")


class HiCacheStorage(abc.ABC):
    """Contract: keys are page hashes (lowercase hex); a value is one page's bytes.

    * ``batch_get(keys)`` → the bytes of every key, ``None`` where absent;
    * ``batch_set(keys, values)`` → per key, whether it is stored afterwards
      (setting a key that exists is a success and may skip the write);
    * ``batch_exists(keys)`` → how many *leading* keys are present: a prefix is
      only usable up to its first missing page.

    No method raises for a missing key; a value is either whole or absent.
    """

    @abc.abstractmethod
    def batch_get(self, keys: Sequence[str]) -> List[Optional[bytes]]: ...

    @abc.abstractmethod
    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> List[bool]: ...

    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int: ...


class HiCacheFile(HiCacheStorage):
    """One file per page, ``<directory>/<page hash>.bin``.

    A write goes to a temporary file in the same directory, then ``os.replace``
    renames it into place, so readers see a page whole or not at all. Keys carry
    only token content: give each (model, KV layout) its own directory; the
    engine puts each TP rank in a folder of its own (:func:`rank_storage_dir`).
    """

    def __init__(self, directory: Union[str, os.PathLike]):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not _PAGE_KEY.fullmatch(key):
            raise ValueError(f"storage keys are lowercase hex page hashes, got {key!r}")
        return self.directory / f"{key}.bin"

    def batch_get(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        return [self._read(key) for key in keys]

    def batch_set(self, keys: Sequence[str], values: Sequence[bytes]) -> List[bool]:
        if len(keys) != len(values):
            raise ValueError(f"batch_set got {len(keys)} keys and {len(values)} values")
        return [self._write(key, value) for key, value in zip(keys, values)]

    def batch_exists(self, keys: Sequence[str]) -> int:
        count = 0
        for key in keys:
            if not self._path(key).exists():
                break
            count += 1
        return count

    def _read(self, key: str) -> Optional[bytes]:
        try:
            return self._path(key).read_bytes()
        except OSError:  # absent, or unreadable: either way not a page this tier can give
            return None

    def _write(self, key: str, value: bytes) -> bool:
        path = self._path(key)
        if path.exists():
            return True
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
            return True
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return False


def rank_storage_dir(directory: Union[str, os.PathLike], tp_rank: int, tp_size: int) -> Path:
    """Where one TP rank keeps its pages: each holds only its head shard's KV, so with
    ``tp_size > 1`` every rank has a folder of its own (``tp{size}-rank{rank}``)."""
    return Path(directory) if tp_size == 1 else Path(directory) / f"tp{tp_size}-rank{tp_rank}"


STORAGE_BACKENDS: Dict[str, Callable[..., HiCacheStorage]] = {"file": HiCacheFile}


def create_storage_backend(name: str, **kwargs) -> HiCacheStorage:
    """Build the backend registered as ``name`` with ``kwargs``."""
    try:
        backend = STORAGE_BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(STORAGE_BACKENDS))
        raise ValueError(f"unknown hicache storage backend {name!r}; known: {known}") from None
    return backend(**kwargs)
