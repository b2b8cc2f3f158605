"""Radix-tree keys and the chained page hash shared with the router.

A :class:`RadixKey` is a token sequence plus an optional ``extra_key`` (a LoRA
id, a tenant's cache salt): keys with different ``extra_key`` never share a
node. A page's hash is SHA-256 over the parent page's hash and the page's
token ids (4-byte little-endian each); the first page of a sequence chains
from a root hash that depends only on ``extra_key``. The router imports
:func:`hash_pages` so that its index and the workers' KV events agree.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from functools import lru_cache
from typing import List, Optional, Sequence


class RadixKey:
    """``token_ids`` is the key's own list (copied in): a tree node keeps its key, and the
    caller's list may grow after (a request's ``output_ids``)."""

    __slots__ = ("token_ids", "extra_key")

    def __init__(self, token_ids: Sequence[int], extra_key: Optional[str] = None):
        self.token_ids = list(token_ids)
        self.extra_key = extra_key

    @classmethod
    def _owning(cls, token_ids: List[int], extra_key: Optional[str]) -> "RadixKey":
        """A key over ``token_ids`` without a second copy: a fresh list no one else holds (a
        slice). Matches and inserts slice their key at every node they pass."""
        key = cls.__new__(cls)
        key.token_ids, key.extra_key = token_ids, extra_key
        return key

    def __len__(self) -> int:
        return len(self.token_ids)

    def __iter__(self):
        return iter(self.token_ids)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return RadixKey._owning(self.token_ids[idx], self.extra_key)
        return self.token_ids[idx]

    def __eq__(self, other) -> bool:
        return isinstance(other, RadixKey) and (self.token_ids, self.extra_key) == (other.token_ids, other.extra_key)

    def __repr__(self) -> str:
        head = self.token_ids[:8]
        more = "..." if len(self.token_ids) > 8 else ""
        return f"RadixKey({head}{more}, len={len(self)}, extra_key={self.extra_key!r})"


@lru_cache(maxsize=1024)
def root_hash(extra_key: Optional[str] = None) -> str:
    """The hash a sequence's first page chains from."""
    return hashlib.sha256(b"raydix-root:" + (extra_key or "").encode()).hexdigest()


def hash_page(token_ids: Sequence[int], parent_hash: str) -> str:
    digest = hashlib.sha256(bytes.fromhex(parent_hash))
    digest.update(struct.pack(f"<{len(token_ids)}I", *(t & 0xFFFFFFFF for t in token_ids)))
    return digest.hexdigest()


def _le_words(token_ids: Sequence[int]) -> bytes:
    """The ids as 4-byte little-endian words, each taken mod 2^32 (``hash_page``'s packing)."""
    try:
        words = array("I", token_ids)  # every id already fits an unsigned 32-bit word: no masking
    except (OverflowError, TypeError):
        words = None
    if words is None or words.itemsize != 4:
        return struct.pack(f"<{len(token_ids)}I", *(t & 0xFFFFFFFF for t in token_ids))
    if sys.byteorder == "big":
        words.byteswap()
    return words.tobytes()


def hash_pages(
    token_ids: Sequence[int], page_size: int, parent_hash: Optional[str] = None, extra_key: Optional[str] = None
) -> List[str]:
    """Chained hashes of every *whole* page of ``token_ids``: ``hash_page`` page after page, with
    the ids packed once and the chain carried as bytes (the router hashes every prompt with it)."""
    prev = bytes.fromhex(parent_hash if parent_hash is not None else root_hash(extra_key))
    data = _le_words(token_ids[: len(token_ids) - len(token_ids) % page_size])
    step, sha, hashes = 4 * page_size, hashlib.sha256, []
    for start in range(0, len(data), step):
        prev = sha(prev + data[start : start + step]).digest()
        hashes.append(prev.hex())
    return hashes
