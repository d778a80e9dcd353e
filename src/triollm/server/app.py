"""The HTTP edge's routes: a quart-trio app, wrapped in the request-lifetime middleware.

What happens to one ``POST /v1/completions`` (read with docs/serving.md):

1. hypercorn parses the request and starts the ASGI app in its own task;
   quart-trio runs our view and a ``receive`` loop side by side in one nursery.
   When the client disconnects, hypercorn's reader sees EOF, sends
   ``http.disconnect``, and quart-trio cancels that nursery: our view (or the body
   generator) gets ``trio.Cancelled`` at its next checkpoint -- while parked in the
   admission queue, while waiting on the token channel, anywhere.
2. The view (:meth:`Handlers.generate`) reads the whole body (413 past
   ``max_body_bytes``), parses it (``openai.py``: 400 naming the field, 404 for
   another model), has ``request.Preparer`` turn it into a frozen
   :class:`~triollm.spec.GenerationSpec` (tokenizing, grammars, the ``max_tokens``
   rule: the edge itself touches no model internals), and waits for admission (429 +
   ``Retry-After``). Only then does it return a response, so every refusal is a real
   status code.
3. A streaming response is an async generator (``responses.py`` builds OpenAI's
   shapes): each SSE event is yielded on its own and quart sends it as its own
   ``http.response.body`` message, which hypercorn writes to the socket as one
   HTTP/1.1 chunk, at once.
4. :class:`~triollm.server.lifetime.Lifetime`, an ASGI middleware around the whole
   app (``lifetime.py``), owns the request's end. Its ``finally`` runs however the
   request ends (normal, error, cancelled before or after the response started) and
   calls the stream's synchronous ``close()``: an ``await`` there would raise at
   once, because the scope is already cancelled. A request cut short by its client
   is logged with status 499 and counted as ``client_closed``.

The other APIs (OpenAI's Responses, Anthropic's Messages, Ollama's; ``apiroutes.py``)
take the same path through :meth:`Handlers.translated`: their parser builds the chat
request and names the writer that shapes the answer in the API's own JSON, SSE or
NDJSON; a refusal comes back in the API's own error shape (:meth:`Handlers.error`).

Traps designed around (each has a test under tests/server/):

- Quart's ``RESPONSE_TIMEOUT`` (60 s by default) wraps the body in
  ``move_on_after``: a longer stream is silently cut and the client sees a
  truncated chunked body. We set it to ``None`` for the app and for each stream.
- The Quart ``request`` object is gone inside the body generator (no request
  context): everything is read before the response is returned.
- hypercorn's shielded, deadline-free socket write: see ``transport.py``; hypercorn
  itself is run by ``frontend.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from triollm.admission import QueueClosed, Refusal
from triollm.errors import FieldError
from triollm.outcomes import Refused
from triollm.request import (
    TEXT_LIMITER,
    GenerationRequest,
    Preparer,
    ServedModel,
    TemplateBroken,
)
from triollm.scheduler import Infeasible
from triollm.server import anthropic, ollama, sse
from triollm.server.answers import Translation, Writer
from triollm.server.apifields import UnknownFields
from triollm.server.door import Door, DoorPolicy
from triollm.server.embeddings import Pooler
from triollm.server.lifetime import LIFE_KEY, Lifetime, RequestLife, Stage
from triollm.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from triollm.server.metrics import Metrics
from triollm.server.ollama import ModelFacts
from triollm.server.openai import (
    ApiError,
    field_error,
    is_prompt_list,
    load_object,
    parse_chat,
    parse_completions,
)
from triollm.server.responses import ResponseWriter, error_response, json_text
from triollm.service import Lifecycle, RequestStream, Service
from triollm.spec import GenerationSpec

__all__ = ["DEFAULT_MAX_BODY_BYTES", "Handlers", "ServedModel", "create_app", "http_error"]

log = logging.getLogger("triollm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB: a long prompt is ~100 KB of JSON
MIN_BODY_LIMIT_BYTES = 1024 * 1024


def body_limit_for(largest_request: int, max_chars_per_token: int) -> int:
    """The default body limit, sized to what can fit: the largest request's tokens at
    the most characters a token can hold, 6 bytes each (JSON's ``\\uXXXX``), plus
    64 KiB for the rest of the body; at least 1 MiB. 4,096 positions: 1 MiB."""
    sized = largest_request * max(1, max_chars_per_token) * 6 + 64 * 1024
    return max(MIN_BODY_LIMIT_BYTES, sized)


DEFAULT_BODY_TIMEOUT_S = 60.0  # headers sent, body never finished: 408 after this


def http_error(err: HTTPException) -> ApiError:
    """Werkzeug's HTTP errors in OpenAI's shape. A 5xx is the server's fault:
    ``server_error``, never ``invalid_request_error`` (clients retry on the type)."""
    status = err.code or 500
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = err.name.lower().replace(" ", "_")
    return ApiError(status, err.description or err.name, type=kind, code=code)


# Bodies larger than this are parsed in a worker thread (a thread costs ~0.1 ms; a
# 64 KiB body parses in a few ms).
PARSE_OFF_LOOP_BYTES = 64 * 1024


async def read_body() -> bytes:
    raw: bytes = await request.get_data(cache=False, as_text=False)  # type: ignore[assignment]
    return raw


T = TypeVar("T")


async def _parsed(parse: Callable[[bytes], T], raw: bytes) -> T:
    if len(raw) > PARSE_OFF_LOOP_BYTES:
        # Parsing is Python: 20,000 empty messages (660 KB) took 0.3-0.7 s, which on
        # the loop froze every stream (issue 28). In a thread the loop keeps its turns.
        return await trio.to_thread.run_sync(parse, raw, limiter=TEXT_LIMITER)
    return parse(raw)


async def _respond(writer: Writer, streaming: bool) -> Response:
    """The writer's stream (each event its own body message), or its whole body."""
    if streaming:
        response = Response(writer.events(), mimetype=writer.media_type, headers=dict(sse.HEADERS))
        response.timeout = None  # never cut a stream (Quart's RESPONSE_TIMEOUT)
        return response
    body, status = await writer.whole()
    return Response(json_text(body), status=status, mimetype="application/json")


class Handlers:
    """The routes' bodies, one small method per endpoint (``create_app`` wires them).

    Every generation endpoint is the same four moves: parse the body into a
    :class:`~triollm.request.GenerationRequest` (the API's own module), prepare it
    into a spec (``request.Preparer``), submit the spec (the service's queue), and
    shape the stream (``responses.py``). A new API is a parser and a writer beside
    these, not a new path into the model.
    """

    def __init__(
        self,
        service: Service,
        model: ServedModel,
        metrics: Metrics,
        max_body_bytes: int,
    ) -> None:
        self.service = service
        self.model = model
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.preparer = Preparer(
            model, service.scheduler, max_tokens_default=service.config.max_tokens_default
        )
        self.unknown = UnknownFields()  # the fields nobody knows, logged once per API

    # -- errors ---------------------------------------------------------------------

    @staticmethod
    def error(err: ApiError) -> Response:
        """The error in the shape of the API the path belongs to: Anthropic's and
        Ollama's clients read their own (the rest, the Responses API too, OpenAI's)."""
        path = request.path
        if path.startswith("/v1/messages"):
            body: dict[str, Any] = anthropic.error_body(err)
        elif path.startswith("/api/"):
            body = ollama.error_body(err)
        else:
            return error_response(err)
        return Response(
            json_text(body), status=err.status, mimetype="application/json", headers=err.headers
        )

    def refused(self, exc: Refusal) -> ApiError:
        """A capacity refusal (a queue full or a wait expired) as its 429, counted: the
        one mapping for generation's queue and embeddings'."""
        self.metrics.ended_early(exc.reason)
        return ApiError(
            429,
            str(exc),
            type="rate_limit_error",
            code=exc.reason.value,
            headers={"Retry-After": str(exc.retry_after_s)},
        )

    async def on_api_error(self, err: ApiError) -> Response:
        if err.status in (400, 404, 413):
            self.metrics.ended_early(Refused.BAD_REQUEST)
        return self.error(err)

    async def on_field_error(self, err: FieldError) -> Response:
        # A field the model layer refused (SamplingParams' ranges): its .field is param.
        return await self.on_api_error(field_error(err))

    async def on_http_error(self, err: HTTPException) -> Response:
        if isinstance(err, RequestEntityTooLarge):
            self.metrics.ended_early(Refused.BAD_REQUEST)
            message = f"the request body is larger than the limit of {self.max_body_bytes} bytes"
            return self.error(ApiError(413, message, code="request_too_large"))
        return self.error(http_error(err))

    async def on_bug(self, err: Exception) -> Response:
        log.exception("unhandled error")
        return self.error(ApiError(500, f"internal error: {err}", type="server_error"))

    # -- probes and the model card ----------------------------------------------------

    async def health(self) -> Any:
        # Liveness. A process whose batch loop has failed is alive but useless, and
        # orchestrators copied from other servers probe /health, not /ready: say so.
        state = self.service.state
        if state is Lifecycle.FAILED:
            return {"status": "failed", "reason": self.service.failed}, 503
        if state is Lifecycle.STARTING:
            # Warming up (kernels compiling): not serving yet, as llama-server says
            # while loading. During the drain it stays 200: killing a draining
            # process would cut the streams the grace is for.
            return {"status": "warming up"}, 503
        return {"status": "ok"}

    async def ready(self) -> Any:
        state = self.service.state
        if state is Lifecycle.FAILED:
            return {"status": "failed", "reason": self.service.failed}, 503
        if state is Lifecycle.READY:
            return {"status": "ready", "model": self.model.id}
        return {"status": state.value}, 503  # "warming up" or "shutting down"

    async def metrics_page(self) -> Response:
        return Response(self.metrics.render(), mimetype=None, content_type=METRICS_CONTENT_TYPE)

    def _model_card(self) -> dict[str, Any]:
        model = self.model
        return {
            "id": model.id,
            "object": "model",
            "created": model.created,
            "owned_by": "triollm",
            "max_model_len": model.context_tokens,
        }

    async def models(self) -> Any:
        return {"object": "list", "data": [self._model_card()]}

    async def model_by_id(self, model_id: str) -> Any:
        # client.models.retrieve(id); ids may hold slashes ("org/name").
        self.check_model(model_id)
        return self._model_card()

    def check_model(self, model_id: str | None) -> None:
        if model_id is not None and model_id != self.model.id:
            raise ApiError(
                404,
                f"the model '{model_id}' does not exist; this server serves '{self.model.id}'",
                param="model",
                code="model_not_found",
            )

    # -- tokens -----------------------------------------------------------------------

    async def tokenize(self) -> Any:
        # vLLM's and llama-server's endpoint: {"prompt": ...} (or llama-server's
        # "content"), or {"messages": [...]} through the chat template. Same parsing,
        # same limits and the same worker thread as a generation request. A list of
        # prompts, as /v1/completions takes it, gets a count and a token list each.
        body = load_object(await read_body())
        if "content" in body and "prompt" not in body:
            body["prompt"] = body.pop("content")
        raw = json_text(body).encode()
        reqs = [parse_chat(raw)] if "messages" in body else parse_completions(raw)
        self.unknown.note(request.path, reqs[0].unknown)
        with refusals():
            ids = [await self.preparer.tokenize(r) for r in reqs]
        limit = self.model.context_tokens
        if "messages" in body or not is_prompt_list(body.get("prompt")):
            return {"count": len(ids[0]), "max_model_len": limit, "tokens": ids[0]}
        return {"count": [len(one) for one in ids], "max_model_len": limit, "tokens": ids}

    async def detokenize(self) -> Any:
        tokens = load_object(await read_body()).get("tokens")
        # No more ids than the largest request holds: no answer or prompt is longer, and
        # uncapped, a 3.2 MB request came back as 137 MB (issue 28, N9). The text goes
        # out under vLLM's key and llama-server's; the cap bounds both.
        if isinstance(tokens, list) and len(tokens) > self.model.context_tokens:
            raise ApiError(
                400,
                f"'tokens' holds {len(tokens)} ids, past the limit of "
                f"{self.model.context_tokens} (this server's maximum context length)",
                param="tokens",
            )
        limit = self.model.vocab_limit
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in tokens
        ):
            raise ApiError(
                400, f"'tokens' must be a list of token ids below {limit}", param="tokens"
            )
        text = await self.preparer.decode(tokens)
        return {"prompt": text, "content": text}  # vLLM's key, llama-server's key

    async def completions_render(self) -> Any:
        # llm-d's precise prefix routing (and vllm-router's kv_aware, before it falls
        # back to /tokenize) hashes a request's exact token ids to find the replica that
        # holds its blocks: the ids this server would run, one entry per prompt (vLLM's
        # and llm-d's simulator's shape; a list of prompts, as /v1/completions takes
        # it, gets an entry each). Nothing is generated and nothing queues.
        return [{"token_ids": ids} for ids in await self._render(parse_completions)]

    async def chat_completions_render(self) -> Any:
        # The same for a conversation: the ids after the chat template, as one object.
        (ids,) = await self._render(lambda raw: [parse_chat(raw)])
        return {"token_ids": ids}

    async def _render(self, parse: Callable[[bytes], list[GenerationRequest]]) -> list[list[int]]:
        reqs = await _parsed(parse, await read_body())
        self.unknown.note(request.path, reqs[0].unknown)
        self.check_model(reqs[0].model)
        with refusals():
            return [await self.preparer.tokenize(req) for req in reqs]

    # -- generation -------------------------------------------------------------------

    async def completions(self) -> Response:
        return await self.generate(parse_completions)

    async def chat_completions(self) -> Response:
        return await self.generate(lambda raw: [parse_chat(raw)])

    async def generate(self, parse: Callable[[bytes], list[GenerationRequest]]) -> Response:
        """Parse, prepare, submit, shape: one OpenAI chat or completions request. A list
        of prompts (completions) is a request per prompt, submitted together
        (``Service.submit_prompts``) and written as one response."""
        life: RequestLife = request.scope[LIFE_KEY]  # type: ignore[literal-required]
        reqs = await _parsed(parse, await read_body())
        req = reqs[0]  # the fields the prompts share
        self.unknown.note(request.path, req.unknown)
        self.check_model(req.model)
        with refusals():
            specs = [await self.preparer.prepare(r) for r in reqs]
        echoes = []
        for r in reqs:
            echo = ""
            if r.echo:  # /v1/completions: the prompt's text, then the answer's
                echo = r.prompt_text or ""
                if r.prompt_ids is not None:
                    echo = await self.preparer.decode(r.prompt_ids)
            echoes.append(echo)
        stream = await self._start(specs, life, req.stream)
        return await _respond(ResponseWriter(req, self.model, stream, echoes), req.stream)

    async def translated(self, parse: Callable[[bytes], Translation]) -> Response:
        """The same four moves for an API that translates onto chat (Responses,
        Messages, Ollama): its parser builds the request and names its writer."""
        life: RequestLife = request.scope[LIFE_KEY]  # type: ignore[literal-required]
        t = await _parsed(parse, await read_body())
        self.unknown.note(t.api, t.unknown)
        self.check_model(t.request.model)
        with refusals():
            spec = await self.preparer.prepare(t.request)
        if t.adjust is not None:
            spec = t.adjust(spec)
        stream = await self._start([spec], life, t.request.stream)
        return await _respond(t.writer(self.model, stream), t.request.stream)

    async def _start(
        self, specs: list[GenerationSpec], life: RequestLife, streaming: bool
    ) -> RequestStream:
        stream = await self._submit(specs, life)
        life.stream = stream
        # "generating" for a whole-body answer, so a cut one is not logged as a stream.
        life.stage = Stage.STREAMING if streaming else Stage.GENERATING
        return stream

    async def _submit(self, specs: list[GenerationSpec], life: RequestLife) -> RequestStream:
        """Queue the specs (one per prompt) and wait for the admission of all; every
        refusal as its HTTP status."""
        life.stage = Stage.QUEUED
        try:
            return await self.service.submit_prompts(specs)
        except Infeasible as exc:
            life.stage = Stage.REFUSED
            # 'n', 'prompt': the choices do not fit the slots or the pool together,
            # whatever the context.
            code = None if exc.field in ("n", "prompt") else "context_length_exceeded"
            raise field_error(exc, code=code) from None
        except FieldError as exc:  # a priority out of range, or one the policy ignores
            life.stage = Stage.REFUSED
            raise field_error(exc) from None
        except Refusal as exc:
            life.stage = Stage.REFUSED
            raise self.refused(exc) from None
        except QueueClosed as exc:
            life.stage = Stage.REFUSED
            if self.service.state is Lifecycle.FAILED:
                raise ApiError(
                    503, str(exc), type="service_unavailable", code="server_failed"
                ) from None
            raise ApiError(
                503,
                str(exc),
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": str(self.service.retry_after_s())},
            ) from None


class refusals:
    """What ``Preparer`` refuses, as the edge answers it: text that cannot fit is
    ``context_length_exceeded`` (400); a broken chat template is the server's (500).
    Any other FieldError reaches the app's handler: 400 with its ``param``."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Infeasible):
            raise field_error(exc, code="context_length_exceeded") from None
        if isinstance(exc, TemplateBroken):
            raise ApiError(500, str(exc), type="server_error", code="chat_template_error") from None


def create_app(
    service: Service,
    model: ServedModel,
    metrics: Metrics,
    *,
    drain_nursery: trio.Nursery,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    door: DoorPolicy | None = None,
    embedder: Pooler | None = None,
    facts: ModelFacts | None = None,
) -> Lifetime:
    """The ASGI application: quart-trio routes (:class:`Handlers`) wrapped in
    :class:`Lifetime`.

    ``drain_nursery`` outlives every request (Lifetime's refused-body drainers run
    there); ``frontend.serve_http`` passes its own. ``embedder``: pools embeddings
    for /v1/embeddings (None: that route answers 404); ``facts``: what Ollama's
    listings say of the model."""
    app = QuartTrio("triollm")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BODY_TIMEOUT"] = body_timeout_s  # a body that stops arriving: 408
    app.config["RESPONSE_TIMEOUT"] = None  # a 60 s default would silently cut long streams
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False
    from triollm.server.apiroutes import ApiRoutes  # it builds on Handlers: imported here

    h = Handlers(service, model, metrics, max_body_bytes)
    others = ApiRoutes(h, embedder, ModelFacts() if facts is None else facts)
    app.register_error_handler(ApiError, h.on_api_error)
    app.register_error_handler(FieldError, h.on_field_error)
    app.register_error_handler(HTTPException, h.on_http_error)
    app.register_error_handler(Exception, h.on_bug)
    routes: list[tuple[str, str, Callable[..., Any]]] = [
        ("GET", "/health", h.health),
        ("GET", "/ready", h.ready),
        ("GET", "/metrics", h.metrics_page),
        ("GET", "/v1/models", h.models),
        ("GET", "/v1/models/<path:model_id>", h.model_by_id),
        ("POST", "/v1/completions", h.completions),
        ("POST", "/v1/chat/completions", h.chat_completions),
        ("POST", "/v1/completions/render", h.completions_render),
        ("POST", "/v1/chat/completions/render", h.chat_completions_render),
        ("POST", "/tokenize", h.tokenize),
        ("POST", "/detokenize", h.detokenize),
        # OpenAI's Responses, Anthropic's Messages, Ollama's API, embeddings (apiroutes.py)
        *others.routes(),
    ]
    for method, path, view in routes:
        app.add_url_rule(path, view_func=view, methods=[method])
    # The door (Host, CORS, API key, content type) inside the lifetime middleware, so
    # its refusals are logged and a refused body's connection is closed like any other.
    door = DoorPolicy() if door is None else door
    return Lifetime(Door(app, door), metrics, service, drain_nursery)
