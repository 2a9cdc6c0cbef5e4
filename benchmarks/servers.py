"""Running pipeshard servers side by side: throughput at several user counts, interleaved.

Each server is any OpenAI-compatible URL already serving (a `pipeshard up` with other options,
another build, another host). For each round and user count every server gets the same
``users`` concurrent greedy chat requests in turn (the order reverses every other round, so
drift in the machine's speed hits all alike); aggregate completion tok/s per run. The first
round warms the servers up (their compiled-model caches, the adaptive speculation's
measurements) and is left out of the medians. Also checks that every server gave the same
greedy text for every prompt (a server whose output differs is reported).

Usage:
  pipeshard bench compare --server NAME=URL --server NAME=URL [...] [--users 1,2,4,8]
      [--rounds 4] [--tokens 64] [--model ID] [--name servers]
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


async def run_users(client: Any, model: str, users: int, tokens: int) -> tuple[float, list[str]]:
    """``users`` concurrent greedy requests: (aggregate completion tok/s, their texts)."""

    async def one(prompt: str) -> tuple[str, int]:
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            temperature=0,
        )
        return reply.choices[0].message.content or "", reply.usage.completion_tokens

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(users)]
    started = time.perf_counter()
    done = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - started
    return sum(n for _, n in done) / elapsed, [text for text, _ in done]


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
    for round_ in range(opts.rounds):
        for users in opts.users:
            order = list(servers) if round_ % 2 == 0 else list(servers)[::-1]
            for name in order:
                rate, out = await run_users(clients[name], model, users, opts.tokens)
                rates[name][users].append(rate)
                for i, text in enumerate(out):
                    texts.setdefault(PROMPTS[i % len(PROMPTS)], {})[name] = text
                print(f"round {round_} {name} users={users}: {rate:.1f} tok/s", flush=True)
    differing = sorted(p for p, by in texts.items() if len(set(by.values())) > 1)
    return {"servers": servers, "model": model, "rates": rates, "differing_prompts": differing}


def report(result: dict[str, Any], opts: argparse.Namespace, info: dict[str, Any]) -> str:
    names = list(result["servers"])
    first = names[0]
    lines = [
        f"Servers side by side, {result['model']}: {opts.tokens} greedy tokens per request, "
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
    parser.add_argument("--model", help="model id (default: the first server's)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--name", default="servers", help="results file name")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    if opts.rounds < 1 or opts.tokens < 1 or min(opts.users) < 1:
        parser.error("--rounds, --tokens and --users must be positive")
    info = machine()
    result = asyncio.run(measure(opts))
    save(opts.results, opts.name, report(result, opts, info), result, opts)
    return 1 if result["differing_prompts"] else 0


if __name__ == "__main__":
    sys.exit(main())
