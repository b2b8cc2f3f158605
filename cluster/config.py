"""The cluster's configuration: one YAML file, typed and validated at load time.

    config = load_config("configs/local_cpu.yaml")
    config.prefill.tp_size, config.decode.engine.page_size, config.transfer.backend
    engine_config = config.engine_config("decode")      # an actors.engine EngineConfig

Every model forbids unknown keys and validates ranges; a bad file raises
:class:`ConfigError`, whose lines name each bad field by its dotted path
(``prefill.tp_size: Input should be greater than or equal to 1 (got 0)``).
Engine settings of a worker group (``prefill.engine``, ``decode.engine``) are
the fields of :class:`actors.engine.config.EngineConfig`, with the same types
and ranges, less the four the cluster fills in itself (model path, tokenizer
path, device, and tp_size: the group's own). A section left empty in the YAML
(``transfer:`` with every key commented out) keeps its defaults.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional, Type, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, create_model,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from actors.engine.config import COMBINATION_CHECKS, EngineConfig, prefill_speculative_error
from actors.engine.media_connector import MediaFetchConfig
from cluster.reasoning import REASONING_FORMATS
from cluster.tool_calls import TOOL_CALL_PARSERS

Role = Literal["prefill", "decode"]
TRANSFER_BACKENDS = ("auto", "shm", "cuda_ipc", "torch_dist", "fake")
DATA_TRANSPORTS = ("auto", "gloo", "nccl")  # transfer.backends.dist_data's (that module imports torch)
ROUTING_POLICIES = ("cache_aware", "power_of_two", "round_robin", "random")
# EngineConfig fields the cluster sets from `model` and the group's `device`.
CLUSTER_OWNED_ENGINE_FIELDS = ("model_path", "tokenizer_path", "device", "tp_size")
# EngineConfig fields of Engine.generate's own URL fetches: a PD worker is sent images the server fetched
# (ServerConfig's fields of the same names), so a worker group has none to set
SERVER_OWNED_ENGINE_FIELDS = tuple(MediaFetchConfig.model_fields)
# EngineConfig fields that fix the KV layout: a page moves slot for slot, so both sides agree.
KV_LAYOUT_FIELDS = ("page_size", "dtype", "kv_cache_dtype")
# EngineConfig fields that say what a request's priority means: the server checks it once for both sides.
PRIORITY_FIELDS = ("enable_priority_scheduling", "schedule_low_priority_values_first")
# EngineConfig fields that shape a request's grammar: the prefill side samples the first token under
# it and the decode side's matcher must accept that token, so both sides compile it alike.
GRAMMAR_CONFIG_FIELDS = ("constrained_json_disable_any_whitespace",)
# EngineConfig fields that say which LoRA adapters a request may name: the prefill side computes its KV
# under the adapter and the decode side goes on under the same one, so both load the same adapters
# (at start, and at runtime: a load must fit both sides' slots and host memory cap).
LORA_FIELDS = ("lora_paths", "max_lora_rank", "lora_target_modules", "max_loaded_loras")
# EngineConfig fields that say which weights compute: the decode side goes on from the KV and first token the
# prefill side computed, so both serve the same ones.
QUANTIZATION_FIELDS = ("quantization",)

_STRICT = ConfigDict(extra="forbid", frozen=True)


class ConfigError(ValueError):
    """A config that failed to load; ``errors`` holds one ``path: message`` line per problem."""

    def __init__(self, source: str, errors: List[str]):
        self.source = source
        self.errors = list(errors)
        super().__init__(f"invalid raydix config {source}:\n" + "\n".join(f"  {e}" for e in self.errors))


def _invalid(kind: str, text: str) -> PydanticCustomError:
    """A validation error whose message is ``text`` verbatim (no "Value error, " prefix, no templating)."""
    return PydanticCustomError(kind, "{text}", {"text": text})


def _empty_sections_as_defaults(model: Type[BaseModel], data: Any) -> Any:
    """``data`` with its null sub-sections as empty ones: YAML reads ``transfer:`` with nothing (or
    only comments) under it as null, which means "the defaults" there, not "not a mapping"."""
    if not isinstance(data, Mapping):
        return data
    empty = [name for name, field in model.model_fields.items()
             if data.get(name, ...) is None and isinstance(field.annotation, type)
             and issubclass(field.annotation, BaseModel)]
    return {**data, **{name: {} for name in empty}} if empty else data


class ModelConfig(BaseModel):
    """What to serve: a local HF checkpoint, or a built-in tiny random-weight model."""

    model_config = _STRICT

    model_path: Optional[str] = Field(None, description="HF checkpoint directory (config.json + *.safetensors)")
    builtin: Optional[str] = Field(None, description="family of the built-in tiny model (built locally, no download)")
    seed: int = Field(0, ge=0, description="weight seed of the built-in tiny model")
    tokenizer_path: Optional[str] = Field(None, description="tokenizer directory; None: the checkpoint's")
    served_model_name: Optional[str] = Field(None, min_length=1, description="model name in the OpenAI API")

    @field_validator("builtin")
    @classmethod
    def _known_family(cls, family: Optional[str]) -> Optional[str]:
        if family is None:
            return None
        from actors.engine.tiny import FAMILIES, VL_FAMILIES  # imports torch: only when a builtin is asked for

        if family not in FAMILIES + VL_FAMILIES:
            raise _invalid("unknown_family", f"unknown family {family!r}; known: {', '.join(FAMILIES + VL_FAMILIES)}")
        return family

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if (self.model_path is None) == (self.builtin is None):
            raise _invalid("model_source", "set exactly one of model_path and builtin")
        return self

    @property
    def name(self) -> str:
        """The name clients address the model by."""
        if self.served_model_name:
            return self.served_model_name
        if self.builtin is not None:
            return f"tiny-{self.builtin}"
        return Path(self.model_path).name

    def resolve_model_path(self) -> str:
        """The checkpoint directory; a built-in model is built into ``$RAYDIX_HOME/models`` on first use."""
        if self.model_path is not None:
            return os.path.expanduser(self.model_path)
        from cluster.cli import builtin_model

        return builtin_model(self.builtin, seed=self.seed)


def _engine_overrides_model() -> Type[BaseModel]:
    """EngineConfig's fields less the cluster-owned ones, each with its own type, range and default."""
    fields = {
        name: (info.annotation, copy.copy(info))
        for name, info in EngineConfig.model_fields.items()
        if name not in CLUSTER_OWNED_ENGINE_FIELDS + SERVER_OWNED_ENGINE_FIELDS
    }
    return create_model(
        "EngineOverrides", __config__=_STRICT, __module__=__name__,
        __doc__="Engine settings of one worker group: the fields of EngineConfig that the YAML may set.",
        **fields,
    )


EngineOverrides = _engine_overrides_model()


# AutoscalingConfig's signals, by the target per worker each is held to
AUTOSCALING_TARGETS = ("target_ongoing_requests", "target_waiting_requests", "target_queued_prefill_tokens",
                       "target_kv_usage")


class AutoscalingConfig(BaseModel):
    """A side's worker count set by its load (``cluster.autoscaler``): Ray Serve's ``autoscaling_config``
    (its defaults, "replicas" read "workers"), and Dynamo Planner's load signals beside its ongoing
    requests. Each enabled signal asks for ``current × its average per worker over the look-back /
    its target`` workers; the side heads for the most any asks."""

    model_config = _STRICT

    min_workers: int = Field(1, ge=1, le=1024, description="fewest workers (a request needs one of each side)")
    max_workers: int = Field(1, ge=1, le=1024, description="most workers (Ray Serve's default 1: set it)")
    target_ongoing_requests: Optional[float] = Field(
        2.0, gt=0.0, description="Ray Serve's: requests a worker should hold (queued or running); null: not a signal")
    target_waiting_requests: Optional[float] = Field(
        None, gt=0.0, description="requests a worker should have waiting for a batch (Dynamo's prefill queue); "
        "null: not a signal")
    target_queued_prefill_tokens: Optional[int] = Field(
        None, ge=1, description="prompt tokens a prefill worker should have queued, uncached (Dynamo's "
        "prefill queue tokens); null: not a signal")
    target_kv_usage: Optional[float] = Field(
        None, gt=0.0, le=1.0, description="KV-cache fraction a worker should use, cached prefixes not counted "
        "(Dynamo's decode signal, say 0.8); null: not a signal")
    metrics_interval_s: float = Field(1.0, gt=0.0, description="how often the signals are sampled and a decision made")
    look_back_period_s: float = Field(30.0, gt=0.0, description="the window a signal is averaged over")
    upscale_delay_s: float = Field(30.0, ge=0.0, description="how long more workers must be wanted before one starts")
    downscale_delay_s: float = Field(600.0, ge=0.0, description="how long fewer workers must be wanted before one "
                                     "is drained and stopped")
    upscaling_factor: Optional[float] = Field(None, gt=0.0, description="the share of a wanted increase taken at "
                                              "once (null: 1, all of it)")
    downscaling_factor: Optional[float] = Field(None, gt=0.0, description="the share of a wanted decrease taken at "
                                                "once (null: 1; at least one worker either way)")
    drain_timeout_s: float = Field(600.0, gt=0.0, description="how long a worker scaled down gets for the "
                                   "requests it accepted to finish before it stops (as Ray Serve's "
                                   "graceful_shutdown_timeout_s: a request hung past it does not hold the side's "
                                   "changes forever)")
    start_retry_backoff_s: float = Field(30.0, ge=0.0, description="after a worker failed to start, the wait "
                                         "before the next start (doubling with each failure in a row)")
    max_start_failures: int = Field(3, ge=1, description="starts failing in a row after which this side stops "
                                    "scaling up for start_failure_cooldown_s (a bad node or config is not retried "
                                    "every backoff)")
    start_failure_cooldown_s: float = Field(300.0, ge=0.0, description="after max_start_failures in a row, the wait "
                                            "before one more start is tried (Kubernetes' crash-loop backoff cap, "
                                            "5 min): a node or quota that comes back is used without a restart")

    @field_validator("max_workers")
    @classmethod
    def _max_at_least_min(cls, max_workers: int, info: ValidationInfo) -> int:
        min_workers = info.data.get("min_workers")
        if min_workers is not None and max_workers < min_workers:
            raise _invalid("max_below_min", f"must be >= min_workers ({min_workers})")
        return max_workers

    @model_validator(mode="after")
    def _some_signal(self) -> "AutoscalingConfig":
        if not any(getattr(self, name) is not None for name in AUTOSCALING_TARGETS):
            raise _invalid("no_signal", f"set at least one of {', '.join(AUTOSCALING_TARGETS)}")
        return self


class WorkerGroupConfig(BaseModel):
    """One side of the cluster: ``num_workers`` workers, each ``engine.pp_size`` pipeline stages of a TP group
    of ``tp_size`` rank actors (the two sides may differ in both: each rank pushes or takes its stage's layers)."""

    model_config = _STRICT

    num_workers: int = Field(1, ge=1, le=1024, description="workers (TP groups) on this side")
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per worker, one Ray actor each")
    device: Literal["cpu", "cuda"] = Field("cpu", description="device every rank of this side runs on")
    num_cpus_per_rank: float = Field(1.0, ge=0.0, le=1024.0, description="Ray CPUs each rank actor reserves")
    num_gpus_per_rank: Optional[float] = Field(
        None, ge=0.0, le=1.0, description="Ray GPUs each rank reserves; None: 1 on cuda (a worker takes tp_size "
        "GPUs), 0 on cpu; a fraction shares a GPU between ranks (their engine.max_total_tokens must be set)")
    engine: EngineOverrides = Field(default_factory=EngineOverrides,
                                    description="EngineConfig fields for this side's engines")
    autoscaling: Optional[AutoscalingConfig] = Field(
        None, description="scale this side by its load between autoscaling.min_workers and max_workers, from "
        "num_workers at start (cluster.autoscaler); null: only by hand (POST / DELETE /workers)")

    @model_validator(mode="before")
    @classmethod
    def _empty_engine_section(cls, data: Any) -> Any:
        return _empty_sections_as_defaults(cls, data)

    @field_validator("num_gpus_per_rank")
    @classmethod
    def _gpus_match_device(cls, num_gpus: Optional[float], info: ValidationInfo) -> Optional[float]:
        device = info.data.get("device")
        if device == "cpu" and num_gpus:
            raise _invalid("cpu_with_gpus", "must be 0 when device is cpu")
        if device == "cuda" and num_gpus == 0:
            raise _invalid("cuda_without_gpus", "must be > 0 when device is cuda")
        return num_gpus

    @property
    def gpus_per_rank(self) -> float:
        """Ray GPUs one rank reserves, with the device default applied."""
        if self.num_gpus_per_rank is not None:
            return self.num_gpus_per_rank
        return 1.0 if self.device == "cuda" else 0.0

    @property
    def ranks_per_worker(self) -> int:
        """``tp_size × engine.pp_size``: a worker's rank actors, every pipeline stage a TP group."""
        return self.tp_size * self.engine.pp_size

    @property
    def num_ranks(self) -> int:
        return self.num_workers * self.ranks_per_worker

    def engine_overrides(self) -> Dict[str, Any]:
        """Only the engine fields the YAML set, so EngineConfig keeps its own defaults for the rest."""
        return self.engine.model_dump(exclude_unset=True)

    def engine_config(self, model_path: str, tokenizer_path: Optional[str] = None) -> EngineConfig:
        return EngineConfig(model_path=model_path, tokenizer_path=tokenizer_path, device=self.device,
                            tp_size=self.tp_size, **self.engine_overrides())


class TransferConfig(BaseModel):
    """Moving KV pages from prefill to decode; the timeouts follow SGLang's disaggregation defaults."""

    model_config = _STRICT

    backend: Literal[TRANSFER_BACKENDS] = Field(
        "auto", description="auto: picked per worker pair (same node: shm or cuda_ipc; else torch_dist)")
    data_transport: Literal[DATA_TRANSPORTS] = Field(
        "auto", description="torch_dist payloads: nccl (device to device) when both sides' pools are on CUDA, "
        "else gloo (host-staged); gloo: always gloo; nccl: NCCL or the transfer fails (needs cuda on both sides)")
    bootstrap_timeout_s: float = Field(300.0, gt=0.0, description="prefill waits this long for decode's "
                                       "destination slots (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
    waiting_timeout_s: float = Field(300.0, gt=0.0, description="decode waits this long for the KV pages "
                                     "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT); a prefilled request whose push a "
                                     "prefill TP rank has not reported ended by then fails")
    heartbeat_interval_s: float = Field(5.0, gt=0.0, description="workers are checked this often; torch_dist "
                                        "pairs send a message at least this often")
    heartbeat_max_failures: int = Field(2, ge=1, description="missed heartbeats in a row that take a worker out of "
                                        "the rotation until it answers again; a torch_dist pair silent for one "
                                        "interval more is closed")
    num_reserved_decode_tokens: int = Field(
        512, ge=0, description="KV tokens decode keeps free per running request when it admits a transfer")

    def agent_options(self) -> Dict[str, Dict[str, Any]]:
        """Keyword arguments of each backend's agent (``create_agent``), by backend name."""
        return {"torch_dist": {"data_transport": self.data_transport, "keepalive_s": self.heartbeat_interval_s,
                               "keepalive_misses": self.heartbeat_max_failures + 1}}


class ServerConfig(MediaFetchConfig):
    """The OpenAI-compatible HTTP server and its admission control (429 queue full, 408 queue timeout); how it
    fetches a request's image URLs (MediaFetchConfig's fields)."""

    model_config = _STRICT

    host: str = Field("127.0.0.1", min_length=1, description="bind address; the loopback default keeps the "
                      "API private, 0.0.0.0 exposes it (set api_key then)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    api_key: Optional[SecretStr] = Field(None, description="bearer token clients must send; None: no auth")
    max_concurrent_requests: int = Field(256, ge=1, description="requests in flight at once")
    max_queue_size: int = Field(1024, ge=0, description="requests waiting for a slot; beyond it: 429")
    queue_timeout_s: float = Field(60.0, gt=0.0, description="longest wait for a slot; beyond it: 408")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="larger bodies are refused (413)")
    reasoning_parser: Optional[Literal[tuple(REASONING_FORMATS)]] = Field(
        None, description="vLLM's and SGLang's --reasoning-parser: a chat choice's thinking (<think>…</think>; "
        "gpt_oss: Harmony's analysis channel) apart, in reasoning_content (and vLLM's reasoning), its answer in "
        "content; None: all of it is content")
    tool_call_parser: Optional[Literal[tuple(TOOL_CALL_PARSERS)]] = Field(
        None, description="how chat's tool_choice \"auto\" (the default with tools) reads the model's calls, "
        "vLLM's --tool-call-parser; None: \"auto\" is refused, and tools without a tool_choice answer in content")
    allow_runtime_lora_updating: bool = Field(
        False, description="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind its "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; off: the routes do not exist): every prefill and decode worker loads "
        "or unloads the adapter, /v1/models follows")
    allow_weight_updates: bool = Field(
        False, description="POST /update_weights_from_disk (SGLang's, which serves it ungated; off: the route "
        "does not exist, as vLLM keeps its dev endpoints behind VLLM_SERVER_DEV_MODE): every prefill and decode "
        "worker loads the checkpoint at a path on its own disk, for RL rollouts between training steps")
    enable_sleep_mode: bool = Field(
        False, description="POST /sleep, /wake_up, GET /is_sleeping (vLLM's, behind --enable-sleep-mode and "
        "VLLM_SERVER_DEV_MODE) and POST /release_memory_occupation, /resume_memory_occupation (SGLang's, with "
        "--enable-memory-saver); off: the routes do not exist. Every prefill and decode worker gives its KV "
        "cache and weights back while a colocated RL trainer trains, requests refused (503) meanwhile")
    health_generate_timeout_s: float = Field(
        20.0, gt=0.0, description="GET /health_generate's limit for its one-token generation (SGLang's "
        "SGLANG_HEALTH_CHECK_TIMEOUT); past it: 503")
    responses_store_size: int = Field(1000, ge=0, description="/v1/responses stored (store: true) for "
                                      "previous_response_id and GET, least recently used evicted past this; in this "
                                      "HTTP server's memory, not shared between replicas")
    classifier_from_token: Optional[List[str]] = Field(
        None, min_length=2, max_length=2, description="vLLM's hf_overrides classifier_from_token (the "
        "Qwen3-Reranker recipe): the \"false\" and \"true\" tokens of the tokenizer, say [\"no\", \"yes\"]; /score "
        "and /rerank score a pair sigmoid(logit_true - logit_false) at its prompt's last position; None: the "
        "cosine of the two texts' embeddings (vLLM's score of an embedding model)")
    score_template: Optional[str] = Field(
        None, description="with classifier_from_token: a pair's prompt text, {query} and {document} filled in (the "
        "reranker's own prompt, say Qwen3-Reranker's chat turns); None: the tokenizer's pair encoding of the two "
        "texts (vLLM's cross-encoder prompt)")
    video_num_frames: int = Field(32, ge=1, description="a video file's most frames (vLLM's video loader's "
                                  "num_frames): sampled evenly over it")
    video_fps: float = Field(2.0, gt=0.0, description="the frames a second taken of a video file (vLLM's video "
                             "loader's fps), at most video_num_frames")

    @model_validator(mode="after")
    def _score_template(self):
        template = self.score_template
        if template is None:
            return self
        if self.classifier_from_token is None:
            raise ValueError("score_template: a template shapes a classifier's pair prompt; set "
                             "classifier_from_token too (embedding similarity embeds each text alone)")
        missing = [p for p in ("{query}", "{document}") if p not in template]
        if missing:
            raise ValueError(f"score_template: {' and '.join(missing)} missing (the pair's texts go there)")
        return self


class RouterConfig(BaseModel):
    """How the router picks the prefill and decode worker of a request (SGLang router defaults)."""

    model_config = _STRICT

    prefill_policy: Literal[ROUTING_POLICIES] = Field("cache_aware", description="prefill worker choice")
    decode_policy: Literal[ROUTING_POLICIES] = Field("cache_aware", description="decode worker choice (cache_aware: "
                                                     "room, then the worker holding the conversation within "
                                                     "decode_affinity_slack, then the least loaded)")
    cache_threshold: float = Field(0.3, ge=0.0, le=1.0, description="cache_aware: least matched fraction of the "
                                   "prompt that sends a request to the worker caching it")
    balance_abs_threshold: int = Field(64, ge=0, description="cache_aware guard, per request: a worker more than "
                                       "this many in-flight requests above the least loaded one ...")
    balance_rel_threshold: float = Field(1.5, ge=1.0, description="... and above this many times its load is "
                                         "skipped for the request (its cache match notwithstanding)")
    uncached_token_weight: float = Field(2.0, ge=0.0, description="cache_aware prefill cost w × uncached prompt "
                                         "tokens + queued prefill tokens: the weight w (0: load only)")
    decode_affinity_slack: int = Field(4, ge=0, description="cache_aware decode: a worker holding the prompt's "
                                       "prefix is preferred while at most this many requests busier than the "
                                       "least loaded decode worker")
    decode_affinity_min_tokens: int = Field(64, ge=0, description="cache_aware decode: the fewest matched prompt "
                                            "tokens that count as a hit (shorter ones, such as a chat header, "
                                            "save too little to bend load balance)")
    approx_ttl_s: float = Field(30.0, gt=0.0, description="how long a routing decision counts as cached pages on "
                                "its workers unless KV events confirm them first")
    event_interval_s: float = Field(0.05, gt=0.0, description="how often the router pulls KV events from the "
                                    "workers")
    max_events_per_pull: int = Field(4096, ge=1, description="KV events one pull takes from a worker")
    route_ttl_s: float = Field(3600.0, gt=0.0, description="a request routed and never released (its client died, "
                               "the release was lost) stops counting as its workers' load after this, unless a worker "
                               "still reports holding it")
    route_grace_s: float = Field(30.0, gt=0.0, description="a route open this long whose request neither of its "
                                 "workers reports holding in two heartbeats in a row is dropped (its release was "
                                 "lost); covers the gap between routing and the request reaching its decode worker")
    client_timeout_s: float = Field(30.0, gt=0.0, description="longest a request waits for the router to place it "
                                    "(then it fails) or to take its release (then route_grace_s covers it)")
    max_retries: int = Field(2, ge=0, description="new (prefill, decode) pairs a request tries when a worker of its "
                             "pair died, was unavailable or reports itself broken before its first output (never "
                             "after it, nor on a timeout or bad input); 0: no retries")


class PlacementConfig(BaseModel):
    """Where rank actors go in a multi-node Ray cluster."""

    model_config = _STRICT

    use_node_resources: bool = Field(False, description="place prefill ranks only on nodes declaring the custom "
                                     "resource `prefill_resource`, decode ranks on `decode_resource`")
    prefill_resource: str = Field("prefill", min_length=1, description="custom Ray resource of prefill nodes")
    decode_resource: str = Field("decode", min_length=1, description="custom Ray resource of decode nodes")
    resource_per_rank: float = Field(0.001, gt=0.0, le=1.0, description="amount of the custom resource each rank "
                                     "asks for (nodes declare 1, so many ranks fit on one node)")
    tp_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = Field(
        "STRICT_PACK", description="placement-group strategy of one worker's TP ranks")


class ClusterConfig(BaseModel):
    """A whole PD cluster: the model, both worker groups, transfer, router, HTTP server and placement."""

    model_config = _STRICT

    model: ModelConfig = Field(description="what to serve")
    prefill: WorkerGroupConfig = Field(description="the prefill workers")
    decode: WorkerGroupConfig = Field(description="the decode workers")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="KV transfer backend and timeouts")
    server: ServerConfig = Field(default_factory=ServerConfig, description="the HTTP server")
    router: RouterConfig = Field(default_factory=RouterConfig, description="routing policies")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="node placement")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        return _empty_sections_as_defaults(cls, data)

    @model_validator(mode="after")
    def _sides_agree(self) -> "ClusterConfig":
        for kind, names, why in (
                ("kv_layout_mismatch", KV_LAYOUT_FIELDS, "KV pages move slot for slot, so both sides must agree"),
                ("priority_mismatch", PRIORITY_FIELDS,
                 "a request's priority orders both sides' queues, so both must read it alike"),
                ("grammar_mismatch", GRAMMAR_CONFIG_FIELDS,
                 "the decode side's grammar must accept the first token the prefill side sampled under its own"),
                ("lora_mismatch", LORA_FIELDS,
                 "a request's adapter computes its KV on the prefill side and its tokens on the decode side"),
                ("quantization_mismatch", QUANTIZATION_FIELDS,
                 "the decode side goes on from the KV the prefill side's weights computed")):
            for name in names:
                ours, theirs = getattr(self.decode.engine, name), getattr(self.prefill.engine, name)
                if ours != theirs:
                    raise _invalid(kind, f"decode.engine.{name}: {ours!r} differs from prefill.engine.{name} "
                                   f"{theirs!r}; {why}")
        error = prefill_speculative_error(self.prefill.engine)
        if error:
            raise _invalid("prefill_speculative", f"prefill.engine.{error}")
        for role in ("prefill", "decode"):
            group = self.group(role)
            # (EngineConfig's own checks: found here, not in every actor)
            for field, check in COMBINATION_CHECKS:
                error = check(group.engine)
                if error:
                    raise _invalid(field, f"{role}.engine.{field}: {error}")
            if group.device == "cuda" and group.gpus_per_rank < 1.0 and group.engine.max_total_tokens is None:
                # (each rank sizes its pool by mem_fraction_static of the whole GPU's free memory:
                # a second rank on the GPU finds none left)
                raise _invalid("shared_gpu_pool", f"{role}.engine.max_total_tokens: must be set when "
                               f"{role}.num_gpus_per_rank < 1 (got {group.gpus_per_rank}): ranks sharing a GPU "
                               "need their KV pool sized explicitly")
            scaling = group.autoscaling
            if scaling is not None and not scaling.min_workers <= group.num_workers <= scaling.max_workers:
                raise _invalid("workers_outside_autoscaling", f"{role}.num_workers: {group.num_workers} is outside "
                               f"{role}.autoscaling's [min_workers, max_workers] = "
                               f"[{scaling.min_workers}, {scaling.max_workers}]")
        if self.transfer.backend == "cuda_ipc" and "cpu" in (self.prefill.device, self.decode.device):
            raise _invalid("cuda_ipc_on_cpu", "transfer.backend: cuda_ipc needs device cuda on both sides")
        if self.transfer.data_transport == "nccl" and "cpu" in (self.prefill.device, self.decode.device):
            raise _invalid("nccl_on_cpu", "transfer.data_transport: nccl needs device cuda on both sides")
        return self

    def group(self, role: Role) -> WorkerGroupConfig:
        return self.prefill if role == "prefill" else self.decode

    def engine_config(self, role: Role, model_path: Optional[str] = None) -> EngineConfig:
        """The EngineConfig every rank of ``role`` runs; ``model_path`` skips resolving the model again."""
        path = model_path or self.model.resolve_model_path()
        return self.group(role).engine_config(path, tokenizer_path=self.model.tokenizer_path)

    def with_updates(self, updates: Mapping[str, Any]) -> "ClusterConfig":
        """A validated copy with dotted-path fields replaced: ``{"server.port": 9000}`` (strings are coerced)."""
        data = self.model_dump(exclude_unset=True)
        for dotted, value in updates.items():
            node = data
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError("overrides", [f"{dotted}: {part} is not a section"])
            node[leaf] = value
        return parse_config(data, source="overrides")


def parse_config(data: Any, source: str = "<dict>") -> ClusterConfig:
    """Validate an already-parsed mapping; raises :class:`ConfigError` naming every bad field."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(source, [f"the top level must be a mapping, not {type(data).__name__}"])
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, format_validation_error(exc, ClusterConfig)) from None


def load_config(path: Union[str, Path]) -> ClusterConfig:
    """Read and validate a cluster YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_config(data, source=str(path))


def format_validation_error(exc: ValidationError, root: Type[BaseModel]) -> List[str]:
    """One ``dotted.path: message`` line per error, with the offending value and, for an unknown key,
    the keys that section does know."""
    lines = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            known = _section_fields(root, err["loc"][:-1])
            msg = "unknown field" + (f"; known: {', '.join(known)}" if known else "")
        elif _is_scalar(err.get("input")) and not (isinstance(err["input"], str) and repr(err["input"]) in msg):
            msg += f" (got {err['input']!r})"
        lines.append(f"{path}: {msg}" if path else msg)
    return lines


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool))


def _section_fields(root: Type[BaseModel], loc) -> List[str]:
    model = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)
