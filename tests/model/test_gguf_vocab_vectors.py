"""Real vocabularies: a GGUF file's tokenizer gives the ids its model's own tokenizer gives.

The files are llama.cpp's tokenizer test vectors (``tools/llama_vocab.py`` fetches
them from the ``llama-cpp-python`` sdist on PyPI, once): vocabulary-only GGUF files
of real models, each with a corpus and the ids the model's Hugging Face tokenizer
gives for it (``add_special_tokens=False``). The corpus is llama.cpp's: whitespace
runs, tabs and newlines, several scripts, emoji, code, numbers, a long mixed text.
Skipped, saying why, when the sdist cannot be had.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from triollm.errors import ModelLoadError
from triollm.model.gguf import GGUFFile
from triollm.model.gguf_tokenizer import tokenizer_from_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from llama_vocab import cases, fetch_or_skip_reason

# the vocabulary file -> what it is (tokenizer.ggml.model / tokenizer.ggml.pre)
SUPPORTED = {
    "llama-spm": "Llama 2, SentencePiece BPE with byte fallback (llama)",
    "phi-3": "Phi-3, SentencePiece BPE (llama)",
    "llama-bpe": "Llama 3, byte-level BPE, its own split, whole-word tokens (gpt2 / llama-bpe)",
    "qwen2": "Qwen2, byte-level BPE, NFC, single digits (gpt2 / qwen2)",
    "starcoder": "StarCoder, every digit alone, as SmolLM2 (gpt2 / starcoder)",
}
# gpt-2 and refact pass too (python tools/llama_vocab.py --check runs every file); left
# out here for time: their splits are GPT-2's and StarCoder's, covered above and by
# test_gguf_tokenizer.py.


@pytest.fixture(scope="module")
def vocabs() -> Path:
    where, why = fetch_or_skip_reason()
    if where is None:
        pytest.skip(why)
    return where


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_every_text_of_the_corpus_gets_the_models_own_ids(vocabs: Path, name: str) -> None:
    path = vocabs / f"ggml-vocab-{name}.gguf"
    tokenizer = tokenizer_from_gguf(GGUFFile(path))
    wrong = [
        (text, ids, ours)
        for text, ids in cases(path)
        if (ours := list(tokenizer.encode(text, add_special_tokens=False))) != ids
    ]
    assert len(cases(path)) >= 40
    assert wrong == [], f"{SUPPORTED[name]}: {len(wrong)} texts differ, first: {wrong[0]}"


def test_a_vocabulary_of_an_unsupported_kind_is_refused_by_name(vocabs: Path) -> None:
    path = vocabs / "ggml-vocab-bert-bge.gguf"
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model 'bert' is not supported"):
        tokenizer_from_gguf(GGUFFile(path))
