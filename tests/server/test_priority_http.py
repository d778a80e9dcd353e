"""The request's ``priority`` over HTTP: from the body to the policy's order.

vLLM's extension field: an integer, smaller is served earlier, 0 when left out. It
is honoured under a policy that orders by it (``orders_by_priority``; the example
``PriorityWithAging``), and a non-zero one is refused under any other policy, as
vLLM refuses one without priority scheduling. Generation is held still with a
StepGate, so the queue is built while one request holds the only slot; every wait
is on the service's own state.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from serverkit import MODEL_ID, StepGate, live_server

from triollm.policy_examples.priority import PriorityWithAging
from triollm.scheduler import PRIORITY_MAX, PRIORITY_MIN

ENDPOINTS = {
    "/v1/completions": {"prompt": "Hello there"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello there"}]},
}


async def post(url: str, path: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    body |= ENDPOINTS[path] | fields
    return await trio.to_thread.run_sync(lambda: httpx.post(url + path, json=body, timeout=60))


def first_runs(records: Any, of: set[int]) -> list[int]:
    """The ids in ``of`` in the order they first ran (with one slot: the admission order);
    the warm-up request's steps are recorded too, and left out."""
    order: list[int] = []
    for rec in records:
        order += [s for s in rec.seq_ids if s in of and s not in order]
    return order


@pytest.mark.parametrize("path", list(ENDPOINTS))
async def test_a_higher_priority_request_queued_behind_lower_ones_is_admitted_first(loaded, path):
    async with live_server(loaded, slots=1, policy=PriorityWithAging()) as live:
        service, scheduler = live.service, live.service.scheduler
        gate = StepGate(service)
        ids: dict[str, int] = {}

        async def send(name: str, priority: int | None) -> None:
            fields = {} if priority is None else {"priority": priority}
            r = await post(live.url, path, **fields)
            assert r.status_code == 200, r.text

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, "holder", None)  # priority 0, left out
            await service.wait_until(lambda: gate.parked)  # it holds the only slot
            (ids["holder"],) = scheduler.running_ids()
            for name, priority in (("low-1", 5), ("low-2", 5), ("urgent", -1)):
                known = set(ids.values())
                nursery.start_soon(send, name, priority)
                await service.wait_until(lambda: len(scheduler.waiting_ids()) == len(ids))
                (ids[name],) = set(scheduler.waiting_ids()) - known
            # The policy's view: the urgent one, queued last, is tried first.
            assert scheduler.waiting_order() == (ids["urgent"], ids["low-1"], ids["low-2"])
            gate.open()
        assert first_runs(service.recorder.records, set(ids.values())) == [
            ids["holder"],
            ids["urgent"],
            ids["low-1"],
            ids["low-2"],
        ]
        assert live.pool_is_idle()


@pytest.mark.parametrize("path", list(ENDPOINTS))
async def test_a_policy_that_ignores_priority_refuses_a_non_zero_one_by_name(loaded, path):
    async with live_server(loaded) as live:  # reserve: first come, first served
        r = await post(live.url, path, priority=1)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "priority"
        assert "(reserve) does not order by priority" in error["message"]
        assert (await post(live.url, path, priority=0)).status_code == 200
        assert (await post(live.url, path)).status_code == 200
        assert live.pool_is_idle()


async def test_a_priority_outside_32_bits_is_refused_naming_the_limit(loaded):
    async with live_server(loaded, policy=PriorityWithAging()) as live:
        for value in (PRIORITY_MAX + 1, PRIORITY_MIN - 1, 10**40):
            r = await post(live.url, "/v1/completions", priority=value)
            assert r.status_code == 400, value
            error = r.json()["error"]
            assert error["param"] == "priority"
            assert f"between {PRIORITY_MIN} and {PRIORITY_MAX}" in error["message"]
        for value in (PRIORITY_MIN, PRIORITY_MAX):
            assert (await post(live.url, "/v1/completions", priority=value)).status_code == 200
        assert live.pool_is_idle()
