"""What the load generator sends: exact token-id prompts, mixed lengths, growing chats."""

from __future__ import annotations

import random

import pytest

from triollm.bench.workload import Api, Source, Span, Workload
from triollm.errors import UserError


def workload(**kw) -> Workload:
    args = {
        "api": Api.COMPLETIONS,
        "model": "m",
        "prompt_tokens": Span(32, 32),
        "max_tokens": Span(8, 8),
    } | kw
    return Workload(**args)


def test_a_token_id_prompt_has_exactly_the_asked_length_within_the_id_range() -> None:
    req = Source(workload(token_ids=Span(10, 20)), 0).single()
    assert len(req.body["prompt"]) == 32 and req.prompt_ids == tuple(req.body["prompt"])
    assert all(10 <= t <= 20 for t in req.prompt_ids)
    assert req.body["stream"] is True and req.body["stream_options"] == {"include_usage": True}
    assert req.body["ignore_eos"] is True and req.max_tokens == 8


def test_the_same_seed_sends_the_same_requests_to_every_server() -> None:
    a = [Source(workload(), 3).single().body for _ in range(1)]
    b = [Source(workload(), 3).single().body for _ in range(1)]
    assert a == b
    assert Source(workload(), 4).single().body != a[0]


def test_mixed_lengths_are_drawn_within_their_ranges_and_vary() -> None:
    src = Source(workload(prompt_tokens=Span(4, 64), max_tokens=Span(1, 16)), 0)
    reqs = [src.single() for _ in range(50)]
    lengths = {len(r.prompt_ids) for r in reqs}
    assert min(lengths) >= 4 and max(lengths) <= 64 and len(lengths) > 10
    assert {r.max_tokens for r in reqs} <= set(range(1, 17))


def test_a_conversation_sends_its_whole_history_growing_turn_by_turn() -> None:
    conv = Source(workload(api=Api.CHAT, turns=3, prompt_tokens=Span(5, 5)), 0).conversation()
    sizes = []
    while not conv.finished:
        req = conv.next_request()
        msgs = req.body["messages"]
        sizes.append(len(msgs))
        assert msgs[-1]["role"] == "user" and len(msgs[-1]["content"].split()) == 5
        assert req.turn == len(sizes)
        conv.answered(f"answer {req.turn}")
    assert sizes == [1, 3, 5]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["answer 1", "answer 2"]


def test_spans_parse_fixed_and_ranges_and_name_the_flag_when_wrong() -> None:
    assert Span.parse("32", "--prompt-tokens") == Span(32, 32)
    assert Span.parse("16-256", "--prompt-tokens").mixed
    assert Span(3, 9).draw(random.Random(0)) in range(3, 10)
    for bad in ("x", "0", "9-3", "4-"):
        with pytest.raises(UserError, match="--prompt-tokens"):
            Span.parse(bad, "--prompt-tokens")


def test_turns_need_the_chat_api() -> None:
    with pytest.raises(UserError, match="--turns needs --api chat"):
        workload(turns=2)


def test_a_word_prompt_is_made_of_whole_words_ids_cut_at_the_exact_length() -> None:
    words = ((5,), (6, 7), (8, 9, 10))
    src = Source(workload(word_ids=words, prompt_tokens=Span(4, 40)), 0)
    for _ in range(30):
        req = src.single()
        ids = req.prompt_ids
        assert ids is not None and 4 <= len(ids) <= 40 and req.body["prompt"] == list(ids)
        # every id but the cut last word's starts where a whole word does
        at = 0
        while at < len(ids):
            word = next(w for w in words if w[0] == ids[at])
            assert ids[at : at + len(word)] == word[: len(ids) - at]
            at += len(word)


def test_each_chunks_token_count_is_asked_for_unless_turned_off() -> None:
    assert Source(workload(), 0).single().body["timings_per_token"] is True
    assert "timings_per_token" not in Source(workload(timings_per_token=False), 0).single().body
