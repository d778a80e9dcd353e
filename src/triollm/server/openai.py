"""OpenAI's request and error shapes: parse a JSON body into a frozen request, or refuse it.

Everything about the request's *shape* is checked here, before the request touches
the tokenizer, the queue or the scheduler: bad JSON, a field of the wrong JSON type,
a feature we do not implement (``best_of`` other than ``n``, ``logit_bias`` ...),
limits of OpenAI's API itself (``stop``, ``logprobs``). Each refusal is an
:class:`ApiError` whose ``param`` names the field, so the ``openai`` client shows
the user which argument to fix. The sampling *ranges* are not checked here:
``SamplingParams`` owns them, and its :class:`~triollm.errors.FieldError` reaches the
client through :func:`field_error`, its ``.field`` becoming ``param``. The result
is a :class:`GenerationRequest`, frozen, holding only plain values: the handler
reads everything it needs from the Quart ``request`` *before* it starts the
response, because the request object is gone by the time the body is written.

Trap: JSON ``true`` is a Python ``bool``, which is an ``int``. Every integer field
checks for ``bool`` first, or ``"max_tokens": true`` would mean one token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from triollm.errors import FieldError

# The API-neutral request lives with prepare() (request.py); named here too, since
# this module is what builds it for the OpenAI API.
from triollm.request import ChatMessage as ChatMessage
from triollm.request import GenerationRequest as GenerationRequest
from triollm.server import structured

T = TypeVar("T")

# A bound on `stop`: unbounded, the per-token search cost would grow without limit.
# OpenAI caps it at 4, but code-completion clients send ~9 (vLLM and llama-server
# take any number): 16 sequences of at most 256 characters.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
# The legacy completions API allows at most 5 alternatives per token; chat allows 20.
MAX_COMPLETION_LOGPROBS = 5
# vLLM's stop_token_ids has no bound; each id is one set lookup per token, and while
# min_tokens holds them back, one masked logit: 256 is far past any real list.
MAX_STOP_TOKEN_IDS = 256
MAX_CHAT_TOP_LOGPROBS = 20
# OpenAI's own bound on `n`; the server's is its slots (the choices run at once), which
# the scheduler's door names (Scheduler.add_group). This one caps the work done for a
# request before that check (a text pipeline per choice).
MAX_CHOICES = 128
# chat_template_kwargs: a template reads a handful of switches (enable_thinking ...)
MAX_TEMPLATE_KWARGS = 32
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


# An error message quotes the offending value; a 3 MB value must not come back whole.
MAX_ERROR_MESSAGE_CHARS = 600
# JSON integers longer than this are refused while parsing (Python's own limit, 4,300
# digits, would surface as an internal error; no field here needs more than 20).
MAX_INTEGER_DIGITS = 100


def cut_message(message: str, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str:
    """``message`` at most ``limit`` characters: the rest is replaced by its length."""
    if len(message) <= limit:
        return message
    return message[: limit - 40] + f"... [cut: {len(message)} characters in all]"


class ApiError(Exception):
    """A refusal with an HTTP status and OpenAI's error body.

    ``param`` names the request field to fix (``None`` when no single field is to
    blame); ``code`` is a short machine-readable reason (``"queue_full"``). The
    message names the limit, so a refusal reads as arithmetic, not as a bug.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = cut_message(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def field_error(exc: FieldError, code: str | None = None) -> ApiError:
    """A field the model layer refused (a sampling range, a request that cannot fit):
    400, with the field it names as ``param``."""
    return ApiError(400, str(exc), param=exc.field, code=code)


# --------------------------------------------------------------------------- field readers


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A JSON number (its range is ``SamplingParams``'s to check)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
    return float(value)


def as_integer(value: Any) -> Any:
    """The one rule for integral floats: JSON has one number type, so ``4.0`` is the
    integer 4 wherever an integer is expected (as pydantic, hence vLLM, reads it);
    ``4.5`` stays a float and is refused by the caller."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _kind(value: Any) -> str:
    """How an error names a wrong value: its type, and a float's value (``2.5``)."""
    return f"{value!r}" if isinstance(value, float) else type(value).__name__


def _integer(
    body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    """A JSON integer; ``lo``/``hi`` only for limits of the API itself."""
    value = as_integer(body.get(name))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {_kind(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        limit = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise bad_request(f"'{name}' must be {limit}, got {value}", name)
    return value


def _boolean(
    body: dict[str, Any], name: str, default: bool = False, *, param: str | None = None
) -> bool:
    """``param``: the field's full name when ``body`` is a nested object."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        full = param or name
        raise bad_request(f"'{full}' must be true or false, got {type(value).__name__}", full)
    return value


def _text(value: str, param: str) -> str:
    """Refuse a string that is not valid Unicode text: JSON's ``"\\ud800"`` escape
    decodes to a lone surrogate, which Python keeps in a ``str`` but which cannot
    be encoded (tokenizer, logs, the 404 message echoing 'model'): a 500 later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(
            f"'{param}' is not valid Unicode text: a lone surrogate at character {exc.start}",
            param,
        ) from None
    return value


def _string(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {type(value).__name__}", name)
    return _text(value, name)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(items)}", "stop"
        )
    for s in items:
        _text(s, "stop")
        if not s:
            raise bad_request("'stop' sequences must not be empty", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise bad_request(
                f"'stop' sequences may be at most {MAX_STOP_CHARS} characters, got {len(s)}",
                "stop",
            )
    return tuple(items)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``: token ids (their range is the app's to check, against
    the model's vocabulary)."""
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    items = [as_integer(t) for t in value] if isinstance(value, list) else None
    if items is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        raise bad_request("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    if any(t < 0 for t in items):
        raise bad_request("'stop_token_ids' must be non-negative integers", "stop_token_ids")
    if len(items) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(items)}",
            "stop_token_ids",
        )
    return tuple(items)


# vLLM's fields that change the output and are not implemented here.
VLLM_OUTPUT_FIELDS = {
    "bad_words": "no token sequence can be banned from the answer",
    "allowed_token_ids": "the vocabulary cannot be narrowed to a list (a grammar can)",
}


def _refuse_unsupported(body: dict[str, Any], kind: str) -> None:
    """Fields we do not implement are refused by name, never silently ignored:
    a client that asked for two choices and got one would miscount."""
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    best_of = as_integer(body.get("best_of"))
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        # best_of samples more answers than it returns and keeps the likeliest; this
        # server returns every answer it samples. Equal to n, it asks for nothing else.
        raise bad_request(
            f"'best_of' must equal 'n' ({n}): this server returns every choice it samples "
            f"and ranks none, got {best_of!r}",
            "best_of",
        )
    if kind == "chat" and body.get("echo"):
        raise bad_request("'echo' is a /v1/completions field", "echo")
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    if body.get("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    # vLLM's fields that change the output: refused by name until implemented, so a
    # client that relies on one learns it at once instead of getting other text.
    for name, why in VLLM_OUTPUT_FIELDS.items():
        if body.get(name):
            raise bad_request(
                f"'{name}' is not supported by this server (vLLM's extension): {why}", name
            )
    if kind == "completion" and body.get("tools") is not None:
        raise bad_request("'tools' is a chat field: use /v1/chat/completions", "tools")
    if kind == "completion" and body.get("chat_template_kwargs") is not None:
        raise bad_request(
            "'chat_template_kwargs' is a chat field: use /v1/chat/completions",
            "chat_template_kwargs",
        )


def _common(body: dict[str, Any], kind: Literal["completion", "chat"]) -> dict[str, Any]:
    _refuse_unsupported(body, kind)
    # OpenAI requires 'model'; a one-model server can do without it, as vLLM and
    # llama.cpp do, so `curl -d '{"prompt": "..."}'` just works. Absent means "the
    # served model"; present but wrong is still a 404 (app.py).
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty string (or left out)", "model")
    if model is not None:
        _text(model, "model")
    max_tokens = _integer(body, "max_tokens", 0)
    max_completion = _integer(body, "max_completion_tokens", 0)
    echo = kind == "completion" and body.get("echo") is True
    for name, value in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion)):
        if value == 0 and not echo:
            raise bad_request(
                f"'{name}' must be at least 1, got 0 (0 is only for 'echo': the prompt "
                "alone, with its log-probabilities)",
                name,
            )
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_request(
            f"'max_tokens' ({max_tokens}) and 'max_completion_tokens' ({max_completion}) differ;"
            " give one",
            "max_completion_tokens",
        )
    stream = _boolean(body, "stream")
    include_usage = False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = _boolean(options, "include_usage", param="stream_options.include_usage")
    top_k = _integer(body, "top_k")
    seed = _integer(body, "seed")
    user = _string(body, "user")
    # vLLM's field: requests share cached prompt blocks only within one salt, so a
    # tenant cannot learn another's prompts from how fast its own are answered.
    cache_salt = _string(body, "cache_salt")
    if cache_salt is not None and not cache_salt:
        raise bad_request("'cache_salt' must be a non-empty string (or left out)", "cache_salt")
    max_tokens = max_completion if max_completion is not None else max_tokens
    min_tokens = _integer(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not be more than 'max_tokens' ({max_tokens})",
            "min_tokens",
        )
    return {
        "kind": kind,
        "model": model,
        "n": _integer(body, "n") or 1,  # its range: _refuse_unsupported
        "max_tokens": max_tokens,
        "min_tokens": min_tokens,
        "stop_token_ids": _stop_token_ids(body),
        "include_stop_str_in_output": _boolean(body, "include_stop_str_in_output"),
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": 0 if top_k is None or top_k == -1 else top_k,  # -1 is vLLM's "off"
        "min_p": _number(body, "min_p", 0.0),
        "seed": seed,  # any integer: the sampler folds it into its seed space
        "stop": _stop(body),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "stream": stream,
        "include_usage": include_usage,
        "user": user,
        "ignore_eos": _boolean(body, "ignore_eos"),
        "grammar": _structured(structured.grammar_spec, body),
        "cache_salt": cache_salt or "",
        # vLLM's field; its range and whether the policy reads it are the scheduler's
        # and the service's to check (one owner each), the type is ours.
        "priority": _integer(body, "priority") or 0,
    }


def _structured(read: Callable[..., T], *args: Any) -> T:
    """A reader of ``server/structured.py``, its FieldError turned into the 400."""
    try:
        return read(*args)
    except FieldError as exc:
        raise field_error(exc) from None


class _TooManyDigits(Exception):
    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise _TooManyDigits(len(text.lstrip("-")))
    return int(text)


def load_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or the 400 saying why not (``invalid_json``)."""
    return _load_object(raw)


def _load_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", None, "invalid_json") from None
    except _TooManyDigits as exc:
        raise bad_request(
            f"the body holds an integer of {exc.digits} digits; at most {MAX_INTEGER_DIGITS} "
            "are accepted",
            None,
            "invalid_json",
        ) from None
    except RecursionError:
        # json.loads recurses per nesting level: '[[[[...' a few thousand deep
        # exhausts the interpreter's stack.
        raise bad_request("the body is nested too deeply", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object", None, "invalid_json")
    return body


def parse_completion(raw: bytes) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids.

    A list holding one string or one list of ids is accepted (the ``openai``
    client sends that shape); several prompts are refused by name.
    """
    body = _load_object(raw)
    fields = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and any(isinstance(t, float) for t in prompt):
        # Token ids by the integral-float rule: [1, 2.0] is [1, 2]; 2.5 is named.
        prompt = [as_integer(t) for t in prompt]
        for i, t in enumerate(prompt):
            if isinstance(t, float):
                raise bad_request(
                    f"'prompt' token ids must be integers; prompt[{i}] is {t!r}", "prompt"
                )
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        prompt_text = _text(prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if any(isinstance(t, bool) or t < 0 for t in prompt):
            raise bad_request("'prompt' token ids must be non-negative integers", "prompt")
        prompt_ids = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request(
            f"'prompt' must be one prompt (a string or a list of token ids); got {len(prompt)}",
            "prompt",
        )
    elif prompt is None:
        raise bad_request("'prompt' is required: a string or a list of token ids", "prompt")
    elif isinstance(prompt, list) and not prompt:
        raise bad_request("'prompt' must not be empty", "prompt")
    elif isinstance(prompt, list):
        kinds = sorted({type(t).__name__ for t in prompt if not isinstance(t, int)})
        raise bad_request(
            f"'prompt' as a list must hold token ids (integers); it holds {', '.join(kinds)}",
            "prompt",
        )
    else:
        raise bad_request(
            "'prompt' must be a string or a list of token ids, got " + type(prompt).__name__,
            "prompt",
        )
    logprobs = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = _boolean(body, "echo")
    return GenerationRequest(
        prompt_text=prompt_text, prompt_ids=prompt_ids, logprobs=logprobs, echo=echo, **fields
    )


def _message(index: int, item: Any) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"'{param}' must be an object", param)
    role = item.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise bad_request(
            f"'{param}.role' must be system, developer, user, assistant or tool; got {role!r}",
            f"{param}.role",
        )
    content = item.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad_request(
                    f"'{param}.content[{j}]' must be a text part (images are not supported)",
                    f"{param}.content",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(
                    f"'{param}.content[{j}].text' must be a string", f"{param}.content"
                )
            parts.append(text)
        content = "\n".join(parts)  # as vLLM joins text parts
    if not isinstance(content, str):
        raise bad_request(f"'{param}.content' must be a string or text parts", f"{param}.content")
    extra = _structured(structured.message_tool_fields, param, role, item)
    return ChatMessage(
        role=role, content=_text(content, f"{param}.content"), tools=tuple(extra.items())
    )


def parse_chat(raw: bytes) -> GenerationRequest:
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template.

    ``logprobs`` is a boolean here and ``top_logprobs`` the number of alternatives.
    """
    body = _load_object(raw)
    fields = _common(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: a non-empty list of messages", "messages")
    parsed = tuple(_message(i, m) for i, m in enumerate(messages))
    want = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    tools = _structured(structured.tools, body)
    if tools is not None and tools.forced() and fields["grammar"] is not None:
        raise bad_request(
            f"'tool_choice' {tools.choice.value} forces a tool call, which cannot also follow "
            f"'{fields['grammar'].field.split('.')[0]}'; give one",
            "tool_choice",
        )
    return GenerationRequest(
        messages=parsed,
        logprobs=(top or 0) if want else None,
        tools=tools,
        template_kwargs=_template_kwargs(body),
        **fields,
    )


def _template_kwargs(body: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """``chat_template_kwargs``: an object of template variables (Qwen3's
    ``enable_thinking``), each name a template identifier; values any JSON."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request(
            "'chat_template_kwargs' must be an object of template variables",
            "chat_template_kwargs",
        )
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise bad_request(
            f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} variables, "
            f"got {len(value)}",
            "chat_template_kwargs",
        )
    for name in value:
        if not _IDENTIFIER.fullmatch(name):
            raise bad_request(
                f"'chat_template_kwargs' names must be template identifiers (a letter, then "
                f"letters, digits or _), got {name[:60]!r}",
                "chat_template_kwargs",
            )
    return tuple(value.items())
