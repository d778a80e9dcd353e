"""A GGUF file's tokenizer gives the ids its model's own tokenizer.json gives.

The GGUF files are written from a fixture's ``tokenizer.json`` the way
llama.cpp's converter writes them (tokens, types, merges, ``pre``); for each
pre-tokenizer we support, the ``tokenizer.json`` is first given that split
(the spelling the Hub's SmolLM2 / Llama 3 / Qwen2 files use), so both sides
split the same way. The corpus: code, several languages and scripts, emoji,
whitespace runs, special tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
from gguf_files import read_checkpoint, write_gguf

from triollm.model.gguf import GGUFFile
from triollm.model.gguf_tokenizer import _LLAMA3, _QWEN2, tokenizer_from_gguf
from triollm.model.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "models"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Grüße aus Köln! Ça va très bien, merci. ¿Dónde está la estación?",
    "東京は日本の首都です。北京是中国的首都。",
    "Привет, мир! Как дела? مرحبا بالعالم",
    "emoji: 😀🎉👍🏽 🇫🇷 family: 👨‍👩‍👧‍👦",
    "spaces:    four, tab:\there, newlines:\n\n\n   and trailing   ",
    "\n\n\t \t\n",
    "numbers 1234567890 3.14159 1,000,000 and 2026-12-01",
    "It's, they're, we'll, I'd, you've, DON'T, Isn't",
    "<s>special</s> tokens inside <pad> text<s>",
    "<|im_start|>user\nHi<|im_end|>",
    "",
    " leading space",
]

PRE_SPLITS = {
    "gpt2": None,  # the fixture's own ByteLevel split
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            },
        ],
    },
    "llama-bpe": {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": _LLAMA3},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": False,
            },
        ],
    },
    "qwen2": {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": _QWEN2},
                "behavior": "Isolated",
                "invert": False,
            },
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
        ],
    },
}


# Merges the fixture's small vocabulary lacks, so that the splits differ in ids:
# runs of digits (split one by one, by three, or not at all) and of whitespace.
EXTRA_MERGES = [
    ("1", "2"),
    ("12", "3"),
    ("123", "4"),
    ("Ġ", "Ġ"),
    ("ĠĠ", "ĠĠ"),
    ("Ċ", "Ċ"),
    ("3", "."),
]


def model_dir_with_split(tmp_path: Path, name: str, pre: str) -> Path:
    d = tmp_path / f"{name}-{pre}"
    shutil.copytree(FIXTURES / name, d)
    tj = json.loads((d / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    next_id = max([*vocab.values(), *(a["id"] for a in tj["added_tokens"])]) + 1
    for left, right in EXTRA_MERGES:
        assert left in vocab and right in vocab
        vocab[left + right] = next_id
        next_id += 1
        tj["model"]["merges"].append(
            [left, right] if isinstance(tj["model"]["merges"][0], list) else f"{left} {right}"
        )
    if PRE_SPLITS[pre] is not None:
        tj["pre_tokenizer"] = PRE_SPLITS[pre]
    if pre == "qwen2":
        tj["normalizer"] = {"type": "NFC"}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    return d


@pytest.mark.parametrize("name", ["llama-gqa-f32", "qwen2-bias-f32"])
@pytest.mark.parametrize("pre", sorted(PRE_SPLITS))
def test_gguf_tokenizer_gives_the_ids_of_tokenizer_json(
    tmp_path: Path, name: str, pre: str
) -> None:
    d = model_dir_with_split(tmp_path, name, pre)
    config, tensors = read_checkpoint(d)
    path = tmp_path / "model.gguf"
    write_gguf(path, config, tensors, d, gguf.GGMLQuantizationType.F32, pre=pre)
    ours = tokenizer_from_gguf(GGUFFile(path))
    theirs = Tokenizer.from_dir(d)
    for text in CORPUS:
        assert ours.encode(text) == theirs.encode(text), text
        ids = theirs.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False
        )
    assert ours.bos_token_id == theirs.bos_token_id
    assert ours.add_bos == theirs.add_bos
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.special_token_ids == theirs.special_token_ids
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.encode_chat(messages) == theirs.encode_chat(messages)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    from triollm.errors import ModelLoadError

    config, tensors = read_checkpoint(FIXTURES / "llama-gqa-f32")
    path = tmp_path / "model.gguf"
    write_gguf(
        path,
        config,
        tensors,
        FIXTURES / "llama-gqa-f32",
        gguf.GGMLQuantizationType.F32,
        pre="falcon",
    )
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.pre 'falcon' is not supported"):
        tokenizer_from_gguf(GGUFFile(path))
