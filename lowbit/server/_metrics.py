"""The server's Prometheus metrics, in a registry of their own (one per app)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
    """

    def __init__(self, queue_length: Callable[[], int], busy_slots: Callable[[], int], slots: int):
        self.registry = CollectorRegistry()
        r = self.registry
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
