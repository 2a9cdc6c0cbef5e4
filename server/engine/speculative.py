"""Proposers for speculative decoding on the gateway, and the adaptive choice of K.

A decode step with speculation feeds the target ``[x0, d1 .. dk]`` (greedy: ``k`` proposals and a
bonus position) or ``[x0, d1 .. d(k-1)]`` (sampling: every one of the ``k`` positions tests a
proposal), and the last stage verifies (:mod:`shard_runtime.speculative`): it emits exactly the
tokens plain decoding would, so proposals only change the speed. A proposer picks each token as
the plain sampler would from its own guess (the draft: its logits, with the request's penalties
and the position's Gumbel noise), so that it agrees with the target where its guess is close.
Rejected positions are rolled back on every stage by the next step's ``rollback`` (the stages
trim their KV state: no garbage, no growth) and in the draft here.

* :class:`DraftProposer`: the small draft model of the export (``export/draft``), run with
  OpenVINO on the gateway with one KV session per sequence, on a paged KV pool with its own
  prefix cache (a sequence whose prefix another one took in before starts from it).
* :class:`NgramProposer`: prompt lookup, no model: copies what followed the latest earlier
  occurrence of the last few tokens of the sequence's own text.
* :class:`AdaptiveK`: picks ``k`` per sequence from its running acceptance rate and the measured
  cost of a pipeline pass and of a draft token, maximising expected tokens per second; under
  network latency a pass costs more, so it proposes more.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from protos.manifest import load_manifest, manifest_hash
from protos.sampling import SamplingParams
from server.engine.prefix import HashChain
from shard_runtime.paged import PagedRunner, PagedStep
from shard_runtime.runner import CapacityExceeded, InvalidStageInput, RunnerOptions
from shard_runtime.sampling import adjusted_logits, pick


@dataclass
class Proposal:
    tokens: list[int]
    seconds: float = 0.0


class Proposer(Protocol):
    def propose(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        prompt_len: int | None = None,
    ) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (the sequence so far); blocking.
        ``prompt_len``: how much of ``context`` is the prompt (the rest, generated tokens, is
        the history the penalties count); None: propose without penalties."""
        ...

    def warm(self, seq_id: str, prompt: list[int]) -> bool:
        """Take in (the next part of) the prompt ahead of the first proposal, while the target
        prefills; True once nothing is left to take in."""
        ...

    def release(self, seq_id: str) -> None: ...


# Tokens the draft takes in per call. Prompts and catch-ups (after plain steps) longer than
# this go in over several calls, so that other requests' proposals, which wait for the one draft
# thread, run in between instead of behind a whole long prompt (docs/benchmarks.md, "Draft
# prompt chunks").
DRAFT_CHUNK = 64

# The draft's KV block pool (allocated up front; a 0.5B draft with an f16 cache takes 12 KiB a
# position: about 43,000 positions for every sequence together, and the prefix cache).
DRAFT_KV_BYTES = 1 << 29

# A hybrid draft (linear-attention layers) keeps its state after each of its last positions
# for this many: a rollback of up to the largest K (--spec-max-k) selects one of them.
DRAFT_STATE_WINDOW = 16


class DraftProposer:
    """The draft model: one KV session per sequence, kept in step with the target.

    It runs on the paged backend (:class:`shard_runtime.paged.PagedRunner`) with its own prefix
    cache: the blocks a sequence fills with its own tokens (prompt and accepted tokens, never
    proposals) are published under the chained hashes of :mod:`server.engine.prefix` (salted
    with the draft's manifest hash), and a new sequence starts on the cached blocks of its prefix,
    as the stages do, so a conversation's next turn or a shared system prompt is not taken in
    again.
    Its numbers only affect speed (the target verifies every proposal and emits its own plain
    tokens), so it computes without batch invariance. A sequence the pool cannot hold gets no
    proposals (plain steps).
    """

    def __init__(
        self,
        export_dir: Path,
        options: RunnerOptions,
        vocab_size: int | None,
        chunk: int = DRAFT_CHUNK,
        *,
        kv_cache_bytes: int = DRAFT_KV_BYTES,
        prefix_cache_blocks: int | None = None,
    ) -> None:
        """``vocab_size``: the target's (None: check_target later, before the first use).
        ``prefix_cache_blocks``: blocks no sequence holds kept for later prefixes at most
        (None: as many as are free; 0: no prefix cache)."""
        self.chunk = chunk
        manifest = load_manifest(export_dir)
        if manifest.num_stages != 1:
            raise ValueError(f"the draft at {export_dir} must be a 1-stage export")
        self.vocab_size = manifest.model.vocab_size
        if vocab_size is not None:
            self.check_target(vocab_size)
        self.model_id = manifest.model.model_id
        self.runner = PagedRunner(
            export_dir,
            0,
            replace(options, batch_invariant=False),
            kv_cache_bytes=kv_cache_bytes,
            prefix_cache_blocks=prefix_cache_blocks,
            manifest=manifest,
            state_cache_bytes=kv_cache_bytes,  # a hybrid draft: as many bytes of states
            state_window=DRAFT_STATE_WINDOW,
        )
        self._salt = manifest_hash(export_dir)  # draft and target hashes never mix
        # Per sequence: the tokens its draft session holds, and how many of them came from the
        # sequence itself (the rest are proposals, which may have been rejected since).
        self._held: dict[str, tuple[list[int], int]] = {}
        self._chains: dict[str, HashChain] = {}  # per sequence: its own tokens' block hashes
        self.fed = 0  # positions computed (prompts, catch-ups and proposals)
        self._lock = threading.Lock()  # one inference at a time on the gateway

    def check_target(self, vocab_size: int) -> None:
        if self.vocab_size != vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({self.vocab_size}) differs from the target's "
                f"({vocab_size}); a draft must share the target's tokenizer"
            )

    def propose(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        prompt_len: int | None = None,
    ) -> Proposal:
        started = time.perf_counter()
        tokens: list[int] = []
        # the penalties' inputs as the target sees them at each proposed position
        penalised = prompt_len is not None and params.uses_history
        history = list(context[prompt_len:]) if penalised else []
        prompt_seen = context[:prompt_len] if penalised else []
        with self._lock:
            try:
                held, common = self._open(seq_id, context)
                # the sequence only grows: only the proposals held beyond `common` can differ
                while common < min(len(held), len(context)) and held[common] == context[common]:
                    common += 1
                if common == len(context):  # the last token's logits are needed again
                    common -= 1
                if common < len(held):
                    held = self._rollback(seq_id, held, common, context)
                    common = len(held)
                feed = context[common:]
                if len(feed) > self.chunk + 1:
                    # far behind (a long prompt not yet taken in, or many plain steps): take in
                    # one chunk now and propose on a later step (this one goes plain)
                    self._take_in(seq_id, held, feed[: self.chunk])
                    return Proposal([], time.perf_counter() - started)
                # the first feed is the sequence's own: the blocks it fills are published
                hashes = self._chains[seq_id].filled(context, common, len(context))
                for _ in range(k):
                    logits = self._forward(seq_id, feed, len(held), hashes)[-1]
                    held.extend(feed)
                    self._held[seq_id] = (held, len(context))
                    # the plain sampler's pick from the draft's logits, with the noise the
                    # target's row at this position draws with
                    adjusted = adjusted_logits(logits, params, history, prompt_seen)
                    token = pick(adjusted, params, len(held))
                    tokens.append(token)
                    if penalised:
                        history.append(token)
                    feed, hashes = [token], []
            except CapacityExceeded:
                # the pool (or the context) cannot hold more of this sequence now: what was
                # proposed so far (often nothing: a plain step); the session is as it was
                pass
        return Proposal(tokens, time.perf_counter() - started)

    def warm(self, seq_id: str, prompt: list[int]) -> bool:
        # all but the last token: a proposal always needs to feed at least one
        wanted = prompt[:-1]
        with self._lock:
            try:
                held, synced = self._open(seq_id, prompt)
                # held is always the sequence's own start, unless proposals went on from there
                if synced != len(held) or len(held) >= len(wanted):
                    return True  # taken in, or proposals already went on from there
                self._take_in(seq_id, held, wanted[len(held) : len(held) + self.chunk])
            except CapacityExceeded:
                return True  # nothing more now: proposals take the prompt in later, or go plain
            return len(held) >= len(wanted)

    def _open(self, seq_id: str, tokens: list[int]) -> tuple[list[int], int]:
        """The sequence's held tokens and how many are its own (under the lock); a sequence
        seen for the first time starts on the cached blocks of its prefix (``tokens``)."""
        if seq_id in self._held:
            return self._held[seq_id]
        chain = self._chains.get(seq_id)
        if chain is None:
            chain = self._chains[seq_id] = HashChain(self._salt, self.runner.blocks.block_size)
        blocks = self.runner.acquire(seq_id, chain.reusable(tokens))
        taken = blocks * self.runner.blocks.block_size
        self._held[seq_id] = (list(tokens[:taken]), taken)
        return self._held[seq_id]

    def _rollback(self, seq_id: str, held: list[int], common: int, context: list[int]) -> list[int]:
        """Cut the session down to ``common`` positions (under the lock); the tokens it holds."""
        try:
            self.runner.rollback(seq_id, len(held) - common)
        except (ValueError, InvalidStageInput):
            # the cut falls inside a block shared with another sequence (the last token of a
            # context seen before, at a block's end), or, on a hybrid draft, further back than
            # the recurrent states it keeps: start again on the cached blocks
            self.runner.release(seq_id)
            del self._held[seq_id]
            return self._open(seq_id, context)[0]
        del held[common:]
        self._held[seq_id] = (held, min(self._held[seq_id][1], common))
        return held

    def _forward(
        self, seq_id: str, tokens: list[int], start: int, hashes: list[bytes]
    ) -> np.ndarray:
        """Feed ``tokens`` at ``start``: the logits of the last one (under the lock)."""
        step = PagedStep(seq_id, np.asarray(tokens, dtype=np.int64), start, hashes=tuple(hashes))
        self.runner.place(step)
        (logits,) = self.runner.forward([step])
        self.fed += len(tokens)
        return logits

    def _take_in(self, seq_id: str, held: list[int], tokens: list[int]) -> None:
        """Feed tokens of the sequence itself (under the lock); ``held`` grows by them."""
        end = len(held) + len(tokens)
        hashes = self._chains[seq_id].filled([*held, *tokens], len(held), end)
        self._forward(seq_id, tokens, len(held), hashes)
        held.extend(tokens)
        self._held[seq_id] = (held, len(held))

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._held.pop(seq_id, None)
            self._chains.pop(seq_id, None)
            self.runner.release(seq_id)


class NgramProposer:
    """Prompt lookup: continue the sequence the way its own text continued before."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(
        self,
        seq_id: str,
        context: list[int],
        k: int,
        params: SamplingParams,
        prompt_len: int | None = None,
    ) -> Proposal:
        started = time.perf_counter()
        found: list[int] = []
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):  # latest occurrence first
                if context[start : start + n] == tail:
                    found = context[start + n : start + n + k]
                    break
            if found:
                break
        return Proposal(found, time.perf_counter() - started)

    def warm(self, seq_id: str, prompt: list[int]) -> bool:
        return True

    def release(self, seq_id: str) -> None:
        pass


class Acceptance:
    """A running estimate of P(a draft token is accepted), per position.

    A verification accepts proposals up to the first rejection, so a step with ``accepted``
    of ``proposed`` gives ``accepted`` successes and one failure (none when all were kept);
    the estimate is successes / (successes + failures), with older steps decaying. (Accepted /
    proposed undercounts: the positions after a rejection are never tried.)
    """

    def __init__(self, prior: float = 0.6, weight: float = 2.0, decay: float = 0.8) -> None:
        self.decay = decay
        self.successes = prior * weight
        self.failures = (1 - prior) * weight

    @property
    def rate(self) -> float:
        return self.successes / max(self.successes + self.failures, 1e-9)

    def update(self, proposed: int, accepted: int) -> None:
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1 if accepted < proposed else 0)


class StepCost:
    """The measured wall time of a pipeline pass as a line in the positions it verifies:
    ``t(n) = base + per_position * (n - 1)``, fitted by exponentially weighted least squares
    over plain (n = 1) and speculative steps. Until both kinds are seen, an extra position
    costs ``PRIOR_SLOPE`` of a pass (the stop-13 measurement on one core: about 13%)."""

    PRIOR_SLOPE = 0.13

    def __init__(self, pass_s: float = 0.05, decay: float = 0.95) -> None:
        self.decay = decay
        self._w = self._n = self._t = self._nn = self._nt = 0.0
        self._prior = pass_s

    def update(self, positions: int, seconds: float) -> None:
        d = self.decay
        n = float(positions)
        self._w = d * self._w + 1
        self._n = d * self._n + n
        self._t = d * self._t + seconds
        self._nn = d * self._nn + n * n
        self._nt = d * self._nt + n * seconds

    def line(self) -> tuple[float, float]:
        """(base, per_position) in seconds."""
        if self._w < 1e-9:
            return self._prior, self.PRIOR_SLOPE * self._prior
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var = self._nn / self._w - mean_n * mean_n
        # the prior's shape through the mean: when positions hardly vary, or the fit is noise
        slope = self.PRIOR_SLOPE * mean_t / (1 + self.PRIOR_SLOPE * (mean_n - 1))
        if var > 0.25:  # positions vary enough to fit a slope
            fitted = (self._nt / self._w - mean_n * mean_t) / var
            if mean_t - fitted * (mean_n - 1) > 0:
                slope = fitted
        return mean_t - slope * (mean_n - 1), max(0.0, slope)


class AdaptiveK:
    """The choice of k (draft tokens per step); 0 = a plain step without a proposal.

    With per-position acceptance ``a`` a greedy step emits ``(1 - a^n) / (1 - a)`` tokens for
    ``n = k + 1`` verified positions (sampling: ``n = k``); ``k`` maximises tokens per second,
    and greedy steps choose 0 when a plain step is expected to give more. A step's time (from
    the decision to the result) is what steps with that ``k`` measured; a ``k`` not measured
    yet is estimated from a line fitted over every pass (:class:`StepCost`) plus ``k`` draft
    tokens, scaled as the nearest measured ``k``'s estimate was. Only measured choices, their
    neighbours and up to twice the largest measured are chosen, so ``k`` climbs 1, 2, 4, 8 at
    the fastest. Costs are the server's (one
    instance for all requests: network latency and load are shared), the acceptance rate is
    each request's own (passed in; the instance keeps the server-wide one as the prior). One
    step in ``EXPLORE`` tries a neighbour of the best ``k`` (greedy: 0 included), so the
    choices around it stay measured as load and latency change.
    """

    EXPLORE = 16
    MEASURED = 2  # steps with a given k before its measured time replaces the estimate

    def __init__(
        self,
        max_k: int = 8,
        fixed: int | None = None,
        acceptance: float | Acceptance = 0.6,
        pass_s: float = 0.05,
        draft_s: float = 0.005,
        explore: int | None = None,
        start: int | None = None,
    ) -> None:
        self.max_k = max_k
        self.fixed = fixed
        self._acceptance = (
            acceptance
            if isinstance(acceptance, Acceptance)
            else Acceptance(acceptance, weight=4.0, decay=0.95)
        )
        self.cost = StepCost(pass_s)
        self.draft_s = draft_s  # running cost of one draft token (seconds)
        # (k, positions) -> (running seconds of such a step, pass and drafting, steps seen)
        self._measured: dict[tuple[int, int], tuple[float, int]] = {}
        self.steps = 0
        self.explore = explore or self.EXPLORE
        self.start = start  # the first choice, until a k is measured (None: the model's best)
        self.best = start  # the latest choice, explorations aside

    @property
    def acceptance(self) -> float:
        """The server-wide acceptance rate (the prior of new requests)."""
        return self._acceptance.rate

    @property
    def acceptance_model(self) -> Acceptance:
        return self._acceptance

    def _known(self) -> dict[tuple[int, int], float]:
        return {key: t for key, (t, n) in self._measured.items() if n >= self.MEASURED}

    def step_seconds(self, k: int, positions: int) -> float:
        """Measured, or the line's estimate scaled as the nearest measured k's estimate was
        (steps take longer than the passes and draft tokens they add up: waiting, overheads)."""
        return self._seconds(k, positions, self._known(), self.cost.line())

    def _seconds(
        self,
        k: int,
        positions: int,
        known: dict[tuple[int, int], float],
        line: tuple[float, float],
    ) -> float:
        if (k, positions) in known:
            return known[(k, positions)]

        def estimate(k: int, positions: int) -> float:
            return line[0] + line[1] * (positions - 1) + k * self.draft_s

        if not known:
            return estimate(k, positions)
        near = min(known, key=lambda key: (abs(key[0] - k), key[0]))
        return estimate(k, positions) * known[near] / max(estimate(*near), 1e-9)

    def rates(self, greedy: bool, acceptance: float | None = None) -> list[float]:
        """Expected tokens per second for k = 0 .. max_k (k = 0: a plain step)."""
        return self._rates(greedy, acceptance, self._known())

    def _rates(
        self, greedy: bool, acceptance: float | None, known: dict[tuple[int, int], float]
    ) -> list[float]:
        a = min(self.acceptance if acceptance is None else acceptance, 0.99)
        line = self.cost.line()  # once per choice: the fit is the same for every k
        out = [1 / max(self._seconds(0, 1, known, line), 1e-9)]
        for k in range(1, self.max_k + 1):
            positions = k + 1 if greedy else k
            expected = (1 - a**positions) / (1 - a)  # tokens emitted per step
            out.append(expected / max(self._seconds(k, positions, known, line), 1e-9))
        return out

    def model_k(self, greedy: bool, acceptance: float | None = None) -> int:
        """The best k >= 1."""
        rates = self.rates(greedy, acceptance)
        return max(range(1, len(rates)), key=lambda k: rates[k])

    def choose(self, greedy: bool, acceptance: float | None = None) -> int:
        self.steps += 1
        if self.fixed is not None:
            return self.fixed
        known = self._known()
        lowest = 0 if greedy else 1
        if not known and self.start is not None:
            self.best = max(lowest, min(self.start, self.max_k))
            return self.best
        rates = self._rates(greedy, acceptance, known)
        # measured choices, their neighbours and up to twice the largest (an untried k far
        # from any measured one rests on an extrapolation; doubling still climbs from 1 to
        # 8 in three choices, where long network hops make high k pay from the start)
        tried = {k for k, _ in known if k >= lowest}
        allowed = {j for k in tried for j in (k - 1, k, k + 1) if lowest <= j <= self.max_k}
        if tried:
            allowed.update(range(max(tried) + 1, min(2 * max(tried), self.max_k) + 1))
        best = self.best = max(allowed or range(lowest, len(rates)), key=lambda k: rates[k])
        if self.steps % self.explore == 0:  # now and then, a neighbour (alternating sides)
            up = (self.steps // self.explore) % 2 == 0
            step = 1 if (up and best < self.max_k) or best == lowest else -1
            return best + step
        return best

    def _measure(self, k: int, positions: int, seconds: float) -> None:
        old, count = self._measured.get((k, positions), (seconds, 0))
        self._measured[(k, positions)] = (0.7 * old + 0.3 * seconds, count + 1)

    def update(
        self,
        proposed: int,
        accepted: int,
        positions: int,
        pass_s: float,
        draft_s: float,
        step_s: float | None = None,
    ) -> None:
        """After a speculative step: ``accepted`` of ``proposed`` draft tokens were kept; the
        pass verified ``positions`` and took ``pass_s``; drafting took ``draft_s``; the whole
        step took ``step_s`` (default: both; more when it waited for the draft's thread,
        which other requests share)."""
        self._acceptance.update(proposed, accepted)
        self.draft_s = 0.8 * self.draft_s + 0.2 * (draft_s / proposed)
        self.cost.update(positions, pass_s)
        self._measure(proposed, positions, pass_s + draft_s if step_s is None else step_s)

    def update_plain(self, seconds: float) -> None:
        """After a plain step (one token) that took ``seconds`` from its decision on."""
        self.cost.update(1, seconds)
        self._measure(0, 1, seconds)


class KByConcurrency:
    """k for every step, by the number of requests decoding at once (``c``).

    Alone (``c`` = 1) a request chooses its own k from its own acceptance rate
    (:class:`AdaptiveK`). With others, each request maximising its own tokens per second
    is not the server's best: a large k slows every other request's steps too (the draft
    thread and the stages are shared), and a request's own step times cannot tell that
    apart from load, so each drifts to a large k, slower than the best k for all
    (docs/benchmarks.md, "Adaptive K under load"). So from
    ``c`` = 2 on, every request takes one k, held for ``EPOCH`` steps per request, and an
    :class:`AdaptiveK` per ``c`` learns from those steps only: with one k for all, a step's
    measured time is what the server gets at that k, and the k that maximises one request's
    tokens per second maximises the server's. Each epoch moves k at most one step from the
    measured ones (every ``EXPLORE``-th epoch tries a neighbour), starting from the k of one
    request fewer. The acceptance rate is the server's, shared by every level.
    """

    EPOCH = 6  # steps per request before k is chosen again
    EXPLORE = 3  # epochs
    MAX_LEVEL = 8  # concurrency levels above this share one model

    def __init__(self, max_k: int = 8, fixed: int | None = None) -> None:
        self.max_k = max_k
        self.fixed = fixed
        # alone, k starts at 1 and climbs: the prior's costs (a 5 ms draft token) are far
        # from any real draft's, and a short request would end before a high start came down
        self.alone = AdaptiveK(max_k, fixed, start=1)
        self._levels: dict[int, AdaptiveK] = {1: self.alone}
        self._epoch: dict[int, tuple[int, int]] = {}  # level -> (k, steps left)

    @property
    def acceptance(self) -> float:
        """The server-wide acceptance rate."""
        return self.alone.acceptance

    def level(self, concurrency: int) -> AdaptiveK:
        c = max(1, min(concurrency, self.MAX_LEVEL))
        model = self._levels.get(c)
        if model is None:
            below = self.level(c - 1)
            start = self._epoch[c - 1][0] if c - 1 in self._epoch else below.best
            model = self._levels[c] = AdaptiveK(
                self.max_k,
                self.fixed,
                self.alone.acceptance_model,
                explore=self.EXPLORE,
                start=start,
            )
        return model

    def choose(self, concurrency: int, greedy: bool, acceptance: float | None = None) -> int:
        """k for a step of a request; ``acceptance``: the request's own rate (used alone)."""
        if self.fixed is not None:
            return self.fixed
        if concurrency <= 1:
            return self.alone.choose(greedy, acceptance)
        c = min(concurrency, self.MAX_LEVEL)
        k, left = self._epoch.get(c, (0, 0))
        if left <= 0:
            k, left = self.level(c).choose(greedy), self.EPOCH * c
        self._epoch[c] = (k, left - 1)
        return k
