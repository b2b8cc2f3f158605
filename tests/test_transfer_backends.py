"""Backends across two OS processes: one ``spawn``ed peer (shared by the module,
process start-up is the cost) plays the other rank.

* shm: the peer is the decode rank with pools in POSIX shared memory; this
  process maps them and writes; then the peer closes its allocator and a
  push to the unlinked files fails (→ Failed, not an exception);
* torch_dist (gloo): the peer is the decode rank, then the prefill rank;
* torch_dist (NCCL data path): this process is the prefill rank on cuda:0,
  the peer the decode rank on cuda:1 (two GPUs: NCCL refuses two ranks on one);
* cuda_ipc: on a GPU only; the peer is the decode rank, as with shm.
"""

import multiprocessing as mp

import numpy as np
import pytest
import torch

from tests.transfer_helpers import (
    RankSpec,
    assert_buffers_equal,
    build_pool,
    expected_after,
    push_one,
    request,
    snapshot,
    swa_window,
)
from tests.transfer_peer import serve
from transfer import KVHandoff, KVPoll, KVReceiver, KVSender, create_agent


class PeerProcess:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child,), daemon=True)
        self.proc.start()

    def __call__(self, name, *args, timeout=60):
        self.conn.send((name, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {name} in {timeout}s")
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def stop(self):
        try:
            self("stop", timeout=10)
        finally:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def peer():
    p = PeerProcess()
    yield p
    p.stop()


def _push_to_peer(peer, backend, spec_src, spec_dst, seed):
    rng = np.random.default_rng(seed)
    src_slots, dst_slots = request(rng, spec_src.page_size, 45, prefix_len=2)
    states = (1, 5) if spec_src.kind == "hybrid" else (None, None)
    src_swa, dst_swa = (a.tolist() for a in swa_window(rng, 16)) if spec_src.kind == "swa" else ((), ())
    wire, before = peer("decode", backend, spec_dst, dst_slots.tolist(), states[1], 2, dst_swa)
    _, layout, tensors, _ = build_pool(spec_src)
    agent = create_agent(backend, layout, tensors, spec_src.tp_rank, spec_src.tp_size)
    try:
        sender = KVSender(agent, "req")
        handoff = KVHandoff.from_bytes(wire)
        sender.init(handoff)
        sender.send(src_slots, states[0], src_swa)
        assert sender.poll() == KVPoll.Success, sender.failure_reason()
        state, reason, after = peer("land")
        assert state == KVPoll.Success, reason
    finally:
        agent.close()
    expected = expected_after(spec_src, layout, tensors, spec_dst, handoff.layout, before, src_slots, dst_slots, *states,
                              src_swa, dst_swa)
    assert_buffers_equal(after, expected)


@pytest.mark.parametrize(
    "kind, page_size, dst_tp_rank, dst_tp_size",
    [("mha", 16, 1, 2), ("hybrid", 1, 0, 1), ("mla", 16, 0, 1), ("swa", 1, 0, 2)],
)
def test_shm_across_processes(peer, kind, page_size, dst_tp_rank, dst_tp_size):
    src = RankSpec(kind, page_size, seed=3)
    dst = RankSpec(kind, page_size, dst_tp_rank, dst_tp_size, shared=True, seed=4)
    _push_to_peer(peer, "shm", src, dst, seed=page_size)


def test_torch_dist_gloo_across_processes_both_directions(peer):
    _push_to_peer(peer, "torch_dist", RankSpec("hybrid", 16, seed=1), RankSpec("hybrid", 16, seed=2), seed=8)
    _push_to_peer(peer, "torch_dist", RankSpec("swa", 1, seed=3), RankSpec("swa", 1, seed=4), seed=9)
    # Prefill TP 2 → decode TP 1: the peer is prefill rank 1 (heads [2, 4)), this
    # process both prefill rank 0 (heads [0, 2)) and the decode rank, which lands
    # only once both halves arrived.
    specs = [RankSpec("mha", 1, r, 2, seed=6 + r) for r in range(2)]
    dst_spec = RankSpec("mha", 1, seed=9)
    _, layout, tensors, _ = build_pool(dst_spec)
    decode = create_agent("torch_dist", layout, tensors, timeout_s=10)
    _, src_layout, src_tensors, _ = build_pool(specs[0])
    prefill = create_agent("torch_dist", src_layout, src_tensors, 0, 2)
    try:
        src_slots, dst_slots = request(np.random.default_rng(2), 1, 30)
        receiver = KVReceiver(decode, "req", 3)
        before = snapshot(tensors)
        handoff = receiver.send_metadata(dst_slots)
        state, reason = peer("prefill", "torch_dist", specs[1], handoff.to_bytes(), src_slots.tolist(), None)
        assert state == KVPoll.Success, reason
        sender = KVSender(prefill, "req")
        sender.init(KVHandoff.from_bytes(handoff.to_bytes()))
        sender.send(src_slots)
        receiver.mark_done()
        assert sender.poll() == receiver.wait() == KVPoll.Success, receiver.failure_reason()
    finally:
        prefill.close()
        decode.close()
    expected = before
    for spec in specs:
        _, src_layout, src_tensors, _ = build_pool(spec)
        expected = expected_after(spec, src_layout, src_tensors, dst_spec, layout, expected, src_slots, dst_slots, None, None)
    assert_buffers_equal(tensors, expected)


def test_shm_push_after_the_peer_unlinked_its_pools_fails(peer):
    wire, _ = peer("decode", "shm", RankSpec(shared=True), [7, 8], None, 0)
    peer("unlink")
    _, layout, tensors, _ = build_pool(RankSpec())
    sender = KVSender(create_agent("shm", layout, tensors), "req")
    sender.init(KVHandoff.from_bytes(wire))
    sender.send([1, 2])
    assert sender.poll() == KVPoll.Failed and "unlinked" in sender.failure_reason()


@pytest.mark.gpu
def test_cuda_ipc_in_process():
    from mem_cache.buffer_allocator import CudaIpcBufferAllocator
    from mem_cache.memory_pool import MHATokenToKVPool
    from transfer.layout import pool_allocators, pool_layout

    pools = [
        MHATokenToKVPool(64, 16, torch.float16, 4, 8, 2, device="cuda", buffer_allocator=CudaIpcBufferAllocator("cuda"))
        for _ in range(2)
    ]
    (src_layout, src), (dst_layout, dst) = pool_layout(pools[0]), pool_layout(pools[1])
    for t in src.values():
        t.copy_(torch.randn_like(t, dtype=torch.float16))
    prefill = create_agent("cuda_ipc", src_layout, src)
    decode = create_agent("cuda_ipc", dst_layout, dst, allocators=pool_allocators(pools[1]))
    push_one(prefill, decode, range(16, 32), range(32, 48))
    for name in src:
        assert torch.equal(dst[name][32:48], src[name][16:32]) and not dst[name][16:32].any()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind, page_size, dst_tp_rank, dst_tp_size",
    [("mha", 16, 1, 2), ("hybrid", 1, 0, 1), ("mla", 16, 0, 1), ("swa", 1, 0, 2)],
)
def test_cuda_ipc_across_processes(peer, kind, page_size, dst_tp_rank, dst_tp_size):
    """As in a PD deployment (a process per rank): the peer's decode pools come from its
    CUDA IPC MemPool, this process opens the pickled handles (another process: no
    shortcut to its tensors) and writes; Mamba layer states and SWA buffers land
    through their views into the bigger allocations."""
    src = RankSpec(kind, page_size, seed=3, device="cuda")
    dst = RankSpec(kind, page_size, dst_tp_rank, dst_tp_size, shared=True, seed=4, device="cuda")
    _push_to_peer(peer, "cuda_ipc", src, dst, seed=page_size)


@pytest.mark.gpu
def test_torch_dist_between_cuda_pools_stages_through_host():
    """The cross-node backend with device pools: rows gathered device→host, sent
    over gloo, scattered host→device, exactly into the destination slots."""
    from mem_cache.memory_pool import MHATokenToKVPool
    from transfer.layout import pool_layout

    pools = [MHATokenToKVPool(128, 16, torch.bfloat16, 4, 8, 2, device="cuda") for _ in range(2)]
    (src_layout, src), (dst_layout, dst) = pool_layout(pools[0]), pool_layout(pools[1])
    for t in src.values():
        t.copy_(torch.randn_like(t, dtype=torch.bfloat16))
    rng = np.random.default_rng(4)
    src_slots = (rng.permutation(7)[:3, None] * 16 + 16 + np.arange(16)).ravel().tolist()
    dst_slots = (rng.permutation(7)[:3, None] * 16 + 16 + np.arange(16)).ravel().tolist()
    prefill, decode = create_agent("torch_dist", src_layout, src), create_agent("torch_dist", dst_layout, dst)
    try:
        push_one(prefill, decode, src_slots, dst_slots)
    finally:
        prefill.close()
        decode.close()
    for name in src:
        untouched = sorted(set(range(dst[name].shape[0])) - set(dst_slots))
        assert torch.equal(dst[name][dst_slots], src[name][src_slots])
        assert not dst[name][untouched].any()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the NCCL data path needs two CUDA devices (NCCL refuses two ranks on one GPU)")
@pytest.mark.parametrize("kind, page_size", [("mha", 1), ("mha", 16), ("hybrid", 16)])
def test_torch_dist_nccl_between_two_gpus_keeps_the_payload_on_device(peer, monkeypatch, kind, page_size):
    """Prefill pools on cuda:0 here, decode pools on cuda:1 in the peer, both in mode
    nccl: two chunks of random slots land byte-exact, every payload was gathered on
    the device, and both ends of the pair record NCCL as its data transport."""
    import transfer.backends.torch_dist as torch_dist

    payload_devices, pack_rows = [], torch_dist.pack_rows

    def recording_pack_rows(*args, **kwargs):
        header, payload = pack_rows(*args, **kwargs)
        payload_devices.append(str(payload.device))
        return header, payload

    monkeypatch.setattr(torch_dist, "pack_rows", recording_pack_rows)
    src_spec = RankSpec(kind, page_size, seed=11, device="cuda:0")
    dst_spec = RankSpec(kind, page_size, seed=12, device="cuda:1")
    src_slots, dst_slots = request(np.random.default_rng(page_size), page_size, 45, prefix_len=2)
    states = (1, 5) if kind == "hybrid" else (None, None)
    wire, before = peer("decode", "torch_dist", dst_spec, dst_slots.tolist(), states[1], 2, (), None,
                        {"data_transport": "nccl"})
    handoff = KVHandoff.from_bytes(wire)
    assert handoff.endpoint["data"] == "nccl"
    _, layout, tensors, _ = build_pool(src_spec)
    agent = create_agent("torch_dist", layout, tensors, data_transport="nccl")
    try:
        sender = KVSender(agent, "req")
        sender.init(handoff)
        sender.send_chunk(src_slots[:20].tolist(), 0, False)
        sender.send_chunk(src_slots[20:].tolist(), 20, True, states[0])
        assert sender.poll() == KVPoll.Success, sender.failure_reason()
        state, reason, after = peer("land")
        assert state == KVPoll.Success, reason
        assert agent.link_transports == {handoff.endpoint["agent_id"]: "nccl"}
        assert {agent.agent_id: "nccl"} in peer("link_transports")
    finally:
        agent.close()
    assert payload_devices == ["cuda:0", "cuda:0"]
    _, _, host_src, _ = build_pool(src_spec.at(device="cpu"))  # the same seeded bytes
    expected = expected_after(src_spec, layout, host_src, dst_spec, handoff.layout, before, src_slots, dst_slots,
                              *states)
    assert_buffers_equal(after, expected)
