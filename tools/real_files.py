"""The real GGUF files proven against transformers, and the one way a test runs them.

Three files, each fetched on first use into the user's cache (never the repository)
and checked against transformers' GGUF loader, which dequantizes the same file to
float32 and runs its own model:

- ``smollm2-q4_1``: SmolLM2-135M-Instruct Q4_1, one wheel (``tools/smollm2.py``);
- ``qwen2.5-coder-0.5b-instruct-q4_k_m``: Qwen2.5-Coder-0.5B-Instruct Q4_K_M, six
  parts (``triollm.bench.realmodels``);
- ``gemma3-270m``: Gemma 3 270M base Q4_K_M, four parts (``tools/gemma3_270m.py``).

``tools/make_real_reference.py NAME`` records transformers' answers into
``tests/fixtures/gguf/NAME-greedy.json``; the tests (``tests/model/test_real_qwen05.py``,
``test_real_gemma3.py``, ``tests/server/test_smollm2_gguf.py``) load the file with
:func:`load_or_skip_reason`, read the records with :func:`reference` and run
:func:`greedy_together`. The tests import this module from ``tools/`` as they import
the fetchers.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
REFERENCES = ROOT / "tests" / "fixtures" / "gguf"
BLOCK = 32
# SmolLM2's wheel publishes no hash: the one its reference was recorded from (02 Dec 2026)
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
sys.path.insert(0, str(ROOT / "tools"))


@dataclass(frozen=True)
class RealFile:
    """One real file: how to have it, and the bytes its reference was recorded from."""

    name: str  # the reference's stem, make_real_reference.py's argument
    fetch: Callable[[], Path]  # the path, downloading first if needed; OSError if it cannot
    sha256: str | None  # of the file the reference came from (None: not recorded)
    source: str  # where it comes from, for a skip's reason


def _smollm2() -> Path:
    import smollm2

    return smollm2.fetch()


def _qwen05() -> Path:
    from triollm.bench import realmodels

    try:
        return realmodels.fetch(realmodels.QWEN_05B)
    except realmodels.FetchError as exc:  # a RuntimeError: one exception family for callers
        raise OSError(str(exc)) from None


def _gemma3() -> Path:
    import gemma3_270m

    return gemma3_270m.fetch()


def _files() -> dict[str, RealFile]:
    import gemma3_270m
    import smollm2

    from triollm.bench import realmodels

    qwen = realmodels.MODELS[realmodels.QWEN_05B]
    return {
        f.name: f
        for f in (
            RealFile("smollm2-q4_1", _smollm2, SMOLLM2_SHA256, f"{smollm2.SPEC} from PyPI"),
            RealFile(qwen.name, _qwen05, qwen.sha256, f"PyPI parts {qwen.package_prefix}1.."),
            RealFile(
                "gemma3-270m", _gemma3, gemma3_270m.SHA256, f"PyPI {gemma3_270m.PACKAGES[0]}.."
            ),
        )
    }


def real_file(name: str) -> RealFile:
    files = _files()
    if name not in files:
        raise SystemExit(f"unknown real file {name!r} (known: {', '.join(files)})")
    return files[name]


def load_or_skip_reason(name: str) -> tuple[Any, str]:
    """(the loaded model, "") or (None, why the file cannot be had).

    Loaded with float32 activations (``exact_activations``): the claim is
    transformers' numbers, token for token, and transformers keeps x float32."""
    f = real_file(name)
    try:
        path = f.fetch()
    except Exception as exc:  # pip, zip, network, disk: every way a fetch fails skips
        return None, f"{name} ({f.source}) unobtainable: {type(exc).__name__}: {exc}"
    from triollm.model.loader import load_model

    return load_model(path, exact_activations=True), ""


def reference(name: str) -> list[dict[str, Any]]:
    """The recorded transformers answers; their sha256 must be the file's (same bytes)."""
    ref = json.loads((REFERENCES / f"{name}-greedy.json").read_text())
    want = real_file(name).sha256
    if want is not None and ref.get("sha256") != want:
        raise AssertionError(
            f"{name}: reference recorded from sha256 {ref.get('sha256')}, the file is {want}"
        )
    return list(ref["records"])


def greedy_together(loaded: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Greedy continuations of every prompt, all sequences in each step (a ragged batch).

    Each runs for exactly its length (the recorded answer's, which ends at EOS when
    transformers' generate stopped there; an early EOS of ours shows as a mismatch).
    The KV cache is float32: a 16-bit cache rounds K/V, and the claim is
    transformers' arithmetic (``test_kv_dtype.py`` bounds the default cache)."""
    from triollm.model.kvstore import KVDtype, PagedKVCache
    from triollm.plan import ChunkPlan

    tables, start = [], 0
    for p, n in zip(prompts, lengths, strict=True):
        blocks = -(-(len(p) + n) // BLOCK)
        tables.append(tuple(range(start, start + blocks)))
        start += blocks
    kv = PagedKVCache(loaded.config, start, BLOCK, KVDtype.F32)
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    chunks = {
        i: ChunkPlan(i, tuple(p), 0, tables[i], sample=True, prefill=True)
        for i, p in enumerate(prompts)
    }
    while live:
        logits = loaded.model.forward([chunks[i] for i in live], kv)
        still = []
        for row, i in enumerate(live):
            t = int(np.argmax(logits[row]))
            out[i].append(t)
            if len(out[i]) < lengths[i]:
                still.append(i)
                pos = len(prompts[i]) + len(out[i]) - 1
                chunks[i] = ChunkPlan(i, (t,), pos, tables[i], sample=True, prefill=False)
        live = still
    return out
