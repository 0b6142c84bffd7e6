"""The server's counters and histograms in Prometheus' text format (``prometheus_client``), for ``GET /metrics``.

One registry per server (never the process-wide default), so two servers or a restarted one start at zero.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("shardbook_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("shardbook_num_requests_waiting", "Sequences waiting to join the batch", registry=r)
        self.batch_size = Histogram(
            "shardbook_batch_size",
            "Sequences in the batch, sampled per request",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.ttft = Histogram(
            "shardbook_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "shardbook_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.queue = Histogram(
            "shardbook_request_queue_time_seconds",
            "Time waiting before joining the batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("shardbook_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generated_tokens = Counter("shardbook_generation_tokens", "Tokens generated", registry=r)
        self.errors = Counter("shardbook_request_errors", "Failed requests by kind", ["kind"], registry=r)
        self.tool_call_failures = Counter(
            "shardbook_tool_call_parse_failures",
            "Replies whose tool calls could not be read or did not answer the request (returned as text)",
            registry=r,
        )
        self.prefix_hits = Counter(
            "shardbook_prefix_cache_hits", "Requests whose prompt started from kept blocks (prefix reuse)", registry=r
        )
        self.cached_tokens = Counter(
            "shardbook_prefix_cache_cached_tokens", "Prompt tokens taken from kept blocks, not prefilled", registry=r
        )
        self.stored_blocks = Gauge(
            "shardbook_prefix_cache_blocks",
            "Blocks the prefix store keeps now (16 tokens each; an end state counts the blocks its bytes fill)",
            registry=r,
        )
        self.evictions = Gauge(
            "shardbook_prefix_cache_evictions", "Blocks evicted from the prefix store since the load", registry=r
        )
        self.scheduler: Any = None

    def submitted(self, sequences: int, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def finished(self, result: Any) -> None:
        self.generated_tokens.inc(result.generated_tokens)
        self.queue.observe(max(result.queue_s, 0.0))
        if result.cached_tokens:
            self.prefix_hits.inc()
            self.cached_tokens.inc(result.cached_tokens)
        if result.generated_tokens:
            self.ttft.observe(max(result.time_to_first_token_s, 0.0))
        total = getattr(result, "total_s", None)
        if total and result.generated_tokens > 1:
            self.tpot.observe((total - result.time_to_first_token_s) / (result.generated_tokens - 1))
        if result.finish_reason == "error":
            self.error("generation")

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def render(self, scheduler: Any) -> bytes:
        if scheduler is not None:
            running, waiting = scheduler.occupancy()
            self.running.set(running)
            self.waiting.set(waiting)
            self.batch_size.observe(max(scheduler.stats.get("rows", 0), 1))
            store = scheduler.prefix_store
            if store is not None:
                self.stored_blocks.set(store.size)
                self.evictions.set(store.stats["evictions"])
        return generate_latest(self.registry)
