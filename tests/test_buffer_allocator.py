"""Buffers a peer process can map: POSIX shared memory on CPU, CUDA IPC on GPU."""

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from mem_cache.buffer_allocator import (
    BufferHandle,
    LocalBufferAllocator,
    SharedMemoryBufferAllocator,
    attach_buffers,
    cleanup_stale_segments,
    create_buffer_allocator,
)
from mem_cache.memory_pool import MHATokenToKVPool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_peer(code: str, handles, timeout=60) -> str:
    """Run ``code`` in a fresh Python process with ``handles`` unpickled as ``handles``."""
    prelude = textwrap.dedent(
        """
        import pickle, sys, torch
        from mem_cache.buffer_allocator import attach_buffers
        handles = pickle.loads(sys.stdin.buffer.read())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        input=pickle.dumps(handles),
        capture_output=True,
        cwd=REPO,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def test_peer_process_reads_pages_and_writes_back():
    alloc = SharedMemoryBufferAllocator(prefix="test")
    try:
        pool = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 2, buffer_allocator=alloc)
        fp8 = alloc.zeros("scales", (6,), torch.float8_e4m3fn)
        loc = torch.tensor([5, 6, 7, 9])
        k = torch.arange(4 * 2 * 8, dtype=torch.float32).reshape(4, 2, 8).to(torch.bfloat16)
        pool.set_kv_buffer(1, loc, k, -k)
        fp8[:] = torch.tensor([0.5, 1, 1.5, 2, 2.5, 3]).to(torch.float8_e4m3fn)
        out = run_peer(
            """
            bufs = attach_buffers(handles)
            k = bufs["k_buffer.1"]
            print(k.dtype, k.shape[0], k[5:8].float().sum().item(), k[9].float().sum().item())
            print(bufs["scales"].float().tolist())
            bufs["v_buffer.0"][3] = 7.0   # the peer writes a slot
            """,
            alloc.export_handles(),
        ).split("\n")
        assert out[0] == f"torch.bfloat16 20 {float(k[:3].float().sum())} {float(k[3].float().sum())}"
        assert out[1] == "[0.5, 1.0, 1.5, 2.0, 2.5, 3.0]"
        assert torch.all(pool.get_value_buffer(0)[3] == 7.0)
        assert torch.all(pool.get_value_buffer(0)[2] == 0)
    finally:
        alloc.close()


def test_close_unlinks_and_refuses_more():
    alloc = SharedMemoryBufferAllocator(prefix="close")
    alloc.zeros("a", (3,), torch.int64)
    with pytest.raises(ValueError, match="already allocated"):
        alloc.zeros("a", (3,), torch.int64)
    paths = [h.payload for h in alloc.export_handles()]
    assert all(os.path.exists(p) for p in paths)
    handles = pickle.loads(pickle.dumps(alloc.export_handles()))
    assert handles[0] == BufferHandle("a", "shm", (3,), "int64", 24)
    alloc.close()
    assert not any(os.path.exists(p) for p in paths)
    with pytest.raises(RuntimeError, match="closed"):
        alloc.zeros("b", (3,), torch.int64)


def test_owner_exit_without_close_leaves_nothing():
    out = subprocess.run(
        [sys.executable, "-c", "import torch\nfrom mem_cache.buffer_allocator import SharedMemoryBufferAllocator\n"
         "a = SharedMemoryBufferAllocator(prefix='exit')\na.zeros('x', (1024,), torch.float32)\n"
         "print(a.export_handles()[0].payload)"],
        capture_output=True, cwd=REPO, timeout=60, check=True,
    ).stdout.decode().strip()
    assert out.startswith("/") and not os.path.exists(out)


def test_stale_segments_of_dead_processes_are_cleaned(tmp_path):
    dead = tmp_path / "raydix-pool-999999999-0123abcd-k_buffer.0"
    mine = tmp_path / f"raydix-pool-{os.getpid()}-0123abcd-k_buffer.0"
    other = tmp_path / "unrelated-file"
    for p in (dead, mine, other):
        p.write_bytes(b"x")
    assert cleanup_stale_segments(str(tmp_path)) == [str(dead)]
    assert mine.exists() and other.exists()


def test_local_buffers_cannot_be_exported():
    alloc = LocalBufferAllocator("cpu")
    alloc.zeros("a", (2,), torch.float32)
    with pytest.raises(NotImplementedError, match="cannot be mapped"):
        alloc.export_handles()
    with pytest.raises(ValueError, match="kind 'local'"):
        attach_buffers([BufferHandle("a", "local", (2,), "float32", 8)])


def test_factory_picks_the_kind_for_the_device():
    assert isinstance(create_buffer_allocator("cpu", shareable=False), LocalBufferAllocator)
    shm = create_buffer_allocator("cpu", shareable=True)
    assert isinstance(shm, SharedMemoryBufferAllocator)
    shm.close()
    with pytest.raises(ValueError, match="meta"):
        create_buffer_allocator("meta", shareable=True)


@pytest.mark.gpu
def test_cuda_ipc_peer_reads_and_writes():
    from mem_cache.buffer_allocator import CudaIpcBufferAllocator

    alloc = CudaIpcBufferAllocator("cuda:0")
    pool = MHATokenToKVPool(64, 16, torch.bfloat16, 4, 32, 2, device="cuda", buffer_allocator=alloc)
    k = torch.randn(3, 4, 32, device="cuda").to(torch.bfloat16)
    pool.set_kv_buffer(0, torch.tensor([17, 18, 40], device="cuda"), k, k)
    torch.cuda.synchronize()
    segments = torch.cuda.memory_snapshot(alloc.mem_pool.id)
    spans = [(s["address"], s["address"] + s["total_size"]) for s in segments]
    for t in alloc.buffers().values():  # every KV buffer lives in the private pool's segments
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans)
    out = run_peer(
        """
        bufs = attach_buffers(handles)
        k = bufs["k_buffer.0"]
        print(k.device.type, k[17:19].float().sum().item(), k[40].float().sum().item())
        bufs["v_buffer.1"][5] = 3.0
        torch.cuda.synchronize()
        """,
        alloc.export_handles(),
        timeout=120,
    ).split("\n")
    assert out[0] == f"cuda {float(k[:2].float().sum())} {float(k[2].float().sum())}"
    assert torch.all(pool.get_value_buffer(1)[5] == 3.0)
    torch.cuda.ipc_collect()  # the peer is gone: release what was shared with it
