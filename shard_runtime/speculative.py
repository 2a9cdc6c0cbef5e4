"""Verifying a draft's proposal on the last stage, exactly (numpy only).

The target was fed ``[x0, d1, ..., dK]``; its logits rows ``p_1 .. p_m`` (``m = K + 1``) predict
the positions after each fed token. The draft proposed ``d_1 .. d_n`` with ``n = m`` (every
position is tested) or ``n = m - 1`` (the last position is a plain "bonus" sample), and, when
sampling, the distribution ``q_i`` it drew each ``d_i`` from (possibly truncated to its most
probable tokens: any proposal distribution is valid as long as it is the one ``d_i`` was drawn
from).

* Greedy (``temperature == 0``): emit ``argmax p_i`` for i = 1, 2, ... and stop after the first
  one that differs from ``d_i``. The output is the greedy output without speculation.
* Sampling: accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; on rejection emit a
  token drawn from the residual ``norm(max(0, p_i - q_i))`` and stop (Leviathan et al. 2023,
  Chen et al. 2023). Each emitted token is then distributed exactly as ``p_i``.

``p_i`` is the final sampling distribution of :mod:`shard_runtime.sampling` (bias, penalties
with the prompt and the tokens before position i, temperature, min-p, top-k, top-p). Random
numbers come from ``(seed, position, purpose)``, so a fixed seed gives the same output, and
when the draft proposes every position (``n = m``) the output does not depend on how many
tokens each step proposes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protos.sampling import DraftDistribution, SampledToken, SamplingParams
from shard_runtime.sampling import (
    _distribution,
    _peak,
    _seed_key,
    _weights,
    adjusted_logits,
    annotate,
    greedy_token,
    inverse_cdf,
    sample,
)

_ACCEPT = 1  # random stream for acceptance tests
_RESIDUAL = 2  # random stream for draws from the residual


def uniform(seed: int | None, position: int, purpose: int) -> float:
    return float(np.random.default_rng([_seed_key(seed), position, purpose]).random())


def verify(
    rows: npt.ArrayLike,
    draft: Sequence[int],
    dists: Sequence[DraftDistribution],
    params: SamplingParams,
    first_position: int,
    history: Sequence[int] = (),
    prompt_seen: Sequence[int] = (),
) -> list[SampledToken]:
    """The tokens to emit (at least one): accepted draft tokens, then a correction or bonus.

    ``rows[i]`` is the target's logits for absolute position ``first_position + i``; ``history``
    the tokens generated before ``first_position`` (for penalties), ``prompt_seen`` the
    prompt's token ids (for the repetition penalty): each row is adjusted as a plain
    :func:`~shard_runtime.sampling.sample` at its position would adjust it.
    """
    logits = np.asarray(rows, dtype=np.float32)
    m = logits.shape[0]
    if len(draft) not in (m, m - 1) or len(draft) == 0:
        raise ValueError(f"{m} rows verify {m} or {m - 1} draft tokens, got {len(draft)}")
    greedy = params.temperature == 0.0
    if not greedy and len(dists) != len(draft):
        raise ValueError("sampling needs the draft distribution of every draft token")
    seen = list(history)
    out: list[SampledToken] = []
    for i in range(m):
        position = first_position + i
        if i == len(draft):  # the bonus position: a plain sample
            out.append(sample(logits[i], params, position, seen, prompt_seen))
            break
        adjusted = adjusted_logits(logits[i], params, seen, prompt_seen)
        if greedy:
            token = greedy_token(adjusted)
            accepted = token == draft[i]
        else:
            token, accepted = _test(adjusted, params, draft[i], dists[i], position)
        out.append(annotate(adjusted, params, token))
        seen.append(token)
        if not accepted:
            break
    return out


def _test(
    adjusted: npt.NDArray[np.float32],
    params: SamplingParams,
    proposed: int,
    dist: DraftDistribution,
    position: int,
) -> tuple[int, bool]:
    """One speculative-sampling step: (emitted token, whether it was the accepted proposal)."""
    q_ids = np.asarray(dist[0], dtype=np.int64)
    q_probs = np.asarray(dist[1], dtype=np.float64)
    truncated = 0 < params.top_k < adjusted.size or params.top_p < 1.0 or params.min_p > 0
    if truncated:
        ids, probs = _distribution(adjusted, params)
        where = np.flatnonzero(ids == proposed)
        p = float(probs[where[0]]) if where.size else 0.0
    else:  # p(proposed) without sorting the vocabulary
        weights = _weights(adjusted, _peak(adjusted), params.temperature)
        p = float(weights[proposed]) / float(weights.astype(np.float64).sum())
    hit = np.flatnonzero(q_ids == proposed)
    q = float(q_probs[hit[0]]) if hit.size else 0.0
    if q > 0.0 and uniform(params.seed, position, _ACCEPT) < min(1.0, p / q):
        return proposed, True
    if not truncated:
        ids, probs = _distribution(adjusted, params)
    # Residual max(0, p - q) in the target's canonical order (probability desc, id asc).
    q_dense = np.zeros(adjusted.size, dtype=np.float64)
    q_dense[q_ids] = q_probs
    q_on_p = q_dense[ids]
    residual = np.maximum(probs - q_on_p, 0.0)
    total = float(residual.sum())
    if total <= 0.0 or not math.isfinite(total):  # p == q on p's support: any p-draw is exact
        residual, total = probs, float(probs.sum())
    index = inverse_cdf(residual / total, uniform(params.seed, position, _RESIDUAL))
    return int(ids[index]), False
