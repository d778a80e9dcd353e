"""On every committed fixture checkpoint, our tokenizer agrees with the prompt ids
transformers recorded, with transformers itself, and the detokenizer streams the
recorded continuations (random-weight gibberish full of split bytes) exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from triollm.model.tokenizer import IncrementalDetokenizer, Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCES = sorted((FIXTURES / "reference").glob("*.json"))


def load(ref_path: Path) -> tuple[dict[str, Any], Tokenizer, Path]:
    ref = json.loads(ref_path.read_text())
    model_dir = FIXTURES / "models" / ref["model"]
    return ref, Tokenizer.from_dir(model_dir), model_dir


pytestmark = pytest.mark.skipif(not REFERENCES, reason="fixtures not generated")


@pytest.mark.parametrize("ref_path", REFERENCES, ids=lambda p: p.stem)
def test_prompts_encode_to_the_ids_transformers_recorded(ref_path: Path) -> None:
    ref, tok, _ = load(ref_path)
    for prompt in ref["prompts"]:
        assert tok.encode(prompt["text"]) == prompt["prompt_ids"]


@pytest.mark.parametrize("ref_path", REFERENCES, ids=lambda p: p.stem)
def test_recorded_continuations_stream_back_exactly(ref_path: Path) -> None:
    ref, tok, _ = load(ref_path)
    for prompt in ref["prompts"]:
        detok = IncrementalDetokenizer(tok, prompt["prompt_ids"])
        pieces = [detok.push(t) for t in prompt["greedy_ids"]] + [detok.flush()]
        full = tok.decode(prompt["prompt_ids"] + prompt["greedy_ids"])
        prompt_text = tok.decode(prompt["prompt_ids"])
        assert full.startswith(prompt_text)
        assert "".join(pieces) == full[len(prompt_text) :]


@pytest.mark.parametrize("ref_path", REFERENCES, ids=lambda p: p.stem)
def test_fixture_tokenizers_agree_with_transformers(ref_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref, tok, model_dir = load(ref_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    msgs = [{"role": "user", "content": "Hi 😀, who runs next?"}]
    assert tok.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    for prompt in ref["prompts"]:
        text = prompt["text"]
        assert tok.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        )
        ids = prompt["greedy_ids"]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
