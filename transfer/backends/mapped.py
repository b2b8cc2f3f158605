"""Same-node push by writing straight into the decode rank's mapped buffers.

The decode rank's pools are allocated from a shareable
:class:`~mem_cache.buffer_allocator.BufferAllocator` (POSIX shared memory on
CPU, a CUDA IPC-exportable ``MemPool`` on GPU). Its agent's ``endpoint()``
carries the allocators' buffer handles plus, for every layout buffer, where it
sits inside one of them (handle number, element offset, shape, strides: a
Mamba ``state.{s}.{layer}`` is one layer's view of a bigger allocator
buffer). A prefill agent maps a peer's handles once (cached by ``agent_id``;
a decode rank whose pools were released and resumed, sleep mode, takes a new
id and every prefill rank drops its old mappings: :meth:`MappedPeerAgent.reset`)
and then every push (one chunk of a request's rows, or all of them) is one
slice ``copy_`` per run of consecutive slots per buffer, source rows to
destination rows — no temporaries, no Ray object store.

Subclasses say how handles travel (``_encode_handles``/``_decode_handles``)
and how to tell that the peer is gone (``_check_peer``).
"""

from __future__ import annotations

import abc
import os
import socket
import threading
import uuid
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mem_cache.buffer_allocator import BufferHandle, attach_buffers, dtype_to_str, pid_alive
from transfer.base import KVHandoff, TransferAgent, TransferError
from transfer.plan import plan_copies, push_rows, row_plan

# agent_id -> agent of this process, for backends that cannot map their own handles.
_LOCAL_AGENTS: "weakref.WeakValueDictionary[str, MappedPeerAgent]" = weakref.WeakValueDictionary()


def locate_buffers(
    buffers: Dict[str, torch.Tensor], names: Sequence[str], handles: Sequence[BufferHandle], storage_key, handle_key
) -> Dict[str, list]:
    """For each of ``names``, the view ``[handle number, element offset, shape,
    stride]`` of its tensor inside the buffer of one of ``handles`` (a Mamba
    ``state.{s}.{layer}`` is one layer of a bigger allocation). Tensors and
    handles are matched by the identity of their storage (``storage_key(tensor)
    == handle_key(handle)[0]``; ``handle_key(handle)[1]`` is the handle's own
    element offset in that storage). Raises TransferError for a buffer that
    none of the handles covers."""
    by_key = {}
    for i, h in enumerate(handles):
        key, offset = handle_key(h)
        if key is not None:
            by_key[key] = (i, offset, h)
    views: Dict[str, list] = {}
    for name in names:
        t = buffers[name]
        key = storage_key(t)
        found = by_key.get(key) if key is not None else None
        if found is None:
            raise TransferError(
                f"buffer {name!r} is not in shareable memory: build the decode rank's pools with a shareable "
                "BufferAllocator and pass its handles (handles=...) or allocators (allocators=...) to create_agent"
            )
        i, offset, h = found
        if h.dtype != dtype_to_str(t.dtype):
            raise TransferError(f"buffer {name!r} is a {t.dtype} view of the {h.dtype} allocation {h.name!r}")
        views[name] = [i, t.storage_offset() - offset, list(t.shape), list(t.stride())]
    return views


class MappedPeerAgent(TransferAgent):
    """Base of the same-node backends (``shm``, ``cuda_ipc``)."""

    # Whether a push to an agent of this very process uses its tensors directly
    # (CUDA IPC handles cannot be opened by the process that exported them).
    local_shortcut = False

    def __init__(
        self, layout, buffers, tp_rank: int = 0, tp_size: int = 1, allocators: Sequence = (),
        handles: Optional[Sequence[BufferHandle]] = None,
    ):
        """``handles`` (or, equivalently, the ``allocators`` that export them) are
        this rank's shareable buffers; only a rank that receives needs them."""
        super().__init__(layout, buffers, tp_rank, tp_size, allocators)
        self.handles = list(handles) if handles is not None else None
        self.agent_id = uuid.uuid4().hex
        self._endpoint: Optional[Dict] = None
        self._peers: Dict[str, Dict[str, torch.Tensor]] = {}
        self._peer_pids: Dict[str, int] = {}  # agent id -> its process, to unmap peers that died
        self._lock = threading.Lock()
        _LOCAL_AGENTS[self.agent_id] = self

    # ---- decode side ------------------------------------------------------------
    def endpoint(self) -> Dict:
        if self._endpoint is None:
            names = [b.name for b in self.layout.buffers]
            handles = self.handles if self.handles is not None else self._allocator_handles()
            views = locate_buffers(self.buffers, names, handles, self._storage_key, self._handle_key)
            self._endpoint = {
                "agent_id": self.agent_id, "host": socket.gethostname(), "pid": os.getpid(),
                "handles": self._encode_handles(handles), "views": views,
            }
        return self._endpoint

    def _allocator_handles(self) -> List[BufferHandle]:
        handles: List[BufferHandle] = []
        for allocator in self.allocators:
            try:
                handles.extend(allocator.export_handles())
            except NotImplementedError as exc:
                raise TransferError(f"{exc}: the decode rank's pools need a shareable allocator") from None
        return handles

    @abc.abstractmethod
    def _storage_key(self, tensor: torch.Tensor):
        """What identifies the memory ``tensor`` lives in (matched against ``_handle_key``)."""

    @abc.abstractmethod
    def _handle_key(self, handle: BufferHandle) -> Tuple[object, int]:
        """``(key, element offset of the handle's tensor in that memory)``."""

    @abc.abstractmethod
    def _encode_handles(self, handles: List[BufferHandle]):
        """msgpack-able form of the handles."""

    @abc.abstractmethod
    def _decode_handles(self, wire) -> List[BufferHandle]:
        """Inverse of ``_encode_handles``."""

    # ---- prefill side ----------------------------------------------------------------
    def push(self, handoff: KVHandoff, src_slots, src_state_slot: Optional[int], src_swa_slots, offset: int = 0) -> int:
        dst = self._peer(handoff.endpoint)
        with_state = src_state_slot is not None and handoff.dst_state_slot is not None
        copies = plan_copies(self.layout, handoff.layout, self.tp_rank, self.tp_size, handoff.tp_rank, with_state)
        dst_slots = handoff.dst_slots[offset : offset + len(src_slots)]
        dst_swa = handoff.dst_swa_slots if len(src_swa_slots) else []
        rows = row_plan(src_slots, dst_slots, src_state_slot, handoff.dst_state_slot, src_swa_slots, dst_swa)
        try:
            return push_rows(self.buffers, dst, copies, rows)
        finally:  # also when a later buffer fails: the copies already issued end before the caller hears
            self._sync()

    def _sync(self) -> None:
        """Make the copies visible to the peer before ``push`` returns."""

    def _check_peer(self, ep: Dict) -> None:
        """Raise TransferError if the peer agent is gone (its mapping, if any, is dropped)."""
        if ep.get("host") != socket.gethostname():
            raise TransferError(f"{self.backend_name} needs both ranks on one node: peer is on {ep.get('host')!r}")
        if not pid_alive(int(ep["pid"])):
            self.forget_peer(ep["agent_id"])
            raise TransferError(f"decode process {ep['pid']} is gone")

    def _peer(self, ep: Dict) -> Dict[str, torch.Tensor]:
        """The peer's buffers mapped into this process (cached per agent id)."""
        try:
            agent_id = ep["agent_id"]
        except (KeyError, TypeError):
            raise TransferError(f"not a {self.backend_name} endpoint: {sorted(ep) if isinstance(ep, dict) else ep!r}") from None
        self._check_peer(ep)
        with self._lock:
            mapped = self._peers.get(agent_id)
            if mapped is None:
                # a new peer (often a dead one's replacement): unmap those whose process is gone,
                # as nothing may push to them again to find out (their mappings pin the memory)
                for gone in [a for a, pid in self._peer_pids.items() if not pid_alive(pid)]:
                    self._peers.pop(gone, None)
                    self._peer_pids.pop(gone, None)
                mapped = self._map_peer(ep)
                self._peers[agent_id] = mapped
                self._peer_pids[agent_id] = int(ep["pid"])
        return mapped

    def _map_peer(self, ep: Dict) -> Dict[str, torch.Tensor]:
        local = _LOCAL_AGENTS.get(ep["agent_id"]) if self.local_shortcut and ep["pid"] == os.getpid() else None
        if local is not None:
            return local.buffers
        try:
            bases = [attach_buffers([h])[h.name] for h in self._decode_handles(ep["handles"])]
        except (OSError, RuntimeError) as exc:
            raise TransferError(f"cannot map the decode rank's buffers: {exc}") from exc
        out = {}
        for name, (i, offset, shape, stride) in ep["views"].items():
            base = bases[i]
            out[name] = base.as_strided(shape, stride, base.storage_offset() + offset)
        return out

    def forget_peer(self, agent_id: str) -> None:
        with self._lock:
            self._peers.pop(agent_id, None)
            self._peer_pids.pop(agent_id, None)

    def reset(self) -> None:
        """Peers' mappings dropped (a released decode pool's memory goes only once no prefill rank maps
        it), and a new agent id with a new endpoint (this rank's resumed pools are new memory, new
        handles): every peer maps them afresh at its next push; an endpoint of the old id names
        unlinked files (shm: the push fails, never writes where the pool no longer reads)."""
        self.close()
        self.agent_id, self._endpoint = uuid.uuid4().hex, None
        _LOCAL_AGENTS[self.agent_id] = self

    def close(self) -> None:
        with self._lock:
            self._peers.clear()
            self._peer_pids.clear()
        _LOCAL_AGENTS.pop(self.agent_id, None)
