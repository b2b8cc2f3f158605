"""Where every pool's device/host buffers come from.

Pools never call ``torch.zeros`` themselves: they ask a :class:`BufferAllocator`
for each buffer by name. Three allocators share one contract:

* :class:`LocalBufferAllocator` — plain ``torch.zeros`` in this process; nothing
  can map it from outside. For unit tests and single-process engines.
* ``SharedMemoryBufferAllocator`` (CPU) — every buffer is a named POSIX shared
  memory file (``/dev/shm``); another process on the node attaches by name and
  reads/writes the same bytes.
* ``CudaIpcBufferAllocator`` (CUDA) — buffers come from a private
  ``torch.cuda.MemPool`` so that KV segments hold nothing else, and each buffer
  exports a CUDA IPC handle a peer process opens.

Contract:
* ``zeros(name, shape, dtype)`` returns a zero-filled tensor allocated once;
  names are unique per allocator (a second ``zeros`` with the same name raises).
* ``export_handles()`` returns picklable :class:`BufferHandle` objects, one per
  buffer in allocation order. ``attach_buffers(handles)`` (any process on the
  same node) returns ``{name: tensor}`` views of the very same memory.
* ``close()`` releases what the allocator owns (unlinks shared memory); tensors
  handed out must not be used after it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch


@dataclass(frozen=True)
class BufferHandle:
    """Everything a peer process needs to map one buffer.

    ``kind`` names the allocator family ("local", "shm", "cuda_ipc");
    ``payload`` is kind-specific and picklable (a file path for "shm", the
    rebuild arguments of a CUDA IPC handle for "cuda_ipc").
    """

    name: str
    kind: str
    shape: Tuple[int, ...]
    dtype: str
    nbytes: int
    payload: Any = field(default=None, compare=False)


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def str_to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dtype


class BufferAllocator(abc.ABC):
    """Hands out named, zero-filled buffers that are allocated exactly once."""

    kind: str = "abstract"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self._buffers: Dict[str, torch.Tensor] = {}

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if name in self._buffers:
            raise ValueError(f"buffer {name!r} already allocated by this allocator")
        tensor = self._allocate(name, tuple(int(s) for s in shape), dtype)
        self._buffers[name] = tensor
        return tensor

    @abc.abstractmethod
    def _allocate(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Allocate one zero-filled buffer."""

    def buffers(self) -> Dict[str, torch.Tensor]:
        return dict(self._buffers)

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def export_handles(self) -> List[BufferHandle]:
        raise NotImplementedError(f"{type(self).__name__} buffers cannot be mapped by another process")

    def close(self) -> None:
        self._buffers.clear()


class LocalBufferAllocator(BufferAllocator):
    """Plain process-private tensors (not shareable)."""

    kind = "local"

    def _allocate(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)
