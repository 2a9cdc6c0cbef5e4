"""Stand-in exports (benchmarks/stand_in.py): the real graphs and small tensors, random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from benchmarks.stand_in import MARK, SCALE_RANGE, fill, is_stand_in, make, stand_in_label
from shard_runtime.chain import LocalChain
from tests.conftest import EXACT, ExportFn

pytestmark = pytest.mark.component

PROMPT = [5, 17, 33, 99, 100, 7, 42, 8]
MIN_BYTES = 512  # the tiny model's weight tensors are a few KiB


def test_a_stand_in_keeps_all_but_the_weights_and_runs(
    tiny_export: ExportFn, tmp_path: Path
) -> None:
    real = tiny_export("qwen2", 2, "int4")
    source = tmp_path / "real"
    shutil.copytree(real, source)
    (source / "draft").mkdir()  # an export's draft, left out of the stand-in
    (source / "draft" / "model.bin").write_bytes(b"draft")
    stand_in = tmp_path / "stand-in"
    mark = make(source, stand_in, MIN_BYTES, leave_out=("draft",))
    assert not (stand_in / "draft").exists()
    assert is_stand_in(stand_in) and not is_stand_in(source)
    assert stand_in_label(stand_in, "m").startswith("Stand-in for m")
    assert stand_in_label(source, "m") == "Real m"

    kinds = {kind for ranges in mark["tensors"].values() for _, _, kind in ranges}
    assert {"u4", "f16"} <= kinds, kinds  # int4 weights and their scales
    for rel, ranges in mark["tensors"].items():
        before, blank = (source / rel).read_bytes(), (stand_in / rel).read_bytes()
        assert len(blank) == len(before)
        kept = bytearray(before)
        for offset, size, _ in ranges:
            assert blank[offset : offset + size] == bytes(size)
            kept[offset : offset + size] = bytes(size)
        assert blank == bytes(kept)  # everything else as it was
    for name in ("manifest.json", "stage-0/model.xml", "tokenizer/tokenizer.json"):
        assert (stand_in / name).read_bytes() == (source / name).read_bytes()

    fill(stand_in, seed=3)
    assert json.loads((stand_in / MARK).read_text())["filled"] is True
    for rel, ranges in mark["tensors"].items():
        filled, before = (stand_in / rel).read_bytes(), (source / rel).read_bytes()
        for offset, size, kind in ranges:
            chunk = filled[offset : offset + size]
            if kind == "f16":
                values = np.frombuffer(chunk, np.float16)
                low, high = SCALE_RANGE
                assert values.min() >= np.float16(low) and values.max() <= np.float16(high)
                assert len(np.unique(values)) > 1
            else:  # random bytes, neither zero nor one repeated value
                assert len(set(chunk)) > min(size, 16) // 2
            assert chunk != before[offset : offset + size]

    prompt = np.array(PROMPT)
    ours = LocalChain(stand_in, EXACT).forward("s", prompt)
    theirs = LocalChain(real, EXACT).forward("s", prompt)
    assert ours.shape == theirs.shape and np.isfinite(ours).all()
    assert not np.allclose(ours, theirs)  # other weights, other logits
