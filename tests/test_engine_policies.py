"""The policies the engine's step loop calls, each on its own (no ring, no processes):
speculation (plan, learn, warm-up), grammar masks on a step's plan, prefix lookup."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq

import pytest

from protos.sampling import SampledToken, SamplingParams
from server.engine.prefix import HashChain, PrefixLookup
from server.engine.sequence import Phase, Sequence
from server.engine.spec_policy import SpeculationPolicy
from server.engine.speculative import NgramProposer
from server.engine.step_plan import StepPlan, grammar_masks
from server.metrics import GatewayMetrics

pytestmark = pytest.mark.unit

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, seed=1)
# a prompt that repeats itself: the n-gram proposer continues it as it went before
PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


def _token(token_id: int) -> SampledToken:
    return SampledToken(token_id, None, [])


def _sequence(max_tokens: int = 20) -> Sequence:
    seq = Sequence("s", list(PROMPT), max_tokens, 0.0)
    seq.phase = Phase.DECODE
    return seq


def _plan(policy: SpeculationPolicy, seq: Sequence, level: int = 1, **kw: object) -> StepPlan:
    sampling = kw.pop("sampling", GREEDY)
    assert isinstance(sampling, SamplingParams)
    return asyncio.run(policy.plan(seq, (seq.prompt[-1],), len(PROMPT) - 1, sampling, level, 512))


def test_a_speculative_plan_feeds_the_proposals_and_verifies_a_bonus_when_greedy() -> None:
    policy = SpeculationPolicy(NgramProposer(), fixed_k=3, metrics=GatewayMetrics())
    plan = _plan(policy, _sequence())
    assert plan.draft == (7, 8, 9)
    assert plan.tokens == (6, 7, 8, 9) and plan.num_logits == 4
    sampled = _plan(policy, _sequence(), sampling=SAMPLED)
    # sampling: every fed position tests a proposal (the last proposal is not fed)
    assert sampled.draft == (7, 8, 9) and sampled.tokens == (6, 7, 8)


def test_speculation_pauses_above_its_user_limit_and_stops_at_max_tokens() -> None:
    policy = SpeculationPolicy(NgramProposer(), fixed_k=3, max_users=2)
    assert _plan(policy, _sequence(), level=2).draft
    paused = _plan(policy, _sequence(), level=3)
    assert paused == StepPlan((6,), level=3)
    short = _sequence(max_tokens=3)
    short.generated = [7]
    # 2 tokens left: greedy proposes 1 and verifies a bonus
    assert _plan(policy, short).draft == (8,)
    short.generated = [7, 8]
    assert _plan(policy, short).draft == ()


def test_learning_moves_a_requests_own_acceptance_and_the_metrics() -> None:
    metrics = GatewayMetrics()
    policy = SpeculationPolicy(NgramProposer(), max_k=4, metrics=metrics)
    plan = StepPlan((6, 7, 8, 9), (7, 8, 9), level=1)
    emitted = [_token(7), _token(8), _token(1)]
    before = policy.k.acceptance
    policy.learn("s", plan, emitted, 0.01, 0.012)
    own = policy._acceptance["s"].rate
    policy.learn("s", plan, [_token(1)], 0.01, 0.012)  # nothing accepted
    assert policy._acceptance["s"].rate < own
    assert policy.k.acceptance != before
    assert metrics.spec_proposed._value.get() == 6 and metrics.spec_accepted._value.get() == 2

    async def release() -> None:
        policy.release("s")
        await policy.close()

    asyncio.run(release())
    assert "s" not in policy._acceptance


def test_warm_up_feeds_the_prompt_until_the_proposer_has_it() -> None:
    class Counting(NgramProposer):
        calls = 0

        def warm(self, seq_id: str, prompt: list[int]) -> bool:
            self.calls += 1
            return self.calls == 3  # three chunks

    proposer = Counting()
    policy = SpeculationPolicy(proposer)
    asyncio.run(policy.warm(_sequence()))
    assert proposer.calls == 3
    done = _sequence()
    done.phase = Phase.DONE
    asyncio.run(policy.warm(done))  # an ended sequence is not warmed
    assert proposer.calls == 3


class _Grammar:
    """A matcher that allows ``allowed`` draft tokens (its own masks: one per row)."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed

    def masks(self, draft: Seq[int] = ()) -> tuple[list[bytes], int]:
        used = min(self.allowed, len(draft))
        return [bytes([i]) for i in range(used + 1)], used


def test_grammar_masks_trim_the_draft_at_the_first_refused_token() -> None:
    plan = StepPlan((6, 7, 8, 9), (7, 8, 9), 0.5, 2)
    masks, same = grammar_masks(_Grammar(3), plan, greedy=True)  # type: ignore[arg-type]
    assert same == plan and masks == [b"\x00", b"\x01", b"\x02", b"\x03"]
    masks, cut = grammar_masks(_Grammar(1), plan, greedy=True)  # type: ignore[arg-type]
    assert cut == StepPlan((6, 7), (7,), 0.5, 2) and masks == [b"\x00", b"\x01"]
    masks, plain = grammar_masks(_Grammar(0), plan, greedy=True)  # type: ignore[arg-type]
    assert plain == StepPlan((6,), level=2, draft_s=0.5) and masks == [b"\x00"]
    sampled = StepPlan((6, 7, 8), (7, 8, 9), 0.5, 2)
    masks, cut = grammar_masks(_Grammar(2), sampled, greedy=False)  # type: ignore[arg-type]
    assert cut.tokens == (6, 7) and cut.draft == (7, 8) and len(masks) == 2


def test_prefix_lookup_names_whole_prompt_blocks_and_never_decoded_ones() -> None:
    lookup = PrefixLookup("export", 4)
    tokens = list(range(3, 14))  # 11 tokens: two whole blocks reusable, leaving 3 to compute
    reusable = lookup.reusable("a", tokens)
    assert reusable == HashChain("export", 4).extend(tokens, 2)
    assert lookup.filled("a", tokens, 0, 8, prefill=True) == reusable
    assert lookup.filled("a", tokens, 4, 9, prefill=True) == reusable[1:]
    assert lookup.filled("a", tokens, 7, 8, prefill=False) == []  # a decode step
    assert PrefixLookup("other", 4).reusable("a", tokens) != reusable  # the export salts them
    lookup.forget("a")
    assert lookup.reusable("a", tokens[:6]) == reusable[:1]
