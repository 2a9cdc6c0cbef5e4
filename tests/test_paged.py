"""The paged KV backend: block bookkeeping, step packing, and batched inference that changes
nothing about each session's output (f32 KV cache, token for token)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Iterator, Sequence
from pathlib import Path

import numpy as np
import openai
import pytest

from exporter.verify import reference_greedy
from protos import pipeshard_v1_pb2 as pb
from protos.sampling import SampledToken
from protos.step import StepRequest
from server.ring import NoCapacity, StepOutput
from server.ring.grpc_client import PipelineClient
from server.ring.local import LocalRing
from shard_runtime.chain import LocalChain
from shard_runtime.paged import BlockManager, BlocksExhausted, PagedRunner, PagedStep
from shard_runtime.runner import CapacityExceeded, RunnerOptions, ShardRunner
from stage_node.backend import PagedBackend, StatefulBackend, StepInput
from stage_node.downstream import pack, unpack
from stage_node.metrics import StageMetrics
from tests.conftest import EXACT, ExportFn
from tests.fleets import Fleet
from tests.processes import PIPESHARD, start_stages

PROMPTS = [[5 + i, 9, 13, 40 + i, 41, 42, 3 * i + 7, 12] * (1 + i % 3) for i in range(8)]


# -- the block manager -------------------------------------------------------------------------
@pytest.mark.unit
def test_blocks_grow_with_the_session_and_rollback_frees_trailing_blocks() -> None:
    blocks = BlockManager(num_blocks=6, block_size=4)
    blocks.open("a")
    blocks.grow("a", 5)  # 2 blocks
    assert (blocks.used, blocks.free) == (2, 4)
    blocks.tables["a"].length = 5
    blocks.grow("a", 8)  # still 2 blocks
    blocks.tables["a"].length = 8
    assert blocks.used == 2
    blocks.grow("a", 9)
    blocks.tables["a"].length = 9
    assert len(blocks.tables["a"].blocks) == 3
    blocks.truncate("a", 4)  # rollback: bookkeeping, the trailing 2 blocks come back
    assert (blocks.tables["a"].length, len(blocks.tables["a"].blocks), blocks.free) == (4, 1, 5)
    blocks.truncate("a", 0)
    assert blocks.free == 6 and blocks.tables["a"].blocks == []
    with pytest.raises(ValueError):
        blocks.truncate("a", 1)  # cannot grow by truncating


@pytest.mark.unit
def test_exhaustion_is_all_or_nothing_and_release_frees_at_once() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.open("a")
    blocks.open("b")
    blocks.grow("a", 5)  # 3 blocks
    with pytest.raises(BlocksExhausted) as caught:
        blocks.grow("b", 3)  # needs 2, 1 free
    assert isinstance(caught.value, CapacityExceeded)  # RESOURCE_EXHAUSTED on the wire
    assert "1 of 4 are free" in str(caught.value)
    assert blocks.tables["b"].blocks == [] and blocks.free == 1  # nothing taken
    assert blocks.release("a") and not blocks.release("a")
    blocks.grow("b", 8)
    assert blocks.free == 0
    assert sorted(blocks.tables["b"].blocks) == [0, 1, 2, 3]  # a's blocks were reused


@pytest.mark.unit
def test_blocks_of_sessions_never_overlap() -> None:
    rng = np.random.default_rng(0)
    blocks = BlockManager(num_blocks=32, block_size=3)
    lengths: dict[str, int] = {}
    for round_ in range(300):
        sid = f"s{rng.integers(8)}"
        if sid not in blocks.tables:
            blocks.open(sid)
            lengths[sid] = 0
        action = rng.integers(3)
        if action == 0:
            target = lengths[sid] + int(rng.integers(1, 7))
            try:
                blocks.grow(sid, target)
                lengths[sid] = blocks.tables[sid].length = target
            except BlocksExhausted:
                pass
        elif action == 1:
            lengths[sid] = int(rng.integers(0, lengths[sid] + 1))
            blocks.truncate(sid, lengths[sid])
        else:
            blocks.release(sid)
            del lengths[sid]
        held = [b for t in blocks.tables.values() for b in t.blocks]
        assert len(held) == len(set(held)) == blocks.used, round_
        for s, table in blocks.tables.items():
            assert len(table.blocks) == blocks.blocks_for(lengths[s])


@pytest.mark.unit
def test_prefix_blocks_are_shared_then_cached_then_evicted_oldest_first() -> None:
    blocks = BlockManager(num_blocks=6, block_size=4)
    h = [bytes([i]) * 16 for i in range(4)]
    blocks.open("a")
    blocks.grow("a", 10)
    blocks.tables["a"].length = 10
    with pytest.raises(ValueError, match="not all full"):
        blocks.publish("a", 1, h[1:3])  # block 2 holds positions 8-9 only
    blocks.publish("a", 0, h[:2])
    a_blocks = blocks.tables["a"].blocks[:2]
    blocks.release("a")
    assert (blocks.free, blocks.cached, blocks.used) == (6, 2, 0)  # cached blocks count free

    assert blocks.acquire("b", [h[0], h[1], h[2]]) == 2  # the run stops at the unknown hash
    assert blocks.tables["b"].blocks == a_blocks and blocks.tables["b"].length == 8
    assert blocks.acquire("c", [h[0], h[3]]) == 1  # block 0 now shared by b and c
    assert (blocks.used, blocks.cached, blocks.hits) == (2, 0, 3)
    with pytest.raises(ValueError, match="shared with another session"):
        blocks.truncate("c", 2)  # would write into b's block
    blocks.grow("c", 6)  # c goes on in a block of its own
    blocks.tables["c"].length = 6
    assert blocks.tables["c"].blocks[0] == a_blocks[0] and blocks.used == 3
    blocks.release("b")
    blocks.release("c")
    assert (blocks.free, blocks.cached) == (6, 2)

    # a second call with fewer hashes cuts an untouched session down, so every stage agrees
    assert blocks.acquire("d", h[:2]) == 2
    assert blocks.acquire("d", h[:1]) == 1 and blocks.cached == 1
    with pytest.raises(ValueError, match="already open"):
        blocks.acquire("d", [h[3]])
    blocks.release("d")

    blocks.open("e")
    blocks.grow("e", 24)  # every block: the cached ones are evicted, oldest first
    assert (blocks.free, blocks.cached, blocks.evictions) == (0, 0, 2)
    blocks.release("e")
    assert blocks.acquire("f", h[:1]) == 0


@pytest.mark.unit
def test_the_prefix_cache_keeps_at_most_its_size() -> None:
    h = [bytes([i]) * 16 for i in range(3)]
    for size, kept in ((None, 3), (1, 1), (0, 0)):
        blocks = BlockManager(num_blocks=4, block_size=2, max_cached=size)
        blocks.open("a")
        blocks.grow("a", 6)
        blocks.tables["a"].length = 6
        blocks.publish("a", 0, h)
        blocks.release("a")
        assert (blocks.cached, blocks.free) == (kept, 4)
        assert blocks.acquire("b", h) == kept


# -- packing steps on the wire -------------------------------------------------------------------
@pytest.mark.unit
def test_a_batch_packs_hidden_states_row_after_row() -> None:
    rows = [np.full((n, 4), i, dtype=np.float32) for i, n in enumerate([3, 1, 2])]
    steps = [pb.Step(session_id=f"s{i}", step_id=i) for i in range(4)]
    items = [(steps[0], rows[0]), (steps[1], rows[1]), (steps[2], None), (steps[3], rows[2])]
    batch = pack(items, np.dtype("float16"))
    assert [s.num_tokens for s in batch.steps] == [3, 1, 0, 2]
    assert list(batch.hidden.shape) == [6, 4]
    back = unpack(pb.StepBatch.FromString(batch.SerializeToString()), first=False)
    assert [s.session_id for s, _ in back] == ["s0", "s1", "s2", "s3"]
    for (_, data), expected in zip(back, [rows[0], rows[1], rows[0][:0], rows[2]], strict=True):
        assert isinstance(data, np.ndarray) and data.dtype == np.float16
        np.testing.assert_array_equal(data, expected)
    # rows that do not add up fail every step of the batch, and nothing else
    batch.steps[0].num_tokens = 4
    assert all(isinstance(d, Exception) for _, d in unpack(batch, first=False))
    tokens = unpack(pb.StepBatch(steps=[pb.Step(token_ids=[4, 5])]), first=True)
    assert tokens[0][1].tolist() == [4, 5]  # type: ignore[union-attr]


# -- one inference call for many sessions == each session alone ----------------------------------
def _steps(session: str, data: np.ndarray, start: int, **kw: object) -> StepInput:
    return StepInput(StepRequest(session, start_position=start, **kw), data)  # type: ignore[arg-type]


@pytest.mark.component
@pytest.mark.parametrize("stage", [0, 1])
def test_a_batched_call_equals_each_session_alone(tiny_export: ExportFn, stage: int) -> None:
    export = tiny_export("qwen2", 2)
    paged = PagedRunner(export, stage, EXACT, kv_cache_bytes=1 << 22)
    stateful = ShardRunner(export, stage, EXACT)
    batched = PagedBackend(paged, StageMetrics())
    alone = StatefulBackend(stateful, StageMetrics())
    rng = np.random.default_rng(stage)

    def chunk(n: int) -> np.ndarray:
        if stage == 0:
            return rng.integers(3, 250, n)
        return rng.standard_normal((n, paged.hidden_size)).astype(np.float32)

    lengths = {f"s{i}": 0 for i in range(5)}
    # rounds mixing prefill chunks, decode tokens, rollbacks and sessions joining late
    plan = [
        {"s0": 40, "s1": 7},
        {"s0": 1, "s1": 33, "s2": 5},
        {"s0": 1, "s1": 1, "s2": 1, "s3": 70},
        {"s0": (3, 2), "s2": 1, "s3": 1, "s4": 1},  # s0 rolls back 2 and feeds 3
        {"s0": 1, "s1": 1, "s2": 1, "s3": 1, "s4": 1},
    ]
    for round_ in plan:
        batch = []
        for sid, spec in round_.items():
            count, rollback = spec if isinstance(spec, tuple) else (spec, 0)
            lengths[sid] -= rollback
            num_logits = min(count, 2)
            batch.append(
                _steps(sid, chunk(count), lengths[sid], rollback=rollback, num_logits=num_logits)
            )
            lengths[sid] += count
        got = batched.compute(batch)
        want = alone.compute(batch)
        for g, w in zip(got, want, strict=True):
            assert not isinstance(g, Exception), g
            if stage == 0:
                np.testing.assert_allclose(g, w, atol=2e-5)  # type: ignore[arg-type]
            else:  # the last stage sampled greedily: the same tokens
                assert [t.token_id for t in g] == [t.token_id for t in w]  # type: ignore[union-attr]
                assert all(isinstance(t, SampledToken) for t in g)  # type: ignore[union-attr]
        for sid, length in lengths.items():
            if paged.has_session(sid):
                assert paged.session_length(sid) == stateful.session_length(sid) == length
    used = paged.blocks.used
    assert used == sum(paged.blocks.blocks_for(n) for n in lengths.values())
    for sid in lengths:
        paged.release(sid)
    assert paged.blocks.free == paged.blocks.num_blocks


@pytest.mark.component
def test_a_step_that_does_not_fit_fails_alone(tiny_export: ExportFn) -> None:
    export = tiny_export("qwen2", 2)
    paged = PagedRunner(export, 0, EXACT, kv_cache_bytes=1)  # the smallest pool: one block
    backend = PagedBackend(paged, StageMetrics())
    size = paged.blocks.block_size
    out = backend.compute([_steps("a", np.arange(3, 3 + size), 0), _steps("b", np.arange(3, 5), 0)])
    assert isinstance(out[0], np.ndarray) and isinstance(out[1], BlocksExhausted)
    assert not paged.has_session("b")  # the failed step left nothing behind
    again = backend.compute([_steps("a", np.array([7]), size)])  # a needs a second block
    assert isinstance(again[0], BlocksExhausted) and paged.session_length("a") == size
    paged.rollback("a", 1)
    assert isinstance(backend.compute([_steps("a", np.array([7]), size - 1)])[0], np.ndarray)


# -- batch invariance: a row's numbers do not depend on the rest of its call ---------------------
@pytest.mark.component
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_bit_identical_whatever_else_shares_the_call(
    tiny_export: ExportFn, threads: int
) -> None:
    """A verification of k positions equals k decodes, and a decode batched with another
    session's prefill equals the decode alone, bit for bit, with the default (noisy) CPU
    options on int4 weights: dynamic activation quantization, f16 KV cache."""
    export = tiny_export("qwen2", 2, "int4")
    options = RunnerOptions(threads=threads)
    runners = [PagedRunner(export, k, options, kv_cache_bytes=1 << 22) for k in (0, 1)]
    rng = np.random.default_rng(threads)
    prompt, cont = rng.integers(3, 250, 37), rng.integers(3, 250, 6)

    def feed(steps: list[PagedStep]) -> list[np.ndarray]:
        outs = []
        for runner in runners:
            for step in steps:
                runner.place(step)
            outs = runner.forward(steps)
            steps = [
                PagedStep(s.session_id, o.astype(np.float32), s.start, s.num_logits)
                for s, o in zip(steps, outs, strict=True)
            ]
        return outs  # the last stage's logits

    feed([PagedStep("decoded", prompt, 0)])
    decoded = np.concatenate(
        [feed([PagedStep("decoded", cont[i : i + 1], 37 + i)])[0] for i in range(len(cont))]
    )
    feed([PagedStep("verified", prompt, 0)])
    verified = feed([PagedStep("verified", cont, 37, num_logits=len(cont))])[0]
    assert np.array_equal(verified, decoded)

    feed([PagedStep("batched", prompt, 0)])
    batched = feed(
        [PagedStep("batched", cont[:1], 37), PagedStep("other", rng.integers(3, 250, 9), 0)]
    )[0]
    assert np.array_equal(batched, decoded[:1])
    for runner in runners:
        for sid in ("decoded", "verified", "batched", "other"):
            runner.release(sid)
        assert runner.blocks.free == runner.blocks.num_blocks


@pytest.mark.component
@pytest.mark.parametrize("threads", [1, 2])
def test_a_solo_step_is_not_padded_and_equals_the_raw_one_row_call(
    tiny_export: ExportFn, threads: int
) -> None:
    """A solo step (the gateway without batching) is computed as it is, one row, even where
    the stage pads lone rows of other steps: bit for bit what a stage without batch invariance
    computes for the same row alone."""
    export = tiny_export("qwen2", 2, "int4")
    invariant = [PagedRunner(export, k, RunnerOptions(threads=threads)) for k in (0, 1)]
    raw = [
        PagedRunner(export, k, RunnerOptions(threads=threads, batch_invariant=False))
        for k in (0, 1)
    ]
    rng = np.random.default_rng(threads)
    prompt, cont = rng.integers(3, 250, 21), rng.integers(3, 250, 4)

    def feed(runners: list[PagedRunner], sid: str, data: np.ndarray, start: int, solo: bool):
        steps = [PagedStep(sid, data, start, solo=solo)]
        for runner in runners:
            runner.place(steps[0])
            (out,) = runner.forward(steps)
            steps = [PagedStep(sid, out.astype(np.float32), start, solo=solo)]
        return out

    logits = {}
    for name, runners, solo in (
        ("solo", invariant, True),
        ("raw", raw, False),
        ("pad", invariant, False),
    ):
        feed(runners, name, prompt, 0, solo)
        logits[name] = np.concatenate(
            [feed(runners, name, cont[i : i + 1], 21 + i, solo) for i in range(len(cont))]
        )
    assert np.array_equal(logits["solo"], logits["raw"])
    if not any(r.pads_lone_rows for r in invariant):  # nothing padded: all three agree
        assert np.array_equal(logits["pad"], logits["raw"])


@pytest.mark.component
@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_a_lone_row_on_an_moe_stage_is_padded_with_a_copy_of_itself(
    tiny_export: ExportFn, arch: str
) -> None:
    """On a stage with MoE layers a lone row's pad row is a copy of the row (same input,
    position and past), so it routes to the same experts instead of paying for its own: the
    pad row's hidden states equal the row's. The row's numbers are bit for bit those of the
    other pad (a token at position 0) and those of the same row batched with another session's,
    at every position, across KV blocks."""
    export = tiny_export(arch, 2)
    options = RunnerOptions(threads=2)
    copying = [PagedRunner(export, k, options, pad_lone_rows=True) for k in (0, 1)]
    assert all(r.pads_lone_rows and r._pad_with_copy for r in copying)
    zeros = [PagedRunner(export, k, options, pad_lone_rows=True) for k in (0, 1)]
    for runner in zeros:
        runner._pad_with_copy = False  # the pad row of a dense stage
    rng = np.random.default_rng(3)
    prompt, cont = rng.integers(3, 250, 29), rng.integers(3, 250, 38)

    def feed(runners: list[PagedRunner], steps: list[PagedStep]) -> tuple[np.ndarray, np.ndarray]:
        """The last stage's logits of the first step, and stage 0's every output row."""
        for runner in runners:
            for step in steps:
                runner.place(step)
            outs = runner.forward(steps)
            if runner is runners[0]:
                rows = np.asarray(runner.request.get_output_tensor(0).data).copy()
            steps = [
                PagedStep(s.session_id, o.astype(np.float32), s.start, s.num_logits)
                for s, o in zip(steps, outs, strict=True)
            ]
        return outs[0], rows.reshape(-1, rows.shape[-1])

    logits: dict[str, list[np.ndarray]] = {"copy": [], "zeros": [], "batched": []}
    for name, runners in (("copy", copying), ("zeros", zeros), ("batched", zeros)):
        feed(runners, [PagedStep(name, prompt, 0)])
    for i, token in enumerate(cont):
        position = len(prompt) + i
        out, rows = feed(copying, [PagedStep("copy", np.array([token]), position)])
        assert rows.shape[0] == 2 and np.array_equal(rows[0], rows[1])  # the same experts
        logits["copy"].append(out)
        out, rows = feed(zeros, [PagedStep("zeros", np.array([token]), position)])
        assert rows.shape[0] == 2 and not np.array_equal(rows[0], rows[1])
        logits["zeros"].append(out)
        other = PagedStep(f"other{i}", rng.integers(3, 250, 1 + i % 3), 0)
        out, _ = feed(zeros, [PagedStep("batched", np.array([token]), position), other])
        logits["batched"].append(out)
        for runner in zeros:
            runner.release(other.session_id)
    assert np.array_equal(np.concatenate(logits["copy"]), np.concatenate(logits["zeros"]))
    assert np.array_equal(np.concatenate(logits["copy"]), np.concatenate(logits["batched"]))


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode", [[], ["--side-by-side", "--stateful"]], ids=["one-process", "side-by-side-stateful"]
)
def test_batch_cost_benchmark_times_each_stage_and_says_whether_it_pads(
    tiny_export: ExportFn, tmp_path: Path, mode: list[str]
) -> None:
    import json
    import subprocess

    export = tiny_export("qwen2", 2, "int4")
    subprocess.run(
        [PIPESHARD, "bench", "batch-cost", "--export", str(export),
         "--rows", "1,2", "--steps", "2", "--rounds", "1", "--results", str(tmp_path), *mode],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    (report,) = tmp_path.glob("batch_cost-*.md")
    (data,) = tmp_path.glob("batch_cost-*.json")
    assert report.read_text().startswith("Command: `pipeshard bench batch-cost ")
    assert "the split that evens them out: `--split " in report.read_text()
    result = json.loads(data.read_text())
    assert sum(result["suggested_split"]) == pytest.approx(6)
    stages = result["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    for stage in stages:
        assert set(stage["ms"]) == {"1", "2"} and all(v > 0 for v in stage["ms"].values())
        # the benchmark's answer is the runner's own: a batch-invariant runner pads exactly then
        options = RunnerOptions(threads=1)  # the benchmark's --threads
        runner = PagedRunner(export, stage["stage"], options, kv_cache_bytes=1 << 22)
        assert stage["pads_one_row_calls"] == (runner.pads_lone_rows)
        # --stateful: the stateful backend's one-row call, timed in the same rounds
        assert ("stateful_ms" in stage) == ("--stateful" in mode)
        assert stage.get("stateful_ms", 1) > 0
    assert ("| stateful 1 row: ms (x paged 1 row) |" in report.read_text()) == (
        "--stateful" in mode
    )


@pytest.mark.integration
def test_batch_cost_side_by_side_reports_a_failing_stage_instead_of_waiting(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """A stage whose process fails (here its weights are cut short) ends the side-by-side run
    with that stage's error, while the other stage waits at the barrier: no hang."""
    import shutil
    import subprocess

    export = tmp_path / "export"
    shutil.copytree(tiny_export("qwen2", 2, "int4"), export)
    weights = export / "stage-1" / "model.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    run = subprocess.run(
        [PIPESHARD, "bench", "batch-cost", "--export", str(export),
         "--rows", "1", "--steps", "1", "--rounds", "1", "--results", str(tmp_path),
         "--side-by-side", "--stateful"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode != 0
    assert "RuntimeError: stage 1: " in run.stderr, run.stderr[-2000:]
    assert not list(tmp_path.glob("batch_cost-*"))


@pytest.mark.unit
def test_the_suggested_split_evens_out_the_measured_stage_times() -> None:
    from benchmarks.batch_cost import suggested_split

    # stage 0: 18 layers at 5 ms; stage 1: 10 layers and a 20 ms head -> 16 + 12 layers = 80 ms
    assert suggested_split([18, 10], [90.0, 70.0]) == [16.0, 12.0]
    assert suggested_split([16, 12], [80.0, 80.0]) == [16.0, 12.0]
    # 3 stages at 1 ms a layer, the last with a 10 ms head: 40 ms in all, 13.33 ms each
    assert suggested_split([10, 10, 10], [10.0, 10.0, 20.0]) == [13.33, 13.33, 3.34]


# -- real stage processes ---------------------------------------------------------------------
@pytest.mark.integration
@pytest.mark.parametrize("stages", [2, 3])
def test_eight_concurrent_sessions_on_paged_stages_equal_transformers(
    tiny_model: object, tiny_export: ExportFn, stages: int, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    export = tiny_export("qwen2", stages)
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model("qwen2"))).eval()  # type: ignore[operator]
    expected = [reference_greedy(reference, p, 12)[0] for p in PROMPTS]
    chain = LocalChain(export, EXACT)  # the stateful backend, each request alone
    assert [chain.greedy(f"p{i}", p, 12)[0] for i, p in enumerate(PROMPTS)] == expected
    procs, addresses = start_stages(export, tmp_path, ["--kv-backend", "paged"])

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()

        async def one(i: int, prompt: list[int]) -> list[int]:
            out = await client.step(f"s{i}", prompt, 0)
            tokens = [out.tokens[0].token_id]
            while len(tokens) < 12:
                out = await client.step(f"s{i}", tokens[-1:], len(prompt) + len(tokens) - 1)
                tokens.append(out.tokens[0].token_id)
            return tokens

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
        finally:
            await client.release(*(f"s{i}" for i in range(len(PROMPTS))))
            infos = await client.stage_infos()
            await client.close()
            assert all(i is not None and i.kv_backend == "paged" for i in infos)
            assert [i.sessions_in_use for i in infos if i] == [0] * stages
            assert [i.kv_blocks_free for i in infos if i] == [i.kv_blocks for i in infos if i]

    try:
        assert asyncio.run(run()) == expected
    finally:
        for proc in procs:
            proc.stop()


# -- the gateway over paged stages: batching, preemption, speculation -----------------------------
def _block_bytes(export: Path, stage: int) -> int:
    return PagedRunner(export, stage, EXACT, kv_cache_bytes=1).kv_cache_bytes  # one block


@contextlib.contextmanager
def _small_pool_fleet(
    tmp_path: Path, blocks: int, gateway_flags: Sequence[str] = ()
) -> Iterator[Fleet]:
    """The chat model on two paged stages whose pools hold ``blocks`` blocks of 32 positions
    each, behind a gateway started with ``gateway_flags``."""
    from tests.fleets import export_chat_model
    from tests.processes import start_gateway

    _, export = export_chat_model(tmp_path)
    # half a block more, so that rounding the GiB figure cannot cost a block
    size = (blocks + 0.5) * max(_block_bytes(export, 0), _block_bytes(export, 1)) / (1 << 30)
    procs, addresses = start_stages(
        export, tmp_path, ["--kv-backend", "paged", "--kv-cache-size", f"{size:.12f}"]
    )
    gateway, url = start_gateway(addresses, tmp_path / "gateway.log", list(gateway_flags))
    try:
        yield Fleet(url, stages=addresses)
    finally:
        gateway.stop()
        for proc in procs:
            proc.stop()


@pytest.mark.integration
def test_gateway_over_small_paged_pools_preempts_and_every_stream_is_unchanged(
    tmp_path: Path,
) -> None:
    """8 concurrent streams (greedy and seeded sampling) on stages whose pools hold about two
    of them: the gateway preempts and resumes, and every text equals the request alone; with
    the prefix cache, no step is refused and every block ends free or cached.

    Prompts of 1-3 blocks of 32 positions in a pool of 8, each growing by two blocks: the
    pool fills up at admission (any two prompts fit), so decoding must preempt."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.clients import request, stream_text

    with _small_pool_fleet(tmp_path, 8, ["--prefill-chunk", "16"]) as fleet:
        bodies = [{**request(i), "max_tokens": 64} for i in range(8)]
        alone = [stream_text(fleet, body) for body in bodies]
        assert len(set(alone)) > 4 and all(alone)
        assert fleet.metric("pipeshard_gateway_preemptions_total") == 0
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda b: stream_text(fleet, b), bodies))
        assert together == alone
        assert fleet.metric("pipeshard_gateway_preemptions_total") > 0
        # the prompts' blocks, cached by the requests alone, opened sessions (prefix cache),
        # and the gateway's accounting never let a stage refuse a step
        assert fleet.metric("pipeshard_gateway_prompt_cached_tokens_total") > 0
        assert "preempted: " not in (tmp_path / "gateway.log").read_text()
        fleet.wait_metric("pipeshard_gateway_requests_running", 0)

        async def pools() -> list[tuple[int, int, int]]:
            client = PipelineClient(fleet.stages)
            await client.start()
            infos = await client.stage_infos()
            await client.close()
            return [(i.sessions_in_use, i.kv_blocks_free, i.kv_blocks) for i in infos if i]

        deadline = 50
        while (state := asyncio.run(pools())) and any(s[0] for s in state) and deadline:
            deadline -= 1  # releases are sent after the streams end
        assert all(used == 0 and free == total == 8 for used, free, total in state), state


@pytest.mark.integration
def test_pools_smaller_than_the_models_context_bound_every_request(tmp_path: Path) -> None:
    """Stages whose pools hold 128 positions under a model context of 256: the gateway says
    so at start, a request that could not fit gets the context-length 400 at once (not a
    refusal per step), and one without max_tokens generates up to the pool, not beyond it."""
    from tests.clients import request

    with _small_pool_fleet(tmp_path, 4) as fleet:
        client = fleet.client()
        log = (tmp_path / "gateway.log").read_text()
        assert "KV pools hold 128 positions, fewer than the model's context of 256" in log
        long = request(7)  # an 89-token prompt
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(**{**long, "max_tokens": 64})
        assert raised.value.code == "context_length_exceeded"
        assert "maximum context length is 128 tokens" in str(raised.value)
        del long["max_tokens"]
        reply = client.chat.completions.create(**long)
        assert reply.usage is not None and reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 128


@pytest.mark.integration
def test_a_gateway_unaware_of_the_pools_retries_refused_steps(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """Without pool accounting (as with a second gateway on the same stages) the stages
    refuse steps that do not fit; each refused sequence is preempted and resumed, and every
    output equals the same request alone on stateful stages."""
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig
    from server.metrics import GatewayMetrics

    export = tiny_export("qwen2", 2)
    chain = LocalChain(export, EXACT)
    prompts = PROMPTS[:6]
    expected = [chain.greedy(f"p{i}", p, 40)[0] for i, p in enumerate(prompts)]
    size = 6 * _block_bytes(export, 0) / (1 << 30)  # 6 blocks of 32: about 3 sequences
    procs, addresses = start_stages(
        export, tmp_path, ["--kv-backend", "paged", "--kv-cache-size", f"{size:.12f}"]
    )

    metrics = GatewayMetrics()

    async def run() -> list[list[int]]:
        client = PipelineClient(addresses)
        await client.start()
        config = SchedulerConfig(groups=2, prefill_chunk=16)  # no kv_pools: no accounting
        engine = Engine(client, frozenset(), 256, config, metrics)

        async def one(i: int, prompt: list[int]) -> list[int]:
            request = GenerationRequest(f"r{i}", prompt, 40)
            return [t.token_id async for t in engine.generate(request)]

        try:
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
        finally:
            await engine.close()
            infos = await client.stage_infos()
            await client.close()
            assert [(i.sessions_in_use, i.kv_blocks_free) for i in infos if i] == [(0, 6)] * 2

    try:
        assert asyncio.run(run()) == expected
        # the only preemptions without accounting are the stages' refusals
        assert metrics.registry.get_sample_value("pipeshard_gateway_preemptions_total")
    finally:
        for proc in procs:
            proc.stop()


class _RefusalCountingRing(LocalRing):
    """The in-process ring on small paged pools, counting the steps its stages refuse."""

    def __init__(self, export: Path, blocks: int) -> None:
        size = max(_block_bytes(export, 0), _block_bytes(export, 1))
        super().__init__(export, EXACT, kv_cache_bytes=int((blocks + 0.5) * size))
        self.refused: list[str] = []

    async def steps(
        self, step: StepRequest, timeout: float | None = None
    ) -> AsyncGenerator[StepOutput, None]:
        try:
            async for out in super().steps(step, timeout):
                yield out
        except NoCapacity as exc:
            self.refused.append(str(exc))
            raise


@pytest.mark.component
@pytest.mark.parametrize("ring_decode", [0, 4])
def test_the_gateways_block_accounting_never_lets_a_stage_refuse_a_step(
    tiny_export: ExportFn, ring_decode: int
) -> None:
    """Six sequences on in-process stages whose pools hold about two of them, the gateway
    counting the blocks: it preempts, and no stage ever refuses a step. Its accounting must
    not run ahead of the stages': a preempted or finished sequence's blocks are free only once
    its release has reached the stages (the next steps may reach them first), and the decode
    steps the ring makes on its own (ring_decode) claim their positions before they go out.
    Every output equals the sequence alone."""
    from server.engine.loop import Engine, GenerationRequest
    from server.engine.scheduler import SchedulerConfig

    export = tiny_export("qwen2", 2)
    ring = _RefusalCountingRing(export, 4)
    (block, _), *_ = ring.kv_pools
    prompts = [p[: block - 4] * 2 for p in PROMPTS[:6]]  # each grows to 2-3 blocks
    config = SchedulerConfig(
        max_running=6,
        groups=1,
        lockstep=True,
        ring_decode=ring_decode,
        prefill_chunk=16,
        max_prefill_in_flight=6,
        busy_prefill_chunk=16,
        kv_pools=ring.kv_pools,
    )

    async def run() -> tuple[list[list[int]], list[list[int]], int]:
        engine = Engine(ring, frozenset(), 256, config)

        async def one(i: int) -> list[int]:
            request = GenerationRequest(f"r{i}", prompts[i], block + 8)
            return [t.token_id async for t in engine.generate(request)]

        try:
            alone = [await one(i) for i in range(len(prompts))]
            together = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            return alone, list(together), engine.scheduler.preemptions
        finally:
            await engine.close()
            await ring.close()

    alone, together, preemptions = asyncio.run(run())
    assert together == alone
    assert preemptions > 0  # the pools were too small for all of them at once
    assert ring.refused == []
    assert all(r.session_count == 0 for r in ring.chain.runners)
