"""Same node, CPU: the decode rank's pools live in POSIX shared memory.

The decode rank builds its pools with
:class:`~mem_cache.buffer_allocator.SharedMemoryBufferAllocator`; its
endpoint lists each file as ``[name, path, shape, dtype, nbytes]``. A
prefill rank maps the files once per peer and writes rows in place. A peer
whose process exited or whose files were unlinked (allocator closed) fails
the push with TransferError (→ the sender's Failed), never a crash.
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import torch

from mem_cache.buffer_allocator import BufferHandle
from transfer.backends.mapped import MappedPeerAgent
from transfer.base import TransferError, register_backend


@register_backend("shm")
class SharedMemoryAgent(MappedPeerAgent):
    def _storage_key(self, tensor: torch.Tensor):
        return getattr(tensor.untyped_storage(), "filename", None)

    def _handle_key(self, handle: BufferHandle) -> Tuple[object, int]:
        return (handle.payload if handle.kind == "shm" else None), 0

    def _encode_handles(self, handles: List[BufferHandle]) -> list:
        for h in handles:
            if h.kind != "shm":
                raise TransferError(f"buffer {h.name!r} is {h.kind!r} memory, the shm backend needs shared memory")
        return [[h.name, h.payload, list(h.shape), h.dtype, h.nbytes] for h in handles]

    def _decode_handles(self, wire) -> List[BufferHandle]:
        return [BufferHandle(name, "shm", tuple(shape), dtype, nbytes, path) for name, path, shape, dtype, nbytes in wire]

    def _check_peer(self, ep: Dict) -> None:
        super()._check_peer(ep)
        handles = ep.get("handles") or []
        if handles and not os.path.exists(handles[0][1]):
            self.forget_peer(ep["agent_id"])
            raise TransferError(f"the decode rank's shared memory {handles[0][1]} was unlinked (pool closed)")
