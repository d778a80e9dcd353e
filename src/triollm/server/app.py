"""The HTTP edge's routes: a quart-trio app, wrapped in the request-lifetime middleware.

What happens to one ``POST /v1/completions`` (read with docs/serving.md):

1. hypercorn parses the request and starts the ASGI app in its own task;
   quart-trio runs our view and a ``receive`` loop side by side in one nursery.
   When the client disconnects, hypercorn's reader sees EOF, sends
   ``http.disconnect``, and quart-trio cancels that nursery: our view (or the body
   generator) gets ``trio.Cancelled`` at its next checkpoint -- while parked in the
   admission queue, while waiting on the token channel, anywhere.
2. The view reads the whole body (413 past ``max_body_bytes``), parses it
   (``openai.py``: 400 naming the field, 404 for another model), tokenizes, builds
   the sampling parameters, and waits for admission (429 + ``Retry-After``). Only
   then does it return a response, so every refusal is a real status code.
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
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from triollm.admission import QueueClosed, Refusal
from triollm.errors import FieldError, UserError
from triollm.model.constrained import JSON_OPTIONS, GrammarKind, GrammarSpec
from triollm.model.tokenizer import ChatTemplateError, TooManyTokens
from triollm.outcomes import Refused
from triollm.scheduler import Infeasible
from triollm.server import sse
from triollm.server.door import Door, DoorPolicy
from triollm.server.lifetime import LIFE_KEY, Lifetime, RequestLife, Stage
from triollm.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from triollm.server.metrics import Metrics
from triollm.server.openai import (
    ApiError,
    GenerationRequest,
    field_error,
    load_object,
    parse_chat,
    parse_completion,
)
from triollm.server.responses import ResponseWriter, ServedModel, error_response, json_text
from triollm.server.structured import ToolChoice
from triollm.service import Choice, Service
from triollm.spec import SequenceSpec
from triollm.toolcalls import ToolCallFormat, ToolCallParser, tool_grammar

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServedModel", "create_app", "http_error"]

log = logging.getLogger("triollm.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB: a long prompt is ~100 KB of JSON
MIN_BODY_LIMIT_BYTES = 1024 * 1024
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default on /v1/completions


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


def create_app(
    service: Service,
    model: ServedModel,
    metrics: Metrics,
    *,
    drain_nursery: trio.Nursery,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    door: DoorPolicy | None = None,
) -> Lifetime:
    """The ASGI application: quart-trio routes wrapped in :class:`Lifetime`.

    ``drain_nursery`` outlives every request (Lifetime's refused-body drainers run
    there); ``frontend.serve_http`` passes its own."""
    app = QuartTrio("triollm")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["BODY_TIMEOUT"] = body_timeout_s  # a body that stops arriving: 408
    app.config["RESPONSE_TIMEOUT"] = None  # a 60 s default would silently cut long streams
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False

    @app.errorhandler(ApiError)
    async def on_api_error(err: ApiError) -> Response:
        if err.status in (400, 404, 413):
            metrics.ended_early(Refused.BAD_REQUEST)
        return error_response(err)

    @app.errorhandler(FieldError)
    async def on_field_error(err: FieldError) -> Response:
        # A field the model layer refused (SamplingParams' ranges): its .field is param.
        return await on_api_error(field_error(err))

    @app.errorhandler(HTTPException)
    async def on_http_error(err: HTTPException) -> Response:
        if isinstance(err, RequestEntityTooLarge):
            metrics.ended_early(Refused.BAD_REQUEST)
            message = f"the request body is larger than the limit of {max_body_bytes} bytes"
            return error_response(ApiError(413, message, code="request_too_large"))
        return error_response(http_error(err))

    @app.errorhandler(Exception)
    async def on_bug(err: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(ApiError(500, f"internal error: {err}", type="server_error"))

    @app.get("/health")
    async def health() -> Any:
        # Liveness. A process whose batch loop has failed is alive but useless, and
        # orchestrators copied from other servers probe /health, not /ready: say so.
        if service.failed is not None:
            return {"status": "failed", "reason": service.failed}, 503
        if not service.ready and not service.closing:
            # Warming up (kernels compiling): not serving yet, as llama-server says
            # while loading. During the drain it stays 200: killing a draining
            # process would cut the streams the grace is for.
            return {"status": "warming up"}, 503
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Any:
        if service.failed is not None:
            return {"status": "failed", "reason": service.failed}, 503
        if service.ready and not service.closing:
            return {"status": "ready", "model": model.id}
        state = "shutting down" if service.closing else "warming up"
        return {"status": state}, 503

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), mimetype=None, content_type=METRICS_CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {
            "id": model.id,
            "object": "model",
            "created": model.created,
            "owned_by": "triollm",
            "max_model_len": model.context_tokens,
        }

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/<path:model_id>")
    async def model_by_id(model_id: str) -> Any:
        # client.models.retrieve(id); ids may hold slashes ("org/name").
        if model_id != model.id:
            raise ApiError(
                404,
                f"the model '{model_id}' does not exist; this server serves '{model.id}'",
                param="model",
                code="model_not_found",
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _generate(parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _generate(parse_chat)

    @app.post("/tokenize")
    async def tokenize() -> Any:
        # vLLM's and llama-server's endpoint: {"prompt": ...} (or llama-server's
        # "content"), or {"messages": [...]} through the chat template. Same parsing,
        # same limits and the same worker thread as a generation request.
        raw: bytes = await request.get_data(cache=False, as_text=False)  # type: ignore[assignment]
        body = load_object(raw)
        if "content" in body and "prompt" not in body:
            body["prompt"] = body.pop("content")
        req = (parse_chat if "messages" in body else parse_completion)(json_text(body).encode())
        _refuse_text_that_cannot_fit(req, model)
        ids = await trio.to_thread.run_sync(_prompt_ids, req, model, limiter=TEXT_LIMITER)
        return {"count": len(ids), "max_model_len": model.context_tokens, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize() -> Any:
        raw: bytes = await request.get_data(cache=False, as_text=False)  # type: ignore[assignment]
        tokens = load_object(raw).get("tokens")
        limit = model.vocab_limit
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limit for t in tokens
        ):
            raise ApiError(
                400, f"'tokens' must be a list of token ids below {limit}", param="tokens"
            )
        text = await trio.to_thread.run_sync(model.tokenizer.decode, tokens, limiter=TEXT_LIMITER)
        return {"prompt": text, "content": text}  # vLLM's key, llama-server's key

    async def _generate(parse: Callable[[bytes], GenerationRequest]) -> Response:
        life: RequestLife = request.scope[LIFE_KEY]  # type: ignore[literal-required]
        raw: bytes = await request.get_data(cache=False, as_text=False)  # type: ignore[assignment]
        req = parse(raw)
        if req.model is not None and req.model != model.id:
            raise ApiError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{model.id}'",
                param="model",
                code="model_not_found",
            )
        _refuse_text_that_cannot_fit(req, model)
        _check_stop_token_ids(req, model)
        # Tokenizing and the chat template run in a worker thread: a long prompt must
        # not stall every other stream's event loop (tests/server/test_hostile_input.py).
        prompt_ids = await trio.to_thread.run_sync(_prompt_ids, req, model, limiter=TEXT_LIMITER)
        tool_format = _tool_format(req, model)
        spec = _constraint(req, model, tool_format)
        grammar = None
        if spec is not None:
            # Compiling may take many milliseconds for a large schema: off the loop.
            # A grammar refused is a GrammarError (a FieldError): 400. A client that
            # leaves meanwhile sets `cancel`: its compile's sandbox child is killed.
            cancel = threading.Event()
            try:
                grammar = await trio.to_thread.run_sync(
                    partial(model.grammars.get, spec, cancel=cancel), abandon_on_cancel=True
                )
            finally:
                cancel.set()
        choices = [
            Choice(
                _sampling_params(req, model, grammar, choice=i),
                ToolCallParser(tool_format) if tool_format is not None else None,
            )
            for i in range(req.n)
        ]
        max_tokens = req.max_tokens
        if (
            max_tokens is None
            and req.kind == "completion"
            and service.config.max_tokens_default is None
        ):
            # OpenAI's default for /v1/completions (vLLM follows it); chat keeps "the
            # rest of the context". Capped by the room left, so it never refuses; a
            # min_tokens above it raises it (the client asked for that many).
            room = service.scheduler.room(SequenceSpec(prompt_ids, n=req.n))
            wanted = max(COMPLETIONS_DEFAULT_MAX_TOKENS, req.min_tokens)
            max_tokens = min(wanted, room) if room >= 1 else None
        echo = ""
        if req.echo:  # /v1/completions: the prompt's text, then the answer's
            echo = req.prompt_text or ""
            if req.prompt_ids is not None:
                echo = await trio.to_thread.run_sync(
                    model.tokenizer.decode, list(req.prompt_ids), limiter=TEXT_LIMITER
                )
        life.stage = Stage.QUEUED
        try:
            stream = await service.submit_choices(
                prompt_ids,
                choices,
                max_tokens=max_tokens,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                want_logprobs=req.logprobs is not None,
                cache_salt=req.cache_salt,
                priority=req.priority,
                stop_token_ids=req.stop_token_ids,
                min_tokens=req.min_tokens,
                include_stop=req.include_stop_str_in_output,
                score_prompt=req.scores_prompt,
            )
        except Infeasible as exc:
            life.stage = Stage.REFUSED
            # 'n': the choices do not fit the slots or the pool, whatever the context.
            code = None if exc.field == "n" else "context_length_exceeded"
            raise field_error(exc, code=code) from None
        except FieldError as exc:  # a priority out of range, or one the policy ignores
            life.stage = Stage.REFUSED
            raise field_error(exc) from None
        except Refusal as exc:
            life.stage = Stage.REFUSED
            metrics.ended_early(exc.reason)
            raise ApiError(
                429,
                str(exc),
                type="rate_limit_error",
                code=exc.reason.value,
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        except QueueClosed as exc:
            life.stage = Stage.REFUSED
            if service.failed is not None:
                raise ApiError(
                    503, str(exc), type="service_unavailable", code="server_failed"
                ) from None
            raise ApiError(
                503,
                str(exc),
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": str(service.retry_after_s())},
            ) from None
        life.stream = stream
        # "generating" for a whole-body answer, so a cut one is not logged as a stream.
        life.stage = Stage.STREAMING if req.stream else Stage.GENERATING
        writer = ResponseWriter(req, model, stream, echo)
        if req.stream:
            response = Response(
                writer.events(), mimetype=sse.CONTENT_TYPE, headers=dict(sse.HEADERS)
            )
            response.timeout = None  # never cut a stream (Quart's RESPONSE_TIMEOUT)
            return response
        body, status = await writer.whole()
        return Response(json_text(body), status=status, mimetype="application/json")

    # The door (Host, CORS, API key, content type) inside the lifetime middleware, so
    # its refusals are logged and a refused body's connection is closed like any other.
    door = DoorPolicy() if door is None else door
    return Lifetime(Door(app, door), metrics, service, drain_nursery)


# --------------------------------------------------------------------------- request -> model


# Threads that tokenize prompts and render chat templates (their own pool: the batch
# loop's step thread must never wait behind them for trio's default limiter).
TEXT_LIMITER = trio.CapacityLimiter(2)


def _refuse_text_that_cannot_fit(req: GenerationRequest, model: ServedModel) -> None:
    """Refuse, before tokenizing, text that holds more tokens than the largest request.

    One token stands for at most ``max_chars_per_token`` characters, so a text of n
    characters is at least n / that many tokens; half that is taken as the bound,
    a margin for normalizers that merge characters. A 7.9 MB prompt against a
    4,096-token context is refused here in microseconds instead of being tokenized."""
    if req.prompt_text is not None:
        chars, param = len(req.prompt_text), "prompt"
    elif req.messages is not None:
        chars, param = sum(len(m.content) for m in req.messages), "messages"
    else:
        return
    per_token = 2 * int(getattr(model.tokenizer, "max_chars_per_token", 0) or 0)
    if per_token <= 0:
        return
    at_least = chars // per_token
    if at_least >= model.context_tokens:
        raise ApiError(
            400,
            f"'{param}' is {chars} characters, at least {at_least} tokens (one token is at "
            f"most {per_token // 2} characters), past this server's maximum context length "
            f"of {model.context_tokens} tokens",
            param=param,
            code="context_length_exceeded",
        )


def _check_stop_token_ids(req: GenerationRequest, model: ServedModel) -> None:
    limit = model.vocab_limit
    bad = [t for t in req.stop_token_ids if t >= limit]
    if bad:
        raise ApiError(
            400,
            f"'stop_token_ids' holds token id {bad[0]}, past the model's vocabulary of {limit}",
            param="stop_token_ids",
        )


def _prompt_ids(req: GenerationRequest, model: ServedModel) -> list[int]:
    tokenizer = model.tokenizer
    limit = model.vocab_limit
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
        what = "holds token id"
    elif req.prompt_text is not None:
        try:
            ids = list(tokenizer.encode(req.prompt_text, limit=model.context_tokens))
        except TooManyTokens as exc:
            raise _too_long(exc, "prompt") from None
        what = "encodes to token id"
    else:
        assert req.messages is not None
        messages = [m.for_template() for m in req.messages]
        # A template without a 'developer' branch would drop or refuse that message;
        # OpenAI's developer role is the system role of older templates (as vLLM maps it).
        if "developer" not in getattr(tokenizer, "chat_templates", {}).get("default", ""):
            for message in messages:
                if message.get("role") == "developer":
                    message["role"] = "system"
        tools = list(req.tools.definitions) if req.tools is not None else None
        try:
            ids = list(
                tokenizer.encode_chat(
                    messages,
                    tools=tools,
                    template_kwargs=dict(req.template_kwargs),
                    limit=model.context_tokens,
                )
            )
        except TooManyTokens as exc:
            raise _too_long(exc, "messages") from None
        except FieldError as exc:  # a template variable the server sets itself
            raise ApiError(400, str(exc), param=exc.field) from None
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except ChatTemplateError as exc:
            # The model's template broke: the server's configuration, not the request.
            raise ApiError(
                500,
                f"{exc} (a server configuration problem: the served model's chat template "
                "is broken; the request itself may be fine)",
                type="server_error",
                code="chat_template_error",
            ) from None
        what = "encodes to token id"
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        param = "messages" if req.messages is not None else "prompt"
        raise ApiError(
            400,
            f"'{param}' {what} {bad[0]}, past the model's vocabulary of {limit} "
            f"(tokenizer {tokenizer.vocab_size}, model {model.model_vocab_size})",
            param=param,
        )
    return ids


def _too_long(exc: TooManyTokens, param: str) -> ApiError:
    """A text refused before tokenizing (Tokenizer.at_least_tokens): the context's 400."""
    return ApiError(
        400,
        f"'{param}': {exc} (this server's maximum context length)",
        param=param,
        code="context_length_exceeded",
    )


def _tool_format(req: GenerationRequest, model: ServedModel) -> ToolCallFormat | None:
    """The format to parse tool calls in, or None when the request's calls are not
    parsed (no tools, or ``tool_choice: none``). Tools on a model whose format is
    unknown are refused: its calls would come back as text the client cannot act on."""
    if req.tools is None or req.tools.choice is ToolChoice.NONE:
        return None
    if model.tool_format is None:
        raise ApiError(
            400,
            "this model's chat template shows no tool-call format this server reads "
            f"({', '.join(f.value for f in ToolCallFormat)}); start it with "
            "--tool-call-parser to name one",
            param="tools",
        )
    return model.tool_format


def _constraint(
    req: GenerationRequest, model: ServedModel, tool_format: ToolCallFormat | None
) -> GrammarSpec | None:
    """The grammar the answer must follow: the request's own, or, for ``tool_choice``
    ``required`` or a named function, one that forces a call in the model's syntax."""
    forced = req.tools.forced() if req.tools is not None else ()
    if not forced:
        return req.grammar
    assert req.tools is not None and tool_format is not None  # _tool_format said so
    lark = tool_grammar(
        tool_format,
        forced,
        parallel=req.tools.parallel and req.tools.choice is ToolChoice.REQUIRED,
        special_token_id=model.tokenizer.special_token_id,
        json_options=JSON_OPTIONS,
    )
    return GrammarSpec(GrammarKind.LARK, lark, "tools")


def _sampling_params(
    req: GenerationRequest, model: ServedModel, grammar: Any = None, *, choice: int = 0
) -> Any:
    """The SamplingParams of the request's choice ``choice``; a value out of range
    raises its FieldError, which the app's handler answers with 400 and ``param``
    (the one owner of the ranges is ``SamplingParams``).

    Choice ``i`` samples with ``seed + i`` (vLLM gives each of its ``n`` the same
    kind of derived seed): the choices differ, and the same seed gives the same
    ``n`` answers again. Without a seed each choice draws from the OS's entropy.
    With ``temperature`` 0 every choice is the same greedy answer, as OpenAI's and
    vLLM's are."""
    seed = None if req.seed is None else req.seed + choice
    return model.make_params(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=seed,
        logprobs=req.logprobs,
        grammar=grammar,
    )
