"""What the HTTP server needs from the cluster, as one small interface.

:class:`ServingBackend` is the whole contract of ``cluster.server``: run a
request (``generate_stream``, cumulative results as ``PDClient`` yields them,
raising ``PDRequestError`` on a worker failure and ``ValueError`` on a request
the workers refuse), list / add / remove workers, health, flush, drain, load and
unload LoRA adapters, update the weights from disk or tensors, pause and continue generation, release
and resume the workers' memory (sleep mode).
:class:`PDBackend` implements it over a ``PDCluster`` (worker management
included) or a bare ``PDClient`` (whatever routes its requests: round-robin
today, the router actor later — the server does not care).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from contextlib import aclosing
from typing import Any, AsyncIterator, Dict, List, Optional, Protocol

from actors.engine.lora import lora_cache_key
from actors.engine.memory_occupation import MemoryState, NotIdleError, parse_tags
from actors.engine.model_loader import DEFAULT_WEIGHT_VERSION, get_context_length, load_config
from actors.engine.multimodal import MultimodalInputs
from actors.engine.weight_updates import (DRAIN_POLL_S, SUCCESS, UpdateWeightsRequest, named_tensors_source,
                                          on_meta)
from actors.pd_scheduler import PDRequestError

logger = logging.getLogger(__name__)


class ServingBackend(Protocol):
    model_name: str
    context_len: int  # the longest request, prompt + output
    max_prompt_len: int  # the longest prompt (a prefill worker's pool may hold less than context_len)
    vocab_size: Optional[int]  # token ids are 0..vocab_size - 1 (None: unknown here; the workers check)
    priority_scheduling: bool  # the workers order requests by priority (else one with a priority is refused)
    lora_modules: Dict[str, str]  # the LoRA adapters the workers serve: name -> adapter directory
    weight_version: str  # SGLang's: the last weights update's ("default" before any)
    model_path: Optional[str]  # the checkpoint served (the last weights update's); None: unknown here
    # the workers' EngineConfig.limit_mm_per_prompt (the server's tokenizer side refuses more images with a 400)
    limit_mm_per_prompt: Optional[Dict[str, int]]
    starting: Dict[str, int]  # by role: the workers add_worker is starting, not in the rotation yet

    @property
    def draining(self) -> bool: ...

    def generate_stream(self, input_ids: List[int], sampling_params: Dict[str, Any], rid: str,
                        priority: int = 0, lora_path: Optional[str] = None,
                        mm_inputs: Optional[MultimodalInputs] = None) -> AsyncIterator[Dict[str, Any]]:
        """A stream closed (or cancelled) before its last result stops the request on its workers:
        a client gone, an abort. A request sent while the weights are updated waits for the update's
        end (admitted, in the server's requests: an abort ends it). ``mm_inputs``: an image request's
        (``input_ids`` its padded prompt), for both workers."""

    def routing_policy(self, role: str) -> str: ...

    def workers(self, include_dead: bool = False) -> List[Dict[str, Any]]:
        """id, role, node, alive, inflight, load (the last heartbeat's stats), the sizes its engine
        chose (``actors.engine.engine.engine_server_info``'s keys) once asked, and a speculating
        worker's ``avg_spec_accept_length`` (:func:`spec_accept_length`)."""

    async def refresh_loads(self) -> None:
        """The workers' loads asked anew, and the sizes of any worker whose engine was not asked yet."""

    async def health(self) -> Dict[str, Any]: ...

    async def flush_cache(self) -> None: ...

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None: ...

    async def unload_lora_adapter(self, lora_name: str) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       torch_empty_cache: bool = False) -> Dict[str, Any]: ...

    async def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None,
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         weight_version: Optional[str] = None,
                                         torch_empty_cache: bool = False) -> Dict[str, Any]: ...

    async def pause_generation(self, mode: str) -> None:
        """SGLang's modes "in_place" and "retract" on every worker, or on none (RuntimeError naming the
        worker that failed it; paused already, the workers stay paused: see :meth:`PDBackend.pause_generation`)."""

    async def continue_generation(self) -> None: ...

    @property
    def is_sleeping(self) -> bool:
        """Whether any part of the workers' memory is released (requests are refused: a 503)."""

    async def release_memory_occupation(self, tags: Optional[List[str]] = None, keep_weights: bool = False) -> None:
        """Sleep mode on every worker or on none: NotIdleError where one holds a request, RuntimeError
        naming the worker that failed otherwise (see :meth:`PDBackend.release_memory_occupation`)."""

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None: ...

    async def add_worker(self, role: str) -> Dict[str, Any]: ...

    async def remove_worker(self, worker_id: str, drain_timeout_s: float = 120.0) -> Dict[str, Any]:
        """Out of the rotation; its accepted requests get ``drain_timeout_s`` to finish, then it stops."""

    async def drain(self, timeout_s: float) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


class UnknownWorkerError(KeyError):
    """No worker with that id."""


class WorkerNotAddedError(RuntimeError):
    """A worker the cluster's state refuses to add (HTTP: 409), before it starts or, the state reached
    while it started, once it is up (it is stopped): ``code`` says why, ``sleeping`` (memory released)
    or ``weights_from_tensors`` (no checkpoint holds the weights served)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def model_context_len(model_path: str, configured: Optional[int] = None) -> int:
    """The context length the workers enforce: the engine's ``context_length`` or the
    checkpoint's, as their runners derive it (:func:`~actors.engine.model_loader.get_context_length`)."""
    return configured or get_context_length(load_config(model_path))


def model_vocab_size(model_path: str) -> Optional[int]:
    """The checkpoint's ``vocab_size`` (its text model's, for a composite config); None if it has none."""
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def spec_accept_length(load: Dict[str, Any]) -> Dict[str, float]:
    """SGLang's ``avg_spec_accept_length`` of a worker's ``internal_states`` entry: the tokens a verify
    step commits per request with a draft, its bonus token included, since the worker started. From
    its last load report (it moves as the worker decodes: not one of the sizes asked once); none
    before its first verify step (as SGLang's)."""
    spec = load.get("spec_decode")
    return {"avg_spec_accept_length": spec["mean_accepted_len"]} if spec and spec["num_drafts"] else {}


class PDBackend:
    """``ServingBackend`` over a ``PDCluster`` and the ``PDClient`` that routes its requests."""

    def __init__(self, client, cluster=None, model_name: str = "default", context_len: int = 4096,
                 health_timeout_s: float = 5.0, max_prompt_len: Optional[int] = None,
                 vocab_size: Optional[int] = None, priority_scheduling: bool = False,
                 lora_modules: Optional[Dict[str, str]] = None,
                 limit_mm_per_prompt: Optional[Dict[str, int]] = None):
        self.client, self.cluster = client, cluster
        self.limit_mm_per_prompt = limit_mm_per_prompt
        self.model_name, self.context_len, self.vocab_size = model_name, context_len, vocab_size
        self.max_prompt_len = context_len - 1 if max_prompt_len is None else min(max_prompt_len, context_len - 1)
        self.health_timeout_s, self.priority_scheduling = health_timeout_s, priority_scheduling
        self.lora_modules = dict(lora_modules or {})
        self.runtime_loras: Dict[str, str] = {}  # the adapters loaded since start (a new worker loads them too)
        self.lora_loads = dict.fromkeys(self.lora_modules, 1)  # by name, the loads so far (the next one's cache key)
        self._lora_lock = asyncio.Lock()  # one load or unload at a time (SGLang's lora_update_lock)
        self.weight_version = DEFAULT_WEIGHT_VERSION  # the workers' (SGLang's; "default" before any update)
        self.weights_update: Optional[UpdateWeightsRequest] = None  # the last that succeeded: a new worker's too
        self.weights_from_tensors = False  # an update from tensors since the last from disk (no checkpoint holds them)
        self._weights_lock = asyncio.Lock()  # one weight update at a time
        self._serving = asyncio.Event()  # clear while a weights update waits and applies: new requests wait
        self._serving.set()
        self._num_streams = 0  # the requests past that gate, not yet ended
        self.owned_router = None
        self.model_path = getattr(cluster, "model_path", None)
        self.paused_mode: Optional[str] = None  # pause_generation's, until continue_generation
        self.engine_info: Dict[str, Dict[str, Any]] = {}  # by worker id: its engine's sizes (static: asked once)
        self.memory = MemoryState()  # sleep mode: what every worker has released
        self.starting: Dict[str, int] = Counter()  # by role: starts under way (the autoscaler counts them)

    @classmethod
    def from_cluster(cls, cluster, tokenizer=None, client=None, use_router: bool = True) -> "PDBackend":
        """``client``: one already made (``cluster.client(router=...)``); otherwise a new one, routed by a
        router actor of the cluster's ``router`` config when the cluster can start one."""
        router = None
        if client is None:
            router = cluster.start_router() if use_router and hasattr(cluster, "start_router") else None
            client = cluster.client(tokenizer, router=router) if router is not None else cluster.client(tokenizer)
        cfg = cluster.config
        context_len = model_context_len(cluster.model_path, getattr(cfg.decode.engine, "context_length", None))
        max_prompt_len = None
        if hasattr(cluster, "context_len"):  # what the workers' pools hold for one request (prefill: its prompt)
            context_len, max_prompt_len = min(context_len, cluster.context_len()), cluster.max_prompt_len()
        backend = cls(client, cluster, cfg.model.name, context_len, max_prompt_len=max_prompt_len,
                      vocab_size=model_vocab_size(cluster.model_path),
                      priority_scheduling=getattr(cfg.decode.engine, "enable_priority_scheduling", False),
                      lora_modules=getattr(cfg.decode.engine, "lora_paths", None),
                      limit_mm_per_prompt=getattr(cfg.prefill.engine, "limit_mm_per_prompt", None))
        backend.owned_router = router
        return backend

    # ---- requests ---------------------------------------------------------------------
    @property
    def draining(self) -> bool:
        return bool(self.client.draining)

    async def generate_stream(self, input_ids, sampling_params, rid, priority=0, lora_path=None, mm_inputs=None):
        """The client's stream, once no weights update is under way (SGLang's model_update_lock, read
        side): a request runs on one checkpoint, its prefill's and its decode's (see
        :meth:`update_weights_from_disk`)."""
        await self._serving.wait()
        self.memory.check_serving()  # (SleepingError: nothing could run it)
        self._num_streams += 1
        try:
            async with aclosing(self.client.generate_stream(input_ids, sampling_params, rid, priority,
                                                            lora_path, mm_inputs)) as results:
                async for result in results:
                    yield result
        finally:
            self._num_streams -= 1

    @property
    def num_retries(self) -> int:
        """Requests the client sent to a new pair after a worker of theirs died (its running total)."""
        return getattr(self.client, "num_retries", 0)

    def routing_policy(self, role: str) -> str:
        """The policy that picks ``role`` workers: the router's when the client has one."""
        router = getattr(self.client, "router", None)
        if router is None or self.cluster is None:
            return "round_robin"
        return getattr(self.cluster.config.router, f"{role}_policy")

    async def drain(self, timeout_s: float = 120.0) -> None:
        await self.client.drain(timeout_s)

    def start(self) -> None:
        self.client.start_heartbeats()

    def stop(self) -> None:
        self.client.stop_heartbeats()
        if self.owned_router is not None:  # started for this backend: it goes with it
            import ray

            ray.kill(self.owned_router)
            self.owned_router = None

    async def _tell_router(self, method: str, *args) -> None:
        router = getattr(self.client, "router", None)
        if router is not None:
            from actors.router import call_method

            await call_method(router, method, *args)

    # ---- workers ----------------------------------------------------------------------
    def _all(self):
        return list(self.client.prefill) + list(self.client.decode)

    def workers(self, include_dead: bool = False) -> List[Dict[str, Any]]:
        """Workers in the rotation (and those that left it by dying, with ``include_dead``): id, role,
        node, alive, load (the last heartbeat's stats), the sizes its engine chose once asked
        (:meth:`refresh_loads`), and a speculating worker's ``avg_spec_accept_length``."""
        return [{**self.engine_info.get(w.worker_id, {}), **spec_accept_length(w.stats), "id": w.worker_id,
                 "role": w.role, "node": w.node_id, "alive": w.alive, "inflight": w.inflight, "load": dict(w.stats)}
                for w in self._all() if w.alive or include_dead]

    async def refresh_loads(self) -> None:
        await self.client.heartbeat_once()
        await self._ask_engine_info()

    async def _ask_engine_info(self) -> None:
        """Each live worker's ``server_info`` (its engine's sizes), asked once: they never change while it
        runs (a sleep or a weight update keeps them). A worker that left drops its entry; one that does
        not answer is asked again next time."""
        workers = self._all()
        ids = {w.worker_id for w in workers}
        for worker_id in [i for i in self.engine_info if i not in ids]:
            del self.engine_info[worker_id]
        new = [w for w in workers if w.alive and w.worker_id not in self.engine_info]
        results = await asyncio.gather(*(w.handle.server_info.remote() for w in new), return_exceptions=True)
        self.engine_info.update((w.worker_id, r) for w, r in zip(new, results) if not isinstance(r, BaseException))

    async def health(self) -> Dict[str, Any]:
        """Ready when every worker in the rotation answers, with at least one per role, and not draining."""
        live = [w for w in self._all() if w.alive]

        async def ping(w) -> bool:
            try:
                await asyncio.wait_for(w.handle.health.remote(), timeout=self.health_timeout_s)
                return True
            except Exception:  # dead or hung: not ready
                return False

        answers = await asyncio.gather(*(ping(w) for w in live))
        status = {w.worker_id: ok for w, ok in zip(live, answers)}
        roles = {w.role for w in live}
        ready = all(answers) and roles == {"prefill", "decode"} and not self.draining
        return {"ready": ready, "draining": self.draining, "workers": status}

    async def flush_cache(self) -> None:
        live = [w for w in self._all() if w.alive]
        try:
            await asyncio.gather(*(w.handle.flush_cache.remote() for w in live))
        except Exception as exc:  # a busy engine refuses to flush
            raise RuntimeError(f"cache not flushed: {getattr(exc, 'cause', None) or exc}") from None

    async def pause_generation(self, mode: str) -> None:
        """SGLang's pause on every live worker, each after its step in progress: "in_place" keeps its
        requests as they are, KV and all; "retract" sends its running requests back to waiting, their
        KV freed (re-prefilled on the decode worker once it steps again); a request whose KV is on its
        way is left as it is. The client waits for a paused request's next output as for any (the
        transfer's ``waiting_timeout_s``): a longer pause fails it. (SGLang's "abort" is the server's:
        it aborts the requests it serves.) All or nothing: a worker failing it, those it paused step
        again (RuntimeError naming the worker and why): a cluster half paused would hold the requests
        routed to one side while the other side runs, and the server, not paused, would send more.
        Paused already, a failed pause leaves the cluster paused as it was: continuing its workers
        would undo the earlier pause, which the server still holds."""
        was, self.paused_mode = self.paused_mode, mode  # (a worker added meanwhile is paused too)
        live = [w for w in self._all() if w.alive]
        results = await asyncio.gather(*(w.handle.pause_generation.remote(mode) for w in live),
                                       return_exceptions=True)
        failed = _failures(live, results)
        if not failed:
            return
        self.paused_mode = was
        if was is not None:
            raise RuntimeError(f"generation paused as before ({was}): {'; '.join(failed)}")
        await asyncio.gather(*(w.handle.continue_generation.remote() for w, r in zip(live, results)
                               if not isinstance(r, BaseException)), return_exceptions=True)
        raise RuntimeError(f"generation not paused (the workers paused step again): {'; '.join(failed)}")

    async def continue_generation(self) -> None:
        self.paused_mode = None
        live = [w for w in self._all() if w.alive]
        await asyncio.gather(*(w.handle.continue_generation.remote() for w in live))

    # ---- sleep mode (actors.engine.memory_occupation) ------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.memory.is_sleeping

    async def release_memory_occupation(self, tags: Optional[List[str]] = None, keep_weights: bool = False) -> None:
        """SGLang's release (vLLM's sleep: every tag, ``keep_weights`` at level 1) on every live worker,
        prefill and decode, each on all its TP ranks, the parts of ``tags`` not released yet. The whole
        cluster goes together: a decode pool's memory is free only once no prefill rank maps it, and a
        request needs both sides. All or nothing, as a pause: a worker failing it, those that released
        resume (NotIdleError where a worker holds a request, the release needing an idle cluster; else
        RuntimeError; both naming the worker). Requests are refused meanwhile (:meth:`generate_stream`:
        SleepingError), as vLLM's server answers 503 while asleep; SGLang's holds nothing either. The
        router re-indexes every worker after it (their caches were dropped, as after a weights update's
        flush). ValueError for an unknown tag."""
        async with self._weights_lock:  # (no weights update in between)
            parts = parse_tags(tags) - self.memory.released
            if not parts:
                return
            live = [w for w in self._all() if w.alive]
            results = await asyncio.gather(*(w.handle.release_memory_occupation.remote(sorted(parts), keep_weights)
                                             for w in live), return_exceptions=True)
            failed = _failures(live, results)
            if failed:
                await asyncio.gather(*(w.handle.resume_memory_occupation.remote(sorted(parts))
                                       for w, r in zip(live, results) if not isinstance(r, BaseException)),
                                     return_exceptions=True)
                busy = any(isinstance(getattr(r, "cause", r), NotIdleError) for r in results)
                raise (NotIdleError if busy else RuntimeError)(f"memory not released (the workers that released "
                                                               f"resumed): {'; '.join(failed)}")
            self.memory.mark_released(parts, keep_weights)
            await self._tell_router("rebuild_from_workers")

    async def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """The parts of ``tags`` (None: all) allocated anew on every live worker (a decode worker's pools in
        new segments, which the prefill workers map at their next push); RuntimeError naming the workers
        that failed (those parts stay released: call again). ValueError for an unknown tag."""
        async with self._weights_lock:
            parts = self.memory.parts_to_resume(parse_tags(tags))
            live = [w for w in self._all() if w.alive]
            results = await asyncio.gather(*(w.handle.resume_memory_occupation.remote(sorted(parts)) for w in live),
                                           return_exceptions=True)
            if _failures(live, results):
                raise RuntimeError(f"memory not resumed on {'; '.join(_failures(live, results))}")
            self.memory.released -= parts

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Every live worker — prefill and decode, each on all its TP ranks — serves the adapter from now
        on, then ``lora_modules`` lists it; on none when one refuses it (ValueError: why). The load's
        cache key (the name, ``name#k`` at the k-th reload) is counted here and given to every
        worker, and the client routes the adapter's requests under it, so the router's prefix index
        hashes them as the workers' radix caches do (a worker added later has loaded the name fewer
        times)."""
        async with self._lora_lock:
            live = [w for w in self._all() if w.alive]
            loads = self.lora_loads.get(lora_name, 0)
            self.lora_loads[lora_name] = loads + 1  # (counted if refused too: no key is given twice)
            cache_key = lora_cache_key(lora_name, loads)
            results = await asyncio.gather(*(w.handle.load_lora_adapter.remote(lora_name, lora_path, cache_key)
                                             for w in live), return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:  # (those that took it drop it again)
                await asyncio.gather(*(w.handle.unload_lora_adapter.remote(lora_name) for w, r in zip(live, results)
                                       if not isinstance(r, BaseException)), return_exceptions=True)
                raise ValueError(str(getattr(failed[0], "cause", None) or failed[0])) from None
            self.lora_modules[lora_name] = self.runtime_loras[lora_name] = lora_path
            self.client.lora_cache_keys[lora_name] = cache_key

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """``lora_modules`` drops the adapter at once (a request naming it is refused), then every live
        worker unloads it once its requests in flight under it have finished."""
        async with self._lora_lock:
            self.lora_modules.pop(lora_name, None)
            self.runtime_loras.pop(lora_name, None)
            self.client.lora_cache_keys.pop(lora_name, None)
            live = [w for w in self._all() if w.alive]
            results = await asyncio.gather(*(w.handle.unload_lora_adapter.remote(lora_name) for w in live),
                                           return_exceptions=True)
            failed = [f"{w.worker_id}: {getattr(r, 'cause', None) or r}" for w, r in zip(live, results)
                      if isinstance(r, BaseException)]
            if failed:
                raise RuntimeError(f"LoRA adapter {lora_name!r} not unloaded on {'; '.join(failed)}")

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                       abort_all_requests: bool = False, flush_cache: bool = True,
                                       torch_empty_cache: bool = False) -> Dict[str, Any]:
        """SGLang's update on every live worker, prefill and decode, each on all its TP ranks: first
        checked everywhere (ValueError naming the worker and what differs, or that a paused request's
        KV cannot be flushed there: no weight touched), then applied on all at once, cluster-wide as
        SGLang's tokenizer manager does it (its model_update_lock): new requests wait in
        :meth:`generate_stream` until every worker has applied it (or it failed), and those in flight
        end first, on the old weights on both sides. The workers' own holding is not enough: a
        prefill worker done with its own requests would run a request's prefill on the new weights
        while its decode worker, still draining, decodes it on the old ones. With
        ``abort_all_requests`` nothing is waited for: each worker aborts the requests it holds (a
        request reserved on the decode side is aborted there, whatever its prefill does). A paused
        cluster is updated at once (SGLang's: its requests resume on the new weights).
        A worker that fails after every check passed leaves the cluster on mixed weights: RuntimeError
        naming each worker's version. Then the router re-indexes every worker (their caches were
        flushed: it would route by prefixes they no longer hold). Returns SGLang's result."""
        req = UpdateWeightsRequest(model_path, weight_version, abort_all_requests, flush_cache, torch_empty_cache)
        async with self._weights_lock:
            result = await self._update_weights(req, "update_weights_from_disk", model_path)
            self.model_path = model_path  # (SGLang's server_args.model_path follows it too)
            self.weights_update = req._replace(weight_version=self.weight_version, abort_all_requests=False)
            self.weights_from_tensors = False
            return result

    async def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None,
                                         flush_cache: bool = True, abort_all_requests: bool = False,
                                         weight_version: Optional[str] = None,
                                         torch_empty_cache: bool = False) -> Dict[str, Any]:
        """SGLang's update from tensors ((HF name, whole tensor) pairs, any subset of the served ones) on
        every live worker, as :meth:`update_weights_from_disk`: checked on all first (they are sent the
        tensors' shapes alone, on meta), then applied on all under the same cluster-wide gate. The
        tensors go into Ray's object store once and every worker reads them from there: the update's
        size in the store while it runs and a copy in each worker's process (each rank then copies its
        shard), fine for what an RL trainer pushes at a time. No checkpoint holds the weights served
        after it: a worker added later could not serve them, so :meth:`add_worker` is refused until an
        update from disk."""
        source = named_tensors_source(named_tensors, load_format)
        stored = await asyncio.to_thread(_put, {name: t.cpu() for name, t in source.items()})
        req = UpdateWeightsRequest(stored, weight_version, abort_all_requests, flush_cache, torch_empty_cache)
        async with self._weights_lock:
            result = await self._update_weights(req, "update_weights_from_tensor", on_meta(source))
            self.weights_update, self.weights_from_tensors = None, True
            return result

    async def _update_weights(self, req: UpdateWeightsRequest, apply: str, check: Any) -> Dict[str, Any]:
        """(the weights lock held) ``req`` checked on every live worker (``check``: what their
        ``check_weights`` reads), then applied on all by their method ``apply``."""
        live = [w for w in self._all() if w.alive]
        results = await asyncio.gather(*(w.handle.check_weights.remote(check, req.flush_cache) for w in live),
                                       return_exceptions=True)
        if _failures(live, results):
            raise ValueError("; ".join(_failures(live, results)))
        self._serving.clear()
        drain = not (req.abort_all_requests or self.paused_mode)  # (a pause meanwhile: they wait for continue)
        try:
            while drain and self._num_streams:
                await asyncio.sleep(DRAIN_POLL_S)
            results = await asyncio.gather(*(getattr(w.handle, apply).remote(*req) for w in live),
                                           return_exceptions=True)
        finally:
            self._serving.set()
        if _failures(live, results):
            versions = await asyncio.gather(*(w.handle.get_weight_version.remote() for w in live),
                                            return_exceptions=True)
            now = ", ".join(f"{w.worker_id}={v if isinstance(v, str) else '?'}" for w, v in zip(live, versions))
            raise RuntimeError(f"weights update failed on {'; '.join(_failures(live, results))}; "
                               f"the workers' weight versions now: {now}")
        self.memory.weights_discarded = False
        if req.weight_version is not None:
            self.weight_version = req.weight_version
        if req.flush_cache:
            await self._tell_router("rebuild_from_workers")
        return {"success": True, "message": SUCCESS,
                "num_paused_requests": sum(r["num_paused_requests"] for r in results)}

    def _refused_worker(self) -> Optional[WorkerNotAddedError]:
        """Why the cluster's state refuses a new worker (None: it takes one)."""
        if self.memory.is_sleeping:
            return WorkerNotAddedError("the workers are sleeping (memory released): wake them up before adding one",
                                       "sleeping")
        if self.weights_from_tensors:
            return WorkerNotAddedError("the workers serve weights updated from tensors, which no checkpoint holds: "
                                       "a new worker could not serve them (update the weights from disk first)",
                                       "weights_from_tensors")
        return None

    async def add_worker(self, role: str) -> Dict[str, Any]:
        if self.cluster is None:
            raise NotImplementedError("this server was given a client, not a cluster: it cannot start workers")
        refused = self._refused_worker()
        if refused is not None:
            raise refused
        self.starting[role] += 1  # (a manual start and the autoscaler's see each other: no side past max_workers)
        try:
            worker = await asyncio.to_thread(self.cluster.add_worker, role)
        finally:  # up, it is in its side's list, counted there
            self.starting[role] -= 1
        async with self._weights_lock:  # (it started on the config's checkpoint)
            # a release or an update from tensors that ran while it started missed it: it goes
            refused = self._refused_worker()
            if refused is None and self.weights_update is not None:
                await worker.handle.update_weights_from_disk.remote(*self.weights_update)
        if refused is not None:
            await asyncio.to_thread(self.cluster.remove_worker, worker.worker_id)
            raise refused
        async with self._lora_lock:  # (those of the config it loaded at start)
            for name, path in self.runtime_loras.items():
                await worker.handle.load_lora_adapter.remote(name, path, self.client.lora_cache_keys.get(name))
        if self.paused_mode is not None:
            await worker.handle.pause_generation.remote(self.paused_mode)
        await self._tell_router("add_worker", worker.worker_id, worker.role, worker.handle, worker.node_id)
        return {"id": worker.worker_id, "role": worker.role, "node": worker.node_id, "alive": worker.alive}

    async def remove_worker(self, worker_id: str, drain_timeout_s: float = 120.0) -> Dict[str, Any]:
        if self.cluster is None:
            raise NotImplementedError("this server was given a client, not a cluster: it cannot stop workers")
        if not any(w.worker_id == worker_id for w in self._all()):
            raise UnknownWorkerError(worker_id)
        # no new requests, but its routes stay while it drains: their ids are still in flight there
        await self._tell_router("drain_worker", worker_id)
        try:
            worker = await asyncio.to_thread(self.cluster.remove_worker, worker_id, drain_timeout_s)
        except UnknownWorkerError:  # removed (or being removed) by another call meanwhile
            raise UnknownWorkerError(worker_id) from None
        try:  # drained and stopped: the router forgets it
            await self._tell_router("remove_worker", worker_id)
        except Exception as exc:  # (its heartbeat finds the actor gone and ends its routes all the same)
            logger.warning("router: removing %s failed: %r", worker_id, exc)
        return {"id": worker.worker_id, "role": worker.role, "removed": True}


LOADS_REFRESH_TIMEOUT_S = 2.0


async def refresh_loads_briefly(backend: ServingBackend) -> None:
    """The workers' loads asked anew for at most :data:`LOADS_REFRESH_TIMEOUT_S`; past it the last
    heartbeats' stand (a /metrics scrape or /get_server_info must not hang on a slow worker)."""
    try:
        await asyncio.wait_for(backend.refresh_loads(), timeout=LOADS_REFRESH_TIMEOUT_S)
    except asyncio.TimeoutError:
        pass


def _put(obj: Any) -> Any:
    """``obj`` in Ray's object store, once (its ref, passed to many workers' calls, is read by each
    from there); as it is without Ray (in-process workers)."""
    import ray

    return ray.put(obj) if ray.is_initialized() else obj


def _failures(workers, results) -> List[str]:
    """'<worker id>: <why>' of each worker whose result is an error (a Ray task error's cause)."""
    return [f"{w.worker_id}: {getattr(r, 'cause', None) or r}" for w, r in zip(workers, results)
            if isinstance(r, BaseException)]


def as_backend(target, tokenizer=None, client=None) -> ServingBackend:
    """A ``PDCluster`` (with ``client``, or a new one), a ``PDClient`` or a ready ``ServingBackend``."""
    if hasattr(target, "generate_stream") and hasattr(target, "workers") and callable(target.workers):
        return target
    if hasattr(target, "client") and hasattr(target, "config"):  # a PDCluster
        return PDBackend.from_cluster(target, tokenizer, client)
    if hasattr(target, "generate_stream"):  # a PDClient
        return PDBackend(target)
    raise TypeError(f"cannot serve a {type(target).__name__}: give a PDCluster, a PDClient or a ServingBackend")


__all__ = ["PDBackend", "PDRequestError", "ServingBackend", "UnknownWorkerError", "as_backend", "model_context_len",
           "model_vocab_size", "refresh_loads_briefly", "spec_accept_length"]
