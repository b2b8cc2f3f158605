"""SGLang's offline API over one in-process engine.

    engine = Engine(model_path=DIR, max_total_tokens=4096)
    out = engine.generate(prompt="hello", sampling_params={"max_new_tokens": 8})
    outs = engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"temperature": 0})
    engine.shutdown()

Each result: ``text`` (unless ``skip_tokenizer_init``), ``output_ids`` and
``meta_info`` (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``finish_reason``, ``ttft``, ``e2e_latency``, and logprobs when asked).

    emb = engine.encode(prompt=["a", "b"], pooling_params={"dimensions": 64})   # SGLang's Engine.encode

Each embedding: ``{"embedding": [floats], "meta_info": {...}}`` (see :mod:`actors.engine.pooling`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import Any, AsyncIterator, Dict, List, Optional, Union

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine_loop import EngineLoop, Post
from actors.engine.grammar import MakingReqs, make_req_off_loop
from actors.engine.lora_updates import load_lora_adapter, unload_lora_adapter
from actors.engine.media_connector import fetch_images, image_urls
from actors.engine.memory_occupation import EngineMemory, parse_tags
from actors.engine.model_loader import DEFAULT_WEIGHT_VERSION
from actors.engine.model_runner import ModelRunner
from actors.engine.multimodal import MultimodalInputs, MultimodalProcessor
from actors.engine.req import Req
from actors.engine.sampling_params import SamplingParams
from actors.engine.scheduler import Scheduler
from actors.engine.tp_worker import LocalTPGroup
from actors.engine.weight_updates import (UpdateWeightsRequest, UpdateWeightsResult, WeightUpdater,
                                          named_tensors_source)

logger = logging.getLogger(__name__)


def _eos_ids(model_path: str, model_config) -> List[int]:
    import json
    import os

    ids = getattr(model_config.get_text_config(), "eos_token_id", None)
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id", ids)
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


def request_result(req: Req, with_text: bool = True, weight_version: str = DEFAULT_WEIGHT_VERSION) -> Dict[str, Any]:
    """The caller's view of a request: ``output_ids`` (cumulative), ``text`` and ``meta_info``
    (with SGLang's ``weight_version``: the weights it ran under, an update waits for it to end)."""
    meta = {
        "id": req.rid,
        "weight_version": weight_version,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason,
        "ttft": (req.first_token_time - req.created_time) if req.first_token_time else None,
        "e2e_latency": (req.finished_time - req.created_time) if req.finished_time else None,
    }
    if req.sampling_params.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids))
        meta["output_top_logprobs"] = list(req.output_top_logprobs)  # (a copy: later steps append to the request's)
    start = req.input_logprob_start()
    if start is not None:  # SGLang's: from logprob_start_len on, position 0's None (it has no context)
        first = 0 if req.sampling_params.logprob_start_len == 0 else start
        head = [None] * (start - first)
        prompt = req.origin_input_ids_unpadded
        meta["input_token_logprobs"] = list(zip(head + req.input_token_logprobs, prompt[first:]))
        meta["input_token_ranks"] = head + req.input_token_ranks
        meta["input_top_logprobs"] = head + req.input_top_logprobs
    result = {"output_ids": list(req.output_ids), "meta_info": meta}
    if req.embedding is not None:
        result["embedding"] = req.embedding
    if with_text:
        result["text"] = req.output_text
    return result


def _embed_params(pooling_params: Optional[Dict]) -> Dict[str, Any]:
    """The sampling params of an embedding request: the prompt only, pooled."""
    return {"max_new_tokens": 0, "pooling": pooling_params or {}}


def _embedding(result: Dict[str, Any]) -> Dict[str, Any]:
    """An embedding request's result (``embedding`` None: it was aborted, as ``meta_info`` says)."""
    return {"embedding": result.get("embedding"), "meta_info": result["meta_info"]}


def check_engine_integrity(sched, runner) -> None:
    """Idle engine: every KV slot is free or cached, no row is held, no lock is left."""
    if sched.has_work():
        raise RuntimeError("check_integrity needs an idle engine")
    tree = sched.tree_cache
    if getattr(tree, "writes_pending", False):  # backups in flight hold their prefixes: end them
        tree.writing_check(wait=True)
    sched.end_orphan_prefetches()  # (their requests are gone: what they read goes to the host tier)
    if getattr(tree, "prefetch_ops", None) or getattr(tree, "_loading_nodes", None):
        raise RuntimeError("host-tier loads or storage prefetches left in flight by an idle engine")
    tree.check_integrity()
    pool = runner.req_to_token_pool
    if pool.available_size() != pool.size:
        raise RuntimeError(f"request-row leak: {pool.size - pool.available_size()} rows held by nobody")
    runner.allocator.check_integrity(in_use=tree.all_values())
    if getattr(runner, "draft", None) is not None:  # (its slots are the allocator's: checked above)
        runner.draft.token_to_kv_pool.check_integrity()
    if sched.swa:  # both pools: full and SWA slots each free or cached, none locked
        pool.check_integrity(live_rows=[])
        tree.check_accounting()
        if tree.full_protected_size() or tree.swa_protected_size():
            raise RuntimeError(f"locks left: {tree.full_protected_size()} full, {tree.swa_protected_size()} SWA tokens")
        return
    if sched.hybrid:
        pool.check_integrity(tree_mamba_slots=tree.all_mamba_values())
        evictable, protected = tree.full_evictable_size(), tree.full_protected_size()
    else:
        pool.check_integrity(live_rows=[])
        evictable, protected = tree.evictable_size(), tree.protected_size()
    total = runner.allocator.num_pages * runner.allocator.page_size
    got = runner.allocator.available_size() + evictable + protected
    if got != total or protected != 0:
        raise RuntimeError(f"slot leak: available + evictable + protected = {got} of {total}")


def flush_engine_cache(sched, runner) -> None:
    """Drop the whole prefix cache (idle engine only): with a host tier its copies too, as
    SGLang's flush (evicted from the device, a prefix would stay on the host, loaded back
    by the next request); a file tier keeps its pages."""
    check_engine_integrity(sched, runner)
    sched.drop_prefix_cache()


def engine_server_info(sched) -> Dict[str, Any]:
    """What this engine chose at start (SGLang's scheduler info of /get_server_info), not what was
    configured: request rows and KV slots as the memory budget sized them (a hybrid model's default
    rows are the most whose Mamba states fit), the memory fraction (SGLang's default when not set), the
    context its pool holds, the chunk prefills are cut in. An SWA model adds its SWA pool's slots, a
    hybrid one its Mamba slots; its ranks' shape (SGLang's tp_size and pp_size). Static: the pools are
    allocated once (a sleep resumes them at the same sizes; a weight update keeps every shape)."""
    runner, cfg = sched.runner, sched.runner.config
    spec = cfg.speculative_algorithm is not None
    info = {"max_running_requests": runner.max_running_requests, "max_total_num_tokens": runner.max_total_num_tokens,
            "mem_fraction_static": runner.mem_fraction_static, "max_req_input_len": sched.context_len - 1,
            "context_len": sched.context_len, "page_size": cfg.page_size,
            "chunked_prefill_size": sched.chunked_prefill_size, "speculative_algorithm": cfg.speculative_algorithm,
            "speculative_num_draft_tokens": cfg.speculative_num_draft_tokens if spec else None,
            "speculative_draft_model_path": cfg.speculative_draft_model_path, "tp_size": cfg.tp_size,
            "pp_size": cfg.pp_size}
    if sched.swa:
        info["swa_max_total_num_tokens"] = runner.swa_max_total_num_tokens
    if sched.hybrid:
        info["max_mamba_cache_size"] = runner.mamba_pool.size
    return info


def _each(n: int, name: str, value, per_request: bool) -> list:
    """``value`` for each of ``n`` requests (:meth:`Engine.generate`'s arguments): its items when
    ``per_request`` (a list of one per request: ValueError naming it when of another length, which a zip
    would cut to the shortest, dropping prompts), else ``value`` each time."""
    if not per_request:
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name}: {len(value)} entries for {n} prompt(s): one per prompt")
    return value


class Engine:
    def __init__(self, model_path: str, **kwargs):
        self.config = EngineConfig(model_path=model_path, **kwargs)
        self.tp_group = LocalTPGroup(self.config) if self.config.num_ranks > 1 else None  # follower ranks spawned
        try:
            self.runner = self.tp_group.worker.runner if self.tp_group else ModelRunner(self.config)
            self.tokenizer = None
            if not self.config.skip_tokenizer_init:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer_path or model_path,
                                                               local_files_only=True)
            self.mm_processor = MultimodalProcessor.for_model(model_path, self.runner.model_config, self.runner.model,
                                                              self.config.limit_mm_per_prompt)
            self.scheduler = Scheduler(self.runner, self.tokenizer)
            self.eos_token_ids = _eos_ids(model_path, self.runner.model_config)
        except BaseException:  # the followers stop and this process leaves the group (a new engine may join one)
            if self.tp_group is not None:
                try:
                    self.tp_group.shutdown()
                except Exception:  # (the start's own error is the one to raise)
                    logger.exception("shutting the TP group down after a failed start failed too")
            raise
        self._rids = itertools.count()
        self.loop = EngineLoop(self.scheduler)
        self._making = MakingReqs()  # by rid: async requests whose grammar compiles off the loop
        self.memory = EngineMemory(self.loop, self.runner, self._call_followers)
        self.loop.check_admission = self.memory.check_serving  # (under the loop's lock: no request slips past a release)

    # ---- requests -----------------------------------------------------------------
    def _make_req(self, params: Dict[str, Any], prompt, input_ids, rid: Optional[str], priority: int = 0,
                  lora_path: Optional[str] = None, image_data: Optional[List[Any]] = None,
                  video_data: Optional[List[Any]] = None) -> Req:
        sampling = SamplingParams(**(params or {}))
        if input_ids is None:
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: pass input_ids, not prompt")
            input_ids = self.tokenizer.encode(prompt)  # with BOS where the tokenizer adds it, as SGLang's
        if not input_ids:
            raise ValueError("the prompt is empty")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need the tokenizer (skip_tokenizer_init=True)")
        mm_inputs = None
        videos = [video_data] if video_data is not None and not isinstance(video_data, list) else video_data
        if image_data or videos:
            if self.mm_processor is None:
                raise ValueError(f"{'image_data' if image_data else 'video_data'}: {self.config.model_path!r} is not "
                                 "a vision-language model")
            if isinstance(image_data, MultimodalInputs):  # processed already (a server's): input_ids are padded
                mm_inputs = image_data.for_request(input_ids)
            else:
                images = image_data if isinstance(image_data, list) or not image_data else [image_data]
                input_ids, mm_inputs = self.mm_processor.process(list(input_ids), images or [], videos or [])
        req = Req(rid or f"req-{next(self._rids)}", list(input_ids), sampling, self.eos_token_ids, priority=priority,
                  lora_path=lora_path, mm_inputs=mm_inputs)
        self.scheduler.check_request(req)
        return req

    def generate(
        self,
        prompt: Union[None, str, List[str]] = None,
        input_ids: Union[None, List[int], List[List[int]]] = None,
        sampling_params: Union[None, Dict, List[Dict]] = None,
        rid: Union[None, str, List[str]] = None,
        priority: Union[int, List[int]] = 0,
        lora_path: Union[None, str, List[Optional[str]]] = None,
        image_data: Optional[List[Any]] = None,
        video_data: Optional[List[Any]] = None,
    ):
        """Run one request or a batch to completion; a batch's results keep its order. ``priority``
        (one, or one per request) needs ``enable_priority_scheduling`` unless 0; ``lora_path`` (one,
        or one per request): the name of a LoRA adapter of ``lora_paths``, None for the base model.
        ``image_data`` (a vision-language model's, SGLang's): a request's images (a PIL image, bytes,
        a file path, a ``data:image/...;base64,`` URL, or an http(s) or file:// URL fetched first by the config's
        MediaFetchConfig rules, as the HTTP server's: :mod:`actors.engine.media_connector`; not from a running event
        loop: ``async_generate``), one per ``<|image_pad|>`` of its prompt,
        in order (or a tokenizer side's ``MultimodalInputs``, ``input_ids`` its padded prompt, its videos too);
        ``video_data`` (SGLang's): its videos, one per ``<|video_pad|>``, each its frames (a list of PIL images or
        a uint8 array [T, H, W, 3]: :mod:`actors.engine.video`); for a batch, one such list (or None) per
        request."""
        batched = isinstance(prompt, list) or (input_ids is not None and input_ids and isinstance(input_ids[0], list))
        n = len(prompt) if isinstance(prompt, list) else (len(input_ids) if batched else 1)
        prompts = _each(n, "prompt", prompt, isinstance(prompt, list))
        ids = _each(n, "input_ids", input_ids, batched and input_ids is not None)  # (a batch of text prompts: None each)
        params = _each(n, "sampling_params", sampling_params, isinstance(sampling_params, list))
        rids = _each(n, "rid", rid, isinstance(rid, list))
        priorities = _each(n, "priority", priority, isinstance(priority, list))
        loras = _each(n, "lora_path", lora_path, isinstance(lora_path, list))
        images = _each(n, "image_data", image_data, batched and image_data is not None)
        if image_urls(images):  # (all of the batch's at once, then the requests are made)
            images = asyncio.run(fetch_images(self.config, images))
        videos = _each(n, "video_data", video_data, batched and video_data is not None)
        reqs = [self._make_req(*args) for args in zip(params, prompts, ids, rids, priorities, loras, images, videos)]
        done = threading.Semaphore(0)
        errors: List[BaseException] = []

        def on_output(req: Req, error: Optional[BaseException]) -> None:
            if error is not None:
                errors.append(error)
            if req.finished or error is not None:
                done.release()

        for req in reqs:
            self.loop.submit(req, on_output)
        for _ in reqs:
            done.acquire()
        if errors:
            raise errors[0]
        results = [self._result(r) for r in reqs]
        return results if batched else results[0]

    async def async_generate(
        self,
        prompt: Optional[str] = None,
        input_ids: Optional[List[int]] = None,
        sampling_params: Optional[Dict] = None,
        rid: Optional[str] = None,
        stream: bool = False,
        priority: int = 0,
        lora_path: Optional[str] = None,
        image_data: Optional[List[Any]] = None,
        video_data: Optional[List[Any]] = None,
    ):
        """One request (``lora_path``, ``image_data``, ``video_data``: as :meth:`generate`'s). ``stream=False``:
        the final result. ``stream=True``: an
        async iterator of results, one per step that produced tokens (each with
        the cumulative ``text``/``output_ids``), the last one finished."""
        if rid is not None:
            self._making.begin(rid)  # (an abort while its grammar compiles marks it: seen below)
        try:
            if image_urls([image_data]):
                image_data = (await fetch_images(self.config, [image_data]))[0]
            args = (sampling_params, prompt, input_ids, rid, priority, lora_path, image_data, video_data)
            # (images are decoded and cut into patches off the event loop, as a grammar compiles)
            req = await (asyncio.to_thread(self._make_req, *args) if image_data or video_data
                         else make_req_off_loop(self._make_req, *args))
        finally:
            aborted = rid is not None and self._making.end(rid)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def on_output(r: Req, error: Optional[BaseException]) -> List[Post]:
            return [Post(loop, queue.put_nowait, ((self._result(r), r.finished, error),))]

        if aborted:  # ended before it is queued, as a waiting request's abort ends it
            req.finish({"type": "abort", "message": "aborted"})
            queue.put_nowait((self._result(req), True, None))
        else:
            self.loop.submit(req, on_output)
        stream_iter = self._stream(queue)
        if stream:
            return stream_iter
        final = None
        async for final in stream_iter:
            pass
        return final

    async def _stream(self, queue: asyncio.Queue) -> AsyncIterator[Dict[str, Any]]:
        while True:
            result, finished, error = await queue.get()
            if error is not None:
                raise error
            yield result
            if finished:
                return

    def encode(self, prompt: Union[None, str, List[str]] = None,
               input_ids: Union[None, List[int], List[List[int]]] = None,
               pooling_params: Optional[Dict] = None, rid: Union[None, str, List[str]] = None,
               lora_path: Union[None, str, List[Optional[str]]] = None):
        """SGLang's ``Engine.encode``: the embedding of one prompt or of each of a batch (its order
        kept), ``pooling_params`` (:class:`~actors.engine.pooling.PoolingParams`: ``dimensions``,
        ``normalize``; ``classifier_token_ids``: a one-element score instead) for all, ``lora_path``
        as :meth:`generate`'s (an adapter's hidden states); run as prompts scored only, they batch
        with generation."""
        outs = self.generate(prompt, input_ids, _embed_params(pooling_params), rid, lora_path=lora_path)
        return [_embedding(o) for o in outs] if isinstance(outs, list) else _embedding(outs)

    async def async_encode(self, prompt: Optional[str] = None, input_ids: Optional[List[int]] = None,
                           pooling_params: Optional[Dict] = None, rid: Optional[str] = None,
                           lora_path: Optional[str] = None) -> Dict[str, Any]:
        """One prompt's :meth:`encode`, awaited."""
        return _embedding(await self.async_generate(prompt, input_ids, _embed_params(pooling_params), rid,
                                                    lora_path=lora_path))

    def abort(self, rid: str) -> bool:
        """Stop a waiting or running request, or one whose grammar compiles (``async_generate``:
        it ends when the compile returns); its caller gets finish_reason "abort"."""
        return self._making.mark(lambda key: key == rid) or self.loop.abort(rid)

    def pause_generation(self, mode: str = "in_place") -> None:
        """SGLang's ``pause_generation``: no step after the one in progress until
        :meth:`continue_generation`; the running requests keep their KV ("in_place") or go back to
        waiting with it freed ("retract")."""
        self.loop.pause(retract=mode == "retract")

    def continue_generation(self) -> None:
        self.loop.resume()

    # ---- LoRA adapters at runtime (actors.engine.lora_updates) ------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve the PEFT adapter in ``lora_path`` as ``lora_name`` from now on (SGLang's and vLLM's
        ``load_lora_adapter``): checked as at start (ValueError), kept in host memory on every TP rank."""
        load_lora_adapter(self.loop, self.runner, self._call_followers, lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving adapter ``lora_name`` (ValueError if it is not served): refused to new requests
        at once, gone once the requests in flight under it have finished (SGLang's)."""
        unload_lora_adapter(self.loop, self.runner, self._call_followers, lora_name)

    # ---- weights (actors.engine.weight_updates) ---------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None,
                                 abort_all_requests: bool = False, flush_cache: bool = True,
                                 torch_empty_cache: bool = False) -> UpdateWeightsResult:
        """SGLang's ``update_weights_from_disk``: serve the checkpoint in ``model_path`` (same model, new
        weights) from now on, on every TP rank. New requests wait meanwhile; those in flight finish
        first, or end aborted with ``abort_all_requests``. ValueError (nothing changed) for a checkpoint
        that does not fit the served model; ``flush_cache`` drops the KV of the old weights;
        ``torch_empty_cache`` empties each rank's CUDA cache after."""
        return self._update_weights(UpdateWeightsRequest(model_path, weight_version, abort_all_requests, flush_cache,
                                                         torch_empty_cache))

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: Optional[str] = None,
                                   torch_empty_cache: bool = False) -> UpdateWeightsResult:
        """SGLang's ``update_weights_from_tensor``: copy ``named_tensors`` ((HF name, whole tensor) pairs,
        any subset of the served ones) into the served weights, each TP rank its shard; otherwise as
        :meth:`update_weights_from_disk` (ValueError, nothing changed, for an unknown name or another
        shape; ``load_format`` only the default)."""
        source = named_tensors_source(named_tensors, load_format)
        return self._update_weights(UpdateWeightsRequest(source, weight_version, abort_all_requests, flush_cache,
                                                         torch_empty_cache))

    def _update_weights(self, req: UpdateWeightsRequest) -> UpdateWeightsResult:
        updater = WeightUpdater(self.loop, self.runner, self._call_followers,
                                lambda: flush_engine_cache(self.scheduler, self.runner),
                                lambda rid, room: self.loop.abort(rid), self.memory)
        return updater.update(req)

    # ---- sleep mode (actors.engine.memory_occupation) ---------------------------------------
    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """SGLang's: give back the memory of ``tags`` ("kv_cache", "weights", "cuda_graph"; None: all) on
        every TP rank; the weights are discarded (SGLang keeps no copy by default): update them after
        resuming. RuntimeError (nothing released) while a request is held; ValueError for an unknown tag."""
        self.memory.release(parse_tags(tags), keep_weights=False)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """SGLang's: allocate the parts of ``tags`` (None: all) again; the KV cache starts empty."""
        self.memory.resume(parse_tags(tags))

    def sleep(self, level: int = 1) -> None:
        """vLLM's: release the KV cache and the weights, level 1 keeping a CPU copy of the weights
        (:meth:`wake_up` restores them), level 2 discarding them (update them after waking up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: 1 or 2")
        self.memory.release(parse_tags(None), keep_weights=level == 1)

    def wake_up(self, tags: Optional[List[str]] = None) -> None:
        """vLLM's: :meth:`resume_memory_occupation`."""
        self.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        """vLLM's: whether any part of the memory is released."""
        return self.memory.is_sleeping

    def server_info(self) -> Dict[str, Any]:
        """:func:`engine_server_info`: the sizes this engine chose."""
        return engine_server_info(self.scheduler)

    def get_weight_version(self) -> str:
        """The ``weight_version`` of the last update ("default" before any)."""
        return self.runner.weights.version

    @property
    def _call_followers(self):
        return self.tp_group.worker.call_followers if self.tp_group is not None else None

    def _result(self, req: Req) -> Dict[str, Any]:
        return request_result(req, self.tokenizer is not None, self.runner.weights.version)

    # ---- health -------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Idle engine: every KV slot is free or cached, no row is held, no lock is left."""
        self.loop.run_exclusive(self._check_integrity)

    def _check_integrity(self) -> None:
        check_engine_integrity(self.scheduler, self.runner)
        if self.tp_group is not None:
            self.tp_group.worker.check_followers()

    def flush_cache(self) -> None:
        """Drop the whole prefix cache (idle engine only)."""

        self.loop.run_exclusive(lambda: flush_engine_cache(self.scheduler, self.runner))

    def shutdown(self) -> None:
        self.loop.stop()
        try:
            self.scheduler.close()
        finally:
            if self.tp_group is not None:
                self.tp_group.shutdown()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
