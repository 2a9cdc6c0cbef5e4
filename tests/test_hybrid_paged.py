"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on the paged backend: each sequence's
linear-attention state lives in slots of the stage's state tables beside its KV blocks, many
sequences share one inference call, and a rollback selects an earlier kept state."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from common.state_pool import pool_slots, slots_per_session
from exporter.verify import reference_greedy
from shard_runtime.chain import LocalChain
from shard_runtime.memory import available_memory
from shard_runtime.paged import BlocksExhausted, PagedRunner, PagedStep, StateSlots
from shard_runtime.runner import InvalidStageInput
from tests.conftest import EXACT, ExportFn

PROMPT = [5, 17, 33, 99, 100, 7, 42, 8, 61, 3, 200, 150]
POOL = 1 << 22  # bytes of KV blocks (and so of state slots) per stage


def _chunked_greedy(
    chain: LocalChain, session: str, prompt: list[int], chunks: list[int], steps: int
) -> tuple[list[int], np.ndarray]:
    at = 0
    for size in chunks:
        logits = chain.forward(session, np.asarray(prompt[at : at + size]))[-1]
        at += size
    tokens: list[int] = []
    rows = []
    for step in range(steps):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if step + 1 < steps:
            logits = chain.forward(session, np.asarray(tokens[-1:]))[-1]
    return tokens, np.stack(rows)


@pytest.mark.unit
def test_state_slots_keep_a_window_and_prefix_states_give_way() -> None:
    """Bookkeeping: a session keeps its states within the window of its length (and none
    after it), prefix states count as free and go least recently used first when a session
    needs their slots, a state kept twice under one hash is given back, and a take that
    cannot be met changes nothing."""
    slots = StateSlots(num_slots=6, window=2, max_prefix=6)
    held = slots.states.setdefault("a", {})
    held.update(zip(range(5), slots.take(5, "a"), strict=True))  # states after 0..4
    slots.keep("a", 4)
    assert sorted(held) == [2, 3, 4] and (slots.free, slots.used) == (3, 3)
    slots.keep("a", 3)  # rolled back to 3: the state after 4 goes
    assert sorted(held) == [2, 3] and slots.free == 4
    first, second, spare = slots.take(3, "prefix states")
    slots.put_prefix(b"x", first)
    slots.put_prefix(b"y", second)
    slots.put_prefix(b"x", spare)  # already kept: the slot comes back
    assert (slots.cached, slots.free, slots.used) == (2, 4, 2)
    assert slots.prefix_slot(b"x") == first  # now the most recently used
    taken = slots.take(3, "b")  # the two free ones, then the oldest prefix state (y)
    assert second in taken and slots.prefix_slot(b"y") is None
    assert slots.prefix_slot(b"x") == first
    with pytest.raises(BlocksExhausted, match=r"needs 3 .* 1 of 6 are free"):
        slots.take(3, "c")
    assert (slots.free, slots.cached) == (1, 1)
    slots.release("a")
    slots.give(taken)
    assert slots.free == 6 and not slots.states


@pytest.mark.component
@pytest.mark.parametrize(
    ("arch", "stages"), [("qwen3_5", 1), ("qwen3_5", 3), ("qwen3_5_moe", 2), ("qwen3_next", 2)]
)
def test_paged_stages_equal_transformers(
    tiny_export: ExportFn, tiny_model: Callable[..., Path], arch: str, stages: int
) -> None:
    """Paged stages (a stage of linear-attention layers only among them, at 3 stages) give
    transformers' greedy tokens for the prompt at once, token for token, whatever the prefill
    chunks (odd sizes, one at a time, shorter than the convolution's kernel); the linear
    layers run as the fused paged kernels."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model(arch))).eval()
    expected, expected_logits = reference_greedy(reference, PROMPT, 24)
    chain = LocalChain(tiny_export(arch, stages), EXACT, "paged", kv_cache_bytes=POOL)
    manifest = chain.manifest
    for runner in chain.runners:
        assert isinstance(runner, PagedRunner)
        kinds = Counter(
            str(op.get_rt_info()["layerType"].astype(str))
            for op in runner.compiled.get_runtime_model().get_ops()
        )
        linear = len(runner.recurrent_layers)
        assert linear, "every stage of these tiny hybrids holds a linear-attention layer"
        assert kinds["PagedGatedDeltaNet"] == kinds["PagedCausalConv1D"] == linear, kinds
        assert kinds["TensorIterator"] == kinds["Loop"] == 0
        assert runner.states is not None
    assert manifest.model.layer_types
    for n, chunks in enumerate(([12], [4, 1, 7], [1] * len(PROMPT), [2, 3, 7])):
        tokens, logits = _chunked_greedy(chain, f"s{n}", PROMPT, chunks, 24)
        chain.release(f"s{n}")
        assert tokens == expected, f"chunks {chunks}"
        assert np.abs(logits - expected_logits).max() < 1e-4
    for runner in chain.runners:
        assert isinstance(runner, PagedRunner) and runner.states is not None
        assert runner.states.used == 1  # everything given back but the scratch slot
        assert runner.blocks.used == 0


class _Stages:
    """The paged runners of an export, fed step lists through every stage in turn."""

    def __init__(self, export: Path, **kw: object) -> None:
        from protos.manifest import load_manifest

        stages = load_manifest(export).num_stages
        self.runners = [PagedRunner(export, k, EXACT, **kw) for k in range(stages)]  # type: ignore[arg-type]

    def feed(self, steps: list[PagedStep]) -> list[np.ndarray]:
        outs: list[np.ndarray] = []
        for runner in self.runners:
            for step in steps:
                runner.place(step)
            outs = runner.forward(steps)
            steps = [  # every stage sees the step's block hashes, as in the ring
                PagedStep(
                    s.session_id, o.astype(np.float32), s.start, s.num_logits, hashes=s.hashes
                )
                for s, o in zip(steps, outs, strict=True)
            ]
        return outs  # the last stage's logits

    def rollback(self, session: str, count: int) -> None:
        for runner in self.runners:
            runner.rollback(session, count)

    def release(self, session: str) -> None:
        for runner in self.runners:
            runner.release(session)


@pytest.mark.component
def test_interleaved_sessions_in_one_call_each_equal_alone(tiny_export: ExportFn) -> None:
    """Eight sessions whose prefill chunks and decodes share inference calls (joining late,
    of different lengths) get the logits each gets alone."""
    stages = _Stages(tiny_export("qwen3_5", 2), kv_cache_bytes=POOL)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, 3 + 5 * i) for i in range(8)]
    alone = []
    for i, prompt in enumerate(prompts):
        out = [stages.feed([PagedStep(f"a{i}", prompt, 0)])[0][-1]]
        for k in range(4):
            token = np.array([int(np.argmax(out[-1]))])
            out.append(stages.feed([PagedStep(f"a{i}", token, len(prompt) + k)])[0][-1])
        alone.append(out)
        stages.release(f"a{i}")
    got: dict[int, list[np.ndarray]] = {i: [] for i in range(8)}
    fed = dict.fromkeys(range(8), 0)
    for round_ in range(8):  # sessions 2r and 2r+1 join in round r
        steps = []
        for i in range(min(8, 2 * round_ + 2)):
            if len(got[i]) == 5:
                continue
            if not got[i]:
                steps.append(PagedStep(f"b{i}", prompts[i], 0))
            else:
                token = np.array([int(np.argmax(got[i][-1]))])
                steps.append(PagedStep(f"b{i}", token, fed[i]))
        if not steps:
            break
        for step, out in zip(steps, stages.feed(steps), strict=True):
            i = int(step.session_id[1:])
            got[i].append(out[-1])
            fed[i] += len(step.data)
    for i in range(8):
        assert len(got[i]) == 5
        np.testing.assert_allclose(np.stack(got[i]), np.stack(alone[i]), atol=1e-5)
        assert [int(np.argmax(r)) for r in got[i]] == [int(np.argmax(r)) for r in alone[i]]


@pytest.mark.component
def test_rollbacks_equal_never_feeding_the_rolled_back_positions(tiny_export: ExportFn) -> None:
    """With a window of 4: verifications of 5 positions (4 proposals and a bonus) rolled back
    by 3 and by 4, and a draft's pattern (4 one-token calls, then a rollback of 3), each leave
    the session as feeding only the kept positions would: the next logits are the same.
    Further back than the kept states it refuses and changes nothing."""
    stages = _Stages(tiny_export("qwen3_5", 2), kv_cache_bytes=POOL, state_window=4)
    rng = np.random.default_rng(1)
    prompt, cont, nxt = rng.integers(3, 250, 13), rng.integers(3, 250, 5), rng.integers(3, 250, 3)

    def reference(kept: np.ndarray) -> np.ndarray:
        """The logits of ``nxt`` after the prompt and ``kept``, fed without rollbacks."""
        stages.feed([PagedStep("ref", prompt, 0)])
        if len(kept):
            stages.feed([PagedStep("ref", kept, 13)])
        out = stages.feed([PagedStep("ref", nxt, 13 + len(kept), num_logits=3)])[0]
        stages.release("ref")
        return out

    # a verification of 4 proposals and a bonus position (the window + 1), 3 rejected, then
    # one of 5 with all 4 proposals rejected
    stages.feed([PagedStep("v", prompt, 0)])
    stages.feed([PagedStep("v", cont, 13, num_logits=5)])
    stages.rollback("v", 3)
    got = stages.feed([PagedStep("v", nxt, 15, num_logits=3)])[0]
    np.testing.assert_allclose(got, reference(cont[:2]), atol=1e-5)
    stages.rollback("v", 3)
    stages.feed([PagedStep("v", cont, 15, num_logits=5)])
    stages.rollback("v", 4)
    got = stages.feed([PagedStep("v", nxt, 16, num_logits=3)])[0]
    np.testing.assert_allclose(got, reference(np.concatenate([cont[:2], cont[:1]])), atol=1e-5)

    # a draft: one token at a time, then back by 3
    stages.feed([PagedStep("d", prompt, 0)])
    for i in range(4):
        stages.feed([PagedStep("d", cont[i : i + 1], 13 + i)])
    stages.rollback("d", 3)
    got = stages.feed([PagedStep("d", nxt, 14, num_logits=3)])[0]
    np.testing.assert_allclose(got, reference(cont[:1]), atol=1e-5)

    # back to the start: a new sequence from zeros
    stages.rollback("d", 17)
    got = stages.feed([PagedStep("d", prompt, 0)])[0]
    np.testing.assert_allclose(got, stages.feed([PagedStep("fresh", prompt, 0)])[0], atol=1e-6)

    # a long prefill keeps only its end state: rolling back into it is refused, unchanged
    length = stages.runners[0].session_length("d")
    with pytest.raises(InvalidStageInput, match="recurrent state"):
        stages.rollback("d", 2)
    assert all(r.session_length("d") == length for r in stages.runners)
    got = stages.feed([PagedStep("d", nxt, 13, num_logits=3)])[0]
    np.testing.assert_allclose(got, reference(cont[:0]), atol=1e-5)


@pytest.mark.component
def test_state_slot_exhaustion_refuses_and_changes_nothing(tiny_export: ExportFn) -> None:
    """With the fewest state slots (4), a session's first step that finds too few free is
    refused with RESOURCE_EXHAUSTED's error (BlocksExhausted) and leaves nothing behind (no
    session, no blocks, no slots); the first session goes on as if nothing had happened. A
    window the pool cannot hold for one session is cut to what it can: a lone session always
    goes on."""
    export = tiny_export("qwen3_5", 1)
    runner = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_window=0)
    assert runner.states is not None
    # 4 slots (the least): the scratch slot's and, with no window, two sessions' one each
    # between calls, but only one of them can take its zeros and its first state
    small = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_cache_bytes=1, state_window=0)
    assert small.states is not None and small.states.num_slots == 4
    assert small.state_cache_bytes == 4 * small._slot_bytes
    prompt = np.array(PROMPT)

    def run(r: PagedRunner, sid: str, data: np.ndarray, start: int) -> np.ndarray:
        step = PagedStep(sid, data, start)
        r.place(step)
        return r.forward([step])[0]

    want = [run(runner, "a", prompt, 0), run(runner, "a", np.array([7]), 12)]
    got = [run(small, "a", prompt, 0)]
    others = 0
    with pytest.raises(BlocksExhausted, match="state slots exhausted"):
        while True:  # sessions until the slots run out
            free, used = small.states.free, small.blocks.used
            small.place(PagedStep(f"b{others}", prompt, 0))
            small.forward([PagedStep(f"b{others}", prompt, 0)])
            others += 1
    assert others == 1
    assert not small.has_session(f"b{others}") and small.states.free == free
    assert small.blocks.used == used
    for i in range(others):
        small.release(f"b{i}")
    got.append(run(small, "a", np.array([7]), 12))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6)
    small.release("a")
    assert small.states.used == 1  # the scratch slot

    cut = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_cache_bytes=1)
    # asked for 8: 4 slots hold one session at a window of 1 (3 slots) and the scratch slot
    assert cut.states is not None and cut.states.window == 1
    logits = run(cut, "a", prompt, 0)
    for i in range(12):  # one-token steps: each needs a slot beside the state it reads
        logits = run(cut, "a", np.array([int(np.argmax(logits[-1]))]), 12 + i)


@pytest.mark.component
def test_the_state_pool_is_sized_by_sessions_at_the_full_window(tiny_export: ExportFn) -> None:
    """By default a stage's state pool holds max_sessions sessions, at most 8, each at the full
    window (common.state_pool: window + 2 slots a session and the scratch slot); with
    state_sessions 3 at a window of 4 it holds exactly three sessions at their fullest (a
    verification of 4 proposals and a bonus position each, in one call: every slot taken),
    and they compute what each computes alone. Sessions and bytes together, or more sessions
    than max_sessions, are refused."""
    from shard_runtime.runner import RunnerOptions

    export = tiny_export("qwen3_5", 1)
    default = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL)
    assert default.states is not None and default.states.window == 8
    assert default.states.num_slots == pool_slots(8, 8) == 81
    few = PagedRunner(export, 0, replace(EXACT, max_sessions=2), kv_cache_bytes=POOL)
    assert few.states is not None and few.states.num_slots == pool_slots(2, 8) == 21
    runner = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_sessions=3, state_window=4)
    assert runner.states is not None and runner.states.num_slots == 3 * 6 + 1
    assert runner.state_cache_bytes == 19 * runner._slot_bytes
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, 9 + i) for i in range(3)]
    verify = [rng.integers(3, 250, 5) for _ in range(3)]

    def alone(i: int) -> np.ndarray:
        solo = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_window=4)
        for step in (PagedStep("s", prompts[i], 0), PagedStep("s", verify[i], len(prompts[i]), 5)):
            solo.place(step)
            out = solo.forward([step])[0]
        return out

    for i, prompt in enumerate(prompts):
        step = PagedStep(f"s{i}", prompt, 0)
        runner.place(step)
        runner.forward([step])
    steps = [PagedStep(f"s{i}", verify[i], len(prompts[i]), 5) for i in range(3)]
    for step in steps:
        runner.place(step)
    assert runner.states.free == 0  # three sessions at their fullest fill the pool
    for i, out in enumerate(runner.forward(steps)):
        np.testing.assert_allclose(out, alone(i), atol=1e-5)
    with pytest.raises(ValueError, match="sessions or its bytes, not both"):
        PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL, state_sessions=2, state_cache_bytes=1)
    with pytest.raises(ValueError, match=r"state_sessions must be 1 to max_sessions \(2\)"):
        PagedRunner(export, 0, RunnerOptions(max_sessions=2), state_sessions=3)


@pytest.mark.component
def test_pools_larger_than_the_memory_left_are_refused_at_start(tiny_export: ExportFn) -> None:
    """A state pool for more sessions than this machine's memory holds is refused before it
    is allocated, with the pools' sizes and the settings that set them."""
    export = tiny_export("qwen3_5", 1)
    left = available_memory()
    assert left is not None  # Linux: MemAvailable
    slot = PagedRunner(export, 0, EXACT, kv_cache_bytes=POOL)._slot_bytes
    # twice what is left now: other processes' memory may come and go before the check
    sessions = 2 * (left // (slot * slots_per_session(8))) + 1
    options = replace(EXACT, max_sessions=sessions)
    with pytest.raises(ValueError, match=r"GiB of linear-attention state slots \(--state-sessions"):
        PagedRunner(export, 0, options, kv_cache_bytes=POOL, state_sessions=sessions)


@pytest.mark.unit
def test_the_memory_left_is_the_least_of_the_kernels_and_the_cgroups(tmp_path: Path) -> None:
    """MemAvailable, less where a cgroup (v2, or v1's memory controller) limits the process;
    a cgroup without a limit, or files that are missing, leave it out."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 8000 kB\nMemAvailable:  4000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/unit\n")
    assert available_memory(proc, cgroup) == 4000 * 1024  # no cgroup files: MemAvailable
    (cgroup / "unit").mkdir(parents=True)
    (cgroup / "unit" / "memory.max").write_text("max\n")
    (cgroup / "unit" / "memory.current").write_text("100\n")
    assert available_memory(proc, cgroup) == 4000 * 1024
    (cgroup / "unit" / "memory.max").write_text("1000000\n")
    assert available_memory(proc, cgroup) == 1000000 - 100
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/\n")
    (cgroup / "memory" / "job").mkdir(parents=True)
    (cgroup / "memory" / "job" / "memory.limit_in_bytes").write_text("2000000\n")
    (cgroup / "memory" / "job" / "memory.usage_in_bytes").write_text("500000\n")
    assert available_memory(proc, cgroup) == 1500000
    assert available_memory(tmp_path / "none", cgroup) is None


@pytest.mark.component
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_padded_lone_rows_compute_the_same(tiny_export: ExportFn, arch: str) -> None:
    """Where one-row calls are padded to two (batch invariance), the pad row reads the real
    row's state and writes a scratch slot of its own (a copy of the row on MoE stages): the
    real row's logits are those of an unpadded stage, and the session's state is untouched."""
    export = tiny_export(arch, 2)
    padded = _Stages(export, kv_cache_bytes=POOL, pad_lone_rows=True)
    plain = _Stages(export, kv_cache_bytes=POOL, pad_lone_rows=False)
    assert all(r.pads_lone_rows for r in padded.runners)
    outs = []
    for stages in (padded, plain):
        logits = [stages.feed([PagedStep("s", np.array(PROMPT), 0)])[0][-1]]
        for i in range(6):
            token = np.array([int(np.argmax(logits[-1]))])
            logits.append(stages.feed([PagedStep("s", token, len(PROMPT) + i)])[0][-1])
        outs.append(np.stack(logits))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)


@pytest.fixture(scope="module")
def hybrid_with_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 on 2 stages with a draft of its own family (its weights plus noise)."""
    from exporter.export import ExportOptions, export_model
    from protos.manifest import WeightSpec
    from testing_support.tiny_models import make_draft, make_model

    base = tmp_path_factory.mktemp("hybrid-draft")
    target = make_model("qwen3_5", base / "target")
    draft = make_draft(target, base / "draft-model", noise=0.3)
    out = base / "export"
    export_model(
        ExportOptions(
            model=str(target),
            out=out,
            stages=2,
            weights=WeightSpec(format="fp32"),
            draft=str(draft),
            quiet=True,
        )
    )
    return out


@pytest.mark.component
def test_a_ring_of_paged_hybrid_stages_batches_and_speculates_exactly(
    hybrid_with_draft: Path, tmp_path: Path
) -> None:
    """Stage processes with --kv-backend auto serve a hybrid on the paged backend. Eight
    concurrent requests give each request's tokens alone; speculation with a hybrid draft
    (which runs on the paged backend too, rolling its proposals back) gives plain decoding's
    tokens (greedy), with proposals both accepted and rejected; seeded sampling with speculation
    gives plain sampling's tokens too, whatever K and the batching."""
    import asyncio

    from protos.sampling import SamplingParams
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.engine.speculative import DraftProposer, Proposer
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from tests.processes import start_stages

    export = hybrid_with_draft
    prompts = [[5 + i, 9, 13, 40 + i, 41, 42, 3 * i + 7, 12] * (1 + i % 3) for i in range(8)]
    procs, addresses = start_stages(export, tmp_path, extra=["--hidden-dtype", "fp32"])

    def generate(
        proposer: Proposer | None,
        sampling: SamplingParams,
        concurrent: bool,
        metrics: GatewayMetrics | None = None,
        spec_k: int = 4,
    ) -> tuple[list[list[int]], bool]:
        async def run() -> tuple[list[list[int]], bool]:
            client = PipelineClient(addresses)
            await client.start()
            engine = Engine(
                client,
                frozenset(),
                256,
                SchedulerConfig(prefill_chunk=5),
                metrics or GatewayMetrics(),
                proposer=proposer,
                spec_k=spec_k if proposer else 0,
            )

            async def one(i: int, prompt: list[int]) -> list[int]:
                request = GenerationRequest(f"r{i}", prompt, 24, sampling)
                return [t.token_id async for t in engine.generate(request)]

            try:
                if concurrent:
                    out = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
                    return list(out), client.paged
                return [await one(i, p) for i, p in enumerate(prompts)], client.paged
            finally:
                await engine.close()
                infos = await client.stage_infos()
                await client.close()
                assert [i.sessions_in_use for i in infos if i] == [0, 0]
                # every state slot given back (but a pad row's, where one-row calls are padded)
                assert all(0 <= i.state_slots - i.state_slots_free <= 1 for i in infos if i)
                assert all(i.state_slots > 0 for i in infos if i)

        return asyncio.run(run())

    greedy = SamplingParams()
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    try:
        alone, paged = generate(None, greedy, concurrent=False)
        assert paged  # auto chose the paged backend for the hybrid's stages
        assert generate(None, greedy, concurrent=True)[0] == alone
        proposer = DraftProposer(export / "draft", EXACT, 256)
        assert proposer.runner.states is not None  # the draft is a hybrid on PagedRunner
        metrics = GatewayMetrics()
        assert generate(proposer, greedy, concurrent=True, metrics=metrics)[0] == alone
        proposed = metrics.registry.get_sample_value("pipeshard_gateway_spec_proposed_tokens_total")
        accepted = metrics.registry.get_sample_value("pipeshard_gateway_spec_accepted_tokens_total")
        assert proposed and accepted is not None and 0 < accepted < proposed
        # seeded sampling with speculation: plain sampling's tokens, whatever K and the batching
        sampled = generate(None, seeded, concurrent=False)[0]
        assert generate(proposer, seeded, concurrent=False, spec_k=1)[0] == sampled
        assert generate(proposer, seeded, concurrent=True, spec_k=1)[0] == sampled
        assert generate(proposer, seeded, concurrent=True, spec_k=5)[0] == sampled
        assert len({tuple(t) for t in sampled}) == len(prompts)
        assert proposer.runner.session_count == 0
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.component
def test_a_cached_prefix_gives_the_uncached_tokens(tiny_export: ExportFn) -> None:
    """The prefix cache on paged hybrid stages, through the gateway over HTTP: a prompt's
    chunks keep the linear-attention state at their last full block's end beside the cached
    blocks. A prompt sharing the first's start beyond that block opens on the blocks and that
    state (visible in usage and the gateway's metrics) and gets the tokens (and their
    log-probabilities) of a gateway without the prefix cache; a prompt whose shared part ends
    before any kept state takes nothing from the cache."""
    from server.ring.local import LocalRing
    from tests.fleets import local_gateway

    export = tiny_export("qwen3_5", 2)
    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(3, 250, 75)]  # blocks 0 and 1 full, chunk of 75
    shared = [*first[:70], *(int(t) for t in rng.integers(3, 250, 9))]
    early = [*first[:40], *(int(t) for t in rng.integers(3, 250, 30))]  # inside block 1

    cached_ring = LocalRing(export, EXACT, hidden_dtype="fp32", kv_cache_bytes=POOL)
    plain_ring = LocalRing(export, EXACT, hidden_dtype="fp32", kv_cache_bytes=POOL)
    with (
        local_gateway(export, "hybrid", ring=cached_ring, prefill_chunk=75) as cached,
        local_gateway(
            export, "hybrid", ring=plain_ring, prefill_chunk=75, prefix_cache=False
        ) as plain,
    ):
        reply, hit = _complete(cached.url, first)
        assert hit == 0 and _same(reply, _complete(plain.url, first)[0])
        stage = cached_ring.chain.runners[0]
        assert isinstance(stage, PagedRunner) and stage.states is not None
        assert stage.states.cached >= 1  # the state at position 64
        for prompt, want in ((shared, 64), (early, 0)):
            got, hit = _complete(cached.url, prompt)
            assert hit == want
            assert _same(got, _complete(plain.url, prompt)[0])
        assert cached.metric("pipeshard_gateway_prompt_cached_tokens_total") == 64


def _complete(url: str, prompt: list[int]) -> tuple[list[tuple[str, float]], int]:
    """The tokens and their log-probabilities (which a wrong initial state changes where
    the tiny model's greedy tokens may not), and the cached prompt tokens."""
    reply = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": "Bearer test-key"},
        json={
            "model": "hybrid",
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    details = body["usage"].get("prompt_tokens_details") or {}
    logprobs = body["choices"][0]["logprobs"]
    tokens = list(zip(logprobs["tokens"], logprobs["token_logprobs"], strict=True))
    return tokens, int(details.get("cached_tokens") or 0)


def _same(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> bool:
    """The same tokens with the same log-probabilities (to rounding)."""
    return [t for t, _ in got] == [t for t, _ in want] and all(
        abs(a - b) < 1e-5 for (_, a), (_, b) in zip(got, want, strict=True)
    )


@pytest.mark.component
def test_sequences_the_state_pool_cannot_hold_are_preempted_and_resumed(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Stage processes whose state pools hold about three of six concurrent sequences and a
    gateway engine that counts no pools (as for stages that report none): the stages refuse
    the steps that find no slot (RESOURCE_EXHAUSTED), the gateway preempts those sequences and
    re-prefills them later, and every output equals the same request alone on stateful
    stages."""
    import asyncio

    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from tests.processes import start_stages

    export = tiny_export("qwen3_5", 2)
    chain = LocalChain(export, EXACT)
    prompts = [[5 + i, 9, 13, 40 + i, 41, 42, 3 * i + 7, 12] * (1 + i % 3) for i in range(6)]
    expected = [chain.greedy(f"p{i}", p, 24)[0] for i, p in enumerate(prompts)]
    window = 4
    slot = max(PagedRunner(export, k, EXACT, kv_cache_bytes=POOL)._slot_bytes for k in (0, 1))
    size = (3 * (window + 2) + 1) * slot / (1 << 30)
    flags = ["--hidden-dtype", "fp32", "--state-window", str(window)]
    procs, addresses = start_stages(
        export, tmp_path, [*flags, "--state-cache-size", f"{size:.12f}"]
    )
    metrics = GatewayMetrics()

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        engine = Engine(client, frozenset(), 256, SchedulerConfig(prefill_chunk=16), metrics)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = GenerationRequest(f"r{i}", prompt, 24)
            return [t.token_id async for t in engine.generate(request)]

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await engine.close()
            infos = await client.stage_infos()
            await client.close()
            assert [i.sessions_in_use for i in infos if i] == [0, 0]

    try:
        assert asyncio.run(run()) == expected
        assert metrics.registry.get_sample_value("pipeshard_gateway_preemptions_total")
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.component
def test_admission_waits_for_state_slots_instead_of_preempting(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Stage processes whose state pools hold three sessions (--state-sessions 3, at a window
    of 4) and a gateway engine configured as `pipeshard serve` configures it from the stages'
    Info: of six concurrent sequences three run and three wait in the queue until a session
    is freed (each of those gets its first token only after another sequence's last), no
    stage refuses a step (nothing is preempted), and every output equals the same request
    alone on stateful stages."""
    import asyncio

    from server.engine.loop import Engine, GenerationRequest
    from server.metrics import GatewayMetrics
    from server.ring.grpc_client import PipelineClient
    from server.settings import GatewaySettings
    from tests.processes import start_stages

    export = tiny_export("qwen3_5", 2)
    chain = LocalChain(export, EXACT)
    prompts = [[5 + i, 9, 13, 40 + i, 41, 42, 3 * i + 7, 12] * (1 + i % 3) for i in range(6)]
    expected = [chain.greedy(f"p{i}", p, 24)[0] for i, p in enumerate(prompts)]
    flags = ["--hidden-dtype", "fp32", "--state-window", "4", "--state-sessions", "3"]
    procs, addresses = start_stages(export, tmp_path, flags)
    metrics = GatewayMetrics()
    events: list[tuple[str, int]] = []  # ("first" | "last", request) in the order they came

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        # each stage: 3 x (4 + 2) slots for sessions beside its scratch slot, 6 a session
        assert client.state_pools == ((18, 6), (18, 6))
        settings = GatewaySettings(stages=addresses, prefill_chunk=16)
        config = settings.ring_scheduler_config(
            len(addresses),
            client.paged,
            client.kv_pools,
            client.prefix_block_size,
            client.state_pools,
        )
        engine = Engine(client, frozenset(), 256, config, metrics)

        async def one(i: int, prompt: list[int]) -> list[int]:
            tokens = []
            async for token in engine.generate(GenerationRequest(f"r{i}", prompt, 24)):
                tokens.append(token.token_id)
                if len(tokens) in (1, 24):
                    events.append(("first" if len(tokens) == 1 else "last", i))
            return tokens

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await engine.close()
            infos = await client.stage_infos()
            await client.close()
            assert [i.sessions_in_use for i in infos if i] == [0, 0]

    try:
        assert asyncio.run(run()) == expected
        assert metrics.registry.get_sample_value("pipeshard_gateway_preemptions_total") == 0
        first_end = events.index(next(e for e in events if e[0] == "last"))
        waited = [i for kind, i in events[first_end:] if kind == "first"]
        assert len(waited) >= 3, events
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.component
def test_a_ring_of_paged_hybrid_stages_serves_cached_prefixes_exactly(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Stage processes and gateway processes: a gateway with the prefix cache opens a prompt
    that shares a previous prompt's chunk on the stages' cached blocks and kept states (every
    stage acquires over gRPC), and answers as a gateway without the cache on the same stages,
    token for token and log-probability for log-probability."""
    from tests.processes import start_gateway, start_stages

    export = tiny_export("qwen3_5", 2)
    rng = np.random.default_rng(6)
    first = [int(t) for t in rng.integers(3, 250, 75)]
    shared = [*first[:70], *(int(t) for t in rng.integers(3, 250, 9))]
    procs, addresses = start_stages(export, tmp_path, ["--hidden-dtype", "fp32"])
    flags = ["--prefill-chunk", "75", "--model-name", "hybrid"]
    gateways = [
        start_gateway(addresses, tmp_path / f"gateway-{n}.log", [*flags, *extra])
        for n, extra in enumerate(([], ["--no-prefix-cache"]))
    ]
    (_, cached), (_, plain) = gateways
    try:
        reply, hit = _complete(cached, first)
        assert hit == 0 and _same(reply, _complete(plain, first)[0])
        got, hit = _complete(cached, shared)
        assert hit == 64
        assert _same(got, _complete(plain, shared)[0])
        metrics = httpx.get(f"{cached}/metrics").text
        assert "pipeshard_gateway_prompt_cached_tokens_total 64.0" in metrics
    finally:
        for gateway, _ in gateways:
            gateway.stop()
        for proc in procs:
            proc.stop()


@pytest.mark.component
def test_the_stage_reports_its_state_slots(tiny_export: ExportFn) -> None:
    """A hybrid paged stage's backend sets pipeshard_stage_state_slots (used, free) as its
    sessions take and give back slots."""
    from protos.step import StepRequest
    from stage_node.backend import PagedBackend, StepInput
    from stage_node.metrics import StageMetrics

    runner = PagedRunner(tiny_export("qwen3_5", 1), 0, EXACT, kv_cache_bytes=POOL)
    metrics = StageMetrics()
    backend = PagedBackend(runner, metrics)

    def gauge(state: str) -> float | None:
        return metrics.registry.get_sample_value("pipeshard_stage_state_slots", {"state": state})

    assert runner.states is not None
    assert (gauge("used"), gauge("free")) == (1, runner.states.num_slots - 1)
    out = backend.compute([StepInput(StepRequest("s", start_position=0), np.array(PROMPT))])
    assert not isinstance(out[0], Exception)
    assert gauge("used") == 2  # the session's latest state beside the scratch slot
    runner.release("s")
    backend.pool_metrics()
    assert gauge("used") == 1


@pytest.mark.component
def test_the_gateway_proposes_no_more_than_the_stages_roll_back(
    hybrid_with_draft: Path, tmp_path: Path
) -> None:
    """Stages that keep 2 positions of states (--state-window 2) and a gateway with a draft
    asked for 6 proposals a step: it proposes at most 2 (and says so), so every rejected
    proposal rolls back; the output equals a gateway's without speculation on the same
    stages. Its start says that the stages' state pools hold fewer sessions than it runs."""
    from tests.processes import start_gateway, start_stages

    export = hybrid_with_draft
    procs, addresses = start_stages(
        export, tmp_path, ["--hidden-dtype", "fp32", "--state-window", "2"]
    )
    flags = ["--model-name", "hybrid"]
    drafting = [*flags, "--draft", str(export / "draft"), "--spec-k", "6"]
    speculating, spec_url = start_gateway(addresses, tmp_path / "spec.log", drafting)
    plain, plain_url = start_gateway(
        addresses, tmp_path / "plain.log", [*flags, "--speculation", "off"]
    )
    try:
        for prompt in ([5, 17, 33, 99] * 6, [9, 8, 7] * 7):
            got = _complete(spec_url, prompt)[0]
            assert _same(got, _complete(plain_url, prompt)[0])
        log = (tmp_path / "spec.log").read_text()
        assert "speculation proposes at most 2 token(s)" in log
        # the stages' default state pools: 8 sessions (4 slots each at the window of 2)
        assert "state pools hold 8 session(s) at once (fewer than --max-concurrent 16)" in log
        metrics = httpx.get(f"{spec_url}/metrics").text
        proposed = [
            float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("pipeshard_gateway_spec_proposed_tokens_total ")
        ]
        assert proposed and proposed[0] > 0
    finally:
        speculating.stop()
        plain.stop()
        for proc in procs:
            proc.stop()


@pytest.mark.component
@pytest.mark.parametrize("chunks", [[40], [30, 5, 5]])
def test_a_session_acquired_on_a_kept_state_computes_as_one_fed_whole(
    tiny_export: ExportFn, chunks: list[int]
) -> None:
    """Runner level, both ways a prompt chunk keeps the state at its last full block's end (a
    long chunk writes it through la.cache_interval = block size, a short one stores every
    position and copies it): a second session acquired on that block starts from the state
    and its next logits equal a session fed everything, to the bit; a block whose end state
    was not kept is not acquired."""
    stages = _Stages(tiny_export("qwen3_5", 2), kv_cache_bytes=POOL)
    size = stages.runners[0].blocks.block_size
    assert size == 32
    rng = np.random.default_rng(7)
    prompt, rest = rng.integers(3, 250, 40), rng.integers(3, 250, 6)
    hashes = (b"block-0",)

    at = 0
    for count in chunks:
        named = hashes if at < size <= at + count else ()
        stages.feed([PagedStep("a", prompt[at : at + count], at, hashes=named)])
        at += count
    assert [r.acquire("b", [*hashes, b"block-1"]) for r in stages.runners] == [1, 1]
    tail = np.concatenate([prompt[size:], rest])
    got = stages.feed([PagedStep("b", tail, size, num_logits=len(tail))])[0]
    whole = np.concatenate([prompt, rest])
    want = stages.feed([PagedStep("c", whole, 0, num_logits=len(whole))])[0][size:]
    assert np.array_equal(got, want)
    assert [r.acquire("d", [b"unknown"]) for r in stages.runners] == [0, 0]


class _RestartFleet:
    """Two paged hybrid stage processes (``--hidden-dtype fp32``, exact) and gateways over
    them, by name; stage 1 can be killed and started again on its address."""

    def __init__(self, export: Path, logs: Path, gateways: dict[str, list[str]]) -> None:
        from tests.processes import start_gateway, start_stages

        self.export, self.logs = export, logs
        self.flags = ["--hidden-dtype", "fp32"]
        self.procs, self.addresses = start_stages(export, logs, self.flags)
        self.gateways = {
            name: start_gateway(self.addresses, logs / f"gateway-{name}.log", flags)
            for name, flags in gateways.items()
        }

    def restart(self, index: int) -> None:
        from tests.processes import start_stages

        port = int(self.addresses[index].rsplit(":", 1)[1])
        self.procs[index] = start_stages(
            self.export, self.logs, self.flags, ports=[port], stages=[index]
        )[0][0]

    def infos(self) -> list[tuple[int, int]]:
        """Each stage's sessions in use and state slots in use."""
        import asyncio

        from server.ring.grpc_client import PipelineClient

        async def ask() -> list[tuple[int, int]]:
            client = PipelineClient(self.addresses)
            await client.start()
            try:
                infos = await client.stage_infos()
            finally:
                await client.close()
            assert all(infos)
            return [(i.sessions_in_use, i.state_slots - i.state_slots_free) for i in infos if i]

        return asyncio.run(ask())

    def stop(self) -> None:
        for gateway, _ in self.gateways.values():
            gateway.stop()
        for proc in self.procs:
            proc.stop()


@pytest.fixture(scope="module")
def restart_fleets(
    hybrid_with_draft: Path, tiny_export: ExportFn, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], _RestartFleet]]:
    """A :class:`_RestartFleet` per architecture, started on first use: Qwen3.5 with a gateway
    without speculation ("plain") and one speculating with its hybrid draft ("draft"),
    Qwen3.5-MoE with a plain one."""
    fleets: dict[str, _RestartFleet] = {}
    plain = ["--model-name", "hybrid", "--speculation", "off"]

    def get(arch: str) -> _RestartFleet:
        if arch not in fleets:
            logs = tmp_path_factory.mktemp(f"restart-{arch}")
            if arch == "qwen3_5":
                draft = [
                    "--model-name", "hybrid", "--draft", str(hybrid_with_draft / "draft"),
                    "--spec-k", "4", "--speculation-max-users", "0",
                    "--draft-kv-cache-size", "0.05",
                ]  # fmt: skip
                gateways = {"plain": plain, "draft": draft}
                fleets[arch] = _RestartFleet(hybrid_with_draft, logs, gateways)
            else:
                fleets[arch] = _RestartFleet(tiny_export(arch, 2), logs, {"plain": plain})
        return fleets[arch]

    try:
        yield get
    finally:
        for fleet in fleets.values():
            fleet.stop()


class _Stream(threading.Thread):
    """A streamed completion read in a thread: its ``data:`` events; ``started`` is set after
    the 4th."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.events: list[str] = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream(
            "POST", f"{self.url}/v1/completions", json=self.body, timeout=120,
            headers={"Authorization": "Bearer test-key"},
        ) as reply:  # fmt: skip
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line)
                    if len(self.events) == 4:
                        self.started.set()

    def text(self) -> str:
        if not self.is_alive() and not self.events:
            self.start()
        self.join(120)
        assert not self.is_alive()
        chunks = [json.loads(e.removeprefix("data: ")) for e in self.events[:-1]]
        return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))

    def errors(self) -> list[str]:
        return [e for e in self.events if '"error"' in e]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("arch", "gateway"), [("qwen3_5", "plain"), ("qwen3_5", "draft"), ("qwen3_5_moe", "plain")]
)
def test_streams_on_paged_hybrid_stages_survive_a_stage_restart(
    restart_fleets: Callable[[str], _RestartFleet], arch: str, gateway: str
) -> None:
    """Stage processes of a hybrid on the paged backend: two streams (greedy, seeded sampling)
    mid-generation when stage 1 freezes, is killed and is started again on its address. Both
    re-prefill (prompt and generated tokens, on fresh sessions and state slots, stage 0's
    cached prompt blocks beside a restarted stage 1 that has none) and finish with the text of
    an uninterrupted run, without an error event; every session and state slot is given back
    on both stages. With a hybrid draft speculating too: a resumed draft session starts again,
    and its proposals change, but not the tokens kept."""
    from tests.processes import settled

    fleet = restart_fleets(arch)
    _, url = fleet.gateways[gateway]
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (40, 37)]  # past a block
    common = {"model": "hybrid", "max_tokens": 100, "stream": True, "ignore_eos": True}
    bodies = [
        {**common, "prompt": prompts[0], "temperature": 0},
        {**common, "prompt": prompts[1], "temperature": 0.9, "seed": 7},
    ]
    expected = [_Stream(url, body).text() for body in bodies]
    assert all(expected)
    resumed = _scrape(url, "pipeshard_gateway_resumed_total")

    streams = [_Stream(url, body) for body in bodies]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.started.wait(60)
    fleet.procs[1].signal(signal.SIGSTOP)
    # the streams' next steps are held by the frozen stage
    assert settled(lambda: _scrape(url, "pipeshard_gateway_steps_in_flight"), bool)
    fleet.procs[1].kill()
    fleet.restart(1)

    for n, stream in enumerate(streams):
        assert stream.text() == expected[n], bodies[n]
        assert not stream.errors(), stream.errors()
        assert stream.events[-1] == "data: [DONE]"
    # both were cut off and went on (neither had ended before the stage froze)
    assert _scrape(url, "pipeshard_gateway_resumed_total") == resumed + 2
    held = settled(fleet.infos, lambda found: found == [(0, 1), (0, 1)])
    # no session left on either stage, and no state slot but the stage's scratch slot
    assert held == [(0, 1), (0, 1)]


def _scrape(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
