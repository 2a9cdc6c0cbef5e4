"""Proposers for speculative decoding on the gateway, and the adaptive choice of K.

A decode step with speculation feeds the target ``[x0, d1 .. dk]`` (greedy: ``k`` proposals and a
bonus position) or ``[x0, d1 .. d(k-1)]`` (sampling: every one of the ``k`` positions tests a
proposal, so the output does not depend on ``k``), and the last stage verifies
(:mod:`stage_node.speculative`). Rejected positions are rolled back on every stage by the next
step's ``rollback`` (the stages trim their KV state: no garbage, no growth) and in the draft here.

* :class:`DraftProposer`: the small draft model of the export (``export/draft``), run with
  OpenVINO on the gateway with one KV session per sequence.
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

from protos.manifest import load_manifest
from stage_node.runner import RunnerOptions, ShardRunner
from stage_node.sampling import (
    SamplingParams,
    _adjust,
    _inverse_cdf,
    greedy_token,
    probabilities,
)
from stage_node.speculative import DraftDistribution, uniform

DRAFT_TOP_K = 64  # the draft's sampling distribution is truncated to this many tokens
_DRAFT_STREAM = 3  # random stream of draft draws (the verifier uses 1 and 2)


@dataclass
class Proposal:
    tokens: list[int]
    dists: list[DraftDistribution]  # empty for greedy
    seconds: float = 0.0


class Proposer(Protocol):
    def propose(self, seq_id: str, context: list[int], k: int, params: SamplingParams) -> Proposal:
        """Up to ``k`` tokens to follow ``context`` (the sequence so far); blocking."""
        ...

    def warm(self, seq_id: str, prompt: list[int]) -> None:
        """Take in the prompt ahead of the first proposal (while the target prefills)."""
        ...

    def release(self, seq_id: str) -> None: ...


class DraftProposer:
    """The draft model: one OpenVINO session per sequence, kept in step with the target."""

    def __init__(self, export_dir: Path, options: RunnerOptions, vocab_size: int) -> None:
        manifest = load_manifest(export_dir)
        if manifest.num_stages != 1:
            raise ValueError(f"the draft at {export_dir} must be a 1-stage export")
        if manifest.model.vocab_size != vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({manifest.model.vocab_size}) differs from the "
                f"target's ({vocab_size}); a draft must share the target's tokenizer"
            )
        self.model_id = manifest.model.model_id
        self.runner = ShardRunner(export_dir, 0, options, manifest=manifest)
        # Per sequence: the tokens its draft session holds, and how many of them came from the
        # sequence itself (the rest are proposals, which may have been rejected since).
        self._held: dict[str, tuple[list[int], int]] = {}
        self._lock = threading.Lock()  # one inference at a time on the gateway

    def propose(self, seq_id: str, context: list[int], k: int, params: SamplingParams) -> Proposal:
        started = time.perf_counter()
        with self._lock:
            held, common = self._held.get(seq_id, ([], 0))
            # the sequence only grows: only the proposals held beyond `common` can differ
            while common < min(len(held), len(context)) and held[common] == context[common]:
                common += 1
            if common == len(context):  # the last token's logits are needed again
                common -= 1
            if common < len(held):
                self.runner.rollback(seq_id, len(held) - common)
                del held[common:]
            feed = context[common:]
            synced = len(context)
            tokens: list[int] = []
            dists: list[DraftDistribution] = []
            greedy = params.temperature == 0.0
            for _ in range(k):
                logits = self.runner.forward(seq_id, np.asarray(feed, dtype=np.int64))[-1]
                held.extend(feed)
                position = len(held)
                if greedy:
                    token = greedy_token(_adjust(logits, params, ()))
                else:
                    token, dist = _draw(logits, params, position)
                    dists.append(dist)
                tokens.append(token)
                feed = [token]
            self._held[seq_id] = (held, synced)
        return Proposal(tokens, dists, time.perf_counter() - started)

    def warm(self, seq_id: str, prompt: list[int]) -> None:
        with self._lock:
            if seq_id in self._held or len(prompt) < 2:
                return
            # all but the last token: a proposal always needs to feed at least one
            self.runner.forward(seq_id, np.asarray(prompt[:-1], dtype=np.int64))
            self._held[seq_id] = (list(prompt[:-1]), len(prompt) - 1)

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._held.pop(seq_id, None)
            self.runner.release(seq_id)


class NgramProposer:
    """Prompt lookup: continue the sequence the way its own text continued before."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram

    def propose(self, seq_id: str, context: list[int], k: int, params: SamplingParams) -> Proposal:
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
        dists: list[DraftDistribution] = (
            [] if params.temperature == 0.0 else [([t], [1.0]) for t in found]
        )
        return Proposal(found, dists, time.perf_counter() - started)

    def warm(self, seq_id: str, prompt: list[int]) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass


@dataclass
class AdaptiveK:
    """The choice of k (draft tokens per step); 0 = a plain step without a proposal.

    The model: with acceptance rate ``a`` a step emits ``(1 - a^n) / (1 - a)`` tokens for ``n``
    verified positions and costs a pipeline pass (a little more per extra position) plus ``k``
    draft tokens; ``k`` maximises tokens per second. Costs are the server's (one instance for
    all requests: network latency and load are shared), the acceptance rate is each request's
    own (passed in; the instance keeps the server-wide one as the prior). Greedy steps also
    measure what plain steps give (one in ``EXPLORE`` steps goes the other way) and stop
    proposing while plain steps are faster, e.g. when the draft competes with the stages for
    the same cores. Sampling always proposes, so that its output does not depend on the choice.
    """

    EXPLORE = 16

    max_k: int = 8
    fixed: int | None = None
    acceptance: float = 0.6  # prior; running estimate of P(a draft token is accepted)
    pass_s: float = 0.05  # running cost of one pipeline pass (seconds)
    draft_s: float = 0.005  # running cost of one draft token
    spec_rate: float | None = None  # tokens per second on speculative steps
    plain_rate: float | None = None  # tokens per second on plain steps
    steps: int = 0

    def model_k(self, greedy: bool, acceptance: float | None = None) -> int:
        a = min(self.acceptance if acceptance is None else acceptance, 0.99)
        best, best_rate = 1, 0.0
        for k in range(1, self.max_k + 1):
            positions = k + 1 if greedy else k
            expected = (1 - a**positions) / (1 - a)  # tokens emitted per step
            cost = self.pass_s * (1 + 0.02 * positions) + k * self.draft_s
            if expected / cost > best_rate:
                best, best_rate = k, expected / cost
        return best

    def choose(self, greedy: bool, acceptance: float | None = None) -> int:
        self.steps += 1
        if self.fixed is not None:
            return self.fixed
        k = self.model_k(greedy, acceptance)
        if not greedy:
            return k
        speculate = (
            self.spec_rate is None or self.plain_rate is None or self.spec_rate >= self.plain_rate
        )
        if self.steps % self.EXPLORE == 0:  # now and then, try the other way
            speculate = not speculate
        return k if speculate else 0

    def update(
        self, proposed: int, accepted: int, emitted: int, pass_s: float, draft_s: float
    ) -> None:
        """After a speculative step: ``accepted`` of ``proposed`` draft tokens were kept."""
        self.acceptance = 0.8 * self.acceptance + 0.2 * (accepted / proposed)
        self.draft_s = 0.8 * self.draft_s + 0.2 * (draft_s / proposed)
        self.pass_s = 0.8 * self.pass_s + 0.2 * pass_s
        rate = emitted / max(pass_s + draft_s, 1e-6)
        self.spec_rate = rate if self.spec_rate is None else 0.8 * self.spec_rate + 0.2 * rate

    def update_plain(self, seconds: float) -> None:
        """After a plain step (one token) that took ``seconds``."""
        rate = 1 / max(seconds, 1e-6)
        self.plain_rate = rate if self.plain_rate is None else 0.7 * self.plain_rate + 0.3 * rate


def _draw(
    logits: np.ndarray, params: SamplingParams, position: int
) -> tuple[int, DraftDistribution]:
    """A draft token and the truncated distribution it was drawn from."""
    top_k = min(params.top_k, DRAFT_TOP_K) if params.top_k else DRAFT_TOP_K
    ids, probs = probabilities(logits, replace(params, top_k=top_k))
    index = _inverse_cdf(probs, uniform(params.seed, position, _DRAFT_STREAM))
    return int(ids[index]), (ids.tolist(), probs.astype(np.float32).tolist())
