"""Prefill and decode workers: plain classes that ``cluster/`` turns into Ray actors.

Each hosts one engine (model runner + a disaggregated scheduler + the loop
thread) and its transfer agents, as rank 0 of its ``tp_size × pp_size`` ranks
(``actors.rank``: the followers, of every pipeline stage, are ``TPFollower``
actors; each rank pushes or receives its own stage's layers' KV). The path of
one request, driven by whoever routes it (``cluster.pd_client.PDClient``, its
pair picked by the router actor)::

    handoffs = await decode.reserve(rid, input_ids, sampling_params)   # slots reserved
    notice   = await prefill.prefill(rid, input_ids, sampling_params, handoffs)  # KV pushed
    async for out in decode.stream(rid, notice): ...                   # tokens

A prompt scored only (``max_new_tokens`` 0) has nothing to decode: it runs on the
prefill worker alone, ``out = await prefill.prefill_only(rid, input_ids, sampling_params)``.

A failure anywhere ends the request with :class:`PDRequestError` and frees
what it held on the worker that saw it; the router aborts the other side
(``decode.abort(rid)``), and the decode side's waiting timeout frees a
reservation whose notice never comes.

The methods are ``async`` so that a Ray async actor serves many requests at
once; tests call them in-process with asyncio.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import random
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from actors.engine.config import EngineConfig, prefill_speculative_error
from actors.engine.engine import (_eos_ids, check_engine_integrity, engine_server_info, flush_engine_cache,
                                  request_result)
from actors.engine.engine_loop import EngineLoop, Post
from actors.engine.grammar import MakingReqs, make_req_off_loop
from actors.engine.lora_updates import async_unload_lora_adapter, load_lora_adapter
from actors.engine.memory_occupation import EngineMemory, parse_tags
from actors.engine.model_loader import WeightsSource
from actors.engine.multimodal import MultimodalInputs
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.weight_updates import (ABORT_MESSAGE, UpdateWeightsRequest, WeightUpdater, check_paused_flush,
                                          check_weights)
from actors.kv_push import PushResult
from actors.pd_prefill import PrefillScheduler
from actors.pd_scheduler import DecodeScheduler, PDRequestError, WorkerBrokenError
from actors.rank import RankHost
from mem_cache.kv_events import KVEventBatch, PageHashSnapshot
from transfer.base import KVHandoff, check_compatible
from transfer.plan import expected_heads

logger = logging.getLogger(__name__)
CANCELLED_RIDS_KEPT = 65536  # aborted request ids a prefill worker remembers (refusing late arrivals)
ENDED_EARLY_KEPT = 4096  # decode: requests that ended before their stream() came, kept to tell it why
KV_EVENT_LOG_SIZE = 65536  # events a worker keeps for routers to pull; one further behind resyncs


class _Worker:
    role = "worker"

    def __init__(self, model_path: str, engine_args: Optional[Dict[str, Any]] = None, backend: str = "shm",
                 worker_id: Optional[str] = None, dist_init_method: Optional[str] = None,
                 agent_options: Optional[Dict[str, Dict[str, Any]]] = None):
        """``engine_args["tp_size"]`` × ``["pp_size"]`` > 1: this is rank 0; the followers (TPFollower
        actors) join the group at ``dist_init_method`` while this constructor waits.
        ``agent_options``: extra transfer-agent keywords per backend name."""
        self.worker_id = worker_id or f"{self.role}-{random.getrandbits(32):08x}"
        # workers publish KV events by default: the router's prefix index follows them (a decode
        # worker's tree holds the conversations it decoded, where their next turns fit best)
        engine_args = {"enable_kv_events": True, **(engine_args or {})}
        self.config = EngineConfig(model_path=model_path, **engine_args)
        error = prefill_speculative_error(self.config) if self.role == "prefill" else None
        if error:  # (before any rank starts)
            raise ValueError(error)
        self.rank = RankHost(self.role, self.config, backend, self.worker_id, 0, dist_init_method, agent_options)
        self.backends, self.agents, self.runner = self.rank.backends, self.rank.agents, self.rank.runner
        self.tp_worker = self.rank.tp_worker
        self.tokenizer = None
        if not self.config.skip_tokenizer_init:
            from transformers import AutoTokenizer

            path = self.config.tokenizer_path or model_path
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_token_ids = _eos_ids(model_path, self.runner.model_config)
        self.draining = False
        self.broken: Optional[str] = None  # why this worker can no longer serve (a TP rank died)

    def _make_req(self, sampling_params: Optional[Dict[str, Any]], rid: str, input_ids: List[int],
                  priority: int = 0, lora_path: Optional[str] = None,
                  mm_inputs: Optional[MultimodalInputs] = None) -> Req:
        """``mm_inputs``: an image request's images, M-RoPE positions and delta, as the tokenizer side made them
        (``MultimodalProcessor.process``, whose padded ids are ``input_ids``): both sides take them, the prefill
        worker encodes the images, the decode worker decodes at the delta (and re-prefills a retracted request),
        each on its own items (``MultimodalInputs.for_request``)."""
        params = SamplingParams(**(sampling_params or {}))
        if not input_ids:
            raise ValueError("the prompt is empty")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer (skip_tokenizer_init=True)")
        req = Req(rid, list(input_ids), params, self.eos_token_ids, priority=priority, lora_path=lora_path,
                  mm_inputs=None if mm_inputs is None else mm_inputs.for_request(input_ids))
        self.scheduler.check_request(req)  # never queued if it could never be admitted
        req.pd_error = None
        return req

    def _submit(self, req: Req):
        """Submit; returns an asyncio queue of ``(result, finished, error)`` per step."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        with_text = self.tokenizer is not None

        def on_output(r: Req, error: Optional[BaseException]) -> List[Post]:
            # ``finished`` before the error: a prefill's transfer thread may finish ``r`` meanwhile,
            # setting ``pd_error`` first; read the other way round a failed push looks like success
            finished = r.finished
            error = error or (PDRequestError(r.pd_error) if r.pd_error else None)
            posts = [Post(loop, queue.put_nowait, ((self._snapshot(r, with_text), finished, error),))]
            if finished:  # (the queue names the request, whose id may come again meanwhile)
                posts.append(Post(loop, self._finished, (r.rid, queue)))
            return posts

        self.loop.submit(req, on_output)
        return queue

    def _snapshot(self, req: Req, with_text: bool) -> Dict[str, Any]:
        return request_result(req, with_text, self.runner.weights.version)

    def _finished(self, rid: str, queue: asyncio.Queue) -> None:
        """On the actor's event loop, once the request ``rid`` whose outputs go to ``queue`` has ended."""

    # ---- health and stats -----------------------------------------------------------
    def health(self) -> Dict[str, Any]:
        self._raise_if_broken()
        return {"worker_id": self.worker_id, "role": self.role, "draining": self.draining, "time": time.time()}

    def _raise_if_broken(self) -> None:
        pusher = self.rank.pusher  # (a prefill worker's: a transfer lane whose thread kept dying)
        broken = self.broken or self.tp_worker.broken or (pusher.broken if pusher is not None else None)
        if broken:
            raise WorkerBrokenError(f"{self.worker_id} is broken: {broken}")

    async def watch_followers(self, followers: List[Any], interval_s: float = 1.0) -> str:
        """Runs (on the actor's event loop) until a TP follower rank is gone; from then on
        ``health()`` and ``load()`` fail, so heartbeats take this worker out of rotation."""
        while not self.broken:
            try:
                ranks = await asyncio.wait_for(asyncio.gather(*(f.alive.remote() for f in followers)),
                                               timeout=max(5.0, 5 * interval_s))
                if not all(ranks):
                    self.broken = "a TP follower's loop has stopped (or its KV transfer lane is broken)"
            except Exception as exc:  # the follower actor died or does not answer
                self.broken = f"a TP follower is gone ({type(exc).__name__})"
            if not self.broken:
                await asyncio.sleep(interval_s)
        logger.error("%s: %s", self.worker_id, self.broken)
        return self.broken

    def node_id(self) -> str:
        """The Ray node this worker runs on ("local" outside Ray)."""
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def load(self) -> Dict[str, Any]:
        """Queue lengths and KV usage for heartbeats, ``rids``: the id of every request this
        worker holds in any state, and ``rooms``: the bootstrap room (the attempt) of those that
        have one (the router drops a route whose attempt neither of its workers holds: its
        release was lost)."""
        self._raise_if_broken()
        sched = self.scheduler
        total = sched.total_tokens()
        held = self.loop.held_rooms()
        return {
            "worker_id": self.worker_id,
            "rids": list(held),
            "rooms": {rid: room for rid, room in held.items() if room is not None},
            "num_requests": len(held),  # (the autoscaler's ongoing requests: Ray Serve's queued + running)
            "waiting": len(sched.waiting),
            "running": len(sched.running),
            "free_slots": sched.available_tokens(),
            "total_slots": total,
            "kv_usage": 1.0 - sched.available_tokens() / total,
            "context_len": sched.context_len,
            **({"hicache": hicache_stats(sched.tree_cache)} if sched.host_tier else {}),
            **({"spec_decode": sched.spec_stats.as_dict()} if sched.speculative else {}),
        }

    def server_info(self) -> Dict[str, Any]:
        """The sizes this worker's engine chose at start (:func:`engine_server_info`: static, asked once
        per worker)."""
        return engine_server_info(self.scheduler)

    async def drain(self, timeout_s: float = 120.0) -> bool:
        """Refuse new requests; return once nothing is queued or running (True) or at the timeout."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.loop.run_exclusive(self.scheduler.has_work):
                return True
            await asyncio.sleep(0.02)
        return False

    # ---- sleep mode (actors.engine.memory_occupation) -----------------------------------------
    def _init_memory(self) -> None:
        """Once the loop is made: requests refused while asleep (under the loop's lock); each rank's
        transfer agents forget the old KV memory as it goes and comes (``RankHost.reset_agents``:
        a prefill rank its mappings of the decode pools, a decode rank its endpoint)."""
        self.memory = EngineMemory(self.loop, self.runner, self.tp_worker.call_followers)
        self.memory.rank.on_kv_moved = self.rank.reset_agents
        self.loop.check_admission = self.memory.check_serving

    async def release_memory_occupation(self, tags: Optional[List[str]] = None, keep_weights: bool = False) -> None:
        """Give back the memory of ``tags`` (None: all) on every TP rank, the weights kept in a CPU copy with
        ``keep_weights`` (vLLM's sleep level 1). NotIdleError (nothing released) while a request is held
        here, a KV transfer of its included; ValueError for an unknown tag. The whole cluster releases
        together (``cluster.backend.PDBackend``): a decode pool's old memory goes once no prefill rank
        maps it."""
        await asyncio.to_thread(self.memory.release, parse_tags(tags), keep_weights)

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """Allocate the memory of ``tags`` (None: all) anew on every TP rank; the KV cache starts empty (a
        decode worker's pools in new segments: its hand-offs carry the new endpoint)."""
        await asyncio.to_thread(self.memory.resume, parse_tags(tags))

    def is_sleeping(self) -> bool:
        return self.memory.is_sleeping

    # ---- KV events for the router's prefix index -------------------------------------------
    def _init_kv_log(self) -> None:
        self._kv_log: List[Any] = []  # drained events, ids increasing; bounded like the cache's own queue
        self.scheduler.tree_cache.events.max_pending = KV_EVENT_LOG_SIZE

    def _drain_kv_events(self) -> int:
        """Move the tree cache's new events into the log (loop paused); returns the newest event id."""
        events = self.scheduler.tree_cache.events
        self._kv_log.extend(events.take())
        if len(self._kv_log) > 2 * KV_EVENT_LOG_SIZE:
            del self._kv_log[: len(self._kv_log) - KV_EVENT_LOG_SIZE]
        return events.next_id

    async def kv_events(self, since_id: int = 0, max_events: int = 4096) -> KVEventBatch:
        """The tree cache's events after ``since_id``, oldest first, at most ``max_events``. A first id
        past ``since_id + 1``, or no events with ``last_id != since_id``, means the caller missed some."""
        def take() -> KVEventBatch:
            newest = self._drain_kv_events()
            start = bisect.bisect_right(self._kv_log, since_id, key=lambda e: e.event_id)
            batch = self._kv_log[start : start + max_events]
            return KVEventBatch(batch, batch[-1].event_id if batch else newest)

        return await asyncio.to_thread(self.loop.run_exclusive, take)

    async def cached_page_hashes(self) -> PageHashSnapshot:
        """Every page this worker's tree holds, one hash chain per node, as of event ``last_id``
        (what a restarted router rebuilds its index from)."""
        def snapshot() -> PageHashSnapshot:
            newest = self._drain_kv_events()
            cache = self.scheduler.tree_cache
            if not cache.events.enabled:
                return PageHashSnapshot([], newest, self.config.page_size, self.scheduler.reuse_rule())
            return PageHashSnapshot(cache.stored_page_hashes(), newest, self.config.page_size,
                                    self.scheduler.reuse_rule(), *cache.marked_page_hashes())

        return await asyncio.to_thread(self.loop.run_exclusive, snapshot)

    def pause_generation(self, mode: str = "in_place") -> None:
        """Hold the scheduler after its current step (requests stay queued); ``mode`` "retract": its
        running requests go back to waiting, their KV freed (:meth:`EngineLoop.pause`)."""
        self.loop.pause(retract=mode == "retract")

    def continue_generation(self) -> None:
        self.loop.resume()

    def check_integrity(self) -> None:
        """Idle worker: every slot free or cached, no row held, no lock left, and every
        TP follower's index tables equal rank 0's."""
        def check():
            check_engine_integrity(self.scheduler, self.runner)
            self.tp_worker.check_followers()

        self.loop.run_exclusive(check)

    def flush_cache(self) -> None:
        # the flush is chosen under the loop's lock, where a release of the KV cache cannot land in between
        self.loop.run_exclusive(lambda: self.memory.cache_flush(lambda: flush_engine_cache(self.scheduler, self.runner))())

    async def load_lora_adapter(self, lora_name: str, lora_path: str, cache_key: Optional[str] = None) -> None:
        """This worker (every TP rank) serves the adapter in ``lora_path`` as ``lora_name`` from now on,
        its requests' prefixes cached under ``cache_key`` (the backend's, the router's too) (on a
        thread: the actor's event loop delivers outputs meanwhile)."""
        await asyncio.to_thread(load_lora_adapter, self.loop, self.runner, self.tp_worker.call_followers,
                                lora_name, lora_path, cache_key)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Refuse new requests for adapter ``lora_name``; returns once those in flight have finished and it is gone."""
        await async_unload_lora_adapter(self.loop, self.runner, self.tp_worker.call_followers, lora_name)

    async def check_weights(self, model_path: WeightsSource, flush_cache: bool = True) -> None:
        """ValueError naming what differs when the checkpoint in ``model_path`` (or named tensors: on meta
        will do) cannot replace the weights this worker serves, on any of its TP ranks (nothing is
        loaded); RuntimeError when a paused update with ``flush_cache`` would be refused here
        (:func:`check_paused_flush`): the PD backend checks every worker before any applies it."""
        def check():
            self.memory.check_weights_update()
            check_paused_flush(self.loop, flush_cache)
            check_weights(self.runner, self.tp_worker.call_followers, model_path)

        self.loop.run_exclusive(check)

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       torch_empty_cache: bool = False) -> Dict[str, Any]:
        """SGLang's update on this worker, every TP rank (actors.engine.weight_updates): new requests
        wait, those in flight finish first (or are aborted); returns SGLang's result as a dict."""
        return await self._update_weights(UpdateWeightsRequest(model_path, weight_version, abort_all_requests,
                                                               flush_cache, torch_empty_cache))

    async def update_weights_from_tensor(self, named_tensors: Dict[str, Any],
                                         weight_version: Optional[str] = None, abort_all_requests: bool = False,
                                         flush_cache: bool = True, torch_empty_cache: bool = False) -> Dict[str, Any]:
        """:meth:`update_weights_from_disk` from named tensors (HF names, whole tensors, any subset of the
        served ones; SGLang's ``update_weights_from_tensor``): each TP rank copies its shard."""
        return await self._update_weights(UpdateWeightsRequest(named_tensors, weight_version, abort_all_requests,
                                                               flush_cache, torch_empty_cache))

    async def _update_weights(self, req: UpdateWeightsRequest) -> Dict[str, Any]:
        updater = WeightUpdater(self.loop, self.runner, self.tp_worker.call_followers,
                                lambda: flush_engine_cache(self.scheduler, self.runner),
                                lambda rid, room: self.abort(rid, ABORT_MESSAGE, room=room), self.memory)
        return (await updater.async_update(req))._asdict()

    def get_weight_version(self) -> str:
        return self.runner.weights.version

    def shutdown(self) -> None:
        """Stop the loop, release the followers (their loops return), free the pools."""
        self.loop.stop()
        try:
            self.scheduler.close()
        finally:
            self.tp_worker.shutdown()
            self.rank.close()


def hicache_stats(tree) -> Dict[str, float]:
    """What the hierarchical cache holds and has moved so far (cumulative counts). A sliding-window
    model's second host pool, its SWA layers' KV, apart (``swa_`` keys): its tokens are not the full
    pool's (a load brings the SWA KV of a window only)."""
    controller = tree.cache_controller
    host = controller.host_pool
    stats = {
        "host_usage": 1.0 - host.available_size() / host.size,
        "device_to_host_tokens": controller.written_tokens,
        "host_to_device_tokens": controller.loaded_tokens,
        "device_to_host_failed_tokens": controller.failed_written_tokens,
        "host_to_storage_pages": controller.stored_pages,
        "storage_to_host_pages": controller.prefetched_pages + controller.read_pages,
    }
    swa = getattr(tree, "swa_cache_controller", None)
    if swa is not None:
        stats.update(swa_host_usage=1.0 - swa.host_pool.available_size() / swa.host_pool.size,
                     swa_device_to_host_tokens=swa.written_tokens, swa_host_to_device_tokens=swa.loaded_tokens,
                     swa_host_to_storage_pages=swa.stored_pages,
                     swa_storage_to_host_pages=swa.prefetched_pages + swa.read_pages)
    return stats


class PrefillWorker(_Worker):
    """Matches, prefills, samples the first token, pushes the KV; never decodes."""

    role = "prefill"

    def __init__(self, model_path: str, engine_args: Optional[Dict[str, Any]] = None, backend: str = "shm",
                 worker_id: Optional[str] = None, dist_init_method: Optional[str] = None,
                 agent_options: Optional[Dict[str, Dict[str, Any]]] = None, waiting_timeout_s: Optional[float] = 300.0):
        """``waiting_timeout_s`` (``TransferConfig.waiting_timeout_s``, the decode side's wait for the
        KV): a prefilled request whose push some rank has not reported ended by then fails."""
        super().__init__(model_path, engine_args, backend, worker_id, dist_init_method, agent_options)
        self.scheduler = PrefillScheduler(self.runner, self.tokenizer, self.agents, self.rank.pusher, self.tp_worker,
                                          waiting_timeout_s)
        # aborted (rid, room) attempts, (rid, None): every attempt under the id
        self._cancelled: "collections.OrderedDict[Tuple[str, Optional[int]], None]" = collections.OrderedDict()
        self.loop = EngineLoop(self.scheduler)
        self.scheduler.enable_early_notice(self.loop.deliver_now)
        self._init_kv_log()
        self._init_memory()

    async def prefill(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                      handoffs: List[bytes], priority: int = 0, lora_path: Optional[str] = None,
                      mm_inputs: Optional[MultimodalInputs] = None) -> Dict[str, Any]:
        """Prefill and push; returns the completion notice the decode side needs. A broken worker
        (a TP rank gone, a transfer lane broken) raises ``WorkerBrokenError``, also for a request
        whose push failed on it: the worker's failure, not the request's (the client retries it)."""
        parsed = [KVHandoff.from_bytes(raw) for raw in handoffs]
        room = parsed[0].room if parsed else None  # the attempt: its decode reservation's room
        req = await self._make_prefill_req(rid, input_ids, sampling_params, priority, room, lora_path, mm_inputs)
        if req.sampling_params.max_new_tokens == 0:
            raise ValueError("max_new_tokens 0 (a prompt scored only) has no decode side: see prefill_only")
        for handoff in parsed:  # reject what cannot be served before any work is done
            agent = self.agents.get(handoff.backend)
            if agent is None:
                raise PDRequestError(f"hand-off over backend {handoff.backend!r}; this worker has {sorted(self.agents)}")
            check_compatible(agent.layout, handoff.layout)  # LayoutMismatchError names the difference
        if parsed:  # the decode worker (its rank 0's agent): the lane its pushes take
            req.pd_dest = f"{parsed[0].backend}/{parsed[0].endpoint.get('agent_id', '')}"
        req.pd_handoffs = list(handoffs)
        req.pd_expected = [(handoff.tp_rank, expected_heads(handoff)) for handoff in parsed]  # the write check's
        await self._run_to_end(req)
        return {
            "rid": rid,
            "room": room,  # the attempt: the decode side takes the notice for its reservation only
            "first_token": req.output_ids[0],
            "logprob": req.output_logprobs[0] if req.output_logprobs else None,
            "top_logprobs": req.output_top_logprobs[0] if req.output_top_logprobs else None,
            "first_finish": req.pd_first_finish,
            # the prompt's logprobs (return_logprob with logprob_start_len): only this side ran the prompt
            "input_token_logprobs": req.input_token_logprobs if req.input_logprob_start() is not None else None,
            "input_token_ranks": req.input_token_ranks,
            "input_top_logprobs": req.input_top_logprobs,
            # a seeded request's generator goes on where the first draw left it, so its samples equal
            # a single engine's
            "generator_state": (req.generator.get_state().cpu().numpy().tobytes()
                                if req.generator is not None else None),
            "cached_tokens": req.cached_tokens,
            "prompt_tokens": len(req.origin_input_ids),
            "transfer_time": getattr(req, "pd_transfer_time", None),
            "transfer_bytes": getattr(req, "pd_transfer_bytes", 0),
            "prefill_latency": req.finished_time - req.created_time,
        }

    async def prefill_only(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                           room: Optional[int] = None, priority: int = 0, lora_path: Optional[str] = None,
                           mm_inputs: Optional[MultimodalInputs] = None) -> Dict[str, Any]:
        """A prompt scored only (``max_new_tokens`` 0: prompt logprobs, say lm-evaluation-harness's
        loglikelihood): no decode worker takes part, so this worker prefills it, caches the prompt and
        ends it with finish ``length`` 0; returns its result as the engine does (``meta_info`` with
        ``input_token_logprobs``, ``cached_tokens``, ``prompt_tokens``...). ``room`` names the
        attempt, as a decode reservation's room does for :meth:`prefill` (aborts and load reports
        name it)."""
        req = await self._make_prefill_req(rid, input_ids, sampling_params, priority, room, lora_path, mm_inputs)
        if req.sampling_params.max_new_tokens != 0:
            raise ValueError(f"prefill_only serves max_new_tokens 0 only, not {req.sampling_params.max_new_tokens}")
        req.pd_handoffs = []
        return await self._run_to_end(req)

    async def _make_prefill_req(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                                priority: int, room: Optional[int], lora_path: Optional[str] = None,
                                mm_inputs: Optional[MultimodalInputs] = None) -> Req:
        """Attempt ``room`` of ``rid``, made; refused while draining or broken, or once aborted."""
        if self.draining:
            raise PDRequestError("prefill worker is draining")
        self._raise_if_broken()
        # (made first: an abort that comes while its grammar compiles is seen below, before it is submitted)
        req = await make_req_off_loop(self._make_req, sampling_params, rid, input_ids, priority, lora_path, mm_inputs)
        if (rid, None) in self._cancelled or (rid, room) in self._cancelled:
            raise PDRequestError(f"request {rid!r} was aborted before its prefill started")
        req.pd_room = room
        return req

    async def _run_to_end(self, req: Req) -> Dict[str, Any]:
        """Submit ``req`` and wait until it ends; returns its last result (its error raised)."""
        queue = self._submit(req)
        while True:
            result, finished, error = await queue.get()
            if error is not None:
                self._raise_if_broken()
                raise error
            if finished:
                return result

    def followers_pushed(self, rank: int, results: List[PushResult]) -> None:
        """TP follower ``rank``'s transfer thread: its share of these requests ended. The
        notice of one that every rank has pushed goes out now (on this thread), not after
        the forward the engine loop is running."""
        self.scheduler.on_pushed(rank, results)

    async def abort(self, rid: str, message: str = "aborted", room: Optional[int] = None) -> bool:
        """After this returns no rank of this worker will push ``rid``'s KV: it was never
        here, already pushed, or is dropped now — a chunk copy in progress on any rank is
        waited for, queued ones are dropped (a call arriving later is refused).
        ``room`` (its hand-offs' room) names the attempt: later calls are refused for
        that attempt only, so the client may send the id again with a new reservation.
        Without it every later call under ``rid`` is refused."""
        self._cancelled[(rid, room)] = None
        while len(self._cancelled) > CANCELLED_RIDS_KEPT:
            self._cancelled.popitem(last=False)
        return self.loop.abort(rid, room)

    def load(self) -> Dict[str, Any]:
        out = super().load()
        out["queued_prefill_tokens"] = sum(len(r.origin_input_ids) - len(r.prefix_indices) for r in self.scheduler.waiting)
        out["bytes_pushed"] = self.scheduler.bytes_pushed
        out["inflight"] = len(self.scheduler.inflight)
        return out


class DecodeWorker(_Worker):
    """Reserves slots for a prompt, receives its KV, decodes, streams tokens."""

    role = "decode"

    def __init__(self, model_path: str, engine_args: Optional[Dict[str, Any]] = None, backend: str = "shm",
                 worker_id: Optional[str] = None, dist_init_method: Optional[str] = None,
                 num_reserved_decode_tokens: int = 512, waiting_timeout_s: float = 300.0,
                 agent_options: Optional[Dict[str, Dict[str, Any]]] = None):
        super().__init__(model_path, engine_args, backend, worker_id, dist_init_method, agent_options)
        self.scheduler = DecodeScheduler(
            self.runner, self.tokenizer, self.agents, self.tp_worker, num_reserved_decode_tokens, waiting_timeout_s,
        )
        self.loop = EngineLoop(self.scheduler)
        self._init_kv_log()
        self._init_memory()
        self._queues: Dict[str, asyncio.Queue] = {}
        self._streaming: set = set()  # rids whose stream() is reading their queue
        # rid -> queue of a request that ended (failed transfer, timeout) before its stream() came
        self._ended_early: "collections.OrderedDict[str, asyncio.Queue]" = collections.OrderedDict()
        self._making = MakingReqs()  # by (rid, room): reservations whose grammar compiles off the loop

    async def reserve(self, rid: str, input_ids: List[int], sampling_params: Optional[Dict[str, Any]],
                      backend: Optional[str] = None, room: Optional[int] = None, priority: int = 0,
                      lora_path: Optional[str] = None, mm_inputs: Optional[MultimodalInputs] = None) -> List[bytes]:
        """Wait for a request row and KV slots; returns one hand-off per decode rank (``lora_path``:
        the adapter its decode runs under, the prefill side's: its KV is that adapter's).
        ``backend``: how the prefill peer reaches us (default: this worker's first).
        ``room`` names this attempt (SGLang's bootstrap room; default: a random one): the
        caller that picked it can abort this attempt and no other under the same id."""
        if self.draining:
            raise PDRequestError("decode worker is draining")
        self._raise_if_broken()  # (its TP group lost a rank: WorkerBrokenError, the client goes elsewhere)
        backend = backend or self.backends[0]
        if backend not in self.agents:
            raise PDRequestError(f"backend {backend!r} not served here; this worker has {sorted(self.agents)}")
        if room is not None and not (isinstance(room, int) and 0 <= room < 2**63):
            raise ValueError(f"room must be an integer in [0, 2**63), got {room!r}")
        room = random.getrandbits(63) if room is None else room
        key = (rid, room)
        self._making.begin(key)  # (an abort while its grammar compiles marks it: seen below, before it is submitted)
        try:
            req = await make_req_off_loop(self._make_req, sampling_params, rid, input_ids, priority, lora_path,
                                          mm_inputs)
        finally:
            aborted = self._making.end(key)
        if aborted:
            raise PDRequestError(f"request {rid!r} was aborted before its reservation was made")
        req.pd_room, req.pd_backend = room, backend
        queue = self._submit(req)
        self._queues[rid] = queue
        try:
            result, finished, error = await queue.get()
        except asyncio.CancelledError:  # the caller gave up while we waited for room
            await self.abort(rid, "the caller cancelled the reservation", safe=True, room=req.pd_room)
            raise
        if error is not None:
            self._queues.pop(rid, None)
            raise error
        return result["handoffs"]

    def _snapshot(self, req: Req, with_text: bool) -> Dict[str, Any]:
        out = super()._snapshot(req, with_text)
        if getattr(req, "pd_state", None) == "transfer":
            out["handoffs"] = req.pd_handoffs
        return out

    def _finished(self, rid: str, queue: asyncio.Queue) -> None:
        if rid in self._streaming or self._queues.get(rid) is not queue:
            return  # its stream() reads it, or it is gone (a new request may have the id now)
        del self._queues[rid]  # ended before its stream() came: keep its last word for it
        self._ended_early[rid] = queue
        while len(self._ended_early) > ENDED_EARLY_KEPT:
            self._ended_early.popitem(last=False)

    @staticmethod
    def _ended_error(rid: str, error: Optional[BaseException], what: str) -> PDRequestError:
        if isinstance(error, PDRequestError):
            return error
        return PDRequestError(f"request {rid!r} {what}{f': {error}' if error else ''}")

    async def stream(self, rid: str, notice: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        """Deliver the prefill side's notice, then yield results until the request ends.
        A request that already ended (its transfer failed or timed out) raises why."""
        room, live = notice.get("room"), self.loop.run_exclusive(lambda: self.scheduler.live_room(rid))
        if None not in (room, live) and room != live:  # a stale notice: the request under the id now is not its
            raise PDRequestError(f"the notice for {rid!r} is from another attempt than the one reserved here")
        queue = self._queues.get(rid)
        if queue is None:
            ended, error = self._ended_early.pop(rid, None), None
            while ended is not None and not ended.empty():
                error = ended.get_nowait()[2] or error
            raise self._ended_error(rid, error, "has no reservation on this decode worker (never made, timed out "
                                               "or aborted)")
        if not self.loop.run_exclusive(lambda: self.scheduler.on_transfer_done(rid, notice)):
            # it ended in the scheduler just now: its last output, with the reason, is on its way
            error = None
            try:
                while True:
                    _, done, step_error = await asyncio.wait_for(queue.get(), timeout=5.0)
                    error = step_error or error
                    if done:
                        break
            except asyncio.TimeoutError:
                pass
            self._queues.pop(rid, None)
            self._ended_early.pop(rid, None)
            raise self._ended_error(rid, error, "is no longer waiting for its KV (timed out or aborted)")
        finished = False
        self._streaming.add(rid)
        try:
            while not finished:
                result, finished, error = await queue.get()
                if error is not None:
                    raise error
                yield result
        finally:
            self._streaming.discard(rid)
            if self._queues.get(rid) is queue:  # (a new request with this id may have reserved already)
                del self._queues[rid]
            if not finished:  # the consumer went away: stop decoding for nobody (this attempt: the id may be
                # in use again by now); after the notice no prefill rank writes its slots
                self.loop.abort(rid, "the client went away", True, notice.get("room"))

    def backends_used(self) -> Dict[str, int]:
        """Completed transfers per backend."""
        return dict(self.scheduler.backend_counts)

    async def abort(self, rid: str, message: str = "aborted", safe: bool = False, room: Optional[int] = None) -> bool:
        """End ``rid`` here. ``safe``: the prefill side confirmed it will not push (or is
        dead), so reserved slots go back at once; otherwise they wait out the hand-off's deadline.
        ``room``: only the attempt reserved with that room — a late abort of an earlier
        attempt, or of a refused duplicate, leaves the request now under the id alone.
        The request's last word (the abort) goes to whoever waits on it, as any ending does."""
        self._making.mark(lambda key: key[0] == rid and room in (None, key[1]))
        return self.loop.abort(rid, message, safe, room)

    def load(self) -> Dict[str, Any]:
        out = super().load()
        out["prealloc"] = len(self.scheduler.prealloc)
        out["transfer"] = len(self.scheduler.transfer)
        out["retractions"] = self.scheduler.num_retractions
        out["preemptions"] = self.scheduler.num_preemptions
        return out
