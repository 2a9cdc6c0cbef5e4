"""gpt-oss's MXFP4 experts: run-time memory and decode time of each exact form the CPU runs.

One gpt-oss expert layer (the exporter's tiled 2-GEMM block: router with bias, the top-k's
softmax, interleaved gate/up + bias, the clamped SwiGLU, down + bias) is built with random MXFP4
experts (e8m0 exponents in a real checkpoint's range, random e2m1 codes) held in each form, and
compiled on the CPU in a process of its own:

- ``i8-f32``: the doubled e2m1 values as i8 codes, an f32 scale 2^(E-128) per 32: the
  export's form (exporter.gguf_quant.expert_weights);
- ``i8-e8m0``: the same codes, the scale as an e8m0 byte (f8e8m0);
- ``f4-e8m0``: the file's own f4e2m1 codes and f8e8m0 scales (4.25 bits a weight, as stored);
- ``f4-f32``: f4e2m1 codes, f32 scales.

For each: whether the experts became GatherMatmul and which weight type it reads, the process's
RSS growth from building to the first inference (the compiled layer's memory, with the model
object and the build's arrays freed), its peak, bits per expert weight at run time (net: the
growth between this build and one of 4 experts, per weight between them, so that the runtime's
fixed memory is out), the median time of a 1-token call, and the largest difference from a
float64 numpy reference on the MXFP4 values (every form is exact in its weights; the difference
is the f32 arithmetic).

Usage: pipeshard bench mxfp4-forms [--experts 32] [--hidden 1024] [--width 1024]
       [--forms i8-f32,i8-e8m0,f4-e8m0,f4-f32] [--threads 1]
Writes mxfp4_forms-<date>.{md,json} in --results DIR (default: the current directory).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import add_results_option, save

FORMS = ("i8-f32", "i8-e8m0", "f4-e8m0", "f4-f32")
ALPHA, LIMIT = 1.702, 7.0
TOP_K = 4
SMALL = 4  # experts of the second, smaller build that the fixed memory is measured by


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _release_freed() -> None:
    """Collect garbage and hand freed heap pages back (glibc keeps them otherwise), so that
    RSS counts what is held."""
    import ctypes

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _random_mxfp4(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, cols] uint8 in element order, exponents [rows, cols / 32] uint8)."""
    codes = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    exponents = rng.integers(118, 126, (rows, cols // 32), dtype=np.uint8)
    return codes, exponents


def _values(codes: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    from exporter.gguf_quant import MXFP4_VALUES, e8m0_half

    scale = np.repeat(e8m0_half(exponents), 32, axis=1)
    return MXFP4_VALUES[codes].astype(np.float32) * scale


def _weight_node(form: str, codes: np.ndarray, exponents: np.ndarray, experts: int) -> Any:
    """[E, rows / E, cols] f32 decompressed from ``form``'s constants."""
    import openvino as ov
    import openvino.opset13 as ops

    from exporter.gguf_quant import expert_weights, mxfp4_weight

    if form == "i8-f32":  # the export's own node
        return expert_weights(mxfp4_weight(codes, exponents), experts, "experts")
    rows, cols = codes.shape
    shape = [experts, rows // experts, cols // 32, 32]
    if form == "i8-e8m0":
        from exporter.gguf_quant import MXFP4_VALUES

        values = ops.constant(MXFP4_VALUES[codes].reshape(shape), ov.Type.i8)
        w = ops.convert(values, ov.Type.f32)
        exponents = exponents - 1  # the doubled values: times 2^(E - 128), e8m0 byte E - 1
    else:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)  # even element low
        tensor = ov.Tensor(ov.Type.f4e2m1, shape)
        tensor.data[...] = packed.reshape(tensor.data.shape)
        w = ops.convert(ov.op.Constant(tensor), ov.Type.f32)
    scale_shape = [experts, rows // experts, cols // 32, 1]
    if form.endswith("e8m0"):  # e8m0 E: 2^(E - 127)
        scales = ov.Tensor(ov.Type.f8e8m0, scale_shape)
        scales.data[...] = exponents.reshape(scales.data.shape)
        scale = ops.convert(ov.op.Constant(scales), ov.Type.f32)
    else:  # the e2m1 value times 2^(E - 127)
        scale = ops.constant(
            (2.0 ** (exponents.astype(np.float64) - 127)).astype(np.float32).reshape(scale_shape)
        )
    w = ops.multiply(w, scale)
    return ops.reshape(
        w, ops.constant(np.array([experts, rows // experts, cols], np.int64)), False
    ).output(0)


def measure_one(form: str, experts: int, hidden: int, width: int, threads: int) -> dict[str, Any]:
    """Build, compile and time the layer in ``form`` (in this process)."""
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    router = rng.standard_normal((experts, hidden)).astype(np.float32) * 0.1
    router_bias = rng.standard_normal(experts).astype(np.float32) * 0.1
    gate_up = _random_mxfp4(rng, experts * 2 * width, hidden)
    down = _random_mxfp4(rng, experts * hidden, width)
    gate_up_bias = rng.standard_normal((experts, 1, 2 * width)).astype(np.float32)
    down_bias = rng.standard_normal((experts, 1, hidden)).astype(np.float32)
    x = rng.standard_normal((1, 1, hidden)).astype(np.float32)
    reference = _reference(x, router, router_bias, gate_up, gate_up_bias, down, down_bias, width)
    _release_freed()
    base_kib = _status_kib("VmRSS")

    def c(value: Any, dtype: Any = np.int64) -> Any:
        return ops.constant(np.array(value, dtype=dtype))

    xin = ops.parameter([-1, -1, hidden], ov.Type.f32, name="x")
    rows = ops.reshape(xin, c([-1, hidden]), False)
    logits = ops.add(ops.matmul(rows, ops.constant(router), False, True), ops.constant(router_bias))
    top = ops.topk(logits, c(TOP_K), -1, "max", "value", ov.Type.i64)
    zeros = ops.broadcast(c(0.0, np.float32), ops.shape_of(logits))
    routing = ops.scatter_elements_update(
        zeros, top.output(1), ops.softmax(top.output(0), -1), c(1)
    )
    tiled = ops.reshape(ops.tile(rows, c([experts, 1])), c([experts, -1, hidden]), False)
    both = ops.matmul(tiled, _weight_node(form, *gate_up, experts), False, True)
    both = ops.add(both, ops.constant(gate_up_bias))
    end = np.iinfo(np.int64).max
    gate = ops.slice(both, c([0]), c([end]), c([2]), c([2]))
    up = ops.slice(both, c([1]), c([end]), c([2]), c([2]))
    up = ops.add(ops.clamp(up, -LIMIT, LIMIT), c(1.0, np.float32))
    glu = ops.swish(ops.minimum(gate, c(LIMIT, np.float32)), c(ALPHA, np.float32))
    out = ops.matmul(ops.multiply(up, glu), _weight_node(form, *down, experts), False, True)
    out = ops.add(out, ops.constant(down_bias))
    batch = ops.gather(ops.shape_of(xin), c([0]), c(0))
    per = ops.reshape(out, ops.concat([c([experts]), batch, c([-1, hidden])], 0), False)
    weights = ops.reshape(
        ops.transpose(routing, c([1, 0])), ops.concat([c([experts]), batch, c([-1])], 0), False
    )
    result = ops.reduce_sum(ops.multiply(per, ops.unsqueeze(weights, c(-1))), c(0), False)
    model = ov.Model([ops.result(result)], [xin], f"gpt-oss-experts-{form}")
    del gate_up, down
    started = time.perf_counter()
    compiled = ov.Core().compile_model(
        model,
        "CPU",
        {
            "INFERENCE_PRECISION_HINT": "f32",
            "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
            "INFERENCE_NUM_THREADS": str(threads),
        },
    )
    compile_s = time.perf_counter() - started
    del model
    _release_freed()
    request = compiled.create_infer_request()
    got = request.infer({"x": x})[compiled.outputs[0]].copy()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        request.infer({"x": x})
        times.append(time.perf_counter() - t0)
    rss_kib = _status_kib("VmRSS") - base_kib
    gathers = [
        op
        for op in compiled.get_runtime_model().get_ops()
        if op.get_rt_info()["layerType"].astype(str) == "GatherMatmul"
    ]
    weight_types = sorted({op.input(1).get_element_type().get_type_name() for op in gathers})
    params = experts * 3 * hidden * width
    return {
        "form": form,
        "gather_matmul": len(gathers),
        "gather_matmul_weight_types": weight_types,
        "rss_growth_bytes": rss_kib * 1024,
        "peak_rss_bytes": _status_kib("VmHWM") * 1024,
        "bits_per_expert_weight": rss_kib * 1024 * 8 / params,
        "compile_s": compile_s,
        "decode_call_ms": 1000 * statistics.median(times),
        "max_rel_diff": float(np.abs(got - reference).max() / np.abs(reference).max()),
    }


def _reference(
    x: np.ndarray,
    router: np.ndarray,
    router_bias: np.ndarray,
    gate_up: tuple[np.ndarray, np.ndarray],
    gate_up_bias: np.ndarray,
    down: tuple[np.ndarray, np.ndarray],
    down_bias: np.ndarray,
    width: int,
) -> np.ndarray:
    """transformers' GptOssMLP in float64 on the MXFP4 values (the chosen experts only)."""
    experts = router.shape[0]
    row = x.reshape(-1).astype(np.float64)
    logits = router.astype(np.float64) @ row + router_bias
    chosen = np.argsort(-logits)[:TOP_K]
    weights = np.exp(logits[chosen] - logits[chosen].max())
    weights /= weights.sum()
    gu_rows = gate_up[0].reshape(experts, 2 * width, -1)
    gu_exp = gate_up[1].reshape(experts, 2 * width, -1)
    d_rows = down[0].reshape(experts, -1, width)
    d_exp = down[1].reshape(experts, -1, width // 32)
    out = np.zeros_like(row)
    for weight, e in zip(weights, chosen, strict=True):
        both = _values(gu_rows[e], gu_exp[e]).astype(np.float64) @ row + gate_up_bias[e, 0]
        gate = np.minimum(both[0::2], LIMIT)
        up = np.clip(both[1::2], -LIMIT, LIMIT)
        act = (up + 1) * gate / (1 + np.exp(-ALPHA * gate))
        out += weight * (_values(d_rows[e], d_exp[e]).astype(np.float64) @ act + down_bias[e, 0])
    return out.reshape(x.shape)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeshard bench mxfp4-forms", description=__doc__)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024, help="each expert's channels")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child measuring one form
    add_results_option(parser)
    opts = parser.parse_args(argv)
    if opts.one:
        row = measure_one(opts.one, opts.experts, opts.hidden, opts.width, opts.threads)
        print(json.dumps(row))
        return 0
    if opts.experts <= SMALL:
        parser.error(f"--experts must be more than {SMALL}")

    def child(form: str, experts: int) -> dict[str, Any]:
        args = [
            sys.executable, "-m", "benchmarks.mxfp4_forms", "--one", form,
            "--experts", str(experts), "--hidden", str(opts.hidden),
            "--width", str(opts.width), "--threads", str(opts.threads),
        ]  # fmt: skip
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return {"form": form, "error": done.stderr.strip().splitlines()[-1:]}
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))

    rows = []
    params = opts.experts * 3 * opts.hidden * opts.width
    for form in opts.forms.split(","):
        if form not in FORMS:
            parser.error(f"unknown form {form!r} (one of {', '.join(FORMS)})")
        row, small = child(form, opts.experts), child(form, SMALL)
        if "error" not in row and "error" not in small:
            # the growth per expert weight between the two sizes: the runtime's fixed memory out
            extra = row["rss_growth_bytes"] - small["rss_growth_bytes"]
            row["net_bits_per_expert_weight"] = extra * 8 / (params * (1 - SMALL / opts.experts))
        rows.append(row)
    lines = [
        f"# gpt-oss MXFP4 expert forms: {opts.experts} experts x [{opts.hidden} hidden, "
        f"{opts.width} channels] ({params / 1e6:.0f}M expert weights), top-{TOP_K}, "
        f"{opts.threads} thread(s)",
        "",
        "| form | GatherMatmul (weights) | RSS growth | bits/weight (net) | peak RSS "
        "| 1-token call | max rel. diff |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['form']} | failed: {row['error']} | | | | | |")
            continue
        lines.append(
            f"| {row['form']} | {row['gather_matmul']}"
            f" ({', '.join(row['gather_matmul_weight_types'])})"
            f" | {row['rss_growth_bytes'] / 2**20:.0f} MiB"
            f" | {row.get('net_bits_per_expert_weight', float('nan')):.2f}"
            f" | {row['peak_rss_bytes'] / 2**20:.0f} MiB | {row['decode_call_ms']:.2f} ms"
            f" | {row['max_rel_diff']:.1e} |"
        )
    report = "\n".join(lines)
    save(opts.results, "mxfp4_forms", report, {"rows": rows}, opts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
