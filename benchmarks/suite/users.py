"""Experiment 2, micro-batching: 1, 2, 4, 8 concurrent users on N stages vs monolithic 1 user.

Every user streams a chat completion over HTTP from a real gateway (`pipeshard serve`) on the
running stage processes (benchmarks/microbatch.py's clients: greedy, end-of-sequence suppressed,
each user its own prompt). With a draft, a second gateway speculates with it at K=3 and serves
2 users: the paper's headline configuration. The monolithic baseline (openvino-genai, 1 user) is
measured in every round, and each round's fleet figures are divided by that round's baseline.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from benchmarks.microbatch import busy_seconds, run_users
from benchmarks.processes import start_gateway
from benchmarks.suite import paper
from benchmarks.suite.context import Bench
from benchmarks.suite.stats import fmt, ratios, ref, spread

log = logging.getLogger(__name__)
TITLE = "2. Micro-batching: concurrent users on the stages vs the monolithic model"
SPEC_USERS, SPEC_K = 2, 3
SPEC_ROW = f"{SPEC_USERS} users + speculative K={SPEC_K}"


def run(bench: Bench) -> dict[str, Any]:
    users = list(bench.knobs.users)
    tokens = bench.knobs.tokens
    gateways = []
    try:
        plain, url = start_gateway(
            bench.addresses,
            bench.logs / "gateway.log",
            ["--max-concurrent", str(max(users)), "--log-level", "WARNING"],
            timeout=600,
            prefix=bench.pin.prefix(),
        )
        gateways.append(plain)
        spec_url = None
        if bench.draft_dir is not None:
            spec, spec_url = start_gateway(
                bench.addresses,
                bench.logs / "gateway-spec.log",
                [
                    *("--draft", str(bench.draft_dir), "--spec-k", str(SPEC_K)),
                    *("--draft-threads", str(bench.pin.threads)),
                    *("--ov-cache-dir", str(bench.ov_cache), "--log-level", "WARNING"),
                ],
                timeout=600,
                prefix=bench.pin.prefix(),
            )
            gateways.append(spec)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run_users(url, model, 1, min(tokens, 8), bench.eos)  # warm-up
        if spec_url:
            run_users(spec_url, model, 1, min(tokens, 8), bench.eos)
        rounds = [
            _round(bench, url, spec_url, model, users, tokens) for _ in range(bench.knobs.rounds)
        ]
    finally:
        for gateway in gateways:
            gateway.stop()
    return {
        "users": users,
        "tokens": tokens,
        "rounds": rounds,
        "summary": summarize(rounds, users, spec_url is not None),
        "skipped": _skipped(bench),
    }


def _round(
    bench: Bench, url: str, spec_url: str | None, model: str, users: list[int], tokens: int
) -> dict[str, Any]:
    measured: dict[str, Any] = {"monolithic": None, "fleet": {}, "spec": None}
    if bench.baseline is not None:
        result = bench.worker("genai-decode", bench.baseline, tokens=tokens)
        measured["monolithic"] = result["decode_tok_s"]
    for count in users:
        measured["fleet"][str(count)] = with_busy(bench, url, model, count, tokens)
    if spec_url:
        measured["spec"] = with_busy(bench, spec_url, model, SPEC_USERS, tokens)
    return measured


def with_busy(bench: Bench, url: str, model: str, count: int, tokens: int) -> dict[str, Any]:
    """``count`` streaming users, and each stage's busy fraction while they ran."""
    busy = [busy_seconds(port) for port in bench.metric_ports]
    began = time.perf_counter()
    result = run_users(url, model, count, tokens, bench.eos)
    wall = time.perf_counter() - began
    result["stage_busy"] = [
        (busy_seconds(port) - b) / wall for port, b in zip(bench.metric_ports, busy, strict=True)
    ]
    log.info("%s, %d user(s): %.2f tok/s", url, count, result["decode_tok_s"])
    return result


def summarize(rounds: list[dict[str, Any]], users: list[int], spec: bool) -> dict[str, Any]:
    mono = [r["monolithic"] for r in rounds]
    one = [r["fleet"][str(users[0])]["decode_tok_s"] for r in rounds]
    rows: dict[str, Any] = {}
    series = {
        f"{u} user{'s' if u > 1 else ''}": [r["fleet"][str(u)] for r in rounds] for u in users
    }
    if spec:
        series[SPEC_ROW] = [r["spec"] for r in rounds]
    for name, results in series.items():
        speeds = [x["decode_tok_s"] for x in results]
        rows[name] = {
            "tok_s": spread(speeds),
            "vs_monolithic": ratios(speeds, mono),
            "vs_first": ratios(speeds, one),
            "ttft_ms": spread(t for x in results for t in x["ttft_ms"]),
            "itl_p50_ms": spread(x["itl_p50_ms"] for x in results),
            "itl_p95_ms": spread(x["itl_p95_ms"] for x in results),
            "stage_busy": [
                spread(x["stage_busy"][k] for x in results)
                for k in range(len(results[0].get("stage_busy", [])))
            ],
        }
    return {"monolithic": spread(mono), "rows": rows}


def _skipped(bench: Bench) -> list[str]:
    notes = []
    if bench.baseline is None:
        notes.append(
            "Monolithic baseline skipped: no --baseline (optimum-cli export), so there is no "
            "ratio to the monolithic single user."
        )
    if bench.draft_dir is None:
        notes.append(f"'{SPEC_ROW}' skipped: the export has no draft/.")
    return notes


def table(result: dict[str, Any], bench: Bench) -> list[str]:
    summary = result["summary"]
    stages = bench.manifest.num_stages
    first = f"{result['users'][0]} user"
    lines = [
        f"Aggregate decode tok/s while every user decodes, {result['tokens']} greedy tokens per "
        f"user, over HTTP through the gateway; {stages} stages. Median [min, max] over "
        f"{bench.knobs.rounds} rounds; ratios to the monolithic model and to {first} on the "
        "stages, round by round. With speculation several tokens arrive together, so the "
        "median gap between streamed tokens is about 0 and the p95 is about one step.",
        "",
        "| configuration | paper tok/s | paper vs monolithic | tok/s | vs monolithic | "
        f"vs {first} | TTFT ms | inter-token p50 / p95 ms | stage busy |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| monolithic openvino-genai, 1 user | {paper.MONOLITHIC:.2f} | 1.00x | "
        + (f"{fmt(summary['monolithic'])} | 1.00x" if summary["monolithic"] else "skipped |")
        + " | | | | |",
    ]
    for name, row in summary["rows"].items():
        paper_tok_s = paper.HEADLINE.get(name)
        paper_ratio = paper_tok_s / paper.MONOLITHIC if paper_tok_s else None
        busy = " / ".join(fmt(b) for b in row["stage_busy"]) or "-"
        lines.append(
            f"| {stages} stages, {name} | {ref(paper_tok_s)} | "
            f"{ref(paper_ratio, 2, 'x')} | {fmt(row['tok_s'])} | "
            f"{fmt(row['vs_monolithic'], 2, 'x')} | {fmt(row['vs_first'], 2, 'x')} | "
            f"{fmt(row['ttft_ms'], 0)} | {fmt(row['itl_p50_ms'], 1)} / "
            f"{fmt(row['itl_p95_ms'], 1)} | {busy} |"
        )
    return lines
