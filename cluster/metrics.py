"""Prometheus metrics of one HTTP server (a registry per app, so two apps in one
process never share counters).

Per request (observed by the server as it streams): TTFT over both legs
(arrival → first token out: admission queue, prefill, KV transfer, first
decode step), the prefill leg alone, TPOT, inter-token latency, end-to-end
latency, tokens (prompt / generated / cache hits), the KV transfer's latency,
bytes and bandwidth, and which worker each routing policy picked. Per worker
(refreshed at scrape time from the workers' own load reports): KV usage, queue
lengths (prefill waiting; decode prealloc / transfer / running / retracted),
requests in flight, the request rows and KV slots its engine chose, and with the
hierarchical cache its host usage (a sliding-window model's SWA host pool apart); and, as
counters (``_total``: they only grow, so ``rate()`` applies), retractions and the
priority preemptions among them, KV bytes pushed, the hierarchical cache's tokens /
pages moved between its tiers and speculative decoding's drafts, draft tokens and
accepted tokens (in all and per draft position: vLLM's).
The client's retries (a request sent to a new pair after a worker of its pair
died) count in ``raydix_request_retries_total``.
A worker that left drops its series, routing decisions included. With autoscaling, each side's
desired worker count (``raydix_autoscaler_desired_workers{role}``) as the autoscaler last decided it.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

PREFIX = "raydix"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
BANDWIDTH_BUCKETS = tuple(10.0 ** e for e in range(5, 12))  # 100 kB/s … 100 GB/s
ENGINE_SIZES = (("max_running_requests", "request rows the worker's engine runs at most, as it chose them"),
                ("max_total_num_tokens", "KV slots of the worker's (full-attention) pool, as its engine sized it"))
QUEUES = {"prefill": ("waiting", "running"), "decode": ("prealloc", "transfer", "running", "waiting")}


class _WorkerCounters:
    """The workers' own running totals, exported as counters at scrape time from the last
    ``set_workers`` (a worker's counter is its process's: it is read, never incremented here)."""

    FAMILIES = (  # name, help, extra label, [(label value, path in the load report)]
        ("worker_retractions", "decode retractions (KV pressure or priority preemption)", None,
         [(None, ("retractions",))]),
        ("worker_preemptions", "decode requests retracted for one of a higher priority (priority scheduling)",
         None, [(None, ("preemptions",))]),
        ("worker_kv_bytes_pushed", "KV bytes a prefill worker pushed", None, [(None, ("bytes_pushed",))]),
        ("worker_hicache_tokens", "hierarchical cache: tokens copied between device and host (backups, load "
         "backs)", "direction", [(d, ("hicache", f"{d}_tokens")) for d in ("device_to_host", "host_to_device")]),
        ("worker_hicache_swa_tokens", "hierarchical cache of a sliding-window model: tokens of its SWA layers' KV "
         "copied between device and host", "direction",
         [(d, ("hicache", f"swa_{d}_tokens")) for d in ("device_to_host", "host_to_device")]),
        ("worker_hicache_backup_failed_tokens", "hierarchical cache: tokens whose device-to-host backup failed "
         "(their host copy dropped)", None, [(None, ("hicache", "device_to_host_failed_tokens"))]),
        ("worker_hicache_storage_pages", "hierarchical cache: pages written to and read from the storage tier",
         "direction", [(d, ("hicache", f"{d}_pages")) for d in ("host_to_storage", "storage_to_host")]),
        ("worker_hicache_swa_storage_pages", "hierarchical cache of a sliding-window model: pages of its SWA "
         "layers' KV written to and read from the storage tier", "direction",
         [(d, ("hicache", f"swa_{d}_pages")) for d in ("host_to_storage", "storage_to_host")]),
        # vLLM's spec_decode_* counters (a list: one sample per draft position, labelled by it)
        ("worker_spec_decode_num_drafts", "speculative decoding: request-steps verified with a draft", None,
         [(None, ("spec_decode", "num_drafts"))]),
        ("worker_spec_decode_num_draft_tokens", "speculative decoding: draft tokens verified", None,
         [(None, ("spec_decode", "num_draft_tokens"))]),
        ("worker_spec_decode_num_accepted_tokens", "speculative decoding: draft tokens accepted", None,
         [(None, ("spec_decode", "num_accepted_tokens"))]),
        ("worker_spec_decode_num_accepted_tokens_per_pos", "speculative decoding: drafts whose token at the "
         "position was accepted", "position", [(None, ("spec_decode", "num_accepted_tokens_per_pos"))]),
    )

    def __init__(self):
        self.workers: List[Dict[str, Any]] = []

    def collect(self) -> Iterator[CounterMetricFamily]:
        for name, doc, extra, values in self.FAMILIES:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["worker", "role"] + ([extra] if extra else []))
            for w in self.workers:
                if not w["alive"]:
                    continue
                for label, path in values:
                    value = w.get("load") or {}
                    for part in path:
                        value = value.get(part) if isinstance(value, dict) else None
                    if isinstance(value, list):
                        for position, count in enumerate(value):
                            family.add_metric([w["id"], w["role"], str(position)], count)
                    elif value is not None:
                        family.add_metric([w["id"], w["role"]] + ([label] if extra else []), value)
            yield family


class _ReadCounter:
    """A counter kept elsewhere (the client's), exported at scrape time from its last ``value``."""

    def __init__(self, name: str, doc: str):
        self.name, self.doc, self.value = name, doc, 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.doc, value=self.value)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model"]
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", "generation requests ended, by finish reason",
                                m + ["finish_reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first token out, both PD legs",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_leg = Histogram(f"{PREFIX}_prefill_leg_seconds", "prefill worker: queue, prefill and KV push",
                                     m, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds", "(e2e - ttft) / (tokens - 1)",
                              m, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "gap between streamed chunks per token",
                             m, buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "arrival to last token", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens", m, registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "generated tokens", m, registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_cached_tokens", "prompt tokens served from a prefix cache "
                                     "(cache hit tokens)", m, registry=r)
        self.prefill_cached_tokens = Counter(f"{PREFIX}_prefill_cached_tokens", "prompt tokens the prefill worker "
                                             "found in its own prefix cache (what prefix-aware routing wins)", m,
                                             registry=r)
        self.decode_cached_tokens = Counter(f"{PREFIX}_decode_cached_tokens", "prompt tokens the decode worker "
                                            "already held (their KV did not move; what decode affinity wins)", m,
                                            registry=r)
        self.transfer_latency = Histogram(f"{PREFIX}_kv_transfer_seconds", "KV push of one request, prefill → decode",
                                          m, buckets=TOKEN_LATENCY_BUCKETS + (5.0, 10.0), registry=r)
        self.transfer_bytes = Counter(f"{PREFIX}_kv_transfer_bytes", "KV bytes pushed prefill → decode", m,
                                      registry=r)
        self.transfer_bandwidth = Histogram(f"{PREFIX}_kv_transfer_bandwidth_bytes_per_second",
                                            "bytes / push time of one request", m, buckets=BANDWIDTH_BUCKETS,
                                            registry=r)
        self.routing = Counter(f"{PREFIX}_routing_decisions", "worker picked per request, by role and policy",
                               ["role", "policy", "worker"], registry=r)
        self.server_running = Gauge(f"{PREFIX}_server_requests_running", "requests holding an admission slot",
                                    registry=r)
        self.server_queued = Gauge(f"{PREFIX}_server_requests_queued", "requests waiting for an admission slot",
                                   registry=r)
        self.autoscaler_desired = Gauge(f"{PREFIX}_autoscaler_desired_workers", "workers the autoscaler's last "
                                        "decision wants on the side (cluster.autoscaler)", ["role"], registry=r)
        w = ["worker", "role"]
        self.worker_up = Gauge(f"{PREFIX}_worker_up", "1 while the worker is in the rotation", w, registry=r)
        self.kv_usage = Gauge(f"{PREFIX}_worker_kv_cache_usage_ratio", "KV slots in use / total", w, registry=r)
        self.queue_len = Gauge(f"{PREFIX}_worker_queue_requests", "requests per worker queue", w + ["queue"],
                               registry=r)
        self.inflight = Gauge(f"{PREFIX}_worker_inflight_requests", "requests routed to the worker, not yet ended",
                              w, registry=r)
        self.host_kv_usage = Gauge(f"{PREFIX}_worker_host_kv_cache_usage_ratio",
                                   "hierarchical cache: host KV slots in use / total", w, registry=r)
        self.host_swa_kv_usage = Gauge(f"{PREFIX}_worker_host_swa_kv_cache_usage_ratio", "hierarchical cache of a "
                                       "sliding-window model: SWA host KV slots in use / total", w, registry=r)
        # the sizes the worker's engine chose at start (SGLang's max_total_num_tokens gauge; vLLM's cache_config_info)
        self.engine_sizes = {key: Gauge(f"{PREFIX}_worker_{key}", doc, w, registry=r) for key, doc in ENGINE_SIZES}
        self.worker_counters = _WorkerCounters()
        r.register(self.worker_counters)
        self.request_retries = _ReadCounter(f"{PREFIX}_request_retries", "requests sent to a new (prefill, decode) "
                                            "pair after a worker of theirs died or was unavailable before their "
                                            "first output")
        r.register(self.request_retries)
        self._routed: set = set()  # label values of the routing counter's series

    def observe_request(self, meta: Dict[str, Any], arrival: float, first_token: float, end: float,
                        policies: Dict[str, str]) -> None:
        """One finished generation (one choice), from its last ``meta_info`` and the server's clock."""
        m = self.model_name
        tokens = meta.get("completion_tokens") or 0
        self.finished.labels(m, (meta.get("finish_reason") or {}).get("type", "unknown")).inc()
        self.prompt_tokens.labels(m).inc(meta.get("prompt_tokens") or 0)
        self.generation_tokens.labels(m).inc(tokens)
        self.cached_tokens.labels(m).inc(meta.get("cached_tokens") or 0)
        self.prefill_cached_tokens.labels(m).inc(meta.get("prefill_cached_tokens") or 0)
        self.decode_cached_tokens.labels(m).inc(meta.get("decode_cached_tokens") or 0)
        self.ttft.labels(m).observe(first_token - arrival)
        self.e2e.labels(m).observe(end - arrival)
        if tokens > 1:
            self.tpot.labels(m).observe((end - first_token) / (tokens - 1))
        if meta.get("ttft_pd") is not None:
            self.prefill_leg.labels(m).observe(meta["ttft_pd"])
        seconds, nbytes = meta.get("transfer_time"), meta.get("transfer_bytes")
        if seconds is not None:
            self.transfer_latency.labels(m).observe(seconds)
        if nbytes:
            self.transfer_bytes.labels(m).inc(nbytes)
            if seconds:
                self.transfer_bandwidth.labels(m).observe(nbytes / seconds)
        for role in ("prefill", "decode"):
            worker = meta.get(f"{role}_worker")
            if worker:
                self.routing.labels(role, policies[role], worker).inc()
                self._routed.add((role, policies[role], worker))

    def observe_itl(self, seconds: float, tokens: int) -> None:
        if tokens > 0:
            per_token = seconds / tokens
            for _ in range(tokens):
                self.itl.labels(self.model_name).observe(per_token)

    def set_retries(self, retries: int) -> None:
        """The client's running total of retries (read at scrape time)."""
        self.request_retries.value = retries

    def set_workers(self, workers: List[Dict[str, Any]], running: int, queued: int) -> None:
        """Per-worker gauges from a fresh ``backend.workers(include_dead=True)``: a worker out of the
        rotation is ``worker_up`` 0 and nothing else; workers that left drop their series (the routing
        counter's too: worker ids are not reused, so those would only pile up)."""
        for gauge in (self.worker_up, self.kv_usage, self.queue_len, self.inflight, self.host_kv_usage,
                      self.host_swa_kv_usage, *self.engine_sizes.values()):
            gauge.clear()
        self.worker_counters.workers = workers
        known = {w["id"] for w in workers}
        for labels in [labels for labels in self._routed if labels[2] not in known]:
            self.routing.remove(*labels)
            self._routed.discard(labels)
        self.server_running.set(running)
        self.server_queued.set(queued)
        for w in workers:
            key, load = (w["id"], w["role"]), w.get("load") or {}
            self.worker_up.labels(*key).set(1 if w["alive"] else 0)
            if not w["alive"]:  # its last load report is stale: only its being down is exported
                continue
            self.inflight.labels(*key).set(w.get("inflight", 0))
            for size, gauge in self.engine_sizes.items():
                if size in w:
                    gauge.labels(*key).set(w[size])
            if "kv_usage" in load:
                self.kv_usage.labels(*key).set(load["kv_usage"])
            for queue in QUEUES.get(w["role"], ()):
                if queue in load:
                    self.queue_len.labels(*key, queue).set(load[queue])
            hicache = load.get("hicache")
            if hicache:
                self.host_kv_usage.labels(*key).set(hicache["host_usage"])
                if "swa_host_usage" in hicache:
                    self.host_swa_kv_usage.labels(*key).set(hicache["swa_host_usage"])
