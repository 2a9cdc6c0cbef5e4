"""What the network costs: one fleet on one host (loopback) against the gateway and every stage
on hosts of their own over shaped links (a lab of network namespaces, benchmarks/lab.py).

For each network (``loopback``, or ``RATE:DELAY_MS`` such as ``100mbit:5``: every host's link
at RATE both ways, DELAY_MS each way on every link into a stage, by a latency proxy):

- time to first token of prompts of each ``--prompts`` length (raw token ids, no two sharing a
  prefix, one request at a time, ``max_tokens`` 1), median over ``--rounds``;
- decode tokens per second at each ``--users`` count (concurrent streams of ``--tokens``
  tokens, end-of-sequence ignored): the sum over the streams of (tokens - 1) / (last token -
  first token);
- bytes per prompt token (from the TTFT requests) and per decoded token (the decode runs, their
  prompts' share taken off), as payload (the stages' and the gateway's
  ``*_link_bytes_total`` summed over every hop) and, on the lab's links, as bytes on the wire
  (every byte the hosts' interfaces sent: TCP/IP headers, gRPC framing, health probes and the
  client's HTTP included).

Root only (network namespaces). Usage::

    pipeshard bench links [--export DIR] [--networks loopback,1gbit:1,100mbit:5]
        [--users 1,4,8] [--prompts 500,2000] [--tokens 64] [--rounds 3] [--quick]

Writes links-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lab import Lab, LabFleet, free_subnet, start_fleet, unavailable
from benchmarks.report import add_results_option, describe, machine, save
from common.net import default_ov_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Network:
    name: str
    rate: str | None  # None: loopback (every process on one host)
    delay_ms: float

    @property
    def loopback(self) -> bool:
        return self.rate is None


def parse_network(text: str) -> Network:
    if text == "loopback":
        return Network("loopback", None, 0.0)
    rate, sep, delay = text.partition(":")
    try:
        from benchmarks.lab import rate_bits

        rate_bits(rate)
        delay_ms = float(delay) if sep else 0.0
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"a network is `loopback` or RATE:DELAY_MS (e.g. 100mbit:5): {text!r} ({exc})"
        ) from exc
    label = f"{rate} + {delay_ms:g} ms" if delay_ms else rate
    return Network(label, rate, delay_ms)


def numbers(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4,8: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1: {text!r}")
    return values


def payload_bytes(fleet: LabFleet) -> float:
    """Every hop's payload so far: what the gateway and each stage sent."""
    total = 0.0
    urls = [(f"{fleet.url}/metrics", "pipeshard_gateway_link_bytes_total"), *(
        (url, "pipeshard_stage_link_bytes_total") for url in fleet.metrics
    )]  # fmt: skip
    for url, name in urls:
        text = httpx.get(url, verify=fleet.verify, timeout=30).text
        for match in re.finditer(rf'^{name}\{{direction="out",[^}}]*\}} (\S+)$', text, re.M):
            total += float(match.group(1))
    return total


def wire_bytes(lab: Lab) -> int:
    """Bytes every host has sent on its link (the bridge end of its veth received them)."""
    return sum(
        int(Path(f"/sys/class/net/{h.veth}/statistics/rx_bytes").read_text()) for h in lab.hosts
    )


class Client:
    def __init__(self, fleet: LabFleet, model: str, vocab: int, seed: int = 0) -> None:
        import numpy as np

        self.fleet = fleet
        self.model = model
        self.rng = np.random.default_rng(seed)
        self.high = min(vocab, 30000)  # ordinary tokens, well below any special ones

    def prompt(self, length: int) -> list[int]:
        return [int(x) for x in self.rng.integers(100, self.high, size=length)]

    async def stream(
        self, session: httpx.AsyncClient, prompt: list[int], tokens: int
    ) -> tuple[float, list[float]]:
        """When the request went out, and when each token came."""
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip
        began = time.perf_counter()
        times: list[float] = []
        async with session.stream("POST", f"{self.fleet.url}/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:500]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"the stream failed: {event['error']}")
                times.append(time.perf_counter())
        return began, times


async def measure(
    lab: Lab, fleet: LabFleet, client: Client, opts: argparse.Namespace, wire: bool
) -> dict[str, Any]:
    result: dict[str, Any] = {"ttft_ms": {}, "decode": {}}
    async with httpx.AsyncClient(verify=fleet.verify, timeout=900) as session:
        await client.stream(session, client.prompt(16), 4)  # warm-up
        prompt_payload = prompt_wire = 0.0
        prompt_tokens = 0
        for length in opts.prompts:
            times = []
            for _ in range(opts.rounds):
                payload0, wire0 = payload_bytes(fleet), wire_bytes(lab) if wire else 0
                began, got = await client.stream(session, client.prompt(length), 1)
                times.append((got[0] - began) * 1000)
                prompt_payload += payload_bytes(fleet) - payload0
                prompt_wire += (wire_bytes(lab) - wire0) if wire else 0
                prompt_tokens += length
            result["ttft_ms"][str(length)] = {"median": statistics.median(times), "all": times}
            log.info("ttft %s: %s", length, times)
        per_prompt = prompt_payload / prompt_tokens
        per_prompt_wire = prompt_wire / prompt_tokens if wire else None
        result["bytes_per_prompt_token"] = {"payload": per_prompt, "wire": per_prompt_wire}
        decode_payload = decode_wire = 0.0
        decoded = 0
        for users in opts.users:
            prompts = [client.prompt(opts.decode_prompt) for _ in range(users)]
            payload0, wire0 = payload_bytes(fleet), wire_bytes(lab) if wire else 0
            runs = await asyncio.gather(*(client.stream(session, p, opts.tokens) for p in prompts))
            payload = payload_bytes(fleet) - payload0 - per_prompt * users * opts.decode_prompt
            sent = (wire_bytes(lab) - wire0) if wire else 0
            sent -= (per_prompt_wire or 0) * users * opts.decode_prompt
            steps = sum(len(times) - 1 for _, times in runs)
            rate = sum((len(t) - 1) / (t[-1] - t[0]) for _, t in runs if len(t) > 1)
            result["decode"][str(users)] = {"tokens_per_s": rate, "steps": steps}
            decode_payload += payload
            decode_wire += sent
            decoded += steps
            log.info("decode %d users: %.2f tok/s", users, rate)
        result["bytes_per_decoded_token"] = {
            "payload": decode_payload / decoded,
            "wire": decode_wire / decoded if wire else None,
        }
    return result


def run_network(
    network: Network, export: Path, logs: Path, opts: argparse.Namespace, vocab: int
) -> dict[str, Any]:
    from protos.manifest import load_manifest

    stages = load_manifest(export).num_stages
    with Lab(stages + 1, opts.lab_name, free_subnet(), rate=network.rate) as lab:
        folder = logs / re.sub(r"\W+", "-", network.name)
        fleet = start_fleet(
            lab, export, folder, stage_hosts=[0] * stages if network.loopback else None,
            delay_ms=network.delay_ms, exact=False, ov_cache=default_ov_cache(), timeout=900,
            gateway_flags=["--log-level", "WARNING"],
        )  # fmt: skip
        models = httpx.get(f"{fleet.url}/v1/models", verify=fleet.verify, timeout=30).json()
        client = Client(fleet, models["data"][0]["id"], vocab)
        return asyncio.run(measure(lab, fleet, client, opts, wire=not network.loopback))


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1024:,.1f} KiB" if value >= 1024 else f"{value:,.0f} B"


def report(results: dict[str, dict[str, Any]], opts: argparse.Namespace, title: str) -> str:
    names = list(results)
    base = results.get("loopback")
    lines = [title, "", "Time to first token (ms, median):", ""]
    lines += ["| prompt tokens | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for length in opts.prompts:
        cells = []
        for name in names:
            value = results[name]["ttft_ms"][str(length)]["median"]
            cell = f"{value:,.0f}"
            if base is not None and name != "loopback":
                cell += f" ({value / base['ttft_ms'][str(length)]['median']:.2f}x)"
            cells.append(cell)
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", f"Decode tokens per second, all users together ({opts.tokens} tokens each):", ""]
    lines += ["| users | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for users in opts.users:
        cells = []
        for name in names:
            value = results[name]["decode"][str(users)]["tokens_per_s"]
            cell = f"{value:.2f}"
            if base is not None and name != "loopback":
                cell += f" ({value / base['decode'][str(users)]['tokens_per_s']:.2f}x)"
            cells.append(cell)
        lines.append(f"| {users} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Bytes over all hops together (payload: the link metrics; wire: what the hosts' "
        "interfaces sent, headers, probes and the client's HTTP included):",
        "",
        "| network | per prompt token, payload | wire | per decoded token, payload | wire |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        p, d = results[name]["bytes_per_prompt_token"], results[name]["bytes_per_decoded_token"]
        lines.append(
            f"| {name} | {fmt_bytes(p['payload'])} | {fmt_bytes(p['wire'])} | "
            f"{fmt_bytes(d['payload'])} | {fmt_bytes(d['wire'])} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--export", type=Path, default=None, help="default: `pipeshard up`'s export")
    p.add_argument(
        "--networks",
        type=lambda s: [parse_network(x) for x in s.split(",")],
        default=[parse_network(x) for x in ("loopback", "1gbit:1", "100mbit:5")],
        help="loopback and/or RATE:DELAY_MS (default: loopback,1gbit:1,100mbit:5)",
    )
    p.add_argument("--users", type=numbers, default=[1, 4, 8])
    p.add_argument("--prompts", type=numbers, default=[500, 2000], help="TTFT prompt lengths")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per user")
    p.add_argument("--decode-prompt", type=int, default=16, help="prompt tokens per decode user")
    p.add_argument("--rounds", type=int, default=3, help="TTFT requests per prompt length")
    p.add_argument("--quick", action="store_true", help="1 round, 16 tokens (a smoke run)")
    p.add_argument("--lab-name", default="psbench", help="name of the lab it builds")
    add_results_option(p)
    opts = p.parse_args(argv)
    if opts.quick:
        opts.rounds, opts.tokens = 1, 16
    reason = unavailable()
    if reason:
        p.error(f"the links benchmark needs a lab of hosts: {reason}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from benchmarks.suite.exports import resolve_export
    from protos.manifest import load_manifest

    export = resolve_export(opts.export)
    manifest = load_manifest(export)
    context = manifest.model.max_context
    too_long = [n for n in opts.prompts if n + 1 > context]
    if too_long:
        p.error(f"prompts of {too_long} tokens do not fit the model's context of {context}")
    model = manifest.model.model_id
    with tempfile.TemporaryDirectory(prefix="links-bench-") as temp:
        logs = Path(temp)
        results = {}
        for network in opts.networks:
            log.info("network %s", network.name)
            results[network.name] = run_network(
                network, export, logs, opts, manifest.model.vocab_size
            )
    info = machine()
    title = (
        f"Links: {model} ({manifest.num_stages} stages, {manifest.weights.format}) with the "
        f"gateway and each stage on a host of its own (network namespaces on a bridge, tbf "
        f"links, latency proxies) against all of them on one host; {describe(info)}."
    )
    text = report(results, opts, title)
    save(opts.results, "links", text, {"results": results, "model": model}, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
