"""The contract of a KV transfer, and the per-rank agents with their registry.

One request's KV moves from a prefill rank to a decode rank by *push*: the
decode rank reserves slots and answers with a :class:`KVHandoff` (its slot
list and layout); the prefill rank, once its forward wrote the KV, copies the
rows of its source slots into the decode rank's destination slots. Control
messages (the hand-off, the completion notice) travel between the workers'
actors; the bytes travel through a backend (shared memory, CUDA IPC,
``torch.distributed``), never through Ray's object store.

Per rank process there is one :class:`TransferAgent` (it owns the backend's
connections and the attached peer buffers), defined here with the backend
registry (:func:`register_backend`, :func:`create_agent`). The rest of the
contract lives in two modules and is re-exported here, so that importers name
one module (``from transfer.base import KVSender``):

* :mod:`transfer.handoff`: the hand-off message, the layouts it carries and
  their checks, the errors (:class:`TransferError`, :class:`LayoutMismatchError`);
* :mod:`transfer.states`: the polled per-request state machines
  (:class:`KVPoll`, :class:`KVSender`, :class:`KVReceiver`).
"""

from __future__ import annotations

import abc
from typing import Dict, List, Optional, Sequence

from transfer.handoff import (
    HANDOFF_VERSION,
    BufferLayout,
    KVHandoff,
    KVLayout,
    LayoutMismatchError,
    TransferError,
    check_compatible,
    head_overlap,
)
from transfer.states import FAILURE_PROB_ENV, KVPoll, KVReceiver, KVSender

__all__ = [  # the whole contract, wherever each name is defined
    "FAILURE_PROB_ENV", "HANDOFF_VERSION", "BufferLayout", "KVHandoff", "KVLayout", "KVPoll", "KVReceiver", "KVSender",
    "LayoutMismatchError", "TransferAgent", "TransferError", "check_compatible", "create_agent", "head_overlap",
    "known_backends", "register_backend",
]


class TransferAgent(abc.ABC):
    """One per rank process: this rank's transferable buffers and the backend.

    ``buffers`` maps every name of ``layout.buffers`` to the tensor whose rows
    are addressed by slot (``[rows, *row_shape]``).
    """

    backend_name = "abstract"
    # Whether prefill ranks write this rank's buffers themselves (shm, CUDA IPC): a push still
    # running when this side gives a hand-off up could then land in slots reused meanwhile.
    # False where bytes reach the buffers only through ``landed``, on this side (torch_dist).
    writes_in_place = True

    def __init__(
        self,
        layout: KVLayout,
        buffers: Dict[str, "object"],
        tp_rank: int = 0,
        tp_size: int = 1,
        allocators: Sequence["object"] = (),
    ):
        missing = [b.name for b in layout.buffers if b.name not in buffers]
        if missing:
            raise ValueError(f"layout names buffers this rank does not have: {missing[:4]}")
        self.layout, self.buffers, self.tp_rank, self.tp_size = layout, buffers, tp_rank, tp_size
        # The BufferAllocators the buffers came from (``transfer.layout.pool_allocators``):
        # same-node backends export their handles in ``endpoint()``; others ignore them.
        self.allocators = tuple(allocators)

    @abc.abstractmethod
    def endpoint(self) -> Dict:
        """msgpack-able address peers use to reach this agent's buffers."""

    @abc.abstractmethod
    def push(
        self, handoff: KVHandoff, src_slots: Sequence[int], src_state_slot: Optional[int], src_swa_slots: Sequence[int],
        offset: int = 0,
    ) -> int:
        """Prefill side: copy row ``src_slots[i]`` into ``handoff.dst_slots[offset + i]`` (and
        the state and SWA rows, whole); returns bytes moved. One hand-off may take several
        pushes of disjoint row ranges; only the one with the state and SWA rows has them."""

    def expect(self, handoff: KVHandoff) -> None:
        """Decode side: get ready to receive (pull backends post their receives here)."""

    def landed(self, handoff: KVHandoff) -> bool:
        """Decode side, after the completion notice, never blocking: whether the bytes
        of ``handoff`` (every part of them) are in this rank's buffers (push backends: always). Raises
        TransferError when they cannot arrive any more."""
        return True

    def missing(self, handoff: KVHandoff) -> str:
        """What ``handoff`` still waits for, in words (for timeout messages)."""
        return "the bytes"

    def failed(self, handoff: KVHandoff) -> Optional[str]:
        """Decode side, never blocking, before the completion notice: why the bytes of
        ``handoff`` cannot arrive any more (the prefill side gave it up: :meth:`abort`), or
        None. Backends with no such word say None: the error notice through the workers
        (or the timeout) ends the receiver then."""
        return None

    def cancel(self, handoff: KVHandoff) -> None:
        """Decode side: stop waiting for ``handoff`` (its receiver failed); bytes that
        still arrive for it are dropped. Never raises."""

    def abort(self, handoff: KVHandoff, reason: str) -> None:
        """Prefill side: this rank's sender of ``handoff`` failed (SGLang's sender syncing
        Failed to the decode endpoint): tell the decode rank, where the backend has a way,
        so that its receiver fails now with ``reason`` (:meth:`failed`). Best effort: never
        raises, never waits on a push in progress."""

    def reset(self) -> None:
        """This rank's pools were released or allocated anew (sleep mode, the worker idle): forget what
        stands for the old memory. Backends that copy by tensor at each push and landing (torch_dist)
        keep nothing of it; the same-node ones drop their mappings of peers' pools and take a new
        agent id (:class:`~transfer.backends.mapped.MappedPeerAgent`)."""

    def close(self) -> None:
        """Drop peer mappings and connections."""


_BACKENDS: Dict[str, type] = {}


def register_backend(name: str):
    def wrap(cls):
        cls.backend_name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def create_agent(name: str, layout: KVLayout, buffers: Dict, tp_rank: int = 0, tp_size: int = 1, **kwargs) -> TransferAgent:
    if name not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name](layout, buffers, tp_rank, tp_size, **kwargs)


def known_backends() -> List[str]:
    return sorted(_BACKENDS)
