"""Prefix caching (#38): a multi-turn chat and a shared system prompt, with and without the cache.

Setup (stated in the report):
  - 2 `pipeshard stage` processes (paged KV, the default; their prefix cache keeps every free
    block), stage k pinned to the k-th of ``--stage-cores`` (taskset) with ``--threads``
    inference threads, each with a Prometheus port;
  - two gateways over the same stage processes: ``cached`` (`pipeshard serve`, the prefix
    cache on, the default) and ``uncached`` (`pipeshard serve --no-prefix-cache`: every prompt
    prefilled whole; it names no blocks, so it leaves nothing in the stages' cache for the
    other one); with ``--draft`` both run the export's draft (`--draft EXPORT/draft`);
  - this process's HTTP clients stream every reply: greedy, end-of-sequence biased away
    (logit_bias) so every reply is ``--tokens`` long. The text is Python source of this
    Python's standard library (argparse.py, dataclasses.py), cut to token counts with the
    gateway's own tokenizer, so a run is the same on any machine with the same Python.

1. Multi-turn chat: a system prompt and a first user message (code to review) of about
   ``--context-tokens`` prompt tokens, then ``--turns`` - 1 more turns, each adding a user
   message of about ``--turn-tokens`` tokens (the module's next part). Every turn sends the
   same history to both gateways, one after the other (which one first alternates turn by
   turn), and the reply (checked identical) joins the history. Per request: time to first
   token, decode tok/s (the tokens after the first over their time) and cached_tokens.
   Targets: TTFT of turns 2+ with the cache <= 0.2x without it (every turn); decode tok/s
   with the cache >= 0.97x without it (median of the turns' ratios).
2. Shared system prompt: a system prompt of about ``--system-tokens`` tokens, ``--users``
   users at once, each its own question of about ``--question-tokens`` tokens. One warm-up
   request with that system prompt on each gateway first (the cached one then holds it); then
   the users at once on the cached gateway, then at once on the uncached one. Targets: TTFT
   p50 with the cache <= 0.3x without it; aggregate tok/s (end to end: every user's tokens
   over first request to last token) not lower.

The stages' ``pipeshard_stage_kv_blocks{state="cached"}`` is read after every turn and phase.

Usage: pipeshard bench prefix [--export DIR] [--turns 8] [--context-tokens 1500]
       [--turn-tokens 150] [--system-tokens 1000] [--users 8] [--question-tokens 40]
       [--tokens 64] [--draft] [--stage-cores 0,1] [--gateway-cores CPUS] [--quick]
Writes prefix-cache-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import platform
import shlex
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.microbatch import TOPICS, one_user, percentile, stage_metrics, summarize
from benchmarks.processes import Proc, start_gateway, start_pinned_stages
from benchmarks.report import add_results_option, describe, machine, reachable_eos, save
from benchmarks.stand_in import stand_in_label
from benchmarks.suite.stats import fmt, ratios

# gateway -> its `pipeshard serve` flags; both run over the same stage processes
GATEWAYS = {"cached": [], "uncached": ["--no-prefix-cache"]}
# the stages' prefix cache: blocks kept now, blocks taken from it so far, blocks evicted so far
STAGE_CACHE = (
    'pipeshard_stage_kv_blocks{state="cached"}',
    "pipeshard_stage_prefix_cache_hit_blocks_total",
    "pipeshard_stage_kv_blocks_evicted_total",
)
GATEWAY_TOKENS = (
    "pipeshard_gateway_prompt_cached_tokens_total",
    "pipeshard_gateway_prompt_tokens_total",
)
FULL = {
    "turns": 8,
    "context_tokens": 1500,
    "turn_tokens": 150,
    "system_tokens": 1000,
    "users": 8,
    "question_tokens": 40,
    "tokens": 64,
}
# --quick: the smoke test's sizes (a tiny model's 256-token context)
QUICK = {
    "turns": 3,
    "context_tokens": 64,
    "turn_tokens": 8,
    "system_tokens": 96,
    "users": 2,
    "question_tokens": 16,
    "tokens": 4,
}
TTFT_TARGET = 0.2  # multi-turn: TTFT with the cache / without, turns 2+
DECODE_TARGET = 0.97  # multi-turn: decode tok/s with the cache / without
SHARED_TTFT_TARGET = 0.3  # shared system prompt: TTFT p50 with the cache / without
SHARED_TOK_S_TARGET = 1.0  # shared system prompt: aggregate tok/s with the cache / without

REVIEWER = "You review Python code: bugs, naming, structure, tests."
TEAM = "Answer questions about this Python module briefly.\n```python\n"
ELABORATION = (
    " Where it fits, use the module in the system prompt in your example and name the functions "
    "you rely on. Keep the answer short."
)
WARM_UP = "What is this module for?"


class Texts:
    """Text cut to token counts with the gateway's own tokenizer (server/api/tokenization.py)."""

    def __init__(self, export: Path, manifest: Any) -> None:
        from server.api.tokenization import load_codec

        self.codec = load_codec(export / manifest.tokenizer.directory, manifest)

    def ids(self, text: str) -> list[int]:
        return list(self.codec.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, ids: list[int]) -> str:
        return str(self.codec.tokenizer.decode(ids))

    def prompt_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.codec.chat_prompt(messages))

    def source(self, module: str, tokens: int) -> list[int]:
        """At least ``tokens`` token ids of a standard-library module's source (repeated)."""
        ids = self.ids(inspect.getsource(importlib.import_module(module)))
        return ids * (tokens // len(ids) + 1)


def message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def conversation(texts: Texts, opts: argparse.Namespace) -> tuple[list[dict[str, str]], list[str]]:
    """The multi-turn chat's first messages (system prompt and a first user message with the
    start of argparse.py, about ``--context-tokens`` prompt tokens) and each later turn's user
    message (the module's next part, about ``--turn-tokens`` tokens)."""
    head, tail = (
        "Here is the first part of a module I maintain:\n```python\n",
        ("\n```\nWhat does this part do, and what would you change?"),
    )
    room = opts.context_tokens - texts.prompt_tokens(
        [message("system", REVIEWER), message("user", head + tail)]
    )
    later_head, later_tail = "Next part:\n```python\n", "\n```\nAny bugs?"
    part = opts.turn_tokens - len(texts.ids(later_head + later_tail))
    room, part = max(room, 1), max(part, 1)
    code = texts.source("argparse", room + part * opts.turns)
    first = [message("system", REVIEWER), message("user", head + texts.text(code[:room]) + tail)]
    later = [
        later_head + texts.text(code[room + k * part : room + (k + 1) * part]) + later_tail
        for k in range(opts.turns - 1)
    ]
    return first, later


def shared_prompt(texts: Texts, opts: argparse.Namespace) -> tuple[str, list[str]]:
    """The shared system prompt (the team's instructions and the start of dataclasses.py, about
    ``--system-tokens`` tokens as a prompt of its own) and each user's question (a topic of
    the users suite and a request, cut to ``--question-tokens`` tokens)."""
    room = opts.system_tokens - texts.prompt_tokens([message("system", TEAM + "\n```")])
    code = texts.source("dataclasses", max(room, 1))
    system = TEAM + texts.text(code[: max(room, 1)]) + "\n```"
    questions = [
        texts.text(
            texts.ids(f"Question {i + 1}: {TOPICS[i % len(TOPICS)]}{ELABORATION}")[
                : opts.question_tokens
            ]
        )
        for i in range(opts.users)
    ]
    return system, questions


def ask(
    url: str, model: str, messages: list[dict[str, str]], tokens: int, eos: list[int]
) -> dict[str, Any]:
    """One streamed reply: TTFT, decode tok/s (tokens after the first over their time), the
    usage's prompt and cached tokens, the text, and the raw start and arrivals."""
    streamed = one_user(url, model, messages, tokens, eos)
    arrivals, usage = streamed["arrivals"], streamed["usage"]
    count = sum(n for _, n in arrivals)
    span = arrivals[-1][0] - arrivals[0][0] if arrivals else 0.0
    return {
        "ttft_ms": (arrivals[0][0] - streamed["start"]) * 1000 if arrivals else float("nan"),
        "decode_tok_s": (count - arrivals[0][1]) / span if span > 0 else float("nan"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "completion_tokens": count,
        "text": streamed["text"],
        "start": streamed["start"],
        "arrivals": arrivals,
    }


def kept(record: dict[str, Any]) -> dict[str, Any]:
    """A request's figures for the JSON (without its raw arrivals)."""
    return {k: v for k, v in record.items() if k not in ("start", "arrivals")}


def stage_cache(ports: list[int]) -> list[dict[str, float]]:
    """Each stage's cached blocks now, and its hit and evicted blocks so far."""
    names = ("cached_blocks", "hit_blocks", "evicted_blocks")
    return [dict(zip(names, stage_metrics(port, *STAGE_CACHE), strict=True)) for port in ports]


def gateway_tokens(url: str) -> dict[str, float]:
    """A gateway's prompt tokens taken from the cache and prompt tokens, so far."""
    cached, prompt = stage_metrics(int(url.rsplit(":", 1)[1]), *GATEWAY_TOKENS)
    return {"prompt_cached_tokens": cached, "prompt_tokens": prompt}


def multi_turn(
    urls: dict[str, str],
    model: str,
    eos: list[int],
    texts: Texts,
    opts: argparse.Namespace,
    ports: list[int],
) -> list[dict[str, Any]]:
    first, later = conversation(texts, opts)
    history = list(first)
    turns = []
    for k in range(opts.turns):
        if k:
            history.append(message("user", later[k - 1]))
        order = list(GATEWAYS) if k % 2 == 0 else list(reversed(GATEWAYS))
        got = {name: ask(urls[name], model, history, opts.tokens, eos) for name in order}
        cached, uncached = got["cached"], got["uncached"]
        turn = {
            "turn": k + 1,
            "first": order[0],
            "same_reply": cached["text"] == uncached["text"],
            "full_length": all(r["completion_tokens"] == opts.tokens for r in got.values()),
            "stage_cache": stage_cache(ports),
            **{name: kept(record) for name, record in got.items()},
        }
        turns.append(turn)
        print(
            f"turn {k + 1}: {uncached['prompt_tokens']} prompt tokens, cached "
            f"{cached['cached_tokens']}; TTFT {cached['ttft_ms']:.0f} / "
            f"{uncached['ttft_ms']:.0f} ms, decode {cached['decode_tok_s']:.2f} / "
            f"{uncached['decode_tok_s']:.2f} tok/s (cache on / off); same reply: "
            f"{turn['same_reply']}",
            flush=True,
        )
        history.append(message("assistant", uncached["text"]))
    return turns


def shared_system(
    urls: dict[str, str],
    model: str,
    eos: list[int],
    texts: Texts,
    opts: argparse.Namespace,
    ports: list[int],
) -> dict[str, Any]:
    system, questions = shared_prompt(texts, opts)
    result: dict[str, Any] = {"warm_up": {}, "stage_cache_after_warm_up": None}
    for name, url in urls.items():
        warm = ask(
            url, model, [message("system", system), message("user", WARM_UP)], opts.tokens, eos
        )
        result["warm_up"][name] = kept(warm)
    result["stage_cache_after_warm_up"] = stage_cache(ports)
    for name, url in urls.items():
        bodies = [[message("system", system), message("user", q)] for q in questions]
        with ThreadPoolExecutor(len(bodies)) as pool:
            records = list(pool.map(lambda m, u=url: ask(u, model, m, opts.tokens, eos), bodies))
        summary = summarize(
            [r["start"] for r in records], [r["arrivals"] for r in records], opts.tokens
        )
        ttft = summary["ttft_ms"]
        result[name] = {
            **summary,
            "ttft_p50_ms": percentile(ttft, 0.5),
            "ttft_p95_ms": percentile(ttft, 0.95),
            "requests": [kept(r) for r in records],
            "stage_cache": stage_cache(ports),
        }
        print(
            f"shared system prompt, {name}: TTFT p50 {result[name]['ttft_p50_ms']:.0f} ms, "
            f"{summary['e2e_tok_s']:.2f} tok/s end to end, cached tokens "
            f"{[r['cached_tokens'] for r in records]}",
            flush=True,
        )
    cached, uncached = result["cached"], result["uncached"]
    result["same_replies"] = [
        a["text"] == b["text"]
        for a, b in zip(cached["requests"], uncached["requests"], strict=True)
    ]
    return result


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def blocks(cache: list[dict[str, float]], key: str = "cached_blocks") -> str:
    """A reading of stage_cache as ``stage 0 / stage 1``."""
    return " / ".join(f"{stage[key]:.0f}" for stage in cache)


def chat_report(turns: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The multi-turn table and its targets."""
    lines = [
        "## 1. Multi-turn chat",
        "",
        "| turn | first | prompt tokens | cached tokens | prefilled with the cache | TTFT ms "
        "cache on / off | TTFT ratio | decode tok/s on / off | decode ratio | same reply | "
        "stage cached blocks |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in turns:
        on, off = t["cached"], t["uncached"]
        lines.append(
            f"| {t['turn']} | {t['first']} | {off['prompt_tokens']} | {on['cached_tokens']} | "
            f"{on['prompt_tokens'] - on['cached_tokens']} | "
            f"{on['ttft_ms']:.0f} / {off['ttft_ms']:.0f} | {on['ttft_ms'] / off['ttft_ms']:.3f} | "
            f"{on['decode_tok_s']:.2f} / {off['decode_tok_s']:.2f} | "
            f"{on['decode_tok_s'] / off['decode_tok_s']:.3f} | "
            f"{'yes' if t['same_reply'] else 'NO'}{'' if t['full_length'] else ' (short)'} | "
            f"{blocks(t['stage_cache'])} |"
        )
    later = turns[1:]
    ttft = ratios(
        [t["cached"]["ttft_ms"] for t in later], [t["uncached"]["ttft_ms"] for t in later]
    )
    decode = ratios(
        [t["cached"]["decode_tok_s"] for t in later], [t["uncached"]["decode_tok_s"] for t in later]
    )
    total = ratios(
        [sum(t["cached"]["ttft_ms"] for t in later)], [sum(t["uncached"]["ttft_ms"] for t in later)]
    )
    ttft_ok = ttft is not None and ttft["max"] <= TTFT_TARGET
    decode_ok = decode is not None and decode["median"] >= DECODE_TARGET
    same = all(t["same_reply"] for t in turns)
    span = f"turns 2-{len(turns)}"
    lines += [
        "",
        "Ratios are cache on / off within a turn; [min, max] over the turns.",
        "",
        f"- TTFT of {span} with the cache <= {TTFT_TARGET}x without it, every turn: "
        f"{fmt(ttft, 3, 'x')} (summed over the turns {fmt(total, 3, 'x')}): "
        f"{verdict(ttft_ok)}",
        f"- decode tok/s of {span} with the cache >= {DECODE_TARGET}x without it (median of the "
        f"turns): {fmt(decode, 3, 'x')}: {verdict(decode_ok)}",
        f"- every reply identical with and without the cache: {verdict(same)}"
        + ("" if same else f" (turns {[t['turn'] for t in turns if not t['same_reply']]} differ)"),
    ]
    return lines, {
        "ttft_ratio": ttft,
        "ttft_total_ratio": total,
        "decode_ratio": decode,
        "ttft_pass": ttft_ok,
        "decode_pass": decode_ok,
        "same_replies": same,
    }


def shared_report(shared: dict[str, Any], users: int) -> tuple[list[str], dict[str, Any]]:
    """The shared-system-prompt table and its targets."""
    lines = [
        "## 2. Shared system prompt",
        "",
        "One warm-up request with the system prompt on each gateway ("
        + ", ".join(
            f"{n}: {w['cached_tokens']} of {w['prompt_tokens']} prompt tokens cached, TTFT "
            f"{w['ttft_ms']:.0f} ms"
            for n, w in shared["warm_up"].items()
        )
        + f"; stage cached blocks then {blocks(shared['stage_cache_after_warm_up'])}), then "
        f"{users} users at once on the cached gateway, then at once on the uncached one.",
        "",
        "| gateway | prompt tokens | cached tokens per request | TTFT p50 / p95 / max (ms) | "
        "aggregate decode tok/s | end-to-end tok/s | stage cached blocks |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in GATEWAYS:
        r = shared[name]
        prompts = [q["prompt_tokens"] for q in r["requests"]]
        window = f"{r['decode_tok_s']:.2f}" if r["decode_tok_s"] else "n/a (never all at once)"
        lines.append(
            f"| {name} | {min(prompts)}-{max(prompts)} | "
            f"{', '.join(str(q['cached_tokens']) for q in r['requests'])} | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p95_ms']:.0f} / {max(r['ttft_ms']):.0f} | "
            f"{window} | {r['e2e_tok_s']:.2f} | {blocks(r['stage_cache'])} |"
        )
    on, off = shared["cached"], shared["uncached"]
    ttft = on["ttft_p50_ms"] / off["ttft_p50_ms"]
    tok_s = on["e2e_tok_s"] / off["e2e_tok_s"]
    decode = on["decode_tok_s"] / off["decode_tok_s"] if off["decode_tok_s"] else None
    same = all(shared["same_replies"])
    lines += [
        "",
        "Aggregate decode tok/s counts the tokens that arrived while every user was decoding, "
        "over that window; end to end counts every user's tokens over first request to last "
        "token (prefill included).",
        "",
        f"- TTFT p50 with the cache <= {SHARED_TTFT_TARGET}x without it: {ttft:.3f}x: "
        f"{verdict(ttft <= SHARED_TTFT_TARGET)}",
        f"- aggregate tok/s (end to end) with the cache not lower: {tok_s:.3f}x"
        + ("" if decode is None else f" (aggregate decode tok/s: {decode:.3f}x)")
        + f": {verdict(tok_s >= SHARED_TOK_S_TARGET)}",
        f"- every reply identical with and without the cache: {verdict(same)}",
    ]
    return lines, {
        "ttft_p50_ratio": ttft,
        "e2e_tok_s_ratio": tok_s,
        "decode_tok_s_ratio": decode,
        "ttft_pass": ttft <= SHARED_TTFT_TARGET,
        "tok_s_pass": tok_s >= SHARED_TOK_S_TARGET,
        "same_replies": same,
    }


def render(
    data: dict[str, Any], opts: argparse.Namespace, manifest: Any, stage_cores: list[str]
) -> tuple[str, list[dict[str, str]], dict[str, Any]]:
    """The report, the processes (cores and threads) and the verdicts of a run's ``data``."""
    pinned = (
        f"core(s) {opts.gateway_cores} (taskset)"
        if opts.gateway_cores
        else (f"unpinned (any of the {os.cpu_count()} cores)")
    )
    draft_threads = str(opts.threads) if opts.draft else "-"
    processes = [
        *(
            {
                "process": f"stage {s.index} (`pipeshard stage`, layers "
                f"{s.span(manifest.model.intermediate_size)})",
                "cores": stage_cores[s.index % len(stage_cores)],
                "threads": str(opts.threads),
            }
            for s in manifest.stages
        ),
        *(
            {
                "process": f"gateway {name} (`{shlex.join(['pipeshard', 'serve', *flags])}"
                f"{' --draft EXPORT/draft' if opts.draft else ''}`)",
                "cores": pinned,
                "threads": f"draft {draft_threads}" if opts.draft else "-",
            }
            for name, flags in GATEWAYS.items()
        ),
        {
            "process": "HTTP clients (this process, one thread per request)",
            "cores": pinned,
            "threads": "-",
        },
    ]
    lines = [
        "# Prefix caching: with and without the cache, side by side",
        "",
        f"{stand_in_label(opts.export, manifest.model.model_id)}, export {opts.export.name}, "
        f"{manifest.num_stages} stage processes with the stages' defaults (paged KV, prefix "
        "cache keeping every free block). Two gateways over the same stages: `cached` (the "
        "defaults) and `uncached` (`--no-prefix-cache`)"
        + (", both with the export's draft" if opts.draft else ", no draft")
        + f". Greedy, {opts.tokens} tokens per reply (end-of-sequence biased away), streamed. "
        f"Text: Python {platform.python_version()} standard library source (argparse.py for "
        "the chat, dataclasses.py for the shared system prompt). "
        f"Run took {data['seconds']:.0f} s.",
        "",
        f"Machine: {describe(data['machine_at_start'])}.",
        "",
        "## Processes: cores and threads",
        "",
        "| process | cores | threads |",
        "|---|---|---|",
        *(f"| {r['process']} | {r['cores']} | {r['threads']} |" for r in processes),
        "",
    ]
    targets: dict[str, Any] = {}
    if "multi_turn" in data:
        table, targets["multi_turn"] = chat_report(data["multi_turn"])
        lines += [
            f"A system prompt and a first message of {opts.context_tokens} tokens (asked), then "
            f"{opts.turns - 1} turns of {opts.turn_tokens} user tokens each; every turn on both "
            "gateways one after the other, `first` says which went first.",
            "",
            *table,
            "",
        ]
    if "shared" in data:
        table, targets["shared"] = shared_report(data["shared"], opts.users)
        lines += [
            f"A system prompt of {opts.system_tokens} tokens (asked), {opts.users} users with "
            f"questions of {opts.question_tokens} tokens (asked).",
            "",
            *table,
            "",
        ]
    hits = data["gateway_tokens"]["cached"]
    end = data["stage_cache_at_end"]
    lines += [
        "Cached gateway over the whole run: "
        f"{hits['prompt_cached_tokens']:.0f} of {hits['prompt_tokens']:.0f} prompt tokens taken "
        "from the cache (`pipeshard_gateway_prompt_cached_tokens_total` over "
        "`pipeshard_gateway_prompt_tokens_total`). The stages took "
        f"{blocks(end, 'hit_blocks')} blocks from their caches and evicted "
        f"{blocks(end, 'evicted_blocks')} (stage 0 / 1).",
        "",
        'Stage cached blocks: `pipeshard_stage_kv_blocks{state="cached"}` of stage 0 / 1, '
        "read when the turn or phase ended. The stages set it after each inference call, so it "
        "shows the pool as of their last call: blocks a request's session still held then "
        "count as used, not cached.",
    ]
    return "\n".join(lines), processes, targets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeshard bench prefix",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--export", type=Path, help="default: the default model's export (`pipeshard up`)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test): " + str(QUICK))
    for name, value in FULL.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"default {value}")
    p.add_argument(
        "--scenarios", default="chat,shared", help="chat (multi-turn), shared (system prompt)"
    )
    p.add_argument("--draft", action="store_true", help="both gateways run the export's draft/")
    p.add_argument("--stage-cores", default="0,1", help="stage k on the k-th (taskset)")
    p.add_argument("--threads", type=int, default=1, help="inference threads per stage and draft")
    p.add_argument(
        "--gateway-cores", help="pin both gateways and the HTTP clients (default: unpinned)"
    )
    p.add_argument("--ov-cache-dir", type=Path, help="OpenVINO model cache (default pipeshard's)")
    add_results_option(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    opts = p.parse_args(argv)
    for name, value in (QUICK if opts.quick else FULL).items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    scenarios = [s for s in opts.scenarios.split(",") if s]
    if not scenarios or set(scenarios) - {"chat", "shared"}:
        p.error("--scenarios: chat, shared or both")
    if opts.turns < 2:
        p.error("--turns: at least 2 (turn 1 fills the cache)")

    from benchmarks.suite.exports import resolve_export
    from common.net import default_ov_cache
    from protos.manifest import load_manifest
    from stage_node.settings import parse_cpus

    opts.export = resolve_export(opts.export)
    manifest = load_manifest(opts.export)
    if opts.draft and manifest.draft is None:
        p.error(f"--draft: {opts.export} has no draft")
    ov_cache = opts.ov_cache_dir or default_ov_cache()
    stage_cores = [c for c in opts.stage_cores.split(",") if c]
    logs = Path(tempfile.mkdtemp(prefix="prefix-cache-"))
    texts = Texts(opts.export, manifest)
    eos = reachable_eos(manifest)
    extra = ["--ov-cache-dir", str(ov_cache)]
    if opts.draft:
        assert manifest.draft is not None
        draft = opts.export / manifest.draft.directory
        extra += ["--draft", str(draft), "--draft-threads", str(opts.threads)]
    prefix = ["taskset", "-c", opts.gateway_cores] if opts.gateway_cores else []
    procs: list[Proc] = []
    gateways: dict[str, Proc] = {}
    urls: dict[str, str] = {}
    data: dict[str, Any] = {"logs": str(logs), "machine_at_start": machine()}
    began = time.monotonic()
    try:
        procs, addresses, ports = start_pinned_stages(
            opts.export,
            logs,
            metrics=True,
            cores=stage_cores,
            threads=opts.threads,
            extra=["--ov-cache-dir", str(ov_cache), "--log-level", "WARNING"],
        )
        for name, flags in GATEWAYS.items():
            gateways[name], urls[name] = start_gateway(
                addresses, logs / f"gateway-{name}.log", [*flags, *extra], prefix=prefix
            )
        if opts.gateway_cores:  # the client threads start from this one and inherit its cores
            os.sched_setaffinity(0, parse_cpus(opts.gateway_cores))
        model = httpx.get(f"{urls['cached']}/v1/models").json()["data"][0]["id"]
        for url in urls.values():  # warm-up: the call shapes of one user and of every user
            with ThreadPoolExecutor(opts.users) as pool:
                topics = [TOPICS[i % len(TOPICS)] for i in range(opts.users)]
                list(pool.map(lambda t, u=url: one_user(u, model, t, 4, eos), topics))
        data["stage_cache_at_start"] = stage_cache(ports)
        if "chat" in scenarios:
            data["multi_turn"] = multi_turn(urls, model, eos, texts, opts, ports)
        if "shared" in scenarios:
            data["shared"] = shared_system(urls, model, eos, texts, opts, ports)
        data["gateway_tokens"] = {name: gateway_tokens(url) for name, url in urls.items()}
        data["stage_cache_at_end"] = stage_cache(ports)
    finally:
        for gateway in gateways.values():
            gateway.stop()
        for proc in procs:
            proc.stop()
    data["seconds"] = round(time.monotonic() - began, 1)
    report, data["processes"], data["targets"] = render(data, opts, manifest, stage_cores)
    save(opts.results, "prefix-cache", report, data, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
