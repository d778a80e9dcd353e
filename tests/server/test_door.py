"""The door (server/door.py): Host names, CORS, the API key and the content type."""

from __future__ import annotations

import httpx
import openai
import pytest
import trio
from serverkit import MODEL_ID, live_server

from triollm.server.door import LOOPBACK_HOSTS, DoorPolicy, host_name

BODY = {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2}


async def call(method: str, url: str, **kw) -> httpx.Response:
    return await trio.to_thread.run_sync(lambda: httpx.request(method, url, timeout=30, **kw))


def test_host_names_lose_their_port():
    assert host_name("127.0.0.1:8000") == "127.0.0.1"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("LocalHost") == "localhost"
    assert host_name("::1") == "::1"


async def test_a_loopback_server_refuses_a_foreign_host_name(loaded):
    # DNS rebinding: a hostile page's name resolving to 127.0.0.1 still says its name.
    async with live_server(loaded) as live:
        r = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"host": "evil.test"}
        )
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_host"
        for host in (f"localhost:{live.port}", f"127.0.0.1:{live.port}", f"[::1]:{live.port}"):
            r = await call("GET", live.url + "/health", headers={"host": host})
            assert r.status_code == 200, host
    door = DoorPolicy.for_bind("127.0.0.1", allowed_hosts=["box.lan"])
    async with live_server(loaded, door=door) as live:
        r = await call("GET", live.url + "/health", headers={"host": "box.lan:8000"})
        assert r.status_code == 200
    assert DoorPolicy.for_bind("0.0.0.0").allowed_hosts is None  # --public: any name


async def test_the_bind_address_is_a_name_the_server_answers_to(loaded):
    # --host 127.0.0.2 was accepted, then every request to it was a 400 invalid_host,
    # /health included (issue 28, N7).
    door = DoorPolicy.for_bind("127.0.0.2")
    async with live_server(loaded, door=door) as live:
        r = await call("GET", live.url + "/health", headers={"host": f"127.0.0.2:{live.port}"})
        assert r.status_code == 200
        r = await call("GET", live.url + "/health", headers={"host": "evil.test"})
        assert r.status_code == 400
    assert "::2" not in LOOPBACK_HOSTS
    assert "::2" in (DoorPolicy.for_bind("::2", allowed_hosts=["a.lan"]).allowed_hosts or ())


def test_an_empty_api_key_is_not_no_key():
    with pytest.raises(ValueError, match="empty"):
        DoorPolicy.for_bind("127.0.0.1", api_key="")
    assert DoorPolicy.for_bind("127.0.0.1").api_key is None


async def test_cors_is_off_by_default_and_answers_preflights_when_asked(loaded):
    pre = {
        "origin": "https://chat.example",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with live_server(loaded) as live:
        r = await call("OPTIONS", live.url + "/v1/chat/completions", headers=pre)
        # answered (not a 405), but without the headers that would let the page go on
        assert r.status_code == 204 and "access-control-allow-origin" not in r.headers
        r = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"origin": pre["origin"]}
        )
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    door = DoorPolicy.for_bind("127.0.0.1", allowed_origins=["https://chat.example"])
    async with live_server(loaded, door=door) as live:
        r = await call("OPTIONS", live.url + "/v1/chat/completions", headers=pre)
        assert r.status_code == 204
        assert r.headers["access-control-allow-origin"] == "https://chat.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        r = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"origin": pre["origin"]}
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://chat.example"
        other = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"origin": "https://evil.test"}
        )
        assert "access-control-allow-origin" not in other.headers


async def test_an_api_key_is_required_when_set_and_probes_stay_open(loaded):
    door = DoorPolicy.for_bind("127.0.0.1", api_key="sk-secret")
    async with live_server(loaded, door=door) as live:
        for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": "sk-secret"}):
            r = await call("POST", live.url + "/v1/completions", json=BODY, headers=headers)
            assert r.status_code == 401
            assert r.headers["www-authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        for path in ("/health", "/ready", "/metrics"):
            assert (await call("GET", live.url + path)).status_code == 200
        assert (await call("GET", live.url + "/v1/models")).status_code == 401
        # The official client sends the key as a bearer token.
        good = openai.OpenAI(base_url=live.url + "/v1", api_key="sk-secret", max_retries=0)
        r = await trio.to_thread.run_sync(
            lambda: good.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2)
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        bad = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await trio.to_thread.run_sync(
                lambda: bad.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2)
            )
        # Anthropic's client sends the key as x-api-key; a wrong one is still refused.
        r = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"x-api-key": "sk-secret"}
        )
        assert r.status_code == 200
        r = await call(
            "POST", live.url + "/v1/completions", json=BODY, headers={"x-api-key": "sk-wrong"}
        )
        assert r.status_code == 401
    door = DoorPolicy.for_bind("127.0.0.1", api_key="sk-secret", open_paths=[])
    async with live_server(loaded, door=door) as live:
        assert (await call("GET", live.url + "/metrics")).status_code == 401


async def test_a_browsers_post_that_is_not_json_is_a_415_and_curl_d_is_read(loaded):
    async with live_server(loaded) as live:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
            headers = {"content-type": ctype} if ctype else {}
            r = await call(
                "POST",
                live.url + "/v1/completions",
                content=b'{"prompt": "x", "max_tokens": 2}',
                headers={**headers, "origin": "https://evil.test"},
            )
            assert r.status_code == 415, ctype
            assert r.json()["error"]["code"] == "unsupported_media_type"
            # No Origin: not a browser's form post (curl -d says form-urlencoded).
            r = await call(
                "POST",
                live.url + "/v1/completions",
                content=b'{"prompt": "x", "max_tokens": 2}',
                headers=headers,
            )
            assert r.status_code == 200, ctype
        r = await call(
            "POST",
            live.url + "/v1/completions",
            content=b"prompt=x",
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await call(
            "POST",
            live.url + "/v1/completions",
            json=BODY,
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert r.status_code == 200
        assert live.pool_is_idle()
