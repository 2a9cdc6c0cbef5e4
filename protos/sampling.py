"""What a request asks of sampling and what a sampled token carries back: the types the wire
contract (protos/codec.py) encodes; the stage samples with them (shard_runtime/sampling.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20
# repetition_penalty's range: far enough from 0 that dividing a logit by it stays finite
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI semantics). Call :meth:`validate` once per request."""

    temperature: float = 0.0  # 0 = greedy (argmax; ties -> lowest id)
    top_p: float = 1.0  # nucleus, (0, 1]
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: fixed seed 0; the gateway picks a random one per request
    top_logprobs: int = 0  # 0..20 alternatives to report
    logprobs: bool = False  # report the chosen token's logprob
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # added before everything
    presence_penalty: float = 0.0  # subtracted once from every token in `history`
    frequency_penalty: float = 0.0  # subtracted once per occurrence in `history`
    # Extensions (vLLM's semantics): min_p drops tokens less probable than min_p times the most
    # probable one (after temperature, before top-k / top-p; 0 = off); repetition_penalty
    # divides the positive logits of every token of the prompt and the output (multiplies the
    # negative ones), 1 = off.
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def uses_history(self) -> bool:
        """Whether sampling needs the tokens generated so far (a penalty that looks at them)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the first out-of-range parameter."""
        check_range("temperature", self.temperature, 0.0, 2.0)
        if not (_is_real(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not (
            _is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 63)
        ):
            raise ValueError(f"seed must be a 64-bit signed integer or None, got {self.seed!r}")
        if not (_is_int(self.top_logprobs) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.top_logprobs!r}"
            )
        if not isinstance(self.logprobs, bool | np.bool_):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("min_p", self.min_p, 0.0, 1.0)
        penalty = self.repetition_penalty
        if not (_is_real(penalty) and MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY):
            raise ValueError(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {penalty!r}"
            )
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and 0 <= token < vocab_size):
                raise ValueError(
                    f"logit_bias token id {token!r} is outside the vocabulary [0, {vocab_size})"
                )
            if not (_is_real(bias) and -100.0 <= bias <= 100.0):
                raise ValueError(
                    f"logit_bias value for token {token} must be in [-100, 100], got {bias!r}"
                )


@dataclass(frozen=True)
class SampledToken:
    """A chosen token with the logprobs that were asked for.

    ``logprob`` is None unless ``logprobs`` or ``top_logprobs > 0`` was requested. Both it and
    ``top`` are log-softmax values of the logits after bias and penalties, before temperature and
    truncation. ``top`` is sorted by logprob desc (ties: lowest id first), ``top_logprobs`` long.
    """

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_
    )


def check_range(name: str, value: float, low: float, high: float) -> None:
    if not (_is_real(value) and low <= value <= high):  # False for NaN too
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
