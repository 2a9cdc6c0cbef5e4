"""Fleets of real processes for the tests: tiny chat models exported to stages, the stages and
gateways started on loopback, and :class:`Fleet`, what a test holds of them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from exporter.export import ExportOptions, export_model
from protos.manifest import WeightSpec
from server.ring import Ring
from server.ring.grpc_client import PipelineClient
from testing_support.tiny_models import CHAT_TEMPLATE, CORPUS, JSON_CORPUS, make_draft, make_model
from tests.processes import Proc, start_gateway, start_stages

KEY = "test-key"
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
# A Hermes-style template (Qwen's tool calls) small enough for the tiny tokenizer.
TINY_HERMES_TEMPLATE = (
    "{% if tools %}<s>tools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(', ') }}; call one as <tool_call>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def scrape(url: str, name: str) -> float:
    """A metric without labels, from the Prometheus endpoint at ``url``."""
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


# Eight prompts of different lengths and repeats: interleaved sessions, each equal to itself
# alone (tests/test_stage_ring.py, tests/test_export_parity.py)
EIGHT_PROMPTS = [
    [5, 17, 33, 99, 100, 7, 42, 8],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [200, 150, 100, 50],
    [9, 9, 9, 9, 9, 9],
    [77, 31, 12, 140, 141, 142, 3],
    [250, 3, 250, 3, 250],
    [60, 61, 62],
    [18, 180, 81, 118, 181, 8, 88, 188],
]


@dataclass
class Fleet:
    """A gateway at ``url`` over the stages at ``stages`` (and the processes, where the test
    started them): ``gateways`` names other gateways over the same stages, ``stage_metrics``
    the stages' Prometheus ports."""

    url: str
    model: str = "chat-model"
    source: Path | None = None
    export: Path | None = None
    stages: list[str] = field(default_factory=list)
    gateway: Proc | None = None
    stage_procs: list[Proc] = field(default_factory=list)
    gateways: dict[str, str] = field(default_factory=dict)
    stage_metrics: tuple[int, ...] = ()
    logs: list[Path] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        """The gateway's process id, then every stage's."""
        procs = [p for p in (self.gateway, *self.stage_procs) if p is not None]
        return [p.popen.pid for p in procs if p.popen is not None]

    def client(self, url: str = "", key: str = KEY) -> openai.OpenAI:
        """An openai client of the gateway at ``url`` (default: this fleet's)."""
        return openai.OpenAI(
            base_url=f"{url or self.url}/v1", api_key=key, max_retries=0, timeout=120.0
        )

    def choices(self, finish: str) -> float:
        """``pipeshard_gateway_choices_total`` for one way of ending (0 before the first)."""
        text = httpx.get(f"{self.url}/metrics").text
        pattern = rf'^pipeshard_gateway_choices_total{{finish="{finish}"}} (\S+)$'
        match = re.search(pattern, text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def metric(self, name: str) -> float:
        return scrape(self.url, name)

    def wait_metric(self, name: str, value: float, timeout: float = 60.0) -> None:
        """Until metric ``name`` is ``value`` (the timeout is a hang guard)."""
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} stayed {self.metric(name)}, not {value}"
            time.sleep(0.02)

    def stage_sessions(self) -> list[int]:
        async def infos() -> list[int]:
            client = PipelineClient(self.stages)
            await client.start()
            found = [i.sessions_in_use for i in await client.stage_infos() if i]
            await client.close()
            return found

        return asyncio.run(infos())


def export_chat_model(
    base: Path,
    stages: int = 2,
    *,
    name: str = "chat-model",
    chat_template: str | None = CHAT_TEMPLATE,
    json: bool = False,
    draft: bool = False,
    max_context: int | None = None,
    special_tokens: Sequence[str] = (),
) -> tuple[Path, Path]:
    """A tiny Qwen2 with a chat template, exported to fp32 stages: (source, export). ``json``:
    its tokenizer can write JSON and tool calls; ``draft``: a draft (its weights plus noise)
    exported beside it; ``special_tokens``: the template's markup tokens."""
    corpus = CORPUS + JSON_CORPUS if json else CORPUS
    source = make_model(
        "qwen2",
        base / name,
        chat_template=chat_template,
        corpus=corpus,
        special_tokens=special_tokens,
    )
    drafted = make_draft(source, base / f"{name}-draft", noise=0.3) if draft else None
    export = base / "export"
    export_model(
        ExportOptions(
            model=str(source), out=export, stages=stages, weights=WeightSpec(format="fp32"),
            draft=str(drafted) if drafted else None, max_context=max_context, quiet=True,
        )
    )  # fmt: skip
    return source, export


@contextlib.contextmanager
def hermes_fleet(
    base: Path,
    gateway_flags: Sequence[str] = (),
    name: str = "tool-model",
    max_context: int | None = None,
) -> Iterator[Fleet]:
    """The tiny chat model with a Hermes-style template (Qwen's calls), which can write JSON,
    on 2 stages behind a gateway started with ``gateway_flags``."""
    source, export = export_chat_model(
        base, name=name, chat_template=TINY_HERMES_TEMPLATE, json=True, max_context=max_context
    )
    procs, addresses = start_stages(export, base)
    gateway, url = start_gateway(addresses, base / "gateway.log", list(gateway_flags))
    try:
        yield Fleet(url, name, source, export, addresses, gateway=gateway, stage_procs=procs)
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


@contextlib.contextmanager
def local_gateway(
    export: Path,
    model: str,
    keys: Sequence[str] = (KEY,),
    ring: Ring | None = None,
    **settings: object,
) -> Iterator[Fleet]:
    """The real gateway app over the in-process ring of ``export`` (no stage processes; or
    over ``ring``), served over HTTP by uvicorn on a free loopback port in a thread, serving
    ``model``."""
    import socket
    import threading

    import uvicorn

    from server.api.app import create_app
    from server.ring.local import LocalRing
    from server.settings import GatewaySettings

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = GatewaySettings(
        stages=["127.0.0.1:9"],  # unused: the in-process ring replaces them
        listen=f"127.0.0.1:{port}",
        speculation="off",
        model_name=model,
        api_keys=list(keys),  # type: ignore[arg-type]
        **settings,  # type: ignore[arg-type]
    )
    app = create_app(config, ring or LocalRing(export))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.05)
    try:
        yield Fleet(f"http://127.0.0.1:{port}", model)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
