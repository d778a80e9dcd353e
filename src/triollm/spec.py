"""The frozen request messages: what one request is, once, for every layer below the edge.

A request crosses the layers as one frozen object, never as a list of keyword
arguments re-declared in each signature (CONVENTIONS rule 15). This module holds the
scheduler's slice of it, :class:`SequenceSpec`: the fields that decide admission
and step composition (the prompt, the answer budget, the token ids it ends on, how
many choices, the priority, the prefix-cache salt, whether the prompt is scored).
``Scheduler.add_group``, ``Scheduler.check_group``, ``Scheduler.room`` and
``AdmissionQueue.enqueue`` all take it; a new request feature that the scheduler
must know about adds a field here and nowhere else.

This module imports nothing but the standard library: the pure scheduler imports it,
and the scheduler must not pull in numpy or trio.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SequenceSpec"]


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
    max_tokens: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    n: int = 1
    priority: int = 0
    cache_salt: str = ""
    score_prompt: bool = False

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
        # Written out (not the dataclass's own __init__) to take any iterable and freeze
        # it: the callers hold lists, and a frozen message must not share one.
        object.__setattr__(self, "prompt_ids", tuple(prompt_ids))
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "stop_token_ids", frozenset(stop_token_ids))
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "cache_salt", cache_salt)
        object.__setattr__(self, "score_prompt", bool(score_prompt))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)
