"""Integrity checking shared by every pool, allocator and cache.

``check_integrity()`` on any pool raises :class:`IntegrityError` with the
numbers that disagree; it never returns a boolean that callers could ignore.
"""

from __future__ import annotations

from typing import Optional

import torch


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
