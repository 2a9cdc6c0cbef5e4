"""Greedy agreement with llama.cpp: the same prompt token ids to pipeshard and llama-server.

Both servers must already serve the same GGUF (``pipeshard up --model FILE`` and
``llama-server -m FILE``). For each prompt (token ids: ``--prompt-ids``, or the texts below as
llama-server's ``/tokenize`` encodes them, no special tokens) both write ``--tokens`` greedy
tokens with the end-of-sequence token ignored: pipeshard's ``/v1/completions`` with the ids as
``prompt``, ``temperature: 0``, ``ignore_eos``, ``logprobs: 2``; llama-server's ``/completion``
with the ids, ``temperature: 0``, ``ignore_eos``, ``n_probs: 2``, ``cache_prompt: false``
(its logprobs are of the full distribution, before sampling). Reported per prompt: the tokens
that agree before the first difference, and at that position both sides' two most probable
tokens and their logprob gap (= the logit gap: the same normalizer). On random-weight stand-ins
near-ties are common; a difference at a clear gap (both sides' gaps above ``--clear-gap``) is a
bug to find, and the exit status is 1.

pipeshard's legacy logprobs name tokens by their text (bytes decoded as UTF-8, invalid bytes
replaced), so tokens are compared as that text, llama.cpp's ``bytes`` decoded alike; where the
text holds a replacement character two byte tokens could look the same, and the report marks
the position ``ambiguous``.

Usage:
  pipeshard bench llama-agree --pipeshard URL --llama-server URL [--tokens 64]
      [--prompt-ids 1,2,3 ...] [--clear-gap 1.0] [--name llama-agree]
Writes <name>-<date>.{json,md} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.report import add_results_option, describe, machine, save

TEXTS = [
    "Write a Python function to check if a number is prime.",
    "Explain what a hash map is in one paragraph.",
    "What is the difference between a list and a tuple in Python?",
    "How do I reverse a linked list? Give code in C.",
]
REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class Step:
    """One generated position on one side: the picked token's text and the two most probable
    (text, logprob), most probable first."""

    token: str
    top: list[tuple[str, float]]

    @property
    def gap(self) -> float | None:
        return self.top[0][1] - self.top[1][1] if len(self.top) > 1 else None


@dataclass(frozen=True)
class Agreement:
    prompt_tokens: int
    generated: int
    agreed: int  # tokens equal before the first difference (= generated: none)
    pipeshard: Step | None  # at the first difference
    llama: Step | None
    ambiguous: bool  # a compared token's text held a replacement character


def post(url: str, body: dict[str, Any], timeout: float = 1200.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def text_of(raw: list[int]) -> str:
    return bytes(raw).decode("utf-8", errors="replace")


def llama_steps(url: str, ids: list[int], tokens: int) -> list[Step]:
    reply = post(
        f"{url}/completion",
        {
            "prompt": ids,
            "n_predict": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "n_probs": 2,
            "cache_prompt": False,
        },
    )
    steps = []
    for entry in reply["completion_probabilities"]:
        top = [(text_of(t["bytes"]), float(t["logprob"])) for t in entry["top_logprobs"]]
        steps.append(Step(text_of(entry["bytes"]), top))
    return steps


def pipeshard_steps(url: str, model: str, ids: list[int], tokens: int) -> list[Step]:
    reply = post(
        f"{url}/v1/completions",
        {
            "model": model,
            "prompt": ids,
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 2,
        },
    )
    lp = reply["choices"][0]["logprobs"]
    steps = []
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        steps.append(Step(token, [(t, float(v)) for t, v in ranked]))
    return steps


def agreement(ours: list[Step], theirs: list[Step], prompt_tokens: int) -> Agreement:
    n = min(len(ours), len(theirs))
    ambiguous = False
    for i in range(n):
        ambiguous |= REPLACEMENT in ours[i].token or REPLACEMENT in theirs[i].token
        if ours[i].token != theirs[i].token:
            return Agreement(prompt_tokens, n, i, ours[i], theirs[i], ambiguous)
    return Agreement(prompt_tokens, n, n, None, None, ambiguous)


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        return str(json.load(response)["data"][0]["id"])


def tokenize(llama_url: str, text: str) -> list[int]:
    return [int(t) for t in post(f"{llama_url}/tokenize", {"content": text})["tokens"]]


def clear_difference(a: Agreement, clear_gap: float) -> bool:
    if a.pipeshard is None or a.llama is None:
        return False
    gaps = (a.pipeshard.gap, a.llama.gap)
    return all(g is not None and g > clear_gap for g in gaps) and not a.ambiguous


def report(rows: list[Agreement], opts: argparse.Namespace, info: dict[str, Any]) -> str:
    def top(step: Step | None) -> str:
        if step is None:
            return ""
        return ", ".join(f"{json.dumps(t)} {v:.3f}" for t, v in step.top)

    def gap(step: Step | None) -> str:
        return "" if step is None or step.gap is None else f"{step.gap:.3f}"

    lines = [
        f"Greedy agreement, pipeshard {opts.pipeshard} against llama-server {opts.llama_server} "
        f"on the same GGUF: {opts.tokens} tokens a prompt, end of sequence ignored. "
        f"{describe(info)}.",
        "",
        "| prompt | prompt tokens | agreed / generated | pipeshard's top 2 (logprob) | gap "
        "| llama.cpp's top 2 (logprob) | gap | clear difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, a in enumerate(rows):
        flag = "yes" if clear_difference(a, opts.clear_gap) else "no"
        if a.ambiguous:
            flag += " (ambiguous text)"
        lines.append(
            f"| {i} | {a.prompt_tokens} | {a.agreed} / {a.generated} | {top(a.pipeshard)} "
            f"| {gap(a.pipeshard)} | {top(a.llama)} | {gap(a.llama)} | {flag} |"
        )
    lines += [
        "",
        f"A clear difference: both gaps above {opts.clear_gap} at the first differing position "
        "(a near-tie flips on rounding; a clear gap does not).",
    ]
    return "\n".join(lines) + "\n"


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from e
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError("token ids must be non-negative and at least one")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench llama-agree", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pipeshard", required=True, help="URL of pipeshard's gateway")
    parser.add_argument("--llama-server", required=True, help="URL of llama-server")
    parser.add_argument("--model", help="pipeshard's model id (default: the one it serves)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--prompt-ids",
        type=parse_ids,
        action="append",
        help="a prompt as comma-separated token ids (repeat; default: 4 texts tokenized)",
    )
    parser.add_argument("--clear-gap", type=float, default=1.0, help="logprob gap (nats)")
    parser.add_argument("--name", default="llama-agree", help="results file name")
    add_results_option(parser)
    opts = parser.parse_args(argv)
    if opts.tokens < 1:
        parser.error("--tokens must be positive")
    opts.pipeshard = opts.pipeshard.rstrip("/")
    opts.llama_server = opts.llama_server.rstrip("/")
    info = machine()
    model = opts.model or served_model(opts.pipeshard)
    prompts = opts.prompt_ids or [tokenize(opts.llama_server, t) for t in TEXTS]
    rows = []
    for ids in prompts:
        theirs = llama_steps(opts.llama_server, ids, opts.tokens)
        ours = pipeshard_steps(opts.pipeshard, model, ids, opts.tokens)
        rows.append(agreement(ours, theirs, len(ids)))
        print(f"{len(ids)} prompt tokens: {rows[-1].agreed} / {rows[-1].generated} agree")
    result = {"model": model, "prompts": prompts, "rows": [asdict(r) for r in rows]}
    save(opts.results, opts.name, report(rows, opts, info), result, opts)
    return 1 if any(clear_difference(r, opts.clear_gap) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
