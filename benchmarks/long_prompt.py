"""One user streams while another sends a long prompt: how long the first user's tokens pause.

Against a running server (`pipeshard up`, any options): user A streams ``--tokens`` greedy
tokens; ``--delay`` seconds in, user B sends a prompt of about ``--prompt-tokens`` tokens (code
lines) for a short answer. Prints one JSON line: B's prompt tokens and seconds, and A's gaps
between streamed tokens while B was in flight (count, p95, longest) and overall (median).

  pipeshard bench long-prompt [--url http://127.0.0.1:8000] [--prompt-tokens 2500]
                                   [--tokens 160] [--delay 4] [--api-key KEY]
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from typing import Any

import httpx

from benchmarks.microbatch import one_user


def _stream(
    url: str, model: str, tokens: int, out: dict[str, Any], headers: dict[str, str]
) -> None:
    prompt = "Write a long Python tutorial about classes."
    streamed = one_user(url, model, prompt, tokens, [], headers)
    out["a"] = [arrived for arrived, _ in streamed["arrivals"]]


def _long(
    url: str, model: str, prompt_tokens: int, out: dict[str, Any], headers: dict[str, str]
) -> None:
    code = " ".join(f"def f{i}(x): return x * {i} + {i % 7}" for i in range(prompt_tokens // 16))
    body = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Summarise this code:\n" + code}],
    }
    started = time.perf_counter()
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=900)
    if reply.status_code != 200:
        out["error"] = f"the long prompt got {reply.status_code}: {reply.text}"
        return
    out["b"] = (started, time.perf_counter(), reply.json()["usage"]["prompt_tokens"])


def measure(
    url: str, prompt_tokens: int, tokens: int, delay: float, api_key: str | None = None
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    models.raise_for_status()
    model = models.json()["data"][0]["id"]
    out: dict[str, Any] = {}
    a = threading.Thread(target=_stream, args=(url, model, tokens, out, headers))
    a.start()
    time.sleep(delay)
    b = threading.Thread(target=_long, args=(url, model, prompt_tokens, out, headers))
    b.start()
    a.join()
    b.join()
    if "error" in out:
        raise SystemExit(out["error"])
    arrivals, (b_start, b_end, b_prompt) = out["a"], out["b"]
    pairs = list(itertools.pairwise(arrivals))
    during = sorted((y - x) * 1000 for x, y in pairs if y > b_start and x < b_end)
    every = sorted((y - x) * 1000 for x, y in pairs)
    return {
        "b_prompt_tokens": b_prompt,
        "b_seconds": round(b_end - b_start, 1),
        "a_gaps_during_b": len(during),
        "a_p95_gap_during_b_ms": round(during[int(0.95 * (len(during) - 1))]) if during else None,
        "a_longest_gap_ms": round(during[-1]) if during else None,
        "a_median_gap_ms": round(every[len(every) // 2]) if every else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench long-prompt",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--prompt-tokens", type=int, default=2500, help="about this long (B)")
    p.add_argument("--tokens", type=int, default=160, help="tokens A streams")
    p.add_argument("--delay", type=float, default=4.0, help="seconds before B starts")
    p.add_argument("--api-key", help="Bearer key, where the server asks for one")
    args = p.parse_args(argv)
    result = measure(args.url, args.prompt_tokens, args.tokens, args.delay, args.api_key)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
