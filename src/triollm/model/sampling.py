"""Choosing the next token from one row of logits: penalties, filters, a seeded draw.

The pipeline for one sequence, one step (each stage is one vectorised numpy operation
over the vocabulary; nothing loops over tokens in Python):

1. **Penalties**, on the raw logits:
   - repetition (Hugging Face semantics): every id seen in the prompt *or* the answer
     has its logit divided by ``repetition_penalty`` when positive, multiplied when
     negative (so the penalty always pushes it down);
   - presence and frequency (OpenAI semantics): every id seen in the *answer* loses
     ``presence_penalty`` once plus ``frequency_penalty`` per occurrence.
2. **Temperature**: logits / T. ``temperature == 0`` means greedy: argmax of the
   penalised logits, no random number is drawn.
3. **Truncation**, in Hugging Face's order: top-k (ties with the k-th are kept), top-p
   (the smallest set whose probability reaches ``top_p``, at least one token), min-p
   (drop tokens below ``min_p`` times the top token's probability).
4. **Draw**: one uniform number from the sequence's own generator, inverted through the
   cumulative distribution. Exactly one draw per sampled token, so the stream of tokens
   depends only on the seed and the logits, never on what else shares the batch.

Log-probabilities (``logprobs``) are the log-softmax of the logits after penalties and
temperature but *before* truncation (with T = 1 for greedy, where the tempered
distribution would be a spike). That is OpenAI's meaning: the distribution the token
was drawn from, shaped by the request's own settings, and still defined for the top-n
alternatives that truncation removed.

Tests: ``tests/model/test_sampling.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from triollm.errors import FieldError

if TYPE_CHECKING:
    from triollm.model.constrained import Grammar

_SEED_SPACE = 2**64  # numpy's generators take a non-negative seed; any int is folded into it
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def _check_number(name: str, value: object, lo: float, hi: float, *, lo_open: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise FieldError(name, f"{name} must be a finite number, got {value!r}")
    below = value <= lo if lo_open else value < lo
    if below or value > hi:
        bracket = "(" if lo_open else "["
        raise FieldError(name, f"{name} must be in {bracket}{lo}, {hi}], got {value!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request turns logits into tokens. Frozen and validated on construction.

    Every field's default leaves the model's distribution unchanged (plain sampling at
    temperature 1). Bad values raise :class:`~triollm.errors.FieldError` (a
    ``ValueError``) naming the field and its range; its ``field`` attribute is the
    HTTP 400's ``param``. This is the one place the ranges live: the HTTP edge checks
    only JSON types and lets these checks answer.

    Trap: ``seed=None`` draws from OS entropy, so two identical requests differ; pass a
    seed to reproduce a run. ``temperature=0`` ignores every truncation setting.
    """

    temperature: float = 1.0  # 0 = greedy; OpenAI's range [0, 2]
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; HF semantics over prompt + answer
    presence_penalty: float = 0.0  # OpenAI semantics over the answer
    frequency_penalty: float = 0.0  # OpenAI semantics over the answer
    seed: int | None = None  # None = OS entropy
    logprobs: int | None = None  # None = none; 0 = the chosen token's only; n = plus top-n
    # vLLM's prompt_logprobs: a scored prompt's alternatives per position (None = as
    # many as logprobs asks for the echo); the Batch scores with scored_top_n
    prompt_logprobs: int | None = None
    # Structured output: the answer must follow this compiled grammar; the Batch masks
    # each row with it before sampling (model/constrained.py). None = unconstrained.
    grammar: Grammar | None = None
    # vLLM's min_tokens: until the answer holds this many tokens, the Batch keeps every
    # id the answer ends on (the request's stop ids, EOS among them) from being sampled.
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or self.min_tokens < 0
        ):
            raise FieldError(
                "min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
            )
        _check_number("temperature", self.temperature, 0.0, 2.0, lo_open=False)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_number("min_p", self.min_p, 0.0, 1.0, lo_open=False)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, lo_open=False)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, lo_open=False)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise FieldError(
                "top_k", f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise FieldError("seed", f"seed must be an integer or null, got {self.seed!r}")
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise FieldError(
                "logprobs",
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                f"got {self.logprobs!r}",
            )
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise FieldError(
                "prompt_logprobs",
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                f"got {self.prompt_logprobs!r}",
            )

    @property
    def scored_top_n(self) -> int:
        """How many alternatives a scored prompt's positions get: enough for the echo's
        ``logprobs`` and for ``prompt_logprobs`` (each answer takes its own share)."""
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled token, with log-probabilities when the request asked for them."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


class SequenceSampler:
    """The sampling state of one sequence: its random generator and the ids it has seen.

    Create one per sequence when it joins the batch; call :meth:`sample` once per step
    with that sequence's logits row.

    Trap: :meth:`sample` records the token it returns (for the penalties). Call
    :meth:`accept` only for a token this sampler did not choose (one forced from
    outside); calling it for a sampled token counts that token twice.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self.params = params
        seed = None if params.seed is None else params.seed % _SEED_SPACE
        self._rng = np.random.default_rng(seed)
        # Invariant: _counts holds the answer's ids only; the prompt is kept apart because
        # presence/frequency penalties must not see it, while the repetition penalty does.
        self._prompt_ids = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        self._counts: dict[int, int] = {}

    def accept(self, token_id: int) -> None:
        """Record a token that joined the answer without being drawn by :meth:`sample`."""
        self._counts[token_id] = self._counts.get(token_id, 0) + 1

    def sample(self, logits: np.ndarray) -> Sample:
        """Choose the next token from ``logits`` (float32, shape ``(vocab,)``) and record it."""
        p = self.params
        x = self._penalised(logits)  # (vocab,) float32, a copy
        if not p.greedy and p.temperature != 1.0:
            x /= np.float32(p.temperature)
        if p.greedy:
            token = int(np.argmax(x))
        else:
            idx, vals = candidates(x, p.top_k, p.top_p, p.min_p)
            token = int(idx[self._draw(vals)])
        self.accept(token)
        if p.logprobs is None:
            return Sample(token)
        return _with_logprobs(token, x, p.logprobs)

    # -- stages ----------------------------------------------------------------------------

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        x = np.array(logits, dtype=np.float32, copy=True)  # (vocab,) float32
        vocab = x.shape[0]
        if not self._counts and p.repetition_penalty == 1.0:
            return x
        gen_ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
        gen_counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
        keep = gen_ids < vocab  # an id past this row (a bigger tokenizer) cannot be penalised
        gen_ids, gen_counts = gen_ids[keep], gen_counts[keep]
        if p.repetition_penalty != 1.0:
            seen = np.union1d(self._prompt_ids, gen_ids)
            seen = seen[(seen >= 0) & (seen < vocab)]
            vals = x[seen]
            rp = np.float32(p.repetition_penalty)
            x[seen] = np.where(vals < 0, vals * rp, vals / rp)
        if p.presence_penalty or p.frequency_penalty:
            x[gen_ids] -= gen_counts * np.float32(p.frequency_penalty) + np.float32(
                p.presence_penalty
            )
        return x

    def _draw(self, vals: np.ndarray) -> int:
        """Inverse-CDF draw from softmax(vals); returns a position in ``vals``.

        Exactly one uniform number per token, whatever the vocabulary or the filters.
        The search is two-level (which block of ``_DRAW_BLOCK`` tokens, then where in
        it) because a float64 running sum over 150k entries costs milliseconds per
        token and a float32 one drifts by up to n * 6e-8 of the total.
        """
        probs = np.exp(vals - vals.max())  # (n,) float32; -inf -> 0
        n = probs.shape[0]
        full = n - n % _DRAW_BLOCK
        sums = probs[:full].reshape(-1, _DRAW_BLOCK).sum(axis=1).astype(np.float64)
        if full < n:
            sums = np.append(sums, probs[full:].sum(dtype=np.float64))
        ends = np.cumsum(sums)  # (n_blocks,) float64: where each block's mass ends
        u = self._rng.random() * ends[-1]
        # side="right" never lands on a block (or token) of zero mass: its running sum
        # equals its predecessor's, and u is strictly below the last value.
        b = min(int(np.searchsorted(ends, u, side="right")), ends.shape[0] - 1)
        block = probs[b * _DRAW_BLOCK : (b + 1) * _DRAW_BLOCK].astype(np.float64)
        within = u - (ends[b - 1] if b > 0 else 0.0)
        j = int(np.searchsorted(np.cumsum(block), within, side="right"))
        # Rounding between the block's sum and its running sum may push j one past the
        # end; clamp to the block's last token with any mass, never a zero one.
        j = min(j, int(np.flatnonzero(block)[-1]))
        return b * _DRAW_BLOCK + j


_DRAW_BLOCK = 1024  # tokens per block of the two-level inverse-CDF search


# Top-p looks at the most likely tokens first; this many are partitioned out at a time
# (then 4x more) instead of sorting the whole vocabulary, which costs milliseconds per
# token at 150k entries while the nucleus is usually a few dozen tokens.
_TOP_P_FIRST = 256


def candidates(
    x: np.ndarray, top_k: int, top_p: float, min_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The ids that top-k, then top-p, then min-p keep, and their logits.

    ``x`` (vocab,) float32 is already penalised and divided by the temperature. Each
    filter sees the distribution the previous one left (renormalised), as in
    transformers. At least one token always survives. With no filter on, every id is
    a candidate (``idx`` is then ``arange(vocab)``, without a copy of ``x``).
    """
    vocab = x.shape[0]
    if 0 < top_k < vocab:
        kth = np.partition(x, vocab - top_k)[vocab - top_k]  # the k-th largest value
        idx = np.flatnonzero(x >= kth)  # ties with the k-th are kept, as in HF
        vals = x[idx]
    else:
        idx, vals = np.arange(vocab), x
    if top_p < 1.0:
        idx, vals = _nucleus(idx, vals, top_p)
    if min_p > 0.0:
        # The ratio to the best token's probability does not depend on the normaliser.
        keep = np.exp(vals - vals.max()) >= np.float32(min_p)
        idx, vals = idx[keep], vals[keep]
    return idx, vals


def _nucleus(idx: np.ndarray, vals: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Keep the most likely tokens while the probability *before* each is below ``top_p``.

    That is transformers' rule (drop the ascending tail whose sum is <= 1 - top_p)
    read from the other end. Only the top ``m`` tokens are sorted, ``m`` growing until
    they reach ``top_p``.
    """
    n = vals.shape[0]
    top = vals.max()
    total = np.exp(vals - top).sum(dtype=np.float64)  # the normaliser over every candidate
    m = min(_TOP_P_FIRST, n)
    while True:
        part = np.argpartition(vals, n - m)[n - m :] if m < n else np.arange(n)
        part = part[np.argsort(-vals[part], kind="stable")]  # (m,) most likely first
        probs = np.exp(vals[part] - top) / total
        before = np.cumsum(probs) - probs  # probability of the tokens ranked above each
        if m == n or before[-1] + probs[-1] >= top_p:
            keep = part[before < top_p]
            return idx[keep], vals[keep]
        m = min(4 * m, n)


def truncate(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """``x`` with every logit the filters remove set to -inf (a new array; for tests/tools)."""
    idx, vals = candidates(x, top_k, top_p, min_p)
    out = np.full_like(x, -np.inf)
    out[idx] = vals
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    """log(softmax(x)) in float64, computed stably (max subtracted, log-sum-exp)."""
    x64 = x.astype(np.float64)
    shifted = x64 - np.max(x64)
    return np.asarray(shifted - np.log(np.exp(shifted).sum()))


def _with_logprobs(token: int, x: np.ndarray, top_n: int) -> Sample:
    """The chosen token's log-probability under softmax(x), and the top ``top_n``."""
    chosen, best = token_logprobs(x[None, :], np.array([token]), top_n)
    return Sample(token, float(chosen[0]), best[0])


def token_logprobs(
    x: np.ndarray, ids: np.ndarray, top_n: int
) -> tuple[np.ndarray, list[tuple[tuple[int, float], ...]]]:
    """For each row ``r`` of ``x`` (``(k, vocab)`` float32 logits): the log-probability
    of ``ids[r]`` under softmax(x[r]) (a ``(k,)`` float64 array), and the top
    ``top_n`` as ``(token_id, logprob)`` pairs, best first.

    The one log-probability rule, for a sampled token (one row) and for a scored
    prompt (a slice of rows, ``batch.py``): exp in float32 after the row's maximum
    is subtracted, summed in float64. Only the normaliser needs the whole
    vocabulary; log-softmax is monotone, so the top-n of the log-probabilities are
    the top-n of ``x``. The same token gets the same value in both places, so a
    client comparing the chosen logprob with the best alternative's finds them
    equal exactly when the token was the most likely one (lm-eval's ``is_greedy``).
    """
    k = x.shape[0]
    top = x.max(axis=1)  # (k,) float32
    shifted = x - top[:, None]  # (k, vocab) float32 scratch
    np.exp(shifted, out=shifted)
    log_total = np.log(shifted.sum(axis=1, dtype=np.float64))  # (k,) float64
    top64 = top.astype(np.float64)
    chosen = (x[np.arange(k), ids].astype(np.float64) - top64) - log_total
    if top_n <= 0:
        return chosen, [()] * k
    n = min(top_n, x.shape[1])
    idx = np.argpartition(x, -n, axis=1)[:, -n:]  # (k, n)
    vals = np.take_along_axis(x, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1)
    lps = (vals.astype(np.float64) - top64[:, None]) - log_total[:, None]
    # A grammar's mask leaves forbidden tokens at -inf: they are not alternatives
    # (and -inf is not a JSON number).
    best = [
        tuple((int(i), float(lp)) for i, lp, v in zip(ir, lr, vr, strict=True) if np.isfinite(v))
        for ir, lr, vr in zip(idx, lps, vals, strict=True)
    ]
    return chosen, best
