"""The metrics' reasons are the outcome enums: every member is exported, none can be misspelt."""

from __future__ import annotations

from typing import Any

import trio

from triollm.bench.client import step_means_ms, step_totals
from triollm.events import StepKind
from triollm.outcomes import EndCode, Refused
from triollm.plan import FinishReason
from triollm.server.lifetime import Lifetime
from triollm.server.metrics import Metrics


def test_every_way_a_request_ends_has_a_series_from_the_start() -> None:
    page = Metrics("m").render().decode()
    for reason in (*EndCode, *Refused):
        assert (
            f'triollm:request_rejections_total{{model_name="m",reason="{reason.value}"}} 0.0'
            in page
        )
    for finish in (FinishReason.STOP, FinishReason.LENGTH):
        assert (
            f'triollm:request_success_total{{finished_reason="{finish.value}",model_name="m"}} 0.0'
            in page
        )


def test_every_triollm_series_carries_the_model_name_as_vllm_labels_it() -> None:
    metrics = Metrics("org/model-1")
    metrics.token(True, 0.2)
    lines = [line for line in metrics.render().decode().splitlines() if line[:1] not in "#"]
    ours = [line for line in lines if line.startswith("triollm:")]
    assert ours and all('model_name="org/model-1"' in line for line in ours)
    assert any(line.startswith("process_") for line in lines)  # vLLM's: no model label
    assert metrics.registry.get_sample_value("triollm:generation_tokens_total") == 1.0


def test_counting_any_reason_never_raises_and_counts_it_alone() -> None:
    metrics = Metrics("m")
    for reason in (*EndCode, *Refused):
        metrics.ended_early(reason)  # runs inside the batch loop: it must never raise
    metrics.ended_early(EndCode.TOO_SLOW)
    assert metrics.rejection_count(EndCode.TOO_SLOW) == 2
    assert metrics.rejection_count(Refused.QUEUE_FULL) == 1


def test_step_times_are_kept_apart_by_kind_and_read_back_by_the_load_generator() -> None:
    # A decode step's time is the engine's share of a token, set beside the ITL; a
    # prefill step mixed into the same series would hide what the server path adds.
    metrics = Metrics("m")
    before = step_totals(metrics.render().decode())
    metrics.step(1, 1, StepKind.DECODE, 0.030)
    metrics.step(1, 1, StepKind.DECODE, 0.040)
    metrics.step(33, 2, StepKind.PREFILL, 0.200)
    after = step_totals(metrics.render().decode())
    assert after == {"decode": (0.070, 2.0), "prefill": (0.200, 1.0)}
    assert step_means_ms(before, after) == {
        "decode": {"steps": 2.0, "mean_ms": 35.0},
        "prefill": {"steps": 1.0, "mean_ms": 200.0},
    }
    assert step_means_ms(before, {}) is None  # a server without the histogram


def test_a_step_is_a_prefill_step_when_it_computed_any_prompt_row() -> None:
    assert StepKind.of(prefill_rows=0) is StepKind.DECODE
    assert StepKind.of(prefill_rows=1) is StepKind.PREFILL


class _Warming:
    """A service still warming up, as the lifetime middleware sees it."""

    failed = None
    closing = False
    ready = False

    def notify(self) -> None:
        pass


async def _answer(lifetime: Lifetime, path: str) -> None:
    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        pass

    await lifetime({"type": "http", "method": "GET", "path": path, "headers": []}, receive, send)


async def test_a_warming_up_503_is_not_a_server_error_but_a_500_is():
    # /ready said 503 during warm-up, and every fresh server showed one server error
    # (issue 28, N11).
    status = 503

    async def app(scope: dict, receive: object, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    metrics = Metrics("m")
    async with trio.open_nursery() as nursery:
        lifetime = Lifetime(app, metrics, _Warming(), nursery)  # type: ignore[arg-type]
        await _answer(lifetime, "/ready")
        assert metrics.server_error_count() == 0
        status = 500
        await _answer(lifetime, "/v1/completions")
        assert metrics.server_error_count() == 1
