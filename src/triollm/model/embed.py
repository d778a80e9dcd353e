"""Embeddings from a decoder: the final hidden states of a text, pooled into one vector.

An embedding model built on a decoder (Qwen3-Embedding is Qwen3's layout; e5-mistral,
gte-Qwen2 and SFR-Embedding are Mistral's and Qwen2's) is the same forward pass as the
chat model without the output head: the text's tokens go through every layer, the last
layer's output is normed (``model.norm``), and a pooling rule turns the rows into one
vector:

- ``last`` (Qwen3-Embedding, e5-mistral): the row of the last token, which under causal
  attention is the only row that has seen the whole text;
- ``mean``: the mean of every row (gte-style models).

The vector is then L2-normalized, so a dot product of two is their cosine similarity.
This matches what sentence-transformers computes for these models (``last_hidden_state``
pooled, then ``normalize``); ``tests/server/test_embeddings.py`` holds it to transformers.

How it runs: :meth:`LlamaModel.forward_scored` returns the final-normed hidden state of
a chunk's *scored* rows (the rows it gives the output head when a prompt is scored), so
a chunk that scores every row gives every row's state, with no head computed for them.
The K/V the layers write go to a private cache sized to the text (the server's pool
belongs to the scheduler, which knows nothing of this text). The text runs in chunks of
``chunk_tokens`` rows, each its own forward call: the model runs one forward at a time
(its lock), so the batch loop's next step waits for at most one chunk, not the whole
text. That is the hazard this module is shaped around: a 4,000-token text in one call
would freeze every stream for the whole prefill.

Every array is float32.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from triollm.model.kvstore import KVDtype, PagedKVCache
from triollm.plan import ChunkPlan

if TYPE_CHECKING:  # a name only: importing llama compiles nothing, but the CLI need not load it
    from triollm.model.llama import LlamaModel

__all__ = ["Embedder", "Pooling", "normalize"]


class Pooling(enum.Enum):
    """How a text's rows become one vector (named as sentence-transformers names them)."""

    LAST = "last"  # the last token's row (Qwen3-Embedding)
    MEAN = "mean"  # the mean of every row


def normalize(v: np.ndarray) -> np.ndarray:
    """``v`` over its L2 norm (a zero vector stays zero rather than turning into NaN)."""
    norm = np.float32(np.linalg.norm(v))
    return v / norm if norm > 0 else v


class Embedder:
    """Pools a served model's final hidden states into embeddings.

    ``chunk_tokens``: rows per forward call (the server's prefill chunk, so an embedding
    holds the model no longer than a prefill chunk does); ``block_size`` and
    ``kv_dtype``: the private cache's layout (the server's own, so the attention kernels
    see the cache they were compiled for).

    Trap: :meth:`embed` blocks for the whole text; call it from a worker thread, one at
    a time per embedder (its cache is allocated per call, up to a text's worth of K/V).
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        pooling: Pooling = Pooling.LAST,
        chunk_tokens: int = 128,
        block_size: int = 32,
        kv_dtype: KVDtype = KVDtype.F32,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.model = model
        self.pooling = pooling
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.kv_dtype = kv_dtype

    @property
    def dimensions(self) -> int:
        return int(self.model.config.hidden_size)

    def embed(self, token_ids: Sequence[int], dimensions: int | None = None) -> np.ndarray:
        """``(hidden,)`` float32, L2-normalized: the pooled final hidden state. With
        ``dimensions``, its first that many values, normalized again (the Matryoshka
        rule Qwen3-Embedding is trained for: a prefix of the vector is an embedding)."""
        ids = tuple(int(t) for t in token_ids)
        if not ids:
            raise ValueError("an embedding needs at least one token")
        bs = self.block_size
        n_blocks = -(-len(ids) // bs)
        kv = PagedKVCache(self.model.config, n_blocks, bs, self.kv_dtype)
        table = tuple(range(n_blocks))
        total = np.zeros(self.dimensions, dtype=np.float32)  # (hidden,) float32, mean pooling
        last = total
        for start in range(0, len(ids), self.chunk_tokens):
            rows = ids[start : start + self.chunk_tokens]
            final = start + len(rows) == len(ids)
            wanted = self.pooling is Pooling.MEAN or final
            # score_ids only count rows here: every row of the chunk is "scored", so
            # forward_scored hands back each row's final-normed state. No row samples.
            chunk = ChunkPlan(
                seq_id=0,
                token_ids=rows,
                start=start,
                block_table=table,
                sample=False,
                prefill=True,
                score_ids=rows if wanted else (),
            )
            _, hidden = self.model.forward_scored([chunk], kv)  # (rows or 0, hidden) float32
            if self.pooling is Pooling.MEAN:
                total += hidden.sum(axis=0, dtype=np.float32)
            elif final:
                last = hidden[-1]
        pooled = total / np.float32(len(ids)) if self.pooling is Pooling.MEAN else last
        if dimensions is not None:
            pooled = pooled[:dimensions]
        return normalize(pooled.astype(np.float32, copy=False))
