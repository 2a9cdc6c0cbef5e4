"""Arguments more than one part of the command line takes: the global ``--log-level`` every
subcommand repeats, and `pipeshard export`'s, which `up` also parses for the export it makes;
and the help formatter that states the settings' defaults."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.options import comma_list, comma_numbers

if TYPE_CHECKING:
    from exporter.export import ExportOptions


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given after the subcommand it wins, absent it leaves the global one alone.
    common.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING, ERROR (default: INFO for services, WARNING for tools)",
    )
    return common


COMMON = _common()


def defaults_help(defaults: Callable[[], Mapping[str, Any]]) -> type[argparse.HelpFormatter]:
    """A help formatter that writes ``{default}`` in a flag's help as the default of the
    setting the flag sets (``defaults()[dest]``), and ``{NAME}`` as ``defaults()[NAME]``. The
    flags of the services default to None (not given: the environment or config file
    decides), so their defaults live only in the settings classes, and ``defaults`` is called
    (the settings imported) only to show help."""

    class DefaultsHelpFormatter(argparse.HelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str | None:
            text = super()._get_help_string(action)
            if text is None or "{" not in text:
                return text
            values = defaults()

            def value(match: re.Match[str]) -> str:
                name = action.dest if match[1] == "default" else match[1]
                return show_default(values[name])

            return re.sub(r"\{(\w+)\}", value, text)

    return DefaultsHelpFormatter


def show_default(value: Any) -> str:
    """A default as help states it: 120.0 as 120, 0.5 as 0.5."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def settings_defaults(settings_class: Any) -> dict[str, Any]:
    """Every field's default of a pydantic settings class (factories called)."""
    return {
        name: field.get_default(call_default_factory=True)
        for name, field in settings_class.model_fields.items()
        if not field.is_required()
    }


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export", parents=[COMMON], help="split a model into stateful OpenVINO stage shards"
    )
    p.add_argument("model", help="Hugging Face folder, .gguf file, or a built-in model name")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--stages", type=int, default=None, help="number of stages (default 1)")
    p.add_argument(
        "--split",
        type=comma_numbers,
        default=None,
        help="layers per stage, e.g. 14,14; a fraction cuts inside a layer's MLP, e.g. 15.7,12.3",
    )
    p.add_argument(
        "--node-memory",
        type=comma_list,
        default=None,
        help="memory budget per node, e.g. 16GB,8GB: layers are split to fit",
    )
    p.add_argument(
        "--weights",
        choices=["auto", "gguf", "fp32", "fp16", "int8", "int4"],
        default="auto",
        help="gguf: a GGUF file's own quantized blocks, as they are (auto's choice for a .gguf); "
        "int4/int8: NNCF compression (auto's choice for a Hugging Face folder: int4); "
        "fp16/fp32: plain floats",
    )
    p.add_argument(
        "--gguf-form",
        choices=["split", "exact", "fast"],
        default="split",
        help="--weights gguf: how blocks with a minimum (Q4_K, Q5_K, ...) are kept: split "
        "(default; exact, the minimum as a small matmul of its own), exact (f32 zero points, "
        "slower on CPU); fast: split, and Q6_K regrouped from 16 to 32 columns a scale "
        "(inexact: a pair's smaller sub-block is rounded to the larger one's grid, faster)",
    )
    p.add_argument(
        "--stage",
        type=int,
        default=None,
        help="export only stage K of the plan (+ manifest and tokenizer), reading only its "
        "tensors: each PC builds its own stage into the same --out",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="int4 group size; -1: per channel (default 128, or the largest power of two "
        "below it that divides every matrix's input channels)",
    )
    p.add_argument("--sym", action="store_true", help="symmetric int4 (default asymmetric)")
    p.add_argument("--draft", default=None, help="draft model exported beside the target")
    p.add_argument(
        "--no-beam-idx",
        action="store_true",
        help="leave out the beam_idx Gather (benchmark control: no KV-cache fusion)",
    )
    p.add_argument("--max-context", type=int, default=None, help="override the maximum context")
    p.add_argument(
        "--plan-context",
        type=int,
        default=None,
        help="context length for the KV memory estimate (default: the maximum context)",
    )
    p.add_argument("--cache-dir", type=Path, default=None, help="download cache (built-in models)")
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="do nothing if the output folder already holds this export; else (re)export",
    )
    p.add_argument("--quiet", action="store_true", help="no plan, no progress bars")


def export_options(args: argparse.Namespace) -> ExportOptions:
    """`pipeshard export`'s parsed arguments as the exporter's options."""
    from exporter.export import ExportOptions
    from exporter.plan import parse_size
    from protos.manifest import WeightSpec

    int4 = args.weights == "int4"
    weights = None  # auto: decided by the source
    if args.weights != "auto":
        weights = WeightSpec(
            format=args.weights,
            group_size=args.group_size if int4 else None,
            symmetric=args.sym if int4 else None,
        )
    return ExportOptions(
        model=args.model,
        out=args.out,
        stages=args.stages,
        split=args.split,
        node_memory=[parse_size(s) for s in args.node_memory] if args.node_memory else None,
        weights=weights,
        gguf_form=args.gguf_form,
        stage=args.stage,
        draft=args.draft,
        beam_idx=not args.no_beam_idx,
        force=args.force,
        reuse=args.reuse,
        quiet=args.quiet,
        max_context=args.max_context,
        plan_context=args.plan_context,
        cache_dir=args.cache_dir,
    )
