"""Verifying a draft's proposal on the last stage, exactly (numpy only).

The target was fed ``[x0, d1, ..., dK]``; its logits rows ``p_1 .. p_m`` (``m = K + 1``) predict
the positions after each fed token. The draft proposed ``d_1 .. d_n`` with ``n = m`` (every
position is tested) or ``n = m - 1`` (the last position is a plain "bonus" sample).

Coupled verification: at each tested position i, ``x_i`` is the token a plain
:func:`~shard_runtime.sampling.sample` picks from the target's row there (bias, penalties with
the prompt and the tokens before position i, then greedy ``argmax``, or temperature, min-p,
top-k, top-p and the Gumbel-max draw with the position's noise ``g_ij``, which depends only
on ``(seed, position, token id)``). ``d_i`` is accepted iff ``x_i == d_i``; at the first mismatch
``x_i`` is emitted and verification stops; when every proposal was accepted, the bonus row (if
any) gives a plain sample. Every emitted token is therefore the plain sampler's token at its
position, whatever the draft proposed: speculative output is token for token the output
without speculation, alone or batched, for greedy and seeded sampling alike.

The draft proposes what the plain sampler would pick from the draft's own logits with the same
noise (:func:`shard_runtime.sampling.pick`), so that where draft and target distributions are
close the two picks agree (the same token has the largest log-probability plus noise in both).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from protos.sampling import SampledToken, SamplingParams
from shard_runtime.sampling import adjusted_logits, annotate, pick, sample


def verify(
    rows: npt.ArrayLike,
    draft: Sequence[int],
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
    seen = list(history)
    out: list[SampledToken] = []
    for i in range(m):
        position = first_position + i
        if i == len(draft):  # the bonus position: a plain sample
            out.append(sample(logits[i], params, position, seen, prompt_seen))
            break
        adjusted = adjusted_logits(logits[i], params, seen, prompt_seen)
        token = pick(adjusted, params, position)
        out.append(annotate(adjusted, params, token))
        seen.append(token)
        if token != draft[i]:
            break
    return out
