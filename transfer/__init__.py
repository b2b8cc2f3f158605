"""Moving KV pages between workers by slot-index lists.

Will hold the msgpack wire messages, the sender/receiver handshake (a polled
state machine), and the backends: same-node shared memory / CUDA IPC over the
buffers of ``mem_cache.buffer_allocator``, and ``torch.distributed`` (NCCL or
gloo) across nodes, plus a fake backend with the same interface for tests.
"""
