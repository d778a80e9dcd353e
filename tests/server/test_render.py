"""The render endpoints: a request's token ids, as a router that tokenizes needs them.

llm-d's precise prefix routing (and vllm-router's ``kv_aware``, which asks before
falling back to ``/tokenize``) hash a request's *exact* token ids to find the
replica holding its blocks. ``POST /v1/completions/render`` answers a list (one entry
per prompt) and ``POST /v1/chat/completions/render`` one object, each with the
``token_ids`` the server itself would run (the chat template applied), as vLLM's and
llm-d's inference simulator's do. Nothing is generated and nothing queues.
"""

from __future__ import annotations

from typing import Any

import httpx
from serverkit import MODEL_ID, live_server


async def test_render_gives_the_token_ids_the_server_would_run(loaded: Any) -> None:
    messages = [{"role": "user", "content": "Tell me about the lighthouse."}]
    async with (
        live_server(loaded) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        tokenized = (await http.post("/tokenize", json={"prompt": "Once upon a time"})).json()
        rendered = await http.post(
            "/v1/completions/render", json={"model": MODEL_ID, "prompt": "Once upon a time"}
        )
        assert rendered.status_code == 200
        (entry,) = rendered.json()
        assert entry["token_ids"] == tokenized["tokens"]

        chat_ids = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        chat = await http.post("/v1/chat/completions/render", json={"messages": messages})
        assert chat.status_code == 200
        assert chat.json()["token_ids"] == chat_ids
        # Token ids in, the same ids out (a router that already tokenized).
        ids = await http.post("/v1/completions/render", json={"prompt": [5, 6, 7]})
        assert ids.json()[0]["token_ids"] == [5, 6, 7]

        wrong = await http.post("/v1/completions/render", json={"model": "nope", "prompt": "x"})
        assert wrong.status_code == 404
        bad = await http.post("/v1/chat/completions/render", json={"messages": "not a list"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        # Nothing was generated: no step ran for a render.
        assert live.service.scheduler.statistics().running == 0


async def test_a_list_of_prompts_is_rendered_and_tokenized_as_each_alone(loaded: Any) -> None:
    prompts = ["Once upon a time", [5, 6, 7], "The end."]
    async with (
        live_server(loaded) as live,
        httpx.AsyncClient(base_url=live.url, timeout=60) as http,
    ):
        alone = [
            (await http.post("/tokenize", json={"prompt": p})).json()["tokens"] for p in prompts
        ]
        rendered = await http.post("/v1/completions/render", json={"prompt": prompts})
        tokenized = await http.post("/tokenize", json={"prompt": prompts})
        bad = await http.post("/tokenize", json={"prompt": ["fine", 7]})
    assert rendered.status_code == 200 and tokenized.status_code == 200, tokenized.text
    assert [entry["token_ids"] for entry in rendered.json()] == alone
    # /tokenize mirrors the shape it was sent: a list of prompts, a list of each
    assert tokenized.json()["tokens"] == alone
    assert tokenized.json()["count"] == [len(ids) for ids in alone]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"
