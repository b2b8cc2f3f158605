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
* ``release()`` gives every buffer's memory back (sleep mode), keeping the tensors (their
  shapes, none of their bytes: nothing may read them meanwhile); ``resume()`` allocates them
  anew, zero-filled, at other addresses. The tensors' storages are swapped in place, so the
  pools' tensors and every view of them see the new memory. A shareable allocator's buffers
  are new ones (shm: new files, the old ones unlinked; CUDA IPC: a new ``MemPool``): their
  handles change, and a peer's mapping of the old ones must be dropped (it would pin the old
  memory, and write where the pool no longer reads: ``TransferAgent.reset``).
* ``close()`` releases what the allocator owns (unlinks shared memory) and
  refuses further allocations; tensors handed out must not be used after it.
  Views a peer already attached stay valid (an unlinked file lives on while
  mapped), but no new peer can attach.
"""

from __future__ import annotations

import abc
import fcntl
import logging
import math
import os
import re
import tempfile
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)


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
        self._closed = False

    def zeros(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled ``shape``/``dtype`` buffer registered under the unique ``name``."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed: cannot allocate {name!r}")
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

    def release(self) -> None:
        """Each buffer's memory given back: its storage swapped with an empty one, which takes the old
        memory with it as it goes (freed; a file unmapped; on CUDA to the caching allocator, which
        ``torch.cuda.empty_cache`` then returns to the driver). Views share the storage: released too."""
        for tensor in self._buffers.values():
            tensor.untyped_storage()._swap_data_ptr_(torch.UntypedStorage(0, device=self.device))
        self._released()

    def resume(self) -> None:
        """Each buffer allocated anew (zero-filled, as ``zeros``) and swapped into its storage."""
        for name, tensor in self._buffers.items():
            fresh = self._allocate(name, tuple(tensor.shape), tensor.dtype)
            tensor.untyped_storage()._swap_data_ptr_(fresh.untyped_storage())

    def _released(self) -> None:
        """What the allocator drops once its buffers' memory is gone (files, a memory pool)."""

    def export_handles(self) -> List[BufferHandle]:
        raise NotImplementedError(f"{type(self).__name__} buffers cannot be mapped by another process")

    def close(self) -> None:
        """Forget every buffer and refuse further allocations (idempotent)."""
        self._closed = True
        self._buffers.clear()


class LocalBufferAllocator(BufferAllocator):
    """Plain process-private tensors (not shareable)."""

    kind = "local"

    def _allocate(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)


def _shm_dir() -> str:
    configured = os.environ.get("RAYDIX_SHM_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _map_file(path: str, shape: Tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """``shape``/``dtype`` view of a shared mapping of the file (0 bytes cannot be mapped)."""
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


_STEM = re.compile(r"^(raydix-[A-Za-z0-9_.]+-\d+-[0-9a-f]{8})(?:-|\.lock$)")


def cleanup_stale_segments(directory: str | None = None) -> List[str]:
    """Unlink raydix shared-memory files whose owner is gone (a SIGKILLed worker cannot
    run its finalizers). Returns the removed paths.

    An owner holds a shared ``flock`` on its ``{stem}.lock`` file for as long as it
    lives (the kernel drops it when the process dies, however it dies), so a stem whose
    lock file can be locked exclusively, or has none, is stale. Unlike a PID check this
    holds where ``/dev/shm`` is shared by processes of different PID namespaces
    (containers of one pod)."""
    directory = directory or _shm_dir()
    stems: Dict[str, List[str]] = {}
    for entry in os.listdir(directory):
        match = _STEM.match(entry)
        if match is not None:
            stems.setdefault(match.group(1), []).append(os.path.join(directory, entry))
    removed = []
    for stem, paths in stems.items():
        lock_path = os.path.join(directory, stem + ".lock")
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            # no lock: a dead owner that had unlinked it already, or one without lock files
            # (an older raydix on this node, as in a rolling upgrade): judged by its PID
            if pid_alive(int(stem.rsplit("-", 2)[1])):
                continue
            fd = None
        except PermissionError:  # another user's files
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # the owner is alive
            for path in sorted(paths, key=lambda p: p == lock_path):  # the lock file last
                try:
                    os.unlink(path)
                except (FileNotFoundError, PermissionError):  # raced, or another user's file
                    continue
                removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (of this node) exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner_lock(stem: str) -> int:
    """Create ``{stem}.lock`` holding a shared flock (made under another name, then renamed:
    a cleanup never sees it unlocked); returns its descriptor, to keep open while owning."""
    tmp = f"{stem}.lock.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.rename(tmp, stem + ".lock")
    return fd


def _unlink_owned(paths: List[str], lock_path: str, lock_fd: int, owner_pid: int) -> None:
    """Unlink ``paths``, then the owner's lock, unless running in a forked child of their owner."""
    if os.getpid() != owner_pid:
        return
    for path in paths + [lock_path]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.close(lock_fd)


class SharedMemoryBufferAllocator(BufferAllocator):
    """Each buffer is a named POSIX shared-memory file that peers map by path.

    Files are named ``raydix-{prefix}-{pid}-{uid}-{buffer name}`` under
    ``/dev/shm`` (``RAYDIX_SHM_DIR`` overrides), next to the owner's
    ``raydix-{prefix}-{pid}-{uid}.lock``, and are unlinked by :meth:`close`, or
    when the allocator is garbage-collected or the process exits; a process
    that is killed leaves them to :func:`cleanup_stale_segments`. ``multiprocessing.shared_memory`` is avoided on purpose: its
    resource tracker unlinks a segment when an *attaching* process exits.
    """

    kind = "shm"

    def __init__(self, device: str | torch.device = "cpu", prefix: str | None = None):
        super().__init__(device)
        if self.device.type != "cpu":
            raise ValueError(f"shared-memory buffers live on the CPU, not {self.device}")
        tag = re.sub(r"[^A-Za-z0-9_.]", "_", prefix or "pool")
        self._stem = os.path.join(_shm_dir(), f"raydix-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._paths: List[str] = []
        self._handles: List[BufferHandle] = []
        self._generation = 0  # buffers allocated anew after a release are files of new names
        lock_fd = _owner_lock(self._stem)  # held while this process lives (cleanup_stale_segments)
        # Runs on close(), garbage collection, or interpreter exit (atexit).
        self._finalizer = weakref.finalize(self, _unlink_owned, self._paths, self._stem + ".lock", lock_fd,
                                           os.getpid())

    def _allocate(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        generation = f"g{self._generation}-" if self._generation else ""
        path = f"{self._stem}-{generation}{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        self._paths.append(path)  # owned from now on, even if sizing fails
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
        finally:
            os.close(fd)
        self._handles.append(BufferHandle(name, "shm", shape, dtype_to_str(dtype), nbytes, path))
        return _map_file(path, shape, dtype, nbytes)

    def export_handles(self) -> List[BufferHandle]:
        return list(self._handles)

    def _released(self) -> None:
        """The files unlinked (a peer's mapping keeps one's memory until it drops it) and their handles
        dropped; :meth:`resume` makes new ones, under names a stale handle cannot open."""
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths.clear()  # (in place: the finalizer holds the list)
        self._handles.clear()
        self._generation += 1

    def close(self) -> None:
        """Unlink every file; peers' existing mappings survive, new attaches fail."""
        super().close()
        self._handles.clear()
        self._finalizer()


class CudaIpcBufferAllocator(BufferAllocator):
    """Buffers from a private ``torch.cuda.MemPool``, exported as CUDA IPC handles.

    A private pool keeps the KV segments free of unrelated allocations (an
    IPC handle maps a whole segment). This process must keep the tensors
    alive for as long as peers use them.
    """

    kind = "cuda_ipc"

    def __init__(self, device: str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CudaIpcBufferAllocator needs a CUDA device")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC buffers live on a CUDA device, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(device)
        self.mem_pool = torch.cuda.MemPool()

    def _allocate(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self.mem_pool, device=self.device):
            return torch.zeros(shape, dtype=dtype, device=self.device)

    def _released(self) -> None:
        """A new private pool for :meth:`resume`: the old one, dropped, is freed by ``torch.cuda.empty_cache``
        once no block of it is in use (a peer's open IPC handle keeps its block until the peer drops it)."""
        self.mem_pool = torch.cuda.MemPool()

    def export_handles(self) -> List[BufferHandle]:
        """One handle per buffer; ``payload`` is ``(rebuild_fn, args)`` from ``reduce_tensor``."""
        from torch.multiprocessing.reductions import reduce_tensor

        return [
            BufferHandle(name, "cuda_ipc", tuple(t.shape), dtype_to_str(t.dtype), t.nbytes, reduce_tensor(t))
            for name, t in self._buffers.items()
        ]


def attach_buffers(handles: Sequence[BufferHandle]) -> Dict[str, torch.Tensor]:
    """Map another process's buffers into this one: ``{name: tensor}`` over the same memory."""
    out: Dict[str, torch.Tensor] = {}
    for h in handles:
        if h.kind == "shm":
            out[h.name] = _map_file(h.payload, tuple(h.shape), str_to_dtype(h.dtype), h.nbytes)
        elif h.kind == "cuda_ipc":
            rebuild, args = h.payload
            out[h.name] = rebuild(*args)
        else:
            raise ValueError(f"buffer {h.name!r} of kind {h.kind!r} cannot be attached from another process")
    return out


def create_buffer_allocator(device: str | torch.device, shareable: bool, prefix: str | None = None) -> BufferAllocator:
    """Local tensors, or the shareable kind for the device (shm on CPU, CUDA IPC on GPU)."""
    device = torch.device(device)
    if not shareable:
        return LocalBufferAllocator(device)
    if device.type == "cpu":
        # a worker SIGKILLed on this node (a crash, a failed start) left its pools behind
        removed = cleanup_stale_segments()
        if removed:
            logger.info("removed %d shared-memory segments of dead processes", len(removed))
        return SharedMemoryBufferAllocator(device, prefix)
    if device.type == "cuda":
        return CudaIpcBufferAllocator(device)
    raise ValueError(f"no shareable buffer allocator for device type {device.type!r}")
