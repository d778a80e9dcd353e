"""A GGUF file's tokenizer, rebuilt as a ``tokenizers`` pipeline.

A GGUF file carries no ``tokenizer.json``; it carries the pieces
(``tokenizer.ggml.*`` metadata): the model kind, the token strings, their
types, the BPE merges or the SentencePiece scores, the special token ids,
whether BOS is added, and ``tokenizer.chat_template``. We assemble from them
the same pipeline the model's ``tokenizer.json`` describes, out of the Rust
``tokenizers`` library's parts, and hand it to the project's
:class:`~triollm.model.tokenizer.Tokenizer`, so nothing above this module
knows where a tokenizer came from.

Two model kinds:

- ``gpt2``: byte-level BPE (SmolLM2, Llama 3, Qwen2/3). The tokens are
  already spelled in GPT-2's byte alphabet and the merges are listed. What
  the file does not spell out is how text is split before BPE; it names it
  instead (``tokenizer.ggml.pre``), and :data:`PRE_TOKENIZERS` maps each name
  we support to the split its ``tokenizer.json`` uses.
- ``llama``: SentencePiece-style BPE (Llama 2, Mistral, TinyLlama): ``▁``
  for spaces, a prepended ``▁``, byte fallback to ``<0xNN>`` tokens. The file
  has scores but no merges; a piece's merge rank is its score order, so the
  merges are recovered from the vocabulary (``tokenizers``' own
  ``SentencePieceBPE`` conversion does the same).

Token types (``tokenizer.ggml.token_type``): 3 (control) are special tokens,
4 (user-defined) are added tokens matched whole; both are never split.

Proof: ``tests/model/test_gguf_tokenizer.py`` writes GGUF files from
``tokenizer.json`` models and checks equal ids on a corpus of code, several
languages, emoji, whitespace runs and special tokens; and
``tests/model/test_gguf_vocab_vectors.py`` takes real models' vocabularies
(Llama 2 and Phi-3 SentencePiece, Llama 3, Qwen2, StarCoder) from llama.cpp's
tokenizer test files, with the ids each model's own tokenizer gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from triollm.errors import ModelLoadError

if TYPE_CHECKING:
    from triollm.model.gguf import GGUFFile
    from triollm.model.tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> Any:
    # GPT-2's own regex is the one ByteLevel applies with use_regex=True
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2() -> Any:
    # StarCoder / SmolLM: every digit alone, then GPT-2's split
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _regex_split(pattern: str) -> Any:
    def build() -> Any:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


@dataclass(frozen=True)
class PreSplit:
    """What a ``tokenizer.ggml.pre`` name stands for in its model's ``tokenizer.json``."""

    build: Callable[[], Any]  # the pre-tokenizer
    nfc: bool = False  # an NFC normalizer first (Qwen2)
    # A word that is itself in the vocabulary is one token, merges or not (Llama 3's
    # ``"ignore_merges": true``): "ệt" is a Llama 3 token no merge sequence reaches.
    ignore_merges: bool = False


_GPT2 = PreSplit(_gpt2_split)
_DIGITS = PreSplit(_digits_then_gpt2)
_LLAMA3_SPLIT = PreSplit(_regex_split(_LLAMA3), ignore_merges=True)
_QWEN2_SPLIT = PreSplit(_regex_split(_QWEN2), nfc=True)

PRE_TOKENIZERS: dict[str, PreSplit] = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _DIGITS,
    "starcoder": _DIGITS,
    "refact": _DIGITS,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,  # a Llama 3 fine-tune: Llama 3's tokenizer
    "dbrx": PreSplit(_regex_split(_LLAMA3)),
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def tokenizer_from_gguf(file: GGUFFile) -> Tokenizer:
    """The project's Tokenizer for a GGUF file's ``tokenizer.ggml.*`` metadata."""
    from triollm.model.tokenizer import Tokenizer

    g = file.get
    kind = g("tokenizer.ggml.model", "str")
    tokens: list[str] = list(g("tokenizer.ggml.tokens", "array[str]"))
    types: list[int] = list(g("tokenizer.ggml.token_type", "array[int]", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"{file.path}: metadata key 'tokenizer.ggml.token_type' has {len(types)} entries "
            f"for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        hf = _byte_level_bpe(file, tokens)
        byte_fallback = False
    elif kind == "llama":
        hf = _sentencepiece_bpe(file, tokens)
        byte_fallback = True
    else:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)"
        )
    # control and user-defined tokens: matched whole in text, never split
    added = [
        AddedToken(tok, special=t == _CONTROL, normalized=False)
        for tok, t in zip(tokens, types, strict=True)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    hf.add_special_tokens([a for a in added if a.special])
    hf.add_tokens([a for a in added if not a.special])

    def token_of(key: str) -> str | None:
        tid = g(key, "int", None)
        if tid is None:
            return None
        if not 0 <= tid < len(tokens):
            raise ModelLoadError(
                f"{file.path}: metadata key {key!r} is {tid}, outside the vocabulary "
                f"(0..{len(tokens) - 1})"
            )
        return tokens[tid]

    special = {
        field: text
        for field, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
        )
        if (text := token_of(key)) is not None
    }
    eos_ids = [g("tokenizer.ggml.eos_token_id", "int")] if "eos_token" in special else []
    eot = token_of("tokenizer.ggml.eot_token_id")  # end of turn (Llama 3's <|eot_id|>)
    if eot is not None:
        eos_ids.append(tokens.index(eot))
    # llama.cpp's default when the key is absent: SentencePiece models add BOS, BPE ones not
    add_bos = bool(g("tokenizer.ggml.add_bos_token", "bool", kind == "llama"))
    template = g("tokenizer.chat_template", "str", None)
    return Tokenizer(
        hf,
        bos_token=special.get("bos_token"),
        eos_tokens=[special["eos_token"]] if "eos_token" in special else [],
        eos_token_ids=eos_ids,
        add_bos=add_bos,
        chat_templates={"default": template} if template is not None else {},
        special_token_strings=special,
        byte_fallback=byte_fallback,
        source=str(file.path),
    )


def _byte_level_bpe(file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    merges_text: list[str] = list(file.get("tokenizer.ggml.merges", "array[str]"))
    merges = []
    for i, m in enumerate(merges_text):
        left, sep, right = m.partition(" ")
        if not sep:
            raise ModelLoadError(
                f"{file.path}: tokenizer.ggml.merges[{i}] is {m!r}, not two tokens"
            )
        merges.append((left, right))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pre = file.get("tokenizer.ggml.pre", "str", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{file.path}: tokenizer.ggml.pre {pre!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    split = PRE_TOKENIZERS[pre]
    hf = HFTokenizer(
        models.BPE(
            vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=split.ignore_merges
        )
    )
    if split.nfc:
        hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = split.build()
    hf.decoder = decoders.ByteLevel()
    return hf


def _sentencepiece_bpe(file: GGUFFile, tokens: list[str]) -> HFTokenizer:
    scores = list(file.get("tokenizer.ggml.scores", "array[float]"))
    if len(scores) != len(tokens):
        raise ModelLoadError(
            f"{file.path}: metadata key 'tokenizer.ggml.scores' has {len(scores)} entries "
            f"for {len(tokens)} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(tokens)}
    # A merge (a, b) exists when a + b is a piece; pieces with higher scores merge first
    # (ties: the lower id first), the rank SentencePiece's own BPE uses.
    ranked = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], pid, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk = file.get("tokenizer.ggml.unknown_token_id", "int", None)
    hf = HFTokenizer(
        models.BPE(
            vocab,
            merges,
            unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    add_prefix = bool(file.get("tokenizer.ggml.add_space_prefix", "bool", True))
    steps: list[Any] = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    hf.normalizer = normalizers.Sequence(steps)
    parts = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        parts.append(decoders.Strip(content=" ", left=1, right=0))
    hf.decoder = decoders.Sequence(parts)
    return hf
