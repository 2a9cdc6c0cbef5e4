"""Prometheus metrics of one stage process (served on its own port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class StageMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.forward_seconds = Histogram(
            "pipeshard_stage_forward_seconds",
            "Time of one forward pass of this stage's layers",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rollback_seconds = Histogram(
            "pipeshard_stage_rollback_seconds",
            "Time to forget a session's last positions (rejected speculative tokens)",
            buckets=(0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS),
            registry=self.registry,
        )
        self.sessions = Gauge(
            "pipeshard_stage_sessions", "Sessions holding KV state", registry=self.registry
        )
        self.tokens = Counter(
            "pipeshard_stage_tokens", "Tokens processed", ["phase"], registry=self.registry
        )
        self.bytes = Counter(
            "pipeshard_stage_bytes",
            "Payload bytes of steps received and sent",
            ["direction"],
            registry=self.registry,
        )
        self.link_bytes = Counter(
            "pipeshard_stage_link_bytes",
            "Payload bytes of steps and results per link: received from and sent to each peer "
            "(in: the caller's host; out: the next stage's address, or the gateway's host for "
            "results)",
            ["direction", "peer"],
            registry=self.registry,
        )
        self.steps_in_flight = Gauge(
            "pipeshard_stage_steps_in_flight",
            "Steps received and not yet passed on (waiting or computing)",
            registry=self.registry,
        )
        self.compute_running = Gauge(
            "pipeshard_stage_compute_running_seconds",
            "How long the oldest inference call in progress has run (0: none); one that keeps "
            "growing is a hung device",
            registry=self.registry,
        )
        self.busy_seconds = Counter(
            "pipeshard_stage_busy_seconds",
            "Time spent computing steps; its rate / streams is the busy fraction",
            registry=self.registry,
        )
        self.errors = Counter(
            "pipeshard_stage_errors",
            "Failed steps by gRPC status code",
            ["code"],
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "pipeshard_stage_batch_size",
            "Sessions computed in one inference call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self.batch_tokens = Histogram(
            "pipeshard_stage_batch_tokens",
            "Positions computed in one inference call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
            registry=self.registry,
        )
        self.loop_steps = Counter(
            "pipeshard_stage_loop_steps",
            "Decode steps this last stage fed back to stage 0 itself (Step.follow)",
            registry=self.registry,
        )
        self.kv_blocks = Gauge(
            "pipeshard_stage_kv_blocks",
            "Paged KV blocks by state (used, free; cached: of the free ones, blocks of known "
            "prefixes no session holds); absent on the stateful backend",
            ["state"],
            registry=self.registry,
        )
        self.state_slots = Gauge(
            "pipeshard_stage_state_slots",
            "Linear-attention state slots of a hybrid model's paged stage by state (used, "
            "free); absent elsewhere",
            ["state"],
            registry=self.registry,
        )
        self.prefix_blocks = Counter(
            "pipeshard_stage_prefix_cache_hit_blocks",
            "KV blocks new sessions took from the prefix cache instead of computing them",
            registry=self.registry,
        )
        self.kv_blocks_evicted = Counter(
            "pipeshard_stage_kv_blocks_evicted",
            "Cached prefix blocks given to other content (the pool needed their room)",
            registry=self.registry,
        )
