"""The frozen request messages: what one request is, once, for every layer below the edge.

A request crosses the layers as one frozen object, never as a list of keyword
arguments re-declared in each signature (CONVENTIONS rule 15). Two of them:

- :class:`GenerationSpec`: the whole request as ``request.prepare`` resolves it (the
  prompt's token ids, ``n``, the complete sampling parameters, the answer budget, the
  ids and strings it ends on, scoring, priority, salt, tool calls). The service, the
  output processor and the Batch read it; the offline engine runs it.
- :class:`SequenceSpec`: the scheduler's slice of it (:meth:`GenerationSpec.sequence`),
  the fields that decide admission and step composition. ``Scheduler.add_group``,
  ``check_group``, ``room`` and ``AdmissionQueue.enqueue`` take it.

A new request feature adds a field here and nowhere else; the scheduler learns of it
only if it goes into the slice.

This module imports nothing but the standard library (and ``toolcalls.py``, which is
pure too): the pure scheduler imports it, and must not pull in numpy or trio (the
sampling parameters' class is named for the type checker only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triollm.toolcalls import ToolCallFormat

if TYPE_CHECKING:
    from triollm.model.sampling import SamplingParams

__all__ = ["GenerationSpec", "SequenceSpec"]


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass's own __init__ does the same


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """What the scheduler needs of one request: its ``n`` sequences' common shape.

    ``max_tokens=None`` means the rest of the context (the scheduler's rule 1 sizes it);
    the server never sends ``None``: ``request.prepare`` resolves an unset budget first.
    ``stop_token_ids`` are the ids a sequence ends on (EOS included, unless the request
    ignores it). ``n`` sequences of the same prompt are a group (the scheduler's rule 10).
    ``priority`` is read only by a policy that orders by it (smaller first).
    ``cache_salt`` is the prefix cache's domain: only equal salts share blocks (rule 9).
    ``score_prompt``: every prompt token after the first gets its log-probability, and
    ``max_tokens`` may be 0 (rule 11).

    The ranges (a priority's bounds, ``n`` against the slots, the budget against the
    context and the pool) are the scheduler's to check: they depend on its
    configuration, and its :class:`~triollm.scheduler.Infeasible` names the field.

    Trap: ``prompt_ids`` and ``stop_token_ids`` are frozen on construction (a tuple, a
    frozenset), so a caller's list changed afterwards cannot change a queued request.
    """

    prompt_ids: tuple[int, ...]
    max_tokens: int | None
    stop_token_ids: frozenset[int]
    n: int
    priority: int
    cache_salt: str
    score_prompt: bool

    def __init__(
        self,
        prompt_ids: Iterable[int],
        max_tokens: int | None = None,
        stop_token_ids: Iterable[int] = frozenset(),
        *,
        n: int = 1,
        priority: int = 0,
        cache_salt: str = "",
        score_prompt: bool = False,
    ) -> None:
        # Written out to take any iterable and freeze it: the callers hold lists, and a
        # frozen message must not share one.
        _set(self, "prompt_ids", tuple(prompt_ids))
        _set(self, "max_tokens", max_tokens)
        _set(self, "stop_token_ids", frozenset(stop_token_ids))
        _set(self, "n", n)
        _set(self, "priority", priority)
        _set(self, "cache_salt", cache_salt)
        _set(self, "score_prompt", bool(score_prompt))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """One request, resolved: everything the layers below the edge need, in one place.

    ``sampling`` is complete (ranges checked by ``SamplingParams``): temperature and
    the truncations, penalties, ``seed``, ``logprobs``, the grammar, ``min_tokens``.
    Choice ``i`` of ``n`` samples with ``seed + i`` (:meth:`choice_sampling`).
    ``max_tokens`` is the answer budget of each choice; ``request.prepare`` never
    leaves it ``None`` (the one rule for an unset budget is its ``answer_budget``).
    ``stop_token_ids`` are the ids the answer ends on: the model's EOS ids (unless the
    client ignored them) and the client's own; ``stop`` the strings (the text side,
    ``textstream.py``), ``include_stop`` keeps a matched one in the text.
    ``score_prompt``: each choice's first delta carries the prompt's log-probabilities
    (echo with logprobs; the scheduler's rule 11). ``priority`` and ``cache_salt`` go
    to the scheduler as they are. ``tool_format``: each choice's text is parsed for
    tool calls in this syntax (None: not parsed). ``skip_special_tokens``: False keeps
    special tokens (chat markers) in the answer's text, as their strings (vLLM's
    field). ``internal``: the warm-up request, left out of the metrics.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int | None
    stop_token_ids: frozenset[int]
    n: int
    stop: tuple[str, ...]
    include_stop: bool
    score_prompt: bool
    priority: int
    cache_salt: str
    tool_format: ToolCallFormat | None
    skip_special_tokens: bool
    internal: bool

    def __init__(
        self,
        prompt_ids: Iterable[int],
        sampling: SamplingParams,
        max_tokens: int | None = None,
        stop_token_ids: Iterable[int] = frozenset(),
        *,
        n: int = 1,
        stop: Iterable[str] = (),
        include_stop: bool = False,
        score_prompt: bool = False,
        priority: int = 0,
        cache_salt: str = "",
        tool_format: ToolCallFormat | None = None,
        skip_special_tokens: bool = True,
        internal: bool = False,
    ) -> None:
        _set(self, "prompt_ids", tuple(prompt_ids))
        _set(self, "sampling", sampling)
        _set(self, "max_tokens", max_tokens)
        _set(self, "stop_token_ids", frozenset(stop_token_ids))
        _set(self, "n", n)
        _set(self, "stop", tuple(stop))
        _set(self, "include_stop", include_stop)
        _set(self, "score_prompt", bool(score_prompt))
        _set(self, "priority", priority)
        _set(self, "cache_salt", cache_salt)
        _set(self, "tool_format", tool_format)
        _set(self, "skip_special_tokens", skip_special_tokens)
        _set(self, "internal", internal)

    @property
    def want_logprobs(self) -> bool:
        """Do the deltas carry each token's log-probability (``sampling.logprobs``)?"""
        return self.sampling.logprobs is not None

    @property
    def min_tokens(self) -> int:
        return self.sampling.min_tokens

    def choice_sampling(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling: ``seed + index`` (vLLM derives its ``n`` seeds
        the same way), so the choices differ and one seed gives the same ``n`` answers
        again. Without a seed every choice draws from the OS's entropy."""
        seed = self.sampling.seed
        if seed is None or index == 0:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=seed + index)

    def sequence(self) -> SequenceSpec:
        """The scheduler's slice."""
        return SequenceSpec(
            self.prompt_ids,
            self.max_tokens,
            self.stop_token_ids,
            n=self.n,
            priority=self.priority,
            cache_salt=self.cache_salt,
            score_prompt=self.score_prompt,
        )
