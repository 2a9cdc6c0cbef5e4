"""What one engine step feeds the ring, and how a grammar trims it.

``Work item -> StepPlan (tokens, draft to verify) -> (grammar) masks + trimmed plan -> StepRequest``
"""

from __future__ import annotations

from dataclasses import dataclass

from server.engine.constraints import Matcher


@dataclass(frozen=True)
class StepPlan:
    """What one step feeds the ring: tokens, and the draft to verify when speculating."""

    tokens: tuple[int, ...]
    draft: tuple[int, ...] = ()
    draft_s: float = 0.0
    level: int = 1  # requests decoding at once when k was chosen (KByConcurrency)

    @property
    def num_logits(self) -> int:
        return len(self.tokens) if self.draft else 1


def grammar_masks(matcher: Matcher, plan: StepPlan, greedy: bool) -> tuple[list[bytes], StepPlan]:
    """Constrained decoding: the token masks of a sampling step's rows, and its plan without
    the draft tokens the grammar refuses (the first one it refuses and all after it)."""
    masks, used = matcher.masks(plan.draft)
    if used < len(plan.draft):
        draft = plan.draft[:used]
        x0 = plan.tokens[:1]
        if not draft or (not greedy and used < 1):
            plan = StepPlan(x0, level=plan.level, draft_s=plan.draft_s)
        else:
            # greedy feeds every proposal and verifies a bonus; sampling tests each proposal
            fed = (*x0, *(draft if greedy else draft[:-1]))
            plan = StepPlan(fed, draft, plan.draft_s, plan.level)
    return masks[: plan.num_logits], plan
