"""Stand-in models: an export's graphs with random weights, to time it on a host it cannot reach.

A benchmark host may take only a few tens of megabytes (a lent machine with no network, say),
while the real 1.5B int4 shards weigh a gigabyte. Decode time does not depend on the weights'
values: the int4/int8 kernels decompress and multiply every weight alike. So a stand-in keeps
everything of a real export or optimum-cli folder (graphs, manifest, tokenizer, every tensor
under ``--min-bytes``: norms, biases, shapes) and blanks the large weight tensors (u4/i4/u8/i8
weights and zero points, f16/bf16/f32 scales); blanked, they compress to almost nothing.
``fill`` then writes random values into them on the benchmark host: random bytes for the
integer tensors, uniform [0.003, 0.006] for the float ones (the size of int4 scales, so that
activations stay finite over every layer, also in fp16). Not zeros or one repeated value:
OpenVINO folds or specialises constants whose elements are all equal (a zero point of 0, a
scale of 1).

The outputs are meaningless (random tokens) and their cost is the real model's: the benchmarks
that time stand-ins say so in their reports (``stand_in.json`` marks the folder). Measure the
stand-in next to the real model once on a host that has both (``compare``).

Usage: pipeshard bench stand-in make SRC DST     # here: blank a copy (then tar -cJ it)
       pipeshard bench stand-in fill DST         # there: random weights in place
       pipeshard bench stand-in compare REAL STAND_IN [--cores 0] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np

MARK = "stand_in.json"
# the IRs whose weights are blanked; tokenizer IRs (their vocabularies are u8 constants) are not
MODEL_NAMES = ("model.xml", "openvino_model.xml")
INTEGER = {"u4", "i4", "u8", "i8"}
FLOAT = {"f16", "f32", "bf16"}
SCALE_RANGE = (0.003, 0.006)


def weight_ranges(xml: Path, min_bytes: int) -> list[tuple[int, int, str]]:
    """(offset, size, element type) of the IR's constants of at least ``min_bytes`` that a
    stand-in blanks."""
    found = []
    for layer in ET.parse(xml).getroot().iter("layer"):
        data = layer.find("data")
        if layer.get("type") != "Const" or data is None:
            continue
        kind, size = data.get("element_type", ""), int(data.get("size", "0"))
        if size >= min_bytes and (kind in INTEGER or kind in FLOAT):
            found.append((int(data.get("offset", "0")), size, kind))
    return sorted(found)


def is_stand_in(folder: Path) -> bool:
    return (folder / MARK).is_file()


def stand_in_label(folder: Path, model_id: str) -> str:
    """How a report names the model in ``folder``."""
    if not is_stand_in(folder):
        return f"Real {model_id}"
    return (
        f"Stand-in for {model_id} (its export's graphs and small tensors, random large weights: "
        "the same cost, meaningless text; pipeshard bench stand-in)"
    )


def make(
    src: Path, dst: Path, min_bytes: int = 65536, leave_out: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Copy ``src`` to ``dst`` with every model IR's large weights zeroed, without the top-level
    entries named in ``leave_out`` (e.g. an export's draft); returns the mark."""
    if dst.exists():
        raise SystemExit(f"{dst} exists")
    shutil.copytree(
        src,
        dst,
        ignore=lambda folder, names: [
            n for n in names if n.endswith(".bin") or (Path(folder) == src and n in leave_out)
        ],
    )
    mark: dict[str, Any] = {"source": src.name, "filled": False, "tensors": {}}
    for bin_src in sorted(src.rglob("*.bin")):
        rel = bin_src.relative_to(src)
        if rel.parts[0] in leave_out:
            continue
        xml = bin_src.with_suffix(".xml")
        if xml.name not in MODEL_NAMES or not xml.is_file():
            shutil.copyfile(bin_src, dst / rel)
            continue
        ranges = weight_ranges(xml, min_bytes)
        with bin_src.open("rb") as inp, (dst / rel).open("wb") as out:
            at = 0
            for offset, size, _ in ranges:
                out.write(inp.read(offset - at))  # what lies between: kept
                out.seek(size, 1)  # a hole: zeros, stored as nothing where the disk allows
                inp.seek(size, 1)
                at = offset + size
            out.write(inp.read())
            out.truncate()
        mark["tensors"][str(rel)] = ranges
    (dst / MARK).write_text(json.dumps(mark, indent=1))
    return mark


def fill(folder: Path, seed: int = 0) -> int:
    """Random values into a stand-in's blanked tensors; returns the bytes written."""
    mark = json.loads((folder / MARK).read_text())
    written = 0
    for index, (rel, ranges) in enumerate(sorted(mark["tensors"].items())):
        rng = np.random.default_rng([seed, index])
        data = np.memmap(folder / rel, dtype=np.uint8, mode="r+")
        for offset, size, kind in ranges:
            data[offset : offset + size] = np.frombuffer(random_tensor(rng, kind, size), np.uint8)
            written += size
        data.flush()
        del data
    mark["filled"] = True
    (folder / MARK).write_text(json.dumps(mark, indent=1))
    return written


def random_tensor(rng: np.random.Generator, kind: str, size: int) -> bytes:
    if kind in INTEGER:
        return rng.bytes(size)
    low, high = SCALE_RANGE
    if kind == "bf16":  # the upper half of an f32
        values = rng.uniform(low, high, size // 2).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    dtype = np.dtype(np.float16 if kind == "f16" else np.float32)
    return rng.uniform(low, high, size // dtype.itemsize).astype(dtype).tobytes()


def compare(real: Path, stand_in: Path, cores: str, rounds: int, tokens: int) -> dict[str, Any]:
    """genai decode tok/s of the real optimum-cli folder and its stand-in, alternating, each
    loaded once in a pinned process of its own (benchmarks/workers.py's genai-repeat)."""
    from benchmarks.workers import Repeater

    props = {"INFERENCE_PRECISION_HINT": "f32"}
    workers = {
        name: Repeater(folder, cores=cores, tokens=tokens, props=props)
        for name, folder in (("real", real), ("stand-in", stand_in))
    }
    runs: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for _ in range(rounds):
            for name, worker in workers.items():
                runs[name].append(worker.measure())
                print(f"{name}: {runs[name][-1]:.2f} tok/s", flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    ratio = [s / r for r, s in zip(runs["real"], runs["stand-in"], strict=True)]
    return {"runs": runs, "stand_in_vs_real": ratio, "median": statistics.median(ratio)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pipeshard bench stand-in",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("make", help="blank a copy of an export or optimum-cli folder")
    m.add_argument("src", type=Path)
    m.add_argument("dst", type=Path)
    m.add_argument("--min-bytes", type=int, default=65536)
    m.add_argument("--leave-out", action="append", default=[], help="a top-level entry, e.g. draft")
    f = sub.add_parser("fill", help="random weights into a stand-in, in place")
    f.add_argument("folder", type=Path)
    f.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare", help="genai tok/s of a real optimum-cli folder and its stand-in")
    c.add_argument("real", type=Path)
    c.add_argument("stand_in", type=Path)
    c.add_argument("--cores", default="0")
    c.add_argument("--rounds", type=int, default=5)
    c.add_argument("--tokens", type=int, default=64)
    opts = p.parse_args(argv)
    if opts.verb == "make":
        mark = make(opts.src, opts.dst, opts.min_bytes, tuple(opts.leave_out))
        count = sum(len(r) for r in mark["tensors"].values())
        size = sum(s for r in mark["tensors"].values() for _, s, _ in r)
        print(f"{opts.dst}: {count} tensors blanked ({size / 2**20:.0f} MiB)")
    elif opts.verb == "fill":
        print(f"{opts.folder}: {fill(opts.folder, opts.seed) / 2**20:.0f} MiB of random weights")
    else:
        result = compare(opts.real, opts.stand_in, opts.cores, opts.rounds, opts.tokens)
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
