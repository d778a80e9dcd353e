"""HTTP-level refusals, health/readiness/metrics, and that a bad request disturbs nothing."""

from __future__ import annotations

import json

import httpx
import trio
from serverkit import MODEL_ID, StepGate, live_server, raw_post, read_until

from triollm.outcomes import EndCode, Refused


async def get(url: str) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.get(url, timeout=30))


async def post(url: str, content: bytes) -> httpx.Response:
    return await trio.to_thread.run_sync(
        lambda: httpx.post(
            url, content=content, headers={"content-type": "application/json"}, timeout=30
        )
    )


async def test_refusals_are_openai_shaped_and_disturb_nothing_in_flight(loaded):
    async with live_server(loaded, max_body_bytes=4096) as live:
        service, metrics = live.service, live.stack.metrics
        gate = StepGate(service)
        body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 6, "stream": True}
        body["ignore_eos"] = True
        running = await raw_post(live.port, "/v1/completions", body)
        await service.wait_until(lambda: gate.parked)

        bad_json = await post(live.url + "/v1/completions", b"{not json")
        assert bad_json.status_code == 400
        assert bad_json.json()["error"]["code"] == "invalid_json"

        wrong_type = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": "x", "temperature": "hot"}' % MODEL_ID.encode(),
        )
        assert wrong_type.status_code == 400
        assert wrong_type.json()["error"]["param"] == "temperature"

        too_big = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": "%s"}' % (MODEL_ID.encode(), b"x" * 10_000),
        )
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "request_too_large"

        too_long = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": [%s]}' % (MODEL_ID.encode(), b",".join([b"5"] * 300)),
        )
        assert too_long.status_code == 400
        assert too_long.json()["error"]["param"] == "prompt"
        assert "300" in too_long.json()["error"]["message"]

        out_of_vocab = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": [1, 99999]}' % MODEL_ID.encode(),
        )
        assert out_of_vocab.status_code == 400

        missing = await get(live.url + "/v2/nothing")
        assert missing.status_code == 404 and "error" in missing.json()

        assert metrics.rejection_count(Refused.BAD_REQUEST) == 5
        # The stream that was running all along is untouched.
        gate.open()
        buf = bytearray()
        assert await read_until(running, b"data: [DONE]", buf)
        assert b'"finish_reason":"length"' in buf
        await running.aclose()


async def test_health_ready_models_and_metrics_move(loaded):
    async with live_server(loaded) as live:
        assert (await get(live.url + "/health")).json() == {"status": "ok"}
        ready = await get(live.url + "/ready")
        assert ready.status_code == 200 and ready.json()["model"] == MODEL_ID
        before = (await get(live.url + "/metrics")).text
        assert "triollm:kv_blocks_total" in before
        label = f'model_name="{MODEL_ID}"'  # vLLM's label, on every triollm: series
        assert f'triollm:request_rejections_total{{{label},reason="queue_full"}} 0.0' in before
        r = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": "Hi", "max_tokens": 4, "ignore_eos": true}'
            % MODEL_ID.encode(),
        )
        assert r.status_code == 200
        after = (await get(live.url + "/metrics")).text
        assert f"triollm:generation_tokens_total{{{label}}} 4.0" in after
        assert f'triollm:request_success_total{{finished_reason="length",{label}}} 1.0' in after
        assert f"triollm:time_to_first_token_seconds_count{{{label}}} 1.0" in after
        assert f"triollm:num_requests_running{{{label}}} 0.0" in after
        live.service.begin_shutdown()
        not_ready = await get(live.url + "/ready")
        assert not_ready.status_code == 503
        refused = await post(
            live.url + "/v1/completions",
            b'{"model": "%s", "prompt": "Hi", "max_tokens": 4, "ignore_eos": true}'
            % MODEL_ID.encode(),
        )
        assert refused.status_code == 503


async def test_shutdown_lets_a_stream_finish_within_the_grace_period(loaded):
    async with live_server(loaded, http={"grace_s": 30.0}) as live:
        gate = StepGate(live.service)
        body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 5, "stream": True}
        body["ignore_eos"] = True
        sock = await raw_post(live.port, "/v1/completions", body)
        await live.service.wait_until(lambda: gate.parked)
        live.shutdown.set()
        await live.service.wait_until(lambda: live.service.closing)
        gate.open()  # the stream goes on after the shutdown began, and completes
        buf = bytearray()
        assert await read_until(sock, b"data: [DONE]", buf)
        assert b'"finish_reason":"length"' in buf
        await sock.aclose()
    assert live.stack.metrics.rejection_count(EndCode.SHUTDOWN) == 0


async def test_shutdown_cuts_what_is_still_running_after_the_grace_period(loaded):
    with trio.fail_after(60):  # a hang guard, not a timing assertion
        async with live_server(loaded, http={"grace_s": 0.2}) as live:
            gate = StepGate(live.service)  # never opened: the stream cannot finish
            body = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 5, "stream": True}
            sock = await raw_post(live.port, "/v1/completions", body)
            await live.service.wait_until(lambda: gate.parked)
    metrics = live.stack.metrics
    assert metrics.rejection_count(EndCode.SHUTDOWN) == 1
    assert metrics.rejection_count(EndCode.CLIENT_CLOSED) == 0
    assert live.pool_is_idle()
    await sock.aclose()


async def test_a_request_without_model_is_served_by_the_one_model_and_a_wrong_one_is_404(loaded):
    async with live_server(loaded) as live:
        plain = await post(live.url + "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
        assert plain.status_code == 200
        assert plain.json()["model"] == MODEL_ID
        wrong = await post(
            live.url + "/v1/completions", b'{"model": "gpt-9", "prompt": "Hi", "max_tokens": 2}'
        )
        assert wrong.status_code == 404
        assert wrong.json()["error"]["param"] == "model"


async def test_a_413_closes_the_keep_alive_connection_instead_of_hanging(loaded):
    """The body is refused before it is read, so the rest of it is still on the
    wire: the server must say "Connection: close" and close, never wait."""
    async with live_server(loaded, max_body_bytes=4096) as live:
        sock = trio.socket.socket()
        await sock.connect(("127.0.0.1", live.port))
        stream = trio.SocketStream(sock)
        declared = 1_000_000
        await stream.send_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % declared + b"a" * 8192
        )
        buf = bytearray()
        assert await read_until(stream, b"\r\n\r\n", buf)
        head = bytes(buf).split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 413")
        assert b"connection: close" in head
        # The server closes: reads end in EOF (or a reset), not a hang.
        while True:
            try:
                chunk = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
        await stream.aclose()


async def test_a_pool_smaller_than_the_context_serves_requests_without_max_tokens(loaded):
    # 2 slots x 256 positions of context, but a pool of 4 x 32 = 128 positions.
    async with live_server(loaded, num_blocks=4, block_size=32) as live:
        models = (await get(live.url + "/v1/models")).json()
        assert models["data"][0]["max_model_len"] == 128
        # Chat: /v1/completions without max_tokens means OpenAI's 16 instead.
        r = await post(
            live.url + "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true}',
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length"
        usage = body["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 128


async def test_metrics_count_failures_5xx_and_preemptions_but_not_the_warm_up(loaded):
    async with live_server(loaded) as live:
        metrics = live.stack.metrics
        page = (await get(live.url + "/metrics")).text
        label = f'{{model_name="{MODEL_ID}"}}'
        assert f"triollm:step_rows_count{label} 0.0" in page  # the warm-up's steps: not counted
        assert f"triollm:num_preemptions_total{label} 0.0" in page
        assert f"triollm:num_requests_running{label} 0.0" in page

        async def broken(plan):
            raise RuntimeError("kernel exploded")

        live.service.step_runner = broken
        r = await post(live.url + "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert metrics.rejection_count(EndCode.INTERNAL) == 1
        assert metrics.server_error_count() == 1
        page = (await get(live.url + "/metrics")).text
        assert (
            f'triollm:http_server_errors_total{{model_name="{MODEL_ID}",status="500"}} 1.0' in page
        )


async def test_a_sampling_value_out_of_range_is_a_400_naming_the_field(loaded):
    """The ranges live in SamplingParams alone; its FieldError reaches the client
    with the field as ``param`` (nothing parses it out of the message)."""
    cases = {
        "temperature": 2.5,
        "top_p": 0,
        "top_k": -3,
        "min_p": 2,
        "presence_penalty": 3,
        "frequency_penalty": -3,
        "repetition_penalty": 0,
    }
    async with live_server(loaded) as live:
        for field, value in cases.items():
            body = json.dumps({"prompt": "Hi", "max_tokens": 2, field: value}).encode()
            r = await post(live.url + "/v1/completions", body)
            assert r.status_code == 400, (field, r.text)
            error = r.json()["error"]
            assert error["param"] == field and field in error["message"], error
        assert live.stack.metrics.rejection_count(Refused.BAD_REQUEST) == len(cases)


async def test_health_says_503_once_the_batch_loop_has_failed(loaded):
    """Orchestrators copied from other servers probe /health, not /ready: a process
    whose batch loop is gone must fail that probe too, or it is never replaced."""
    async with live_server(loaded) as live:
        assert (await get(live.url + "/health")).status_code == 200

        def broken_record(plan, result):
            raise RuntimeError("the recorder broke")  # outside the step: the loop fails

        live.service.recorder.record = broken_record
        r = await post(live.url + "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
        assert r.status_code == 500
        await live.service.wait_until(lambda: live.service.failed is not None)
        health = await get(live.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the recorder broke" in health.json()["reason"]
        assert (await get(live.url + "/ready")).status_code == 503
