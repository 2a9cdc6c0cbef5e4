"""Settings of the gateway: flags over `PIPESHARD_GATEWAY_*` variables over a TOML config file."""

from __future__ import annotations

import dataclasses
import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from common.net import check_listen, check_tls_pair, default_ov_cache, local_address, split_listen
from server.engine.scheduler import SchedulerConfig
from server.hosts import stages_here

if TYPE_CHECKING:
    from shard_runtime.runner import RunnerOptions

# Prompt tokens per chunk while a paged ring's group decodes: small enough that the group's
# decode steps stay short (docs/benchmarks.md, "Micro-batch groups on paged rings").
PAGED_BUSY_PREFILL_CHUNK = 32
# Running requests per micro-batch group on a paged ring before another group opens (up to one
# per stage): two requests decode faster batched together than pipelined one per group.
PAGED_GROUP_SIZE = 2
# The scheduler's defaults, which the settings below that configure it take as theirs.
SCHEDULER_DEFAULTS = SchedulerConfig()


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPESHARD_GATEWAY_", extra="forbid")

    # NoDecode: the environment gives comma-separated lists, not JSON.
    stages: Annotated[list[str], NoDecode] = Field(
        description="stage addresses HOST:PORT in stage order"
    )
    listen: str = Field(default="127.0.0.1:8000", description="HTTP address HOST:PORT")
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="accepted Bearer keys (none: no authentication)"
    )
    model_name: str | None = Field(
        default=None, description="model id served (default: the export's model id)"
    )
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="other model names every endpoint accepts for the served model (the "
        "names clients such as Claude Code send); /v1/models lists the model id only",
    )
    stream_keepalive_s: float = Field(
        default=5.0,
        ge=0,
        description="a streamed request whose first token takes longer than this (a long "
        "prompt's prefill) starts its stream anyway (the opening events of its API) and sends a "
        "keep-alive (an SSE comment, Anthropic's ping) this often until the output comes, so "
        "clients with a read timeout keep waiting; failures before that are plain HTTP errors; "
        "0: wait for the first token before answering",
    )
    responses_store_size: int = Field(
        default=1000,
        ge=0,
        description="responses of /v1/responses kept in memory for previous_response_id and "
        "GET /v1/responses/{id} (least recently used out first); 0: none are kept",
    )
    tokenizer: Path | None = Field(
        default=None, description="local tokenizer folder (default: fetched from the stages)"
    )
    secret: SecretStr | None = Field(default=None, description="shared secret of the stages")
    tls_ca: Path | None = Field(default=None, description="CA bundle to verify the stages (TLS)")
    tls_server_name: str | None = Field(default=None, description="name in stage certificates")
    tls_cert: Path | None = Field(
        default=None, description="PEM certificate (chain) to serve HTTPS with, with tls_key"
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert")
    step_timeout: float = Field(
        default=60.0, gt=0, description="seconds one pipeline step may take"
    )
    start_timeout: float = Field(
        default=300.0, gt=0, description="seconds to wait for the stages at start-up"
    )
    health_interval: float = Field(
        default=0.5,
        gt=0,
        description="seconds between health probes of every stage (how soon a dead or "
        "returning stage is noticed where no step shows it)",
    )
    health_timeout: float = Field(
        default=1.0, gt=0, description="seconds a stage may take to answer a health probe"
    )
    link_loss_timeout: float = Field(
        default=5.0,
        gt=0,
        description="seconds a stage (or its link to the next stage) may go without "
        "answering the health probes before the steps in flight through it are abandoned "
        "as lost (a cut link: nothing is refused, packets go nowhere); they wait for the "
        "resume grace like those of a stage that went down. A stage busy with a long step "
        "still answers its probes: its step has step_timeout. Longer than health_timeout",
    )
    max_body_bytes: int = Field(default=4 * 2**20, gt=0, description="larger requests get 413")
    max_concurrent: int = Field(
        default=SCHEDULER_DEFAULTS.max_running,
        ge=1,
        description="choices generating at once, each with a KV session on every stage",
    )
    max_queued: int = Field(
        default=SCHEDULER_DEFAULTS.max_queued,
        ge=0,
        description="choices waiting for a slot; beyond it requests get 429",
    )
    queue_timeout: float = Field(
        default=SCHEDULER_DEFAULTS.queue_timeout,
        gt=0,
        description="seconds a choice may wait in the queue (then 503)",
    )
    prefill_chunk: int = Field(
        default=SCHEDULER_DEFAULTS.prefill_chunk,
        ge=1,
        description="prompt tokens per prefill step (long prompts in chunks)",
    )
    max_prefill_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="prefill chunks in the stage ring at once (default "
        f"{SCHEDULER_DEFAULTS.max_prefill_in_flight}; paged rings: no "
        "limit but the token budget, see prefill_chunk_busy)",
    )
    prefill_chunk_busy: int | None = Field(
        default=None,
        ge=1,
        description="prompt tokens a micro-batch group may have in the ring while it decodes "
        f"(default: off, chunks of prefill_chunk; paged rings: {PAGED_BUSY_PREFILL_CHUNK})",
    )
    micro_batch_groups: int | None = Field(
        default=None,
        ge=1,
        description="micro-batch groups the running requests are spread over (default: one "
        f"per stage; paged rings: one per {PAGED_GROUP_SIZE} running requests, up to one per "
        "stage); 1 where the "
        "stages share one machine's cores (pipeshard up does)",
    )
    batching: bool = Field(
        default=True,
        description="several requests' rows in one inference call (paged stages); off: each "
        "running request a micro-batch group of its own, pipelined across the stages, its "
        "one-row steps not padded where no speculation runs (faster for a few users where a "
        "two-row call costs much more than a one-row one: `pipeshard bench batch-cost`)",
    )
    prefix_cache: bool = Field(
        default=True,
        description="paged stages that keep prompt prefixes (their prefix_cache_blocks): a "
        "request's session opens on the KV blocks of its prompt's longest prefix the stages "
        "already hold (a conversation's earlier turns, a shared system prompt), and only the "
        "rest is prefilled; off: every prompt is prefilled whole",
    )
    ring_decode: int = Field(
        default=32,
        ge=0,
        description="without batching or speculation: decode tokens the stage ring produces "
        "on its own after each decode step, the last stage feeding each token straight back "
        "to stage 0 without the round trip through the gateway (0: every step through the "
        "gateway)",
    )
    ring_decode_batched: int = Field(
        default=8,
        ge=0,
        description="with batching (paged stages), no speculation: decode tokens a "
        "micro-batch group's sequences produce on the ring on their own after each decode "
        "step, while no request waits to join a group; a request that arrives meanwhile "
        "starts decoding at most this many tokens later (0: every step through the gateway)",
    )
    resume_grace: float = Field(
        default=SCHEDULER_DEFAULTS.resume_grace,
        ge=0,
        description="seconds in-flight requests wait for a failed stage to come back, then "
        "re-prefill and go on (0: fail them at once)",
    )
    shutdown_grace: float = Field(
        default=5.0,
        ge=0,
        description="when the gateway is stopped (SIGTERM, Ctrl-C): seconds the requests in "
        "flight get to finish; then the rest end with 503 / an error event (code "
        "server_shutting_down), so the stop never hangs on a long generation",
    )
    reasoning_parser: Literal["auto", "none", "think", "harmony"] = Field(
        default="auto",
        description="how the model's reasoning is split from its answer "
        "(message.reasoning_content): think (<think>...</think>, opened by the model or by "
        "the chat template), harmony (gpt-oss's analysis / final / commentary channels), "
        "none (everything is content); auto: read from the chat template, else the "
        "architecture",
    )
    draft: Path | None = Field(
        default=None, description="draft export folder (export/draft) for speculative decoding"
    )
    speculation: Literal["auto", "draft", "ngram", "off"] = Field(
        default="auto",
        description="proposer: the draft model, prompt lookup (ngram), off; auto = draft if given",
    )
    spec_k: int = Field(
        default=0, ge=0, le=16, description="draft tokens per step; 0 = adaptive per request"
    )
    spec_max_k: int = Field(default=8, ge=1, le=16, description="largest adaptive K")
    speculation_max_users: int | Literal["auto"] = Field(
        default="auto",
        description="speculate only while at most this many requests decode at once; with "
        "more, every step decodes plain (and the ring decodes on its own) until they are "
        "fewer again; 0 = no limit (adaptive K decides at every load); auto = 1 where a stage "
        "runs on this machine (the draft shares its cores), else 0",
    )
    draft_device: str = Field(default="CPU", description="OpenVINO device of the draft")
    draft_threads: int = Field(default=0, ge=0, description="draft inference threads (0: auto)")
    draft_kv_cache_size: float = Field(
        default=0.5,
        gt=0,
        description="GiB of KV blocks the draft holds (allocated at start; its sequences and "
        "its prefix cache share them)",
    )
    ov_cache_dir: Path | None = Field(
        default_factory=default_ov_cache, description="OpenVINO model cache for the draft"
    )
    json_schema_additional_properties: Literal["closed", "open"] = Field(
        default="closed",
        description="tool arguments and strict JSON schemas (response_format json_schema with "
        "strict true): closed, an object schema that names its properties and says nothing of "
        "additionalProperties takes no other keys (additionalProperties false, as with "
        "xgrammar's strict mode in vLLM); open: such schemas are enforced as written, extra "
        "keys allowed",
    )
    unknown_fields: Literal["warn", "reject"] = Field(
        default="warn",
        description="request fields the gateway does not know (other servers' extensions, "
        "typos): warn, accepted and ignored, named in a warning in the log and in the "
        "response header x-pipeshard-ignored-fields; reject, a 400 naming the first one",
    )
    log_level: str = Field(default="INFO")

    def speculation_limit(self, draft_model: bool = True) -> tuple[int, str]:
        """speculation_max_users resolved, and why. "auto": 1 where the draft model shares the
        cores of a stage on this machine, else 0 (prompt lookup uses no model)."""
        if self.speculation_max_users != "auto":
            return self.speculation_max_users, "speculation_max_users"
        if not draft_model:
            return 0, "auto: no draft model"
        here = stages_here(self.stages)
        if not here:
            return 0, "auto: no stage runs on this machine"
        return 1, (
            f"auto: stage {here[0]} ({self.stages[here[0]]}) runs on this machine and the "
            "draft takes its cores; --speculation-max-users 0 lifts the limit"
        )

    def draft_runner_options(self) -> RunnerOptions:
        """How the draft model is compiled: its device and threads, the OpenVINO cache, and
        sessions for every running request's draft with room to spare."""
        from shard_runtime.runner import RunnerOptions

        return RunnerOptions.from_settings(
            self,
            device=self.draft_device,
            threads=self.draft_threads,
            max_sessions=4 * self.max_concurrent,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_running=self.max_concurrent,
            max_queued=self.max_queued,
            queue_timeout=self.queue_timeout,
            prefill_chunk=self.prefill_chunk,
            max_prefill_in_flight=self.max_prefill_in_flight
            or SCHEDULER_DEFAULTS.max_prefill_in_flight,
            resume_grace=self.resume_grace,
            busy_prefill_chunk=self.prefill_chunk_busy,
        )

    def ring_scheduler_config(
        self,
        stages: int,
        paged: bool,
        kv_pools: tuple[tuple[int, int], ...] = (),
        prefix_block_size: int | None = None,
        state_pools: tuple[tuple[int, int], ...] = (),
    ) -> SchedulerConfig:
        """The scheduler for a ring of ``stages`` stages: one micro-batch group per stage, or
        ``micro_batch_groups``. On paged stages (batched inference) the groups move in
        lockstep, one opens per PAGED_GROUP_SIZE running sequences (unless the count is
        fixed), a group's prompts share a token budget per step
        (prefill_chunk, or prefill_chunk_busy while the group decodes) instead of going one
        chunk at a time, and the groups decode ``ring_decode_batched`` tokens on the ring on
        their own while no request waits to join one. Without ``batching`` every running
        sequence is a group of its own (SchedulerConfig.solo), on any backend. ``kv_pools``:
        the paged stages' block pools, which admission, prompt chunks and decode steps must
        fit (the newest sequence is preempted if not). ``prefix_block_size``: the block size
        in which every stage keeps prompt prefixes (None: they keep none), for prefix_cache.
        ``state_pools``: the hybrid paged stages' state slots, which admission counts too."""
        groups = self.micro_batch_groups or stages
        config = dataclasses.replace(
            self.scheduler_config(),
            groups=groups,
            kv_pools=kv_pools,
            state_pools=state_pools,
            prefix_cache=self.prefix_cache and prefix_block_size is not None,
        )
        if not self.batching:
            return dataclasses.replace(
                config,
                groups=max(self.max_concurrent, groups),
                max_prefill_in_flight=self.max_prefill_in_flight or self.max_concurrent,
                busy_prefill_chunk=self.prefill_chunk_busy or PAGED_BUSY_PREFILL_CHUNK,
                lockstep=True,
                solo=True,
                ring_decode=self.ring_decode,
            )
        if paged:
            config = dataclasses.replace(
                config,
                max_prefill_in_flight=self.max_prefill_in_flight or self.max_concurrent,
                busy_prefill_chunk=self.prefill_chunk_busy or PAGED_BUSY_PREFILL_CHUNK,
                lockstep=True,
                group_size=0 if self.micro_batch_groups else PAGED_GROUP_SIZE,
                ring_decode=self.ring_decode_batched,
            )
        return config

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the gateway (loopback for a wildcard
        listen address)."""
        return f"{self.scheme}://{local_address(self.listen)}"

    @property
    def open_to_the_network(self) -> bool:
        """Listening beyond loopback with no API key: anyone who reaches the port can use it."""
        host = split_listen(self.listen)[0]
        if self.api_keys or host == "localhost":
            return False
        try:
            return not ipaddress.ip_address(host).is_loopback
        except ValueError:  # a host name
            return True

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        return check_listen(value)

    @model_validator(mode="after")
    def _check_tls(self) -> GatewaySettings:
        check_tls_pair(self.tls_cert, self.tls_key)
        return self

    @model_validator(mode="after")
    def _check_link_loss(self) -> GatewaySettings:
        if self.link_loss_timeout <= self.health_timeout:
            raise ValueError(
                f"link_loss_timeout ({self.link_loss_timeout:g}) must be longer than "
                f"health_timeout ({self.health_timeout:g}): one slow probe is no lost link"
            )
        return self

    @model_validator(mode="after")
    def _check_batching(self) -> GatewaySettings:
        if not self.batching and self.micro_batch_groups is not None:
            raise ValueError(
                "micro_batch_groups and batching=false do not go together: without batching "
                "every running request is a group of its own"
            )
        return self

    @field_validator("speculation_max_users", mode="before")
    @classmethod
    def _check_speculation_max_users(cls, value: Any) -> Any:
        return speculation_users(value)

    @field_validator("stages", "api_keys", "model_aliases", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one stage address is needed")
        for address in value:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"stage address must be HOST:PORT, got {address!r}")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        config = _CONFIG_FILE.get("path")
        if config is not None:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=config),)
        return sources

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> GatewaySettings:
        """Flags (``overrides``) win over environment variables, which win over the file."""
        if config_file is not None and not config_file.is_file():
            raise ValueError(f"config file {config_file} does not exist")
        _CONFIG_FILE["path"] = config_file
        try:
            return cls(**overrides)
        finally:
            _CONFIG_FILE["path"] = None


_CONFIG_FILE: dict[str, Path | None] = {"path": None}


def speculation_users(value: Any) -> int | Literal["auto"]:
    """A speculation_max_users value: "auto" or a number of requests, 0 (no limit) or more."""
    if value == "auto":
        return "auto"
    try:
        users = int(value)
    except (TypeError, ValueError):
        users = -1
    if users < 0 or isinstance(value, bool | float):
        raise ValueError(f"must be auto or a number of requests, 0 (no limit) or more: {value!r}")
    return users
