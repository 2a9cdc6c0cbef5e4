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
   renormalised. :func:`probabilities` returns exactly that distribution, sorted by
   (probability desc, token id asc). One token is drawn from it by **Gumbel-max**: the kept
   token ``j`` with the largest ``logit_j / temperature + g_j``, where ``g_j = -log(-log(u_j))``
   is Gumbel noise and ``u_j`` a uniform that only ``(seed, position, j)`` decide (SplitMix64
   hashes, 24-bit uniforms, built per block of 64 ids so that each block's largest uniform is
   known first: see :func:`_uniforms`). The argmax of log-probabilities plus independent
   Gumbel noise is distributed exactly as the probabilities, so the draw is the distribution
   itself, after every truncation, penalty and bias. Speculative decoding relies on the noise
   being per token: a draft that proposes the same draw from its own logits (:func:`pick`)
   proposes the target's token whenever the two models' winners under the same noise
   coincide.

Reproducibility: the draw for a token depends only on ``(seed, position)`` (and the logits).
The noise of a token id does not depend on the vocabulary's size or the rest of the row, so a
token is the same whatever the batching, retries or rollbacks around it. ``seed=None`` means
the fixed seed 0: choosing a random seed per request when the user gave none is the caller's
(the gateway's) job, so that the seed it picked can be recorded and the request replayed.

Speed (vocab ~152k, every token): nothing sorts the whole vocabulary in the common case.
Without top-k / top-p the draw is pruned exactly: the most probable token's score
``logit_t / T + g_t`` is a floor for the winner's, and no token of a block of 64 ids scores
above the block's largest logit plus its largest noise (one hash per block), so one pass of
block maxima picks the few blocks whose bound reaches the floor and only their ids get noise.
Top-k selection (``top_k``, ``top_logprobs`` and the 512 nucleus candidates) first bounds the
k-th largest value from below by the k-th largest maximum over strided groups of the
vocabulary, one cheap pass, and only partitions the few survivors. ``top_p`` without
``top_k`` looks at the 512 most probable tokens first; only when those do not reach ``top_p``
does it widen to 8192 and then to a full sort.
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
    "gumbel_noise",
    "pick",
    "probabilities",
    "sample",
    "suppress",
]

FloatArray = npt.NDArray[np.float32]
IdArray = npt.NDArray[np.int64]
ProbArray = npt.NDArray[np.float64]

# Tokens the nucleus / plain-temperature paths look at first (then 16x more, then all).
NUCLEUS_CANDIDATES = 512
_GROUP = 64  # stride-group size of the top-k prefilter
_SEED_MOD = 1 << 64
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment
_NOISE_BITS = 24
_ULP = 0.5**_NOISE_BITS
_BLOCK = 64  # ids per block of the noise (see _uniforms)
_PRUNE_MARGIN = 1e-6  # float rounding of a block's bound: the pruning never drops a winner


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
    the ``argmax`` when greedy, else the Gumbel-max draw with the position's noise.
    A draft proposes with it too (speculative decoding), on its own logits."""
    if params.temperature == 0.0:
        return greedy_token(adjusted)
    return _draw(adjusted, params, position)


def gumbel_noise(seed: int | None, position: int, ids: npt.ArrayLike) -> ProbArray:
    """The Gumbel noise ``-log(-log(u_j))`` of token ``ids`` at ``position`` (float64):
    ``(seed, position, id)`` alone decide it; see :func:`_uniforms`."""
    noise: ProbArray = -np.log(-np.log(_uniforms(seed, position, np.asarray(ids, np.int64))))
    return noise


def _uniforms(seed: int | None, position: int, ids: IdArray) -> ProbArray:
    """The tokens' uniforms, built per block of 64 ids (``j // 64``) so that a block's largest
    one is known first: block ``b``'s largest uniform is ``M_b = V_b ** (1 / 64)``, at id
    ``64 b + L_b``; every other id's is ``M_b * v_j``. ``V_b``, ``v_j`` (24-bit uniforms
    ``(k + 0.5) / 2**24``) and ``L_b`` (6 bits) come from SplitMix64 keyed by
    ``mix(seed ^ mix(position))``, output ``2 b + 2`` for the block and ``2 j + 1`` for the
    token. The 64 uniforms of a block are then independent and uniform, as if drawn directly."""
    top, where = _block_maxima(seed, position, ids // _BLOCK)
    own = _splitmix(_stream_key(seed, position), 2 * ids + 1) >> np.uint64(64 - _NOISE_BITS)
    uniforms: ProbArray = np.where(
        ids % _BLOCK == where, top, top * ((own.astype(np.float64) + 0.5) * _ULP)
    )
    return uniforms


def _block_maxima(seed: int | None, position: int, blocks: IdArray) -> tuple[ProbArray, IdArray]:
    """Each block's largest uniform ``M_b`` and where it is (``L_b``, the id modulo 64)."""
    z = _splitmix(_stream_key(seed, position), 2 * blocks + 2)
    where = (z & np.uint64(_BLOCK - 1)).astype(np.int64)
    top: ProbArray = ((z >> np.uint64(64 - _NOISE_BITS)).astype(np.float64) + 0.5) * _ULP
    np.power(top, 1.0 / _BLOCK, out=top)
    return top, where


def _stream_key(seed: int | None, position: int) -> int:
    return _mix64(_seed_key(seed) ^ _mix64(position & _MASK64))


def _splitmix(key: int, counters: IdArray) -> npt.NDArray[np.uint64]:
    """SplitMix64's outputs number ``counters`` of the stream that starts at ``key``."""
    z = counters.astype(np.uint64)
    z *= np.uint64(_GOLDEN)  # wraps modulo 2**64, as SplitMix64's counter does
    z += np.uint64(key)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _mix64(x: int) -> int:
    """SplitMix64's finaliser on a Python int (the per-(seed, position) key)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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

    Only the kept (truncated) tokens are returned, sorted by (probability desc, id asc), with
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


def _distribution(adjusted: FloatArray, params: SamplingParams) -> tuple[IdArray, ProbArray]:
    """The sorted sampling distribution; see :func:`probabilities`."""
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
    count = limit if not truncate_p else min(NUCLEUS_CANDIDATES, limit)
    while True:
        ids = _top_sorted(adjusted, count)
        probs = weights32[ids].astype(np.float64) / total
        if truncate_p:
            keep = _nucleus(probs, params.top_p)
            if keep or count == limit:  # rounding can leave the full sum just under top_p
                probs = probs[: keep or limit]
                return ids[: keep or limit], probs / probs.sum()
        elif count == limit:
            return ids, probs
        count = count * 16
        if 2 * count > limit:
            count = limit


def _draw(adjusted: FloatArray, params: SamplingParams, position: int) -> int:
    """Gumbel-max over the kept tokens: ``argmax logit_j / T + g_j`` (ties: the lowest id)."""
    scale = 1.0 / params.temperature
    if (0 < params.top_k < adjusted.size) or params.top_p < 1.0:
        ids, _ = _distribution(adjusted, params)
        ids = np.sort(ids)
    else:
        # Exact pruning: the top token's score is a floor for the winner's, and no token of a
        # block scores above the block's largest logit plus its largest noise; expand only
        # the blocks whose bound reaches the floor.
        peak = _peak(adjusted)
        top = int(np.argmax(adjusted))
        size = adjusted.size
        body = size - size % _BLOCK
        maxima = adjusted[:body].reshape(-1, _BLOCK).max(axis=1)
        if body < size:
            maxima = np.append(maxima, adjusted[body:].max())
        blocks = np.arange(maxima.size, dtype=np.int64)
        block_top, _ = _block_maxima(params.seed, position, blocks)
        bound = maxima.astype(np.float64) * scale - np.log(-np.log(block_top))
        floor = float(peak) * scale + float(gumbel_noise(params.seed, position, [top])[0])
        reach = bound >= floor - _PRUNE_MARGIN
        if params.min_p > 0:  # blocks whose largest weight min_p drops hold no kept token
            reach &= _weights(maxima, peak, params.temperature) >= np.float32(params.min_p)
        near = np.flatnonzero(reach)
        ids = (near[:, None] * _BLOCK + np.arange(_BLOCK)).ravel()
        ids = ids[ids < size]
        ids = ids[np.isfinite(adjusted[ids])]
        if params.min_p > 0:
            ids = ids[_weights(adjusted[ids], peak, params.temperature) >= np.float32(params.min_p)]
    scores = adjusted[ids].astype(np.float64) * scale + gumbel_noise(params.seed, position, ids)
    return int(ids[int(np.argmax(scores))])


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
