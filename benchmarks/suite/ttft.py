"""Experiment 5, time to first token by prompt length: N stages over gRPC vs monolithic.

Prompts of exactly 128, 512 and 2,048 tokens (text repeated, raw token ids, no template, no two
with a common prefix), the same ids for both systems. The monolithic model is openvino-genai on
the worker cores (one process per round, warmed up on the first prompt reversed); the stages
are served by the gateway's engine in this process, with the gateway's chunked prefill
(``prefill_chunk`` tokens per step through the ring), as a user of `pipeshard serve` gets it.
Ratios are round by round.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from benchmarks.microbatch import TOPICS
from benchmarks.speculative import gateway_engine
from benchmarks.suite.context import Bench
from benchmarks.suite.stats import fmt, ratios, spread

log = logging.getLogger(__name__)
TITLE = "5. Time to first token by prompt length"


def fitting(lengths: tuple[int, ...], max_context: int) -> tuple[list[int], str | None]:
    """The lengths that fit the context with one generated token; longer ones are cut to fit."""
    limit = max_context - 1
    too_long = [n for n in lengths if n > limit]
    fitted = sorted({min(n, limit) for n in lengths})
    if not too_long:
        return fitted, None
    return fitted, (
        f"The model's maximum context is {max_context} tokens: "
        f"{', '.join(map(str, too_long))}-token prompts do not fit with the first generated "
        f"token, measured at {limit} tokens instead."
    )


def prompts_of(bench: Bench, lengths: list[int]) -> list[list[int]]:
    """One prompt per length, no two with a common prefix (nothing for a prefix cache to reuse):
    the topics' text as token ids, each prompt starting at another place in it, repeated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(bench.export / bench.manifest.tokenizer.directory)
    )
    unit = list(tokenizer.encode(" ".join(TOPICS), add_special_tokens=False))
    prompts = []
    for i, length in enumerate(lengths):
        start = (i * 37) % len(unit)
        rotated = unit[start:] + unit[:start]
        prompts.append((rotated * (length // len(rotated) + 1))[:length])
    return prompts


async def ring_ttft(bench: Bench, prompts: list[list[int]]) -> list[float]:
    """Milliseconds to the first token of each prompt through the stages, one at a time."""
    from protos.sampling import SamplingParams
    from server.engine.loop import GenerationRequest

    async with gateway_engine(bench.addresses, None, 0, bench.max_context) as (engine, _):

        async def first_token(ids: list[int]) -> float:
            request = GenerationRequest(f"ttft-{time.monotonic_ns()}", ids, 1, SamplingParams())
            began = time.perf_counter()
            elapsed = 0.0
            async for _ in engine.generate(request):
                elapsed = time.perf_counter() - began
            return elapsed * 1000

        await first_token(prompts[0][::-1])  # warm-up, as the genai worker's
        return [await first_token(ids) for ids in prompts]


def run(bench: Bench) -> dict[str, Any]:
    lengths, note = fitting(bench.knobs.lengths, bench.max_context)
    prompts = prompts_of(bench, lengths)
    rounds = []
    for _ in range(bench.knobs.rounds):
        measured: dict[str, Any] = {"monolithic_ms": None}
        if bench.baseline is not None:
            measured["monolithic_ms"] = bench.worker("genai-ttft", bench.baseline, prompts=prompts)[
                "ttft_ms"
            ]
        measured["stages_ms"] = bench.run(ring_ttft(bench, prompts))
        rounds.append(measured)
        log.info("ttft %s", measured)
    summary = {}
    for i, length in enumerate(lengths):
        stages = [r["stages_ms"][i] for r in rounds]
        mono = [r["monolithic_ms"][i] if r["monolithic_ms"] else None for r in rounds]
        summary[str(length)] = {
            "stages_ms": spread(stages),
            "monolithic_ms": spread(mono),
            "stages_vs_monolithic": ratios(stages, mono),
        }
    skipped = [note] if note else []
    if bench.baseline is None:
        skipped.append("Monolithic baseline skipped: no --baseline (optimum-cli export).")
    return {"lengths": lengths, "rounds": rounds, "summary": summary, "skipped": skipped}


def table(result: dict[str, Any], bench: Bench) -> list[str]:
    from server.engine.scheduler import SchedulerConfig

    stages = bench.manifest.num_stages
    lines = [
        f"Milliseconds from the request to the first token, 1 user, greedy; {stages} stages "
        f"with the gateway's chunked prefill ({SchedulerConfig().prefill_chunk} tokens per "
        "step) vs openvino-genai (its default pipeline) prefilling the whole prompt at once; "
        "no two prompts (warm-up included) share a prefix, so no prefix cache helps. "
        "Median [min, max] over "
        f"{bench.knobs.rounds} rounds; ratio = stages / monolithic, round by round (above 1: "
        "the stages are slower). The paper reports no time-to-first-token figures.",
        "",
        f"| prompt tokens | monolithic genai TTFT ms | {stages} stages over gRPC TTFT ms | "
        "stages / monolithic |",
        "|---|---|---|---|",
    ]
    for length, row in result["summary"].items():
        lines.append(
            f"| {length} | {fmt(row['monolithic_ms'], 0)} | {fmt(row['stages_ms'], 0)} | "
            f"{fmt(row['stages_vs_monolithic'], 2, 'x')} |"
        )
    return lines
