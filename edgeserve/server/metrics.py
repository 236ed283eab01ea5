"""Prometheus metrics: latency histograms, token counters, engine gauges read at scrape time."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from edgeserve.server.model_manager import ModelEntry, ModelManager

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)


class Metrics:
    """One registry per app, so several servers in one process (tests) do not collide."""

    def __init__(self, manager: "ModelManager") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("edgeserve_time_to_first_token_seconds", "Request arrival to first generated token",
                              ["model"], buckets=_LATENCY, registry=r)
        self.tpot = Histogram("edgeserve_time_per_output_token_seconds", "Mean time between output tokens of a request",
                              ["model"], buckets=_TPOT, registry=r)
        self.e2e = Histogram("edgeserve_e2e_request_latency_seconds", "Request arrival to last token",
                             ["model"], buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("edgeserve_prompt_tokens", "Prompt tokens of finished requests", ["model"],
                                     registry=r)
        self.cached_tokens = Counter("edgeserve_cached_prompt_tokens", "Prompt tokens reused from the prefix cache",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("edgeserve_generation_tokens", "Generated tokens", ["model"], registry=r)
        self.requests = Counter("edgeserve_http_requests", "HTTP requests by route and status code",
                                ["path", "status"], registry=r)
        self.embed_requests = Counter("edgeserve_embedding_requests", "Finished embedding requests", ["model"],
                                      registry=r)
        self.embed_inputs = Counter("edgeserve_embedding_inputs", "Inputs (texts or token lists) embedded", ["model"],
                                    registry=r)
        self.embed_tokens = Counter("edgeserve_embedding_tokens", "Tokens embedded", ["model"], registry=r)
        self.embed_latency = Histogram("edgeserve_embedding_request_latency_seconds",
                                       "Embedding request arrival to vectors (model load excluded)", ["model"],
                                       buckets=_LATENCY, registry=r)
        self.load_seconds = Histogram("edgeserve_model_load_seconds", "Time to load a model", ["model"],
                                      buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320), registry=r)
        r.register(_EngineCollector(manager))

    def observe_load(self, entry: "ModelEntry") -> None:
        """Record one finished model load."""
        if entry.load_seconds is not None:
            self.load_seconds.labels(entry.id).observe(entry.load_seconds)

    def observe_request(self, model: str, ttft: float | None, e2e: float, num_prompt: int, num_cached: int,
                        num_output: int) -> None:
        """Record one finished generation (one choice)."""
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
            if num_output > 1:
                self.tpot.labels(model).observe((e2e - ttft) / (num_output - 1))
        self.e2e.labels(model).observe(e2e)
        self.prompt_tokens.labels(model).inc(num_prompt)
        self.cached_tokens.labels(model).inc(num_cached)
        self.generation_tokens.labels(model).inc(num_output)

    def observe_embedding(self, model: str, num_inputs: int, num_tokens: int, seconds: float) -> None:
        """Record one finished embedding request."""
        self.embed_requests.labels(model).inc()
        self.embed_inputs.labels(model).inc(num_inputs)
        self.embed_tokens.labels(model).inc(num_tokens)
        self.embed_latency.labels(model).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges read from each loaded engine's stats() when scraped (an embedding engine has only running / waiting)."""

    def __init__(self, manager: "ModelManager") -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "num_running": GaugeMetricFamily("edgeserve_num_requests_running", "Requests in the running batch",
                                             labels=["model"]),
            "num_waiting": GaugeMetricFamily("edgeserve_num_requests_waiting", "Requests waiting to be scheduled",
                                             labels=["model"]),
            "kv_blocks_used": GaugeMetricFamily("edgeserve_kv_blocks_used", "KV blocks held by running requests",
                                                labels=["model"]),
            "kv_blocks_cached": GaugeMetricFamily("edgeserve_kv_blocks_cached",
                                                  "Free KV blocks still holding a reusable prefix", labels=["model"]),
            "kv_blocks_total": GaugeMetricFamily("edgeserve_kv_blocks_total", "KV blocks in the pool",
                                                 labels=["model"]),
            "kv_cache_bytes": GaugeMetricFamily("edgeserve_kv_cache_bytes", "Bytes of the KV pool", labels=["model"]),
            **{key: GaugeMetricFamily(f"edgeserve_{key}", f"Hybrid models' recurrent states: {text}", labels=["model"])
               for key, text in (("state_slots_used", "slots held by running requests"),
                                 ("state_slots_total", "slots for running requests"),
                                 ("state_snapshots", "prefix-cache snapshots held"),
                                 ("state_bytes", "bytes of the state pool"),
                                 ("prompt_tokens_from_states", "prompt tokens served from state snapshots (not "
                                  "computed)"))},
        }
        preempt = CounterMetricFamily("edgeserve_preemptions", "Requests preempted for lack of KV blocks",
                                      labels=["model"])
        loaded = GaugeMetricFamily("edgeserve_model_loaded", "1 when loaded, 0.5 while loading", labels=["model"])
        kv_dtype = GaugeMetricFamily("edgeserve_kv_cache_dtype", "1 for what the KV pool stores per value "
                                     "(--kv-cache-dtype resolved: bf16, f16, f32, q8_0)", labels=["model", "dtype"])
        offload: dict[str, GaugeMetricFamily] = {}
        spec = {key: GaugeMetricFamily(f"edgeserve_{key}", f"Speculative decoding: {key[5:].replace('_', ' ')}",
                                       labels=["model"])
                for key in ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications",
                            "spec_acceptance_rate", "spec_mean_accepted_length")}
        for entry in list(self.manager.entries.values()):
            loaded.add_metric([entry.id], 1.0 if entry.state == "loaded" else 0.5)
            engine = entry.engine
            if engine is None:
                continue

            stats = engine.stats()
            if getattr(engine, "is_embedding", False):
                for key in ("num_running", "num_waiting"):
                    gauges[key].add_metric([entry.id], float(getattr(stats, key)))
                continue
            for key, g in gauges.items():
                g.add_metric([entry.id], float(getattr(stats, key)))
            preempt.add_metric([entry.id], float(stats.num_preemptions))
            kv_dtype.add_metric([entry.id, stats.kv_cache_dtype], 1.0)
            for key, family in spec.items():
                family.add_metric([entry.id], float(getattr(stats, key)))
            if stats.offload is not None:  # KV tiers: blocks and bytes per tier, hits per tier, bytes moved, swaps
                for key, value in vars(stats.offload).items():
                    family = offload.get(key) or offload.setdefault(key, GaugeMetricFamily(
                        f"edgeserve_kv_offload_{key}", f"KV offload tiers: {key.replace('_', ' ')}", labels=["model"]))
                    family.add_metric([entry.id], float(value))
        yield from offload.values()
        yield from self._vision()
        yield from gauges.values()
        yield from spec.values()
        yield preempt
        yield loaded
        yield kv_dtype

    def _vision(self) -> Iterator[Metric]:
        """The image encoder's cache hits and misses and its time, per model that takes images."""
        families = {key: CounterMetricFamily(f"edgeserve_image_{key}", text, labels=["model"]) for key, text in (
            ("encoder_cache_hits", "Images whose encoder output came from the cache"),
            ("encoder_cache_misses", "Images the vision encoder ran for"),
            ("encode_seconds", "Seconds spent in the vision encoder"))}
        for entry in list(self.manager.entries.values()):
            runtime = getattr(getattr(entry, "lm", None), "vision", None) if entry.engine is not None else None
            if runtime is not None:
                for key, value in (("encoder_cache_hits", runtime.hits), ("encoder_cache_misses", runtime.misses),
                                   ("encode_seconds", runtime.encode_seconds)):
                    families[key].add_metric([entry.id], float(value))
        yield from families.values()
