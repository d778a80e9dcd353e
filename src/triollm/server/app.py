"""The HTTP edge: a quart-trio app, the request-lifetime middleware, and hypercorn.

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
3. A streaming response is an async generator: each SSE event is yielded on its
   own and quart sends it as its own ``http.response.body`` message, which
   hypercorn writes to the socket as one HTTP/1.1 chunk, at once.
4. :class:`Lifetime`, an ASGI middleware around the whole app, owns the
   request's end. Its ``finally`` runs however the request ends (normal, error,
   cancelled before or after the response started) and calls the stream's
   synchronous ``close()``: an ``await`` there would raise at once, because the
   scope is already cancelled. A request cut short by its client is logged with
   status 499 and counted as ``client_closed``.

Traps designed around (each has a test under tests/server/):

- Quart's ``RESPONSE_TIMEOUT`` (60 s by default) wraps the body in
  ``move_on_after``: a longer stream is silently cut and the client sees a
  truncated chunked body. We set it to ``None`` for the app and for each stream.
- The Quart ``request`` object is gone inside the body generator (no request
  context): everything is read before the response is returned.
- hypercorn's shielded, deadline-free socket write: see ``transport.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import hypercorn.trio
import trio
from hypercorn.config import Config as HyperConfig
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from triollm.admission import QueueClosed, Refusal
from triollm.errors import UserError
from triollm.scheduler import Infeasible
from triollm.server import sse, transport
from triollm.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from triollm.server.metrics import Metrics
from triollm.server.openai import ApiError, GenerationRequest, parse_chat, parse_completion
from triollm.service import Completed, Delta, Failed, RequestStream, Service

log = logging.getLogger("triollm.server")

LIFE_KEY = "triollm.life"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 8 MiB: a long prompt is ~100 KB of JSON


@dataclass
class ServedModel:
    """What the edge needs to know about the model it serves."""

    id: str
    tokenizer: Any  # triollm.model.tokenizer.Tokenizer (encode, encode_chat, decode, vocab_size)
    context_tokens: int
    created: int
    make_params: Callable[..., Any]  # SamplingParams
    # The model's embedding rows (config.vocab_size). A tokenizer may know more ids
    # (added tokens past the checkpoint's vocabulary); such an id must be refused
    # here, or the forward pass it reaches fails for every request in the step.
    model_vocab_size: int | None = None

    @property
    def vocab_limit(self) -> int:
        """Token ids must be below this: min(tokenizer vocabulary, model vocabulary)."""
        tok = int(self.tokenizer.vocab_size)
        return tok if self.model_vocab_size is None else min(tok, self.model_vocab_size)


@dataclass
class RequestLife:
    """One request as the middleware sees it."""

    method: str
    path: str
    started: float
    stage: str = "reading"  # reading -> queued -> streaming | generating | refused
    stream: RequestStream | None = None
    disconnected: bool = False
    status: int | None = None
    response_done: bool = False
    body_pending: bool = False  # the request has a body we have not read to its end
    closes_connection: bool = False  # we answered before the body ended: Connection: close


class Lifetime:
    """ASGI middleware: records disconnects and ends every request synchronously."""

    def __init__(self, app: Any, metrics: Metrics, service: Service) -> None:
        self.app = app
        self.metrics = metrics
        self.service = service
        self.in_flight = 0  # HTTP requests whose handler task has not ended
        # Where drainers of refused bodies run (serve_http sets it): they must outlive
        # the request's own task.
        self.drain_nursery: trio.Nursery | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        life = RequestLife(scope["method"], scope["path"], time.monotonic())
        life.body_pending = _has_body(scope)
        scope[LIFE_KEY] = life  # quart's Request keeps this same dict as request.scope

        async def watched_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect" and not life.response_done:
                life.disconnected = True
            elif message["type"] == "http.request" and not message.get("more_body"):
                life.body_pending = False
            return message

        async def watched_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                life.status = message["status"]
                if life.status >= 500:
                    self.metrics.server_error(life.status)
                if life.body_pending:
                    # An answer sent before the body was read (413, 404 on a POST...):
                    # the unread rest of the body is still coming down this connection,
                    # so it cannot carry another request. Without "Connection: close"
                    # the server waits for a body it will never read and a keep-alive
                    # client waits for the connection: both hang.
                    headers = [
                        h for h in message.get("headers", []) if h[0].lower() != b"connection"
                    ]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
                    life.closes_connection = True
                    # hypercorn 0.18 trap: closing that connection first hands the app
                    # an ``http.disconnect`` through a bounded queue that the unread
                    # body has filled, and the app has stopped reading: the close
                    # deadlocks. A drainer task keeps receiving until that disconnect.
                    if self.drain_nursery is not None:
                        self.drain_nursery.start_soon(_drain_until_disconnect, receive)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                life.response_done = True
                if life.closes_connection:
                    # This send also closes the socket (hypercorn does it inside the
                    # call), and it hands the app the disconnect that makes quart-trio
                    # cancel this very task: unshielded, that cancel can land between
                    # "response written" and "socket closed", leaving the client
                    # waiting on an open connection. The socket write has its own
                    # deadline (transport.py), so the shield cannot pin us.
                    with trio.CancelScope(shield=True):
                        await send(message)
                    return
            await send(message)

        self.in_flight += 1
        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            self.in_flight -= 1
            self._end(life)  # sync: we may be inside a cancelled scope

    def _end(self, life: RequestLife) -> None:
        # Cut without a disconnect while shutting down: the grace period ran out.
        by_shutdown = self.service.closing and not life.disconnected
        reason = "shutdown" if by_shutdown else "client_closed"
        cut = life.stream.close(reason) if life.stream is not None else False
        left_queued = life.stage == "queued" and life.disconnected
        if left_queued:
            self.metrics.rejected("client_closed")  # a stream counts itself in the service
        if cut and by_shutdown:
            log.info("%s %s cut short by the shutdown", life.method, life.path)
        elif cut or left_queued:
            where = "while queued" if left_queued else f"while {life.stage}"
            log.info("%s %s 499 client closed the connection %s", life.method, life.path, where)
        elif life.status is not None:
            outcome = life.stream.outcome if life.stream is not None else None
            # A stream the server ended (too_slow, internal) still has status 200:
            # say why it ended, or the log shows a cut-off stream as a success.
            why = f" ended early: {outcome.code}" if isinstance(outcome, Failed) else ""
            log.info(
                "%s %s %d %.3fs%s",
                life.method,
                life.path,
                life.status,
                time.monotonic() - life.started,
                why,
            )
        self.service.notify()  # wake anything waiting on this request's end


DRAIN_LIMIT_S = 30.0  # a drainer gives up after this (a resource bound, not a timing)


async def _drain_until_disconnect(receive: Any) -> None:
    """Discard the rest of a refused body until the connection closes (see Lifetime)."""
    with trio.move_on_after(DRAIN_LIMIT_S):
        while (await receive())["type"] != "http.disconnect":
            pass


def _has_body(scope: dict[str, Any]) -> bool:
    for name, value in scope.get("headers", []):
        name = name.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
    return False


def http_error(err: HTTPException) -> ApiError:
    """Werkzeug's HTTP errors in OpenAI's shape. A 5xx is the server's fault:
    ``server_error``, never ``invalid_request_error`` (clients retry on the type)."""
    status = err.code or 500
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = err.name.lower().replace(" ", "_")
    return ApiError(status, err.description or err.name, type=kind, code=code)


def _error_response(err: ApiError) -> Response:
    response = Response(
        sse_json(err.body()), status=err.status, mimetype="application/json", headers=err.headers
    )
    return response


def sse_json(obj: Any) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)


def create_app(
    service: Service,
    model: ServedModel,
    metrics: Metrics,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Lifetime:
    """The ASGI application: quart-trio routes wrapped in :class:`Lifetime`."""
    app = QuartTrio("triollm")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # a 60 s default would silently cut long streams
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False

    @app.errorhandler(ApiError)
    async def on_api_error(err: ApiError) -> Response:
        if err.status in (400, 404, 413):
            metrics.rejected("bad_request")
        return _error_response(err)

    @app.errorhandler(HTTPException)
    async def on_http_error(err: HTTPException) -> Response:
        if isinstance(err, RequestEntityTooLarge):
            metrics.rejected("bad_request")
            message = f"the request body is larger than the limit of {max_body_bytes} bytes"
            return _error_response(ApiError(413, message, code="request_too_large"))
        return _error_response(http_error(err))

    @app.errorhandler(Exception)
    async def on_bug(err: Exception) -> Response:
        log.exception("unhandled error")
        return _error_response(ApiError(500, f"internal error: {err}", type="server_error"))

    @app.get("/health")
    async def health() -> Any:
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

    @app.get("/v1/models")
    async def models() -> Any:
        return {
            "object": "list",
            "data": [
                {
                    "id": model.id,
                    "object": "model",
                    "created": model.created,
                    "owned_by": "triollm",
                    "max_model_len": model.context_tokens,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await _generate(parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await _generate(parse_chat)

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
        prompt_ids = _prompt_ids(req, model)
        params = _sampling_params(req, model)
        life.stage = "queued"
        try:
            stream = await service.submit(
                prompt_ids,
                params=params,
                max_tokens=req.max_tokens,
                stop=req.stop,
                ignore_eos=req.ignore_eos,
                want_logprobs=req.logprobs is not None,
            )
        except Infeasible as exc:
            life.stage = "refused"
            raise ApiError(400, str(exc), param=exc.field, code="context_length_exceeded") from None
        except Refusal as exc:
            life.stage = "refused"
            metrics.rejected(exc.reason)
            raise ApiError(
                429,
                str(exc),
                type="rate_limit_error",
                code=exc.reason,
                headers={"Retry-After": str(exc.retry_after_s)},
            ) from None
        except QueueClosed as exc:
            life.stage = "refused"
            code = "server_failed" if service.failed is not None else "shutting_down"
            raise ApiError(503, str(exc), type="service_unavailable", code=code) from None
        life.stream = stream
        # "generating" for a whole-body answer, so a cut one is not logged as a stream.
        life.stage = "streaming" if req.stream else "generating"
        writer = _Writer(req, model, stream)
        if req.stream:
            response = Response(
                writer.events(), mimetype=sse.CONTENT_TYPE, headers=dict(sse.HEADERS)
            )
            response.timeout = None  # never cut a stream (Quart's RESPONSE_TIMEOUT)
            return response
        body, status = await writer.whole()
        return Response(sse_json(body), status=status, mimetype="application/json")

    return Lifetime(app, metrics, service)


# --------------------------------------------------------------------------- request -> model


def _prompt_ids(req: GenerationRequest, model: ServedModel) -> list[int]:
    tokenizer = model.tokenizer
    limit = model.vocab_limit
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
        what = "holds token id"
    elif req.prompt_text is not None:
        ids = list(tokenizer.encode(req.prompt_text))
        what = "encodes to token id"
    else:
        assert req.messages is not None
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            ids = list(tokenizer.encode_chat(messages))
        except UserError as exc:
            raise ApiError(400, str(exc), param="messages") from None
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


def _sampling_params(req: GenerationRequest, model: ServedModel) -> Any:
    try:
        return model.make_params(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            logprobs=req.logprobs,
        )
    except ValueError as exc:
        # SamplingParams names the field first ("top_p must be ..."): use it as param.
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None


# --------------------------------------------------------------------------- response shapes


class _Writer:
    """Turns a RequestStream into OpenAI's JSON: SSE chunks or one whole object.

    Built before the response starts (it must not touch ``request``)."""

    def __init__(self, req: GenerationRequest, model: ServedModel, stream: RequestStream) -> None:
        self.req = req
        self.model = model
        self.stream = stream
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text_offset = 0

    # -- logprobs -------------------------------------------------------------------

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """(display string, the token's own bytes) for a logprobs entry.

        A token that is part of a UTF-8 character decodes to U+FFFD on its own, so
        every such byte token would show (and, as a ``top_logprobs`` key, collide)
        as the same "\ufffd". Those are shown as ``bytes:\\xNN`` (OpenAI's
        spelling) with their real bytes."""
        text = str(self.model.tokenizer.decode([token_id], skip_special_tokens=False))
        if "\ufffd" not in text:
            return text, text.encode()
        raw = _raw_token_bytes(self.model.tokenizer, token_id)
        if raw is None:
            return text, text.encode()
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        if self.chat:
            content = []
            for t in delta.tokens:
                s, raw = self._token(t.token_id)
                alts = []
                for i, lp in t.top:
                    alt, alt_raw = self._token(i)
                    alts.append({"token": alt, "logprob": lp, "bytes": list(alt_raw)})
                content.append(
                    {"token": s, "logprob": t.logprob, "bytes": list(raw), "top_logprobs": alts}
                )
            return {"content": content}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for t in delta.tokens:
            tokens.append(self._token(t.token_id)[0])
            token_logprobs.append(t.logprob)
            top.append({self._token(i)[0]: lp for i, lp in t.top})
            # Where this token's text starts in the returned text: the text is what
            # the detokenizer and stop matcher released, not the tokens' own strings.
            offsets.append(self.text_offset)
        self.text_offset += len(delta.text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    # -- chunks ---------------------------------------------------------------------

    def _chunk(self, delta: Delta | None, finish: str | None, first: bool = False) -> bytes:
        lp = self._logprobs(delta) if delta is not None else None
        text = delta.text if delta is not None else ""
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                d["content"] = text
            choice: dict[str, Any] = {
                "index": 0,
                "delta": d,
                "logprobs": lp,
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
            obj = "text_completion"
        return sse.event(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model.id,
                "choices": [choice],
            }
        )

    def _usage(self, prompt: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body. Holds no cleanup: the middleware ends the request."""
        if self.chat:
            yield self._chunk(None, None, first=True)
        async for delta in self.stream:
            yield self._chunk(delta, None)
        outcome = self.stream.outcome
        if isinstance(outcome, Completed):
            yield self._chunk(outcome.final, outcome.finish_reason)
            if self.req.include_usage:
                yield sse.event(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created,
                        "model": self.model.id,
                        "choices": [],
                        "usage": self._usage(outcome.prompt_tokens, outcome.completion_tokens),
                    }
                )
        else:
            code, message = (
                (outcome.code, outcome.message)
                if isinstance(outcome, Failed)
                else ("internal", "the stream ended without an outcome")
            )
            yield sse.error_event(message, type="server_error", code=code)
        yield sse.DONE

    async def whole(self) -> tuple[dict[str, Any], int]:
        """The non-streaming body: (JSON object, status)."""
        texts: list[str] = []
        lps: list[dict[str, Any] | None] = []
        async for delta in self.stream:
            texts.append(delta.text)
            lps.append(self._logprobs(delta))
        outcome = self.stream.outcome
        if not isinstance(outcome, Completed):
            code, message = (
                (outcome.code, outcome.message) if outcome else ("internal", "no outcome")
            )
            status = 503 if code == "shutdown" else 500
            return ApiError(status, message, type="server_error", code=code).body(), status
        texts.append(outcome.final.text)
        lps.append(self._logprobs(outcome.final))
        text = "".join(texts)
        logprobs = _merge_logprobs([x for x in lps if x is not None], self.chat)
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": outcome.finish_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": outcome.finish_reason,
            }
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model.id,
            "choices": [choice],
            "usage": self._usage(outcome.prompt_tokens, outcome.completion_tokens),
        }
        return body, 200


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: bytes that are
    printable Latin-1 stand for themselves, the other 68 are shifted to 256 + n in
    order. This is the inverse map (character -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


def _raw_token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes a token stands for (byte-fallback ``<0xNN>`` or byte-level BPE)."""
    piece = tokenizer.token_text(token_id) if hasattr(tokenizer, "token_text") else None
    if piece is None:
        return None
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


def _merge_logprobs(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any] | None:
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}


# --------------------------------------------------------------------------- hypercorn


def _aborted(metrics: Metrics, service: Service) -> None:
    metrics.connections_aborted.inc()
    service.notify()


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    grace_s: float = 30.0  # shutdown: how long in-flight streams may run on (= the queue wait)
    # A socket write that makes no progress this long aborts the connection (transport.py).
    write_timeout_s: float | None = 30.0
    send_buffer_bytes: int | None = None  # SO_SNDBUF; None = the kernel's autotuned default


async def serve_http(
    service: Service,
    app: Lifetime,
    config: HttpConfig,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run hypercorn until ``shutdown`` is set, then drain gracefully.

    On shutdown: the queue closes (waiters get 503), hypercorn stops accepting and
    gives in-flight requests ``grace_s`` seconds; connections still open after
    that (a write stuck on a client that does not read) are aborted.
    """
    if not transport.install():
        log.warning("the slow-client write guard is off (unsupported hypercorn version)")
    hconfig = HyperConfig()
    hconfig.bind = [f"{config.host}:{config.port}"]
    hconfig.graceful_timeout = config.grace_s
    hconfig.accesslog = None  # Lifetime logs each request, with 499s
    hconfig.errorlog = log
    connections = transport.configure(
        hconfig,
        write_timeout_s=config.write_timeout_s,
        send_buffer_bytes=config.send_buffer_bytes,
        on_abort=partial(_aborted, app.metrics, service),
    )

    async with trio.open_nursery() as nursery:

        async def watchdog() -> None:
            await shutdown.wait()
            service.begin_shutdown()
            await trio.sleep(config.grace_s + 0.5)
            n = await transport.abort_all(connections)
            if n:
                log.warning("aborted %d connection(s) still open after the grace period", n)

        async def run_server(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(
                app,  # type: ignore[arg-type]
                hconfig,
                shutdown_trigger=shutdown.wait,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # served and drained: stop the watchdog

        nursery.start_soon(watchdog)
        app.drain_nursery = nursery
        binds = await nursery.start(partial(run_server))
        task_status.started(binds)
