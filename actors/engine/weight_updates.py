"""Weights replaced from a checkpoint on disk while an engine serves (SGLang's
``update_weights_from_disk``): what an RL framework (verl, OpenRLHF, slime) calls after each
training step to go on generating with the new policy.

The order of one update, on an engine or a PD worker (every TP rank):

1. New requests wait: the engine loop parks them (:meth:`EngineLoop.hold`) until the update ends.
   Those in flight finish first, or with ``abort_all_requests`` end at once as aborted (SGLang's
   abort finish reason), freeing what they held. A worker's own holding does not keep a PD request
   on one checkpoint (a prefill worker done first would prefill it on the new weights for a decode
   worker still on the old): ``PDBackend.update_weights_from_disk`` holds the cluster's new requests
   and waits for those in flight on both sides before any worker is told to update.
   A paused engine (``pause_generation``) is updated at once instead, as SGLang's: nothing is waited
   for or aborted, its requests resume on the new weights (:meth:`WeightUpdater._apply_paused`).
2. Once nothing runs, the checkpoint is checked on every rank before any weight is touched
   (:meth:`ServedWeights.check`): its config must equal the served one's but for metadata, every
   tensor the model loads must be there in its shape (read from the safetensors headers), and
   none left over. A refusal (ValueError naming what differs, and the rank) changes nothing.
3. Every rank copies its shard into the tensors the model holds, in place: whatever holds them
   (LoRA layers wrap the base modules) computes with the new values. A copy that fails on a rank
   reloads the served checkpoint on every rank (SGLang's rollback) and raises.
4. With ``flush_cache`` (the default) the prefix cache goes, its host copies too; a file tier
   (``hicache_storage_dir``) is keyed by weight version: the pages of the new weights go to a
   directory of their own, ``<dir>/weights/<hash of path and version>`` (a fresh one when the update
   names no version), so no engine reads KV of other weights there — neither this one the pages
   of its old weights, nor an engine still on the old weights the pages of the new (which
   clearing the directory would not prevent, and which would destroy what those engines share).
   The storage prefetches of a paused engine's waiting requests end, keeping nothing.
   Without ``flush_cache`` the caches are kept, as SGLang's, KV of the old weights included.
5. With ``torch_empty_cache`` (SGLang's) every rank on CUDA returns the blocks its allocator caches
   (the load's transient buffers among them) to the driver; on the CPU there is nothing to return.
6. ``weight_version`` (SGLang's; "default" until an update names one) is recorded: results
   carry it in ``meta_info``. The checkpoint's tokenizer and generation config are not read, and a
   draft model's weights (speculative decoding) are not replaced: its KV goes with the flushed cache.

An update from tensors (SGLang's ``update_weights_from_tensor``, what a colocated RL trainer, verl's or
slime's, pushes) takes the same steps with named tensors for the checkpoint: HF checkpoint names, whole
(unsharded) tensors, any subset of the served ones (a trainer may push them in buckets: each call is an
update of its own, flushing the cache with ``flush_cache`` as SGLang's). Rank 0 gets them; the followers
get their shapes for the check (on meta) and then the tensors on the CPU through the follower calls, and
each rank copies its shard. A block-FP8 layer takes its weight in FP8 with its scales, or in another
dtype alone, quantized as it loads (:func:`fp8.copy_weight`); an MXFP4 model's experts (dequantized at
start) take the dense tensor, or its ``_blocks`` and ``_scales``; a GPTQ / AWQ layer takes its packed
tensors (``qweight``, ``qzeros``, ``scales``, act-order's ``g_idx``), never a dense weight (nor, for a layer
served without act-order, a ``g_idx`` out of group order, nor a bias but zeros for one without a bias:
:func:`wna16.unread_problems`); a compressed-tensors layer its tensors as stored, never a dense weight
(:func:`compressed_tensors.stored_problems`). No checkpoint holds the weights served after one
(``ServedWeights.path`` None): a copy failing later is not rolled back (nor is SGLang's), and the file tier's
pages of them go to a directory of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch

from actors.engine import wna16
from actors.engine.lora_updates import CallFollowers, on_followers
from actors.engine.model_loader import ServedWeights, WeightsSource, served_name
from mem_cache.hicache_storage import HiCacheFile, rank_storage_dir
from mem_cache.swa_hiradix_storage import swa_storage_backends

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.01  # how often an update looks whether the requests in flight have ended
ABORT_MESSAGE = "aborted: the weights are being updated (abort_all_requests)"
SUCCESS = "Succeeded to update model weights."  # (SGLang's message)


class UpdateWeightsResult(NamedTuple):
    """SGLang's UpdateWeightFromDiskReqOutput: ``num_paused_requests`` the requests that waited."""

    success: bool
    message: str
    num_paused_requests: int


def storage_dir_for(base: str, path: Optional[str], version: Optional[str]) -> str:
    """The file tier's directory for the pages of the weights in ``path`` at ``version``: shared by
    the engines updated alike (a trainer may rewrite one path at every step: the version tells the
    weights apart; two runs may both name a "v1": the path does). No version, or weights from tensors
    (``path`` None: nothing names them across engines and runs): a directory of its own."""
    if version is None or path is None:
        return os.path.join(base, "weights", f"u{uuid.uuid4().hex[:16]}")
    return os.path.join(base, "weights", hashlib.sha256(f"{path}\0{version}".encode()).hexdigest()[:16])


def check_weights(runner, call_followers: CallFollowers, source: WeightsSource) -> None:
    """ValueError naming what differs (and the rank) when ``source`` (a checkpoint's path, or named
    tensors: the followers are sent their shapes and dtypes alone, on meta, but the values a check reads
    of a layer rank 0 does not hold: another pipeline stage's, an expert of another EP rank, by its served name: a
    vision-language model's ``model.language_model.*`` too) cannot replace the served weights on every rank;
    nothing is loaded (the loop's lock held: it calls the followers)."""
    weights = runner.weights
    weights.check(source)
    on_followers(call_followers, "weights_check", source if isinstance(source, str) else on_meta(
        source, lambda name: weights.elsewhere(served_name(weights.renames, name)) and wna16.value_checked(name)))


def on_meta(tensors: Dict[str, torch.Tensor], keep: Optional[Callable[[str], bool]] = None) -> Dict[str, torch.Tensor]:
    """``tensors`` on meta (their shapes and dtypes, sent at no cost) but those ``keep`` names, on the CPU."""
    return {name: t.cpu() if keep is not None and keep(name) else torch.empty_like(t, device="meta")
            for name, t in tensors.items()}


def check_paused_flush(loop, flush_cache: bool) -> None:
    """RuntimeError (nothing changed) when ``loop`` is paused, ``flush_cache`` is asked and a
    request holds KV: paused "in_place", its KV is of the served weights and cannot be dropped
    (SGLang's flush fails so too); "retract" freed it. The loop's lock held."""
    holding = [r.rid for r in loop.held_reqs() if r.req_pool_idx is not None] if loop.paused else []
    if flush_cache and holding:
        raise RuntimeError(f"generation is paused with requests holding KV ({', '.join(holding)}): "
                           "flush_cache cannot drop it; pause with mode retract or abort, or update with "
                           "flush_cache false")


def empty_device_cache(device: torch.device) -> None:
    """SGLang's ``torch_empty_cache``: the CUDA caching allocator's free blocks back to the driver
    (on the CPU, nothing: no caching allocator holds them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def apply_update(sched, runner, call_followers: CallFollowers, flush: Callable[[], None], source: WeightsSource,
                 version: Optional[str], flush_cache: bool, torch_empty_cache: bool = False) -> List[str]:
    """With nothing running (the loop's lock held): check on every rank, copy on every rank (named
    tensors: the followers are sent them on the CPU, whole, each takes its shard), flush (``flush``:
    the engine's prefix cache, idle), empty the device caches, record ``version``. ValueError: refused,
    nothing changed; RuntimeError: a copy failed (rolled back where a checkpoint holds the served weights).
    Returns the names of the served tensors written on any rank (a pipeline stage's are its own)."""
    check_weights(runner, call_followers, source)
    weights, old = runner.weights, runner.weights.path
    what = repr(source) if isinstance(source, str) else "tensors"
    try:
        written = set(weights.load(source))
        for names in on_followers(call_followers, "weights_load", source if isinstance(source, str) else
                                  {name: t.cpu() for name, t in source.items()}):
            written.update(names)
    except Exception as exc:
        raise RuntimeError(f"weights update from {what} failed while copying ({exc}); "
                           f"{_roll_back(weights, call_followers, old)}") from None
    if flush_cache:
        if sched.file_tier:  # (a paused engine's waiting requests: reading pages of the old weights)
            sched.cancel_prefetches()
        flush()
        if sched.file_tier:
            directory = storage_dir_for(runner.config.hicache_storage_dir, weights.path, version)
            tree, rank_dir = sched.tree_cache, rank_storage_dir(directory, runner.tp.rank, runner.tp.size)
            if sched.swa:  # (each host pool's pages in a file tier of its own)
                for controller, backend in zip((tree.cache_controller, tree.swa_cache_controller),
                                               swa_storage_backends(rank_dir)):
                    controller.use_storage(backend)
            else:
                tree.cache_controller.use_storage(HiCacheFile(rank_dir))
            on_followers(call_followers, "weights_storage_dir", directory)
    if torch_empty_cache:
        empty_device_cache(runner.device)
        on_followers(call_followers, "weights_empty_cache", None)
    if version is not None:
        weights.version = version
    return sorted(written)


def _roll_back(weights: ServedWeights, call_followers: CallFollowers, old: Optional[str]) -> str:
    if old is None:  # (SGLang's update from tensors rolls nothing back either)
        return "no checkpoint holds the weights served before (updated from tensors): the ranks' weights may be mixed"
    try:
        weights.load(old)
        on_followers(call_followers, "weights_load", old)
    except Exception as exc:
        logger.exception("rolling the weights back to %s failed", old)
        return f"rolling back to {old!r} failed too ({exc}): the ranks' weights may be mixed"
    return f"rolled back to {old!r} on every rank"


def named_tensors_source(named_tensors, load_format: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """SGLang's ``named_tensors`` (a list of (HF name, whole tensor) pairs, or a dict) as an update's
    source; ValueError for a name given twice or a ``load_format`` other than the default (SGLang's
    "direct", "flattened_bucket" and custom loaders are not served)."""
    if load_format is not None:
        raise ValueError(f"load_format={load_format!r} is not served: only the default (a list of "
                         "(name, tensor) pairs) is")
    pairs = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    source = dict(pairs)
    if len(source) != len(pairs):
        twice = sorted({name for name, _ in pairs if sum(n == name for n, _ in pairs) > 1})
        raise ValueError(f"tensors named more than once: {twice[:8]}")
    if not source:
        raise ValueError("no tensors to update")
    return source


class UpdateWeightsRequest(NamedTuple):
    """SGLang's UpdateWeightFromDiskReqInput (the fields raydix serves); ``source`` its ``model_path``, or
    UpdateWeightsFromTensorReqInput's named tensors (HF names, whole tensors; any subset of the served ones)."""

    source: WeightsSource
    weight_version: Optional[str] = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    torch_empty_cache: bool = False


class WeightUpdater:
    """One engine's (or PD worker's) weight updates: its ``loop``, rank 0's ``runner``, the other
    ranks through ``call_followers``; ``flush()`` drops its prefix cache (idle), ``abort(rid, room)``
    ends a request in flight (a coroutine function for :meth:`async_update`); ``memory`` its sleep state
    (``EngineMemory.update_weights``: the update is checked against it under the loop's lock)."""

    def __init__(self, loop, runner, call_followers: CallFollowers, flush: Callable[[], None],
                 abort: Callable[[str, Optional[int]], Any], memory):
        self.loop, self.runner, self.call_followers, self.flush, self.abort = loop, runner, call_followers, flush, abort
        self.memory = memory

    def update(self, req: UpdateWeightsRequest) -> UpdateWeightsResult:
        """The whole update (see the module docstring) for a caller on a thread of its own: returns
        once the new weights serve; ValueError (a checkpoint refused) or RuntimeError (a failed copy) else."""
        if self.loop.paused:
            return self._apply_paused(req)
        self._hold()
        try:
            self._abort_in_flight(req)
            while not self.loop.drained():
                time.sleep(DRAIN_POLL_S)
            self._apply(req)
        finally:
            paused = self.loop.release()
        return UpdateWeightsResult(True, SUCCESS, paused)

    async def async_update(self, req: UpdateWeightsRequest) -> UpdateWeightsResult:
        """:meth:`update` for an asyncio caller (a worker actor, whose event loop delivers the outputs
        of the very requests the update waits for; the copy runs on a thread, so that the actor
        answers its heartbeats meanwhile)."""
        if self.loop.paused:
            return await asyncio.to_thread(self._apply_paused, req)
        self._hold()
        try:
            await asyncio.gather(*self._abort_in_flight(req))
            while not self.loop.drained():
                await asyncio.sleep(DRAIN_POLL_S)
            await asyncio.to_thread(self._apply, req)
        finally:
            paused = self.loop.release()
        return UpdateWeightsResult(True, SUCCESS, paused)

    def _hold(self) -> None:
        """New requests park from now on."""
        self.loop.hold()

    def _apply_paused(self, req: UpdateWeightsRequest) -> UpdateWeightsResult:
        """SGLang's update of a paused engine: at once, nothing waited for (its requests resume on the
        new weights at ``continue_generation``; none is aborted). With ``flush_cache``, refused
        (RuntimeError, nothing changed) while a request holds KV: paused "in_place", its KV is of the
        served weights and cannot be dropped (SGLang's flush fails so too); "retract" frees it."""
        def apply():
            sched = self.loop.scheduler
            check_paused_flush(self.loop, req.flush_cache)
            self.memory.update_weights(lambda flush: apply_update(sched, self.runner, self.call_followers, flush,
                                                                  req.source, req.weight_version, req.flush_cache,
                                                                  req.torch_empty_cache), sched.drop_prefix_cache)

        self.loop.run_exclusive(apply)
        return UpdateWeightsResult(True, SUCCESS, 0)

    def _abort_in_flight(self, req: UpdateWeightsRequest) -> List[Any]:
        """With ``abort_all_requests``, abort the requests in flight (returns what each ``abort`` returned)."""
        if not req.abort_all_requests:
            return []
        return [self.abort(rid, room) for rid, room in self.loop.in_flight_rooms().items()]

    def _apply(self, req: UpdateWeightsRequest) -> None:
        self.loop.run_exclusive(lambda: self.memory.update_weights(
            lambda flush: apply_update(self.loop.scheduler, self.runner, self.call_followers, flush, req.source,
                                       req.weight_version, req.flush_cache, req.torch_empty_cache), self.flush))
