"""Ollama's API, as a translation onto chat and completions.

Open WebUI's default connection, Continue, and many editor plugins speak Ollama's API
(``http://localhost:11434``); pointed at this server they list the served model and chat
with it. The routes:

- ``GET /api/tags``: the served model, as ``name:tag`` (``<id>:latest`` unless the id has
  a tag); ``GET /api/ps``: the same model, loaded; ``GET /api/version``;
  ``POST /api/show``: its chat template, context length, family and capabilities;
- ``POST /api/chat``: ``messages`` (``role``, ``content``, an assistant's ``tool_calls``
  with ``arguments`` as an object, a tool result's ``tool_name``), ``tools``,
  ``format``, ``options``, ``stream`` (default true);
- ``POST /api/generate``: ``prompt`` (and ``system``) through the chat template, or as
  it is with ``raw: true``.

The body is NDJSON when streamed (``application/x-ndjson``, one JSON object a line):
every line a piece of the answer with ``done: false``, the last one ``done: true`` with
``done_reason`` and Ollama's counters (``prompt_eval_count``, ``eval_count``, the
durations in nanoseconds, measured here at the edge). A call arrives whole, in a line of
its own before the last (Ollama sends calls whole, not in pieces). A failure after the
status line went out is a line ``{"error": ...}``; errors before it are Ollama's shape,
``{"error": "message"}``, with the status.

``format``: ``"json"`` is any JSON object, a schema object constrains the answer to it
(chat's ``response_format``). ``options`` map onto the sampler (:data:`OPTIONS`):
``num_predict`` is ``max_tokens`` (-1 and -2: until the end of the context),
``repeat_penalty`` is ``repetition_penalty``; what this server cannot do is refused by
name (``options.mirostat``), and the options that only place or pace the work
(``num_thread``, ``num_gpu`` ...) are accepted. An option left out takes Ollama's
default (temperature 0.8, top_k 40, top_p 0.9), so a client sees the sampling it would
see against Ollama. ``num_ctx`` bounds the request: a prompt past it is a 400 (Ollama
would cut it silently) and the answer's budget stops at it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from triollm import __version__
from triollm.output import RequestStream
from triollm.plan import FinishReason
from triollm.request import ChatMessage, GenerationRequest, GrammarKind, GrammarSpec, ServedModel
from triollm.server import answers
from triollm.server.apifields import Body, Field, FieldTable, Reader, refuse, text
from triollm.server.apifields import Support as S
from triollm.server.embeddings import EmbeddingRequest
from triollm.server.openai import ApiError, bad_request
from triollm.spec import GenerationSpec
from triollm.toolcalls import ParsedDelta, ToolCall, Tools, merge

__all__ = [
    "CHAT_FIELDS",
    "EMBED_FIELDS",
    "GENERATE_FIELDS",
    "NDJSON",
    "OPTIONS",
    "ModelFacts",
    "OllamaWriter",
    "embed_answer",
    "error_body",
    "model_entry",
    "parse_chat",
    "parse_embed",
    "parse_generate",
    "served_name",
    "show",
]

NDJSON = "application/x-ndjson"

# Ollama's defaults for an option left out (its docs, "Modelfile" PARAMETER table).
OLLAMA_TEMPERATURE = 0.8
OLLAMA_TOP_K = 40
OLLAMA_TOP_P = 0.9

_COMMON = [
    Field("model", S.HONOURED, "the served model, with or without ':latest'; another is a 404"),
    Field("format", S.HONOURED, "'json' or a JSON Schema: the answer is constrained to it"),
    Field("options", S.HONOURED, "sampling (the options table)"),
    Field("stream", S.HONOURED, "NDJSON lines; true unless false"),
    Field("keep_alive", S.ACCEPTED, "the model stays loaded for the server's life"),
    Field("think", S.REFUSED, "no separate thinking channel", (False,)),
    Field("logprobs", S.REFUSED, "log-probabilities are not returned here", (False,)),
    Field("top_logprobs", S.REFUSED, "log-probabilities are not returned here", (0,)),
]
CHAT_FIELDS = FieldTable(
    "ollama chat",
    [
        *_COMMON,
        Field(
            "messages",
            S.HONOURED,
            "system, user, assistant (a final one is continued), tool; tool_calls",
        ),
        Field("tools", S.HONOURED, "function tools, parsed back as message.tool_calls"),
    ],
)
GENERATE_FIELDS = FieldTable(
    "ollama generate",
    [
        *_COMMON,
        Field("prompt", S.HONOURED, "the user turn through the chat template (raw: as it is)"),
        Field("system", S.HONOURED, "the system turn"),
        Field("raw", S.HONOURED, "true: the prompt is sent as it is, no template"),
        Field("suffix", S.REFUSED, "no fill-in-the-middle"),
        Field("template", S.REFUSED, "the model's own chat template is used"),
        Field("context", S.REFUSED, "deprecated token context: send the text", ([],)),
        Field("images", S.REFUSED, "text models only", ([],)),
        Field("width", S.REFUSED, "no image generation"),
        Field("height", S.REFUSED, "no image generation"),
        Field("steps", S.REFUSED, "no image generation"),
    ],
)
OPTIONS = FieldTable(
    "ollama options",
    [
        Field("num_predict", S.HONOURED, "max_tokens; -1 or -2: until the end of the context"),
        Field("temperature", S.HONOURED, "default 0.8 (Ollama's)"),
        Field("top_k", S.HONOURED, "default 40 (Ollama's)"),
        Field("top_p", S.HONOURED, "default 0.9 (Ollama's)"),
        Field("min_p", S.HONOURED, "as chat's"),
        Field("seed", S.HONOURED, "as chat's"),
        Field("stop", S.HONOURED, "stop strings"),
        Field("repeat_penalty", S.HONOURED, "repetition_penalty, over the prompt and answer"),
        Field("presence_penalty", S.HONOURED, "as chat's"),
        Field("frequency_penalty", S.HONOURED, "as chat's"),
        Field("num_ctx", S.HONOURED, "a bound: a prompt past it is a 400, never cut"),
        Field("num_keep", S.ACCEPTED, "only read when a context is cut, which never happens"),
        Field("num_batch", S.ACCEPTED, "the step budget is the server's (--chunk)"),
        Field("num_gpu", S.ACCEPTED, "CPU only"),
        Field("main_gpu", S.ACCEPTED, "CPU only"),
        Field("low_vram", S.ACCEPTED, "CPU only"),
        Field("num_thread", S.ACCEPTED, "the kernels' threads are the server's"),
        Field("numa", S.ACCEPTED, "placement only"),
        Field("use_mmap", S.ACCEPTED, "loading only"),
        Field("use_mlock", S.ACCEPTED, "loading only"),
        Field("vocab_only", S.ACCEPTED, "loading only"),
        Field("f16_kv", S.ACCEPTED, "the cache's type is --kv-cache-dtype"),
        Field("logits_all", S.ACCEPTED, "no logits are returned either way"),
        Field("embedding_only", S.ACCEPTED, "loading only"),
        Field("mirostat_tau", S.ACCEPTED, "read only with mirostat, which is refused"),
        Field("mirostat_eta", S.ACCEPTED, "read only with mirostat, which is refused"),
        Field("mirostat", S.REFUSED, "no mirostat sampling", (0,)),
        Field("typical_p", S.REFUSED, "no locally typical sampling", (1.0, 1)),
        Field("tfs_z", S.REFUSED, "no tail-free sampling", (1.0, 1)),
        Field(
            "repeat_last_n",
            S.REFUSED,
            "the penalty covers the whole prompt and answer (-1), no shorter window",
            (-1,),
        ),
        Field("penalize_newline", S.REFUSED, "newlines are penalised like any token", (True,)),
    ],
)

EMBED_FIELDS = FieldTable(
    "ollama embed",
    [
        Field("model", S.HONOURED, "the served model, with or without ':latest'; another is a 404"),
        Field("input", S.HONOURED, "a string or a list of strings"),
        Field("dimensions", S.HONOURED, "a prefix of the vector, normalized again"),
        Field("truncate", S.ACCEPTED, "an input past the context is a 400, never cut"),
        Field("options", S.ACCEPTED, "sampling options do not touch an embedding"),
        Field("keep_alive", S.ACCEPTED, "the model stays loaded for the server's life"),
    ],
)


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model listings say beyond the id: the family (``model_type``) and
    the bytes the weights hold in memory (``size``)."""

    family: str = ""
    size_bytes: int = 0


def error_body(err: ApiError) -> dict[str, Any]:
    """Ollama's error shape: one message (it names the field)."""
    return {"error": err.message}


def served_name(model: ServedModel) -> str:
    """The model's Ollama name: ``<id>:latest`` unless the id carries a tag."""
    return model.id if ":" in model.id else model.id + ":latest"


def _model_id(name: str | None, model: ServedModel) -> str | None:
    """A requested name as the served id: ``<id>:latest`` is ``<id>``."""
    if name is None or name == served_name(model):
        return None if name is None else model.id
    return name


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def model_entry(model: ServedModel, facts: ModelFacts) -> dict[str, Any]:
    """The model as /api/tags and /api/ps list it. No digest: Ollama's is the hash of
    its own blob, which this server does not have."""
    return {
        "name": served_name(model),
        "model": served_name(model),
        "modified_at": datetime.fromtimestamp(model.created, UTC).isoformat(),
        "size": facts.size_bytes,
        "digest": "",
        "details": {
            "parent_model": "",
            "format": "triollm",
            "family": facts.family,
            "families": [facts.family] if facts.family else [],
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def show(model: ServedModel, facts: ModelFacts) -> dict[str, Any]:
    """``/api/show``: the template, the context length and what the model can do."""
    template = model.tokenizer.chat_templates.get("default", "")
    capabilities = ["completion"] + (["tools"] if model.tool_format is not None else [])
    family = facts.family or "general"
    return {
        "license": "",
        "modelfile": "",
        "parameters": "",
        "template": template,
        "details": model_entry(model, facts)["details"],
        "model_info": {
            "general.architecture": family,
            f"{family}.context_length": model.context_tokens,
        },
        "capabilities": capabilities,
        "modified_at": datetime.fromtimestamp(model.created, UTC).isoformat(),
    }


def version() -> dict[str, str]:
    return {"version": __version__}


# --------------------------------------------------------------------------- requests


def _format(body: dict[str, Any]) -> GrammarSpec | None:
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return GrammarSpec(GrammarKind.JSON_OBJECT, None, "format")
    if isinstance(value, dict):
        return GrammarSpec(GrammarKind.JSON_SCHEMA, value, "format")
    raise bad_request(f"'format' must be \"json\" or a JSON Schema object; got {value!r}", "format")


def _sampling(body: dict[str, Any]) -> tuple[dict[str, Any], int | None, tuple[str, ...]]:
    """``options`` as GenerationRequest fields, ``num_ctx``, and the unknown options."""
    options = Reader(body).obj("options") or {}
    unknown = OPTIONS.screen(options, "options.")
    o = Reader(options, "options.")
    predict = o.integer("num_predict", -2)
    top_k = o.integer("top_k", 0)
    fields = {
        "max_tokens": None if predict is None or predict < 0 else max(predict, 1),
        "temperature": o.number("temperature", OLLAMA_TEMPERATURE),
        "top_k": OLLAMA_TOP_K if top_k is None else top_k,
        "top_p": o.number("top_p", OLLAMA_TOP_P),
        "min_p": o.number("min_p", 0.0),
        "seed": o.integer("seed"),
        "stop": o.stops("stop"),
        "repetition_penalty": o.number("repeat_penalty", 1.0),
        "presence_penalty": o.number("presence_penalty", 0.0),
        "frequency_penalty": o.number("frequency_penalty", 0.0),
    }
    if predict == 0:  # Ollama: nothing generated; here the smallest answer is one token
        raise bad_request("'options.num_predict' must be at least 1, or -1", "options.num_predict")
    return fields, o.integer("num_ctx", 1), unknown


def _num_ctx(limit: int | None) -> Callable[[GenerationSpec], GenerationSpec] | None:
    """``num_ctx`` as a bound on the prepared spec: refuse a prompt past it (Ollama
    would cut the prompt's start silently), stop the answer at it."""
    if limit is None:
        return None

    def adjust(spec: GenerationSpec) -> GenerationSpec:
        room = limit - len(spec.prompt_ids)
        if room < 1:
            raise bad_request(
                f"the prompt is {len(spec.prompt_ids)} tokens, leaving no room for an answer "
                f"in 'options.num_ctx' ({limit}); this server never cuts a prompt",
                "options.num_ctx",
            )
        if spec.max_tokens is None or spec.max_tokens > room:
            return dataclasses.replace(spec, max_tokens=room)
        return spec

    return adjust


def _messages(body: dict[str, Any]) -> tuple[tuple[ChatMessage, ...], bool]:
    """The turns, and whether the last is an assistant message to continue: Ollama
    continues a final assistant message (prefill) rather than answering after it."""
    raw = Reader(body).items("messages")
    if not raw:
        raise bad_request("'messages' is required: a non-empty list of messages", "messages")
    out = []
    calls_seen: list[str] = []  # ids of the last assistant turn's calls, for its results
    results = 0
    for i, m in enumerate(raw):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"'{param}' must be an object", param)
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(
                f"'{param}.role' must be system, user, assistant or tool; got {role!r}",
                f"{param}.role",
            )
        if m.get("images"):
            raise refuse(f"{param}.images", "text models only")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad_request(f"'{param}.content' must be a string", f"{param}.content")
        fields: dict[str, Any] = {}
        if role == "assistant" and m.get("tool_calls"):
            calls: list[dict[str, Any]] = []
            ids: list[str] = []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    where = f"{param}.tool_calls[{j}]"
                    raise bad_request(f"'{where}' must be a function call with a 'name'", where)
                # Ollama's calls carry no id (newer ones may): the template needs one to
                # pair each result with its call, so the k-th result answers the k-th call.
                call_id = str(call.get("id") or f"call_{i}_{j}")
                ids.append(call_id)
                arguments = fn.get("arguments", {})
                calls.append(
                    {"id": call_id, "function": {"name": fn["name"], "arguments": arguments}}
                )
            fields["tool_calls"] = calls
            calls_seen, results = ids, 0
        elif role == "tool":
            given = m.get("tool_call_id")
            if isinstance(given, str) and given:
                call_id = given
            else:
                call_id = calls_seen[results] if results < len(calls_seen) else f"call_result_{i}"
            results += 1
            fields["tool_call_id"] = call_id
            name = m.get("tool_name")
            if isinstance(name, str):
                fields["name"] = name
        out.append(answers.chat_message(role, content, param, fields))
    last = raw[-1]
    prefill = last.get("role") == "assistant" and not last.get("tool_calls")
    return tuple(out), prefill


def _tools(body: dict[str, Any]) -> Tools | None:
    raw = Reader(body).items("tools")
    if not raw:
        return None
    return answers.function_tools(raw, "auto", True)  # Ollama has no tool_choice: the model decides


def _check_think(body: dict[str, Any]) -> None:
    think = body.get("think")
    if think not in (None, False):
        raise refuse("think", "no separate thinking channel")


def parse_chat(raw: bytes, model: ServedModel) -> answers.Translation:
    """``POST /api/chat``. ``model``: to read ``<id>:latest`` as the served id."""
    r = Body(raw, CHAT_FIELDS)
    body = r.body
    _check_think(body)
    sampling, num_ctx, odd = _sampling(body)
    tools = _tools(body)
    grammar = _format(body)
    req = answers.chat_request(
        _messages(body),
        tools,
        grammar,
        "tools",
        model=_model_id(r.string("model"), model),
        stream=r.boolean("stream", True),
        **sampling,
    )
    name = r.string("model") or served_name(model)

    def writer(served: ServedModel, stream: RequestStream) -> OllamaWriter:
        return OllamaWriter(name, stream, chat=True)

    return answers.Translation("ollama", req, writer, r.unknown + odd, _num_ctx(num_ctx))


def parse_generate(raw: bytes, model: ServedModel) -> answers.Translation:
    """``POST /api/generate``: ``prompt`` through the template, or raw."""
    r = Body(raw, GENERATE_FIELDS)
    body = r.body
    _check_think(body)
    sampling, num_ctx, odd = _sampling(body)
    prompt = r.string("prompt")
    if not prompt:
        raise bad_request("'prompt' is required: a non-empty string", "prompt")
    system = r.string("system")
    raw_mode = r.boolean("raw")
    common = {
        "model": _model_id(r.string("model"), model),
        "stream": r.boolean("stream", True),
        "grammar": _format(body),
        **sampling,
    }
    if raw_mode:
        if system:
            raise bad_request("'system' has no place in a raw prompt: put it in 'prompt'", "system")
        req = GenerationRequest(kind="completion", prompt_text=prompt, **common)
    else:
        turns = ([answers.chat_message("system", system, "system")] if system else []) + [
            answers.chat_message("user", prompt, "prompt")
        ]
        req = GenerationRequest(kind="chat", messages=tuple(turns), **common)
    name = r.string("model") or served_name(model)

    def writer(served: ServedModel, stream: RequestStream) -> OllamaWriter:
        return OllamaWriter(name, stream, chat=False)

    return answers.Translation("ollama", req, writer, r.unknown + odd, _num_ctx(num_ctx))


# --------------------------------------------------------------------------- the answer


def _tool_call(call: ToolCall, index: int) -> dict[str, Any]:
    given = answers.arguments_object(call.arguments)
    return {
        "id": call.id,
        "function": {"index": index, "name": call.name, "arguments": given or {}},
    }


class OllamaWriter:
    """Turns a one-choice RequestStream into Ollama's lines or one object."""

    media_type = NDJSON

    def __init__(self, name: str, stream: RequestStream, *, chat: bool) -> None:
        self.name = name
        self.stream = stream
        self.chat = chat
        self.started = time.monotonic_ns()
        self.first_token: int | None = None

    def _line(self, text: str, done: bool, calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, "created_at": _now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_tool_call(c, i) for i, c in enumerate(calls)]
            out["message"] = message
        else:
            out["response"] = text
        out["done"] = done
        return out

    def _final(self, line: dict[str, Any], finish: answers.Finish) -> dict[str, Any]:
        end = time.monotonic_ns()
        first = self.first_token if self.first_token is not None else end
        reason = "length" if finish.reason is FinishReason.LENGTH else "stop"
        return {
            **line,
            "done_reason": reason,
            "total_duration": end - self.started,
            "load_duration": 0,
            "prompt_eval_count": finish.prompt_tokens,
            "prompt_eval_duration": first - self.started,
            "eval_count": finish.completion_tokens,
            "eval_duration": end - first,
        }

    async def whole(self) -> tuple[dict[str, Any], int]:
        try:
            answer: answers.Answer = await answers.collect(self.stream)
        except answers.StreamFailed as exc:
            return {"error": exc.message}, exc.status
        self.first_token = self.first_token or time.monotonic_ns()
        return self._final(self._line(answer.text, True, answer.calls), answer.finish), 200

    async def events(self) -> AsyncIterator[bytes]:
        calls: list[ParsedDelta] = []  # a call goes out whole, once it is complete
        try:
            async for item in answers.pieces(self.stream):
                piece = item if isinstance(item, answers.Piece) else item.last
                if self.first_token is None:
                    self.first_token = time.monotonic_ns()
                if piece.calls:
                    calls.append(ParsedDelta("", piece.calls))
                if piece.text:
                    yield _encode(self._line(piece.text, False))
                if isinstance(item, answers.Finish):
                    _, whole = merge(calls)
                    if whole:
                        yield _encode(self._line("", False, whole))
                    yield _encode(self._final(self._line("", True), item))
        except answers.StreamFailed as exc:
            yield _encode({"error": exc.message})


def _encode(obj: dict[str, Any]) -> bytes:
    # One line per object: json.dumps escapes every newline inside strings.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# --------------------------------------------------------------------------- embeddings


def parse_embed(raw: bytes, model: ServedModel, hidden_size: int) -> EmbeddingRequest:
    """``POST /api/embed``: ``input`` (a string or strings) as an embeddings request."""
    r = Body(raw, EMBED_FIELDS)
    value = r.body.get("input")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise bad_request("'input' is required: a string or a list of strings", "input")
    for i, item in enumerate(items):
        if not isinstance(item, str) or not item:
            raise bad_request(f"'input[{i}]' must be a non-empty string", f"input[{i}]")
        text(item, f"input[{i}]")
    return EmbeddingRequest(
        model=_model_id(r.string("model"), model),
        inputs=tuple(items),
        base64=False,
        dimensions=r.integer("dimensions", 1, hidden_size),
        unknown=r.unknown,
    )


def embed_answer(
    name: str, vectors: Sequence[Any], prompt_tokens: int, started_ns: int
) -> dict[str, Any]:
    """Ollama's answer to /api/embed: the vectors, in input order, and its counters."""
    return {
        "model": name,
        "embeddings": [v.tolist() for v in vectors],
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,
        "prompt_eval_count": prompt_tokens,
    }
