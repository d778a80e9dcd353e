"""The cluster measurements' client and CPU accounting (src/triollm/cluster/load.py).

A whole (non-streamed) answer is classified as a streamed one is: ok only with a
``finish_reason``; a refusal, a broken answer and a dead connection each by name.
The CPU accounting reads /proc: checked against Python's own clock for this process,
and on a command name built to break a naive split.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import pytest

from triollm.cluster.load import (
    CLOCK_TICKS,
    CpuMeter,
    closed_loop,
    cpu_seconds,
    stat_cpu_seconds,
    story_body,
    whole_one,
)

URL = "http://replica/v1/completions"


def answer(request: httpx.Request) -> httpx.Response:
    kind = request.headers.get("x-kind", "ok")
    if kind == "refused":
        return httpx.Response(503, json={"error": {"message": "shutting_down"}})
    if kind == "broken":
        return httpx.Response(200, content=b'{"choices": [{"text": "on')
    if kind == "dead":
        raise httpx.ConnectError("connection refused", request=request)
    finish = None if kind == "unfinished" else "length"
    return httpx.Response(
        200,
        json={
            "choices": [{"index": 0, "text": "once", "finish_reason": finish}],
            "usage": {"completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 32}},
        },
    )


@pytest.mark.parametrize(
    ("kind", "outcome"),
    [("ok", "ok"), ("refused", "refused"), ("broken", "cut"), ("unfinished", "cut"),
     ("dead", "failed")],
)  # fmt: skip
async def test_a_whole_answer_is_classified_by_how_it_ended(kind: str, outcome: str) -> None:
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(answer), headers={"x-kind": kind}
    ) as client:
        result = await whole_one(client, URL, {"prompt": "x"}, t0=time.perf_counter())
    assert result.outcome == outcome
    assert result.ttft_s is None  # the first token came with the last
    if outcome == "ok":
        assert (result.status, result.tokens, result.cached_tokens) == (200, 5, 32)
    else:
        assert result.tokens == 0 and (outcome == "failed") == (result.status is None)


async def test_the_closed_loop_sends_a_body_whole_unless_it_asks_to_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies: list[dict[str, Any]] = []

    def record(request: httpx.Request) -> httpx.Response:
        import json

        bodies.append(json.loads(request.content))
        return answer(request)

    real = httpx.AsyncClient

    def mocked(**kwargs: Any) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(record), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", mocked)
    results, _ = await closed_loop(URL, 2, 4, lambda rng: story_body(rng, 8, stream=False))
    assert [r.outcome for r in results] == ["ok"] * 4
    assert all("stream" not in b and b["max_tokens"] == 8 for b in bodies)


def test_cpu_seconds_agree_with_pythons_own_clock_for_this_process() -> None:
    pid = os.getpid()
    before, clock = cpu_seconds(pid), time.process_time()
    x = 0
    while time.process_time() - clock < 0.3:  # burn a measurable amount of CPU
        x += 1
    used, python_says = cpu_seconds(pid) - before, time.process_time() - clock
    # Both count every thread of the process; /proc in whole clock ticks.
    assert abs(used - python_says) <= 3 / CLOCK_TICKS + 0.02


def test_a_command_name_with_spaces_and_parens_does_not_shift_the_fields() -> None:
    fields = ["S"] + ["0"] * 10 + [str(3 * CLOCK_TICKS), str(2 * CLOCK_TICKS)] + ["0"] * 30
    line = "4242 (a) (b c) " + " ".join(fields)
    assert stat_cpu_seconds(line) == 5.0


def test_the_meter_names_every_process_and_what_it_does_not_account_for() -> None:
    meter = CpuMeter({"me": os.getpid(), "gone": 2**22 + 12345})  # above pid_max: no such
    meter.start()
    clock = time.process_time()
    while time.process_time() - clock < 0.05:
        pass
    used = meter.stop()
    assert used["me"] > 0 and used["gone"] == 0.0
    assert used["other"] >= 0 and used["wall"] > 0
