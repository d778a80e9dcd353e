"""The statistics of a level: what each figure of the table is computed from."""

from __future__ import annotations

import pytest

from triollm.bench.stats import Outcome, Problem, RequestRecord, percentiles, summarise


def ok(sent: float, chunks: tuple[float, ...], done: float, tokens: int, turn: int = 0):
    return RequestRecord(
        sent_s=sent,
        done_s=done,
        outcome=Outcome.OK,
        status=200,
        chunk_s=chunks,
        output_tokens=tokens,
        finish_reason="length",
        turn=turn,
    )


def test_ttft_itl_e2e_and_stream_rate_come_from_the_chunk_times() -> None:
    r = ok(1.0, (1.5, 1.7, 2.0), 2.5, tokens=3)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.2, 0.3])
    assert r.e2e_s == pytest.approx(1.5)
    # two tokens after the first, over the 1.0 s from first token to the end
    assert r.stream_tok_s == pytest.approx(2.0)


def test_percentiles_interpolate_and_scale_and_are_none_when_empty() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0], 1e3)
    assert p["p50"] == pytest.approx(3000.0)
    assert p["p90"] == pytest.approx(4600.0)
    assert p["mean"] == pytest.approx(3000.0)
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def test_aggregate_throughput_is_every_token_over_the_levels_wall_time() -> None:
    records = [
        ok(0.0, (0.1, 0.2), 1.0, tokens=10),
        ok(0.5, (0.6,), 2.0, tokens=30),
        # a cut stream's tokens count (the server computed them); its latency does not
        RequestRecord(
            sent_s=0.2, done_s=0.9, outcome=Outcome.CUT, status=200, chunk_s=(0.3,), output_tokens=5
        ),
    ]
    s = summarise(records)
    assert s.duration_s == pytest.approx(2.0)
    assert s.output_tokens == 45
    assert s.aggregate_tok_s == pytest.approx(22.5)
    assert s.ok == 2 and s.by_outcome == {"200": 2, "cut": 1}
    assert s.ttft_ms["p50"] == pytest.approx(100.0)  # (100 + 100) / 2, the cut one left out
    assert s.e2e_ms["p50"] == pytest.approx(1250.0)


def test_statuses_retry_after_and_problems_are_counted_by_kind() -> None:
    records = [
        ok(0.0, (0.1,), 1.0, tokens=1),
        RequestRecord(
            sent_s=0.0, done_s=0.1, outcome=Outcome.RATE_LIMITED, status=429, retry_after="2"
        ),
        RequestRecord(sent_s=0.0, done_s=0.1, outcome=Outcome.RATE_LIMITED, status=429),
        RequestRecord(sent_s=0.0, done_s=0.1, outcome=Outcome.CLIENT_ERROR, status=400),
        RequestRecord(sent_s=0.0, done_s=0.1, outcome=Outcome.SERVER_ERROR, status=503),
        RequestRecord(
            sent_s=0.0,
            done_s=0.5,
            outcome=Outcome.OK,
            status=200,
            chunk_s=(0.2,),
            output_tokens=1,
            problems=((Problem.NO_DONE, "ended early"),),
        ),
    ]
    s = summarise(records)
    assert s.by_outcome == {"200": 2, "429": 2, "4xx": 1, "5xx": 1}
    assert s.retry_after == {"2": 1, "(none)": 1}
    assert s.problems == {"no [DONE]": 1}
    assert s.problem_examples == {"no [DONE]": "ended early"}


def test_multi_turn_reports_ttft_per_turn_and_the_last_turn_on_its_own() -> None:
    records = [
        ok(0.0, (0.1,), 1.0, 1, turn=1),
        ok(1.0, (1.3,), 2.0, 1, turn=2),
        ok(0.0, (0.3,), 1.0, 1, turn=1),
        ok(1.0, (1.5,), 2.0, 1, turn=2),
    ]
    s = summarise(records)
    assert s.ttft_by_turn_ms["1"]["p50"] == pytest.approx(200.0)
    assert s.ttft_by_turn_ms["2"]["p50"] == pytest.approx(400.0)
    assert s.last_turn_ttft_ms == s.ttft_by_turn_ms["2"]
    assert summarise([ok(0.0, (0.1,), 1.0, 1)]).last_turn_ttft_ms == {}


def counted(chunks: tuple[float, ...], tokens: tuple[int, ...], done: float, total: int):
    """A request whose server said how many tokens each chunk carried."""
    return RequestRecord(
        sent_s=0.0,
        done_s=done,
        outcome=Outcome.OK,
        status=200,
        chunk_s=chunks,
        chunk_tokens=tokens,
        output_tokens=total,
        finish_reason="length",
    )


def test_a_chunk_of_three_tokens_adds_three_gaps_of_a_third_each() -> None:
    # one token, one token, then a CJK character's 3 byte-tokens in one chunk 0.3 s later
    r = counted((1.0, 1.1, 1.4), (1, 1, 3), done=1.4, total=5)
    assert r.itl_s == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert r.chunk_gap_s == pytest.approx([0.1, 0.3])  # the old per-chunk figure
    s = summarise([r])
    assert s.itl_ms["p99"] == pytest.approx(100.0)
    assert s.chunk_gap_ms["p99"] == pytest.approx(298.0)  # 0.1 + 0.99 x (0.3 - 0.1)
    assert (s.multi_token_chunks, s.token_chunks, s.itl_unplaced) == (1, 3, 0)


def test_the_first_chunks_extra_tokens_add_no_gap_and_a_textless_tail_no_step() -> None:
    # two tokens in the first chunk (inside TTFT), then one; a last chunk of text only
    r = counted((0.5, 0.7, 0.8), (2, 1, 0), done=0.8, total=3)
    assert r.itl_s == pytest.approx([0.2])


def test_tpot_is_e2e_minus_ttft_over_the_tokens_after_the_first() -> None:
    r = counted((0.5, 1.0, 2.0), (1, 2, 2), done=2.5, total=5)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.tpot_s == pytest.approx((2.5 - 0.5) / 4)
    assert summarise([r]).tpot_ms["p50"] == pytest.approx(500.0)
    assert counted((0.5,), (1,), done=0.6, total=1).tpot_s is None  # one token: no TPOT


def test_without_the_servers_counts_one_token_per_chunk_only_when_usage_agrees() -> None:
    r = ok(0.0, (0.1, 0.2, 0.4), 0.5, tokens=3)
    assert r.tokens_by_chunk == (1, 1, 1) and r.itl_s == pytest.approx([0.1, 0.2])
    # four tokens in three chunks: which chunk carried two is unknown, so no ITL from
    # it (TPOT still has it), and the level says how many requests were left out
    short = ok(0.0, (0.1, 0.2, 0.4), 0.5, tokens=4)
    assert short.tokens_by_chunk is None and short.itl_s is None
    s = summarise([r, short])
    assert s.itl_unplaced == 1 and s.tpot_ms["p50"] is not None
    assert s.itl_ms["p50"] == pytest.approx(150.0)  # r's two gaps only


def test_server_counts_that_do_not_add_up_to_usage_place_nothing() -> None:
    assert counted((0.1, 0.2), (1, 1), done=0.3, total=3).itl_s is None
