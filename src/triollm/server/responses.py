"""OpenAI's response shapes: a :class:`~triollm.output.RequestStream` in, SSE chunks or
one JSON object out. JSON only: every text and byte it writes came with the deltas
(the output processor decoded them), so this module holds no tokenizer.

:class:`ResponseWriter` is built before the response starts (it must not touch
quart's ``request``, which is gone inside the body generator) and turns the stream's
:class:`~triollm.events.Delta` values and its outcome into OpenAI's JSON: the
``text_completion`` / ``chat.completion.chunk`` events of a stream, or the whole
``text_completion`` / ``chat.completion`` body. Logprobs entries show each token's
text, or its bytes when the token is part of a character (``output.token_text``).
A scored prompt (``echo`` with ``logprobs``) arrives as each choice's first delta's
``prompt``: its tokens become entries like the answer's, before them, with offsets
into the echoed text, and the echoed text travels with them (a stream's first event
of the choice carries both, as vLLM sends them). vLLM's ``prompt_logprobs`` (whole
bodies only) reads the same scores into vLLM's shape: a choice's
``prompt_logprobs`` on completions, the body's on chat. An outcome that is not a
completion becomes an SSE error event, or a status from :data:`STATUS_OF_END`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Response

from triollm.events import Completed, Delta, Ended, Failed, Outcome, TokenInfo
from triollm.outcomes import EndCode
from triollm.output import RequestStream
from triollm.request import GenerationRequest, ServedModel
from triollm.server import sse
from triollm.server.openai import ApiError
from triollm.toolcalls import ParsedDelta, ToolCallDelta, merge

# The status of a whole-body answer whose stream was cut: the server's fault (500),
# except a shutdown, which is the server's choice to stop and is worth a retry (503).
STATUS_OF_END = {
    EndCode.SHUTDOWN: 503,
    EndCode.INTERNAL: 500,
    EndCode.TOO_SLOW: 500,
    EndCode.CLIENT_CLOSED: 500,  # nobody reads it: the client has gone
    # The request's grammar could not be followed to its end (a parser limit, a token the
    # engine refused): the request's 400, never a 500 the client retries (issue 26).
    EndCode.GRAMMAR_FAILED: 400,
}


def json_text(obj: Any) -> str:
    """A JSON body as text (non-ASCII kept as is)."""
    return json.dumps(obj, ensure_ascii=False)


def error_response(err: ApiError) -> Response:
    return Response(
        json_text(err.body()), status=err.status, mimetype="application/json", headers=err.headers
    )


class ResponseWriter:
    """Turns a RequestStream into OpenAI's JSON: SSE chunks or one whole object.

    A request of ``n`` choices: every chunk names its choice's ``index`` and each
    choice gets its own ``finish_reason`` when it ends, in the order things happen
    (the stream's one channel interleaves them). The usage counts the prompt once and
    the completion tokens of every choice; ``cached_tokens`` is the prompt's, as its
    first choice (the one that computed it) found them. A choice that fails fails the
    response: OpenAI's shapes have no error for one choice, so the stream gets its
    error event and ends (the whole body its status), and the other choices are ended
    at once with the failed one's code (``RequestStream.close``).
    """

    media_type = sse.CONTENT_TYPE  # of the streamed body

    def __init__(
        self,
        req: GenerationRequest,
        model: ServedModel,
        stream: RequestStream,
        echo: str | list[str] = "",
    ) -> None:
        """``echo``: the prompt's text, when the completion request asked for ``echo``:
        each choice's text starts with it (a stream's first events carry it). A list of
        prompts (completions): one echo per prompt, and the stream's choices are
        ``req.n`` per prompt, prompt ``i``'s choice ``j`` at index ``i * n + j``."""
        self.req = req
        self.echoes = [echo] if isinstance(echo, str) else echo
        self.per_prompt = max(1, req.n)
        self.model = model
        self.stream = stream
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        # logprobs, per choice: where its next answer token's text starts (after the echo)
        self.text_offsets: dict[int, int] = {}
        # A scored prompt: the echoed text waits for the prompt's log-probabilities and
        # goes out with them, in each choice's first delta (Delta.prompt).
        self.echo_waits = req.scores_prompt

    def echo(self, index: int) -> str:
        """The echoed text of choice ``index`` (its prompt's)."""
        prompt = index // self.per_prompt if len(self.echoes) > 1 else 0
        return self.echoes[prompt]

    # -- logprobs -------------------------------------------------------------------

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        """A delta's logprobs entry. Each token's display text and bytes (a piece of a
        character shows as ``bytes:\\xNN``) and a scored prompt's offsets come with the
        delta (``output.Describer``): shaping them needs no tokenizer."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            content = []
            for t in delta.tokens:
                alts = [
                    {"token": text, "logprob": lp, "bytes": list(raw)}
                    for (_, lp), (text, raw) in zip(t.top, t.top_text, strict=True)
                ]
                content.append(
                    {
                        "token": t.text,
                        "logprob": t.logprob,
                        "bytes": list(t.raw),
                        "top_logprobs": alts,
                    }
                )
            return {"content": content}
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []

        k = self.req.logprobs  # a scored prompt may carry more, for prompt_logprobs

        def entry(t: TokenInfo, offset: int) -> None:
            tokens.append(t.text)
            token_logprobs.append(t.logprob)
            # The first prompt token has no logprob and no alternatives: null, as in
            # OpenAI's and vLLM's answers.
            alts = zip(t.top[:k], t.top_text[:k], strict=True)
            top.append(None if t.logprob is None else {text: lp for (_, lp), (text, _) in alts})
            offsets.append(offset)

        if self.req.echo:  # a prompt scored for prompt_logprobs alone is not echoed
            for t, offset in zip(delta.prompt, delta.prompt_offsets, strict=True):
                entry(t, offset)
        at = self.text_offsets.get(delta.index, len(self.echo(delta.index)))
        for t in delta.tokens:
            # Where this token's text starts in the returned text: the text is what
            # the detokenizer and stop matcher released, not the tokens' own strings.
            entry(t, at)
        self.text_offsets[delta.index] = at + len(delta.text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, deltas: list[Delta]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of one choice: an entry per prompt position, None
        for the first (nothing predicts it), else keyed by token id: the prompt token
        first, then the ``prompt_logprobs`` likeliest there, each with its logprob, its
        rank (1: the likeliest) and its text. The scores ride the choice's first delta."""
        k = self.req.prompt_logprobs or 0
        prompt = next((d.prompt for d in deltas if d.prompt), ())
        out: list[dict[str, Any] | None] = []
        for t in prompt:
            if t.logprob is None:
                out.append(None)
                continue
            entry = {
                str(t.token_id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.text}
            }
            alts = zip(t.top[:k], t.top_text[:k], strict=True)
            for rank, ((tid, lp), (text, _)) in enumerate(alts, start=1):
                entry.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": text})
            out.append(entry)
        return out

    def _text(self, delta: Delta) -> str:
        """A delta's text; the echoed prompt first in the one that carries its scores
        (a scored choice's first delta always does, the first token's at least)."""
        return self.echo(delta.index) + delta.text if delta.prompt else delta.text

    # -- chunks ---------------------------------------------------------------------

    def _chunk(
        self,
        index: int,
        delta: Delta | None,
        finish: str | None,
        first: bool = False,
        lp: dict[str, Any] | None = None,
    ) -> bytes:
        """One SSE event; ``lp`` is the delta's logprobs (:meth:`_logprobs`)."""
        text = self._text(delta) if delta is not None else ""
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                d["content"] = text
            if delta is not None and delta.tool_calls:
                d["tool_calls"] = [_call_delta(t) for t in delta.tool_calls]
            choice: dict[str, Any] = {
                "index": index,
                "delta": d,
                "logprobs": lp,
                "finish_reason": finish,
            }
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
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

    def _usage(self, outcomes: list[Completed]) -> dict[str, Any]:
        """Each prompt once (its choices shared it), every choice's completion tokens."""
        firsts = outcomes[:: self.per_prompt]  # each prompt's first choice
        prompt = sum(o.prompt_tokens for o in firsts)
        completion = sum(o.completion_tokens for o in outcomes)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # OpenAI's shape: how many prompt tokens were not computed again. Each
            # prompt's first choice's: it computed the prompt; the others read its blocks.
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in firsts)},
        }

    @staticmethod
    def _failure(outcome: Outcome | None) -> tuple[str, str]:
        """(code, message) of a choice that did not complete."""
        if isinstance(outcome, Failed):
            return outcome.code.value, outcome.message
        return EndCode.INTERNAL.value, "the stream ended without an outcome"

    def _cut_the_others(self, failed: Ended) -> None:
        """End the choices still running when one has failed the response: with its
        code, so the log and the metrics say why (not as if the client had left)."""
        if isinstance(failed.outcome, Failed) and self.stream.n > 1:
            why = f"choice {failed.index} of the request failed: {failed.outcome.message}"
            self.stream.close(failed.outcome.code, why)

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body. Holds no cleanup: the middleware ends the request."""
        for index in range(self.stream.n):
            if self.chat:
                yield self._chunk(index, None, None, first=True)
            elif self.echo(index) and not self.echo_waits:
                yield self._chunk(index, Delta(self.echo(index), (), index=index), None)
        done: dict[int, Completed] = {}
        async for event in self.stream.events():
            if isinstance(event, Delta):
                lp = self._logprobs(event)
                yield self._chunk(event.index, event, None, lp=lp)
                continue
            outcome = event.outcome
            if not isinstance(outcome, Completed):
                code, message = self._failure(outcome)
                self._cut_the_others(event)
                yield sse.error_event(message, type="server_error", code=code)
                yield sse.DONE
                return
            done[event.index] = outcome
            lp = self._logprobs(outcome.final)
            yield self._chunk(event.index, outcome.final, outcome.finish_reason.value, lp=lp)
        if len(done) < self.stream.n:  # the channel closed under a choice still running
            code, message = self._failure(self.stream.outcome)
            yield sse.error_event(message, type="server_error", code=code)
        elif self.req.include_usage:
            yield sse.event(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.chat else "text_completion",
                    "created": self.created,
                    "model": self.model.id,
                    "choices": [],
                    "usage": self._usage([done[i] for i in range(self.stream.n)]),
                }
            )
        yield sse.DONE

    async def whole(self) -> tuple[dict[str, Any], int]:
        """The non-streaming body: (JSON object, status)."""
        n = self.stream.n
        # the echo first, unless it comes with the scores
        deltas: list[list[Delta]] = [
            [Delta("" if self.echo_waits else self.echo(i), (), index=i)] for i in range(n)
        ]
        done: dict[int, Completed] = {}
        failed: Outcome | None = None
        async for event in self.stream.events():
            if isinstance(event, Delta):
                deltas[event.index].append(event)
            elif isinstance(event.outcome, Completed):
                done[event.index] = event.outcome
                deltas[event.index].append(event.outcome.final)
            else:
                self._cut_the_others(event)  # one choice failed: so does the response
                failed = event.outcome
                break
        if len(done) < n:
            outcome = failed if failed is not None else self.stream.outcome
            code, message = self._failure(outcome)
            status = STATUS_OF_END[outcome.code] if isinstance(outcome, Failed) else 500
            kind = "server_error" if status >= 500 else "invalid_request_error"
            return ApiError(status, message, type=kind, code=code).body(), status
        outcomes = [done[i] for i in range(n)]
        # the echo (deltas[i][0]) has no tokens
        lps = [[self._logprobs(d) for d in deltas[i][1:]] for i in range(n)]
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model.id,
            "choices": [self._choice(i, deltas[i], outcomes[i], lps[i]) for i in range(n)],
            "usage": self._usage(outcomes),
        }
        if self.chat and self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(deltas[0])  # vLLM's place
        return body, 200

    def _choice(
        self,
        index: int,
        deltas: list[Delta],
        outcome: Completed,
        lps: list[dict[str, Any] | None],
    ) -> dict[str, Any]:
        """One whole choice from its deltas (the echo first, the final one last) and
        their logprobs."""
        text = "".join(self._text(d) for d in deltas)
        _, tool_calls = merge([ParsedDelta("", d.tool_calls) for d in deltas])
        logprobs = merge_logprobs([x for x in lps if x is not None], self.chat)
        finish = outcome.finish_reason.value
        if not self.chat:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._prompt_logprobs(deltas)
            return choice
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            # OpenAI: content is null when the answer is only calls.
            answer["content"] = text or None
            answer["tool_calls"] = [c.to_openai() for c in tool_calls]
        return {"index": index, "message": answer, "logprobs": logprobs, "finish_reason": finish}


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
