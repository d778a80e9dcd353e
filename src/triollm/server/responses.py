"""OpenAI's response shapes: a :class:`~triollm.service.RequestStream` in, SSE chunks or
one JSON object out.

:class:`ResponseWriter` is built before the response starts (it must not touch
quart's ``request``, which is gone inside the body generator) and turns the stream's
:class:`~triollm.events.Delta` values and its outcome into OpenAI's JSON: the
``text_completion`` / ``chat.completion.chunk`` events of a stream, or the whole
``text_completion`` / ``chat.completion`` body. Logprobs entries show each token's
text, or its bytes (``Tokenizer.token_bytes``) when the token is part of a character.
An outcome that is not a completion becomes an SSE error event, or a status from
:data:`STATUS_OF_END`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from quart import Response

from triollm.events import Completed, Delta, Failed
from triollm.outcomes import EndCode
from triollm.server import sse
from triollm.server.openai import ApiError, GenerationRequest
from triollm.service import RequestStream
from triollm.toolcalls import ParsedDelta, ToolCallDelta, ToolCallFormat, merge

# The status of a whole-body answer whose stream was cut: the server's fault (500),
# except a shutdown, which is the server's choice to stop and is worth a retry (503).
STATUS_OF_END = {
    EndCode.SHUTDOWN: 503,
    EndCode.INTERNAL: 500,
    EndCode.TOO_SLOW: 500,
    EndCode.CLIENT_CLOSED: 500,  # nobody reads it: the client has gone
    EndCode.GRAMMAR_FAILED: 500,  # the grammar engine gave up mid-answer (a parser limit)
}


@dataclass
class ServedModel:
    """What the edge needs to know about the model it serves."""

    id: str
    tokenizer: Any  # triollm.model.tokenizer.Tokenizer (encode, encode_chat, decode, token_bytes)
    context_tokens: int  # the largest request admitted (SchedulerConfig.largest_request)
    created: int
    make_params: Callable[..., Any]  # SamplingParams
    # The model's embedding rows (config.vocab_size). A tokenizer may know more ids
    # (added tokens past the checkpoint's vocabulary); such an id must be refused
    # here, or the forward pass it reaches fails for every request in the step.
    model_vocab_size: int | None = None
    # Structured output: the compiled grammars, over the vocabulary as the grammar
    # library sees it (model/constrained.GrammarCache), built once at startup.
    grammars: Any = None
    # How this model writes tool calls: --tool-call-parser, else read from its chat
    # template (toolcalls.detect_format); None: requests with tools are refused.
    tool_format: ToolCallFormat | None = None

    @property
    def vocab_limit(self) -> int:
        """Token ids must be below this: min(tokenizer vocabulary, model vocabulary)."""
        tok = int(self.tokenizer.vocab_size)
        return tok if self.model_vocab_size is None else min(tok, self.model_vocab_size)


def json_text(obj: Any) -> str:
    """A JSON body as text (non-ASCII kept as is)."""
    return json.dumps(obj, ensure_ascii=False)


def error_response(err: ApiError) -> Response:
    return Response(
        json_text(err.body()), status=err.status, mimetype="application/json", headers=err.headers
    )


class ResponseWriter:
    """Turns a RequestStream into OpenAI's JSON: SSE chunks or one whole object."""

    def __init__(
        self, req: GenerationRequest, model: ServedModel, stream: RequestStream, echo: str = ""
    ) -> None:
        """``echo``: the prompt's text, when the completion request asked for ``echo``:
        the answer's text starts with it (the first event of a stream carries it)."""
        self.req = req
        self.echo = echo
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
        tokenizer = self.model.tokenizer
        text = str(tokenizer.decode([token_id], skip_special_tokens=False))
        if "\ufffd" not in text:
            return text, text.encode()
        raw = tokenizer.token_bytes(token_id)
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
            if delta is not None and delta.tool_calls:
                d["tool_calls"] = [_call_delta(t) for t in delta.tool_calls]
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

    def _usage(self, outcome: Completed) -> dict[str, Any]:
        prompt, completion = outcome.prompt_tokens, outcome.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's shape: how many prompt tokens were not computed again.
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        }

    def _failure(self) -> tuple[str, str]:
        """(code, message) of a stream that did not complete."""
        outcome = self.stream.outcome
        if isinstance(outcome, Failed):
            return outcome.code.value, outcome.message
        return EndCode.INTERNAL.value, "the stream ended without an outcome"

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body. Holds no cleanup: the middleware ends the request."""
        if self.chat:
            yield self._chunk(None, None, first=True)
        elif self.echo:
            yield self._chunk(Delta(self.echo, ()), None)
        async for delta in self.stream:
            yield self._chunk(delta, None)
        outcome = self.stream.outcome
        if isinstance(outcome, Completed):
            yield self._chunk(outcome.final, outcome.finish_reason.value)
            if self.req.include_usage:
                yield sse.event(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created,
                        "model": self.model.id,
                        "choices": [],
                        "usage": self._usage(outcome),
                    }
                )
        else:
            code, message = self._failure()
            yield sse.error_event(message, type="server_error", code=code)
        yield sse.DONE

    async def whole(self) -> tuple[dict[str, Any], int]:
        """The non-streaming body: (JSON object, status)."""
        texts: list[str] = [self.echo]
        lps: list[dict[str, Any] | None] = []
        calls: list[ParsedDelta] = []
        async for delta in self.stream:
            texts.append(delta.text)
            lps.append(self._logprobs(delta))
            calls.append(ParsedDelta("", delta.tool_calls))
        outcome = self.stream.outcome
        if not isinstance(outcome, Completed):
            code, message = self._failure()
            status = STATUS_OF_END[outcome.code] if isinstance(outcome, Failed) else 500
            return ApiError(status, message, type="server_error", code=code).body(), status
        texts.append(outcome.final.text)
        lps.append(self._logprobs(outcome.final))
        calls.append(ParsedDelta("", outcome.final.tool_calls))
        text = "".join(texts)
        _, tool_calls = merge(calls)
        logprobs = merge_logprobs([x for x in lps if x is not None], self.chat)
        finish = outcome.finish_reason.value
        if self.chat:
            answer: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                # OpenAI: content is null when the answer is only calls.
                answer["content"] = text or None
                answer["tool_calls"] = [c.to_openai() for c in tool_calls]
            choice: dict[str, Any] = {
                "index": 0,
                "message": answer,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model.id,
            "choices": [choice],
            "usage": self._usage(outcome),
        }
        return body, 200


def _call_delta(t: ToolCallDelta) -> dict[str, Any]:
    """One piece of a streamed call, as OpenAI spells it: the first piece of a call
    carries ``id``, ``type`` and ``function.name``; later ones only arguments."""
    if t.id is None:
        return {"index": t.index, "function": {"arguments": t.arguments}}
    return {
        "index": t.index,
        "id": t.id,
        "type": "function",
        "function": {"name": t.name, "arguments": t.arguments},
    }


def merge_logprobs(parts: list[dict[str, Any]], chat: bool) -> dict[str, Any] | None:
    """The logprobs of several deltas as one entry (a whole-body answer)."""
    if not parts:
        return None
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [v for p in parts for v in p[k]] for k in parts[0]}
