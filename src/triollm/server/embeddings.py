"""``POST /v1/embeddings``: OpenAI's request and answer shapes around ``model/embed.py``.

The request: ``input`` (a string, a list of strings, a list of token ids, or a list of
such lists; at most :data:`MAX_INPUTS`), ``encoding_format`` (``float``, or ``base64``:
each vector's little-endian float32 bytes, which the ``openai`` client asks for by
default and decodes itself), ``dimensions`` (a prefix of the vector, normalized again),
``model``, ``user``. Each input is tokenized by ``request.Preparer`` (the same limits and
vocabulary checks as a prompt; the 400 names ``input[i]``) and pooled by the server's
:class:`Pooler` (``model/embed.Embedder``, built by ``server/command.py``).

Embeddings do not take a place in the generation queue: they hold no KV blocks of the
pool (each keeps a private K/V cache of its own text's size, freed when it is pooled).
They have a queue of their own, :class:`EmbeddingQueue`: one runs at a time, each chunk
of its text taking its turn at the model's lock with the batch loop's steps
(``model/embed.py`` says why the chunks), and a bounded number wait, as long as the
generation queue lets a request wait; past either bound the request is refused with
admission's own 429s (``queue_full``, ``queue_timeout``, ``Retry-After``). Without the
bound a flood of embeddings would pile up without limit in front of the model and of
the tokenizer's threads, which chat requests share.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from triollm.admission import QueueFull, QueueTimeout, retry_after
from triollm.server.apifields import Body, Field, FieldTable, text
from triollm.server.apifields import Support as S
from triollm.server.openai import as_integer, bad_request

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "EMBEDDINGS_FIELDS",
    "MAX_INPUTS",
    "EmbeddingQueue",
    "EmbeddingRequest",
    "Pooler",
    "answer",
    "parse_embeddings",
]

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request

EMBEDDINGS_FIELDS = FieldTable(
    "embeddings",
    [
        Field("model", S.HONOURED, "the served model (or left out); another id is a 404"),
        Field("input", S.HONOURED, "text, token ids, or a list of either"),
        Field("encoding_format", S.HONOURED, "float or base64 (little-endian float32)"),
        Field("dimensions", S.HONOURED, "a prefix of the vector, normalized again"),
        Field("user", S.ACCEPTED, "a label"),
    ],
)


class Pooler(Protocol):
    """What the edge needs of ``model/embed.Embedder``."""

    @property
    def dimensions(self) -> int: ...

    def embed(self, token_ids: Sequence[int], dimensions: int | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated request: each input is text or token ids."""

    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    base64: bool
    dimensions: int | None
    unknown: tuple[str, ...] = ()


class EmbeddingQueue:
    """One embedding request runs at a time; at most ``max_waiters`` wait, each at most
    ``wait_s`` (the generation queue's depth per slot and wait budget: the embedder is
    one slot). Past either bound: :class:`~triollm.admission.QueueFull` or
    :class:`~triollm.admission.QueueTimeout`, which the edge answers 429 with
    ``Retry-After`` as it answers generation's.

    The wait is FIFO (``trio.Lock`` is fair). A client that leaves while waiting gives
    its place back at once (the ``finally``), and one that leaves while running releases
    the lock when its thread's chunk returns.
    """

    def __init__(self, *, max_waiters: int, wait_s: float) -> None:
        self._running = trio.Lock()
        self.max_waiters = max_waiters
        self.wait_s = wait_s
        self.waiting = 0  # requests in place() that do not hold the lock yet

    @asynccontextmanager
    async def place(self) -> AsyncIterator[None]:
        """Hold the one running place while the body runs (waiting for it if need be)."""
        if self.waiting >= self.max_waiters:
            raise QueueFull(
                f"the embeddings queue is full: {self.waiting} requests wait behind the one "
                f"running (at most {self.max_waiters}); retry later",
                retry_after(self.wait_s),
            )
        self.waiting += 1
        try:
            with trio.move_on_after(self.wait_s) as waited:
                await self._running.acquire()
        finally:
            self.waiting -= 1
        if waited.cancelled_caught:  # our deadline: the client's own cancel passes through
            raise QueueTimeout(
                f"waited {self.wait_s:g} s for the embeddings queue without a turn",
                retry_after(self.wait_s),
            )
        try:
            yield
        finally:
            self._running.release()


def _ids(value: list[Any], param: str) -> tuple[int, ...] | None:
    """``value`` as token ids, or None if it is not a list of integers."""
    ids = [as_integer(t) for t in value]
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return None
    if any(t < 0 for t in ids):
        raise bad_request(f"'{param}' token ids must be non-negative integers", param)
    return tuple(ids)


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and _ids(value, "input") is not None:
        items = [value]  # one list of token ids is one input
    elif isinstance(value, list) and value:
        items = value
    else:
        raise bad_request(
            "'input' is required: a non-empty string, token ids, or a list of either", "input"
        )
    if len(items) > MAX_INPUTS:
        raise bad_request(
            f"'input' may hold at most {MAX_INPUTS} inputs, got {len(items)}", "input"
        )
    out: list[str | tuple[int, ...]] = []
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'{param}' must not be empty", param)
            out.append(text(item, param))
            continue
        ids = _ids(item, param) if isinstance(item, list) else None
        if ids is None:
            raise bad_request(f"'{param}' must be a non-empty string or a list of token ids", param)
        out.append(ids)
    return tuple(out)


def parse_embeddings(raw: bytes, hidden_size: int) -> EmbeddingRequest:
    """The body as an :class:`EmbeddingRequest` (a 400 naming the field)."""
    r = Body(raw, EMBEDDINGS_FIELDS)
    fmt = r.string("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(
            f"'encoding_format' must be float or base64, got {fmt!r}", "encoding_format"
        )
    return EmbeddingRequest(
        model=r.string("model") or None,
        inputs=_inputs(r.body.get("input")),
        base64=fmt == "base64",
        dimensions=r.integer("dimensions", 1, hidden_size),
        unknown=r.unknown,
    )


def answer(
    req: EmbeddingRequest, model_id: str, vectors: Sequence[np.ndarray], prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's list of embeddings, in input order."""
    data = []
    for i, v in enumerate(vectors):
        value: Any = (
            base64.b64encode(v.astype("<f4").tobytes()).decode() if req.base64 else v.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": model_id,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
