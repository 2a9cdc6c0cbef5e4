"""Token sampling for one row of logits on the last pipeline stage (numpy only, no torch).

Pipeline, in this order:

1. ``logit_bias`` is added; ``repetition_penalty`` (vLLM / Hugging Face semantics) divides the
   positive logits of every token in ``prompt_seen`` (the prompt's token ids) or ``history``
   and multiplies the negative ones; then OpenAI presence/frequency penalties are subtracted
   using the counts of ``history`` (the tokens generated so far in this request). The input
   array is never modified; a copy is made only when one of these actually changes something.
2. Reported logprobs (``logprobs`` / ``top_logprobs``) are the log-softmax of these adjusted
   logits, before temperature and truncation, as OpenAI reports them; they are therefore the same
   for greedy and sampled requests. They cost one extra pass and are computed only on request.
3. ``temperature == 0`` is greedy: one ``argmax`` (ties go to the lowest token id).
4. Otherwise the logits are scaled by ``1 / temperature``; with ``min_p`` the tokens whose
   probability is below ``min_p`` times the most probable one's are dropped; what is left is
   truncated to ``top_k`` and then to the nucleus ``top_p`` (the smallest set of most
   probable tokens whose cumulative probability is ``>= top_p``, at least one token),
   renormalised, and one token is drawn by inverse CDF over the
   kept tokens ordered by (probability desc, token id asc) - precisely by adjusted logit desc,
   then id asc, which temperature cannot reorder. :func:`probabilities` returns exactly
   that ordered distribution; :func:`sample` draws from it.

Reproducibility: the draw for a token depends only on ``(seed, position)``. Each token uses
exactly one uniform ``u = np.random.default_rng([seed mod 2**64, position]).random()``, so a token
is the same whatever the batching, retries or rollbacks around it. ``seed=None`` means the fixed
seed 0: choosing a random seed per request when the user gave none is the caller's (the
gateway's) job, so that the seed it picked can be recorded and the request replayed.

Speed (vocab ~152k, every token): nothing sorts the whole vocabulary in the common case. Top-k
selection (``top_k``, ``top_logprobs`` and the 512 nucleus candidates) first bounds the k-th
largest value from below by the k-th largest maximum over strided groups of the vocabulary, one
cheap pass, and only partitions the few survivors. ``top_p`` without ``top_k``, and plain
temperature sampling, look at the 512 most probable tokens first; only when those do not reach
``top_p`` (or, for plain temperature, when ``u`` falls past them) do they widen to 8192 and then
to a full sort. Every prefix has the same probabilities and cumulative sums as the full sorted
distribution, so the wider look gives the identical token, only slower.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protos.sampling import SampledToken, SamplingParams

__all__ = [
    "annotate",
    "greedy_token",
    "pick",
    "probabilities",
    "sample",
    "suppress",
    "uniform",
]

FloatArray = npt.NDArray[np.float32]
IdArray = npt.NDArray[np.int64]
ProbArray = npt.NDArray[np.float64]

# Tokens the nucleus / plain-temperature paths look at first (then 16x more, then all).
NUCLEUS_CANDIDATES = 512
_GROUP = 64  # stride-group size of the top-k prefilter
_SEED_MOD = 1 << 64


def sample(
    logits: npt.ArrayLike,
    params: SamplingParams,
    position: int,
    history: Sequence[int] = (),
    prompt_seen: Sequence[int] = (),
) -> SampledToken:
    """Pick the token at absolute sequence ``position`` from one row of logits ``[vocab]``.

    ``history`` is the tokens generated so far in this request (for the penalties),
    ``prompt_seen`` the prompt's token ids (for the repetition penalty). ``params`` is assumed
    to have passed :meth:`SamplingParams.validate`.
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    adjusted = adjusted_logits(logits, params, history, prompt_seen)
    return annotate(adjusted, params, pick(adjusted, params, position))


def pick(adjusted: FloatArray, params: SamplingParams, position: int) -> int:
    """The token :func:`sample` picks at ``position`` from bias- and penalty-adjusted logits:
    the ``argmax`` when greedy, else the inverse-CDF draw with the position's one uniform.
    A draft proposes with it too (speculative decoding), on its own logits."""
    if params.temperature == 0.0:
        return greedy_token(adjusted)
    return _draw(adjusted, params, uniform(params.seed, position))


def uniform(seed: int | None, position: int) -> float:
    """The one uniform of the draw at ``position``: ``(seed, position)`` alone decide it."""
    return float(np.random.default_rng([_seed_key(seed), position]).random())


def greedy_token(adjusted: FloatArray) -> int:
    """``argmax`` of adjusted logits (ties: the lowest id); refuses rows without a finite max."""
    token = int(np.argmax(adjusted))
    if not math.isfinite(float(adjusted[token])):
        raise ValueError("logits must contain a finite maximum (NaN, +inf or all -inf)")
    return token


def annotate(adjusted: FloatArray, params: SamplingParams, token: int) -> SampledToken:
    """``token`` with the logprobs ``params`` asks for, from bias- and penalty-adjusted logits."""
    if not (params.logprobs or params.top_logprobs > 0):
        return SampledToken(token_id=token, logprob=None, top=[])
    peak = float(adjusted.max())
    log_z = peak + math.log(float(np.exp(adjusted - np.float32(peak)).sum()))
    top: list[tuple[int, float]] = []
    if params.top_logprobs > 0:
        ids = _top_sorted(adjusted, params.top_logprobs)
        values = adjusted[ids].astype(np.float64) - log_z
        top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
    return SampledToken(token_id=token, logprob=float(adjusted[token]) - log_z, top=top)


def probabilities(
    logits: npt.ArrayLike,
    params: SamplingParams,
    history: Sequence[int] = (),
    prompt_seen: Sequence[int] = (),
) -> tuple[IdArray, ProbArray]:
    """The final sampling distribution for ``temperature > 0`` as ``(token_ids, probs)``.

    Only the kept (truncated) tokens are returned, in draw order (probability desc, id asc), with
    ``probs`` (float64) renormalised to sum to 1. ``history`` feeds the penalties as in
    :func:`sample`. Without ``top_k``/``top_p`` this is the whole vocabulary (a full sort).
    """
    if params.temperature <= 0.0:
        raise ValueError("probabilities() needs temperature > 0 (greedy has no distribution)")
    return _distribution(adjusted_logits(logits, params, history, prompt_seen), params)


# --- internals -------------------------------------------------------------------------------


def _seed_key(seed: int | None) -> int:
    # Negative 64-bit seeds map to distinct non-negative keys (SeedSequence needs >= 0).
    return 0 if seed is None else int(seed) % _SEED_MOD


def adjusted_logits(
    logits: npt.ArrayLike,
    params: SamplingParams,
    history: Sequence[int],
    prompt_seen: Sequence[int] = (),
) -> FloatArray:
    """float32 logits with bias and penalties applied; a copy only when something changes."""
    row: FloatArray = np.asarray(logits, dtype=np.float32)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"expected one non-empty row of logits, got shape {row.shape}")
    penalise = len(history) > 0 and (
        params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )
    repeat = params.repetition_penalty != 1.0 and (len(history) > 0 or len(prompt_seen) > 0)
    if not params.logit_bias and not penalise and not repeat:
        return row
    row = row.copy()
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
        bias = np.fromiter(
            params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias)
        )
        row[ids] += bias
    if repeat:
        seen = np.unique(
            np.concatenate(
                [np.asarray(prompt_seen, dtype=np.int64), np.asarray(history, dtype=np.int64)]
            )
        )
        if seen[0] < 0 or seen[-1] >= row.size:
            raise ValueError(f"seen token ids outside the vocabulary [0, {row.size})")
        values = row[seen]
        factor = np.float32(params.repetition_penalty)
        row[seen] = np.where(values > 0, values / factor, values * factor)
    if penalise:
        seen, counts = np.unique(np.asarray(history, dtype=np.int64), return_counts=True)
        if seen[0] < 0 or seen[-1] >= row.size:
            raise ValueError(f"history holds token ids outside the vocabulary [0, {row.size})")
        penalty = params.presence_penalty + params.frequency_penalty * counts
        row[seen] -= penalty.astype(np.float32)
    return row


def _peak(adjusted: FloatArray) -> np.float32:
    peak = adjusted.max()
    if not np.isfinite(peak):
        raise ValueError("logits must contain a finite maximum (NaN, +inf or all -inf)")
    return np.float32(peak)


def _weights(logits: FloatArray, peak: np.float32, temperature: float) -> FloatArray:
    """Unnormalised probabilities ``exp((logits - max) / temperature)``; no overflow possible."""
    weights: FloatArray = np.subtract(logits, peak)
    weights *= np.float32(1.0 / temperature)
    return np.exp(weights, out=weights)


def _top_sorted(values: FloatArray, k: int) -> IdArray:
    """Ids of the ``k`` largest values, sorted by (value desc, id asc); exact on ties."""
    size = values.size
    if k >= size:
        return np.argsort(-values, kind="stable").astype(np.int64, copy=False)
    # Prefilter: the k-th largest maximum over disjoint groups is <= the k-th largest value, so
    # every top-k element (and every tie of the k-th value) is >= it. Groups are strided
    # (column maxima of a [group, size // group] view), which numpy reduces in one fast pass.
    group = min(_GROUP, size // (4 * k))
    cand: IdArray | None = None
    sub = values
    if group >= 2:
        body = size - size % group
        maxima = values[:body].reshape(group, -1).max(axis=0)
        if body < size:  # leftover elements are singleton groups
            maxima = np.concatenate([maxima, values[body:]])
        bound = np.partition(maxima, maxima.size - k)[maxima.size - k]
        cand = np.flatnonzero(values >= bound)
        sub = values[cand]
    if sub.size > k:
        part = np.argpartition(sub, sub.size - k)[sub.size - k :]
        kth = sub[part].min()
        above = part[sub[part] > kth]
        ties = np.flatnonzero(sub == kth)[: k - above.size]  # ascending ids
        picked = np.concatenate([above, ties])
    else:
        picked = np.arange(sub.size)
    ids = picked if cand is None else cand[picked]
    ids = ids.astype(np.int64, copy=False)
    return ids[np.lexsort((ids, -values[ids]))]


def _nucleus(probs: ProbArray, top_p: float) -> int:
    """How many of the sorted ``probs`` the nucleus keeps (>= 1), or 0 if they fall short."""
    cdf = np.cumsum(probs)
    if cdf[-1] < top_p:
        return 0
    return int(np.searchsorted(cdf, top_p, side="left")) + 1


def _distribution(
    adjusted: FloatArray, params: SamplingParams, reach: float | None = None
) -> tuple[IdArray, ProbArray]:
    """The sorted sampling distribution; see :func:`probabilities`.

    With ``reach`` set and no truncation, the result may be just the most probable prefix of the
    full distribution, not renormalised, whose cumulative probability exceeds ``reach``: an
    inverse-CDF draw of ``u == reach`` on it is exactly the draw on the whole distribution.
    """
    # Order and top-k selection use the adjusted logits themselves, not the scaled ones: scaling
    # is monotone, and float32 rounding after it could merge distinct logits into ties.
    peak = _peak(adjusted)
    size = adjusted.size
    truncate_p = params.top_p < 1.0
    # min_p keeps the tokens whose weight exp((logit - peak) / T), which is their probability
    # over the most probable one's, is at least min_p: a prefix of the sorted order
    min_p = np.float32(params.min_p)
    if 0 < params.top_k < size:
        ids = _top_sorted(adjusted, params.top_k)
        weights32 = _weights(adjusted[ids], peak, params.temperature)
        if min_p > 0:
            keep = int(np.count_nonzero(weights32 >= min_p))
            ids, weights32 = ids[:keep], weights32[:keep]
        weights = weights32.astype(np.float64)
        probs = weights / weights.sum()
        if truncate_p:
            keep = _nucleus(probs, params.top_p) or ids.size
            ids, probs = ids[:keep], probs[:keep]
            probs = probs / probs.sum()
        return ids, probs

    # Look at the most probable NUCLEUS_CANDIDATES first, then 16x more, then everything. Every
    # prefix has the same probabilities and cumulative sums as the full sorted distribution.
    weights32 = _weights(adjusted, peak, params.temperature)
    limit = size  # the tokens min_p keeps (all without it)
    if min_p > 0:
        kept = weights32 >= min_p
        limit = int(np.count_nonzero(kept))
        total = float(weights32[kept].sum())
    else:
        total = float(weights32.sum())
    count = limit if not truncate_p and reach is None else min(NUCLEUS_CANDIDATES, limit)
    while True:
        ids = _top_sorted(adjusted, count)
        probs = weights32[ids].astype(np.float64) / total
        if truncate_p:
            keep = _nucleus(probs, params.top_p)
            if keep or count == limit:  # rounding can leave the full sum just under top_p
                probs = probs[: keep or limit]
                return ids[: keep or limit], probs / probs.sum()
        elif count == limit or (reach is not None and np.cumsum(probs)[-1] > reach):
            return ids, probs
        count = count * 16
        if 2 * count > limit:
            count = limit


def inverse_cdf(probs: ProbArray, u: float) -> int:
    """Index of the draw ``u`` in sorted ``probs``; never a zero-probability tail entry."""
    cdf = np.cumsum(probs)
    index = int(np.searchsorted(cdf, u, side="right"))
    if index >= cdf.size:  # u beyond the rounded total: the last token with probability > 0
        index = int(np.searchsorted(cdf, cdf[-1], side="left"))
    return index


def _draw(adjusted: FloatArray, params: SamplingParams, u: float) -> int:
    ids, probs = _distribution(adjusted, params, reach=u)
    return int(ids[inverse_cdf(probs, u)])


def suppress(
    rows: npt.ArrayLike, ids: Sequence[int], first_position: int, before: int
) -> FloatArray:
    """Logits ``rows`` (row i samples absolute position ``first_position + i``) with tokens
    ``ids`` set to -inf in every row whose position is before ``before`` (``min_tokens``:
    the end-of-sequence ids are never sampled early). A copy; ``rows`` is not changed."""
    out = np.array(rows, dtype=np.float32)
    early = max(0, min(len(out), before - first_position))
    if early and len(ids):
        index = np.asarray(ids, dtype=np.int64)
        index = index[(index >= 0) & (index < out.shape[-1])]
        out[:early, index] = -np.inf
    return out


def apply_masks(rows: npt.ArrayLike, masks: Sequence[bytes]) -> FloatArray:
    """Logits ``rows`` with every token a mask does not allow set to -inf (constrained
    decoding): ``masks[i]`` is row i's bitmask, bit t of byte t // 8 (little-endian bit order)
    for token t; tokens past its end are not allowed. A copy; ``rows`` is not changed."""
    out = np.array(rows, dtype=np.float32)
    if len(masks) != len(out):
        raise ValueError(f"{len(masks)} token masks for {len(out)} sampled rows")
    vocab = out.shape[-1]
    for row, mask in zip(out, masks, strict=True):
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
        allowed = np.zeros(vocab, dtype=bool)
        allowed[: min(vocab, len(bits))] = bits[:vocab].astype(bool)
        if not allowed.any():
            raise ValueError("a token mask allows no token")
        row[~allowed] = -np.inf
    return out
