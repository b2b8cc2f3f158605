"""The engine's arguments: one validated object; a bad value fails naming the field.

"auto" / None values are resolved where the model and device are known (the
model runner and the scheduler).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional

from pydantic import BeforeValidator, ConfigDict, Field, model_validator

from actors.engine.media_connector import MediaFetchConfig

CHUNKED_PREFILL_DEFAULT = 2048  # tokens per prefill chunk when chunked_prefill_size is not set
CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")  # the schedule policies that order requests by the radix cache
# the projections a LoRA adapter may target (HF names; a model's supported_lora_modules say which it has)
# SGLang's names; qkv_proj and gate_up_proj: Phi-3's fused projections (one adapter over q | k | v, gate | up);
# q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj: DeepSeek's MLA; in_proj_qkvz, in_proj_ba, out_proj:
# Qwen3-Next's linear attention; w1, w3, w2: Mixtral's experts' gate, up, down (a MoE's experts are targeted by
# their projections' names, gate_proj every expert's gate_proj as vLLM's)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "in_proj_qkvz",
                       "in_proj_ba", "out_proj", "w1", "w2", "w3")


def lora_paths_dict(value: Any) -> Any:
    """SGLang's ``--lora-paths`` list (``name=path``, or a bare path named by itself) as a
    name -> path mapping; a mapping as it is."""
    if not isinstance(value, (list, tuple)):
        return value
    pairs = [item.split("=", 1) if "=" in item else (item, item) for item in value]
    names = [name for name, _ in pairs]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"LoRA adapter name {duplicate!r} is given twice")
    return dict(pairs)


def lora_target_modules_list(value: Any) -> Any:
    """SGLang's ``--lora-target-modules``: ``"all"`` (alone or in the list) stands for every projection."""
    if value == "all" or (isinstance(value, (list, tuple)) and "all" in value):
        return list(LORA_TARGET_MODULES)
    return value


class EngineConfig(MediaFetchConfig):
    """The engine's arguments; how ``generate`` fetches an image URL of ``image_data`` (MediaFetchConfig's fields,
    the HTTP server's rules: vLLM's LLM and SGLang's Engine fetch their URLs)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model_path: str = Field(description="HF checkpoint directory (config.json + *.safetensors)")
    tokenizer_path: Optional[str] = Field(None, description="defaults to model_path")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto: the checkpoint's dtype")
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = "auto"
    quantization: Optional[Literal["fp8"]] = Field(
        None, description="the weights' quantization (SGLang's and vLLM's --quantization): None: the checkpoint's "
        "own (config.json's quantization_config: block-wise FP8 served weight-only, actors.engine.fp8; GPTQ and "
        "AWQ kept packed, served weight-only, actors.engine.wna16; compressed-tensors and per-tensor FP8 kept as "
        "stored, served weight-only, actors.engine.compressed_tensors); 'fp8': "
        "the same, and an unquantized checkpoint quantized to 128x128-block FP8 as it loads")
    page_size: int = Field(1, ge=1, le=256)
    mem_fraction_static: Optional[float] = Field(
        None, gt=0.0, lt=1.0, description="the share of device memory for the weights and the static pools. None: "
        "SGLang's on CUDA (device memory less a reserve for a prefill chunk's activations, the CUDA graphs and the "
        "ranks); 0.5 on the CPU (actors.engine.model_runner.default_mem_fraction_static)")
    max_total_tokens: Optional[int] = Field(None, gt=0, description="KV pool size in tokens; None: from memory")
    max_running_requests: Optional[int] = Field(None, gt=0)
    context_length: Optional[int] = Field(None, gt=0, description="None: the model's max_position_embeddings")
    chunked_prefill_size: Optional[int] = Field(None, description="tokens per prefill chunk; -1 disables; None: 2048")
    max_prefill_tokens: int = Field(16384, gt=0, description="tokens of one prefill batch")
    schedule_policy: Literal["fcfs", "lof", "random", "lpm", "dfs-weight"] = Field(
        "fcfs", description="the order admission tries waiting requests in (SGLang's --schedule-policy): fcfs "
        "(arrival), lof (most max_new_tokens first), random, lpm (longest cached prefix first), dfs-weight (a walk "
        "of the prefix tree, the subtree with the most waiting requests first); lpm and dfs-weight need the radix "
        "cache and order as fcfs above 128 waiting requests")
    limit_mm_per_prompt: Optional[Dict[Literal["image", "video"], Annotated[int, Field(ge=0)]]] = Field(
        None, description="vLLM's: the most images and videos one prompt may hold ({\"image\": N, \"video\": M}; "
        "0 refuses them), a vision-language model's; more is refused (a 400 at the server) before any is decoded. "
        "None: no limit but the context length's")
    enable_priority_scheduling: bool = Field(
        False, description="order waiting requests by their priority first, the policy's order within one; a "
        "waiting request may preempt running ones (see priority_scheduling_preemption_threshold). Off, a request "
        "with a priority other than 0 is refused (vLLM's behaviour)")
    schedule_low_priority_values_first: bool = Field(
        False, description="priority scheduling: lower priority values are served first (default: higher ones)")
    priority_scheduling_preemption_threshold: int = Field(
        10, ge=0, description="priority scheduling: a waiting request that does not fit retracts running requests "
        "whose priority is more than this below its own (SGLang's default 10); set it above the priorities' range "
        "to order without preempting")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="auto: triton on CUDA (the torch backend, a reference, copies each layer's K/V "
        "into padded fp32 tables), torch on the CPU (where Triton runs interpreted)")
    moe_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="how an MoE layer's routed experts run: triton, two grouped-GEMM launches over the "
        "batch's tokens sorted by expert (SGLang's fused MoE); torch, HF's eager loop (one matmul per chosen "
        "expert, a host sync a layer). auto: triton on CUDA, torch on the CPU (where Triton runs interpreted) and for "
        "experts the fused kernels do not take (compressed-tensors FP8 / int8 ones, mixed bits or groups: "
        "actors.engine.moe_wna16)")
    disable_cuda_graph: bool = Field(
        False, description="run every decode forward eagerly (SGLang's --disable-cuda-graph, vLLM's enforce_eager). "
        "Graphs are on by default where they can be: off on the CPU, with the torch attention backend, the eager "
        "MoE experts, sliding-window and hybrid (Mamba) models, pipeline parallelism, and on a PD prefill worker "
        "(it never decodes); a batch with a LoRA adapter runs eagerly (actors.engine.cuda_graph_runner says why)")
    cuda_graph_max_bs: Optional[int] = Field(
        None, gt=0, description="the largest decode batch captured (SGLang's --cuda-graph-max-bs); larger ones run "
        "eagerly. None: SGLang's by device memory and tp_size (8 below 20 GB, 256 on an 80 GB GPU at tp < 4)")
    cuda_graph_bs: Optional[List[Annotated[int, Field(gt=0)]]] = Field(
        None, description="the decode batch sizes captured (SGLang's --cuda-graph-bs, vLLM's "
        "cudagraph_capture_sizes); a batch is padded to the next one. None: 1, 2, 4, 8, 12, then every 8 to 256 and "
        "every 16 to 512, up to cuda_graph_max_bs")
    disable_radix_cache: bool = False
    radix_eviction_policy: Literal["lru", "lfu", "fifo", "mru", "filo", "priority"] = "lru"
    mamba_scheduler_strategy: Literal["no_buffer", "extra_buffer"] = "no_buffer"
    mamba_track_interval: int = Field(256, gt=0)
    swa_full_tokens_ratio: float = Field(
        0.8, gt=0.0, le=1.0,
        description="sliding-window models (Gemma 3, Mistral): slots of the SWA layers' pool as a fraction of the "
        "full layers' pool (SGLang's --swa-full-tokens-ratio). The SWA pool only needs each running request's last "
        "window plus the tokens of one prefill chunk, so it can be smaller: with room for two chunks and two windows "
        "it serves prompts up to the full pool's size; otherwise a request is held to the SWA pool less a window",
    )
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = Field(2.0, gt=1.0, description="host KV pool size as a multiple of the device pool (a "
                                 "sliding-window model has two: one per pool, full and SWA layers)")
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    hicache_storage_dir: Optional[str] = Field(None, description="file tier directory (None: host tier only); with "
                                               "tp_size > 1 each rank keeps its pages in tp{size}-rank{rank} under it; a "
                                               "sliding-window model's SWA layers' pages in a swa folder there")
    hicache_storage_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = Field(
        "timeout", description="file tier: a request's pages are fetched from its arrival on; at admission "
        "best_effort takes what has arrived, wait_complete holds the request until all have, timeout holds it "
        "up to hicache_storage_prefetch_timeout_s (SGLang's policies; its default, best_effort, admits a request "
        "on an idle engine before a local file is read); a sliding-window model reads its pages at admission")
    hicache_storage_prefetch_timeout_s: float = Field(1.0, gt=0.0, description="the timeout policy's limit")
    hicache_overlap_load: bool = Field(True, description="load host-tier KV layer by layer while the forward that "
                                       "reads it runs (a load stream on CUDA, a loader thread on CPU); False: "
                                       "load before the forward")
    hicache_overlap_write: bool = Field(True, description="back up a write-through hit to the host tier off the "
                                        "loop (a write stream on CUDA, a writer thread on CPU), its prefix locked "
                                        "until the copy is done; False: copy at once")
    skip_tokenizer_init: bool = False
    constrained_json_disable_any_whitespace: bool = Field(
        False, description="SGLang's: a json_schema's output has no whitespace of its own between its tokens (a "
        "model may otherwise write whitespace where it is allowed until max_new_tokens)")
    random_seed: int = 0
    init_new_token_ratio: float = Field(0.7, gt=0.0, le=1.0)
    min_new_token_ratio: float = Field(0.1, gt=0.0, le=1.0)
    new_token_ratio_decay: float = Field(0.001, ge=0.0)
    enable_kv_events: bool = False
    disaggregation_async_push: bool = Field(
        True, description="prefill worker of a disaggregated pair: push each chunk's KV on a transfer thread while "
        "the next batch runs (False: push inside the engine loop, which waits for it)",
    )
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks (one process each); every rank holds "
                         "1/tp_size of the attention heads, MLP and expert intermediate dims")
    pp_size: int = Field(
        1, ge=1, le=64, description="pipeline-parallel stages (vLLM's --pipeline-parallel-size, SGLang's --pp-size): "
        "the decoder layers split into pp_size contiguous ranges, each held by a TP group of tp_size ranks "
        "(tp_size × pp_size ranks in all, each holding and caching only its stage's layers); pp_micro_batches "
        "batches in flight (actors.engine.pipeline)")
    pp_micro_batches: int = Field(
        1, ge=1, le=64, description="pipeline parallelism: micro-batches in flight, of disjoint requests (SGLang's "
        "running_mbs; its pp_size + pp_async_batch_depth): rank 0 schedules the next while the later stages run "
        "the earlier ones, and takes each one's output as it comes back (actors.engine.micro_batch). pp_size "
        "keeps every stage busy; 1: one batch at a time (memory scale-out, not throughput)")
    pp_layer_partition: Optional[List[int]] = Field(
        None, description="the decoder layers of each stage, in stage order (vLLM's VLLM_PP_LAYER_PARTITION); "
        "None: an even split, the remainder on the stages before the last")
    enable_expert_parallel: bool = Field(
        False, description="MoE models: shard the experts over the TP ranks instead of their intermediate dims "
        "(vLLM's --enable-expert-parallel; SGLang's --ep-size equal to --tp-size): each rank holds tp_size-th of "
        "every MoE layer's experts whole (tp_size must divide their number) and runs them on the tokens routed to "
        "them; attention, dense and shared-expert MLPs stay TP. The KV layout is the same, so the two sides of a "
        "PD cluster may differ in it")
    speculative_algorithm: Optional[Literal["ngram", "draft_model"]] = Field(
        None, description="speculative decoding (vLLM's speculative_config method, SGLang's --speculative-algorithm): "
        "ngram drafts a request's next tokens from its own prompt and output (no draft model), draft_model (SGLang's "
        "STANDALONE) from a small model of the same vocabulary, speculative_draft_model_path "
        "(actors.engine.draft_model); one forward verifies them (actors.engine.spec_decode); None: off")
    speculative_draft_model_path: Optional[str] = Field(
        None, description="draft_model: the draft's HF checkpoint directory (SGLang's --speculative-draft-model-path, "
        "vLLM's speculative_config model); the target's vocabulary and tokenizer")
    speculative_num_draft_tokens: int = Field(4, ge=1, le=64, description="draft tokens per request and step, at "
                                              "most (vLLM's num_speculative_tokens)")
    speculative_ngram_min: int = Field(1, ge=1, description="the shortest n-gram ending the sequence that is looked "
                                       "up earlier in it (vLLM's prompt_lookup_min)")
    speculative_ngram_max: int = Field(4, ge=1, description="the longest one, tried first (vLLM's prompt_lookup_max)")

    lora_paths: Annotated[Optional[Dict[str, str]], BeforeValidator(lora_paths_dict)] = Field(
        None, description="LoRA adapters served beside the base model (SGLang's --lora-paths, vLLM's --lora-modules): "
        "name -> PEFT adapter directory (adapter_config.json + adapter_model.safetensors), or a list of 'name=path'; "
        "a request names one (lora_path; the OpenAI model field), none: the base model. The projections of each "
        "model's supported_lora_modules: attention, dense MLP, a MoE's shared and routed experts "
        "(actors.engine.lora, actors.engine.lora_experts)")
    max_loras_per_batch: int = Field(
        8, ge=1, description="adapter slots on the device (SGLang's; vLLM's --max-loras): every adapter is kept in "
        "host memory and the slots hold those the running requests use, swapped in as requests need them (the "
        "least recently used one no running request uses gives way); a request whose adapter finds no slot waits")
    max_lora_rank: Optional[int] = Field(None, ge=1, description="the slots' rank (a smaller adapter's zero-padded; "
                                         "SGLang's and vLLM's --max-lora-rank): an adapter loaded at runtime may "
                                         "have up to it; None: the largest start adapter's")
    lora_target_modules: Annotated[Optional[List[Literal[LORA_TARGET_MODULES]]],
                                   BeforeValidator(lora_target_modules_list)] = Field(
        None, description="the projections whose layers take adapters, in every decoder layer (SGLang's "
        "--lora-target-modules; 'all': every one; a fused projection's parts name it, Phi-3's q_proj its "
        "qkv_proj; an expert projection's name, gate_proj, Mixtral's w1 or GPT-OSS's gate_up_proj, names every "
        "routed expert's too; a name no layer of the model has is refused at start): an adapter, at start or loaded at "
        "runtime, targets only these; with max_lora_rank it serves adapters loaded at runtime without any "
        "lora_paths; None: the layers the start adapters target")
    max_loaded_loras: Optional[int] = Field(
        None, ge=1, description="adapters held in host memory at most (SGLang's; vLLM's --max-cpu-loras), those "
        "being unloaded included: a load beyond it is refused; at least max_loras_per_batch; None: no cap")

    @property
    def num_ranks(self) -> int:
        """The worker's ranks: a TP group per pipeline stage."""
        return self.tp_size * self.pp_size

    @model_validator(mode="after")
    def _check_combinations(self) -> "EngineConfig":
        for _, check in COMBINATION_CHECKS:
            error = check(self)
            if error:
                raise ValueError(error)
        return self


def mamba_tracking_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) Mamba tracking cannot
    work, or None."""
    if config.mamba_scheduler_strategy == "extra_buffer" and config.mamba_track_interval % config.page_size:
        return (f"mamba_track_interval ({config.mamba_track_interval}) must be a multiple of page_size "
                f"({config.page_size}) with mamba_scheduler_strategy extra_buffer: a decode checkpoint is "
                "cached at a page boundary")
    return None


def schedule_policy_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) schedule policy cannot
    work, or None."""
    if config.schedule_policy in CACHE_AWARE_POLICIES and config.disable_radix_cache:
        return (f"schedule_policy {config.schedule_policy!r} orders requests by the radix cache, which "
                "disable_radix_cache=True turns off (use fcfs, lof or random)")
    return None


def speculative_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) n-gram lookup window cannot
    work, or None."""
    if config.speculative_ngram_min > config.speculative_ngram_max:
        return (f"speculative_ngram_min ({config.speculative_ngram_min}) is more than speculative_ngram_max "
                f"({config.speculative_ngram_max})")
    return None


def draft_model_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) draft model cannot work, or
    None: draft_model needs its path and the path needs draft_model; the host tier backs up the target's
    KV only, so a prefix loaded back would have no draft KV (:mod:`actors.engine.draft_model`)."""
    drafting = config.speculative_algorithm == "draft_model"
    if drafting and not config.speculative_draft_model_path:
        return "speculative_draft_model_path is needed with speculative_algorithm 'draft_model'"
    if config.speculative_draft_model_path and not drafting:
        return (f"speculative_draft_model_path is set but speculative_algorithm is "
                f"{config.speculative_algorithm!r}: only 'draft_model' runs a draft model")
    if drafting and config.enable_hierarchical_cache:
        return ("speculative_draft_model_path: a draft model does not work with enable_hierarchical_cache=True "
                "(the host tier backs up the target's KV only; a prefix loaded back would lack the draft's)")
    return None


def prefill_speculative_error(config) -> Optional[str]:
    """Why a prefill worker's engine settings (an EngineConfig or the cluster's ``prefill.engine``)
    cannot take speculative decoding, or None: it samples a request's first token only and never
    decodes, so a draft has nothing to verify; it is the decode side's setting."""
    if config.speculative_algorithm is not None:
        return (f"speculative_algorithm {config.speculative_algorithm!r}: a prefill worker never decodes, so it has "
                "nothing to speculate; set it in decode.engine")
    return None


def lora_rank_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) LoRA slots have no rank, or
    None: without start adapters nothing else gives it (SGLang asks for both flags alike)."""
    if config.lora_target_modules and not config.lora_paths and config.max_lora_rank is None:
        return ("max_lora_rank is needed with lora_target_modules and no lora_paths: it is the rank of the "
                "adapter slots, which no start adapter gives")
    return None


def max_loaded_loras_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) cap on the adapters in host
    memory cannot hold, or None (SGLang's checks)."""
    cap = config.max_loaded_loras
    if cap is not None and cap < config.max_loras_per_batch:
        return (f"max_loaded_loras ({cap}) is less than max_loras_per_batch ({config.max_loras_per_batch}): "
                "the device slots hold adapters of host memory")
    if cap is not None and len(config.lora_paths or {}) > cap:
        return f"max_loaded_loras ({cap}) is less than the {len(config.lora_paths)} adapters of lora_paths"
    return None


# The checks of field combinations, each with the field its error names: EngineConfig runs them,
# and the cluster config too, on each group's engine section (so they fail at the server, not in an actor).
def pipeline_error(config) -> Optional[str]:
    """Why ``config``'s (an EngineConfig or a cluster group's engine section) pipeline stages cannot
    work, or None: pp_layer_partition needs a count per stage; what keeps state per layer outside the
    stage's pools (a draft model's or LoRA's on rank 0, the host tier's copies) is not split into stages yet."""
    partition = config.pp_layer_partition
    if partition is not None and len(partition) != config.pp_size:
        return f"pp_layer_partition has {len(partition)} counts for pp_size={config.pp_size} stages"
    if config.pp_size == 1:
        if getattr(config, "pp_micro_batches", 1) > 1:
            return f"pp_micro_batches={config.pp_micro_batches} needs pp_size > 1"
        return None
    for field, value in (("speculative_algorithm", config.speculative_algorithm),
                         ("lora_paths", config.lora_paths or config.lora_target_modules),
                         ("enable_hierarchical_cache", config.enable_hierarchical_cache)):
        if value:
            return f"pp_size={config.pp_size}: {field} is not served with pipeline parallelism yet"
    return None


COMBINATION_CHECKS = (("mamba_track_interval", mamba_tracking_error), ("schedule_policy", schedule_policy_error),
                      ("speculative_ngram_min", speculative_error),
                      ("speculative_draft_model_path", draft_model_error), ("max_lora_rank", lora_rank_error),
                      ("max_loaded_loras", max_loaded_loras_error), ("pp_size", pipeline_error))
