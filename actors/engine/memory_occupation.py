"""Sleep mode: an engine gives its memory back while an RL trainer colocated with it trains, and takes it
again to generate (SGLang's ``release_memory_occupation`` / ``resume_memory_occupation``, vLLM's ``sleep``
/ ``wake_up``). Two parts are released, by tag:

* ``kv_cache``: the prefix cache is dropped (its host-tier copies too, as a flush: they are KV of the
  weights the trainer is about to change; the host buffers stay allocated, a file tier keeps its pages),
  then every KV and Mamba state buffer's memory goes back (:meth:`BufferAllocator.release`: the storage
  freed, on CUDA returned to the driver). Resumed: allocated anew at the same sizes, zero-filled, the
  cache empty. The request table (int32 rows) is kept.
* ``weights``: the checkpoint tensors' memory (``ServedWeights.targets``; buffers the model computes at
  start, such as rotary tables, are kept). vLLM's sleep level 1 keeps a copy in CPU memory and wake_up
  copies it back; level 2, and SGLang's release (it keeps no copy unless ``enable_weights_cpu_backup``),
  discard them: resumed, they are zeros and the engine refuses to generate until weight updates
  (``update_weights_from_disk`` / ``_tensor``, a trainer's buckets of tensors adding up) have written every
  one of them — the RL flow's release, resume of the weights, update, resume of the KV cache. A draft
  model's checkpoint tensors (draft-model speculation, rank 0) are released with them and always copied
  to the CPU, at level 2 too: weight updates replace the served checkpoint only, so nothing else could
  write the draft's again.

* ``cuda_graph``: the decode CUDA graphs (``actors.engine.cuda_graph_runner``; none on the CPU or with graphs
  off). They read the KV buffers' and the weights' memory, which a release frees and a resume allocates anew
  elsewhere, so they are dropped whenever a part is released and captured again once every part is resumed;
  the resume of the last other part resumes this one too (:meth:`MemoryState.parts_to_resume`). Released
  alone, the engine still serves: its decode steps run eagerly. Every TP rank captures at once, once every
  rank's memory is back (:meth:`EngineMemory._capture_graphs`).

No tag given: all of them. Every TP rank releases and resumes alike (rank 0 tells the others, as a weight update).

Release needs an idle engine (SGLang's asserts one; vLLM's expects its caller to have stopped sending):
a request held, waiting or running, refuses it (RuntimeError, nothing released). While any part is
released, new requests are refused (RuntimeError: nothing could run them), as are weight updates while the
weights are (their tensors have no memory to copy into: resume them first). A PD worker's KV pools are
released and resumed alike (a decode worker's as new shared-memory files or in a new CUDA IPC pool): each
rank's transfer agents then forget the old memory (``RankMemory.on_kv_moved``; see ``actors.workers``).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

import torch

from actors.engine.lora_updates import on_followers
from actors.engine.model_loader import checkpoint_targets
from mem_cache.mamba_pool import MambaPool
from mem_cache.memory_pool import KVCache

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)


def parse_tags(tags: Optional[Iterable[str]]) -> FrozenSet[str]:
    """The parts ``tags`` names (None: all); ValueError naming an unknown one."""
    tags = MEMORY_TAGS if tags is None else list(tags)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: known are {list(MEMORY_TAGS)}")
    return frozenset(tags)


def kv_pools(runner) -> List:
    """Every pool of ``runner`` holding KV or Mamba state: its KV pool, the pools that one is made of
    (SWA's two, a hybrid model's full-attention pool and Mamba pool), and a draft model's."""
    draft = getattr(runner, "draft", None)
    pending = [runner.token_to_kv_pool, getattr(runner, "mamba_pool", None),
               draft.token_to_kv_pool if draft is not None else None]
    found: Dict[int, object] = {}
    while pending:
        pool = pending.pop()
        if pool is None or id(pool) in found:
            continue
        found[id(pool)] = pool
        pending += [v for v in vars(pool).values() if isinstance(v, (KVCache, MambaPool))]
    return list(found.values())


class RankMemory:
    """One rank's releasable memory (a TP follower's too): its KV pools' buffers and checkpoint tensors.
    ``on_kv_moved``: called once its KV buffers were released or allocated anew (a PD rank's transfer
    agents forget their mappings and endpoint: ``RankHost.reset_agents``)."""

    def __init__(self, runner):
        self.runner = runner
        self.on_kv_moved: Callable[[], None] = lambda: None
        self.weights_copy: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (each tensor with its copy on the CPU)
        self.weights_released: List[Tuple[torch.UntypedStorage, int]] = []  # each storage with its size

    def _allocators(self) -> List:
        """Each once, the allocators of the KV pools' buffers, and of a Mamba pool's verify scratch (speculative
        decoding: sized by the memory budget as the states are)."""
        found = {}
        for pool in kv_pools(self.runner):
            for allocator in (pool.buffer_allocator, getattr(pool, "verify_allocator", None)):
                if allocator is not None:
                    found[id(allocator)] = allocator
        return list(found.values())

    def _draft_weights(self) -> List[torch.Tensor]:
        """A draft model's checkpoint tensors (rank 0's, with draft-model speculation; else none)."""
        draft = getattr(self.runner, "draft", None)
        return [t for t, _ in checkpoint_targets(draft.model).values()] if draft is not None else []

    def release(self, tags: FrozenSet[str], keep_weights: bool = False) -> List[str]:
        """Give back the memory of ``tags``' parts; ``keep_weights``: a CPU copy of the weights first. A draft
        model's weights are released with the weights and always copied: no weight update writes them (it
        replaces the served checkpoint's), so nothing else could restore them. Returns the names of the
        served tensors discarded (released without a copy: weight updates must write them again)."""
        if self.runner.graph_runner is not None:  # (they read the memory about to move)
            self.runner.graph_runner.release()
        if KV_CACHE in tags:
            for allocator in self._allocators():
                allocator.release()
            self.on_kv_moved()
        if WEIGHTS in tags:
            served = [t for t, _ in self.runner.weights.targets.values()]
            draft = self._draft_weights()
            self.weights_copy = [(t, t.detach().to("cpu", copy=True)) for t in (served if keep_weights else []) + draft]
            storages = (t.untyped_storage() for t in served + draft)  # (tied tensors, views of one buffer: once)
            self.weights_released = [(s, s.nbytes()) for s in {s.data_ptr(): s for s in storages}.values()]
            for storage, _ in self.weights_released:
                storage.resize_(0)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return list(self.runner.weights.targets) if WEIGHTS in tags and not keep_weights else []

    @torch.no_grad()
    def resume(self, tags: FrozenSet[str]) -> None:
        """Allocate ``tags``' parts anew: the KV zero-filled, the weights from their CPU copy (else zeros)."""
        if KV_CACHE in tags:
            for allocator in self._allocators():
                allocator.resume()
            for pool in kv_pools(self.runner):
                if isinstance(pool, KVCache):
                    pool.rebind_buffers()
            self.on_kv_moved()
        if WEIGHTS in tags:
            for storage, nbytes in self.weights_released:  # (released, they all have address 0: kept, not found again)
                storage.resize_(nbytes)
                storage.fill_(0)
            for tensor, saved in self.weights_copy:
                tensor.copy_(saved)
            self.weights_copy, self.weights_released = [], []

    def capture_graphs(self, _=None) -> None:
        """Capture the decode graphs anew (none with graphs off), once every part is back."""
        if self.runner.graph_runner is not None:
            self.runner.graph_runner.capture()


class SleepingError(RuntimeError):
    """A request refused while memory is released, or on discarded weights (HTTP: 503)."""


class NotIdleError(RuntimeError):
    """A release refused: requests are in flight (HTTP: 409)."""


class MemoryState:
    """What is released, and whether the weights were discarded and no update has written them since: an
    engine's (:class:`EngineMemory`), or a PD cluster's, every worker's alike (``cluster.backend.PDBackend``)."""

    def __init__(self):
        self.released: Set[str] = set()
        self.weights_discarded = False

    @property
    def is_sleeping(self) -> bool:
        """Some memory requests need is released (released graphs alone: decode runs eagerly)."""
        return bool(self.released - {CUDA_GRAPH})

    def parts_to_resume(self, tags: FrozenSet[str]) -> FrozenSet[str]:
        """The released parts of ``tags``, and the graphs with them once no other part stays released (a
        trainer's flow resumes the weights, then the KV cache, and names no graphs: awake, they are back)."""
        parts = tags & self.released
        if self.released - parts <= {CUDA_GRAPH}:
            parts |= self.released & {CUDA_GRAPH}
        return frozenset(parts)

    def mark_released(self, parts: FrozenSet[str], keep_weights: bool) -> None:
        self.released |= parts
        if WEIGHTS in parts and not keep_weights:
            self.weights_discarded = True

    def check_serving(self) -> None:
        """SleepingError unless requests can run: nothing released, the weights not left discarded."""
        if self.is_sleeping:
            raise SleepingError(f"the engine is sleeping (its {', '.join(sorted(self.released))} released): "
                                "resume_memory_occupation (wake_up) first")
        if self.weights_discarded:
            raise SleepingError("the weights were discarded (sleep level 2, or released without a CPU copy): "
                                "update them (update_weights_from_disk / update_weights_from_tensor) first")

    def check_weights_update(self) -> None:
        """ValueError while the weights are released: an update has no memory to copy into."""
        if WEIGHTS in self.released:
            raise ValueError("the weights are released (sleep mode): resume them first (wake_up with tags "
                             "['weights'], or resume_memory_occupation)")


class EngineMemory(MemoryState):
    """An engine's sleep state (rank 0's; a PD worker's too); each rank's :class:`RankMemory` does the
    releasing. ``loop``: the engine's (its lock held while memory is released or resumed, so no step runs
    meanwhile)."""

    def __init__(self, loop, runner, call_followers):
        super().__init__()
        self.loop, self.rank, self.call_followers = loop, RankMemory(runner), call_followers
        self.unwritten: Set[str] = set()  # (the weights discarded: the served tensors no update has written since)

    def release(self, tags: FrozenSet[str], keep_weights: bool) -> None:
        """NotIdleError (nothing released) while a request is held; parts released already are left as
        they are; the KV cache's release drops the prefix cache first. On every rank or on none: a rank
        failing it (a follower's error is a ValueError naming it), every rank allocates the parts anew and
        the error is raised, discarded weights left discarded (an engine that looked awake on released
        memory would run its next step on freed buffers)."""
        def release():
            held = [r.rid for r in self.loop.held_reqs()]
            if held or self.loop.scheduler.has_work():
                raise NotIdleError(f"requests are in flight ({', '.join(held[:8])}): releasing memory needs an "
                                   "idle engine (abort them, or wait for them to end)")
            parts = tags - self.released
            if KV_CACHE in parts:
                self.loop.scheduler.drop_prefix_cache()
            self.mark_released(parts, keep_weights)
            try:
                self.rank.release(parts, keep_weights)
                # (a pipeline stage's tensors are its own: every rank's must be written again, not rank 0's alone)
                for names in on_followers(self.call_followers, "memory_release", (parts, keep_weights)):
                    self.unwritten.update(names)
            except Exception:  # (a rank that had not released them allocates its KV anew: the cache is empty)
                self._resume(parts)
                raise

        self.loop.run_exclusive(release)

    def resume(self, tags: FrozenSet[str]) -> None:
        self.loop.run_exclusive(lambda: self._resume(self.parts_to_resume(tags)))

    def _resume(self, parts: FrozenSet[str]) -> None:
        self.rank.resume(parts)
        on_followers(self.call_followers, "memory_resume", parts)
        self.released -= parts
        if parts and not self.released:  # (a resume of nothing released: the graphs are there)
            self._capture_graphs()

    def _capture_graphs(self) -> None:
        """Every rank captures its decode graphs, all at once: a rank's capture runs its forward's collectives
        (NCCL's all-reduces, in the warm-ups and in the graphs), which end only once every rank joins them, so
        rank 0 captures between its call to the followers and their replies. Captured in its own resume, before
        the followers are told to resume, it would wait for ranks waiting for it."""
        if self.call_followers is None:
            self.rank.capture_graphs()
        elif self.rank.runner.graph_runner is not None:  # (every rank has graphs, or none has)
            on_followers(functools.partial(self.call_followers, alongside=self.rank.capture_graphs),
                         "memory_capture_graphs", None)

    def mark_released(self, parts: FrozenSet[str], keep_weights: bool) -> None:
        super().mark_released(parts, keep_weights)
        if WEIGHTS in parts and not keep_weights:
            self.unwritten = set(self.rank.runner.weights.targets)

    def update_weights(self, apply: Callable[[Callable[[], None]], List[str]], flush: Callable[[], None]) -> None:
        """A weight update's ``apply(flush)`` (returning the names of the served tensors it wrote), its caller
        holding the loop's lock: refused (ValueError) while the weights are released, the cache's flush as
        :meth:`cache_flush` chooses it. Checked here, not as the update starts: a release landing while it
        waits for the engine to drain would leave its copy writing into freed memory (and a level 2 sleep
        after the copy would be forgotten). Discarded weights serve again once every tensor was written
        since, by one update or several (a trainer's buckets of tensors): a part of them is zeros."""
        self.check_weights_update()
        self.unwritten -= set(apply(self.cache_flush(flush)))
        self.weights_discarded = bool(self.unwritten)

    def cache_flush(self, flush: Callable[[], None]) -> Callable[[], None]:
        """A cache flush (a weight update's, /flush_cache): ``flush``, unless the KV cache is released (then
        the cache is empty and its buffers have no memory to check: dropped as is)."""
        return self.loop.scheduler.drop_prefix_cache if KV_CACHE in self.released else flush
