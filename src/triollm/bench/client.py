"""One streamed request, timed and validated: the edge of the load generator.

httpx (which runs on trio) sends the request; httpx-sse splits the body into
Server-Sent Events. Everything the client sees lands in a :class:`RequestRecord`:
the arrival time of every chunk that carried output, how many tokens each carried
when the server says, how the request ended, and each protocol fault
(:class:`Problem`) with a one-line detail naming what was wrong.

How many tokens a chunk carried (``stats.py``'s per-token ITL needs it): OpenAI's
stream does not say. llama-server does with ``timings_per_token: true``: every
chunk then carries ``timings.predicted_n``, the tokens generated so far, so a chunk
carried the difference from the previous one (its source, ``server-context.cpp``,
sends no chunk while a UTF-8 character is incomplete, then one chunk for all its
byte-tokens). Servers that do not know the field ignore it (triollm and vLLM log
it and go on); their chunks are counted one token each and checked against
``usage`` (``RequestRecord.tokens_by_chunk``).

What a correct OpenAI-style stream looks like, and so what is checked:

- ``200`` with ``text/event-stream``; events ``data: {json}`` whose ``choices[0]``
  carries ``text`` (completions) or ``delta.content`` (chat), a ``finish_reason`` at
  the end, then ``data: [DONE]`` and nothing after it;
- ``usage`` (asked for with ``stream_options.include_usage``) in a chunk near the
  end, whose ``completion_tokens`` is at least the number of text chunks (a chunk may
  carry several tokens, never fewer than one), equals ``max_tokens`` when the
  finish reason is ``length``, and whose ``prompt_tokens`` equals the number of token
  ids sent;
- with ``ignore_eos``, an answer of exactly ``max_tokens`` tokens ending ``length``
  (both servers were asked for that work; one that stops early did less of it);
- per-chunk token counts, when the server gives them, that add up to ``usage``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
from httpx_sse import EventSource, SSEError

from triollm.bench.stats import Outcome, Problem, RequestRecord
from triollm.bench.workload import Api, Request
from triollm.errors import UserError

DONE = "[DONE]"


def _outcome_of_status(status: int) -> Outcome:
    if status == 429:
        return Outcome.RATE_LIMITED
    return Outcome.CLIENT_ERROR if 400 <= status < 500 else Outcome.SERVER_ERROR


def _text_of(choice: dict[str, Any], api: Api) -> str:
    if api is Api.COMPLETIONS:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def check_usage(
    usage: dict[str, Any] | None,
    chunks: int,
    finish: str | None,
    req: Request,
    counted: int | None = None,
) -> list[tuple[Problem, str]]:
    """The usage rules of the module docstring; one problem per rule broken.
    ``chunks``: the chunks that carried text; ``counted``: the tokens the chunks
    said they carried (llama-server's ``timings.predicted_n``), None if they did not."""
    if usage is None:
        return [(Problem.USAGE_MISSING, "no chunk carried 'usage' (include_usage was true)")]
    out: list[tuple[Problem, str]] = []
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int):
        return [(Problem.USAGE_MISMATCH, f"usage.completion_tokens is {completion!r}")]
    if completion < chunks:
        out.append(
            (
                Problem.USAGE_MISMATCH,
                f"usage.completion_tokens={completion} but {chunks} chunks carried text",
            )
        )
    if finish == "length" and completion != req.max_tokens:
        out.append(
            (
                Problem.USAGE_MISMATCH,
                f"finish_reason 'length' at max_tokens={req.max_tokens} "
                f"but usage.completion_tokens={completion}",
            )
        )
    prompt = usage.get("prompt_tokens")
    if req.prompt_ids is not None and prompt != len(req.prompt_ids):
        out.append(
            (
                Problem.USAGE_MISMATCH,
                f"usage.prompt_tokens={prompt} but {len(req.prompt_ids)} token ids were sent",
            )
        )
    if req.body.get("ignore_eos") and (finish != "length" or completion != req.max_tokens):
        out.append(
            (
                Problem.NOT_MAX_TOKENS,
                f"ignore_eos with max_tokens={req.max_tokens} but usage.completion_tokens="
                f"{completion}, finish_reason {finish!r}",
            )
        )
    if counted is not None and counted != completion:
        out.append(
            (
                Problem.USAGE_MISMATCH,
                f"the chunks' token counts (timings.predicted_n) add up to {counted} "
                f"but usage.completion_tokens={completion}",
            )
        )
    return out


def _predicted_n(payload: dict[str, Any]) -> int | None:
    """llama-server's running count of generated tokens in a chunk, if it sent one."""
    timings = payload.get("timings")
    n = timings.get("predicted_n") if isinstance(timings, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _placed(
    chunks: list[tuple[float, bool, int | None]],
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """(arrival times, tokens each carried) of the chunks that carried output.

    When every chunk with text also had a count (llama-server with timings_per_token),
    the chunks with a count but no text (its final chunk can carry the last tokens of a
    character it never completed) are output too. Otherwise (a server without counts;
    llama-server without timings_per_token counts only in its final chunk) only the
    chunks with text are, and the counts are () for ``RequestRecord`` to infer."""
    if chunks and all(k is not None for _, carried, k in chunks if carried):
        kept = [(t, k or 0) for t, carried, k in chunks if carried or k]
        return tuple(t for t, _ in kept), tuple(k for _, k in kept)
    return tuple(t for t, carried, _ in chunks if carried), ()


async def word_ids(
    client: httpx.AsyncClient, base_url: str, words: list[str]
) -> tuple[tuple[int, ...], ...]:
    """Each word (with its leading space, as it sits in running text) as the server's
    tokenizer splits it, through ``POST /tokenize`` (llama-server's and triollm's,
    ``{"content": ...}``; ``add_special: false`` keeps llama-server from adding BOS).
    Concatenated, they are the ids of the words' text, so a prompt made of them has an
    exact length and decodes to ordinary words."""
    out = []
    for w in words:
        body = {"content": " " + w, "add_special": False}
        try:
            r = await client.post(base_url + "/tokenize", json=body)
        except httpx.HTTPError as exc:
            raise UserError(
                f"--prompt-kind words: {base_url}/tokenize failed ({type(exc).__name__}); "
                "pass --prompt-kind ids"
            ) from None
        try:
            ids = r.json()["tokens"]
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(ids)
        except (ValueError, KeyError, TypeError):
            raise UserError(
                f"--prompt-kind words: {base_url}/tokenize answered {r.status_code} without "
                "a token list; pass --prompt-kind ids"
            ) from None
        out.append(tuple(ids))
    return tuple(out)


# The server's step-time histogram (server/metrics.py), its _sum and _count samples.
_STEP_SERIES = "triollm:step_duration_seconds"


def step_totals(page: str) -> dict[str, tuple[float, float]]:
    """``{kind: (seconds, steps)}`` from a triollm ``/metrics`` page's
    ``triollm:step_duration_seconds`` histogram (its ``_sum`` and ``_count``), read
    with prometheus_client's own text parser; empty for a page without it (another
    server, an older triollm). Two readings around a level give the server's own mean
    step time during it (:func:`step_means_ms`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            kind = sample.labels.get("kind")
            end = sample.name.removeprefix(_STEP_SERIES)
            if kind is None or sample.name == end or end not in ("_sum", "_count"):
                continue
            out.setdefault(kind, [0.0, 0.0])[end == "_count"] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def step_means_ms(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]] | None:
    """Per kind, the steps run between two :func:`step_totals` readings and their mean
    time in ms; None when the server publishes no step times."""
    if not after:
        return None
    out = {}
    for kind, (seconds, steps) in after.items():
        s0, n0 = before.get(kind, (0.0, 0.0))
        n = steps - n0
        if n > 0:
            out[kind] = {"steps": n, "mean_ms": round(1e3 * (seconds - s0) / n, 3)}
    return out


async def read_step_totals(
    client: httpx.AsyncClient, base_url: str
) -> dict[str, tuple[float, float]]:
    """:func:`step_totals` of the server's ``/metrics`` page; empty if it has none
    (llama-server answers 501 without ``--metrics``) or cannot be reached."""
    try:
        r = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return {}
    return step_totals(r.text) if r.status_code == 200 else {}


# A keep-alive connection the server closed while it sat idle in the pool (hypercorn's
# keep-alive timeout is 5 s) fails the next request before any byte of a response:
# every HTTP client sends such a request once more on a new connection, and so do we,
# once. A failure after a status line is never retried (that stream is measured as cut).
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def send(
    client: httpx.AsyncClient,
    base_url: str,
    api: Api,
    req: Request,
    *,
    t0: float,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send ``req`` and follow its stream to the end. Never raises for what the server
    does (that is what is being measured); only cancellation propagates. A request
    that fails before any response on a pooled connection is sent once more
    (``STALE_CONNECTION``)."""
    problems: list[tuple[Problem, str]] = []
    # (arrival, carried text?, tokens by timings.predicted_n or None) per chunk with output
    chunks: list[tuple[float, bool, int | None]] = []
    predicted = 0  # the last timings.predicted_n seen
    text: list[str] = []
    usage: dict[str, Any] | None = None
    finish: str | None = None
    done = False
    status: int | None = None
    sent = clock() - t0

    def record(outcome: Outcome, **kw: Any) -> RequestRecord:
        chunk_s, chunk_tokens = _placed(chunks)
        return RequestRecord(
            sent_s=sent,
            done_s=clock() - t0,
            outcome=outcome,
            status=status,
            chunk_s=chunk_s,
            chunk_tokens=chunk_tokens,
            output_tokens=usage["completion_tokens"]
            if usage and isinstance(usage.get("completion_tokens"), int)
            else sum(chunk_tokens)
            if chunk_tokens
            else len(chunk_s),
            prompt_tokens=usage.get("prompt_tokens") if usage else None,
            finish_reason=finish,
            problems=tuple(problems),
            turn=req.turn,
            text="".join(text),
            **kw,
        )

    for attempt in range(2):
        try:
            async with client.stream(
                "POST", base_url + api.path, json=req.body, headers={"Accept": "text/event-stream"}
            ) as response:
                status = response.status_code
                if status != 200:
                    await response.aread()
                    return record(
                        _outcome_of_status(status),
                        retry_after=response.headers.get("retry-after") if status == 429 else None,
                    )
                async for event in EventSource(response).aiter_sse():
                    if event.data == DONE:
                        done = True
                        continue
                    if done:
                        problems.append((Problem.DATA_AFTER_DONE, event.data[:120]))
                        continue
                    try:
                        payload = json.loads(event.data)
                    except json.JSONDecodeError:
                        problems.append((Problem.BAD_EVENT, f"not JSON: {event.data[:120]!r}"))
                        continue
                    if not isinstance(payload, dict):
                        problems.append((Problem.BAD_EVENT, f"not an object: {event.data[:120]!r}"))
                        continue
                    if "error" in payload:
                        problems.append((Problem.ERROR_EVENT, json.dumps(payload["error"])[:200]))
                        continue
                    if payload.get("usage"):
                        usage = payload["usage"]
                    choices = payload.get("choices")
                    if not isinstance(choices, list):
                        problems.append((Problem.BAD_EVENT, f"no 'choices': {event.data[:120]!r}"))
                        continue
                    now = clock() - t0
                    carried = False
                    for choice in choices:
                        piece = _text_of(choice, api)
                        if piece:
                            carried = True
                            text.append(piece)
                        if choice.get("finish_reason"):
                            finish = choice["finish_reason"]
                    k: int | None = None
                    if (n := _predicted_n(payload)) is not None:
                        k, predicted = max(n - predicted, 0), max(n, predicted)
                    if carried or k:
                        chunks.append((now, carried, k))
        except SSEError as exc:  # a 200 that is not an event stream
            problems.append((Problem.BAD_EVENT, str(exc)))
            return record(Outcome.CUT)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            return record(Outcome.NO_CONNECTION)
        except httpx.HTTPError as exc:  # reset, protocol error or timeout mid-way
            if status is None and attempt == 0 and isinstance(exc, STALE_CONNECTION):
                sent = clock() - t0  # the pooled connection had closed while idle: again
                continue
            if status is None:
                return record(Outcome.NO_CONNECTION)
            if not done:
                problems.append((Problem.NO_DONE, f"stream broke: {type(exc).__name__}: {exc}"))
            return record(Outcome.CUT)
        break
    if not done:
        problems.append((Problem.NO_DONE, "the stream ended without 'data: [DONE]'"))
    _, counts = _placed(chunks)
    text_chunks = sum(1 for _, carried, _ in chunks if carried)
    problems.extend(check_usage(usage, text_chunks, finish, req, sum(counts) if counts else None))
    return record(Outcome.OK if finish else Outcome.CUT)
