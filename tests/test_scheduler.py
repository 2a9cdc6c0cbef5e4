"""The micro-batch scheduler as a state machine, driven by fabricated stage results."""

from __future__ import annotations

import random

import pytest

from server.engine.scheduler import MAX_SESSION_LOSSES, Scheduler, SchedulerConfig, chunk_end
from server.engine.sequence import Phase, QueueFull, QueueTimeout, Release, Sequence, Work

pytestmark = pytest.mark.unit

EOS = 0


def seq(name: str, prompt: int = 4, max_tokens: int = 8, arrival: float = 0.0) -> Sequence:
    return Sequence(name, list(range(1, prompt + 1)), max_tokens, arrival)


def token_for(item: Work) -> list[int]:
    """A fabricated sample: a token that depends on where the step is, never EOS."""
    return [100 + item.start_position + len(item.tokens)] if item.samples else []


def freed(s: Scheduler) -> list[str]:
    """Sessions the scheduler asks to free on the stages now (and the stages free them)."""
    sessions = [r.session_id for r in s.take_releases() if r.session_id]
    s.released(sessions)
    return sessions


def complete(s: Scheduler, work: list[Work]) -> None:
    for item in work:
        s.on_result(item.seq_id, token_for(item))


def test_prefill_then_decode_positions_and_tokens() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=256), eos_ids=[EOS])
    s.add(seq("a", prompt=5, max_tokens=3))
    first = s.next_work(0.0)
    assert first == [Work("a", (1, 2, 3, 4, 5), 0, prefill=True, samples=True)]
    assert s.next_work(0.0) == []  # one step per sequence in the ring
    assert s.on_result("a", [42]) == 1
    assert s.sequences["a"].generated == [42]
    assert s.next_work(0.1) == [Work("a", (42,), 5, prefill=False, samples=True)]
    s.on_result("a", [43])
    assert s.next_work(0.2) == [Work("a", (43,), 6, prefill=False, samples=True)]
    s.on_result("a", [44])  # max_tokens reached
    assert s.sequences["a"].phase is Phase.DONE
    assert s.next_work(0.3) == []
    assert freed(s) == ["a"]
    assert freed(s) == []


def test_eos_ends_a_sequence() -> None:
    s = Scheduler(SchedulerConfig(), eos_ids=[EOS])
    s.add(seq("a", max_tokens=100))
    s.next_work(0.0)
    s.on_result("a", [7])
    s.next_work(0.0)
    s.on_result("a", [EOS])
    assert s.sequences["a"].generated == [7, EOS]
    assert s.sequences["a"].phase is Phase.DONE
    assert freed(s) == ["a"]


def test_long_prompt_goes_in_chunks_and_only_the_last_samples() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=256))
    s.add(seq("a", prompt=600))
    chunks = []
    for _ in range(3):
        [item] = s.next_work(0.0)
        chunks.append(item)
        assert s.on_result("a", token_for(item)) == int(item.samples)
    assert [(c.start_position, len(c.tokens), c.samples) for c in chunks] == [
        (0, 256, False),
        (256, 256, False),
        (512, 88, True),
    ]
    assert [t for c in chunks for t in c.tokens] == list(range(1, 601))
    assert s.sequences["a"].generated == token_for(chunks[-1])


def test_decode_steps_are_not_frozen_by_a_long_prefill() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=100, max_prefill_in_flight=1))
    s.add(seq("short", prompt=3, max_tokens=50))
    complete(s, s.next_work(0.0))  # "short" is decoding now
    s.add(seq("long", prompt=1000, max_tokens=5))
    decode_steps_during_prefill = 0
    rounds = 0
    while s.sequences["long"].phase is not Phase.DECODE:
        work = s.next_work(float(rounds))
        rounds += 1
        kinds = sorted((w.seq_id, w.prefill) for w in work)
        # every round: one decode step for "short" beside at most one chunk of "long"
        assert ("short", False) in kinds
        assert sum(1 for w in work if w.prefill) <= 1
        decode_steps_during_prefill += 1
        complete(s, work)
    assert rounds == 10  # 1000 tokens in chunks of 100
    assert decode_steps_during_prefill == 10


def test_prefill_chunks_in_flight_are_bounded_and_oldest_first() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=10, max_prefill_in_flight=2))
    for name in ("a", "b", "c"):
        s.add(seq(name, prompt=30))
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["a", "b"]
    assert s.next_work(0.0) == []  # both chunk slots are taken
    s.on_result("a", [])
    assert [w.seq_id for w in s.next_work(0.0)] == ["a"]  # oldest first, "c" still waits


def test_every_running_sequence_has_a_step_in_the_ring() -> None:
    # With as many decoding sequences as steps the ring can hold, every stage has work.
    s = Scheduler(SchedulerConfig(max_running=8, max_prefill_in_flight=8))
    for i in range(8):
        s.add(seq(f"s{i}"))
    prefill = s.next_work(0.0)
    assert len(prefill) == 8 and s.in_flight == 8
    complete(s, prefill)
    decode = s.next_work(1.0)
    assert len(decode) == 8 and all(not w.prefill for w in decode)
    assert s.in_flight == 8


def test_round_robin_serves_the_longest_waiting_first() -> None:
    s = Scheduler(SchedulerConfig(max_prefill_in_flight=3))
    for name in ("a", "b", "c"):
        s.add(seq(name, max_tokens=100))
    complete(s, s.next_work(0.0))
    # "c" and "a" came back and were served at t=1; "b" has waited since t=0.
    work = s.next_work(1.0)
    by_id = {w.seq_id: w for w in work}
    s.on_result("c", token_for(by_id["c"]))
    s.on_result("a", token_for(by_id["a"]))
    s.on_result("b", token_for(by_id["b"]))
    s.next_work(2.0)  # all three again, now served at t=2 in last_served order
    counts = {name: len(s.sequences[name].generated) for name in ("a", "b", "c")}
    assert counts == {"a": 2, "b": 2, "c": 2}  # nobody is skipped
    for name in ("a", "b", "c"):
        s.on_result(name, [5])
    s.sequences["b"].last_served = -1.0  # b has waited longest
    order = [w.seq_id for w in s.next_work(3.0)]
    assert order[0] == "b"


def test_admission_limits_queue_and_429() -> None:
    s = Scheduler(SchedulerConfig(max_running=2, max_queued=1))
    s.add(seq("a"))
    s.add(seq("b"))
    s.add(seq("c"))  # queued (a and b take the running slots at the next tick)
    with pytest.raises(QueueFull) as info:
        s.add(seq("d"))
    assert info.value.retry_after >= 1
    s.next_work(0.0)
    assert s.running == ["a", "b"] and list(s.queue) == ["c"]
    with pytest.raises(QueueFull):
        s.add(seq("d"))
    with pytest.raises(ValueError, match="already"):
        s.add(seq("a"))
    # "a" finishes: "c" takes its slot, and there is room in the queue again
    s.on_error("a", RuntimeError("boom"))
    s.next_work(1.0)
    assert s.running == ["b", "c"]
    assert [q.seq_id for q in s.take_admitted()] == ["a", "b", "c"]
    s.add(seq("d"))
    assert list(s.queue) == ["d"]


def test_cancelling_a_queued_request_frees_its_place() -> None:
    s = Scheduler(SchedulerConfig(max_running=1, max_queued=1))
    s.add(seq("a"))
    s.next_work(0.0)
    s.add(seq("b"))
    with pytest.raises(QueueFull):
        s.add(seq("c"))
    s.cancel("b")
    assert "b" not in s.sequences
    s.add(seq("c"))
    assert list(s.queue) == ["c"]
    assert freed(s) == []  # "b" never reached a stage


def test_cancelling_a_running_request_releases_after_its_step() -> None:
    s = Scheduler(SchedulerConfig())
    s.add(seq("a"))
    [item] = s.next_work(0.0)
    s.cancel("a")
    assert freed(s) == []  # its step is still in the ring
    assert s.on_result("a", token_for(item)) == 0  # the token is not emitted
    assert freed(s) == ["a"]
    assert "a" not in s.sequences
    assert s.next_work(1.0) == []
    # A sequence cancelled between steps is released at once.
    s.add(seq("b"))
    complete(s, s.next_work(2.0))
    s.cancel("b")
    assert freed(s) == ["b"]
    assert s.sequences == {}


def test_abort_all_ends_queued_and_running_sequences() -> None:
    s = Scheduler(SchedulerConfig(max_running=2))
    for name in "abc":
        s.add(seq(name))
    s.next_work(0.0)  # a and b run (a's prompt is in the ring: one prefill at a time), c waits
    error = RuntimeError("stopping")
    assert sorted(s.abort_all(error)) == ["a", "b", "c"]
    assert all(x.phase is Phase.DONE and x.error is error for x in s.sequences.values())
    assert s.queued == 0 and s.running == []
    assert freed(s) == ["a"]  # only a's session was opened on the stages
    assert s.next_work(1.0) == []


def test_queued_requests_expire() -> None:
    s = Scheduler(SchedulerConfig(max_running=1, queue_timeout=5.0))
    s.add(seq("a", arrival=0.0))
    s.next_work(0.0)
    s.add(seq("b", arrival=1.0))
    assert s.expire(5.5) == []
    assert s.expire(6.5) == ["b"]
    assert isinstance(s.sequences["b"].error, QueueTimeout)
    assert "waited" in str(s.sequences["b"].error)
    s.cancel("b")  # its consumer saw the error and leaves
    assert "b" not in s.sequences and not s.queue


def test_errors_end_the_sequence_and_release_its_session() -> None:
    s = Scheduler(SchedulerConfig())
    s.add(seq("a"))
    s.next_work(0.0)
    failure = RuntimeError("stage 1 is down")
    s.on_error("a", failure)
    assert s.sequences["a"].error is failure
    assert s.sequences["a"].phase is Phase.DONE
    assert freed(s) == ["a"]
    assert s.running == []


def test_speculative_steps_take_several_tokens_and_roll_back_the_rest() -> None:
    s = Scheduler(SchedulerConfig(), eos_ids=[EOS])
    s.add(seq("a", prompt=4, max_tokens=6))
    complete(s, s.next_work(0.0))  # prefill: 1 token, the stages hold 4 positions
    [step] = s.next_work(1.0)
    assert (step.start_position, step.rollback) == (4, 0)
    # the engine fed [x0, d1, d2, d3] (4 positions) and 2 drafts + a correction came back
    assert s.on_result("a", [7, 8, 9], session_length=8) == 3
    [step] = s.next_work(2.0)
    # 4 + 1 + 3 tokens known; the stages hold 8 positions, x0 d1 d2 are kept: roll back 1
    assert (step.tokens, step.start_position, step.rollback) == ((9,), 7, 1)
    # more tokens than max_tokens allows: the sequence takes 2 and ends
    assert s.on_result("a", [10, 11, 12, 13], session_length=11) == 2
    assert s.sequences["a"].generated[-2:] == [10, 11]
    assert s.sequences["a"].phase is Phase.DONE
    # an end-of-sequence token among them ends it there
    s.add(seq("b", prompt=2, max_tokens=50))
    complete(s, s.next_work(3.0))
    s.next_work(4.0)
    assert s.on_result("b", [5, EOS, 6], session_length=6) == 2
    assert s.sequences["b"].generated[-2:] == [5, EOS]


def test_bad_sequences_are_refused() -> None:
    s = Scheduler(SchedulerConfig())
    with pytest.raises(ValueError, match="prompt"):
        s.add(Sequence("x", [], 4, 0.0))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(Sequence("x", [1], 0, 0.0))
    with pytest.raises(ValueError):
        SchedulerConfig(max_running=0)
    assert s.sequences == {}


def run_to_end(s: Scheduler, now: float = 0.0) -> None:
    while work := s.next_work(now):
        complete(s, work)


def test_a_lost_step_resumes_with_a_fresh_session_and_the_same_tokens() -> None:
    lost = RuntimeError("stage 1 is unavailable")
    alone = Scheduler(SchedulerConfig(prefill_chunk=3), eos_ids=[EOS])
    alone.add(seq("a", prompt=5, max_tokens=6))
    run_to_end(alone)
    expected = alone.sequences["a"].generated

    s = Scheduler(SchedulerConfig(prefill_chunk=3, resume_grace=10.0), eos_ids=[EOS])
    s.add(seq("a", prompt=5, max_tokens=6))
    for _ in range(4):  # two prompt chunks, then two decode steps
        complete(s, s.next_work(0.0))
    a = s.sequences["a"]
    assert a.generated == expected[:3]
    assert len(s.next_work(1.0)) == 1  # the step the ring loses
    assert s.on_lost("a", lost, now=1.0) is True
    assert a.phase is Phase.SUSPENDED and a.session_id == "a.r1"
    assert s.take_releases() == [Release("a", "a", final=False)]  # the lost session
    assert s.next_work(2.0, ring_ready=False) == []  # waits while a stage is down
    assert s.expire(5.0) == []  # within the grace
    # The ring is whole: prompt + generated are prefilled again in chunks on a new session;
    # the last chunk samples the next token, and decoding goes on where it stopped.
    resume = s.next_work(6.0)
    assert resume == [Work("a", (1, 2, 3), 0, prefill=True, samples=False, session_id="a.r1")]
    complete(s, resume)
    [middle] = s.next_work(6.0)
    assert middle.tokens == (4, 5, expected[0]) and not middle.samples
    complete(s, [middle])
    [last] = s.next_work(6.0)
    assert last.tokens == tuple(expected[1:3]) and last.samples and last.start_position == 6
    complete(s, [last])
    [decode] = s.next_work(6.0)
    assert decode == Work("a", (expected[3],), 8, False, True, session_id="a.r1")
    complete(s, [decode])
    run_to_end(s, 6.0)
    assert a.generated == expected and a.error is None and a.resumes == 1
    assert s.take_releases() == [Release("a", "a.r1", final=True)]


def test_a_lost_sequence_ends_with_the_error_after_the_grace() -> None:
    lost = RuntimeError("stage 1 is unavailable")
    s = Scheduler(SchedulerConfig(resume_grace=10.0), eos_ids=[EOS])
    s.add(seq("a"))
    s.add(seq("b"))
    s.next_work(0.0)
    assert s.on_lost("a", lost, now=0.0) and s.on_lost("b", lost, now=1.0)
    s.take_releases()
    assert s.expire(10.5) == ["a"]  # "b" still has half a second
    assert s.sequences["a"].phase is Phase.DONE and s.sequences["a"].error is lost
    assert s.take_releases() == [Release("a", None, final=True)]  # nothing left on the stages
    assert s.running == ["b"]
    # A suspended sequence whose caller goes away simply ends.
    s.cancel("b")
    assert s.running == [] and "b" not in s.sequences


def test_without_grace_a_lost_step_ends_the_sequence() -> None:
    s = Scheduler(SchedulerConfig(resume_grace=0.0), eos_ids=[EOS])
    s.add(seq("a"))
    s.next_work(0.0)
    error = RuntimeError("gone")
    assert s.on_lost("a", error, now=0.0) is False
    assert s.sequences["a"].phase is Phase.DONE and s.sequences["a"].error is error
    assert freed(s) == ["a"]


def test_a_session_a_stage_lost_is_prefilled_again_a_few_times_then_the_error_ends_it() -> None:
    """A stage answering that it no longer holds the session (NOT_FOUND: it restarted between
    health checks, or freed the session): re-prefill on a fresh session, at once; the fourth
    time in one sequence ends it with the stage's error."""
    s = Scheduler(SchedulerConfig(), eos_ids=[EOS])
    s.add(seq("a", max_tokens=40))
    complete(s, s.next_work(0.0))
    gone = RuntimeError("session 'a' is not open on stage 0")
    for loss in range(1, MAX_SESSION_LOSSES + 1):
        [_decode] = s.next_work(1.0)  # the step that meets the loss
        assert s.on_session_lost("a", gone, now=1.0) is True
        [resume] = s.next_work(1.0)  # the ring is up: no wait
        assert resume.prefill and resume.start_position == 0
        assert resume.session_id == f"a.r{loss}"
        complete(s, [resume])
    a = s.sequences["a"]
    assert a.resumes == MAX_SESSION_LOSSES and a.error is None
    s.take_releases()
    s.next_work(2.0)
    assert s.on_session_lost("a", gone, now=2.0) is False
    assert a.phase is Phase.DONE and a.error is gone
    assert s.take_releases() == [Release("a", f"a.r{MAX_SESSION_LOSSES}", final=True)]


# -- micro-batch groups and paged KV pools --------------------------------------------------------
def run_until_done(
    s: Scheduler, limit: int = 500, releases: list[Release] | None = None
) -> dict[str, list[int]]:
    """Drive the scheduler with fabricated results (all steps of a tick return together);
    the stages free each tick's released sessions (collected in ``releases``)."""
    for _ in range(limit):
        work = s.next_work(0.0)
        done = s.take_releases()
        s.released(r.session_id for r in done if r.session_id)
        if releases is not None:
            releases += done
        if not work and not s.in_flight and not done:
            break
        complete(s, work)
    return {sid: q.generated for sid, q in s.sequences.items()}


def test_sequences_spread_over_groups_and_steps_carry_their_group() -> None:
    s = Scheduler(SchedulerConfig(groups=2, max_prefill_in_flight=8))
    for name in "abcde":
        s.add(seq(name))
    work = s.next_work(0.0)
    assert {w.seq_id: w.group for w in work} == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}
    complete(s, work)
    assert {w.seq_id: w.group for w in s.next_work(0.0)} == {"a": 0, "b": 1, "c": 0, "d": 1, "e": 0}


def test_a_groups_prompts_share_a_token_budget_that_shrinks_while_it_decodes() -> None:
    config = SchedulerConfig(prefill_chunk=10, busy_prefill_chunk=3, max_prefill_in_flight=9)
    s = Scheduler(config)
    s.add(seq("a", prompt=4))
    s.add(seq("b", prompt=5))
    s.add(seq("c", prompt=30))
    # nobody decodes: 10 prompt tokens in the ring, shared in admission order (c takes 2, one
    # more than what is left of the budget: a chunk never holds a lone token of a prompt)
    assert [(w.seq_id, len(w.tokens)) for w in s.next_work(0.0)] == [("a", 4), ("b", 5), ("c", 2)]
    complete(s, [w for w in [s.sequences[x].in_flight for x in "abc"] if w])
    # a and b decode now: c's prompt advances 3 tokens per step beside them
    work = s.next_work(0.0)
    assert [(w.seq_id, len(w.tokens), w.prefill) for w in work] == [
        ("a", 1, False),
        ("b", 1, False),
        ("c", 3, True),
    ]


def test_lockstep_decode_steps_of_a_group_go_out_together() -> None:
    s = Scheduler(SchedulerConfig(groups=1, lockstep=True, max_prefill_in_flight=8))
    for name in "ab":
        s.add(seq(name, prompt=3))
    complete(s, s.next_work(0.0))  # both prompts in one step
    work = s.next_work(0.0)
    assert [(w.seq_id, w.prefill) for w in work] == [("a", False), ("b", False)]
    s.on_result("a", token_for(work[0]))
    assert s.next_work(0.0) == []  # a is back, b is not: a waits for its group
    # a prompt chunk goes on its own: a late arrival does not wait for the group
    s.add(seq("c", prompt=2))
    (chunk,) = s.next_work(0.0)
    assert chunk.seq_id == "c" and chunk.prefill
    s.on_result("b", token_for(work[1]))
    assert [w.seq_id for w in s.next_work(0.0)] == ["a", "b"]
    # without lockstep a would have gone on alone
    free = Scheduler(SchedulerConfig(groups=1, max_prefill_in_flight=8))
    for name in "ab":
        free.add(seq(name, prompt=3))
    complete(free, free.next_work(0.0))
    work = free.next_work(0.0)
    free.on_result("a", token_for(work[0]))
    assert [w.seq_id for w in free.next_work(0.0)] == ["a"]


def test_groups_open_one_per_group_size_sequences_and_stay_balanced() -> None:
    config = SchedulerConfig(groups=2, group_size=2, lockstep=True, max_prefill_in_flight=8)
    s = Scheduler(config)
    for name in "ab":
        s.add(seq(name, max_tokens=20))
    work = s.next_work(0.0)
    assert s.active_groups() == 1 and {w.group for w in work} == {0}  # two: one batch
    complete(s, work)
    for name in "cd":
        s.add(seq(name, max_tokens=4))
    work = s.next_work(0.0)
    assert s.active_groups() == 2
    assert sorted(w.group for w in work) == [0, 0, 1, 1]  # the second group opened
    # c and d end: a and b share one group again
    for _ in range(30):
        complete(s, work)
        work = s.next_work(0.0)
        if len(s.running) == 2:
            break
    assert s.active_groups() == 1
    complete(s, work)
    assert {w.group for w in s.next_work(0.0)} == {0}
    # every sequence's tokens are what it gets alone
    alone = Scheduler(SchedulerConfig(max_prefill_in_flight=8))
    for name, tokens in zip("abcd", (20, 20, 4, 4), strict=True):
        alone.add(seq(name, max_tokens=tokens))
    grouped = Scheduler(config)
    for name, tokens in zip("abcd", (20, 20, 4, 4), strict=True):
        grouped.add(seq(name, max_tokens=tokens))
    assert run_until_done(grouped) == run_until_done(alone)


def test_kv_pool_admission_waits_for_blocks() -> None:
    # one pool of 4 blocks of 4 positions; each sequence needs 2 blocks for its prompt
    config = SchedulerConfig(prefill_chunk=8, max_prefill_in_flight=8, kv_pools=((4, 4),))
    s = Scheduler(config)
    for name in "abc":
        s.add(seq(name, prompt=7, max_tokens=1))
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["a", "b"]  # c waits in the queue for blocks
    assert s.queued == 1
    complete(s, work)  # both finish (max_tokens 1) and give their blocks back...
    assert s.next_work(0.0) == []  # ...once the stages have freed them: c's first chunk
    assert freed(s) == ["a", "b"]  # sent before that could reach a stage first
    assert [w.seq_id for w in s.next_work(0.0)] == ["c"]


def test_state_pool_admission_waits_for_a_sessions_slots() -> None:
    """A hybrid model's state pool of 25 slots for sessions, 10 a session at its fullest:
    two sessions at once, though the KV blocks would hold all three. The third waits in the
    queue (nothing is preempted) until a finished sequence's release is done, then runs to
    the end with the tokens it gets alone."""

    def make(state_pools: tuple[tuple[int, int], ...]) -> Scheduler:
        config = SchedulerConfig(
            prefill_chunk=8, max_prefill_in_flight=8, kv_pools=((4, 64),), state_pools=state_pools
        )
        s = Scheduler(config)
        for name, tokens in zip("abc", (2, 6, 3), strict=True):
            s.add(seq(name, prompt=7, max_tokens=tokens))
        return s

    alone = run_until_done(make(()))
    s = make(((25, 10),))
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["a", "b"] and s.queued == 1  # c waits for slots
    complete(s, work)
    complete(s, s.next_work(0.0))  # a ends (2 tokens); its session is not freed yet
    assert s.sequences["a"].phase is Phase.DONE
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["b"] and s.queued == 1
    complete(s, work)
    assert freed(s) == ["a"]
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["b", "c"]  # now c is admitted
    complete(s, work)
    assert run_until_done(s) == alone
    assert s.preemptions == 0
    with pytest.raises(ValueError, match="state pools"):
        SchedulerConfig(state_pools=((10, 0),))


def test_decoding_beyond_the_pool_preempts_the_newest_which_resumes_and_ends_the_same() -> None:
    def make(pools: tuple[tuple[int, int], ...]) -> Scheduler:
        s = Scheduler(SchedulerConfig(prefill_chunk=8, max_prefill_in_flight=8, kv_pools=pools))
        for name in "abc":
            s.add(seq(name, prompt=6, max_tokens=10))
        return s

    alone = run_until_done(make(()))
    tight = make(((4, 9),))  # 36 positions for 3 sequences that grow to 16 each
    releases: list[Release] = []
    result = run_until_done(tight, releases=releases)
    assert result == alone  # preemption changes timing, never tokens
    assert tight.preemptions >= 1
    assert all(q.phase is Phase.DONE for q in tight.sequences.values())
    released = [r for r in releases if not r.final and r.session_id]
    assert released and released[0].seq_id == "c"  # the newest went first
    assert tight.sequences["c"].incarnation >= 1  # it re-prefilled on a fresh session


def test_a_preempted_sequences_blocks_are_free_for_others_once_its_release_is_done() -> None:
    """a's next decode step needs the blocks b holds: b is preempted, and a's step waits until
    the stages have freed b's session (sent at once, it could reach a stage first)."""
    s = Scheduler(SchedulerConfig(prefill_chunk=8, max_prefill_in_flight=8, kv_pools=((4, 4),)))
    s.add(seq("a", prompt=7, max_tokens=10))
    s.add(seq("b", prompt=7, max_tokens=10))
    complete(s, s.next_work(0.0))  # both hold 2 blocks: the pool is full
    complete(s, s.next_work(0.0))  # each decoded position 7; the next needs a third block
    assert s.next_work(0.0) == []  # b was preempted for a, whose step waits for b's release
    assert s.sequences["b"].preempted
    [release] = s.take_releases()
    assert release == Release("b", "b", final=False) and release.positions == 9
    s.released(["b"])
    assert [(w.seq_id, w.start_position) for w in s.next_work(0.0)] == [("a", 8)]


def test_the_rings_own_steps_claim_their_positions_within_the_pools() -> None:
    """The ring's own decode steps (follow) get only the room the pools have beside the other
    sequences' claims, and claim it at once: the stages take each step's position before its
    result comes back, with no chance for the gateway to make room then."""
    config = SchedulerConfig(
        max_running=3,
        groups=3,
        lockstep=True,
        solo=True,
        ring_decode=8,
        max_prefill_in_flight=3,
        kv_pools=((4, 5),),
    )
    s = Scheduler(config)
    s.add(seq("a", prompt=6, max_tokens=20))
    s.add(seq("b", prompt=6, max_tokens=20))
    complete(s, s.next_work(0.0))  # a and b hold 6 positions, 2 blocks each
    [step, _] = s.next_work(0.0)  # a's decode step at position 6 leaves a holding 7
    assert (step.seq_id, step.start_position) == ("a", 6)
    # one block is free: the ring may take a up to 12 positions, 5 steps of the 8 asked
    assert s.ring_steps("a", 7, 8) == 5
    assert s.sequences["a"].ring_claim == 12
    s.add(seq("c", prompt=2, max_tokens=2))
    assert [w.seq_id for w in s.next_work(0.0)] == []  # c waits: the ring has its block
    assert s.ring_steps("b", 7, 8) == 1  # b's own block has room for one more
    s.on_result("a", token_for(step), session_length=7)
    assert s.follow("a") == Work("a", (107,), 7, prefill=False, samples=True)


def test_prompts_prefilled_in_chunks_side_by_side_never_wait_for_each_others_blocks() -> None:
    """Two 12-token prompts in chunks of 4 on a pool of 16 positions: claimed chunk by chunk,
    each held 8 positions and waited for the other's blocks forever (nothing decoded, so
    nothing was preempted). A prompt's blocks are claimed at admission, so the second waits
    in the queue and both end."""
    s = Scheduler(SchedulerConfig(prefill_chunk=4, max_prefill_in_flight=8, kv_pools=((4, 4),)))
    s.add(seq("a", prompt=12, max_tokens=2))
    s.add(seq("b", prompt=12, max_tokens=2))
    work = s.next_work(0.0)
    assert [w.seq_id for w in work] == ["a"] and s.queued == 1
    complete(s, work)
    assert run_until_done(s) == {"a": [112, 113], "b": [112, 113]}


class Stages:
    """What paged stages hold for ``drive_with_pools``: positions per session, refusing a
    step that would outgrow a pool (as paged stages do), or open more sessions than a state
    pool holds (``sessions``: a hybrid model's, each session at its fullest); how often they
    refused."""

    def __init__(self, pools: tuple[tuple[int, int], ...], sessions: int | None = None) -> None:
        self.pools = pools
        self.sessions = sessions
        self.held: dict[str, int] = {}
        self.refused = 0

    def place(self, session: str, length: int) -> bool:
        after = {**self.held, session: max(length, self.held.get(session, 0))}
        if any(sum(-(-n // b) for n in after.values()) > c for b, c in self.pools) or (
            self.sessions is not None and len(after) > self.sessions
        ):
            self.refused += 1
            return False
        self.held = after
        return True


def drive_with_pools(
    s: Scheduler,
    stages: Stages,
    rng: random.Random,
    chaos: bool = False,
    limit: int = 6000,
) -> int | None:
    """Drive ``s`` with results in random order and a random share of the steps in flight
    back per tick, on ``stages``, timed as a ring of stage processes may be: a release
    reaches the stages up to two ticks after the scheduler asks for it (steps sent meanwhile
    may come first), and with ring_decode the ring makes its own decode steps (a random
    budget, which the scheduler cuts to what the pools hold: Scheduler.ring_steps), each of
    which the stages take before the result of the step before reaches the scheduler. With
    ``chaos``, steps are also lost with the ring or find their session gone, the ring is down
    at times, and clients cancel. Returns the ticks it took, or None when sequences are left
    with no step in flight and none to send though the ring is up (a hang), or still run
    after ``limit`` ticks."""
    out: list[Work] = []
    releasing: list[tuple[int, list[str]]] = []  # (tick the stages free them, sessions)
    ring: dict[str, int] = {}  # the ring's own steps left after each sequence's step in flight
    for tick in range(limit):
        now, ring_up = float(tick), not chaos or rng.random() < 0.7
        s.expire(now)
        for due, sessions in [r for r in releasing if r[0] <= tick]:
            releasing.remove((due, sessions))
            for session in sessions:
                stages.held.pop(session, None)
            s.released(sessions)
        sent = s.next_work(now, ring_ready=ring_up)
        for item in sent:
            q = s.sequences[item.seq_id]
            ring.pop(item.seq_id, None)
            if s.config.ring_decode and item.samples:  # as Engine._follow_budget asks
                held = item.start_position + len(item.tokens)
                wanted = min(
                    rng.randint(0, s.config.ring_decode), q.max_tokens - len(q.generated) - 1
                )
                ring[item.seq_id] = s.ring_steps(item.seq_id, held, wanted) if wanted > 0 else 0
        out += sent
        sessions = [r.session_id for r in s.take_releases() if r.session_id]
        if sessions:
            releasing.append((tick + rng.randint(0, 2), sessions))
        for sid in list(s.sequences):
            s.forget(sid)  # the finished ones' consumers have seen their end
        if chaos and s.sequences and rng.random() < 0.02:
            s.cancel(rng.choice(list(s.sequences)))
        if not out:
            if not s.running and not s.queued and not releasing:
                return tick
            if not ring_up or releasing:
                continue  # lost sequences wait for the ring, others for releases
            return None
        rng.shuffle(out)
        back = rng.randint(1, len(out))
        done, out = out[:back], out[back:]
        for item in done:
            if item.seq_id not in s.sequences:
                continue  # cancelled and forgotten
            fate = rng.random() if chaos else 1.0
            if fate < 0.03:
                s.on_lost(item.seq_id, RuntimeError("UNAVAILABLE: stage down"), now)
                continue
            if fate < 0.05:
                s.on_session_lost(item.seq_id, RuntimeError("NOT_FOUND: session"), now)
                continue
            length = item.start_position + len(item.tokens)
            if not stages.place(item.session, length):
                s.on_preempted(item.seq_id, RuntimeError("RESOURCE_EXHAUSTED: KV blocks"))
                continue
            left = ring.pop(item.seq_id, 0)
            # the ring's next step reaches stage 0 before this result reaches the gateway
            placed = left > 0 and stages.place(item.session, length + 1)
            s.on_result(item.seq_id, token_for(item))
            if left and (follow := s.follow(item.seq_id)) is not None:
                ring[item.seq_id] = left - 1
                if placed:
                    out.append(follow)
                else:  # the stages refused it
                    s.on_preempted(item.seq_id, RuntimeError("RESOURCE_EXHAUSTED: KV blocks"))
    return None


def random_workload(
    rng: random.Random,
) -> tuple[SchedulerConfig, Stages, list[Sequence]]:
    """Random pools (KV blocks, and at times a hybrid's state pool of 1-4 sessions), chunk
    budgets, prefills in flight and groups (lockstep, solo, ring decode), with or without the
    gateway counting them, and 1-8 sequences that each fit the pools alone."""
    block, blocks = rng.choice([2, 4, 8]), rng.randint(3, 12)
    pools = ((block, blocks),) * rng.randint(1, 2)
    sessions = rng.randint(1, 4) if rng.random() < 0.4 else None
    per = rng.randint(1, 10)  # a session's slots at its fullest
    counted = rng.random() < 0.8
    half = block * blocks // 2  # prompt + max_tokens fit the pools alone
    lockstep = rng.random() < 0.5
    solo = lockstep and rng.random() < 0.5
    running = rng.randint(1, 8)
    config = SchedulerConfig(
        max_running=running,
        max_queued=8,
        queue_timeout=1e6,
        prefill_chunk=rng.randint(1, 8),
        max_prefill_in_flight=rng.randint(1, 8),
        resume_grace=rng.choice([0, 5, 50]),
        groups=running if solo else rng.randint(1, 3),
        busy_prefill_chunk=rng.choice([None, 1, 3]),
        kv_pools=pools if counted else (),
        state_pools=((sessions * per + rng.randint(0, per - 1), per),)
        if counted and sessions
        else (),
        lockstep=lockstep,
        solo=solo,
        group_size=rng.choice([0, 2]) if lockstep and not solo else 0,
        ring_decode=rng.choice([0, 2]) if lockstep else 0,
    )
    count = rng.randint(1, 8)
    sequences = [
        seq(f"s{i}", prompt=rng.randint(1, half), max_tokens=rng.randint(1, half))
        for i in range(count)
    ]
    return config, Stages(pools, sessions), sequences


@pytest.mark.parametrize("seed", range(4))
def test_every_sequence_ends_whatever_the_pools_chunks_groups_and_order(seed: int) -> None:
    """Liveness on random workloads (see random_workload): sequences that each fit the pools
    alone all end, with all their tokens and no error, whatever the result order, and
    whether the gateway counts the blocks or (if not) the stages' refusals preempt."""
    rng = random.Random(seed)
    for _ in range(150):
        config, stages, sequences = random_workload(rng)
        s = Scheduler(config)
        for q in sequences:
            s.add(q)
        assert drive_with_pools(s, stages, rng) is not None, (config, sequences)
        assert all(q.error is None and len(q.generated) == q.max_tokens for q in sequences)
        # counting the blocks and state slots, the gateway never sends a step the stages
        # cannot hold
        assert stages.refused == 0 or not config.kv_pools, (config, sequences)


@pytest.mark.parametrize("seed", range(4))
def test_every_sequence_ends_when_steps_are_lost_and_clients_cancel(seed: int) -> None:
    """Liveness with failures too: steps lost with the ring or finding their session gone,
    a ring down at times, clients that cancel. Every sequence still ends (all its tokens, or
    an error once lost too often or past the resume grace, or cancelled): none hangs."""
    rng = random.Random(100 + seed)
    for _ in range(150):
        config, stages, sequences = random_workload(rng)
        s = Scheduler(config)
        for q in sequences:
            s.add(q)
        assert drive_with_pools(s, stages, rng, chaos=True) is not None, (config, sequences)
        for q in sequences:
            assert q.phase is Phase.DONE
            assert q.cancelled or q.error is not None or len(q.generated) == q.max_tokens


def test_a_stage_refusal_preempts_the_sequence_and_it_resumes() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=8))
    s.add(seq("a", prompt=3))
    complete(s, s.next_work(0.0))
    (_decode,) = s.next_work(0.0)
    assert s.on_preempted("a", RuntimeError("KV blocks exhausted"))
    assert freed(s) == ["a"]
    (again,) = s.next_work(0.0)
    assert again.prefill and again.session_id == "a.r1" and again.start_position == 0
    assert list(again.tokens) == s.sequences["a"].prefix
    for _ in range(16):
        s.sequences["a"].in_flight = again
        if not s.on_preempted("a", RuntimeError("still no blocks")):
            break
    assert s.sequences["a"].phase is Phase.DONE  # refused too often: ends with the error


def test_a_refused_sequence_backs_off_until_another_ends() -> None:
    s = Scheduler(SchedulerConfig(prefill_chunk=8, max_prefill_in_flight=4))
    s.add(seq("a", prompt=3, max_tokens=2))
    s.add(seq("b", prompt=3, max_tokens=8))
    complete(s, s.next_work(0.0))  # both prefilled, each sampled its first token
    work = {w.seq_id: w for w in s.next_work(0.0)}
    assert s.on_preempted("b", RuntimeError("KV blocks exhausted"))
    s.take_releases()
    assert s.next_work(0.0) == []  # a is still decoding: b waits instead of taking its blocks
    s.on_result("a", token_for(work["a"]))  # a reaches max_tokens and ends
    (resumed,) = s.next_work(0.0)
    assert resumed.seq_id == "b" and resumed.prefill and resumed.start_position == 0


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8])
def test_a_prompt_chunk_never_holds_or_leaves_a_lone_token(budget: int) -> None:
    for length in range(1, 30):
        fed, sizes = 0, []
        while fed < length:
            end = chunk_end(length, fed, budget)
            assert fed < end <= length
            sizes.append(end - fed)
            fed = end
        assert length == 1 or min(sizes) >= 2, (length, sizes)
        assert max(sizes) <= max(budget, 2) + 1, (length, sizes)
        # the budget is kept wherever it leaves more than one token behind
        assert all(n == budget for n in sizes[:-2]) or budget < 2, (length, sizes)


def test_without_batching_each_sequence_is_a_group_and_prompts_share_one_budget() -> None:
    config = SchedulerConfig(
        max_running=4,
        groups=4,
        lockstep=True,
        solo=True,
        prefill_chunk=10,
        busy_prefill_chunk=3,
        max_prefill_in_flight=4,
    )
    s = Scheduler(config, eos_ids=[EOS])
    s.add(seq("a", prompt=4, max_tokens=50))
    complete(s, s.next_work(0.0))  # a's prompt in one chunk; a decodes now
    s.add(seq("b", prompt=30))
    s.add(seq("c", prompt=30))
    work = s.next_work(0.0)
    # every sequence has a group of its own; while a decodes, b and c share 3 prompt tokens
    # in the ring (b takes them all, in admission order), not 3 each as groups would
    assert len({s.sequences[x].group for x in "abc"}) == 3
    assert [(w.seq_id, len(w.tokens), w.prefill) for w in work] == [
        ("a", 1, False),
        ("b", 3, True),
    ]
    # a's decode steps never wait for another sequence's: a goes on while b's chunk is out
    s.on_result("a", token_for(work[0]))
    assert [(w.seq_id, w.prefill) for w in s.next_work(0.0)] == [("a", False)]


def test_without_batching_the_scheduler_needs_a_group_per_running_sequence() -> None:
    with pytest.raises(ValueError, match="group per running sequence"):
        SchedulerConfig(max_running=4, groups=2, solo=True)
    SchedulerConfig(max_running=4, groups=4, solo=True)


def test_the_rings_own_steps_are_in_flight_and_end_with_the_sequence() -> None:
    """With ring_decode the ring makes a decode step itself after each result (follow): the
    sequence has it in flight, next_work leaves it alone, and it ends as a sent step would."""
    config = SchedulerConfig(
        max_running=2, groups=2, lockstep=True, solo=True, ring_decode=4, max_prefill_in_flight=2
    )
    s = Scheduler(config, eos_ids=[EOS])
    s.add(seq("a", prompt=3, max_tokens=4))
    s.add(seq("b", prompt=3, max_tokens=20))
    first = {w.seq_id: w for w in s.next_work(0.0)}
    assert s.follow("a") is None  # its prompt's step is still out
    s.on_result("a", [41], session_length=3)
    ring = s.follow("a")
    assert ring == Work("a", (41,), 3, prefill=False, samples=True)
    assert s.sequences["a"].in_flight == ring and s.in_flight == 2
    assert [w.seq_id for w in s.next_work(0.0)] == []  # a's next step is the ring's
    for token, length in ((42, 4), (43, 5)):
        s.on_result("a", [token], session_length=length)
        assert s.follow("a") == Work("a", (token,), length, prefill=False, samples=True)
    s.on_result("a", [44], session_length=6)  # max_tokens: done, the ring's step is dropped
    assert s.follow("a") is None and s.sequences["a"].phase is Phase.DONE
    assert freed(s) == ["a"]
    # cancelled while the ring decodes: the next result ends it and frees its session
    s.on_result("b", token_for(first["b"]))
    assert s.follow("b") is not None
    s.cancel("b")
    assert s.on_result("b", [50], session_length=4) == 0 and s.follow("b") is None
    assert freed(s) == ["b"]
    # an end-of-sequence token ends it too
    s.add(seq("c", prompt=2))
    assert [w.seq_id for w in s.next_work(1.0)] == ["c"]
    s.on_result("c", [EOS])
    assert s.follow("c") is None and freed(s) == ["c"]


def test_a_lockstep_group_runs_on_the_ring_and_a_newcomer_waits_for_its_run() -> None:
    """Batched groups (lockstep) decode on the ring too: each of the group's steps is
    followed by the ring's own; a sequence that joins the group meanwhile prefills at once,
    and its decode steps wait until the group's run is over, then go out with the group's."""
    config = SchedulerConfig(
        max_running=4, groups=1, lockstep=True, ring_decode=2, max_prefill_in_flight=4
    )
    s = Scheduler(config, eos_ids=[EOS])
    s.add(seq("a", prompt=3, max_tokens=20))
    s.add(seq("b", prompt=3, max_tokens=20))
    for w in s.next_work(0.0):
        s.on_result(w.seq_id, token_for(w))
    assert sorted(w.seq_id for w in s.next_work(0.0)) == ["a", "b"]  # together
    for sid in ("a", "b"):
        s.on_result(sid, [41], session_length=4)
        assert s.follow(sid) == Work(sid, (41,), 4, prefill=False, samples=True)
    s.add(seq("c", prompt=3, max_tokens=20))
    chunk = s.next_work(1.0)
    assert [(w.seq_id, w.prefill) for w in chunk] == [("c", True)]  # prefills during the run
    s.on_result("c", token_for(chunk[0]))
    assert s.next_work(1.0) == []  # its decode step waits for the group's run
    for sid in ("a", "b"):
        s.on_result(sid, [42], session_length=5)  # the run's last token: back to the gateway
    assert sorted(w.seq_id for w in s.next_work(2.0)) == ["a", "b", "c"]


def test_the_rings_own_steps_need_solo_or_lockstep_and_no_rollback() -> None:
    with pytest.raises(ValueError, match="needs solo or lockstep"):
        SchedulerConfig(ring_decode=4)
    SchedulerConfig(ring_decode=4, lockstep=True)
    s = Scheduler(SchedulerConfig(groups=16, solo=True, ring_decode=4), eos_ids=[EOS])
    s.add(seq("a", prompt=3))
    s.next_work(0.0)
    s.on_result("a", [41, 42], session_length=5)  # a speculative step's two tokens, all fed
    with pytest.raises(ValueError, match="cannot roll back"):
        s.follow("a")


def test_with_a_prefix_cache_a_session_first_opens_on_its_cached_prefix() -> None:
    """A lookup (no ring step, no tokens) comes first; its prompt chunks then start where the
    stages' cached blocks end. A preempted sequence looks up again on its new session; one
    cancelled during its lookup ends at the answer and frees the session the lookup opened."""
    config = SchedulerConfig(prefill_chunk=8, prefix_cache=True, kv_pools=((4, 12),))
    s = Scheduler(config, eos_ids=[EOS])
    s.add(seq("a", prompt=20, max_tokens=4))
    [lookup] = s.next_work(0.0)
    assert lookup == Work("a", (), 0, prefill=True, samples=False, lookup=True)
    assert s.next_work(0.0) == []  # nothing else of it while the lookup is out
    with pytest.raises(ValueError, match="no step in flight"):
        s.on_result("a", [])
    s.on_prefix("a", 16)
    assert s.sequences["a"].cached == 16 and s.sequences["a"].opened
    [chunk] = s.next_work(0.0)
    assert chunk == Work("a", tuple(range(17, 21)), 16, prefill=True, samples=True)
    s.on_result("a", [42])
    # preempted (its blocks wanted): the new session looks up again; `cached` keeps the first
    s._preempt(s.sequences["a"])
    assert freed(s) == ["a"]
    [again] = s.next_work(0.0)
    assert again.lookup and again.session == "a.r1"
    s.on_prefix("a", 20)  # its own earlier blocks, prompt and generated
    assert s.sequences["a"].fed == 20 and s.sequences["a"].cached == 16
    [rest] = s.next_work(0.0)
    assert (rest.tokens, rest.start_position, rest.samples) == ((42,), 20, True)

    s.add(seq("b", prompt=6))
    assert [w.lookup for w in s.next_work(0.0) if w.seq_id == "b"] == [True]
    s.cancel("b")
    s.on_prefix("b", 0)
    assert "b" not in s.sequences and freed(s) == ["b"]
    with pytest.raises(ValueError, match="cached positions"):
        s.add(seq("c", prompt=6))
        assert [w.lookup for w in s.next_work(0.0) if w.seq_id == "c"] == [True]
        s.on_prefix("c", 6)  # at least the last prompt token is always computed
