"""Logprobs entries: byte tokens keep their own bytes and distinct names; text_offset
indexes the returned text. The texts come with the deltas (``output.Describer``, the
output processor's), the entries from them (``responses.py``)."""

from __future__ import annotations

from functools import partial
from typing import Any

from triollm.events import Delta, TokenInfo
from triollm.model.tokenizer import IncrementalDetokenizer
from triollm.output import Describer
from triollm.request import GenerationRequest, ServedModel
from triollm.server.responses import ResponseWriter


def writer(loaded: Any, kind: str, logprobs: int) -> ResponseWriter:
    model = ServedModel("m", loaded.tokenizer, 256, 0)
    req = GenerationRequest(kind=kind, model=None, prompt_text="x", logprobs=logprobs)  # type: ignore[arg-type]
    return ResponseWriter(req, model, stream=None)  # type: ignore[arg-type]


def described(loaded: Any, delta: Delta) -> Delta:
    tok = loaded.tokenizer
    return Describer(tok, partial(IncrementalDetokenizer, tok)).delta(delta)


def test_byte_tokens_have_their_own_bytes_and_distinct_keys(loaded):
    hf = loaded.tokenizer._hf
    e2, c3 = hf.token_to_id("â"), hf.token_to_id("Ã")  # bytes 0xE2 and 0xC3, half characters
    assert loaded.tokenizer.decode([e2]) == loaded.tokenizer.decode([c3]) == "\ufffd"
    info = TokenInfo(e2, -0.5, ((e2, -0.5), (c3, -1.5)))

    chat = writer(loaded, "chat", 2)._logprobs(described(loaded, Delta("", (info,))))
    assert chat is not None
    entry = chat["content"][0]
    assert entry["bytes"] == [0xE2] and entry["token"] == "bytes:\\xe2"
    assert [alt["bytes"] for alt in entry["top_logprobs"]] == [[0xE2], [0xC3]]

    completion = writer(loaded, "completion", 2)._logprobs(described(loaded, Delta("", (info,))))
    assert completion is not None
    assert completion["top_logprobs"] == [{"bytes:\\xe2": -0.5, "bytes:\\xc3": -1.5}]


def test_text_offset_indexes_the_returned_text(loaded):
    w = writer(loaded, "completion", 0)
    the = loaded.tokenizer._hf.token_to_id("Ġthe")
    e2 = loaded.tokenizer._hf.token_to_id("â")
    deltas = [
        Delta("", (TokenInfo(e2, -1.0, ()),)),  # held back (half a character): no text yet
        Delta("é the", (TokenInfo(the, -1.0, ()),)),
        Delta(" end", (TokenInfo(the, -1.0, ()),)),
    ]
    lps = [w._logprobs(described(loaded, d)) for d in deltas]
    offsets = [o for lp in lps for o in lp["text_offset"]]  # type: ignore[index]
    text = "".join(d.text for d in deltas)
    assert offsets == [0, 0, len("é the")]
    assert all(0 <= o <= len(text) for o in offsets)
