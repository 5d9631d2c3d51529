"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own per app."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_jax.runtime.compiled import compilations

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Counters, gauges and histograms of one server (names prefixed ``dflash_``)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "requests refused or failed, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "completion tokens of finished requests", registry=r)
        self.drafted = Counter("dflash_drafted_tokens", "draft tokens proposed to the target (DFlash)", registry=r)
        self.accepted = Counter("dflash_accepted_tokens", "draft tokens the target accepted (DFlash)", registry=r)
        self.verify_steps = Counter("dflash_verify_steps", "verify passes of finished requests (DFlash)", registry=r)
        self.running = Gauge("dflash_running_requests", "requests holding a batch row", registry=r)
        self.waiting = Gauge("dflash_waiting_requests", "requests waiting for a row", registry=r)
        self.engine_alive = Gauge("dflash_engine_alive", "1 while the engine thread serves", registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "from arrival to the first token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.latency = Histogram("dflash_request_latency_seconds", "from arrival to the last token", buckets=_LATENCY_BUCKETS,
                                 registry=r)
        self.prefix_hit_tokens = Counter("dflash_prefix_cache_hit_tokens", "prompt tokens restored from the prefix cache "
                                         "instead of prefilled", registry=r)
        self.prefix_bytes = Gauge("dflash_prefix_cache_bytes", "bytes of prefilled blocks the prefix cache holds", registry=r)
        self.preemptions = Counter("dflash_preemptions", "requests preempted from a paged batch to free pages (resumed later)",
                                   registry=r)
        self.kv_pages_free = Gauge("dflash_kv_pages_free", "pages of the paged KV pool no row holds (0 unpaged)", registry=r)
        self.kv_pages_total = Gauge("dflash_kv_pages_total", "pages of the paged KV pool (0 unpaged)", registry=r)
        self.prefix_blocks = Gauge("dflash_prefix_cache_blocks", "prefilled blocks the prefix cache holds", registry=r)
        self.engine_alive.set(1)
        self.compilations = Gauge("dflash_xla_compilations", "XLA programs compiled (or read from the persistent compilation cache) "
                                  "by this process; each new batch shape compiles once, stalling the rows meanwhile", registry=r)
        compilations()  # counting starts now
        self.compilations.set_function(compilations)

    def finished(self, job, done) -> None:
        """Counts one finished request (``job``: :class:`~dflash_jax.serve.jobs.Job`, ``done``:
        its :class:`~dflash_jax.serve.jobs.Done`)."""
        self.requests.labels(done.finish_reason).inc()
        self.prompt_tokens.inc(done.prompt_tokens)
        self.generation_tokens.inc(done.completion_tokens)
        self.latency.observe(time.perf_counter() - job.created)
        if done.speculative:
            self.drafted.inc(done.speculative["drafted_tokens"])
            self.accepted.inc(done.speculative["accepted_tokens"])
            self.verify_steps.inc(done.speculative["verify_steps"])

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
