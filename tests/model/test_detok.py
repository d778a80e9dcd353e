"""The incremental detokenizer streams exactly the text a full decode gives, a character
at a time, never half a character and never a missing space.

Two tiny tokenizers are trained here with the ``tokenizers`` library on text full of
emoji and CJK, so that their vocabularies contain pieces of multi-byte characters:

- a GPT-2-style byte-level BPE ("Ġ" marks a space, bytes are ordinary tokens);
- a Llama-2-style SentencePiece BPE ("▁" metaspace, "<0xNN>" byte-fallback tokens, and a
  decoder that strips the first token's leading space).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from triollm.model.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Emoji: 😀 😃 🎉 🚀 👍🏽 and ❤️ hearts 😀😀 🎉🎉",
    "中文字符 汉字 日本語 かな 한국어 漢字中文",
    "café naïve résumé — “quotes” … ünïcödé",
    "the the the cat sat on the mat 12345 67890",
] * 20


def make_byte_level(d: Path) -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(CORPUS, trainer)
    d.mkdir(parents=True, exist_ok=True)
    hf.save(str(d / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(d)


def make_metaspace(d: Path, *, legacy_decoder: bool = True) -> Tokenizer:
    """Llama-2 style by default; ``legacy_decoder=False`` uses the Metaspace decoder
    (newer Mistral/T5-style tokenizer.json files), which drops the first space itself."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    hf.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    data = json.loads(hf.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    if legacy_decoder:
        steps = [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]
    else:
        steps = [
            {"type": "ByteFallback"},
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
        ]
    data["decoder"] = {"type": "Sequence", "decoders": steps}
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(json.dumps(data))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_byte_level(tmp_path_factory.mktemp("bytelevel"))


@pytest.fixture(scope="module")
def metaspace(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_metaspace(tmp_path_factory.mktemp("metaspace"))


@pytest.fixture(scope="module")
def metaspace_decoder(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_metaspace(tmp_path_factory.mktemp("metaspace2"), legacy_decoder=False)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.push(t) for t in ids] + [detok.flush()]


def byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the byte-level token that spells one raw byte (GPT-2's byte-to-char map)."""
    char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins
    table = _bytes_to_unicode()
    tid = tok._hf.token_to_id(table[byte])
    assert tid is not None and table[byte] in char
    return int(tid)


def _bytes_to_unicode() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def test_an_emoji_split_over_byte_tokens_is_held_back_until_complete(
    byte_level: Tokenizer,
) -> None:
    # "😀" is F0 9F 98 80: four byte tokens. Decoded alone, each is U+FFFD.
    ids = [byte_token(byte_level, b) for b in "😀".encode()]
    assert byte_level.decode(ids[:1]) == "\ufffd"
    assert stream(byte_level, [], ids) == ["", "", "", "😀", ""]


def test_an_unfinished_character_at_the_end_is_flushed_as_the_full_decode_shows_it(
    byte_level: Tokenizer,
) -> None:
    ids = [byte_token(byte_level, b) for b in "😀".encode()[:2]]
    pieces = stream(byte_level, [], ids)
    assert pieces[:-1] == ["", ""]
    assert pieces[-1] == byte_level.decode(ids) == "\ufffd"


def test_metaspace_keeps_the_space_a_lone_decode_would_drop(metaspace: Tokenizer) -> None:
    prompt = metaspace.encode("Hello cat")
    (the,) = metaspace.encode("the", add_special_tokens=False)
    assert metaspace.token_text(the) == "▁the"
    assert metaspace.decode([the]) == "the"  # the trap: a lone decode loses the space
    assert stream(metaspace, prompt, [the]) == [" the", ""]


def test_byte_level_keeps_the_space_of_a_g_token(byte_level: Tokenizer) -> None:
    prompt = byte_level.encode("Hello")
    ids = byte_level.encode(" world", add_special_tokens=False)
    assert "".join(stream(byte_level, prompt, ids)) == " world"


def test_byte_fallback_characters_arrive_whole(metaspace: Tokenizer) -> None:
    # "🦀" is not in the training corpus: SentencePiece spells it as four <0xNN> tokens.
    ids = metaspace.encode("crab 🦀 ok", add_special_tokens=False)
    assert any(metaspace.token_text(t) == "<0xF0>" for t in ids)
    pieces = stream(metaspace, [], ids)
    assert "".join(pieces) == "crab 🦀 ok"
    assert "🦀" in pieces[ids.index(metaspace.encode(" ok", add_special_tokens=False)[0])]
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_skipped_like_decode_skips_them(metaspace: Tokenizer) -> None:
    eos = next(iter(metaspace.eos_token_ids))
    ids = metaspace.encode("the cat", add_special_tokens=False)
    pieces = stream(metaspace, [], [ids[0], eos, *ids[1:], eos])
    assert "".join(pieces) == metaspace.decode(ids) == "the cat"


@pytest.mark.parametrize("text", ["Emoji: 😀 🎉🎉 中文字符 done", "café — 汉字 🚀👍🏽!"])
@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_real_text_streams_back_exactly(
    kind: str, text: str, request: pytest.FixtureRequest
) -> None:
    tok: Tokenizer = request.getfixturevalue(kind)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, [], ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def check_stream_against_full_decode(tok: Tokenizer, prompt: list[int], ids: list[int]) -> None:
    pieces = stream(tok, prompt, ids)
    prompt_text = tok.decode(prompt)
    full = tok.decode(prompt + ids)
    if prompt:
        # The continuation is only well defined when the prompt's own text is a prefix
        # (a prompt that ends mid-character changes when the answer completes it).
        if not full.startswith(prompt_text) or prompt_text.endswith("\ufffd"):
            return
        expected = full[len(prompt_text) :]
    else:
        expected = full
    assert "".join(pieces) == expected
    # Streaming never takes text back: everything sent so far is a prefix of the answer,
    # so no U+FFFD is ever sent that the final text does not contain at that place.
    sent = ""
    for piece in pieces:
        sent += piece
        assert expected.startswith(sent)


token_lists = st.lists(st.integers(0, 419), max_size=16)
fast = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast
@given(ids=token_lists, prompt=st.lists(st.integers(0, 419), max_size=4))
def test_byte_level_stream_equals_full_decode(
    byte_level: Tokenizer, ids: list[int], prompt: list[int]
) -> None:
    check_stream_against_full_decode(byte_level, [], ids)
    check_stream_against_full_decode(byte_level, prompt, ids)


@fast
@given(
    ids=st.lists(st.integers(0, 461), max_size=16),
    prompt=st.lists(st.integers(0, 461), max_size=4),
)
def test_metaspace_stream_equals_full_decode(
    metaspace: Tokenizer, ids: list[int], prompt: list[int]
) -> None:
    assert metaspace.vocab_size == 462
    check_stream_against_full_decode(metaspace, [], ids)
    check_stream_against_full_decode(metaspace, prompt, ids)


@fast
@given(
    ids=st.lists(st.integers(0, 461), max_size=16),
    prompt=st.lists(st.integers(0, 461), max_size=4),
)
def test_metaspace_decoder_stream_equals_full_decode(
    metaspace_decoder: Tokenizer, ids: list[int], prompt: list[int]
) -> None:
    check_stream_against_full_decode(metaspace_decoder, [], ids)
    check_stream_against_full_decode(metaspace_decoder, prompt, ids)


def test_the_metaspace_decoder_also_drops_a_lone_tokens_space(
    metaspace_decoder: Tokenizer,
) -> None:
    (the,) = metaspace_decoder.encode("the", add_special_tokens=False)
    assert metaspace_decoder.decode([the]) == "the"
    prompt = metaspace_decoder.encode("Hello cat")
    assert "".join(stream(metaspace_decoder, prompt, [the])) == " the"


@fast
@given(text=st.text(st.sampled_from("ab 😀🎉中文字한\n"), max_size=20))
def test_encoded_text_with_split_characters_streams_back_exactly(
    byte_level: Tokenizer, text: str
) -> None:
    ids = byte_level.encode(text, add_special_tokens=False)
    pieces = stream(byte_level, [], ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_token_bytes_reads_a_byte_fallback_spelling(metaspace: Tokenizer) -> None:
    ids = metaspace.encode("🦀", add_special_tokens=False)
    spelled = [metaspace.token_bytes(t) for t in ids if metaspace.token_text(t) != "▁"]
    assert b"".join(b for b in spelled if b is not None) == "🦀".encode()
    (the,) = metaspace.encode("the", add_special_tokens=False)
    assert metaspace.token_bytes(the) is None  # "▁the" spells no bytes


def test_token_bytes_inverts_the_byte_level_alphabet(byte_level: Tokenizer) -> None:
    ids = [byte_token(byte_level, b) for b in "😀".encode()]
    assert b"".join(byte_level.token_bytes(t) or b"?" for t in ids) == "😀".encode()
    (world,) = byte_level.encode(" world", add_special_tokens=False)
    assert byte_level.token_bytes(world) == b" world"  # "Ġworld": Ġ is the shifted space
    assert byte_level.token_bytes(10**9) is None
