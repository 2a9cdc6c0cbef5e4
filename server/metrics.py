"""Prometheus metrics of the gateway (served on its own /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _Link(Protocol):
    @property
    def address(self) -> str: ...
    @property
    def bytes_out(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...


class _LinkBytes(Collector):
    """``pipeshard_gateway_link_bytes_total``, read from the ring's stages at each scrape."""

    def __init__(self, stages: Callable[[], Sequence[_Link]]) -> None:
        self.stages = stages

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "pipeshard_gateway_link_bytes",
            "Payload bytes of steps sent to and results received from each stage (peer: the "
            "stage's address)",
            labels=["direction", "peer"],
        )
        for stage in self.stages():
            if stage.bytes_out or stage.bytes_in:
                family.add_metric(["out", stage.address], stage.bytes_out)
                family.add_metric(["in", stage.address], stage.bytes_in)
        yield family


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._links = _LinkBytes(lambda: ())
        self.registry.register(self._links)
        self.requests = Counter(
            "pipeshard_gateway_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.choices = Counter(
            "pipeshard_gateway_choices",
            "Choices ended, by how: stop, length, cancelled (the client left), error (a stage "
            "failed, the gateway stopped, ...); a stream that fails after its 200 counts here",
            ["finish"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pipeshard_gateway_time_to_first_token_seconds",
            "From request received to first token sampled",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "pipeshard_gateway_inter_token_latency_seconds",
            "Time between consecutive tokens of one choice",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_cached_tokens = Counter(
            "pipeshard_gateway_prompt_cached_tokens",
            "Prompt tokens whose KV the stages took from their prefix cache (hit rate: this over "
            "pipeshard_gateway_prompt_tokens_total)",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "pipeshard_gateway_prompt_tokens", "Prompt tokens processed", registry=self.registry
        )
        self.generated_tokens = Counter(
            "pipeshard_gateway_generated_tokens", "Tokens generated", registry=self.registry
        )
        self.running = Gauge(
            "pipeshard_gateway_requests_running",
            "Choices holding a running slot (a KV session on every stage)",
            registry=self.registry,
        )
        self.queued = Gauge(
            "pipeshard_gateway_requests_queued",
            "Choices waiting in the queue for a running slot",
            registry=self.registry,
        )
        self.steps_in_flight = Gauge(
            "pipeshard_gateway_steps_in_flight",
            "Steps sent into the stage ring and not yet returned (one per running choice at most)",
            registry=self.registry,
        )
        self.spec_proposed = Counter(
            "pipeshard_gateway_spec_proposed_tokens",
            "Draft tokens proposed for verification (speculative decoding)",
            registry=self.registry,
        )
        self.spec_accepted = Counter(
            "pipeshard_gateway_spec_accepted_tokens",
            "Draft tokens the target accepted; accepted / proposed is the acceptance rate",
            registry=self.registry,
        )
        self.spec_steps = Counter(
            "pipeshard_gateway_spec_steps",
            "Decode steps where a proposer is configured, by mode: speculative (proposals "
            "verified), paused (plain: more requests decode than speculation_max_users), "
            "plain (no proposal: the draft still taking in a prompt, or K chosen 0)",
            ["mode"],
            registry=self.registry,
        )
        self.spec_k = Histogram(
            "pipeshard_gateway_spec_k",
            "Draft tokens proposed per speculative step (K)",
            buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16),
            registry=self.registry,
        )
        self.draft_seconds = Histogram(
            "pipeshard_gateway_draft_seconds",
            "Time the proposer took for one step's proposal",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.preemptions = Counter(
            "pipeshard_gateway_preemptions",
            "Choices that gave up their KV blocks on paged stages to let others decode, and "
            "re-prefilled later to go on",
            registry=self.registry,
        )
        self.resumed = Counter(
            "pipeshard_gateway_resumed",
            "Choices that lost their sessions to a stage failure and re-prefilled to go on",
            registry=self.registry,
        )
        self.queue_seconds = Histogram(
            "pipeshard_gateway_queue_seconds",
            "Time a choice waited in the queue before it got a running slot",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch_links(self, stages: Callable[[], Sequence[_Link]]) -> None:
        """Report the bytes the gateway exchanges with the stages ``stages()`` returns."""
        self._links.stages = stages
