"""Same node, CUDA: the decode rank's pools come from a CUDA IPC-exportable MemPool.

The decode rank builds its pools with
:class:`~mem_cache.buffer_allocator.CudaIpcBufferAllocator`. A CUDA IPC
handle's payload is ``reduce_tensor``'s ``(rebuild_fn, args)``, which msgpack
cannot carry, so the endpoint holds the handle list **pickled** under
``"handles"`` (bytes inside the msgpack map). Unpickling runs the rebuild
function that opens the IPC handle: only accept hand-offs from your own
cluster's control plane. The exporting process cannot open its own handles,
so a push to an agent of the same process uses that agent's tensors directly.

Every push ends by synchronizing the stream it copied on (the prefill
rank's transfer thread has a stream of its own, so the next forward goes on)
so the bytes have landed when the sender reports the chunk done. Importable and registered without CUDA; using it
needs a GPU.
"""

from __future__ import annotations

import pickle
from typing import List, Tuple

import torch

from mem_cache.buffer_allocator import BufferHandle
from transfer.backends.mapped import MappedPeerAgent
from transfer.base import TransferError, register_backend


@register_backend("cuda_ipc")
class CudaIpcAgent(MappedPeerAgent):
    local_shortcut = True

    def _storage_key(self, tensor: torch.Tensor):
        if not tensor.is_cuda:
            return None
        shared = tensor.untyped_storage()._share_cuda_()  # cached: the handle reduce_tensor exported
        return bytes(shared[1]), int(shared[3])

    def _handle_key(self, handle: BufferHandle) -> Tuple[object, int]:
        if handle.kind != "cuda_ipc":
            return None, 0
        _, args = handle.payload  # reduce_tensor's rebuild_cuda_tensor arguments
        return (bytes(args[7]), int(args[9])), int(args[3])

    def _encode_handles(self, handles: List[BufferHandle]) -> bytes:
        for h in handles:
            if h.kind != "cuda_ipc":
                raise TransferError(f"buffer {h.name!r} is {h.kind!r} memory, the cuda_ipc backend needs CUDA IPC buffers")
        return pickle.dumps(handles)

    def _decode_handles(self, wire) -> List[BufferHandle]:
        return pickle.loads(wire)

    def _sync(self) -> None:
        devices = {t.device for t in self.buffers.values() if t.is_cuda}
        for device in devices:
            torch.cuda.current_stream(device).synchronize()
