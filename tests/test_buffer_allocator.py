"""Buffers a peer process can map: POSIX shared memory on CPU, CUDA IPC on GPU.

Peers are fresh ``python -c`` processes: they get the pickled handles on stdin,
run a snippet, and send back whatever the snippet leaves in ``result``.
"""

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
PEER_PRELUDE = """
import pickle, sys, torch
from mem_cache.buffer_allocator import attach_buffers
handles = pickle.loads(sys.stdin.buffer.read())
result = None
"""
PEER_EPILOGUE = "\nsys.stdout.buffer.write(pickle.dumps(result))\n"


def run_python(code: str, stdin: bytes = b"", timeout: float = 60) -> bytes:
    """Run ``code`` in a fresh interpreter at the repo root; its stdout, or fail with its stderr."""
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout


def run_peer(code: str, handles, timeout: float = 60):
    """Run ``code`` in a peer process with ``handles`` unpickled; return its ``result``."""
    source = PEER_PRELUDE + textwrap.dedent(code) + PEER_EPILOGUE
    return pickle.loads(run_python(source, pickle.dumps(handles), timeout))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality, fp8 and NaN-safe: compare the raw bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_peer_process_reads_pages_and_writes_back():
    alloc = SharedMemoryBufferAllocator(prefix="test")
    try:
        bf16 = MHATokenToKVPool(16, 4, torch.bfloat16, 2, 8, 2, buffer_allocator=alloc)
        fp8 = MHATokenToKVPool(16, 4, torch.float8_e4m3fn, 1, 8, 1, buffer_allocator=alloc, name_prefix="fp8.")
        ids = alloc.zeros("ids", (5,), torch.int64)
        empty = alloc.zeros("empty", (0, 3), torch.float32)
        assert fp8.k_buffer[0].dtype == torch.uint8  # fp8 KV is stored as bytes
        loc = torch.tensor([5, 6, 7, 9])
        k = torch.randn(4, 2, 8).to(torch.bfloat16)
        bf16.set_kv_buffer(1, loc, k, -k)
        k8 = torch.tensor([0.5, -1, 1.5, 448]).repeat(4, 1, 2).to(torch.float8_e4m3fn)
        fp8.set_kv_buffer(0, loc, k8, k8)
        ids[:] = torch.tensor([1, -2, 2**40, 0, 7])

        got = run_peer(
            """
            bufs = attach_buffers(handles)
            loc = torch.tensor([5, 6, 7, 9])
            result = {
                "dtypes": {name: str(t.dtype) for name, t in bufs.items()},
                "k": bufs["k_buffer.1"][loc].clone(),
                "v": bufs["v_buffer.1"][loc].clone(),
                "k8": bufs["fp8.k_buffer.0"].view(torch.float8_e4m3fn)[loc].float(),  # exact; fp8 won't pickle
                "untouched": bool((bufs["k_buffer.1"][:5] == 0).all()),
                "ids": bufs["ids"].clone(),
                "empty": tuple(bufs["empty"].shape),
            }
            bufs["v_buffer.0"][3] = 7.0                       # the peer writes a slot ...
            bufs["fp8.v_buffer.0"][2] = torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8)
            bufs["ids"][1] = 99
            """,
            alloc.export_handles(),
        )
        assert got["dtypes"]["k_buffer.1"] == "torch.bfloat16" and got["dtypes"]["fp8.k_buffer.0"] == "torch.uint8"
        assert same_bits(got["k"], k) and same_bits(got["v"], -k) and torch.equal(got["k8"], k8.float())
        assert got["untouched"] and got["empty"] == (0, 3)
        assert torch.equal(got["ids"], torch.tensor([1, -2, 2**40, 0, 7]))
        assert torch.all(bf16.get_value_buffer(0)[3] == 7.0)  # ... and the owner sees it
        assert torch.all(bf16.get_value_buffer(0)[2] == 0)
        assert torch.all(fp8.get_value_buffer(0)[2].float() == 1.0)
        assert ids.tolist() == [1, 99, 2**40, 0, 7]
        assert empty.numel() == 0
    finally:
        alloc.close()


def test_attached_view_shares_bytes_and_outlives_close():
    alloc = SharedMemoryBufferAllocator(prefix="view")
    owner = alloc.zeros("x", (4,), torch.float32)
    peer = attach_buffers(alloc.export_handles())["x"]
    owner[1] = 2.5
    peer[2] = -1.0
    assert peer.tolist() == [0.0, 2.5, -1.0, 0.0] and owner.tolist() == peer.tolist()
    alloc.close()
    peer[0] = 3.0  # the mapping survives the unlink
    assert peer.tolist() == [3.0, 2.5, -1.0, 0.0]


def test_close_unlinks_and_refuses_more():
    alloc = SharedMemoryBufferAllocator(prefix="close")
    alloc.zeros("a/b c", (3,), torch.int64)
    with pytest.raises(ValueError, match="already allocated"):
        alloc.zeros("a/b c", (3,), torch.int64)
    paths = [h.payload for h in alloc.export_handles()]
    assert all(os.path.exists(p) for p in paths)
    assert os.path.basename(paths[0]).startswith(f"raydix-close-{os.getpid()}-")
    assert paths[0].endswith("-a_b_c")
    assert os.stat(paths[0]).st_mode & 0o777 == 0o600
    handles = pickle.loads(pickle.dumps(alloc.export_handles()))
    assert handles[0] == BufferHandle("a/b c", "shm", (3,), "int64", 24)
    assert handles[0].payload == paths[0]
    alloc.close()
    alloc.close()  # idempotent
    assert not any(os.path.exists(p) for p in paths)
    assert alloc.export_handles() == [] and alloc.buffers() == {}
    with pytest.raises(RuntimeError, match="closed"):
        alloc.zeros("b", (3,), torch.int64)


def test_shm_dir_is_configurable(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDIX_SHM_DIR", str(tmp_path))
    alloc = SharedMemoryBufferAllocator(prefix="dir")
    alloc.zeros("x", (2,), torch.float16)
    (path,) = [h.payload for h in alloc.export_handles()]
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) == 4
    alloc.close()
    assert os.listdir(tmp_path) == []


def test_owner_exit_without_close_leaves_nothing():
    """A forked child's exit must not unlink the owner's files; the owner's exit must."""
    out = run_python(textwrap.dedent(
        """
        import os, torch
        from mem_cache.buffer_allocator import SharedMemoryBufferAllocator
        a = SharedMemoryBufferAllocator(prefix='exit')
        a.zeros('x', (1024,), torch.float32)
        path = a.export_handles()[0].payload
        pid = os.fork()
        if pid == 0:
            raise SystemExit(0)  # a normal exit: atexit handlers run in the child
        os.waitpid(pid, 0)
        print(path, os.path.exists(path))
        """
    )).decode().split()
    path, alive_after_child = out
    assert alive_after_child == "True"
    assert os.path.isabs(path) and not os.path.exists(path)


def test_stale_segments_are_those_whose_owner_lock_is_free(tmp_path):
    """Liveness is the owner's flock, not its PID: a live owner whose PID this process cannot
    see (another PID namespace sharing /dev/shm) keeps its files; an owner killed with
    SIGKILL loses them. Files with no lock file (an owner from before lock files, as in a
    rolling upgrade) are judged by their PID; other files are left alone."""
    import fcntl

    held = tmp_path / "raydix-pool-999999999-0123abcd"  # an owner PID this namespace does not have
    fd = os.open(str(held) + ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)
    orphan = tmp_path / "raydix-pool-999999999-4567abcd-k_buffer.0"  # no lock file, its PID gone
    legacy = tmp_path / f"raydix-pool-{os.getpid()}-89abcdef-k_buffer.0"  # no lock file, its owner alive
    other = tmp_path / "unrelated-file"
    for p in (tmp_path / (held.name + "-k_buffer.0"), orphan, legacy, other):
        p.write_bytes(b"x")
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, torch
        os.environ["RAYDIX_SHM_DIR"] = {str(tmp_path)!r}
        from mem_cache.buffer_allocator import SharedMemoryBufferAllocator
        alloc = SharedMemoryBufferAllocator("cpu", prefix="decode-0")
        alloc.zeros("k_buffer.0", (8,), torch.float32)
        os.kill(os.getpid(), signal.SIGKILL)  # no finalizer runs
        """)], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert killed.returncode == -9
    left_by_killed = sorted(str(p) for p in tmp_path.glob("raydix-decode_0-*"))
    assert len(left_by_killed) == 2  # its segment and its lock
    try:
        assert sorted(cleanup_stale_segments(str(tmp_path))) == sorted([str(orphan)] + left_by_killed)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [held.name + ".lock", held.name + "-k_buffer.0", legacy.name, "unrelated-file"])
    finally:
        os.close(fd)
    assert sorted(cleanup_stale_segments(str(tmp_path))) == [str(held) + "-k_buffer.0", str(held) + ".lock"]


def test_a_new_shareable_allocator_reclaims_segments_of_dead_workers(tmp_path, monkeypatch):
    """A SIGKILLed worker cannot unlink its pools; the next worker on the node does."""
    monkeypatch.setenv("RAYDIX_SHM_DIR", str(tmp_path))
    dead = tmp_path / "raydix-decode_0_1a2b3c_r0-999999999-0123abcd-full.k_buffer.0"
    dead.write_bytes(b"x" * 64)
    alloc = create_buffer_allocator("cpu", shareable=True, prefix="decode-1-r0")
    alloc.zeros("k", (4,), torch.float32)
    assert not dead.exists()
    assert [p.name for p in tmp_path.iterdir()] and all(str(os.getpid()) in p.name for p in tmp_path.iterdir())
    assert cleanup_stale_segments(str(tmp_path)) == []  # its owner is alive
    alloc.close()
    assert list(tmp_path.iterdir()) == []  # segments and lock file


def test_local_buffers_cannot_be_exported():
    alloc = LocalBufferAllocator("cpu")
    alloc.zeros("a", (2,), torch.float32)
    with pytest.raises(NotImplementedError, match="cannot be mapped"):
        alloc.export_handles()
    with pytest.raises(ValueError, match="kind 'local'"):
        attach_buffers([BufferHandle("a", "local", (2,), "float32", 8)])
    with pytest.raises(ValueError, match="kind 'nccl'"):
        attach_buffers([BufferHandle("a", "nccl", (2,), "float32", 8)])


def test_factory_picks_the_kind_for_the_device():
    assert isinstance(create_buffer_allocator("cpu", shareable=False), LocalBufferAllocator)
    shm = create_buffer_allocator("cpu", shareable=True)
    assert isinstance(shm, SharedMemoryBufferAllocator)
    shm.close()
    with pytest.raises(ValueError, match="meta"):
        create_buffer_allocator("meta", shareable=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_ipc_without_cuda_raises():
    from mem_cache.buffer_allocator import CudaIpcBufferAllocator

    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaIpcBufferAllocator("cuda:0")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        create_buffer_allocator("cuda", shareable=True)


def assert_in_private_pool(alloc, outsider: torch.Tensor) -> None:
    """Every buffer, and not ``outsider``, lies in a segment of ``alloc.mem_pool``."""
    segments = alloc.mem_pool.snapshot()  # no include_traces=: the device image's older torch lacks it
    spans = [(s["address"], s["address"] + s["total_size"]) for s in segments]

    def inside(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in spans)

    assert all(inside(t) for t in alloc.buffers().values() if t.numel())
    assert not inside(outsider)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_peer_reads_and_writes():
    from mem_cache.buffer_allocator import CudaIpcBufferAllocator

    alloc = CudaIpcBufferAllocator("cuda:0")
    unrelated = torch.ones(1 << 20, device="cuda")  # allocated outside the private pool
    pool = MHATokenToKVPool(64, 16, torch.bfloat16, 4, 32, 2, device="cuda", buffer_allocator=alloc)
    fp8 = MHATokenToKVPool(64, 16, torch.float8_e4m3fn, 1, 32, 1, device="cuda", buffer_allocator=alloc, name_prefix="fp8.")
    alloc.zeros("empty", (0,), torch.float32)
    loc = torch.tensor([17, 18, 40], device="cuda")
    k = torch.randn(3, 4, 32, device="cuda").to(torch.bfloat16)
    pool.set_kv_buffer(0, loc, k, -k)
    fp8.set_kv_buffer(0, loc, k[:, :1].to(torch.float8_e4m3fn), k[:, :1].to(torch.float8_e4m3fn))
    torch.cuda.synchronize()
    if hasattr(alloc.mem_pool, "snapshot"):  # older torch cannot list a pool's segments
        assert_in_private_pool(alloc, unrelated)

    got = run_peer(
        """
        bufs = attach_buffers(handles)
        loc = [17, 18, 40]
        result = {
            "device": bufs["k_buffer.0"].device.type,
            "k": bufs["k_buffer.0"][loc].cpu(),
            "v": bufs["v_buffer.0"][loc].cpu(),
            "k8": bufs["fp8.k_buffer.0"][loc].cpu(),
            "empty": tuple(bufs["empty"].shape),
        }
        bufs["v_buffer.1"][5] = 3.0
        torch.cuda.synchronize()
        del bufs  # drop the mappings: the owner's IPC ref counts fall to zero
        """,
        alloc.export_handles(),
        timeout=120,
    )
    assert got["device"] == "cuda" and got["empty"] == (0,)
    assert same_bits(got["k"], k.cpu()) and same_bits(got["v"], (-k).cpu())
    assert same_bits(got["k8"], fp8.k_buffer[0][loc].cpu())
    assert torch.all(pool.get_value_buffer(1)[5] == 3.0)
    assert torch.all(pool.get_value_buffer(1)[4] == 0)
    del pool, fp8
    alloc.close()
    torch.cuda.ipc_collect()  # the peer is gone: free what was shared with it
