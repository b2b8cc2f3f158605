"""Integrity checking shared by every pool, allocator and cache.

``check_integrity()`` on any pool raises :class:`IntegrityError` with the
numbers that disagree; it never returns a boolean that callers could ignore.
"""

from __future__ import annotations

import os
from typing import Optional

import torch


def debug_enabled(debug: Optional[bool]) -> bool:
    """``debug`` if given, else the ``RAYDIX_DEBUG_MEMORY_POOL`` environment switch: pools
    then check every ``free`` (a double free raises instead of corrupting a free list)."""
    if debug is not None:
        return debug
    return os.environ.get("RAYDIX_DEBUG_MEMORY_POOL", "0") not in ("", "0", "false", "False")


class IntegrityError(AssertionError):
    """A pool, allocator or cache broke one of its invariants."""


def ensure(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)


def check_unique_in_range(
    what: str, ids: torch.Tensor, low: int, high: int, forbidden: Optional[int] = None
) -> None:
    """Every id in ``ids`` lies in ``[low, high]`` and appears once."""
    if ids.numel() == 0:
        return
    ids = ids.detach().to("cpu", torch.int64)
    lo, hi = int(ids.min()), int(ids.max())
    ensure(lo >= low and hi <= high, f"{what}: ids span [{lo}, {hi}], allowed [{low}, {high}]")
    if forbidden is not None:
        ensure(not bool((ids == forbidden).any()), f"{what}: reserved id {forbidden} is present")
    num_unique = int(torch.unique(ids).numel())
    ensure(num_unique == ids.numel(), f"{what}: {ids.numel() - num_unique} duplicate ids among {ids.numel()}")


def check_not_free(what: str, ids: torch.Tensor, free: torch.Tensor) -> None:
    """None of ``ids`` is already in ``free`` (a double free otherwise)."""
    already = int(torch.isin(ids.detach().to("cpu", torch.int64), free.detach().to("cpu", torch.int64)).sum())
    ensure(already == 0, f"double free of {already} {what}")
