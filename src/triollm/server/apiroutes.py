"""The routes of the other APIs: OpenAI's Responses, Anthropic's Messages, Ollama's, and
embeddings. Read with ``app.py``, whose :class:`~triollm.server.app.Handlers` they lean on.

The three chat-like APIs are one handler each around :meth:`Handlers.translated`: the
API's parser builds the chat request and names its writer (``answers.py``), and the
rest (prepare, admission, the stream) is the path /v1/chat/completions takes. What is
here besides is what has no chat counterpart: Ollama's listings, Anthropic's token
count, and embeddings, which do not generate and so queue apart (``EmbeddingQueue``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from quart import Response

from triollm.admission import Refusal
from triollm.errors import FieldError
from triollm.request import GenerationRequest
from triollm.scheduler import Infeasible
from triollm.server import anthropic, ollama
from triollm.server.app import Handlers, read_body, refusals
from triollm.server.embeddings import (
    EmbeddingQueue,
    EmbeddingRequest,
    Pooler,
    answer,
    parse_embeddings,
)
from triollm.server.ollama import ModelFacts
from triollm.server.openai import ApiError, load_object
from triollm.server.openai_responses import parse_responses

__all__ = ["ApiRoutes"]


class ApiRoutes:
    """``embedder``: pools /v1/embeddings (None: that route is a 404); ``facts``: what
    Ollama's listings say of the model beyond its id."""

    def __init__(self, h: Handlers, embedder: Pooler | None, facts: ModelFacts) -> None:
        self.h = h
        self.model = h.model
        self.embedder = embedder
        # One embedding at a time (each holds a private K/V cache of its text's size),
        # a bounded number waiting: past it, 429 as for generation (embeddings.py).
        config = h.service.config
        self.embed_queue = EmbeddingQueue(
            max_waiters=config.queue_depth_per_slot, wait_s=config.queue_wait_s
        )
        self.facts = facts

    def routes(self) -> list[tuple[str, str, Callable[..., Any]]]:
        return [
            ("POST", "/v1/responses", self.responses),
            ("POST", "/v1/messages", self.messages),
            ("POST", "/v1/messages/count_tokens", self.count_tokens),
            ("GET", "/api/version", self.ollama_version),
            ("GET", "/api/tags", self.ollama_tags),
            ("GET", "/api/ps", self.ollama_ps),
            ("POST", "/api/show", self.ollama_show),
            ("POST", "/api/chat", self.ollama_chat),
            ("POST", "/api/generate", self.ollama_generate),
            ("POST", "/v1/embeddings", self.embeddings),
            ("POST", "/api/embed", self.ollama_embed),
        ]

    # -- the translated APIs ------------------------------------------------------------

    async def responses(self) -> Response:
        return await self.h.translated(parse_responses)

    async def messages(self) -> Response:
        return await self.h.translated(anthropic.parse_messages)

    async def ollama_chat(self) -> Response:
        return await self.h.translated(partial(ollama.parse_chat, model=self.model))

    async def ollama_generate(self) -> Response:
        return await self.h.translated(partial(ollama.parse_generate, model=self.model))

    async def count_tokens(self) -> Any:
        req = anthropic.parse_count_tokens(await read_body())
        self.h.check_model(req.model)
        with refusals():
            ids = await self.h.preparer.tokenize(req)
        return {"input_tokens": len(ids)}

    # -- Ollama's listings --------------------------------------------------------------

    async def ollama_tags(self) -> Any:
        return {"models": [ollama.model_entry(self.model, self.facts)]}

    async def ollama_ps(self) -> Any:
        entry = ollama.model_entry(self.model, self.facts)
        # Loaded for the server's life: no expiry, all of it in (CPU) memory.
        entry |= {"expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
        entry["context_length"] = self.model.context_tokens
        return {"models": [entry]}

    async def ollama_version(self) -> Any:
        return ollama.version()

    async def ollama_show(self) -> Any:
        body = load_object(await read_body())
        name = body.get("model", body.get("name"))
        if name != ollama.served_name(self.model):
            self.h.check_model(name if isinstance(name, str) else None)
        return ollama.show(self.model, self.facts)

    # -- embeddings ---------------------------------------------------------------------

    def _embedder(self) -> Pooler:
        if self.embedder is None:
            raise ApiError(404, "this server computes no embeddings", param="model")
        return self.embedder

    async def embeddings(self) -> Any:
        req = parse_embeddings(await read_body(), self._embedder().dimensions)
        vectors, tokens = await self._embed("embeddings", req)
        return answer(req, self.model.id, vectors, tokens)

    async def ollama_embed(self) -> Any:
        started = time.monotonic_ns()
        raw = await read_body()
        req = ollama.parse_embed(raw, self.model, self._embedder().dimensions)
        vectors, tokens = await self._embed("ollama embed", req)
        name = load_object(raw).get("model") or ollama.served_name(self.model)
        return ollama.embed_answer(name, vectors, tokens, started)

    async def _embed(self, api: str, req: EmbeddingRequest) -> tuple[list[Any], int]:
        """Each input's vector, in order, one at a time; and the tokens they held. The
        request holds the embeddings queue's running place while it tokenizes and pools,
        so a flood of embeddings holds at most one of the tokenizer's threads (which
        chat requests share) and one place at the model's lock, and past the queue's
        bound it is refused (429)."""
        embedder = self._embedder()
        self.h.unknown.note(api, req.unknown)
        self.h.check_model(req.model)
        try:
            async with self.embed_queue.place():
                ids = [await self._ids(i, item) for i, item in enumerate(req.inputs)]
                vectors = [
                    await trio.to_thread.run_sync(partial(embedder.embed, one, req.dimensions))
                    for one in ids
                ]
        except Refusal as exc:
            raise self.h.refused(exc) from None
        return vectors, sum(len(one) for one in ids)

    async def _ids(self, index: int, item: str | tuple[int, ...]) -> list[int]:
        """One input's token ids, through the preparer's limits (a 400 naming it)."""
        param = f"input[{index}]"
        limit = self.model.context_tokens
        if not isinstance(item, str) and len(item) > limit:
            # Token ids skip the tokenizer's bound; unbounded, they would size the cache.
            raise ApiError(
                400,
                f"'{param}' holds {len(item)} token ids, past this server's maximum context "
                f"length of {limit}",
                param=param,
                code="context_length_exceeded",
            )
        text, ids = (item, None) if isinstance(item, str) else (None, item)
        req = GenerationRequest(kind="completion", model=None, prompt_text=text, prompt_ids=ids)
        try:
            return await self.h.preparer.tokenize(req)
        except FieldError as exc:
            code = "context_length_exceeded" if isinstance(exc, Infeasible) else None
            raise ApiError(400, f"'{param}': {exc}", param=param, code=code) from None
