"""The text pipeline's rules (textstream.py), one sentence per test, with plain sync calls."""

from __future__ import annotations

import pytest

from triollm.plan import FinishReason
from triollm.textstream import StopMatcher, TextPiece, TextStream

EOS = 99


class FakeDetok:
    """Each id decodes to its entry in ``pieces``; ``held`` is what flush() releases
    (text a real detokenizer held back, e.g. half a UTF-8 character)."""

    def __init__(self, pieces: dict[int, str], held: str = "") -> None:
        self.pieces = pieces
        self.held = held
        self.pushed: list[int] = []

    def push(self, token_id: int) -> str:
        self.pushed.append(token_id)
        return self.pieces[token_id]

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def stream(pieces: dict[int, str], *, stops=(), held: str = "") -> tuple[TextStream, FakeDetok]:
    detok = FakeDetok(pieces, held)
    return TextStream(detok, stops=stops, stop_ids=frozenset({EOS})), detok


# -- the four rules ---------------------------------------------------------------------


def test_a_stop_id_ends_the_text_and_is_not_text() -> None:
    text, detok = stream({1: "hello"}, held=" wor")
    assert text.push(1) == TextPiece("hello")
    assert text.push(EOS) == TextPiece(" wor", FinishReason.STOP)  # the tail comes out with it
    assert EOS not in detok.pushed


def test_a_stop_string_split_across_tokens_is_held_back_and_never_sent() -> None:
    text, _ = stream({1: "hello E", 2: "N", 3: "D and more"}, stops=["END"])
    assert text.push(1) == TextPiece("hello ")
    assert text.push(2) == TextPiece("")
    assert text.push(3) == TextPiece("", FinishReason.STOP)


def test_held_text_that_cannot_become_a_stop_is_released() -> None:
    text, _ = stream({1: "abc EN", 2: "X"}, stops=["END"])
    assert text.push(1) == TextPiece("abc ")
    assert text.push(2) == TextPiece("ENX")


def test_the_end_releases_what_the_matcher_and_the_detokenizer_held() -> None:
    text, _ = stream({1: "abc EN"}, stops=["END"], held="!")
    text.push(1)
    assert text.finish(FinishReason.LENGTH) == TextPiece("EN!", FinishReason.LENGTH)


def test_a_stop_string_completed_by_the_flushed_tail_finishes_with_stop() -> None:
    text, _ = stream({1: "4 </ans"}, stops=["</answer>"], held="wer> more")
    assert text.push(1) == TextPiece("4 ")
    assert text.finish(FinishReason.LENGTH) == TextPiece("", FinishReason.STOP)


def test_a_stop_id_whose_tail_completes_a_stop_string_cuts_the_text_there() -> None:
    text, _ = stream({1: "ok EN"}, stops=["END"], held="D!")
    assert text.push(1) == TextPiece("ok ")
    assert text.push(EOS) == TextPiece("", FinishReason.STOP)


def test_nothing_may_be_pushed_after_the_text_ended() -> None:
    text, _ = stream({1: "x END"}, stops=["END"])
    assert text.push(1).finish is FinishReason.STOP
    with pytest.raises(RuntimeError, match="already ended"):
        text.push(1)
    with pytest.raises(RuntimeError, match="already ended"):
        text.finish(FinishReason.LENGTH)


def test_without_stop_ids_an_eos_id_is_ordinary_text() -> None:  # ignore_eos
    detok = FakeDetok({EOS: "<eos>"})
    text = TextStream(detok)
    assert text.push(EOS) == TextPiece("<eos>")


# -- rule 5: vLLM's include_stop_str_in_output and min_tokens -----------------------------


def test_include_stop_keeps_the_matched_stop_string_and_drops_what_follows() -> None:
    detok = FakeDetok({1: "hello E", 2: "ND and more"})
    text = TextStream(detok, stops=["END"], include_stop=True)
    assert text.push(1) == TextPiece("hello ")
    assert text.push(2) == TextPiece("END", FinishReason.STOP)


def test_include_stop_keeps_a_stop_string_completed_by_the_flushed_tail() -> None:
    detok = FakeDetok({1: "4 </ans"}, held="wer> more")
    text = TextStream(detok, stops=["</answer>"], include_stop=True)
    assert text.push(1) == TextPiece("4 ")
    assert text.finish(FinishReason.LENGTH) == TextPiece("</answer>", FinishReason.STOP)


def test_a_stop_string_before_min_tokens_is_ordinary_text() -> None:
    pieces = {1: "a.", 2: "b.", 3: "c.", 4: "d"}
    text = TextStream(FakeDetok(pieces), stops=["."], min_tokens=3)
    assert text.push(1) == TextPiece("a.")  # tokens 1 and 2: too early to stop
    assert text.push(2) == TextPiece("b.")
    assert text.push(3) == TextPiece("c", FinishReason.STOP)  # the third counts


def test_stop_matcher_with_include_ends_at_the_stop_that_completes_first() -> None:
    m = StopMatcher(["abc", "ab"], include=True)
    assert m.feed("xabcd") == ("xab", True)


# -- the stop matcher, TextStream's part for rule 3 --------------------------------------


def test_stop_matcher_holds_back_a_possible_stop_and_never_emits_it() -> None:
    m = StopMatcher(["XYZ"])
    assert m.feed("ab") == ("ab", False)
    assert m.feed("X") == ("", False)  # could be the start of XYZ: held
    assert m.feed("Y") == ("", False)
    assert m.feed("Q") == ("XYQ", False)  # can no longer match: released
    assert m.feed("cXY") == ("c", False)
    assert m.feed("Zdef") == ("", True)  # matched: nothing from the stop on


def test_stop_matcher_finish_matches_in_the_flushed_tail() -> None:
    m = StopMatcher(["END"])
    assert m.feed("ab") == ("ab", False)
    assert m.finish("cEND tail") == ("c", True)
    m = StopMatcher(["END"])
    assert m.feed("abEN") == ("ab", False)
    assert m.finish("X") == ("ENX", False)  # no match: the held-back text comes out


def test_stop_matcher_picks_the_earliest_stop_and_flushes_the_rest() -> None:
    m = StopMatcher(["cd", "b"])
    assert m.feed("abcd") == ("a", True)
    m = StopMatcher(["world", "lo"])
    assert m.feed("hello world") == ("hel", True)
    m = StopMatcher(["long-stop"])
    assert m.feed("xlong") == ("x", False)
    assert m.flush() == "long"


def test_a_held_prefix_that_does_not_become_a_stop_is_sent_later() -> None:
    m = StopMatcher(["END"])
    assert m.feed("abc EN") == ("abc ", False)
    assert m.feed("X") == ("ENX", False)
    assert m.feed("E") == ("", False)
    assert m.flush() == "E"


def test_without_stop_strings_text_passes_straight_through() -> None:
    m = StopMatcher([])
    assert m.feed("EN") == ("EN", False) and m.flush() == ""
