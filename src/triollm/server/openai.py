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

import enum
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from triollm.errors import FieldError

# The API-neutral request lives with prepare() (request.py); named here too, since
# this module is what builds it for the OpenAI API.
from triollm.request import ChatMessage as ChatMessage
from triollm.request import GenerationRequest as GenerationRequest
from triollm.server import structured

T = TypeVar("T")

log = logging.getLogger("triollm.server")

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
# A list of prompts in /v1/completions: each is a group of n sequences admitted with the
# others, so the slots bound it too (Scheduler.check_prompts); this caps the parsing.
MAX_PROMPTS = 128
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


def value_kind(value: Any) -> str:
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
        raise bad_request(f"'{name}' must be an integer, got {value_kind(value)}", name)
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


def valid_text(value: str, param: str) -> str:
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
    return valid_text(value, name)


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
        valid_text(s, "stop")
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


# --------------------------------------------------------------------------- every field
#
# The one list of the request fields this server knows, for both endpoints: what it
# does with each. docs/serving.md's tables for the two are field_table()'s output, and
# tests/server/test_fields.py sends every row (a refused one is refused by name, an
# honoured one parses) and keeps the page equal to the code.


class Support(enum.Enum):
    """What the server does with a request field."""

    HONOURED = "honoured"  # read, and the answer follows it
    ACCEPTED = "accepted"  # read; by its own definition it does not change the answer
    REFUSED = "refused"  # a 400 naming it, unless it holds a value that asks for nothing


CHAT, COMPLETION = "chat", "completion"
_BOTH = frozenset({CHAT, COMPLETION})
_CHAT_ONLY, _COMPLETION_ONLY = frozenset({CHAT}), frozenset({COMPLETION})
_ENDPOINT = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}


@dataclass(frozen=True, slots=True)
class FieldRule:
    """One request field: whose it is (``origin``), what happens to it, and where.

    ``apis``: the endpoints where it means something; sent to the other one with a
    value that asks for something, it is refused as that endpoint's field.
    ``neutral``: values that ask for nothing (``null`` always is): a REFUSED field
    holding one is accepted, so a client that sends every default (``typical_p: 1.0``)
    is not refused for it.
    """

    support: Support
    origin: str
    note: str
    apis: frozenset[str] = _BOTH
    neutral: tuple[Any, ...] = ()

    def asks(self, value: Any) -> bool:
        """Does ``value`` ask for anything?"""
        return value is not None and not any(value == n for n in self.neutral)


def _rows(support: Support, origin: str, note: str, names: str, **kw: Any) -> dict[str, FieldRule]:
    return {name: FieldRule(support, origin, note, **kw) for name in names.split()}


_H, _A, _R = Support.HONOURED, Support.ACCEPTED, Support.REFUSED
_NO_EFFECT = "no effect unless {} is set, which is refused"

FIELDS: dict[str, FieldRule] = {
    # OpenAI's
    **_rows(_H, "OpenAI", "optional (one model); another model's name is a 404", "model"),
    **_rows(_H, "OpenAI", "rendered by the model's chat template", "messages", apis=_CHAT_ONLY),
    **_rows(
        _H,
        "OpenAI",
        "a string or token ids, or a list of them (up to 128; choice i*n+j: prompt i)",
        "prompt",
        apis=_COMPLETION_ONLY,
    ),
    **_rows(
        _H,
        "OpenAI",
        "the answer's budget; unset: the rest of the context (chat), 16 (completions)",
        "max_tokens max_completion_tokens",
    ),
    **_rows(_H, "OpenAI", "choices sampled at once (choice i: seed + i), up to the slots", "n"),
    **_rows(_H, "OpenAI", "sampling", "temperature top_p seed presence_penalty frequency_penalty"),
    **_rows(_H, "OpenAI", "up to 16 strings of up to 256 characters", "stop"),
    **_rows(
        _H, "OpenAI", "server-sent events; include_usage adds the usage", "stream stream_options"
    ),
    **_rows(_H, "OpenAI", "chat: true/false; completions: 0-5 alternatives per token", "logprobs"),
    **_rows(_H, "OpenAI", "0-20 alternatives per token", "top_logprobs", apis=_CHAT_ONLY),
    **_rows(
        _H,
        "OpenAI",
        "the prompt (with logprobs: scored) before the answer",
        "echo",
        apis=_COMPLETION_ONLY,
        neutral=(False,),
    ),
    **_rows(_H, "OpenAI", "only equal to n: every choice sampled is returned", "best_of"),
    **_rows(_H, "OpenAI", "json_object, json_schema: decoding follows it", "response_format"),
    **_rows(
        _H,
        "OpenAI",
        "rendered by the template, calls parsed back; required or named: forced",
        "tools tool_choice parallel_tool_calls",
        apis=_CHAT_ONLY,
    ),
    **_rows(
        _A,
        "OpenAI",
        "the operator's records; no effect on the answer",
        "user store metadata service_tier prompt_cache_key safety_identifier",
    ),
    **_rows(
        _A,
        "OpenAI",
        "a latency hint: by OpenAI's definition the answer is the same",
        "prediction",
        apis=_CHAT_ONLY,
    ),
    **_rows(_R, "OpenAI", "no per-token bias is applied", "logit_bias", neutral=({},)),
    **_rows(_R, "OpenAI", "no fill-in-the-middle", "suffix", apis=_COMPLETION_ONLY),
    **_rows(_R, "OpenAI", "deprecated: send 'tools'", "functions function_call", apis=_CHAT_ONLY),
    **_rows(
        _R,
        "OpenAI",
        "no reasoning budget or length control to set",
        "reasoning_effort verbosity",
        apis=_CHAT_ONLY,
    ),
    **_rows(_R, "OpenAI", "text only", "modalities", apis=_CHAT_ONLY, neutral=(["text"],)),
    **_rows(_R, "OpenAI", "text only, no web search", "audio web_search_options", apis=_CHAT_ONLY),
    # vLLM's
    **_rows(_H, "vLLM", "sampling", "top_k min_p repetition_penalty"),
    **_rows(
        _H,
        "vLLM",
        "stop options",
        "min_tokens stop_token_ids include_stop_str_in_output ignore_eos",
    ),
    **_rows(_H, "vLLM", "the prefix cache's domain: only equal salts share blocks", "cache_salt"),
    **_rows(_H, "vLLM", "smaller is served earlier, under a policy that reads it", "priority"),
    **_rows(
        _H,
        "vLLM",
        "more chat template variables (enable_thinking ...)",
        "chat_template_kwargs",
        apis=_CHAT_ONLY,
    ),
    **_rows(
        _H,
        "vLLM",
        "structured output (constrained-decoding.md)",
        "guided_json guided_regex guided_choice guided_grammar structured_outputs",
    ),
    **_rows(
        _H,
        "vLLM",
        "assistant prefill: the answer continues the final assistant message",
        "continue_final_message",
        apis=_CHAT_ONLY,
        neutral=(False,),
    ),
    **_rows(
        _H,
        "vLLM",
        "false: no assistant header after the last message",
        "add_generation_prompt",
        apis=_CHAT_ONLY,
        neutral=(True,),
    ),
    **_rows(
        _H,
        "vLLM",
        "keep only the prompt's last k tokens (-1: as many as the context holds)",
        "truncate_prompt_tokens",
    ),
    **_rows(
        _H,
        "vLLM",
        "false: special tokens (chat markers) stay in the answer's text",
        "skip_special_tokens",
    ),
    **_rows(
        _R,
        "vLLM",
        "no token list is banned or allowed (a grammar can)",
        "bad_words allowed_token_ids",
        neutral=([],),
    ),
    **_rows(
        _R, "vLLM", "the served model's own template is used", "chat_template", apis=_CHAT_ONLY
    ),
    **_rows(
        _R, "vLLM", "no documents reach the template", "documents", apis=_CHAT_ONLY, neutral=([],)
    ),
    **_rows(
        _H,
        "vLLM",
        "0-20: each prompt token's logprob and rank, and the k likeliest there (not streamed)",
        "prompt_logprobs",
    ),
    **_rows(_R, "vLLM", "no beam search", "use_beam_search", neutral=(False,)),
    **_rows(_R, "vLLM", "no beam search", "length_penalty", neutral=(1,)),
    **_rows(_R, "vLLM", "tokens are sent as text", "return_tokens_as_token_ids", neutral=(False,)),
    **_rows(_R, "vLLM", "JSON has one compact spelling", "guided_whitespace_pattern"),
    # llama.cpp's
    **_rows(_H, "llama.cpp", "max_tokens' spelling; -1: until the end", "n_predict"),
    **_rows(_H, "llama.cpp", "repetition_penalty's spelling", "repeat_penalty"),
    **_rows(_H, "llama.cpp", "a GBNF (or Lark) grammar, as guided_grammar", "grammar"),
    **_rows(_H, "llama.cpp", "a JSON Schema, as guided_json", "json_schema"),
    **_rows(_R, "llama.cpp", "no locally typical sampling", "typical_p", neutral=(1,)),
    **_rows(_R, "llama.cpp", "no Mirostat sampling", "mirostat", neutral=(0,)),
    **_rows(_A, "llama.cpp", _NO_EFFECT.format("mirostat"), "mirostat_tau mirostat_eta"),
    **_rows(_R, "llama.cpp", "no DRY penalty", "dry_multiplier", neutral=(0,)),
    **_rows(
        _A,
        "llama.cpp",
        _NO_EFFECT.format("dry_multiplier"),
        "dry_base dry_allowed_length dry_penalty_last_n dry_sequence_breakers",
    ),
    **_rows(_R, "llama.cpp", "no XTC sampling", "xtc_probability", neutral=(0,)),
    **_rows(_A, "llama.cpp", _NO_EFFECT.format("xtc_probability"), "xtc_threshold"),
    **_rows(_R, "llama.cpp", "no top-n-sigma sampling", "top_n_sigma", neutral=(-1,)),
    **_rows(_R, "llama.cpp", "send logprobs / top_logprobs", "n_probs", neutral=(0,)),
    **_rows(_A, "llama.cpp", "the prefix cache is always on: speed only", "cache_prompt"),
    # Ollama's, sent to the OpenAI endpoints
    **_rows(
        _R,
        "Ollama",
        "send this API's own fields (temperature, max_tokens, response_format ...)",
        "options format num_ctx",
    ),
}


ENDPOINT_HEADINGS = {CHAT: "`POST /v1/chat/completions`", COMPLETION: "`POST /v1/completions`"}


def field_table(api: str) -> str:
    """:data:`FIELDS` for one endpoint (``"chat"`` or ``"completion"``), as the
    Markdown table docs/serving.md prints under :data:`ENDPOINT_HEADINGS` (the other
    APIs' tables have the same columns). A field of the other endpoint is listed as
    refused here."""
    rows = ["| field | | here |", "| --- | --- | --- |"]
    for name, rule in FIELDS.items():
        if api in rule.apis:
            support, note = rule.support.value, f"{rule.note} ({rule.origin})"
        else:
            support, note = "refused", f"a {_ENDPOINT[next(iter(rule.apis))]} field"
        rows.append(f"| `{name}` | {support} | {note} |")
    return "\n".join(rows)


def _refuse_unsupported(body: dict[str, Any], kind: str) -> tuple[str, ...]:
    """Fields we do not implement are refused by name, never silently ignored:
    a client that asked for two choices and got one would miscount. Returns the
    fields nobody here knows (:data:`FIELDS` lists none of them), which are ignored,
    as vLLM ignores them, and logged once by the edge (``apifields.UnknownFields``)."""
    for name, value in body.items():
        rule = FIELDS.get(name)
        if rule is None or not rule.asks(value):
            continue
        if kind not in rule.apis:
            raise bad_request(
                f"'{name}' is a {_ENDPOINT[next(iter(rule.apis))]} field, not one of "
                f"{_ENDPOINT[kind]}",
                name,
            )
        if rule.support is Support.REFUSED:
            raise bad_request(
                f"'{name}' is not supported by this server ({rule.origin}'s field: {rule.note})",
                name,
            )
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
    return tuple(sorted(body.keys() - FIELDS.keys()))


def _common(body: dict[str, Any], kind: Literal["completion", "chat"]) -> dict[str, Any]:
    unknown = _refuse_unsupported(body, kind)
    # OpenAI requires 'model'; a one-model server can do without it, as vLLM and
    # llama.cpp do, so `curl -d '{"prompt": "..."}'` just works. Absent means "the
    # served model"; present but wrong is still a 404 (app.py).
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty string (or left out)", "model")
    if model is not None:
        valid_text(model, "model")
    # max_tokens' three spellings (OpenAI's two, llama.cpp's n_predict): one budget.
    sizes = {
        "max_tokens": _integer(body, "max_tokens", 0),
        "max_completion_tokens": _integer(body, "max_completion_tokens", 0),
        "n_predict": _integer(body, "n_predict", -1),
    }
    if sizes["n_predict"] == -1:  # llama.cpp's "until the end"
        sizes["n_predict"] = None
    echo = kind == "completion" and body.get("echo") is True
    for name, value in sizes.items():
        if value == 0 and not echo:
            raise bad_request(
                f"'{name}' must be at least 1, got 0 (0 is only for 'echo': the prompt "
                "alone, with its log-probabilities)",
                name,
            )
    given = [(name, value) for name, value in sizes.items() if value is not None]
    for name, value in given[1:]:
        if value != given[0][1]:
            raise bad_request(
                f"'{given[0][0]}' ({given[0][1]}) and '{name}' ({value}) differ; give one", name
            )
    max_tokens = given[0][1] if given else None
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
    min_tokens = _integer(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not be more than 'max_tokens' ({max_tokens})",
            "min_tokens",
        )
    repetition = _number(body, "repetition_penalty", 1.0)
    if body.get("repeat_penalty") is not None:  # llama.cpp's spelling
        repeat = _number(body, "repeat_penalty", 1.0)
        if body.get("repetition_penalty") is not None and repeat != repetition:
            raise bad_request(
                f"'repetition_penalty' ({repetition}) and 'repeat_penalty' ({repeat}) differ; "
                "give one",
                "repeat_penalty",
            )
        repetition = repeat
    prompt_logprobs = _integer(body, "prompt_logprobs", 0, MAX_CHAT_TOP_LOGPROBS)
    if prompt_logprobs is not None and stream:
        # vLLM's rule too: the prompt's scores come whole, in the answer's body.
        raise bad_request(
            "'prompt_logprobs' is not available when 'stream' is true; send stream false",
            "prompt_logprobs",
        )
    truncate = _integer(body, "truncate_prompt_tokens", -1)
    if truncate == 0:
        raise bad_request(
            "'truncate_prompt_tokens' must be at least 1 (or -1: as many as the context "
            "holds), got 0",
            "truncate_prompt_tokens",
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
        "repetition_penalty": repetition,
        "stream": stream,
        "include_usage": include_usage,
        "user": user,
        "ignore_eos": _boolean(body, "ignore_eos"),
        "grammar": _structured(structured.grammar_spec, body),
        "cache_salt": cache_salt or "",
        # vLLM's field; its range and whether the policy reads it are the scheduler's
        # and the service's to check (one owner each), the type is ours.
        "priority": _integer(body, "priority") or 0,
        "truncate_prompt_tokens": truncate,
        "skip_special_tokens": _boolean(body, "skip_special_tokens", default=True),
        "prompt_logprobs": prompt_logprobs,
        "unknown": unknown,
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
    """``POST /v1/completions`` of one prompt: ``prompt`` is a string or a list of token
    ids, or a list of one of them (the ``openai`` client sends that shape); several
    prompts are refused by name here."""
    reqs = parse_completions(raw)
    if len(reqs) > 1:
        raise bad_request(
            f"'prompt' must be one prompt (a string or a list of token ids) here; got {len(reqs)}",
            "prompt",
        )
    return reqs[0]


def parse_completions(raw: bytes) -> list[GenerationRequest]:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list
    of those (up to :data:`MAX_PROMPTS`; OpenAI's and vLLM's batch, which lm-eval
    sends): one request per prompt, every other field shared. Each prompt gets ``n``
    choices; the writer numbers prompt ``i``'s choice ``j`` as ``i * n + j``."""
    body = _load_object(raw)
    fields = _common(body, "completion")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required: a string or a list of token ids", "prompt")
    if is_prompt_list(prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad_request(
                f"'prompt' holds {len(prompt)} prompts, past the limit of {MAX_PROMPTS}",
                "prompt",
            )
        prompts = [_one_prompt(p, f"prompt[{i}]", element=True) for i, p in enumerate(prompt)]
    else:
        prompts = [_one_prompt(prompt, "prompt")]
    logprobs = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    echo = _boolean(body, "echo")
    return [
        GenerationRequest(prompt_text=text, prompt_ids=ids, logprobs=logprobs, echo=echo, **fields)
        for text, ids in prompts
    ]


def is_prompt_list(prompt: Any) -> bool:
    """Is ``prompt`` a list of prompts (strings or token-id lists), not one prompt? The
    one rule for the shape, which /tokenize's answer mirrors."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)


def _one_prompt(
    prompt: Any, param: str, element: bool = False
) -> tuple[str | None, tuple[int, ...] | None]:
    """One prompt: (its text, None) or (None, its token ids); ``param`` names it in
    the 400 (``prompt`` or ``prompt[i]``)."""
    if isinstance(prompt, list) and any(isinstance(t, float) for t in prompt):
        # Token ids by the integral-float rule: [1, 2.0] is [1, 2]; 2.5 is named.
        prompt = [as_integer(t) for t in prompt]
        for i, t in enumerate(prompt):
            if isinstance(t, float):
                raise bad_request(
                    f"'{param}' token ids must be integers; {param}[{i}] is {t!r}", param
                )
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"'{param}' must not be empty", param)
        return valid_text(prompt, param), None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if any(isinstance(t, bool) or t < 0 for t in prompt):
            raise bad_request(f"'{param}' token ids must be non-negative integers", param)
        return None, tuple(prompt)
    if isinstance(prompt, list) and not prompt:
        raise bad_request(f"'{param}' must not be empty", param)
    if isinstance(prompt, list):
        kinds = sorted({type(t).__name__ for t in prompt if not isinstance(t, int)})
        what = "a prompt's token ids" if element else "token ids, or prompts"
        raise bad_request(
            f"'{param}' as a list must hold {what} (integers); it holds {', '.join(kinds)}",
            param,
        )
    raise bad_request(
        f"'{param}' must be a string or a list of token ids, got " + type(prompt).__name__,
        param,
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
        role=role, content=valid_text(content, f"{param}.content"), tools=tuple(extra.items())
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
    prefill = _boolean(body, "continue_final_message")
    generation_prompt = _boolean(body, "add_generation_prompt", default=not prefill)
    if prefill and generation_prompt:
        raise bad_request(
            "'continue_final_message' continues the final assistant message and "
            "'add_generation_prompt' starts a new one; leave add_generation_prompt out "
            "(or false)",
            "continue_final_message",
        )
    if prefill and parsed[-1].role != "assistant":
        raise bad_request(
            "'continue_final_message' needs the conversation to end with an assistant "
            f"message (the text to continue); it ends with {parsed[-1].role!r}",
            "continue_final_message",
        )
    return GenerationRequest(
        messages=parsed,
        logprobs=(top or 0) if want else None,
        tools=tools,
        template_kwargs=_template_kwargs(body),
        add_generation_prompt=generation_prompt,
        continue_final_message=prefill,
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
