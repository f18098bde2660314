"""`/metrics` in Prometheus' text format (names as vLLM's, prefix `sparseserve:`).

Gauges read the engine at scrape time (requests running and waiting, KV-cache usage); latency
histograms and token counters are recorded per finished request by the serving layer; the
speculative-decoding counters are read from the engine's `SpecDecodeMetrics`. Each app has its own
registry, so several servers in one process (tests) do not collide.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from ...engine.async_engine import AsyncLLMEngine

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0)


@dataclass
class RequestTimer:
    """Times of one request, measured where its outputs reach the server."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    itl: list[float] = field(default_factory=list)

    def on_tokens(self) -> None:
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            self.itl.append(now - self.last_token)
        self.last_token = now


class _SpecCollector:
    def __init__(self, engine: AsyncLLMEngine, labels: dict) -> None:
        self.engine, self.labels = engine, labels

    def collect(self):
        spec = self.engine.engine.spec_metrics
        for name, value, doc in (("num_drafts", spec.num_verify_steps, "request-steps that verified drafts"),
                                 ("num_draft_tokens", spec.num_draft_tokens, "draft tokens verified"),
                                 ("num_accepted_tokens", spec.num_accepted_tokens, "draft tokens accepted")):
            family = CounterMetricFamily(f"sparseserve:spec_decode_{name}", doc, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), value)
            yield family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)
        self._labels = labels

        def gauge(name: str, doc: str, read) -> None:
            g = Gauge(f"sparseserve:{name}", doc, names, registry=self.registry)
            g.labels(**labels).set_function(read)

        gauge("num_requests_running", "requests in the running batch", lambda: engine.stats().num_running)
        gauge("num_requests_waiting", "requests waiting for a seat", lambda: engine.stats().num_waiting)
        gauge("kv_cache_usage_perc", "fraction of KV-cache blocks in use (1 = full)",
              lambda: engine.stats().kv_cache_usage)
        self.ttft = Histogram("sparseserve:time_to_first_token_seconds", "time to first token", names,
                              buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self.tpot = Histogram("sparseserve:time_per_output_token_seconds", "time per output token after the first",
                              names, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self.itl = Histogram("sparseserve:inter_token_latency_seconds", "time between two outputs of a request",
                             names, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self.e2e = Histogram("sparseserve:e2e_request_latency_seconds", "request latency, arrival to last token",
                             names, buckets=_REQUEST_BUCKETS, registry=self.registry).labels(**labels)
        self.prompt_tokens = Counter("sparseserve:prompt_tokens", "prompt tokens of finished requests", names,
                                     registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("sparseserve:generation_tokens", "tokens generated", names,
                                         registry=self.registry).labels(**labels)
        self.success = Counter("sparseserve:request_success", "finished requests by finish reason",
                               names + ["finished_reason"], registry=self.registry)
        self.registry.register(_SpecCollector(engine, labels))

    def record(self, timer: RequestTimer, prompt_tokens: int, output_tokens: list[int],
               finish_reasons: list[str | None]) -> None:
        end = time.perf_counter()
        self.e2e.observe(end - timer.start)
        if timer.first_token is not None:
            self.ttft.observe(timer.first_token - timer.start)
            longest = max(output_tokens, default=0)
            if longest > 1:
                self.tpot.observe((end - timer.first_token) / (longest - 1))
        for gap in timer.itl:
            self.itl.observe(gap)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(sum(output_tokens))
        for reason in finish_reasons:
            self.success.labels(finished_reason=reason or "abort", **self._labels).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
