"""`pipeshard export`: a model -> N stateful OpenVINO stage shards + manifest (+ a draft).

``ModelSource -> transformers model -> StageModule per layer range -> stateful IR -> folder``

Everything is written into a temporary folder beside the output and renamed at the end, so a
failed export leaves nothing half-written.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exporter.architectures import ArchitectureFacts, read_architecture
from exporter.errors import ExportError
from exporter.plan import (
    StagePlan,
    check_fits,
    check_split,
    decode_balanced_split,
    format_plan,
    is_fractional,
    mlp_channel_step,
    plan_stages,
    split_for_memory,
)
from exporter.source import ModelSource, resolve_source
from protos.manifest import (
    MANIFEST_NAME,
    DraftEntry,
    FileEntry,
    ModelSpec,
    ShardManifest,
    SourceSpec,
    StageEntry,
    TokenizerSpec,
    WeightSpec,
    load_manifest,
    manifest_hash,
    sha256_file,
)

log = logging.getLogger(__name__)

EXPORTER_VERSION = "0.1.0"


@dataclass
class ExportOptions:
    model: str
    out: Path
    stages: int | None = None
    split: list[float] | None = None  # layers per stage; fractional cuts inside an MLP
    node_memory: list[int] | None = None
    weights: WeightSpec = field(default_factory=lambda: WeightSpec(format="fp16"))
    draft: str | None = None
    beam_idx: bool = True
    force: bool = False
    reuse: bool = False
    quiet: bool = False
    max_context: int | None = None
    plan_context: int | None = None
    cache_dir: Path | None = None


@dataclass
class ExportReport:
    manifest: ShardManifest
    plans: list[StagePlan]
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    reused: bool = False  # --reuse found this export already in place


def _progress(iterable: Any, desc: str, quiet: bool, total: int | None = None) -> Any:
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=quiet, unit="stage", leave=True)


def _check_output(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output folder {out} is not empty (use --force to replace it)")


def _resolve_split(
    options: ExportOptions, facts: ArchitectureFacts, context: int, config: Any
) -> Sequence[float]:
    intermediate = int(config.intermediate_size)
    if options.split:
        split = check_split(facts.num_layers, list(options.split))
        if options.stages is not None and options.stages != len(split):
            raise ExportError(
                f"--stages {options.stages} disagrees with --split ({len(split)} stages)"
            )
        return split
    if options.node_memory:
        if options.stages is not None and options.stages != len(options.node_memory):
            raise ExportError(
                f"--stages {options.stages} disagrees with --node-memory "
                f"({len(options.node_memory)} nodes)"
            )
        return split_for_memory(
            facts, options.node_memory, options.weights.format, intermediate, context
        )
    return decode_balanced_split(facts, options.stages or 1, options.weights.format, intermediate)


def _file_entries(root: Path, folder: Path) -> list[FileEntry]:
    return [
        FileEntry(path=str(p.relative_to(root)), sha256=sha256_file(p), size=p.stat().st_size)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    ]


def _eos_ids(config: Any, tokenizer: Any, generation_config: Any) -> list[int]:
    ids: list[int] = []
    for value in (
        getattr(generation_config, "eos_token_id", None),
        getattr(config, "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    ):
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)
    return ids


def _export_tokenizer(tokenizer: Any, model: Any, tmp: Path) -> TokenizerSpec:
    folder = tmp / "tokenizer"
    tokenizer.save_pretrained(folder)
    return TokenizerSpec(
        directory="tokenizer",
        files=_file_entries(tmp, folder),
        chat_template=getattr(tokenizer, "chat_template", None) or None,
        eos_token_ids=_eos_ids(model.config, tokenizer, getattr(model, "generation_config", None)),
        bos_token_id=getattr(tokenizer, "bos_token_id", None),
        pad_token_id=getattr(tokenizer, "pad_token_id", None),
    )


def _check_draft_vocab(target_tok: Any, target_cfg: Any, draft_tok: Any, draft_cfg: Any) -> None:
    if int(target_cfg.vocab_size) != int(draft_cfg.vocab_size):
        raise ExportError(
            f"draft vocabulary size {draft_cfg.vocab_size} differs from the target's "
            f"{target_cfg.vocab_size}"
        )
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ExportError("the draft's tokenizer vocabulary differs from the target's")


@dataclass
class _Resolved:
    """What an export is made of, read from the configs (no weights, no torch): the plan."""

    out: Path
    source: ModelSource
    config: Any
    facts: ArchitectureFacts
    plans: list[StagePlan]
    intermediate: int
    plan_text: str  # the plan as a table, printed unless quiet
    draft_source: ModelSource | None
    draft_config: Any
    started: float
    phases: dict[str, float]


def _resolve(options: ExportOptions) -> _Resolved:
    started = time.perf_counter()
    if options.quiet:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    out = options.out.expanduser().resolve()
    _check_output(out, options.force or (options.reuse and (out / MANIFEST_NAME).is_file()))
    source = resolve_source(options.model, options.cache_dir, progress=not options.quiet)
    config = source.load_config()
    facts = read_architecture(config)
    if options.max_context:
        facts = _with_context(facts, options.max_context)
    context = options.plan_context or facts.max_context
    split = _resolve_split(options, facts, context, config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    intermediate = int(config.intermediate_size)
    step = 1
    if is_fractional(split):
        weights = options.weights
        step = mlp_channel_step(facts.model_type, weights.format, weights.group_size)
    plans = plan_stages(facts, split, options.weights.format, intermediate, context, tied, step)
    if options.node_memory:
        check_fits(plans, options.node_memory, context)
    plan_text = (
        f"plan for {source.model_id} ({facts.model_type}, {facts.num_layers} layers, "
        f"{options.weights.format}):\n{format_plan(plans, context, intermediate)}"
    )

    draft_source = draft_config = None
    if options.draft:
        draft_source = resolve_source(options.draft, options.cache_dir, not options.quiet)
        draft_config = draft_source.load_config()
        read_architecture(draft_config)
    phases = {"resolve": time.perf_counter() - started}
    return _Resolved(
        out,
        source,
        config,
        facts,
        plans,
        intermediate,
        plan_text,
        draft_source,
        draft_config,
        started,
        phases,
    )


def _reused(options: ExportOptions, r: _Resolved) -> ExportReport | None:
    existing = _reusable(r.out, r.source, r.plans, options, r.draft_source)
    if existing is None:
        return None
    if not options.quiet:
        print(f"{r.plan_text}\n{r.out} already holds this export; reusing it", flush=True)
    return ExportReport(existing, r.plans, time.perf_counter() - r.started, r.phases, True)


def reusable_export(options: ExportOptions) -> ExportReport | None:
    """The export already in ``options.out`` that these options would write (saying so with
    the plan, as ``--reuse`` does), or None (printing nothing) where export_model would have
    to export. Reads configs only, so it needs no torch: the gateway of `pipeshard up`
    checks this itself and runs the export in a child only where one is needed. Raises
    ExportError on bad input."""
    return _reused(options, _resolve(replace(options, reuse=True)))


def export_model(options: ExportOptions) -> ExportReport:
    """Run a whole export; raises ExportError (one-line reason) on bad input."""
    r = _resolve(options)
    if options.reuse:
        reused = _reused(options, r)
        if reused is not None:
            return reused
    if not options.quiet:
        print(r.plan_text, flush=True)
    out, source, config, facts, plans = r.out, r.source, r.config, r.facts, r.plans
    intermediate, draft_source, draft_config = r.intermediate, r.draft_source, r.draft_config
    started, phases = r.started, r.phases

    # torch, OpenVINO and NNCF only now: a reused export (every `pipeshard up` after the first)
    # does without them
    from exporter.convert import compress_stage, make_stage_stateful, save_stage, trace_stage
    from exporter.stage_module import StageModule

    if options.quiet:
        import nncf

        nncf.set_log_level(logging.ERROR)

    t0 = time.perf_counter()
    tokenizer = source.load_tokenizer()
    if draft_source is not None:
        draft_tok = draft_source.load_tokenizer()
        _check_draft_vocab(tokenizer, config, draft_tok, draft_config)
    model = source.load_model(progress=not options.quiet)
    phases["load"] = time.perf_counter() - t0

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        stages: list[StageEntry] = []
        for plan in _progress(plans, f"export {source.model_id}", options.quiet):
            module = StageModule(
                model, facts, plan.layer_start, plan.layer_end, plan.mlp_in, plan.mlp_out
            )
            ov_model = trace_stage(module)
            make_stage_stateful(ov_model, config, options.beam_idx)
            ov_model = compress_stage(ov_model, options.weights, facts.vocab_size)
            folder = tmp / f"stage-{plan.index}"
            save_stage(ov_model, folder, options.weights)
            stages.append(
                StageEntry(
                    index=plan.index,
                    layer_start=plan.layer_start,
                    layer_end=plan.layer_end,
                    mlp_in=plan.mlp_in,
                    mlp_out=plan.mlp_out,
                    directory=folder.name,
                    inputs=[p.get_any_name() for p in ov_model.inputs],
                    outputs=[p.get_any_name() for p in ov_model.outputs],
                    beam_idx=options.beam_idx,
                    files=_file_entries(tmp, folder),
                )
            )
            del module, ov_model
        phases["convert"] = time.perf_counter() - t0
        tokenizer_spec = _export_tokenizer(tokenizer, model, tmp)
        del model

        draft_entry = None
        if draft_source is not None:
            t0 = time.perf_counter()
            draft_report = export_model(
                ExportOptions(
                    model=options.draft or "",
                    out=tmp / "draft",
                    stages=1,
                    weights=options.weights,
                    beam_idx=options.beam_idx,
                    quiet=options.quiet,
                    cache_dir=options.cache_dir,
                )
            )
            draft_entry = DraftEntry(
                directory="draft",
                model_id=draft_report.manifest.model.model_id,
                manifest_sha256=manifest_hash(tmp / "draft"),
            )
            phases["draft"] = time.perf_counter() - t0

        import openvino as ov

        manifest = ShardManifest(
            model=ModelSpec(
                model_id=source.model_id,
                architecture=facts.model_type,
                num_layers=facts.num_layers,
                hidden_size=facts.hidden_size,
                num_heads=facts.num_heads,
                num_kv_heads=facts.num_kv_heads,
                head_dim=facts.head_dim,
                vocab_size=facts.vocab_size,
                max_context=facts.max_context,
                layer_types=facts.layer_types,
                sliding_window=facts.sliding_window,
                intermediate_size=intermediate,
            ),
            weights=options.weights,
            stages=stages,
            tokenizer=tokenizer_spec,
            source=SourceSpec(kind=source.kind, path=str(source.path), sha256=source.sha256),
            draft=draft_entry,
            exporter_version=EXPORTER_VERSION,
            openvino_version=ov.get_version(),
        )
        (tmp / MANIFEST_NAME).write_text(manifest.to_json(), encoding="utf-8")
        load_manifest(tmp)  # what we wrote must read back
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(manifest, plans, time.perf_counter() - started, phases)


def _reusable(
    out: Path,
    source: ModelSource,
    plans: list[StagePlan],
    options: ExportOptions,
    draft: ModelSource | None,
) -> ShardManifest | None:
    """The manifest in ``out`` if it is the export these options would write, else None."""
    try:
        manifest = load_manifest(out)
    except ValueError:
        return None
    same = (
        manifest.source.path == str(source.path)
        and manifest.source.sha256 == source.sha256
        and [(s.layer_start, s.layer_end, s.mlp_in, s.mlp_out) for s in manifest.stages]
        == [(p.layer_start, p.layer_end, p.mlp_in, p.mlp_out) for p in plans]
        and manifest.weights == options.weights
        and all(s.beam_idx == options.beam_idx for s in manifest.stages)
        and (options.max_context is None or manifest.model.max_context == options.max_context)
        and (manifest.draft.model_id if manifest.draft else None)
        == (draft.model_id if draft else None)
    )
    return manifest if same else None


def _with_context(facts: ArchitectureFacts, max_context: int) -> ArchitectureFacts:

    if max_context < 1:
        raise ExportError(f"--max-context must be positive, got {max_context}")
    return replace(facts, max_context=max_context)
