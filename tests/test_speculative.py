"""Draft verification on the last stage: the emitted tokens are plain decoding's, greedy and
sampled; choosing K; proposing without a model."""

from __future__ import annotations

import numpy as np
import pytest

from protos.sampling import SamplingParams
from server.engine.speculative import Acceptance, AdaptiveK, KByConcurrency, NgramProposer, StepCost
from shard_runtime.sampling import sample
from shard_runtime.speculative import verify

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()


def rows_with_argmax(tokens: list[int], vocab: int = 10) -> np.ndarray:
    rows = np.zeros((len(tokens), vocab), dtype=np.float32)
    for i, t in enumerate(tokens):
        rows[i, t] = 5.0
    return rows


def test_greedy_accepts_until_the_first_mismatch_and_emits_the_correction() -> None:
    rows = rows_with_argmax([3, 4, 5, 6])
    out = verify(rows, [3, 4, 9, 6], GREEDY, 10)
    assert [t.token_id for t in out] == [3, 4, 5]  # 9 rejected, 5 is the correction
    out = verify(rows, [7, 4, 5, 6], GREEDY, 10)
    assert [t.token_id for t in out] == [3]
    # every proposal accepted: all of them (the last position tested too)
    assert [t.token_id for t in verify(rows, [3, 4, 5, 6], GREEDY, 10)] == [3, 4, 5, 6]
    # one fewer proposal than rows: the last row gives the bonus token
    assert [t.token_id for t in verify(rows, [3, 4, 5], GREEDY, 10)] == [3, 4, 5, 6]


def test_greedy_applies_bias_and_penalties_with_the_accepted_tokens() -> None:
    rows = np.zeros((2, 6), dtype=np.float32)
    rows[:, 2] = 1.0
    rows[:, 3] = 0.9
    params = SamplingParams(presence_penalty=0.5)
    # position 2 sees token 2 accepted at position 1: its penalty makes 3 the argmax
    out = verify(rows, [2, 2], params, 0, history=[])
    assert [t.token_id for t in out] == [2, 3]
    plain = [sample(rows[0], params, 1, []).token_id]
    plain.append(sample(rows[1], params, 2, plain).token_id)
    assert plain == [2, 3]


def test_logprobs_are_reported_for_verified_tokens() -> None:
    rows = rows_with_argmax([1, 2])
    params = SamplingParams(logprobs=True, top_logprobs=2)
    out = verify(rows, [1, 2], params, 0)
    reference = sample(rows[0], params, 1, [])
    assert out[0].logprob == pytest.approx(reference.logprob)
    assert out[0].top == reference.top


def test_bad_proposals_are_refused() -> None:
    rows = rows_with_argmax([1, 2, 3])
    with pytest.raises(ValueError):
        verify(rows, [1], GREEDY, 0)  # 3 rows verify 2 or 3 tokens
    with pytest.raises(ValueError):
        verify(rows, [], SamplingParams(temperature=1.0), 0)  # nothing to verify


# --- coupled sampling: exactly the plain sampler's tokens -------------------------------------
VOCAB = 50
PARAMS = [
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_k=8),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, frequency_penalty=0.8, presence_penalty=0.3),
    SamplingParams(temperature=1.1, repetition_penalty=1.4, logit_bias={3: 2.0, 7: -1.0}),
    SamplingParams(frequency_penalty=1.5),  # greedy with a penalty
]


def plain_tokens(
    rows: np.ndarray,
    params: SamplingParams,
    first: int,
    history: list[int],
    prompt: list[int],
    forced: list[int] | None = None,
) -> list[int]:
    """What plain decoding samples row by row, each row seeing the tokens before it (the
    ``forced`` ones instead where given: the history a verified draft leaves)."""
    seen = list(history)
    out = []
    for i, row in enumerate(rows):
        token = sample(row, params, first + i, seen, prompt).token_id
        out.append(token)
        seen.append(forced[i] if forced is not None and i < len(forced) else token)
    return out


@pytest.mark.parametrize(
    "params",
    PARAMS,
    ids=["plain", "top_k", "top_p", "min_p", "penalties", "repetition_bias", "greedy"],
)
def test_verify_emits_the_plain_samplers_tokens_whatever_the_draft(params: SamplingParams) -> None:
    """Random rows (peaked, so that drafts are often right), random histories and proposals
    that follow the plain tokens for a while and then go wrong: the emitted tokens are the
    plain sampler's, position by position, and exactly the proposals equal to them are
    accepted. The rule of Leviathan et al. (accept with probability min(1, p/q), else draw
    from the residual) emits other tokens than plain sampling and fails this."""
    rng = np.random.default_rng(11)
    accepted_any = rejected_any = 0
    for trial in range(300):
        params_i = SamplingParams(**{**params.__dict__, "seed": int(rng.integers(1 << 40))})
        m = int(rng.integers(1, 6))
        rows = (rng.standard_normal((m, VOCAB)) * 3).astype(np.float32)
        history = rng.integers(0, VOCAB, int(rng.integers(0, 6))).tolist()
        prompt = rng.integers(0, VOCAB, 4).tolist()
        first = int(rng.integers(10, 1000))
        bonus = bool(rng.integers(2)) and m > 1
        n = m - 1 if bonus else m
        plain = plain_tokens(rows, params_i, first, history, prompt)
        # proposals: the plain tokens up to a random point, then random tokens
        right = int(rng.integers(0, n + 1))
        draft = plain[:right] + rng.integers(0, VOCAB, n - right).tolist()
        out = verify(rows, draft, params_i, first, history, prompt)
        tokens = [t.token_id for t in out]
        # accepted: the proposals up to the first one that differs from the plain token
        agree = next((i for i in range(n) if draft[i] != plain[i]), n)
        assert tokens == plain[: min(agree + 1, m)], (trial, draft, plain)
        accepted_any += agree > 0
        rejected_any += agree < n
    assert accepted_any > 50 and rejected_any > 50


def test_a_draft_with_the_targets_logits_is_always_accepted() -> None:
    """Coupling: the draft picks with the position's noise, so a draft whose logits are the
    target's proposes exactly what is emitted, and a close one mostly does."""
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0.9, seed=5, frequency_penalty=0.5)
    rows = (rng.standard_normal((6, VOCAB)) * 2).astype(np.float32)
    history = [1, 2, 1]
    same = plain_tokens(rows, params, 40, history, [])
    assert [t.token_id for t in verify(rows, same, params, 40, history)] == same
    hits = 0
    for seed in range(200):
        params = SamplingParams(temperature=0.9, seed=seed)
        target = (rng.standard_normal((1, VOCAB)) * 2).astype(np.float32)
        close = target + 0.05 * rng.standard_normal((1, VOCAB)).astype(np.float32)
        proposal = plain_tokens(close, params, 7, [], [])
        hits += verify(target, proposal, params, 7)[0].token_id == proposal[0]
    assert hits > 170


def test_a_fixed_seed_reproduces_the_output_and_the_draft_does_not_change_it() -> None:
    rng = np.random.default_rng(9)
    rows = (rng.standard_normal((3, VOCAB)) * 2).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)
    plain = plain_tokens(rows, params, 5, [], [])
    for draft in ([0, 0, 0], plain, [plain[0], (plain[1] + 1) % VOCAB, 0], plain[:2]):
        out = [t.token_id for t in verify(rows, draft, params, 5)]
        assert out == plain[: len(out)]


# --- choosing K and proposing without a model -------------------------------------------------
def test_adaptive_k_proposes_more_when_a_pass_costs_more() -> None:
    local = AdaptiveK(acceptance=0.7, pass_s=0.06, draft_s=0.02)
    remote = AdaptiveK(acceptance=0.7, pass_s=0.36, draft_s=0.02)  # +100 ms on 3 hops
    assert 1 <= local.model_k(greedy=True) < remote.model_k(greedy=True) <= 8
    # a draft that is rarely right is worth fewer tokens
    poor = AdaptiveK(acceptance=0.2, pass_s=0.36, draft_s=0.02)
    assert poor.model_k(greedy=True) < remote.model_k(greedy=True)
    assert AdaptiveK(fixed=3).choose(greedy=True) == 3


def test_adaptive_k_learns_acceptance_and_stops_when_plain_steps_are_faster() -> None:
    adapt = AdaptiveK(acceptance=0.6)
    for _ in range(40):
        adapt.update(proposed=4, accepted=4, positions=5, pass_s=0.1, draft_s=0.004)
    assert adapt.acceptance > 0.95
    choices = [adapt.choose(greedy=True) for _ in range(32)]
    assert all(k >= 1 for k in choices[:15])
    # plain steps measured much faster than speculative ones: greedy stops proposing,
    # except for an occasional look back
    for _ in range(60):
        adapt.update_plain(0.01)
    choices = [adapt.choose(greedy=True) for _ in range(32)]
    assert choices.count(0) == 30 and len([k for k in choices if k]) == 2
    # sampling always proposes (its output must not depend on the choice)
    assert all(adapt.choose(greedy=False) >= 1 for _ in range(32))


def test_acceptance_is_per_position_not_accepted_over_proposed() -> None:
    """Verification stops at the first rejection: with per-position acceptance 0.8 and k = 8,
    accepted / proposed is about 0.47, the estimate stays near 0.8."""
    rng = np.random.default_rng(0)
    rate = Acceptance(prior=0.5, decay=0.99)
    kept = 0
    for _ in range(400):
        accepted = 0
        while accepted < 8 and rng.random() < 0.8:
            accepted += 1
        rate.update(8, accepted)
        kept += accepted
    assert kept / (400 * 8) < 0.55
    assert 0.75 < rate.rate < 0.85


def test_step_cost_fits_the_pass_and_each_extra_position() -> None:
    """Plain and speculative passes of different lengths give the base cost and the slope;
    the model then prefers fewer proposals when positions cost more."""
    cheap, dear = StepCost(), StepCost()
    for n in [1, 2, 3, 5, 9] * 20:
        cheap.update(n, 0.070 + 0.002 * (n - 1))
        dear.update(n, 0.070 + 0.020 * (n - 1))
    assert cheap.line() == pytest.approx((0.070, 0.002), rel=1e-6)
    assert dear.line() == pytest.approx((0.070, 0.020), rel=1e-6)
    flat, steep = AdaptiveK(acceptance=0.8), AdaptiveK(acceptance=0.8)
    flat.cost, steep.cost = cheap, dear
    assert flat.model_k(greedy=True) > steep.model_k(greedy=True) >= 1
    # one kind of pass only: the prior's slope, scaled to what was measured
    only = StepCost()
    for _ in range(10):
        only.update(5, 0.1)
    base, slope = only.line()
    assert base + 4 * slope == pytest.approx(0.1) and slope == pytest.approx(0.13 * base)


def test_adaptive_k_goes_by_what_steps_with_each_k_measured() -> None:
    """The linear cost line says two proposals pay; when steps with k = 2 measure slower than
    that (drafting, rollbacks, the gateway's own time), one proposal wins, and the other way."""

    def trained(two_s: float) -> AdaptiveK:
        adapt = AdaptiveK()
        for _ in range(5):
            adapt.update_plain(0.085)
            adapt.update(1, 1, positions=2, pass_s=0.100, draft_s=0.030)
            adapt.update(2, 1, positions=3, pass_s=two_s - 0.060, draft_s=0.060)
        return adapt

    slow, fast = trained(two_s=0.210), trained(two_s=0.150)
    assert slow.step_seconds(2, 3) == pytest.approx(0.210)
    assert slow.model_k(greedy=True, acceptance=0.84) == 1
    assert fast.model_k(greedy=True, acceptance=0.84) >= 2  # k = 3 is untried: optimistic
    rates = slow.rates(greedy=True, acceptance=0.84)
    assert rates[1] > rates[0] and rates[1] > rates[2]
    # a step that waited for the draft's thread (shared by every request) counts that wait
    slow.update(4, 4, positions=5, pass_s=0.1, draft_s=0.1, step_s=0.3)
    slow.update(4, 4, positions=5, pass_s=0.1, draft_s=0.1, step_s=0.3)
    assert slow.step_seconds(4, 5) == pytest.approx(0.3)
    # k = 3 was never tried: the line's estimate plus three draft tokens, scaled as the
    # nearest measured k's (2) estimate was
    base, slope = slow.cost.line()
    line = base + 3 * slope + 3 * slow.draft_s
    scale = 0.210 / (base + 2 * slope + 2 * slow.draft_s)
    assert slow.step_seconds(3, 4) == pytest.approx(line * scale)
    # it climbs one k at a time: an untried k next to a measured one may be chosen, not 6 to 8
    slow._measured.clear()
    for _ in range(2):
        slow.update(1, 1, positions=2, pass_s=0.05, draft_s=0.01)
    assert {slow.choose(greedy=False, acceptance=0.99) for _ in range(15)} <= {1, 2}


def test_adaptive_k_doubles_its_way_up_when_a_pass_is_dear() -> None:
    """Over long hops a pass costs about the same whatever it verifies: from k = 1 the choice
    may double once the largest k is measured (1, 2, 4, ...), not only add one."""

    def climb(adapt: AdaptiveK) -> list[int]:
        seen = [adapt.choose(greedy=True, acceptance=0.9)]
        for _ in range(11):
            k = seen[-1]
            if k == 0:
                adapt.update_plain(0.4)
            else:
                adapt.update(k, k, positions=k + 1, pass_s=0.4 + 0.004 * k, draft_s=0.03 * k)
            seen.append(adapt.choose(greedy=True, acceptance=0.9))
        return seen

    seen = climb(AdaptiveK(start=1))
    assert seen[:5] == [1, 1, 2, 2, 4]  # two steps measure a k, then it may double
    assert max(seen) <= 8 and seen[-1] >= 4
    # a cheap pass (0.06 s plus 0.03 s per extra position) keeps k low all the same
    cheap = AdaptiveK(start=1)
    for _ in range(12):
        k = cheap.choose(greedy=True, acceptance=0.9)
        if k == 0:
            cheap.update_plain(0.06)
        else:
            cheap.update(k, k, positions=k + 1, pass_s=0.06 + 0.03 * k, draft_s=0.03 * k)
    assert cheap.choose(greedy=True, acceptance=0.9) <= 2


def _simulate(
    shared: KByConcurrency, level: int, seconds: dict[int, float], steps: int
) -> list[int]:
    """Steps of ``level`` concurrent greedy requests whose step with k proposals takes
    ``seconds[k]``; per-position acceptance 0.8 (seeded); returns the k chosen each step."""
    rng = np.random.default_rng(level)
    chosen = []
    for _ in range(steps):
        k = shared.choose(level, greedy=True, acceptance=0.8)
        chosen.append(k)
        model = shared.level(level)
        if k == 0:
            model.update_plain(seconds[0])
            continue
        accepted = 0
        while accepted < k and rng.random() < 0.8:
            accepted += 1
        model.update(k, accepted, k + 1, seconds[k] * 0.5, seconds[k] * 0.5, seconds[k])
    return chosen


def test_concurrent_requests_share_one_k_per_epoch_and_find_the_servers_best() -> None:
    """Alone, a request takes its own k; with others, every request takes one k for an epoch,
    learnt from steps at that concurrency only: it starts from the k of one request alone and
    climbs to the best k for the server (here plain steps), without touching the k alone."""
    shared = KByConcurrency(max_k=8)
    # alone: a step costs 0.1 s plus 0.01 s per proposal (k = 5 or 6 is the best)
    alone = {k: 0.1 + 0.01 * k for k in range(9)}

    def rate(k: int) -> float:
        return (1 - 0.8 ** (k + 1)) / 0.2 / alone[k]

    best = max(rate(k) for k in range(1, 9))
    chosen = _simulate(shared, 1, alone, 300)
    assert chosen[0] == 1  # alone, k starts at 1 and climbs to (about) the best
    assert sorted(rate(k) for k in chosen[-40:])[5] > 0.98 * best
    # two at once: drafting for both waits in one thread, so proposals cost much more
    together = {k: 0.1 + 0.12 * k for k in range(9)}
    start = shared.alone.best
    chosen = _simulate(shared, 2, together, 12 * 12)
    epochs = [chosen[i : i + 12] for i in range(0, len(chosen), 12)]
    assert all(len(set(e)) == 1 for e in epochs)  # one k per epoch of 6 steps per request
    assert start is not None and epochs[0][0] == start and rate(start) > 0.98 * best
    assert [e[0] for e in epochs[-6:]].count(0) >= 4  # mostly plain, a neighbour now and then
    # the level alone kept its own measurements and k
    assert rate(shared.choose(1, greedy=True, acceptance=0.8)) > 0.95 * best
    assert KByConcurrency(fixed=2).choose(3, greedy=True) == 2


def test_prompt_lookup_continues_the_latest_match() -> None:
    ngram = NgramProposer(max_ngram=3)
    context = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the latest earlier "1 2 3" is followed by 7 8
    assert ngram.propose("s", context, 4, SamplingParams()).tokens == [7, 8, 1, 2]
    sampled = ngram.propose("s", context, 2, SamplingParams(temperature=1.0))
    assert sampled.tokens == [7, 8]
    assert ngram.propose("s", [1, 2, 3], 4, SamplingParams()).tokens == []
