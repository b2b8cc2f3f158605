"""Moving KV pages between workers by slot-index lists.

The contract is imported from :mod:`transfer.base` (agents and their
registry there; the typed versioned hand-off, layouts and errors in
:mod:`transfer.handoff`; the polled sender/receiver state machines in
:mod:`transfer.states`);
:mod:`transfer.layout` reads a rank's transferable buffers off its pools;
:mod:`transfer.runs` cuts slot lists into runs of consecutive slots;
:mod:`transfer.plan` decides which heads and rows a push copies; the
backends (``fake``, ``shm``, ``cuda_ipc``, ``torch_dist``) live in
:mod:`transfer.backends` and register on import.
"""

from transfer.backends import select_backend
from transfer.base import (
    HANDOFF_VERSION,
    BufferLayout,
    KVHandoff,
    KVLayout,
    KVPoll,
    KVReceiver,
    KVSender,
    LayoutMismatchError,
    TransferAgent,
    TransferError,
    check_compatible,
    create_agent,
    known_backends,
    register_backend,
)
from transfer.layout import pool_allocators, pool_layout
from transfer.runs import group_concurrent_contiguous

__all__ = [
    "HANDOFF_VERSION", "BufferLayout", "KVHandoff", "KVLayout", "KVPoll", "KVReceiver", "KVSender",
    "LayoutMismatchError", "TransferAgent", "TransferError", "check_compatible", "create_agent",
    "group_concurrent_contiguous", "known_backends", "pool_allocators", "pool_layout", "register_backend",
    "select_backend",
]
