"""Decode through the CUDA graph runner (actors.engine.cuda_graph_runner). On the CPU nothing is
captured, but the same path runs: static buffers, batches padded to a captured size, the forward on
those buffers; its tokens and logprobs equal the eager engine's, padding writes only the dummy
slot. When graphs are captured again (sleep mode) every TP rank captures at once, and only once
something was released; a PD prefill worker captures none. ``gpu`` tests capture real graphs (dense
and MoE) and replay them against eager, and a capture failing midway keeps none."""

import random
import threading
import types

import pytest
import torch

from actors.engine import Engine, model_runner
from actors.engine.config import EngineConfig
from actors.engine.cuda_graph_runner import (CAPTURE_BS, CudaGraphRunner, capture_batch_sizes, cuda_graph_max_bs,
                                             graphs_off_reason)
from actors.engine.forward_batch import ForwardBatch, ForwardMode
from actors.engine.memory_occupation import MemoryState, parse_tags
from actors.engine.tiny import build_tiny_checkpoint, tiny_adapters
from mem_cache import memory_budget
from mem_cache.memory_budget import GiB
from tests.pd_helpers import close_workers, make_pair
from tests.tp_helpers import thread_ranks

SCORED = {"temperature": 0, "ignore_eos": True, "return_logprob": True}


class RecordingRunner(CudaGraphRunner):
    """Records the size of every batch it replays."""

    def __init__(self, runner, capture_bs):
        super().__init__(runner, capture_bs)
        self.replayed = []

    def replay(self, forward_batch):
        self.replayed.append(forward_batch.batch_size)
        return super().replay(forward_batch)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(build_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"), seed=0))


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 261) for _ in range(rng.randint(3, 9))] for _ in range(n)]


def run(model_dir, batch, lens, graphs, lora_path=None, **args):
    """Each request's tokens and their logprobs, with ``lens`` new tokens each; the graph runner (or None)."""
    engine = Engine(model_path=model_dir, skip_tokenizer_init=True, attention_backend="triton", **args)
    try:
        assert engine.runner.graph_runner is None  # (the CPU: graphs off)
        if graphs:
            engine.runner.graph_runner = RecordingRunner(engine.runner, [1, 2, 4, 8])
        outs = engine.generate(input_ids=batch, sampling_params=[dict(SCORED, max_new_tokens=n) for n in lens],
                               lora_path=lora_path)
        engine.check_integrity()
        logprobs = [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]
        return [o["output_ids"] for o in outs], logprobs, engine.runner.graph_runner, engine.scheduler
    finally:
        engine.shutdown()


def test_padded_decode_equals_eager_through_prefill_and_retraction(llama):
    """Five requests admitted with little room reserved for their outputs (new_token_ratio 0.1) into a
    pool 7 slots larger than their prompts: the second decode step retracts some, whose prefill runs
    again (eager) between decode steps. Decode batches of 5 (padded to 8) and 3 (to 4); tokens and
    logprobs equal the eager engine's."""
    batch, lens = prompts(5), [6, 6, 5, 3, 3]
    args = dict(max_total_tokens=sum(map(len, batch)) + 7, max_running_requests=5, init_new_token_ratio=0.1,
                min_new_token_ratio=0.1)
    eager_ids, eager_lps, _, _ = run(llama, batch, lens, graphs=False, **args)
    ids, lps, graph_runner, scheduler = run(llama, batch, lens, graphs=True, **args)
    assert ids == eager_ids
    for got, want in zip(lps, eager_lps):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert {5, 3} <= set(graph_runner.replayed)  # (padded to 8 and 4)
    assert scheduler.num_retractions > 0


def test_base_model_batches_of_a_lora_engine_after_an_adapter_batch(llama, tmp_path):
    """A LoRA engine: the decode step with an adapter request runs eagerly, the base-model steps after it
    through the runner, whose layers must not keep that step's adapter groups (they would add its
    adapter's delta to a base row). Tokens and logprobs equal the eager engine's."""
    adapters = {name: str(path) for name, path in tiny_adapters(llama, tmp_path).items()}
    batch, lens, lora_path = prompts(3, seed=2), [2, 4, 4], ["sql", None, None]
    eager_ids, eager_lps, _, _ = run(llama, batch, lens, graphs=False, lora_path=lora_path, lora_paths=adapters,
                                     max_total_tokens=256)
    ids, lps, graph_runner, _ = run(llama, batch, lens, graphs=True, lora_path=lora_path, lora_paths=adapters,
                                    max_total_tokens=256)
    assert ids == eager_ids and graph_runner.replayed == [2, 2]
    for got, want in zip(lps, eager_lps):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


def test_padding_rows_write_only_the_dummy_slot(llama):
    """One decode step of 3 requests padded to 4, over static buffers an earlier batch left filled: the KV
    pool changes at the batch's 3 slots and at slot 0 (the padding row's dummy slot), nowhere else; the
    logits equal an eager forward's."""
    engine = Engine(model_path=llama, skip_tokenizer_init=True, attention_backend="triton", max_total_tokens=64)
    try:
        runner = engine.runner
        graph_runner = CudaGraphRunner(runner, [1, 4])
        pool = runner.token_to_kv_pool
        gen = torch.Generator().manual_seed(0)
        for buf in pool.k_buffer + pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=gen))
        seq_lens = [5, 9, 2]
        slots = torch.randperm(60, generator=gen)[:sum(seq_lens)] + 1
        start = 0
        for row, n in enumerate(seq_lens):
            runner.req_to_token_pool.req_to_token[row + 1, :n] = slots[start:start + n].to(torch.int32)
            start += n
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        out = runner.req_to_token_pool.req_to_token[[1, 2, 3], [n - 1 for n in seq_lens]].to(torch.int64)

        def batch():
            return ForwardBatch(ForwardMode.DECODE, t([7, 8, 9]), t(seq_lens) - 1, out.clone(), t([1, 2, 3]),
                                t(seq_lens), t(seq_lens) - 1, t([1, 1, 1]), t([0, 1, 2]), None, None,
                                seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=[n - 1 for n in seq_lens],
                                extend_seq_lens_cpu=[1, 1, 1])

        before = [buf.clone() for buf in pool.k_buffer + pool.v_buffer]
        eager = runner.forward(batch()).next_token_logits
        written = [buf.clone() for buf in pool.k_buffer + pool.v_buffer]
        for buf, old in zip(pool.k_buffer + pool.v_buffer, before):  # (the eager step's writes undone)
            buf.copy_(old)
        graph_runner.out_cache_loc.fill_(int(slots[0]))  # (left by an earlier, larger batch: stale rows)
        graph_runner.seq_lens.fill_(9)
        runner.graph_runner = graph_runner
        graphed = runner.forward(batch()).next_token_logits
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
        untouched = torch.ones(before[0].shape[0], dtype=torch.bool)
        untouched[out] = False
        untouched[0] = False
        for buf, old, eager_buf in zip(pool.k_buffer + pool.v_buffer, before, written):
            assert torch.equal(buf[untouched], old[untouched])
            assert torch.equal(buf[out], eager_buf[out])  # (the batch's own K/V as the eager step wrote them)
        assert not torch.equal(pool.k_buffer[0][0], before[0][0])  # (the padding row wrote the dummy slot)
        runner.graph_runner = None
        runner.req_to_token_pool.req_to_token[1:4].zero_()
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_what_runs_eagerly(llama):
    """Graphs are off on the CPU and for the torch backend; ``can_run`` takes plain decode batches up
    to the largest captured size, not extend batches, larger ones or those with input logprobs / M-RoPE."""
    engine = Engine(model_path=llama, skip_tokenizer_init=True, attention_backend="triton", max_total_tokens=64)
    try:
        runner = engine.runner
        assert "no CUDA" in graphs_off_reason(runner)
        runner.config.pp_size = 2
        assert "pipeline parallelism" in graphs_off_reason(runner)
        runner.config.pp_size = 1
        runner.config.disable_cuda_graph = True
        assert graphs_off_reason(runner) == "disable_cuda_graph"
        graph_runner = CudaGraphRunner(runner, [1, 2, 4])
        t = lambda n: torch.zeros(n, dtype=torch.int64)  # noqa: E731

        def batch(mode=ForwardMode.DECODE, bs=3, **fields):
            return ForwardBatch(mode, t(bs), t(bs), t(bs), t(bs), t(bs) + 1, t(bs), t(bs) + 1, t(bs), None, None,
                                **fields)

        assert graph_runner.can_run(batch()) and graph_runner.can_run(batch(bs=4))
        assert not graph_runner.can_run(batch(bs=5))
        assert not graph_runner.can_run(batch(ForwardMode.EXTEND))
        assert not graph_runner.can_run(batch(ForwardMode.TARGET_VERIFY))
        assert not graph_runner.can_run(batch(input_logprob_indices=t(1)))
        assert not graph_runner.can_run(batch(mrope_positions=t(9).view(3, 3)))
    finally:
        engine.shutdown()


def test_capture_sizes():
    """SGLang's list up to cuda_graph_max_bs, none above the request rows; cuda_graph_bs as given."""
    config = EngineConfig(model_path="m", cuda_graph_max_bs=24)
    assert capture_batch_sizes(config, cuda_graph_max_bs(config, 80 * GiB), 256) == [1, 2, 4, 8, 12, 16, 24]
    assert capture_batch_sizes(config, 24, 10) == [1, 2, 4, 8]
    config.cuda_graph_bs = [6, 3, 40]
    assert capture_batch_sizes(config, cuda_graph_max_bs(config, 80 * GiB), 32) == [3, 6]
    assert CAPTURE_BS[-1] == 512


def test_tp_ranks_capture_rank0s_sizes(llama, monkeypatch):
    """TP ranks on GPUs of different memory capture rank 0's sizes (its default cuda_graph_max_bs, here 256
    for 80 GiB, up to the 128 request rows): a rank picking its own (8 for 16 GiB) would capture other graphs
    than rank 0's, and their NCCL collectives would hang. Graphs are on as on CUDA (nothing is captured on
    the CPU); each rank reports its own memory."""
    thread_ranks(monkeypatch)
    leader = threading.get_ident()  # (rank 0 runs on this thread, the follower on its own)

    def virtual_memory():
        total = (80 if threading.get_ident() == leader else 16) * GiB
        return types.SimpleNamespace(available=total, total=total)

    monkeypatch.setattr(memory_budget, "psutil", types.SimpleNamespace(virtual_memory=virtual_memory))
    monkeypatch.setattr(model_runner, "graphs_off_reason", lambda runner: None)
    eng = Engine(model_path=llama, tp_size=2, skip_tokenizer_init=True, max_total_tokens=256)
    try:
        runners = [eng.runner, eng.tp_group.followers[0].runner]
        assert [r.max_running_requests for r in runners] == [128, 128]
        assert [r.graph_runner.capture_bs for r in runners] == [[bs for bs in CAPTURE_BS if bs <= 128]] * 2
        for runner in runners:
            runner.graph_runner = None
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_the_cuda_graph_tag_alone_is_no_sleep():
    """Released graphs leave decode eager: the engine still serves; any other part is sleep. The graphs
    come back with the last other part resumed (a trainer resumes the weights, then the KV cache)."""
    state = MemoryState()
    state.mark_released(parse_tags(["cuda_graph"]), keep_weights=True)
    assert not state.is_sleeping
    state.check_serving()
    state.mark_released(parse_tags(None), keep_weights=True)
    assert state.is_sleeping
    assert state.parts_to_resume(parse_tags(["weights"])) == {"weights"}
    state.released -= {"weights"}
    assert state.parts_to_resume(parse_tags(["kv_cache"])) == {"kv_cache", "cuda_graph"}
    assert state.parts_to_resume(parse_tags(["cuda_graph"])) == {"cuda_graph"}


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_captured_graphs_equal_eager(family, tmp_path):
    """Real capture and replay (the triton backends, fused experts): tokens and logprobs of batches
    of 1 to 5 requests (5 padded to 8) equal the eager engine's; a sleep releases the graphs and the
    wake-up captures them again."""
    model_dir = str(build_tiny_checkpoint(family, tmp_path / family, seed=0))
    batch, lens = prompts(5, seed=1), [6, 5, 4, 3, 2]
    results = []
    for disable in (True, False):
        engine = Engine(model_path=model_dir, skip_tokenizer_init=True, device="cuda", max_total_tokens=1024,
                        dtype="float32", disable_cuda_graph=disable, cuda_graph_max_bs=8)
        try:
            graph_runner = engine.runner.graph_runner
            assert (graph_runner is None) == disable
            if graph_runner is not None:
                assert sorted(graph_runner.graphs) == [1, 2, 4, 8]
                engine.release_memory_occupation(tags=["kv_cache", "cuda_graph"])
                assert not graph_runner.graphs
                engine.resume_memory_occupation()
                assert sorted(graph_runner.graphs) == [1, 2, 4, 8]
            outs = engine.generate(input_ids=batch, sampling_params=[dict(SCORED, max_new_tokens=n) for n in lens])
            engine.check_integrity()
            results.append(([o["output_ids"] for o in outs],
                            [[lp for lp, _ in o["meta_info"]["output_token_logprobs"]] for o in outs]))
        finally:
            engine.shutdown()
    (eager_ids, eager_lps), (ids, lps) = results
    assert ids == eager_ids
    for got, want in zip(lps, eager_lps):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_a_capture_failing_midway_keeps_no_graph(llama, monkeypatch):
    """A capture failing at a size (out of memory at a wake-up) keeps none of the sizes captured before it
    (largest first): a batch padded to a size left uncaptured would find no graph. The engine decodes
    eagerly, the tokens the graphs gave."""
    engine = Engine(model_path=llama, skip_tokenizer_init=True, device="cuda", max_total_tokens=1024,
                    dtype="float32", cuda_graph_max_bs=8)
    try:
        graph_runner, params = engine.runner.graph_runner, dict(SCORED, max_new_tokens=4)
        before = engine.generate(input_ids=prompts(1), sampling_params=params)[0]["output_ids"]
        forward = CudaGraphRunner._forward

        def failing(self, batch):
            if batch.batch_size == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            return forward(self, batch)

        monkeypatch.setattr(CudaGraphRunner, "_forward", failing)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            graph_runner.capture()
        assert not graph_runner.graphs
        assert engine.generate(input_ids=prompts(1), sampling_params=params)[0]["output_ids"] == before
        engine.check_integrity()
    finally:
        engine.shutdown()


class CollectiveCapture(CudaGraphRunner):
    """A TP rank's graphs whose capture ends only once every rank's does, as NCCL makes it (the all-reduces
    of its warm-ups and graphs wait for every rank's); counts its captures."""

    def __init__(self, runner, barrier: threading.Barrier):
        super().__init__(runner, [1])
        self.barrier, self.captures = barrier, 0

    def capture(self):
        self.barrier.wait()
        self.captures += 1


def test_tp2_ranks_capture_their_graphs_together_on_wake_up(llama, monkeypatch):
    """A TP 2 engine woken up: a rank's capture ends only once the other's does (NCCL), so rank 0 captures
    while the followers do, not before telling them to (each would wait for the other: a deadlock, here
    the barrier's timeout). Every rank captures once, when the last part is back."""
    thread_ranks(monkeypatch)
    eng = Engine(model_path=llama, tp_size=2, skip_tokenizer_init=True, max_total_tokens=256)
    try:
        barrier = threading.Barrier(2, timeout=5)
        runners = [eng.runner, eng.tp_group.followers[0].runner]
        for runner in runners:
            runner.graph_runner = CollectiveCapture(runner, barrier)
        eng.sleep(level=1)
        eng.wake_up(["weights"])
        assert [r.graph_runner.captures for r in runners] == [0, 0]  # (the KV cache still released)
        eng.wake_up()
        assert [r.graph_runner.captures for r in runners] == [1, 1] and not eng.is_sleeping()
        for runner in runners:
            runner.graph_runner = None
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_a_prefill_worker_captures_no_graphs(llama):
    """A PD prefill worker never decodes (a request's tokens after its first are the decode worker's): it
    captures no decode graphs, as SGLang's prefill server (their pool would take the memory its prefills'
    activations need); its decode worker's graphs are off on the CPU alone."""
    prefill, decode = make_pair(llama, prefill_args=dict(max_total_tokens=256), decode_args=dict(max_total_tokens=256))
    try:
        assert graphs_off_reason(prefill.runner) == "disable_cuda_graph"
        assert "no CUDA" in graphs_off_reason(decode.runner)
    finally:
        close_workers(prefill, decode)


def test_waking_an_awake_engine_captures_nothing(llama):
    """A resume with nothing released (a trainer's wake-up call at every step) captures nothing again: a
    capture of every size takes seconds, between two steps of the requests running. Released, the graphs are
    captured once at the wake-up."""
    engine = Engine(model_path=llama, skip_tokenizer_init=True, max_total_tokens=64)
    try:
        engine.runner.graph_runner = graph_runner = CollectiveCapture(engine.runner, threading.Barrier(1))
        engine.resume_memory_occupation()
        engine.resume_memory_occupation(["cuda_graph"])
        assert graph_runner.captures == 0
        engine.release_memory_occupation(["cuda_graph"])
        engine.resume_memory_occupation()
        assert graph_runner.captures == 1
        engine.runner.graph_runner = None
        engine.check_integrity()
    finally:
        engine.shutdown()
