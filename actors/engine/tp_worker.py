"""Tensor-parallel execution: rank 0 schedules, every rank computes its shard.

A worker with ``tp_size = N`` is N processes joined by one torch.distributed
group (:func:`actors.engine.parallel.init_tp_group`). Rank 0 hosts the
Scheduler; each ForwardBatch it runs is first broadcast to the other ranks
(the *followers*), which run the same ``ModelRunner.forward`` on their
shards — the all-reduces inside the layers keep them in step. Only rank 0
samples.

With ``pp_size > 1`` the worker is ``tp_size × pp_size`` ranks (:mod:`actors.engine.pipeline`): the
control messages below go to every rank of every stage (``self.tp``: the whole worker's group), each
rank's model and collectives are its stage's TP group (``self.model_tp``), and the stages hand the
hidden states on inside the forward.

Every rank's pools have the same slot counts; only rank 0 allocates, so the
slot numbers a batch carries (``out_cache_loc``, request rows, Mamba slots,
track slots) mean the same on every rank. What else the forward reads is
kept equal like this:

* index tables (``req_to_token`` and, with an SWA allocator, its
  full→SWA slot map): rank 0 keeps a copy of what the followers hold and
  sends, with each batch, the entries that batch reads (its rows, the slots
  they name) that differ, whoever wrote them (prefill, decode, the tree
  cache re-pointing a row at cached slots) — entries no batch reads are not
  kept up to date (:class:`TableMirror`);
* Mamba state written outside a forward (zeroed at alloc, copied at a
  copy-on-write prefix match, a checkpoint fork or a verify step's commit
  from its scratch): rank 0's MambaPool logs
  those ops and the followers replay them, in order, before the forward;
* the host tier of the hierarchical cache: every rank keeps a host pool of
  its own head shard, with the same slot count; rank 0's tree picks the host
  and device slots, its HiCacheController logs each backup and load-back
  (``runner.host_op_log``) and the followers replay them, in order, before
  the forward (and before any out-of-band write: :meth:`TPModelWorker.sync`);
  with a file tier each rank writes its own pages, in its own folder, and
  a fetch from files keeps only the pages every rank read (rank 0 asks the
  others to read them with a call). A load or a backup failing on a follower does
  not stop it (the all-reduces stay paired; its slots hold garbage): rank 0 asks
  every follower after ending its loads, and its backups (``runner.host_peers_loads``),
  and handles the failure as its own: the requests that read a failed load are
  requeued (the slots a follower could not fill lost on every rank), a failed
  backup's host copy is dropped. A sliding-window model's two host pools
  (``SWAHiRadixCache``) log into the one log, each copy tagged with its pool
  (``PoolOpLog``), and a follower replays them into its shards of both
  (``SWAHostReplay``), its storage writes into its own file tier of each; rank 0's
  reads from files name their pool too. Their copies are made at once and not asked
  about: one failing on a follower ends its loop (the group is broken, not silently wrong).

Hosting (the Ray rank actors do the same as :class:`LocalTPGroup`)::

    # rank 0 (init = tp_init_method(its node's IP), handed to the other ranks)
    worker = TPModelWorker(config, 0, init)
    scheduler = Scheduler(worker.runner, tokenizer)  # runner.forward drives the followers
    ...
    worker.shutdown()                                # every follower_loop returns
    # rank r > 0: a long-running call (a Ray actor: a threaded or async actor's method)
    TPModelWorker(config, r, init).follower_loop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from actors.engine.config import EngineConfig
from actors.engine.forward_batch import ForwardBatch
from actors.engine.model_loader import build_served_model, load_config
from actors.engine.model_runner import ModelRunner
from actors.engine.models.spec import KVCacheSpec
from actors.engine.multimodal import FollowerImages, ImageMirror
from actors.engine.parallel import TPGroup, init_stage_group, init_tp_group
from actors.engine.pipeline import stage_layers
from mem_cache.hicache_controller import HiCacheController
from mem_cache.hicache_storage import HiCacheFile, rank_storage_dir
from mem_cache.memory_pool_host import create_host_pool, host_pool_args
from mem_cache.swa_hiradix_storage import swa_storage_backends
from mem_cache.swa_hiradix_tiers import SWAHostReplay

logger = logging.getLogger(__name__)

STOP, CHECK, CALL = "stop", "check", "call"  # control messages besides a BatchMessage
LOCAL_FIELDS = ("req_to_token_pool", "token_to_kv_pool", "attn_backend")  # each rank fills in its own


class TPGroupBrokenError(RuntimeError):
    """Rank 0 can no longer drive its followers: an earlier exchange with them failed midway."""


@dataclass
class FollowerError:
    """A follower's handler failed; ``message`` says where and why."""

    message: str


@dataclass
class BatchMessage:
    """What the followers apply, then the batch to run (CPU tensors; ``None``
    for a :meth:`TPModelWorker.sync` without a forward)."""

    table_updates: List[Tuple[str, torch.Tensor, torch.Tensor]]  # (table, flat index, values)
    mamba_ops: List[Tuple]
    fields: Optional[Dict[str, Any]]
    host_ops: List[Tuple] = dataclasses.field(default_factory=list)  # host-tier copies (HiCacheController)
    image_drops: List[int] = dataclasses.field(default_factory=list)  # embeddings to drop first (ImageMirror)
    image_keys: Optional[List[List[int]]] = None  # the batch's images' keys, as its mm_items

    @classmethod
    def pack(cls, batch: ForwardBatch, table_updates, mamba_ops, host_ops=(), images=None) -> "BatchMessage":
        """``images``: (drops, keys, the items to send) of :meth:`ImageMirror.updates`."""
        fields = {}
        for f in dataclasses.fields(batch):
            if f.name not in LOCAL_FIELDS:
                value = getattr(batch, f.name)
                fields[f.name] = value.cpu() if isinstance(value, torch.Tensor) else value
        drops, keys, items = images or ([], None, None)
        if items is not None:
            fields["mm_items"] = items
        return cls(table_updates, mamba_ops, fields, list(host_ops), drops, keys)

    def forward_batch(self, device: torch.device) -> ForwardBatch:
        fields = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.fields.items()}
        return ForwardBatch(**fields, req_to_token_pool=None, token_to_kv_pool=None)


def index_tables(runner: ModelRunner) -> Dict[str, torch.Tensor]:
    """The slot-index tables a forward reads, by name."""
    tables = {"req_to_token": runner.req_to_token_pool.req_to_token}
    mapping = getattr(runner.allocator, "full_to_swa_index_mapping", None)
    if mapping is not None:
        tables["full_to_swa_index_mapping"] = mapping
    return tables


def table_digest(tables: Dict[str, torch.Tensor]) -> Dict[str, str]:
    return {name: hashlib.sha1(t.cpu().numpy().tobytes()).hexdigest() for name, t in tables.items()}


class TableMirror:
    """Rank 0's copy of the followers' index tables. ``updates(batch)`` are the entries
    the batch's forward reads that differ from what the followers hold (and marks them
    sent): the ``req_to_token`` cells ``[0, max seq_len)`` of the batch's rows, and the
    full→SWA map at every slot those cells and ``out_cache_loc`` name. That is all a
    follower reads of them (attention reads its requests' rows up to their lengths, SWA
    layers translate those slots, KV writes translate ``out_cache_loc``; transfers and
    host-tier copies get their slots from rank 0), so the cost follows the batch's
    context, not the tables' size (a batch that reads most of the table compares all of
    it: one pass is cheaper than gathering its rows). Other entries may stay stale on the
    followers until a batch reads them; ``sent`` is exactly what the followers hold."""

    def __init__(self, tables: Dict[str, torch.Tensor]):
        self.tables = tables
        self.sent = {name: t.clone() for name, t in tables.items()}

    def updates(self, batch: Optional[ForwardBatch]) -> List[Tuple[str, torch.Tensor, torch.Tensor]]:
        """``None`` (a sync without a forward): nothing reads the tables, nothing is sent."""
        if batch is None:
            return []
        table, sent = self.tables["req_to_token"], self.sent["req_to_token"]
        rows = batch.req_pool_indices.to(table.device, torch.int64)
        width = max(batch.seq_lens_cpu) if batch.seq_lens_cpu is not None else int(batch.seq_lens.max())
        out: List[Tuple[str, torch.Tensor, torch.Tensor]] = []
        if 2 * rows.numel() * width > table.numel():  # most of the table: one pass over it beats gathering it
            for name in self.tables:
                self._diff(name, None, out)
            return out
        cells = table[:, :width].index_select(0, rows)
        i, j = (cells != sent[:, :width].index_select(0, rows)).nonzero(as_tuple=True)
        if i.numel():
            values = cells[i, j]
            sent[rows[i], j] = values
            out.append(("req_to_token", (rows[i] * table.shape[1] + j).cpu(), values.cpu()))
        if "full_to_swa_index_mapping" in self.tables:
            slots = torch.cat([cells.reshape(-1).to(torch.int64), batch.out_cache_loc.to(table.device, torch.int64)])
            self._diff("full_to_swa_index_mapping", slots, out)
        return out

    def _diff(self, name: str, index: Optional[torch.Tensor], out: List) -> None:
        """Append the entries of table ``name`` at flat ``index`` (None: all) that differ from ``sent``."""
        flat, sent = self.tables[name].view(-1), self.sent[name].view(-1)
        if index is None:
            changed = (flat != sent).nonzero().squeeze(1)
        else:
            changed = index[flat[index] != sent[index]].unique()  # (shared prefixes name a slot more than once)
        if changed.numel():
            values = flat[changed]
            sent[changed] = values
            out.append((name, changed.cpu(), values.cpu()))


def apply_table_updates(tables: Dict[str, torch.Tensor], updates) -> None:
    for name, index, values in updates:
        table = tables[name]
        table.view(-1)[index.to(table.device)] = values.to(table.device)


class TPModelWorker:
    """One rank: its model shard and pools (``runner``). Rank 0's
    ``runner.forward`` broadcasts each batch before running it; ranks > 0 call
    :meth:`follower_loop`. With ``tp_size == 1`` it is a plain ModelRunner host."""

    def __init__(self, config: EngineConfig, tp_rank: int, dist_init_method: Optional[str] = None,
                 gpu_id: Optional[int] = None, **runner_kwargs):
        ranks = config.num_ranks
        if not 0 <= tp_rank < ranks:
            raise ValueError(f"tp_rank={tp_rank} is outside [0, tp_size × pp_size={ranks})")
        if ranks > 1 and not dist_init_method:
            raise ValueError("tp_size × pp_size > 1 needs dist_init_method (e.g. tcp://host:port)")
        if config.device == "cuda":
            torch.cuda.set_device(gpu_id if gpu_id is not None else tp_rank % torch.cuda.device_count())
        # every rank of the worker (pipeline stages too): the control messages; the model's own TP group below
        self.tp: TPGroup = init_tp_group(tp_rank, ranks, dist_init_method, torch.device(config.device))
        try:
            self.model_tp = init_stage_group(self.tp, config.tp_size, config.pp_size, config.pp_layer_partition)
            self._init_rank(config, runner_kwargs)
        except BaseException:  # leave the group: a worker made next in this process (a fixed config) makes its own
            if self.tp.size > 1:
                torch.distributed.destroy_process_group()
            raise

    def _init_rank(self, config: EngineConfig, runner_kwargs: Dict[str, Any]) -> None:
        """This rank's shard and pools, and its side of the exchanges with the other ranks."""
        self.runner = ModelRunner(config, tp=self.model_tp, **runner_kwargs)
        self.tables = index_tables(self.runner)
        self._mamba_pool = getattr(self.runner, "mamba_pool", None)
        # a follower's replayer of rank 0's host-tier copies (a sliding-window model's: both host pools')
        self._host_tier: Optional[Union[HiCacheController, SWAHostReplay]] = None
        self._stopped = False
        self.broken: Optional[str] = None  # rank 0: why the group was torn down (see _exchange)
        # follower side of call_followers(): name -> fn(payload) -> reply (picklable)
        self.handlers: Dict[str, Callable[[Any], Any]] = {}
        if self.tp.size > 1 and not self.tp.is_leader:  # (actors.engine.lora_updates, weight_updates)
            from actors.engine.lora_updates import FollowerReads  # (which imports this module)
            from actors.engine.memory_occupation import RankMemory
            from actors.engine.weight_updates import empty_device_cache
            self.memory = memory = RankMemory(self.runner)  # (sleep mode)
            self.handlers.update(FollowerReads(self.runner).handlers(), weights_check=self.runner.weights.check,
                                 weights_load=self.runner.weights.load,
                                 weights_empty_cache=lambda _: empty_device_cache(self.runner.device),
                                 memory_release=lambda payload: memory.release(*payload),
                                 memory_resume=memory.resume, memory_capture_graphs=memory.capture_graphs)
        self._images = ImageMirror() if self.tp.is_leader else FollowerImages()
        if self.tp.size > 1 and self.tp.is_leader:
            self._mirror = TableMirror(self.tables)
            if self._mamba_pool is not None:
                self._mamba_pool.op_log = []
            if config.enable_hierarchical_cache:
                self.runner.host_op_log = []  # the scheduler's HiCacheController logs into it
                self.runner.host_peers_loads = lambda: self.call_followers("host_loads", None)
                if config.hicache_storage_dir:
                    self.runner.storage_peers_read = lambda *payload: self.call_followers("storage_read", payload)
                    self.runner.storage_peers_prefetch = self.call_followers
            self.runner.tp_step = self._step
            self.runner.tp_collect = lambda: self._exchange("a forward")  # (its output, a pipeline's)
        elif self.tp.size > 1 and config.enable_hierarchical_cache and self.runner.spec.kind == "swa":
            storage = (None, None)
            if config.hicache_storage_dir:
                storage = swa_storage_backends(rank_storage_dir(config.hicache_storage_dir, self.tp.rank, self.tp.size))
            self._host_tier = SWAHostReplay(self.runner.token_to_kv_pool, config.hicache_ratio, config.page_size,
                                            storage)
            self.handlers["storage_read"] = lambda payload: self._host_tier.read_storage(*payload)
            self.handlers["weights_storage_dir"] = lambda directory: self._host_tier.use_storage(
                swa_storage_backends(rank_storage_dir(directory, self.tp.rank, self.tp.size)))
        elif self.tp.size > 1 and config.enable_hierarchical_cache:
            pool = self.runner.token_to_kv_pool
            storage = None
            if config.hicache_storage_dir:
                storage = HiCacheFile(rank_storage_dir(config.hicache_storage_dir, self.tp.rank, self.tp.size))
            self._host_tier = HiCacheController(pool, create_host_pool(pool, **host_pool_args(config)), storage,
                                                overlap_load=config.hicache_overlap_load, async_storage_writes=True,
                                                overlap_write=config.hicache_overlap_write, keep_load_errors=True)
            self.handlers["host_loads"] = lambda _: self._host_tier.take_load_report()
            self.handlers["storage_read"] = lambda payload: self._host_tier.read_storage(*payload)
            self.handlers["prefetch_start"] = self._host_tier.peer_prefetch_start
            self.handlers["prefetch_end"] = self._host_tier.peer_prefetch_end
            self.handlers["weights_storage_dir"] = lambda directory: self._host_tier.use_storage(
                HiCacheFile(rank_storage_dir(directory, self.tp.rank, self.tp.size)))

    # ---- rank 0 ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _exchange(self, what: str) -> Iterator[None]:
        """Rank 0: one exchange with the followers (a message, or a forward in step with
        theirs). One that fails midway leaves the ranks at different points of their
        collectives: a follower may wait in an all-reduce this rank never joins, and would
        pair it with one of this rank's next batch (silently wrong sums). So this rank joins
        no collective again: every later exchange raises :class:`TPGroupBrokenError` at once,
        and the process group is destroyed (another may be made in this process). A follower
        left waiting fails at the group's timeout, or as soon as this process ends."""
        if self.broken is not None:
            raise TPGroupBrokenError(f"TP group of rank 0 is broken: {self.broken}")
        try:
            yield
        except BaseException as exc:
            self._break(f"{what} failed ({type(exc).__name__}: {exc})")
            raise

    def _break(self, reason: str) -> None:
        if self.broken is not None:
            return
        self.broken = reason
        logger.error("TP rank 0: %s; the TP group is broken: no further batch runs", reason)
        try:
            torch.distributed.destroy_process_group()
        except Exception:
            logger.exception("TP rank 0: could not destroy the process group")

    @contextlib.contextmanager
    def _step(self, batch: ForwardBatch) -> Iterator[None]:
        """``runner.tp_step``: the batch to the followers, then this rank's forward."""
        with self._exchange("a forward"):
            self._send_batch(batch)
            yield

    def _send_batch(self, batch: Optional[ForwardBatch]) -> None:
        ops: List[Tuple] = []
        if self._mamba_pool is not None:
            ops, self._mamba_pool.op_log = self._mamba_pool.op_log, []
        host_ops: List[Tuple] = []
        if self.runner.host_op_log:  # (emptied in place: the controller holds the list)
            host_ops = list(self.runner.host_op_log)
            self.runner.host_op_log.clear()
        updates = self._mirror.updates(batch)
        images = self._images.updates(batch.mm_items if batch else None)
        self.tp.broadcast_object(BatchMessage.pack(batch, updates, ops, host_ops, images) if batch
                                 else BatchMessage(updates, ops, None, host_ops, images[0]))

    def sync(self) -> None:
        """Rank 0: bring the followers' Mamba states and host-tier copies up to date
        now, without a forward (index table entries go with the batch that reads
        them). Call it before anything writes slots out of band on every rank (a KV
        transfer into freshly allocated Mamba slots: their zeroing must not be
        replayed after the transfer's write)."""
        if self.tp.size > 1:
            with self._exchange("a sync"):
                self._send_batch(None)

    def call_followers(self, name: str, payload: Any, alongside: Optional[Callable[[], None]] = None) -> List[Any]:
        """Rank 0: run ``handlers[name](payload)`` on every follower, in step with
        the batches already sent (a KV push after the forward that wrote it);
        returns their replies in rank order. A handler that raises replies with
        a :class:`FollowerError`, which is returned, not raised. ``alongside``: rank
        0's own part, run while the followers run theirs (between the call and their
        replies): collectives every rank joins (a CUDA graph capture's)."""
        if self.tp.size == 1:
            if alongside is not None:
                alongside()
            return []
        self.sync()  # pending Mamba ops and host-tier copies land before the call acts on those slots
        with self._exchange(f"call {name!r}"):
            self.tp.broadcast_object((CALL, name, payload))
            if alongside is not None:
                alongside()
            return self.tp.gather_objects(None)[1:]

    def _answer_call(self, name: str, payload: Any) -> None:
        try:
            reply = self.handlers[name](payload)
        except Exception as exc:  # the leader decides what a failure means
            logger.exception("TP rank %d: call %r failed", self.tp.rank, name)
            reply = FollowerError(f"rank {self.tp.rank}: {type(exc).__name__}: {exc}")
        self.tp.gather_objects(reply)

    def check_followers(self) -> List[KVCacheSpec]:
        """Rank 0, engine idle: every follower's index tables equal what rank 0
        sent them, its host tier has no load in flight or failure unreported, and it
        holds no image embedding rank 0 does not.
        Returns every rank's KVCacheSpec, in rank order."""
        if self.tp.size == 1:
            return [self.runner.spec]
        self.sync()  # (the image embeddings to drop: those of the prefills ended since the last batch)
        with self._exchange("a check"):
            self.tp.broadcast_object(CHECK)
            replies = self.tp.gather_objects(None)
        expected = table_digest(self._mirror.sent)
        for rank, (digest, _, host_tier_busy, images) in enumerate(replies[1:], start=1):
            if host_tier_busy:
                raise RuntimeError(f"TP rank {rank}: host-tier loads in flight or failures unreported, engine idle")
            if not images <= set(self._images.held):
                raise RuntimeError(f"TP rank {rank}: holds {len(images - set(self._images.held))} image "
                                   "embedding(s) rank 0 has dropped")
            if digest != expected:
                bad = sorted(k for k in expected if digest.get(k) != expected[k])
                raise RuntimeError(f"TP rank {rank}: index tables {bad} differ from rank 0's")
        return [self.runner.spec] + [spec for _, spec, _, _ in replies[1:]]

    def shutdown(self) -> None:
        """Rank 0: end the followers' loops, then leave the group (idempotent; a broken
        group is gone already)."""
        if self._stopped:
            return
        self._stopped = True
        if self.tp.size > 1 and self.broken is None:
            try:
                self.sync()  # what the followers have not replayed yet (their share of the last pages stored)
                self.tp.broadcast_object(STOP)
            finally:  # (a broken group: the followers' next collective fails instead of waiting for STOP)
                if self.broken is None:  # (a failed sync tore it down)
                    torch.distributed.destroy_process_group()

    # ---- ranks > 0 ----------------------------------------------------------------------
    def follower_loop(self) -> None:
        """Run rank 0's batches until it shuts down, then leave the group."""
        if self.tp.is_leader:
            raise RuntimeError("follower_loop runs on ranks > 0; rank 0 drives them through runner.forward")
        device = self.runner.device
        if device.type == "cuda":  # (a follower's loop may run on a thread of its own: a Ray rank actor's)
            torch.cuda.set_device(device)
        while True:
            msg = self.tp.broadcast_object()
            if msg == STOP:
                break
            if msg == CHECK:
                tier = self._host_tier
                busy = tier is not None and (tier.load_pending or tier.load_failures_pending)
                self.tp.gather_objects((table_digest(self.tables), self.runner.spec, busy,
                                        set(self._images.embeddings)))
                continue
            if isinstance(msg, tuple) and msg[0] == CALL:
                self._answer_call(msg[1], msg[2])
                continue
            apply_table_updates(self.tables, msg.table_updates)
            if msg.host_ops:
                self._host_tier.replay(msg.host_ops)
                self._host_tier.start_loading()  # its loads copy while the forward runs, as on rank 0
            if msg.mamba_ops:
                self._mamba_pool.replay(msg.mamba_ops)
            if msg.host_ops and msg.fields is None:
                self._host_tier.wait_loading()
            if (msg.host_ops or msg.mamba_ops) and msg.fields is None and device.type == "cuda":
                # a sync() before out-of-band writes (a KV push into fresh slots): states zeroed, KV loaded first
                torch.cuda.current_stream(device).synchronize()
            self._images.drop(msg.image_drops)
            if msg.fields is not None:
                batch = msg.forward_batch(device)
                try:
                    with self._images.forward(msg.image_keys, batch.mm_items):
                        self.runner.forward(batch)
                finally:
                    if self._host_tier is not None:
                        self._host_tier.wait_loading()
        self._stopped = True
        if self._host_tier is not None:
            self._host_tier.close()
        self.model_tp.pp.end_sends()
        torch.distributed.destroy_process_group()


def check_tp_shardable(config: EngineConfig) -> None:
    """Fail before starting any rank when ``tp_size`` cannot shard the model
    (the error names the config field it must divide, or the quantized layer whose FP8 blocks, or GPTQ /
    AWQ / compressed-tensors int words or groups, it would cut), or ``pp_size`` cannot split its layers (naming pp_size or
    pp_layer_partition)."""
    model_config = load_config(config.model_path)
    build_served_model(config.model_path, model_config, config.quantization,
                       TPGroup(rank=0, size=config.tp_size, expert_parallel=config.enable_expert_parallel))
    if config.pp_size > 1:
        # (a vision-language config's decoder fields are its text config's)
        stage_layers(model_config.get_text_config().num_hidden_layers, 0, config.pp_size, config.pp_layer_partition)


def tp_init_method(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous for a new TP group (a free port on ``host``,
    which must be rank 0's address: rank 0 listens there)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def _follower_main(config: Dict[str, Any], tp_rank: int, dist_init_method: str) -> None:
    config = EngineConfig(**config)
    if config.device == "cpu":  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.num_ranks))
    TPModelWorker(config, tp_rank, dist_init_method).follower_loop()


class LocalTPGroup:
    """Every rank of one TP group (of every pipeline stage's) on this machine: rank 0 in this
    process (its ``worker``), the followers as spawned processes, joined over a free
    localhost TCP port (gloo on CPU, NCCL with one GPU per rank on CUDA)."""

    def __init__(self, config: EngineConfig):
        check_tp_shardable(config)
        init_method = tp_init_method()
        ctx = torch.multiprocessing.get_context("spawn")
        self.processes = [
            ctx.Process(target=_follower_main, args=(config.model_dump(), rank, init_method), daemon=True,
                        name=f"raydix-tp-rank-{rank}")
            for rank in range(1, config.num_ranks)
        ]
        for p in self.processes:
            p.start()
        try:
            self.worker = TPModelWorker(config, 0, init_method)
        except BaseException:
            self._stop_processes(timeout=0)
            raise

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every rank. The followers of a broken group get no STOP (they may wait in a
        collective rank 0 left): they are terminated at once, as when the STOP cannot be sent."""
        try:
            self.worker.shutdown()
        finally:
            self._stop_processes(0 if self.worker.broken else timeout)

    def _stop_processes(self, timeout: float) -> None:
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                logger.warning("TP follower %s did not stop; terminating it", p.name)
                p.terminate()
                p.join()
