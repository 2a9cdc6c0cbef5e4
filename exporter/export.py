"""`pipeshard export`: a model -> N stateful OpenVINO stage shards + manifest (+ a draft).

``ModelSource -> config (plan) -> per stage: its own tensors -> graph -> stateful IR -> folder``

No model is ever loaded whole: each stage is built from its own layers' tensors, read from the
GGUF file (its quantized blocks kept as they are, :mod:`exporter.gguf_quant`) or from the
safetensors files, and saved before the next stage is read. ``--stage K`` builds one stage (with
the manifest and tokenizer), so every PC can build its own shard from its own copy of the model;
the manifest, and so the export's identity, is the same whichever machine wrote which stage.

A whole export is written into a temporary folder beside the output and renamed at the end, so a
failed export leaves nothing half-written; a single stage is written beside its folder and
renamed into place.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.architectures import ArchitectureFacts, read_architecture
from exporter.errors import ExportError
from exporter.families import family
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
from exporter.recipe import Recipe, read_recipe
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

if TYPE_CHECKING:
    from exporter.gguf_quant import Q4KForm
    from exporter.graph import WeightSource

log = logging.getLogger(__name__)

EXPORTER_VERSION = "0.2.0"
# A Hugging Face folder's default: NNCF int4 (asymmetric, groups of 128), int8 embeddings/head
DEFAULT_HF_WEIGHTS = WeightSpec(format="int4", group_size=None, symmetric=False)
DEFAULT_GROUP_SIZE = 128  # int4 groups, unless 128 does not divide a matrix's input channels


@dataclass
class ExportOptions:
    model: str
    out: Path
    stages: int | None = None
    split: list[float] | None = None  # layers per stage; fractional cuts inside an MLP
    node_memory: list[int] | None = None
    # None: the GGUF's own blocks for a GGUF file ("gguf"), int4 for a Hugging Face folder
    weights: WeightSpec | None = None
    gguf_form: Q4KForm = "split"  # how "gguf" weights encode scale+min blocks (Q4_K, ...)
    stage: int | None = None  # export only this stage (+ manifest and tokenizer)
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
    stage_bytes: dict[int, int] = field(default_factory=dict)  # each stage written: its IR size


def _progress(iterable: Any, desc: str, quiet: bool, total: int | None = None) -> Any:
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=quiet, unit="stage", leave=True)


def _check_output(out: Path, force: bool, stage: int | None) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder")
    if stage is not None and (out / MANIFEST_NAME).is_file():
        return  # checked against the plan in _check_same_export
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output folder {out} is not empty (use --force to replace it)")


def _resolve_split(
    options: ExportOptions, facts: ArchitectureFacts, context: int, weights: WeightSpec
) -> Sequence[float]:
    intermediate = facts.intermediate_size
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
        return split_for_memory(facts, options.node_memory, weights.format, intermediate, context)
    return decode_balanced_split(facts, options.stages or 1, weights.format, intermediate)


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


def _generation_config(config: Any) -> Any:
    """The folder's generation_config.json where there is one (it may list several EOS ids),
    else what transformers derives from the model config."""
    from transformers import GenerationConfig

    where = getattr(config, "_name_or_path", None)
    if where and (Path(where) / "generation_config.json").is_file():
        with contextlib.suppress(OSError, ValueError):
            return GenerationConfig.from_pretrained(where, local_files_only=True)
    return GenerationConfig.from_model_config(config)


def _export_tokenizer(tokenizer: Any, config: Any, tmp: Path) -> TokenizerSpec:
    folder = tmp / "tokenizer"
    tokenizer.save_pretrained(folder)
    return TokenizerSpec(
        directory="tokenizer",
        files=[
            FileEntry(path=str(p.relative_to(tmp)), sha256=sha256_file(p), size=p.stat().st_size)
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        ],
        chat_template=getattr(tokenizer, "chat_template", None) or None,
        eos_token_ids=_eos_ids(config, tokenizer, _generation_config(config)),
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


def _weights(options: ExportOptions, source: ModelSource) -> WeightSpec:
    weights = options.weights
    if weights is None:
        weights = WeightSpec(format="gguf") if source.kind == "gguf" else DEFAULT_HF_WEIGHTS
    if weights.format == "gguf":
        if source.kind != "gguf":
            raise ExportError(
                f"--weights gguf keeps a GGUF file's own blocks; {source.path} is not a GGUF file "
                "(use int4, int8, fp16 or fp32)"
            )
        from exporter.weights import gguf_type_summary

        form = options.gguf_form
        types = gguf_type_summary(source.path, form)
        for entry in types:
            if entry.exactness == "rounded to f16" or entry.type == "F64":  # not asked for
                log.warning(
                    "%d %s tensor(s) of %s: %s (%s)",
                    entry.tensors,
                    entry.type,
                    source.path.name,
                    entry.becomes,
                    entry.exactness,
                )
        return weights.model_copy(update={"gguf_form": form, "gguf_types": types})
    return weights


def _int4_groups(weights: WeightSpec, facts: ArchitectureFacts) -> WeightSpec:
    """int4 weights with their group size: the one asked for, which must divide the input
    channels of every matrix NNCF compresses (ExportError naming the ones it does not), or by
    default 128, or the largest power of two below it that divides them all (said in a
    warning)."""
    if weights.format != "int4" or (weights.group_size is not None and weights.group_size <= 0):
        return weights
    heads = facts.num_heads * facts.head_dim
    channels = {"hidden_size": facts.hidden_size, "heads x head_dim": heads}
    if facts.intermediate_size:
        channels["intermediate_size"] = facts.intermediate_size
    if facts.expert_intermediate_size:
        channels["moe_intermediate_size"] = facts.expert_intermediate_size
    common = math.gcd(*channels.values())
    fit = next(g for g in (128, 64, 32, 16, 8, 4, 2, 1) if common % g == 0)
    wanted = weights.group_size or DEFAULT_GROUP_SIZE
    misfits = ", ".join(f"{k} {v}" for k, v in channels.items() if v % wanted)
    if not misfits:
        return weights.model_copy(update={"group_size": wanted})
    per_channel = "--group-size -1 (per channel)"
    if weights.group_size is not None:
        use = f"--group-size {fit} or {per_channel}" if fit >= 16 else per_channel
        raise ExportError(
            f"--group-size {wanted} does not divide the input channels of this model's "
            f"matrices ({misfits}): use {use}"
        )
    if fit < 16:
        raise ExportError(
            f"int4 groups of {wanted} do not fit this model's matrices ({misfits}), nor do "
            f"groups of 16 or more: use {per_channel}, or --weights int8"
        )
    log.warning(
        "int4 groups of %d channels instead of %d: %d does not divide %s (see --group-size)",
        fit,
        wanted,
        wanted,
        misfits,
    )
    return weights.model_copy(update={"group_size": fit})


@dataclass
class _Resolved:
    """What an export is made of, read from the configs (no weights, no torch): the plan."""

    out: Path
    source: ModelSource
    config: Any
    facts: ArchitectureFacts
    weights: WeightSpec
    plans: list[StagePlan]
    plan_text: str  # the plan as a table, printed unless quiet
    draft_source: ModelSource | None
    draft_config: Any
    started: float
    phases: dict[str, float]

    def weight_source(self) -> WeightSource:
        """The model's tensors, read one at a time as a stage asks for them."""
        from exporter.weights import GGUFSource, SafetensorsSource

        source: WeightSource
        if self.source.kind == "gguf":
            if self.weights.format == "gguf":
                form = self.weights.gguf_form or "exact"
                if form == "rounded":  # older manifests only: ExportOptions cannot ask for it
                    raise ExportError("--gguf-form rounded is no longer made: split or exact")
                source = GGUFSource(self.source.path, self.config, form)
            else:
                source = GGUFSource(self.source.path, self.config, dense=self.weights.format)
        else:
            source = SafetensorsSource(self.source.path, self.weights.format)
        # the family's checkpoints under the names the graph asks for (exporter/families/)
        gguf = self.source.kind == "gguf"
        return family(self.facts.model_type).adapt_source(source, self.config, gguf)


def _resolve(options: ExportOptions) -> _Resolved:
    started = time.perf_counter()
    if options.quiet:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    out = options.out.expanduser().resolve()
    _check_output(
        out, options.force or (options.reuse and (out / MANIFEST_NAME).is_file()), options.stage
    )
    source = resolve_source(options.model, options.cache_dir, progress=not options.quiet)
    config = source.load_config()
    facts = read_architecture(config)
    if source.kind == "gguf" and not facts.moe_layers:
        from exporter.weights import gguf_model_field

        if experts := gguf_model_field(source.path, "expert_count"):
            raise ExportError(
                f"{source.path.name} holds {experts} experts a layer (a mixture of experts, "
                f"e.g. Mixtral), which transformers reads as a dense {facts.model_type}: "
                "not supported from a GGUF; export the Hugging Face folder"
            )
    if options.max_context:
        facts = _with_context(facts, options.max_context)
    weights = _int4_groups(_weights(options, source), facts)
    context = options.plan_context or facts.max_context
    split = _resolve_split(options, facts, context, weights)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    step = 1
    if is_fractional(split):
        step = mlp_channel_step(facts.model_type, weights.format, weights.group_size)
    plans = plan_stages(facts, split, weights.format, facts.intermediate_size, context, tied, step)
    if options.node_memory:
        check_fits(plans, options.node_memory, context)
    if options.stage is not None:
        if options.draft:
            raise ExportError(
                "--stage exports one stage of the target; export the draft on the gateway's PC "
                "with its own `pipeshard export DRAFT --out DIR` and pass DIR to --draft there"
            )
        if not 0 <= options.stage < len(plans):
            raise ExportError(f"--stage {options.stage}: the plan has stages 0-{len(plans) - 1}")
    label = weights.format + (f" ({weights.gguf_form})" if weights.gguf_form else "")
    if weights.format == "int4":
        groups = weights.group_size or 0
        label += f" ({'groups of ' + str(groups) if groups > 0 else 'per channel'})"
    plan_text = (
        f"plan for {source.model_id} ({facts.model_type}, {facts.num_layers} layers, "
        f"{label}):\n{format_plan(plans, context, facts.intermediate_size)}"
    )
    if facts.nextn_layers:
        plan_text += (
            f"\n  skipped: {facts.nextn_layers} NextN/MTP layer(s) stored after layer "
            f"{facts.num_layers - 1} (multi-token prediction, not part of the model's output)"
        )
    for entry in weights.gguf_types or []:
        kind = "matrices" if entry.matrix else "1-D"
        plan_text += (
            f"\n  {entry.type} {kind} x{entry.tensors}: {entry.becomes} ({entry.exactness})"
        )

    draft_source = draft_config = None
    if options.draft:
        draft_source = resolve_source(options.draft, options.cache_dir, not options.quiet)
        draft_config = draft_source.load_config()
        read_architecture(draft_config)
    phases = {"resolve": time.perf_counter() - started}
    r = _Resolved(
        out,
        source,
        config,
        facts,
        weights,
        plans,
        plan_text,
        draft_source,
        draft_config,
        started,
        phases,
    )
    if options.stage is not None and (out / MANIFEST_NAME).is_file() and not options.force:
        _check_same_export(r, options)
    return r


def _check_same_export(r: _Resolved, options: ExportOptions) -> None:
    """A stage goes into a folder holding other stages only if they are of the same export."""
    try:
        existing = load_manifest(r.out)
    except ValueError as exc:
        raise ExportError(f"{r.out} holds an unreadable export ({exc}); use --force") from exc
    if _reusable(r.out, r.source, r.plans, r.weights, options, None) is None:
        raise ExportError(
            f"{r.out} holds another export ({existing.model.model_id}, {existing.num_stages} "
            f"stages, {existing.weights.format}); use another --out or --force"
        )


def _reused(options: ExportOptions, r: _Resolved) -> ExportReport | None:
    existing = _reusable(r.out, r.source, r.plans, r.weights, options, r.draft_source)
    if existing is None:
        return None
    if options.stage is not None and not (r.out / f"stage-{options.stage}").is_dir():
        return None
    if options.stage is None and not all(
        (r.out / s.directory / "model.xml").is_file() for s in existing.stages
    ):
        return None
    if not options.quiet:
        print(f"{r.plan_text}\n{r.out} already holds this export; reusing it", flush=True)
    return ExportReport(existing, r.plans, time.perf_counter() - r.started, r.phases, True)


def reusable_export(options: ExportOptions) -> ExportReport | None:
    """The export already in ``options.out`` that these options would write (saying so with
    the plan, as ``--reuse`` does), or None (printing nothing) where export_model would have
    to export. Reads configs only, so it is quick: the gateway of `pipeshard up` checks this
    itself and runs the export in a child only where one is needed. Raises ExportError on
    bad input."""
    return _reused(options, _resolve(replace(options, reuse=True)))


def export_model(options: ExportOptions) -> ExportReport:
    """Run a whole export (or, with ``options.stage``, one stage of it); raises ExportError
    (one-line reason) on bad input. Stages are built one after another from their own tensors,
    so memory holds one stage at a time."""
    r = _resolve(options)
    if options.reuse:
        reused = _reused(options, r)
        if reused is not None:
            return reused
    if not options.quiet:
        print(r.plan_text, flush=True)
    out, source, config, plans = r.out, r.source, r.config, r.plans
    started, phases = r.started, r.phases

    t0 = time.perf_counter()
    tokenizer = source.load_tokenizer()
    if r.draft_source is not None:
        draft_tok = r.draft_source.load_tokenizer()
        _check_draft_vocab(tokenizer, config, draft_tok, r.draft_config)
    phases["tokenizer"] = time.perf_counter() - t0

    selected = plans if options.stage is None else [plans[options.stage]]
    if options.stage is None:
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    else:  # one stage into an export folder that may hold the others already
        tmp = out
        tmp.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        recipe = read_recipe(config, r.facts.max_context)
        stage_sizes = {}
        for plan in _progress(selected, f"export {source.model_id}", options.quiet):
            stage_sizes[plan.index] = _export_stage(r, recipe, plan, tmp, options)
        phases["convert"] = time.perf_counter() - t0
        tokenizer_spec = _export_tokenizer(tokenizer, config, tmp)

        draft_entry = None
        if r.draft_source is not None:
            t0 = time.perf_counter()
            draft_report = export_model(
                ExportOptions(
                    model=options.draft or "",
                    out=tmp / "draft",
                    stages=1,
                    weights=options.weights,
                    gguf_form=options.gguf_form,
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

        manifest = _manifest(r, options, tokenizer_spec, draft_entry)
        _write_manifest(tmp, manifest)
        if options.stage is None:
            if out.exists():
                shutil.rmtree(out)
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, out)
    except BaseException:
        if options.stage is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    report = ExportReport(manifest, plans, time.perf_counter() - started, phases)
    report.stage_bytes = stage_sizes
    return report


def _export_stage(
    r: _Resolved, recipe: Recipe, plan: StagePlan, root: Path, options: ExportOptions
) -> int:
    """Build, compress (NNCF formats) and save one stage; its IR's bytes. The stage is written
    beside its final folder and renamed into place, so a failure leaves the old one (or none)."""
    import gc

    from exporter.compress import compress_stage, import_nncf, save_stage
    from exporter.graph import StageSpec, build_stage
    from exporter.stateful import make_stateful

    source = r.weight_source()
    spec = StageSpec(plan.layer_start, plan.layer_end, plan.mlp_in, plan.mlp_out)
    model = build_stage(recipe, source, spec)
    make_stateful(model, options.beam_idx)
    if options.quiet:
        import_nncf().set_log_level(logging.ERROR)
    model = compress_stage(model, r.weights, r.facts.vocab_size)
    folder = root / f"stage-{plan.index}"
    part = root / f".stage-{plan.index}.tmp-{os.getpid()}"
    shutil.rmtree(part, ignore_errors=True)
    try:
        save_stage(model, part)
        del model, source
        gc.collect()
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(part, folder)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def _manifest(
    r: _Resolved, options: ExportOptions, tokenizer: TokenizerSpec, draft: DraftEntry | None
) -> ShardManifest:
    """The export's manifest: from the plan and the source alone, so that it is the same
    whichever machine exports which stage."""
    import openvino as ov

    facts, plans = r.facts, r.plans
    stages = []
    for plan in plans:
        first, last = plan.index == 0, plan.index == len(plans) - 1
        inputs = ["input_ids" if first else "inputs_embeds", "attention_mask", "position_ids"]
        inputs += ["num_logits"] if last else []
        inputs += ["beam_idx"] if options.beam_idx else []
        stages.append(
            StageEntry(
                index=plan.index,
                layer_start=plan.layer_start,
                layer_end=plan.layer_end,
                mlp_in=plan.mlp_in,
                mlp_out=plan.mlp_out,
                directory=f"stage-{plan.index}",
                inputs=inputs,
                outputs=["logits" if last else "hidden_states"],
                beam_idx=options.beam_idx,
            )
        )
    return ShardManifest(
        model=ModelSpec(
            model_id=r.source.model_id,
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
            intermediate_size=facts.intermediate_size,
        ),
        weights=r.weights,
        stages=stages,
        tokenizer=tokenizer,
        source=SourceSpec(kind=r.source.kind, path=str(r.source.path), sha256=r.source.sha256),
        draft=draft,
        exporter_version=EXPORTER_VERSION,
        openvino_version=ov.get_version(),
    )


def _write_manifest(root: Path, manifest: ShardManifest) -> None:
    part = root / f".{MANIFEST_NAME}.tmp-{os.getpid()}"
    part.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(part, root / MANIFEST_NAME)
    load_manifest(root)  # what we wrote must read back


def _reusable(
    out: Path,
    source: ModelSource,
    plans: list[StagePlan],
    weights: WeightSpec,
    options: ExportOptions,
    draft: ModelSource | None,
) -> ShardManifest | None:
    """The manifest in ``out`` if it is the export these options would write, else None. An
    export with a draft serves without one too (``pipeshard up --no-draft``)."""
    try:
        manifest = load_manifest(out)
    except ValueError:
        return None
    same_source = (
        manifest.source.sha256 == source.sha256
        if source.sha256
        else manifest.source.path == str(source.path)
    )
    same = (
        same_source
        and [(s.layer_start, s.layer_end, s.mlp_in, s.mlp_out) for s in manifest.stages]
        == [(p.layer_start, p.layer_end, p.mlp_in, p.mlp_out) for p in plans]
        and manifest.weights == weights
        and all(s.beam_idx == options.beam_idx for s in manifest.stages)
        and (options.max_context is None or manifest.model.max_context == options.max_context)
        and (
            draft is None
            or (manifest.draft is not None and manifest.draft.model_id == draft.model_id)
        )
    )
    return manifest if same else None


def _with_context(facts: ArchitectureFacts, max_context: int) -> ArchitectureFacts:

    if max_context < 1:
        raise ExportError(f"--max-context must be positive, got {max_context}")
    return replace(facts, max_context=max_context)
