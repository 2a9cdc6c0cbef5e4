"""Shard runner sessions: exact rollback, independence, and bad input that changes nothing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from shard_runtime.chain import LocalChain
from shard_runtime.paged import PagedRunner, PagedStep
from shard_runtime.runner import (
    CapacityExceeded,
    InvalidStageInput,
    RunnerOptions,
    SessionNotFound,
    ShardRunner,
)
from stage_node.server import warm_up
from tests.conftest import EXACT, ExportFn

pytestmark = pytest.mark.component

PROMPT = [5, 17, 33, 99, 100, 7, 42, 8, 61, 3]


def greedy_continue(chain: LocalChain, session: str, logits: np.ndarray, steps: int) -> list[int]:
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits = chain.forward(session, np.array(tokens[-1:]))
    return tokens


@pytest.mark.parametrize(("arch", "junk"), [("qwen2", 1), ("qwen2", 4), ("gemma3", 6)])
def test_rollback_equals_never_fed(tiny_export: ExportFn, arch: str, junk: int) -> None:
    chain = LocalChain(tiny_export(arch, 2), EXACT)
    clean = chain.forward("clean", np.array(PROMPT))
    expected = greedy_continue(chain, "clean", clean, 12)

    chain.forward("dirty", np.array(PROMPT[:4]))
    chain.forward("dirty", np.array(PROMPT[4:]))
    chain.forward("dirty", np.array([11, 12, 13, 14, 15, 16][:junk]))  # rejected draft tokens
    chain.rollback("dirty", junk)
    assert all(r.session_length("dirty") == len(PROMPT) for r in chain.runners)
    # Re-feed the last prompt token through a rollback of 1 as well: crosses a chunk boundary.
    chain.rollback("dirty", 1)
    dirty = chain.forward("dirty", np.array(PROMPT[-1:]))
    np.testing.assert_allclose(dirty[-1], clean[-1], atol=1e-5)
    assert greedy_continue(chain, "dirty", dirty, 12) == expected


def test_rollback_everything_then_reuse(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("llama", 2), EXACT)
    first = chain.forward("s", np.array(PROMPT))
    chain.rollback("s", len(PROMPT))
    again = chain.forward("s", np.array(PROMPT))
    np.testing.assert_allclose(first, again, atol=1e-6)


def test_sessions_are_independent(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("qwen2", 2), EXACT)
    alone = chain.forward("alone", np.array(PROMPT))
    chain.release("alone")
    chain.forward("other", np.array([1, 2, 3]))
    interleaved = chain.forward("mine", np.array(PROMPT[:5]))
    chain.forward("other", np.array([4, 5]))
    interleaved = chain.forward("mine", np.array(PROMPT[5:]))
    np.testing.assert_allclose(interleaved[-1], alone[-1], atol=1e-6)
    assert chain.runners[1].session_count == 2
    chain.release("mine")
    chain.release("other")
    assert all(r.session_count == 0 for r in chain.runners)


def test_num_logits_returns_trailing_rows(tiny_export: ExportFn) -> None:
    chain = LocalChain(tiny_export("qwen2", 1), EXACT)
    all_rows = chain.forward("a", np.array(PROMPT), num_logits=len(PROMPT))
    last = chain.forward("b", np.array(PROMPT), num_logits=1)
    assert all_rows.shape == (len(PROMPT), 256) and last.shape == (1, 256)
    np.testing.assert_allclose(all_rows[-1], last[0], atol=1e-6)


def test_bad_input_is_refused_and_changes_nothing(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("qwen2", 2)
    first = ShardRunner(export_dir, 0, EXACT)
    second = ShardRunner(export_dir, 1, EXACT)
    hidden = first.forward("s", np.array(PROMPT))
    assert hidden.shape == (len(PROMPT), 64) and hidden.dtype == np.float32
    logits = second.forward("s", hidden)

    bad_calls = [
        (InvalidStageInput, lambda: first.forward("s", np.array([[1, 2]]))),  # 2-D ids
        (InvalidStageInput, lambda: first.forward("s", np.array([1.5]))),  # float ids
        (InvalidStageInput, lambda: first.forward("s", np.array([999]))),  # outside vocab
        (InvalidStageInput, lambda: first.forward("s", np.array([], dtype=np.int64))),
        (InvalidStageInput, lambda: first.forward("s", np.array([1]), np.array([3]))),  # order
        (InvalidStageInput, lambda: second.forward("s", np.zeros((1, 63), np.float32))),
        (InvalidStageInput, lambda: second.forward("s", np.zeros((1, 64), np.int32))),
        (InvalidStageInput, lambda: second.forward("s", hidden[:1], num_logits=2)),
        (InvalidStageInput, lambda: first.rollback("s", -1)),
        (InvalidStageInput, lambda: first.rollback("s", len(PROMPT) + 1)),
        (SessionNotFound, lambda: first.rollback("nobody", 1)),
        (SessionNotFound, lambda: first.forward("nobody", np.array([1]), np.array([4]))),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
    assert first.session_length("s") == second.session_length("s") == len(PROMPT)
    assert not first.has_session("nobody")

    # The session still continues exactly as an untouched one.
    nxt = int(np.argmax(logits[-1]))
    got = second.forward("s", first.forward("s", np.array([nxt])))
    fresh_first, fresh_second = ShardRunner(export_dir, 0, EXACT), ShardRunner(export_dir, 1, EXACT)
    fresh_second.forward("t", fresh_first.forward("t", np.array(PROMPT)))
    want = fresh_second.forward("t", fresh_first.forward("t", np.array([nxt])))
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_capacity_limits(tiny_export: ExportFn) -> None:
    export_dir = tiny_export("qwen2", 1)
    runner = ShardRunner(export_dir, 0, RunnerOptions(max_sessions=2))
    runner.forward("a", np.array([1, 2]))
    runner.forward("b", np.array([1, 2]))
    with pytest.raises(CapacityExceeded):
        runner.forward("c", np.array([1, 2]))
    assert runner.release("a") and not runner.release("a")
    runner.forward("c", np.array([1, 2]))
    with pytest.raises(CapacityExceeded):  # the tiny models' maximum context is 256
        runner.forward("b", np.ones(255, dtype=np.int64))
    assert runner.session_length("b") == 2


def _resident_kib(paths: list[Path]) -> int | None:
    """This process's resident KiB of its mappings of ``paths`` (None: none mapped)."""
    names = {str(path) for path in paths}
    total, mapped, current = 0, False, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                current = len(parts) == 6 and parts[5] in names
                mapped = mapped or current
            elif current and parts[0] == "Rss:":
                total += int(parts[1])
    return total if mapped else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps")
@pytest.mark.parametrize(
    ("arch", "backend", "cached"),
    [
        ("qwen3_moe", "stateful", False),
        ("qwen3_moe", "paged", False),
        ("qwen2", "stateful", True),  # a cache hit maps the blob instead of model.bin
        ("qwen2", "paged", False),  # paged stages on CPU use no model cache (below)
    ],
)
def test_released_weight_pages_leave_the_output_unchanged(
    tiny_export: ExportFn, tmp_path: Path, arch: str, backend: str, cached: bool
) -> None:
    """The stage keeps OpenVINO's mapping of its weights file (model.bin, or on a model cache
    hit the cache blob) but computes from the plugin's own copies after the first inference:
    the warm-up leaves none of the file's pages resident in this process, and a session run
    after the release computes exactly what one run before it did."""
    export = tiny_export(arch, 2)
    options = dataclasses.replace(EXACT, cache_dir=tmp_path / "ov-cache" if cached else None)

    def load() -> ShardRunner | PagedRunner:
        if backend == "paged":
            return PagedRunner(export, 1, options, kv_cache_bytes=1 << 20)
        return ShardRunner(export, 1, options)

    if cached:
        load()  # compiles and writes the cache: the runner below imports it
    runner = load()
    mapped = [(export / runner.stage.model_xml).with_suffix(".bin").resolve()]
    if cached:
        mapped += [blob.resolve() for blob in (tmp_path / "ov-cache").iterdir()]
    hidden = np.random.default_rng(0).standard_normal((6, runner.input_width)).astype(np.float32)

    def run(session: str) -> np.ndarray:
        if isinstance(runner, PagedRunner):
            outs = []
            for start, chunk in ((0, hidden[:5]), (5, hidden[5:])):
                step = PagedStep(session, chunk, start)
                runner.place(step)
                outs.append(runner.forward([step])[0])
            runner.release(session)
            return np.concatenate([np.asarray(o).reshape(-1) for o in outs])
        first = runner.forward(session, hidden[:5], np.arange(5))
        second = runner.forward(session, hidden[5:], np.arange(5, 6))
        runner.release(session)
        return np.concatenate([first.reshape(-1), second.reshape(-1)])

    before = run("before")
    assert _resident_kib(mapped) is not None  # the compiled model keeps a mapping
    assert runner.release_weight_pages() > 0
    assert _resident_kib(mapped) == 0
    warm_up(runner)  # the stage server's: releases what its first inference read again
    assert _resident_kib(mapped) == 0
    np.testing.assert_array_equal(run("after"), before)


def test_paged_stages_on_cpu_write_no_model_cache_blob_that_no_start_could_load(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    """OpenVINO's CPU plugin cannot load a cached PagedAttention model (the blob loses the
    runtime info its PagedAttention nodes need): compiled twice with CACHE_DIR, the second
    compile is no cache hit. So a paged runner on CPU compiles without the cache instead of
    writing, at every start, a blob the size of its weights that nothing reads; a stateful
    runner keeps using it. When this test's first half fails, OpenVINO loads cached paged
    models: PagedRunner._compile_properties can keep CACHE_DIR again."""
    import openvino as ov

    from shard_runtime.paged import paged_model

    export = tiny_export("qwen2", 2)
    stateful = ShardRunner(export, 1, dataclasses.replace(EXACT, cache_dir=tmp_path / "stateful"))
    assert any((tmp_path / "stateful").iterdir())  # the stateful runner's blob
    xml = stateful.model_xml
    core = ov.Core()
    props = {**EXACT.compile_properties(), "CACHE_DIR": str(tmp_path / "direct")}
    loaded = []
    for _ in range(2):
        compiled = core.compile_model(paged_model(core.read_model(xml), False, True), "CPU", props)
        loaded.append(bool(compiled.get_property("LOADED_FROM_CACHE")))
    assert loaded == [False, False]
    assert any((tmp_path / "direct").iterdir())  # the blob was written all the same

    options = dataclasses.replace(EXACT, cache_dir=tmp_path / "paged")
    PagedRunner(export, 1, options, kv_cache_bytes=1 << 20)
    assert not (tmp_path / "paged").exists() or not any((tmp_path / "paged").iterdir())
