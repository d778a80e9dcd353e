"""The metrics' reasons are the outcome enums: every member is exported, none can be misspelt."""

from __future__ import annotations

from triollm.outcomes import EndCode, Refused
from triollm.plan import FinishReason
from triollm.server.metrics import Metrics


def test_every_way_a_request_ends_has_a_series_from_the_start() -> None:
    page = Metrics().render().decode()
    for reason in (*EndCode, *Refused):
        assert f'triollm:request_rejections_total{{reason="{reason.value}"}} 0.0' in page
    for finish in (FinishReason.STOP, FinishReason.LENGTH):
        assert f'triollm:request_success_total{{finished_reason="{finish.value}"}} 0.0' in page


def test_counting_any_reason_never_raises_and_counts_it_alone() -> None:
    metrics = Metrics()
    for reason in (*EndCode, *Refused):
        metrics.ended_early(reason)  # runs inside the batch loop: it must never raise
    metrics.ended_early(EndCode.TOO_SLOW)
    assert metrics.rejection_count(EndCode.TOO_SLOW) == 2
    assert metrics.rejection_count(Refused.QUEUE_FULL) == 1
