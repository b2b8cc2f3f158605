"""A peer rank in another OS process for the cross-process transfer tests.

``serve(conn)`` runs in a ``spawn``ed child and answers commands sent over a
``multiprocessing`` pipe: ``(name, args) -> ("ok", result) | ("err", repr)``.
The child plays either side of a transfer with pools built from a
:class:`~tests.transfer_helpers.RankSpec`, so the parent can compute the
expected bytes itself.
"""

from __future__ import annotations

from transfer import KVHandoff, KVReceiver, KVSender, create_agent

from tests.transfer_helpers import build_pool


def _host(tensors):
    """Copies on the host: what goes back through the pipe (device tensors would not)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


class Peer:
    def __init__(self):
        self.pools, self.agents, self.receiver = [], [], None

    def decode(self, backend, spec, dst_slots, dst_state, prefix_len, dst_swa=(), timeout_s=None, options=None):
        """Build a decode rank (``options``: extra agent keywords); returns the hand-off
        bytes and the buffers before."""
        pool, layout, tensors, allocators = build_pool(spec)
        self.pools.append((pool, tensors, allocators))
        agent = self._agent(backend, layout, tensors, spec, allocators, **(options or {}))
        self.receiver = KVReceiver(agent, "req", 1, timeout_s)
        return self.receiver.send_metadata(dst_slots, dst_state, prefix_len, dst_swa).to_bytes(), _host(tensors)

    def land(self):
        """Completion notice: wait for the bytes; returns (state, reason, buffers)."""
        self.receiver.mark_done()
        return int(self.receiver.wait()), self.receiver.failure_reason(), _host(self.pools[-1][1])

    def prefill(self, backend, spec, handoff_bytes, src_slots, src_state, src_swa=()):
        """Build a prefill rank and push; returns (state, reason)."""
        _, layout, tensors, _ = build_pool(spec)
        sender = KVSender(self._agent(backend, layout, tensors, spec, ()), "req")
        sender.init(KVHandoff.from_bytes(handoff_bytes))
        sender.send(src_slots, src_state, src_swa)
        return int(sender.poll()), sender.failure_reason()

    def link_transports(self):
        """Per agent of this peer, the data transport of each pair (torch_dist agents only)."""
        return [dict(getattr(agent, "link_transports", {})) for agent in self.agents]

    def unlink(self):
        for _, _, allocators in self.pools:
            for allocator in allocators:
                allocator.close()

    def _agent(self, backend, layout, tensors, spec, allocators, **options):
        agent = create_agent(backend, layout, tensors, spec.tp_rank, spec.tp_size, allocators=allocators, **options)
        self.agents.append(agent)
        return agent


def serve(conn) -> None:
    peer = Peer()
    while True:
        name, args = conn.recv()
        if name == "stop":
            for agent in peer.agents:
                agent.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(peer, name)(*args)))
        except Exception as exc:  # reported to the parent test
            conn.send(("err", repr(exc)))
