"""The last-stage token sampler: greedy, bias/penalties, seeded draws, truncation, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax, softmax
from scipy.stats import chisquare

from protos.sampling import SamplingParams
from shard_runtime.sampling import gumbel_noise, probabilities, sample

pytestmark = pytest.mark.unit

DRAWS = 4000
SMALL = np.array([0.3, 0.2, 0.1, 0.0, -0.1, -0.2], dtype=np.float32)


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64: the documented hash, in plain Python integers."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _noise(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """The documented Gumbel noise of token ids at (seed, position): -log(-log(u)); block
    b = id // 64 has its largest uniform M = V ** (1/64) at id 64 b + L (V the top 24 bits of
    SplitMix64 output 2 b + 2 plus 0.5 over 2**24, L its low 6 bits), every other id M * v
    (v from output 2 id + 1), the stream keyed by mix(seed ^ mix(position))."""
    key = _mix(seed ^ _mix(position))

    def output(counter: int) -> int:  # mix adds the increment once more
        return _mix((key + (counter - 1) * 0x9E3779B97F4A7C15) & _M64)

    out = []
    for token in ids.tolist():
        block = output(2 * (token // 64) + 2)
        top = (((block >> 40) + 0.5) / (1 << 24)) ** (1 / 64)
        own = ((output(2 * token + 1) >> 40) + 0.5) / (1 << 24)
        u = top if token % 64 == block & 63 else top * own
        out.append(-np.log(-np.log(u)))
    return np.array(out)


def _reference(logits: np.ndarray, temperature: float, top_k: int, top_p: float):
    """Independent full-sort implementation of the sampling distribution."""
    order = np.lexsort((np.arange(logits.size), -logits))  # logit desc, id asc
    z = logits.astype(np.float64) / temperature
    if top_k:
        order = order[:top_k]
    probs = softmax(z[order])
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return order, probs


def _counts(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    tokens = [sample(logits, params, position).token_id for position in range(DRAWS)]
    return np.bincount(tokens, minlength=logits.size)


# --- greedy, bias, penalties ------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert sample(logits, SamplingParams(), 0).token_id == int(np.argmax(logits))
    tied = np.zeros(10, dtype=np.float32)
    tied[[7, 3, 9]] = 5.0
    result = sample(tied, SamplingParams(seed=3), 42)
    assert result.token_id == 3
    assert result.logprob is None and result.top == []


def test_logit_bias_forces_and_bans_tokens() -> None:
    logits = np.array([10.0, 0.0, -5.0, 3.0], dtype=np.float32)
    before = logits.copy()
    forced = SamplingParams(temperature=1.0, logit_bias={2: 100.0}, seed=0)
    assert {sample(logits, forced, p).token_id for p in range(50)} == {2}
    assert sample(logits, SamplingParams(logit_bias={0: -100.0}), 0).token_id == 3
    np.testing.assert_array_equal(logits, before)  # the caller's row is untouched


def test_presence_and_frequency_penalties_move_the_argmax() -> None:
    logits = np.array([5.0, 4.9, 1.0], dtype=np.float32)
    assert sample(logits, SamplingParams(), 0, history=[0]).token_id == 0  # no penalty set
    presence = SamplingParams(presence_penalty=0.2)
    assert sample(logits, presence, 0, history=[0]).token_id == 1
    assert sample(logits, presence, 0, history=[2, 2]).token_id == 0
    frequency = SamplingParams(frequency_penalty=0.05)
    assert sample(logits, frequency, 0, history=[0]).token_id == 0  # 4.95 > 4.9
    assert sample(logits, frequency, 0, history=[0, 0, 0]).token_id == 1  # 4.85 < 4.9
    encourage = SamplingParams(presence_penalty=-0.2)
    assert sample(logits, encourage, 0, history=[1]).token_id == 1
    with pytest.raises(ValueError, match="history"):
        sample(logits, presence, 0, history=[3])


# --- seeded draws -----------------------------------------------------------------------------


def test_draws_depend_only_on_seed_and_position() -> None:
    logits = np.zeros(5000, dtype=np.float32)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, params, position).token_id for position in range(40)]
    again = [sample(logits, params, position).token_id for position in reversed(range(40))]
    assert first == again[::-1]
    assert len(set(first)) > 30  # positions give different draws
    other_seed = SamplingParams(temperature=1.0, seed=99)
    assert [sample(logits, other_seed, p).token_id for p in range(40)] != first
    # Flat over 5000 ids: the token is the one with the largest noise.
    assert first[7] == int(np.argmax(_noise(1234, 7, np.arange(5000))))
    # seed=None is the fixed seed 0.
    none = SamplingParams(temperature=1.0)
    zero = SamplingParams(temperature=1.0, seed=0)
    assert sample(logits, none, 11).token_id == sample(logits, zero, 11).token_id


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=1.3, top_k=7, seed=12),
        SamplingParams(temperature=1.0, top_p=0.8, seed=13),
        SamplingParams(temperature=0.9, min_p=0.05, seed=14),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=15),
        SamplingParams(
            temperature=1.0,
            logit_bias={3: 2.0, 0: -1.5},
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.3,
            seed=16,
        ),
    ],
)
def test_gumbel_draws_follow_the_final_distribution(params: SamplingParams) -> None:
    """Chi-square: the Gumbel-max draw is distributed as probabilities() (after truncation,
    bias and penalties), and never leaves the kept set."""
    logits = (np.random.default_rng(21).standard_normal(40) * 1.5).astype(np.float32)
    history, prompt_seen = [3, 5, 5, 9], [1, 2]
    ids, probs = probabilities(logits, params, history, prompt_seen)
    tokens = [
        sample(logits, params, position, history, prompt_seen).token_id for position in range(DRAWS)
    ]
    counts = np.bincount(tokens, minlength=logits.size)
    assert counts.sum() == counts[ids].sum()  # nothing outside the kept set
    expected = probs * DRAWS
    big = expected >= 5  # merge the rare tokens into one cell
    observed = np.append(counts[ids][big], counts[ids][~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected *= observed.sum() / expected.sum()  # float rounding of the total
    assert chisquare(observed, expected).pvalue > 0.001


@pytest.mark.parametrize(
    ("top_k", "top_p", "temperature", "spread"),
    [
        (0, 1.0, 1.0, 0.3),  # full vocabulary: 512 first, then 8192, then a full sort
        (0, 1.0, 0.7, 3.0),  # peaked: the 512 candidates nearly always hold the draw
        (0, 0.9, 0.8, 1.0),  # nucleus past the candidates: wider look / fallback
        (0, 0.5, 1.0, 3.0),
        (40, 1.0, 1.0, 1.0),
        (40, 0.6, 1.3, 1.0),
    ],
)
def test_sample_draws_from_probabilities(
    top_k: int, top_p: float, temperature: float, spread: float
) -> None:
    logits = (np.random.default_rng(5).standard_normal(20000) * spread).astype(np.float32)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=7)
    ids, probs = probabilities(logits, params)
    ref_ids, ref_probs = _reference(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(probs, ref_probs, rtol=2e-4, atol=1e-9)
    for position in range(25):  # Gumbel-max over the kept tokens
        expected = int(ids[np.argmax(np.log(probs) + _noise(7, position, ids))])
        assert sample(logits, params, position).token_id == expected


# --- empirical distributions ------------------------------------------------------------------


def test_temperature_one_matches_softmax() -> None:
    counts = _counts(SMALL, SamplingParams(temperature=1.0, seed=2024))
    expected = softmax(SMALL.astype(np.float64)) * DRAWS
    assert chisquare(counts, expected).pvalue > 0.001


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(temperature=1.0, top_k=2, seed=5), [0, 1]),
        # softmax(SMALL) ~ [.211, .191, .173, ...]: the nucleus for 0.5 is the first three.
        (SamplingParams(temperature=1.0, top_p=0.5, seed=6), [0, 1, 2]),
    ],
)
def test_truncation_keeps_only_the_kept_set(params: SamplingParams, kept: list[int]) -> None:
    ids, probs = probabilities(SMALL, params)
    assert ids.tolist() == kept
    counts = _counts(SMALL, params)
    assert counts[len(kept) :].sum() == 0
    renormalised = softmax(SMALL[kept].astype(np.float64))
    np.testing.assert_allclose(probs, renormalised, rtol=1e-6)
    assert chisquare(counts[kept], renormalised * DRAWS).pvalue > 0.001


def test_top_p_fallback_on_a_flat_distribution() -> None:
    flat = np.zeros(2000, dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_p=0.99, seed=8)
    ids, probs = probabilities(flat, params)
    # 512 candidates hold only 25.6%: the full sort keeps the ~1980 lowest ids (1981 if the
    # float cumulative sum lands just under 0.99), equally likely.
    assert ids.size in (1980, 1981)
    assert ids.tolist() == list(range(ids.size))
    np.testing.assert_allclose(probs, 1 / ids.size)
    tokens = [sample(flat, params, position).token_id for position in range(300)]
    assert max(tokens) < ids.size and len(set(tokens)) > 200
    # Nearly flat with noise: same answer as an independent full-sort reference.
    noisy = (np.random.default_rng(9).standard_normal(2000) * 0.05).astype(np.float32)
    ids, probs = probabilities(noisy, params)
    ref_ids, ref_probs = _reference(noisy, 1.0, 0, 0.99)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(probs, ref_probs, rtol=1e-5)


def test_top_k_ties_prefer_lowest_ids() -> None:
    logits = np.zeros(3000, dtype=np.float32)
    logits[[2500, 1500]] = 1.0
    ids, _ = probabilities(logits, SamplingParams(temperature=1.0, top_k=5))
    assert ids.tolist() == [1500, 2500, 0, 1, 2]


# --- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_are_log_softmax_of_adjusted_logits(temperature: float) -> None:
    logits = (np.random.default_rng(4).standard_normal(3000) * 3).astype(np.float32)
    params = SamplingParams(
        temperature=temperature,
        top_p=0.9,
        seed=1,
        logprobs=True,
        top_logprobs=5,
        logit_bias={17: 12.0},
        frequency_penalty=0.5,
    )
    history = [int(np.argmax(logits))] * 3
    adjusted = logits.astype(np.float64)
    adjusted[17] += 12.0
    adjusted[history[0]] -= 1.5
    reference = log_softmax(adjusted)

    result = sample(logits, params, 3, history=history)
    assert len(result.top) == 5
    ids = [token for token, _ in result.top]
    values = [value for _, value in result.top]
    assert values == sorted(values, reverse=True)
    assert ids == np.argsort(-reference, kind="stable")[:5].tolist()
    np.testing.assert_allclose(values, reference[ids], atol=1e-4)
    assert result.top[0][0] == 17
    assert result.logprob == pytest.approx(reference[result.token_id], abs=1e-4)


def test_logprobs_are_the_same_for_greedy_and_sampled() -> None:
    logits = np.array([4.0, 1.0, 0.5, 0.5, -2.0], dtype=np.float32)
    greedy = sample(logits, SamplingParams(top_logprobs=3), 0)
    hot = sample(logits, SamplingParams(temperature=2.0, top_k=2, top_logprobs=3), 0)
    assert greedy.top == hot.top
    assert [token for token, _ in greedy.top] == [0, 1, 2]  # tie 2/3 -> lowest id
    assert greedy.logprob is not None  # reported whenever top_logprobs is asked for
    only = sample(logits, SamplingParams(logprobs=True), 0)
    assert only.top == []
    expected = float(log_softmax(logits.astype(np.float64))[0])
    assert only.logprob == pytest.approx(expected, abs=1e-5)


# --- validation -------------------------------------------------------------------------------


def test_defaults_and_edges_validate() -> None:
    SamplingParams().validate(10)
    SamplingParams(
        temperature=2.0,
        top_p=1.0,
        top_k=5,
        seed=-1,
        top_logprobs=20,
        logprobs=True,
        logit_bias={0: -100.0, 9: 100},
        presence_penalty=-2.0,
        frequency_penalty=2.0,
    ).validate(10)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 100.5}}, "logit_bias"),
        ({"logit_bias": {3: -101.0}}, "logit_bias"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_validate_rejects_out_of_range(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs).validate(10)  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="logits"):
        sample(np.full(4, np.nan, dtype=np.float32), SamplingParams(), 0)
    with pytest.raises(ValueError, match="logits"):
        sample(np.full(4, np.nan, dtype=np.float32), SamplingParams(temperature=1.0), 0)
    with pytest.raises(ValueError, match="position"):
        sample(SMALL, SamplingParams(), -1)
    with pytest.raises(ValueError, match="temperature"):
        probabilities(SMALL, SamplingParams())


@pytest.mark.parametrize("size", [151936, 1000, 130])
def test_pruned_draw_is_the_argmax_over_the_whole_vocabulary(size: int) -> None:
    """The exact pruning never changes the token: the Gumbel-max over every kept id, computed
    by brute force, on rows with -inf entries, a partial last block and min_p."""
    rng = np.random.default_rng(size)
    for trial in range(30):
        logits = (rng.standard_normal(size) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
        logits[rng.integers(0, size, size // 10)] = -np.inf
        params = SamplingParams(
            temperature=float(rng.choice([0.3, 0.7, 1.0, 2.0])),
            min_p=float(rng.choice([0.0, 0.01])),
            seed=trial,
        )
        ids, _ = probabilities(logits, params)
        ids = np.sort(ids)
        scores = logits[ids].astype(np.float64) / params.temperature
        scores += gumbel_noise(params.seed, 3 + trial, ids)
        expected = int(ids[np.argmax(scores)])
        assert sample(logits, params, 3 + trial).token_id == expected
