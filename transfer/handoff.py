"""What the decode side tells the prefill side: its KV layout and its slots.

A :class:`KVHandoff` names, for one request and one decode rank, the slots the
KV must land in and the :class:`KVLayout` of that rank's transferable buffers;
it travels as a versioned msgpack map whose every field is checked on arrival
(``_check_wire``), so a bad message fails one transfer, not the worker.
:func:`check_compatible` says whether a prefill rank's layout can feed a decode
rank's; :func:`head_overlap` which heads of a buffer row two ranks share. The
errors of the transfer contract (:class:`TransferError`,
:class:`LayoutMismatchError`) live here, at the bottom of the imports.

Head ranges: every head-sharded buffer row holds heads ``[head_start,
head_start + num_heads)`` of ``total_heads``; a sender copies the
intersection of its range and the receiver's, so prefill and decode may use
different TP sizes. Replicated buffers (MLA latent, ``head_axis=None``) are
copied whole from one chosen source rank; Mamba states need equal head
ranges on both sides. Sliding-window layers (``"swa"`` buffers) move only
the prompt's last window, between SWA slot lists of their own.

Layer ranges: every buffer of a decoder layer names its global model layer
(``layer``), and a layout the model's ``num_layers``; a rank of pipeline stage
s holds its stage's layers only. Two layouts are compatible when they serve a
model of as many layers and agree on the layers both hold; a sender copies
the buffers both ranks hold, so prefill and decode may use different PP sizes
(a prefill rank pushes to the decode ranks whose layers overlap its own).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import msgpack

# 4: a hand-off's rows may arrive in several pushes (row ranges in the pushed header)
# 5: every buffer names its global model layer, the layout the model's number of layers (pipeline stages)
# 6: sliding-window and hybrid layouts name their buffers (Mamba states too) by global layer id, not by position
HANDOFF_VERSION = 6


class TransferError(RuntimeError):
    """A transfer failed (timeout, abort, dead peer, bad message)."""


class LayoutMismatchError(TransferError):
    """The two sides' KV layouts cannot be matched (dtype, row shape, heads, page size)."""


# ---- layouts ------------------------------------------------------------------------
@dataclass(frozen=True)
class BufferLayout:
    """One transferable buffer of a rank's pools.

    ``index`` says what addresses its rows: ``"token"`` (KV slot numbers),
    ``"swa"`` (SWA slot numbers: sliding-window layers) or ``"state"`` (Mamba
    state slots). ``row_shape``/``dtype`` describe one row on *this* rank;
    ``head_axis`` is the axis of ``row_shape`` that holds heads (``None``:
    replicated on every rank, e.g. the MLA latent). ``layer``: the global model
    layer whose KV or Mamba state it holds, as its name says (``None``: a layout
    built by hand, compared on every pipeline stage).
    """

    name: str
    index: str
    row_shape: Tuple[int, ...]
    dtype: str
    head_axis: Optional[int] = None
    head_start: int = 0
    total_heads: int = 0
    layer: Optional[int] = None

    @property
    def num_heads(self) -> int:
        return self.row_shape[self.head_axis] if self.head_axis is not None else 0

    def to_wire(self) -> list:
        return [self.name, self.index, list(self.row_shape), self.dtype, self.head_axis, self.head_start,
                self.total_heads, self.layer]

    @classmethod
    def from_wire(cls, raw: Sequence) -> "BufferLayout":
        name, index, shape, dtype, axis, start, total, layer = raw
        return cls(name, index, tuple(shape), dtype, axis, start, total, layer)


@dataclass(frozen=True)
class KVLayout:
    """``num_layers``: the model's decoder layers (0: unknown, a layout built by hand); the
    buffers hold this rank's layers of them (its pipeline stage's)."""

    page_size: int
    buffers: Tuple[BufferLayout, ...]
    num_layers: int = 0

    def by_name(self) -> Dict[str, BufferLayout]:
        return {b.name: b for b in self.buffers}

    def layers(self) -> FrozenSet[int]:
        """The global model layers this rank holds buffers of."""
        return frozenset(b.layer for b in self.buffers if b.layer is not None)


def check_compatible(src: KVLayout, dst: KVLayout) -> None:
    """Raise :class:`LayoutMismatchError` naming the first difference that makes
    a transfer from ``src`` to ``dst`` impossible. Buffers of a layer only one of
    the two ranks holds (another pipeline stage's) are not compared: they are
    another rank's to send or take."""
    if src.page_size != dst.page_size:
        raise LayoutMismatchError(f"page_size differs: prefill {src.page_size}, decode {dst.page_size}")
    if src.num_layers != dst.num_layers:
        raise LayoutMismatchError(f"num_layers differs: prefill {src.num_layers}, decode {dst.num_layers} "
                                  "(the two sides serve models of different depths)")
    both = src.layers() & dst.layers()
    s = {b.name: b for b in src.buffers if b.layer is None or b.layer in both}
    d = {b.name: b for b in dst.buffers if b.layer is None or b.layer in both}
    if set(s) != set(d):
        only_s, only_d = sorted(set(s) - set(d))[:4], sorted(set(d) - set(s))[:4]
        swa = any(b.index == "swa" for b in src.buffers + dst.buffers)
        hint = " (the split into sliding-window and full-attention layers differs)" if swa else ""
        raise LayoutMismatchError(f"buffers differ: only on prefill {only_s}, only on decode {only_d}{hint}")
    for name, a in s.items():
        b = d[name]
        if (a.index, a.dtype, a.head_axis) != (b.index, b.dtype, b.head_axis):
            raise LayoutMismatchError(
                f"{name}: prefill (index={a.index}, dtype={a.dtype}, head_axis={a.head_axis}) vs "
                f"decode (index={b.index}, dtype={b.dtype}, head_axis={b.head_axis})"
            )
        if a.head_axis is None:
            if a.row_shape != b.row_shape:
                hint = " (Mamba states need the same TP size on prefill and decode)" if a.index == "state" else ""
                raise LayoutMismatchError(f"{name}: row shape {a.row_shape} vs {b.row_shape}{hint}")
            continue
        rest_a = a.row_shape[: a.head_axis] + a.row_shape[a.head_axis + 1 :]
        rest_b = b.row_shape[: b.head_axis] + b.row_shape[b.head_axis + 1 :]
        if rest_a != rest_b or a.total_heads != b.total_heads:
            raise LayoutMismatchError(
                f"{name}: per-head shape {rest_a} of {a.total_heads} heads vs {rest_b} of {b.total_heads} heads"
            )
        if a.index == "state" and (a.head_start, a.num_heads) != (b.head_start, b.num_heads):
            raise LayoutMismatchError(
                f"{name}: Mamba state heads [{a.head_start}, +{a.num_heads}) vs [{b.head_start}, +{b.num_heads}):"
                " hybrid models need the same TP size on prefill and decode"
            )


def head_overlap(src: BufferLayout, dst: BufferLayout) -> Optional[Tuple[int, int]]:
    """Global head range ``[lo, hi)`` both ranks hold, or ``None``."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_heads, dst.head_start + dst.num_heads)
    return (lo, hi) if lo < hi else None


# ---- the hand-off ------------------------------------------------------------------
@dataclass(frozen=True)
class KVHandoff:
    """Decode rank → prefill rank: where one request's KV must land.

    ``dst_slots[i]`` receives the KV of prompt token ``dst_prefix_len + i``
    (tokens before ``dst_prefix_len`` the decode side already holds).
    ``dst_swa_slots[j]`` receives the sliding-window layers' KV of prompt token
    ``prompt_len - len(dst_swa_slots) + j``: the list is aligned to the end of
    the prompt and covers the tokens still inside the window there, less those
    the decode side holds (empty for models without sliding-window layers).
    ``endpoint`` is the backend's address of the decode rank's agent.
    ``deadline`` (epoch seconds, ``None``: none) is when the decode side stops
    waiting: a sender must not start writing after it, because from then on
    the destination slots may be given to another request (same-node push
    backends share one clock; pull backends drop late bytes anyway).
    """

    rid: str
    room: int
    tp_rank: int
    tp_size: int
    layout: KVLayout
    dst_slots: List[int]
    dst_state_slot: Optional[int] = None
    dst_prefix_len: int = 0
    backend: str = "fake"
    endpoint: Dict = field(default_factory=dict)
    deadline: Optional[float] = None
    dst_swa_slots: List[int] = field(default_factory=list)
    version: int = HANDOFF_VERSION

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "version": self.version, "rid": self.rid, "room": self.room, "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "page_size": self.layout.page_size, "num_layers": self.layout.num_layers,
                "buffers": [b.to_wire() for b in self.layout.buffers], "dst_slots": list(self.dst_slots),
                "dst_state_slot": self.dst_state_slot, "dst_prefix_len": self.dst_prefix_len,
                "backend": self.backend, "endpoint": self.endpoint, "deadline": self.deadline,
                "dst_swa_slots": list(self.dst_swa_slots),
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> "KVHandoff":
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise TransferError(f"malformed hand-off message: {exc}") from exc
        version = raw.get("version") if isinstance(raw, dict) else None
        if version != HANDOFF_VERSION:
            raise TransferError(f"hand-off version {version!r}, this build speaks {HANDOFF_VERSION}")
        try:
            _check_wire(raw)
            buffers = tuple(BufferLayout.from_wire(b) for b in raw["buffers"])
            layout = KVLayout(raw["page_size"], buffers, raw["num_layers"])
            return cls(
                raw["rid"], raw["room"], raw["tp_rank"], raw["tp_size"], layout, list(raw["dst_slots"]),
                raw["dst_state_slot"], raw["dst_prefix_len"], raw["backend"], raw["endpoint"], raw["deadline"],
                list(raw["dst_swa_slots"]), version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"malformed hand-off message: {exc!r}") from exc


INDEX_KINDS = ("token", "swa", "state")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_wire(raw: Dict) -> None:
    """Raise ValueError naming the first field of a hand-off map (version checked)
    whose type or value is impossible: slots are non-negative ints (a float would be
    truncated to another slot by the run cutter), ranks lie inside the TP size, every
    buffer's head axis and head range fit its row."""

    def bad(name: str, why: str):
        raise ValueError(f"{name} {why}: {raw.get(name)!r}"[:200])

    def slot_list(name: str) -> None:
        v = raw[name]
        if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
            bad(name, "is not a list of non-negative ints")

    for name in ("rid", "backend"):
        if not isinstance(raw[name], str):
            bad(name, "is not a string")
    for name, low in (("room", None), ("tp_size", 1), ("tp_rank", 0), ("page_size", 1), ("dst_prefix_len", 0),
                      ("num_layers", 0)):
        if not _is_int(raw[name]) or (low is not None and raw[name] < low):
            bad(name, "is not an int" if low is None else f"is not an int >= {low}")
    if raw["tp_rank"] >= raw["tp_size"]:
        bad("tp_rank", f"is not below tp_size {raw['tp_size']}")
    slot_list("dst_slots")
    slot_list("dst_swa_slots")
    if raw["dst_state_slot"] is not None and not (_is_int(raw["dst_state_slot"]) and raw["dst_state_slot"] >= 0):
        bad("dst_state_slot", "is neither None nor a non-negative int")
    if not isinstance(raw["endpoint"], dict):
        bad("endpoint", "is not a map")
    deadline = raw["deadline"]
    if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool)):
        bad("deadline", "is neither None nor a number")
    buffers = raw["buffers"]
    if not isinstance(buffers, list):
        bad("buffers", "is not a list")
    for b in buffers:
        if not isinstance(b, list) or len(b) != 8:
            bad("buffers", f"entry {b!r} is not [name, index, shape, dtype, head_axis, head_start, total_heads, layer]")
        name, index, shape, dtype, axis, start, total, layer = b
        ok = (
            isinstance(name, str) and index in INDEX_KINDS and isinstance(dtype, str)
            and isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)
            and _is_int(start) and _is_int(total) and start >= 0 and total >= 0
            and (axis is None or (_is_int(axis) and 0 <= axis < len(shape)
                                  and (not total or start + shape[axis] <= total)))  # its heads fit the model's
            and (layer is None or (_is_int(layer) and 0 <= layer < (raw["num_layers"] or layer + 1)))  # in the model
        )
        if not ok:
            bad("buffers", f"entry {b!r} is not a valid buffer layout")
