"""Running pipeshard servers side by side: throughput at several user counts, interleaved.

Each server is any OpenAI-compatible URL already serving (a `pipeshard up` with other options,
another build, another host). For each round and user count every server gets the same
``users`` concurrent greedy chat requests in turn (the order reverses every other round, so
drift in the machine's speed hits all alike); aggregate completion tok/s per run. The first
round warms the servers up (their compiled-model caches, the adaptive speculation's
measurements) and is left out of the medians. Also checks that every server gave the same
greedy text for every prompt (a server whose output differs is reported).

``--ignore-eos`` sends ``ignore_eos: true`` (a request field both pipeshard's gateway and
llama-server take), so every request writes ``--tokens`` tokens: for random-weight stand-ins,
whose greedy text may hit an end-of-sequence token at any step. ``--ttft-tokens N`` (default
2000; 0: none) also times, once a round on each server, a non-streamed request of about N
prompt tokens and 1 output token (its time to first token; the prompt starts with the round
and server so that no prefix cache holds it), the prompt's size calibrated on the first server.

Usage:
  pipeshard bench compare --server NAME=URL --server NAME=URL [...] [--users 1,2,4,8]
      [--rounds 4] [--tokens 64] [--ignore-eos] [--ttft-tokens 2000] [--model ID]
      [--name servers]
Writes <name>-<date>.{json,md} in --results DIR (default: the current directory). Say in --name
(or beside the results) how each server was started: its options, cores and threads.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from benchmarks.report import add_results_option, describe, machine, save

PROMPTS = [
    "Write a Python function to check if a number is prime.",
    "Explain what a hash map is in one paragraph.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What is the difference between a list and a tuple in Python?",
    "Write a SQL query selecting the 5 newest users.",
    "Write a Rust function that adds two integers.",
    "How do I reverse a linked list? Give code in C.",
    "Write a JavaScript debounce function.",
]


def parse_server(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"expected NAME=URL (http...), got {text!r}")
    return name, url.rstrip("/")


def extra_body(ignore_eos: bool) -> dict[str, Any] | None:
    return {"ignore_eos": True} if ignore_eos else None


async def run_users(
    client: Any, model: str, users: int, tokens: int, ignore_eos: bool = False
) -> tuple[float, list[str]]:
    """``users`` concurrent greedy requests: (aggregate completion tok/s, their texts)."""

    async def one(prompt: str) -> tuple[str, int]:
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            temperature=0,
            extra_body=extra_body(ignore_eos),
        )
        return reply.choices[0].message.content or "", reply.usage.completion_tokens

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(users)]
    started = time.perf_counter()
    done = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - started
    return sum(n for _, n in done) / elapsed, [text for text, _ in done]


LONG_TEXT = " ".join(PROMPTS)


def long_prompt(tag: str, repeats: int) -> str:
    """A prompt of ``repeats`` copies of the prompts' text after ``tag`` (which differs per
    request, so that no prefix cache holds the rest)."""
    return f"[{tag}] " + " ".join([LONG_TEXT] * repeats)


async def time_first_token(
    client: Any, model: str, text: str, ignore_eos: bool
) -> tuple[float, int]:
    """One non-streamed request of ``text`` for 1 token: (seconds, prompt tokens)."""
    started = time.perf_counter()
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        max_tokens=1,
        temperature=0,
        extra_body=extra_body(ignore_eos),
    )
    return time.perf_counter() - started, reply.usage.prompt_tokens


async def ttft_repeats(client: Any, model: str, target: int, ignore_eos: bool) -> int:
    """How many copies of the prompts' text make about ``target`` prompt tokens (at most)."""
    _, one = await time_first_token(client, model, long_prompt("calibrate", 1), ignore_eos)
    _, two = await time_first_token(client, model, long_prompt("calibrate", 2), ignore_eos)
    per_copy = max(1, two - one)
    return max(1, 1 + (target - one) // per_copy)


async def measure(opts: argparse.Namespace) -> dict[str, Any]:
    import openai

    servers = dict(opts.server)
    clients = {
        name: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=opts.api_key, max_retries=0,
                                 timeout=600.0)
        for name, url in servers.items()
    }  # fmt: skip
    model = opts.model
    if model is None:
        model = (await next(iter(clients.values())).models.list()).data[0].id
    rates: dict[str, dict[int, list[float]]] = {n: {u: [] for u in opts.users} for n in servers}
    texts: dict[str, dict[str, str]] = {}  # prompt -> server -> text
    ttft: dict[str, list[float]] = {n: [] for n in servers}
    ttft_prompt: dict[str, int] = {}
    repeats = 0
    if opts.ttft_tokens:
        first = clients[next(iter(servers))]
        repeats = await ttft_repeats(first, model, opts.ttft_tokens, opts.ignore_eos)
    for round_ in range(opts.rounds):
        order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
        for name in order if repeats else []:
            text = long_prompt(f"round {round_} {name}", repeats)
            seconds, prompt_tokens = await time_first_token(
                clients[name], model, text, opts.ignore_eos
            )
            ttft[name].append(seconds)
            ttft_prompt[name] = prompt_tokens
            print(f"round {round_} {name} ttft ({prompt_tokens} tokens): {seconds:.2f} s")
        for users in opts.users:
            for name in order:
                rate, out = await run_users(
                    clients[name], model, users, opts.tokens, opts.ignore_eos
                )
                rates[name][users].append(rate)
                for i, text in enumerate(out):
                    texts.setdefault(PROMPTS[i % len(PROMPTS)], {})[name] = text
                print(f"round {round_} {name} users={users}: {rate:.1f} tok/s", flush=True)
    differing = sorted(p for p, by in texts.items() if len(set(by.values())) > 1)
    return {
        "servers": servers,
        "model": model,
        "rates": rates,
        "differing_prompts": differing,
        "ttft_seconds": ttft if repeats else {},
        "ttft_prompt_tokens": ttft_prompt,
    }


def report(result: dict[str, Any], opts: argparse.Namespace, info: dict[str, Any]) -> str:
    names = list(result["servers"])
    first = names[0]
    eos = " (`ignore_eos`: every request writes them all)" if opts.ignore_eos else ""
    lines = [
        f"Servers side by side, {result['model']}: {opts.tokens} greedy tokens per request{eos}, "
        f"{opts.rounds} rounds (the first a warm-up, left out), each user count on each server "
        f"in turn. {describe(info)}.",
        "",
        "Servers: " + ", ".join(f"`{n}` {u}" for n, u in result["servers"].items()),
        "",
        "| users | "
        + " | ".join(f"{n} tok/s (median [min, max])" for n in names)
        + "".join(f" | {n} / {first}" for n in names[1:])
        + " |",
        "|---" * (1 + 2 * len(names) - 1) + "|",
    ]
    for users in opts.users:
        cells, medians = [], {}
        for name in names:
            kept = result["rates"][name][users][1:] or result["rates"][name][users]
            medians[name] = statistics.median(kept)
            cells.append(f"{medians[name]:.1f} [{min(kept):.1f}, {max(kept):.1f}]")
        ratios = [f"{medians[n] / medians[first]:.2f}" for n in names[1:]]
        lines.append(f"| {users} | " + " | ".join(cells + ratios) + " |")
    if result["ttft_seconds"]:
        lines += [
            "",
            "Time to first token of one long prompt (a non-streamed request for 1 token, "
            "once a round, the first round left out):",
            "",
            "| server | prompt tokens | seconds (median [min, max]) | / " + first + " |",
            "|---|---|---|---|",
        ]
        medians = {}
        for name in names:
            times = result["ttft_seconds"][name]
            kept = times[1:] or times
            medians[name] = statistics.median(kept)
            lines.append(
                f"| {name} | {result['ttft_prompt_tokens'][name]} | {medians[name]:.2f} "
                f"[{min(kept):.2f}, {max(kept):.2f}] | {medians[name] / medians[first]:.2f} |"
            )
    differing = result["differing_prompts"]
    lines += [
        "",
        "Greedy texts: "
        + ("identical on every server." if not differing else f"differ on {len(differing)} "
           f"prompt(s): {differing}"),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--server",
        type=parse_server,
        action="append",
        required=True,
        help="NAME=URL of a running server (repeat; the first is the reference)",
    )
    parser.add_argument(
        "--users", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8]
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos (every request writes --tokens tokens: random-weight stand-ins)",
    )
    parser.add_argument(
        "--ttft-tokens",
        type=int,
        default=2000,
        help="time to first token of a prompt of about this many tokens, once a round (0: off)",
    )
    parser.add_argument("--model", help="model id (default: the first server's)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--name", default="servers", help="results file name")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    if opts.rounds < 1 or opts.tokens < 1 or min(opts.users) < 1:
        parser.error("--rounds, --tokens and --users must be positive")
    if opts.ttft_tokens < 0:
        parser.error("--ttft-tokens must be 0 (off) or positive")
    info = machine()
    result = asyncio.run(measure(opts))
    save(opts.results, opts.name, report(result, opts, info), result, opts)
    return 1 if result["differing_prompts"] else 0


if __name__ == "__main__":
    sys.exit(main())
