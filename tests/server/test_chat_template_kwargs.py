"""``chat_template_kwargs`` (vLLM's field): a request's own variables for the chat
template, e.g. Qwen3's ``enable_thinking``. The rendering rule is the tokenizer's
(tests/model/test_tokenizer.py); here the HTTP field: it reaches the template,
and a malformed one is a 400 naming it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from serverkit import MODEL_ID, live_server

THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if enable_thinking is defined and not enable_thinking %}/no_think\n"
    "{% endif %}<|im_start|>assistant\n"
)


async def chat(live: Any, path: str = "/v1/chat/completions", **fields: Any) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": 2, "temperature": 0} | fields
    if path.endswith("/chat/completions"):
        body.setdefault("messages", [{"role": "user", "content": "Hello"}])
    return await trio.to_thread.run_sync(lambda: httpx.post(live.url + path, json=body, timeout=60))


async def test_a_template_variable_changes_the_rendered_prompt(loaded, monkeypatch):
    tokenizer = loaded.tokenizer
    monkeypatch.setattr(tokenizer, "chat_templates", {"default": THINKING})
    monkeypatch.setattr(tokenizer, "_compiled", {})
    async with live_server(loaded) as live:
        plain = await chat(live)
        off = await chat(live, chat_template_kwargs={"enable_thinking": False})
        on = await chat(live, chat_template_kwargs={"enable_thinking": True})
    assert plain.status_code == off.status_code == on.status_code == 200
    added = len(tokenizer.encode("/no_think\n", add_special_tokens=False))
    assert off.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] + added
    assert on.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"messages": []}, "'chat_template_kwargs.messages'"),
        ([1, 2], "must be an object"),
        ({"not-a-name": 1}, "template identifiers"),
        ({f"v{i}": i for i in range(33)}, "at most 32"),
    ],
)
async def test_a_malformed_chat_template_kwargs_is_a_400_naming_it(loaded, value, says):
    async with live_server(loaded) as live:
        r = await chat(live, chat_template_kwargs=value)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert says in r.json()["error"]["message"]


async def test_chat_template_kwargs_on_completions_is_a_400(loaded):
    async with live_server(loaded) as live:
        r = await chat(live, "/v1/completions", prompt="Hello", chat_template_kwargs={"x": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
