"""The server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lowbit.server._prefix import PrefixIndex
from lowbit.server._speculate import Stats as SpeculationStats

__all__ = ["CONTENT_TYPE", "Metrics"]

# Seconds: first token after a queue and a prefill; per-token gaps of a decode step.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class Metrics:
    """Counters, gauges and histograms of one server.

    Args:
      queue_length: returns the number of requests waiting for a slot.
      busy_slots: returns the number of slots decoding a request.
      slots: the number of slots.
      prefix: the scheduler's prefix cache, or None (no prefix-cache metrics).
      compiling: returns the number of programs not compiled yet (the background compile
        after start), or None (no such gauge).
      speculation: the scheduler's speculative decoding counts, or None (not speculating).
    """

    def __init__(
        self,
        queue_length: Callable[[], int],
        busy_slots: Callable[[], int],
        slots: int,
        prefix: PrefixIndex | None = None,
        compiling: Callable[[], int] | None = None,
        speculation: SpeculationStats | None = None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        if prefix is not None:
            r.register(_PrefixCollector(prefix))
        if speculation is not None:
            r.register(_SpeculationCollector(speculation))
        self.requests = Counter(
            "lowbit_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("lowbit_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("lowbit_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter(
            "lowbit_finished_requests",
            "generation requests by finish reason",
            ["reason"],
            registry=r,
        )
        queue = Gauge("lowbit_queue_length", "requests waiting for a slot", registry=r)
        queue.set_function(lambda: float(queue_length()))
        busy = Gauge("lowbit_busy_slots", "slots decoding a request", registry=r)
        busy.set_function(lambda: float(busy_slots()))
        occupancy = Gauge("lowbit_batch_occupancy", "busy slots / slots", registry=r)
        occupancy.set_function(lambda: busy_slots() / slots)
        Gauge("lowbit_slots", "decode slots (the batch size)", registry=r).set(slots)
        if compiling is not None:
            pending = Gauge(
                "lowbit_programs_compiling", "programs not compiled yet (after start)", registry=r
            )
            pending.set_function(lambda: float(compiling()))
        self.ttft = Histogram(
            "lowbit_time_to_first_token_seconds",
            "from arrival to the first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "lowbit_time_per_output_token_seconds",
            "mean time per token after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return generate_latest(self.registry)


class _PrefixCollector:
    """The prefix cache's counts, read when scraped (the scheduler thread keeps them)."""

    def __init__(self, index: PrefixIndex):
        self.index = index

    def collect(self):
        s, index = self.index.stats, self.index
        yield CounterMetricFamily(
            "lowbit_prefix_cache_queried_tokens",
            "prompt tokens that looked up the prefix cache",
            value=s.queried_tokens,
        )
        yield CounterMetricFamily(
            "lowbit_prefix_cache_hit_tokens",
            "prompt tokens read from the prefix cache instead of prefilled",
            value=s.hit_tokens,
        )
        yield CounterMetricFamily(
            "lowbit_prefix_cache_evictions", "blocks evicted to make room", value=s.evictions
        )
        yield GaugeMetricFamily(
            "lowbit_prefix_cache_hit_rate",
            "hit tokens / queried tokens since start",
            value=s.hit_tokens / max(s.queried_tokens, 1),
        )
        yield GaugeMetricFamily(
            "lowbit_prefix_cache_blocks_used", "blocks holding a prefix", value=index.used
        )
        yield GaugeMetricFamily(
            "lowbit_prefix_cache_blocks", "blocks in the prefix cache", value=index.blocks
        )


class _SpeculationCollector:
    """Speculative decoding's counts, read when scraped (the scheduler thread keeps them)."""

    def __init__(self, stats: SpeculationStats):
        self.stats = stats

    def collect(self):
        yield CounterMetricFamily(
            "lowbit_speculation_drafted_tokens",
            "tokens guessed by prompt lookup and checked",
            value=self.stats.drafted_tokens,
        )
        yield CounterMetricFamily(
            "lowbit_speculation_accepted_tokens",
            "guessed tokens the model confirmed and the server handed out",
            value=self.stats.accepted_tokens,
        )
