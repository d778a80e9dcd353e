"""The memory arithmetic: how big the KV pool is, how long a context, and why.

One owner for the sizing rules that ``triollm serve`` (``server/command.py``'s
``build_stack``) and ``triollm generate`` (``offline.py``'s ``engine_config``) share:

1. **The context** is the model's own ``max_position_embeddings`` (a GGUF's context
   length), unless asked; asking for more than the model's limit, or for less than 2
   positions (a prompt token and an answer), is refused.
2. **The pool** holds every slot's whole context (``slots x ceil(context / block)``
   blocks), so the reserve policy can admit every slot at once with a full
   reservation, but by default at most :data:`DEFAULT_KV_MEMORY_BYTES` of it when the
   context was not asked (a long-context model's slots x context would be tens of
   GiB); or whatever a memory budget holds; or exactly the blocks asked.
3. **The largest admissible request** is ``SchedulerConfig.largest_request``: the
   context, or less when the pool is smaller than one context. The service caps an
   unset ``max_tokens`` with it, ``/v1/models`` reports it as ``max_model_len``, and
   :class:`MemoryReport` prints it.
4. **The defaults** are ``SchedulerConfig``'s own (the server's, each with its
   measured reason beside it); the offline driver overrides one, the prefill chunk
   (:data:`OFFLINE_CHUNK_TOKENS`), for the reason given there.

Pure Python over integers, like the scheduler: a :class:`Capacity` (what the
operator asked, every unset field ``None``) is resolved against two numbers of the
model into a validated :class:`~triollm.scheduler.SchedulerConfig`. Errors are
:class:`~triollm.errors.FieldError` naming the config field; each CLI maps the field
to its flag. Tests: ``tests/test_sizing.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from triollm.errors import FieldError
from triollm.kv import blocks_for
from triollm.policies import Policy, SchedulingPolicy
from triollm.scheduler import SchedulerConfig


class KVDtype(Enum):
    """The KV cache's element type; the value is the CLI spelling (``--kv-cache-dtype``).

    Here, not in ``model/kvstore.py`` (which stores it), because the memory
    arithmetic depends on it and this module stays free of numpy."""

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"
    Q8_0 = "q8_0"


# 16 bits: half the float32 cache and llama.cpp's default size; f16 over bf16
# because its 3 extra mantissa bits measured closer to the float32 cache
# (docs/engine.md) and K/V values of these models stay far below 65504.
DEFAULT_KV_DTYPE = KVDtype.F16

# The default pool budget when the context is the model's own. Qwen2.5's 32768
# positions x 4 slots of f16 K/V are 1.5 GiB (0.5B) to 3.5 GiB (1.5B); Llama-3.1's
# 131072 would be 64 GiB. 2 GiB holds the first whole and leaves a long request room
# in the others (the pool then limits the largest request, and the start-up lines
# say so); --kv-memory, --kv-blocks or --context ask for another size. It was a
# 4096-position context cap, which refused every request of a client that asks for
# max_tokens 4096 (Continue) on a model of 32768 (issue 26).
DEFAULT_KV_MEMORY_BYTES = 2 * 1024**3

# The offline driver's prefill chunk. The server's 128 (SchedulerConfig.chunk_tokens)
# is there to keep other streams' decode stalls short; `triollm generate` serves one
# request with nobody waiting behind it, so it takes the longer chunk and fewer,
# larger prefill steps.
OFFLINE_CHUNK_TOKENS = 512


def default_of(name: str) -> Any:
    """``SchedulerConfig``'s default for field ``name`` (flags show it in their help)."""
    return {f.name: f.default for f in dataclasses.fields(SchedulerConfig)}[name]


@dataclass(frozen=True)
class Capacity:
    """What the operator asked for, before the model is known. ``None``: not asked.

    Unset, the context is rule 1's, the pool rule 2's, and every other field
    ``SchedulerConfig``'s default. At most one of ``num_blocks`` and
    ``kv_memory_bytes`` is given (the CLI makes them exclusive).
    """

    slots: int | None = None
    block_size: int | None = None
    context_tokens: int | None = None
    num_blocks: int | None = None
    kv_memory_bytes: int | None = None
    chunk_tokens: int | None = None
    stall_rows: int | None = None  # None: the chunk (the server sizes it to the model)
    step_rows: int | None = None
    policy: Policy | SchedulingPolicy | None = None
    overtake_limit: int | None = None
    # The server and the engine share full KV blocks between prompts with the same
    # opening (docs/prefix-cache.md); results are bit-identical either way. A bare
    # SchedulerConfig leaves it off. ``--prefix-cache off`` restores the plain pool.
    prefix_cache: bool = True
    # The KV cache's element type (model/kvstore.py): the pool's bytes per position,
    # so how many blocks a --kv-memory budget holds, follow it.
    kv_dtype: KVDtype = DEFAULT_KV_DTYPE

    def resolve(self, max_positions: int, bytes_per_position: int) -> SchedulerConfig:
        """The scheduler config for a model of ``max_positions`` whose K/V takes
        ``bytes_per_position`` bytes per position. Raises :class:`FieldError`
        (``context_tokens``, ``kv_memory_bytes``) or ``SchedulerConfig``'s own
        ``ValueError`` for a knob out of range."""
        context = resolve_context(max_positions, self.context_tokens)
        slots = _or_default(self.slots, "slots")
        block_size = _or_default(self.block_size, "block_size")
        num_blocks = self.num_blocks
        if num_blocks is None and not (slots >= 1 and block_size >= 1):
            num_blocks = 1  # a placeholder: SchedulerConfig refuses slots/block_size by name
        if num_blocks is None and self.kv_memory_bytes is not None:
            num_blocks = self.kv_memory_bytes // (bytes_per_position * block_size)
            if num_blocks < 1:
                raise FieldError(
                    "kv_memory_bytes",
                    f"kv_memory_bytes {self.kv_memory_bytes} holds no block: one block is "
                    f"{block_size} positions x {bytes_per_position} bytes = "
                    f"{block_size * bytes_per_position}",
                )
        if num_blocks is None:
            num_blocks = slots * blocks_for(context, block_size)  # rule 2
            if self.context_tokens is None:  # the model's own context: the default budget
                budget = DEFAULT_KV_MEMORY_BYTES // (bytes_per_position * block_size)
                num_blocks = max(1, min(num_blocks, budget))
        return SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            slots=slots,
            context_tokens=context,
            chunk_tokens=_or_default(self.chunk_tokens, "chunk_tokens"),
            step_rows=_or_default(self.step_rows, "step_rows"),  # its default: chunk + slots
            stall_rows=_or_default(self.stall_rows, "stall_rows"),  # its default: the chunk
            policy=_or_default(self.policy, "policy"),
            overtake_limit=self.overtake_limit,  # None is SchedulerConfig's own "K = slots"
            prefix_cache=self.prefix_cache,
        )


def _or_default(value: Any, name: str) -> Any:
    return default_of(name) if value is None else value


def resolve_context(max_positions: int, context_tokens: int | None) -> int:
    """Rule 1: the context a sequence may reach (prompt + answer)."""
    if context_tokens is None:
        return max_positions
    if context_tokens < 2:
        raise FieldError(
            "context_tokens",
            f"context_tokens must be >= 2 (a prompt token and an answer), got {context_tokens}",
        )
    if context_tokens > max_positions:
        raise FieldError(
            "context_tokens",
            f"context_tokens ({context_tokens}) exceeds the model's max_position_embeddings "
            f"({max_positions})",
        )
    return context_tokens


@dataclass(frozen=True)
class MemoryReport:
    """The startup arithmetic: why the limits are what they are."""

    weight_bytes: int
    kv_bytes_per_position: int
    scheduler: SchedulerConfig
    lines: tuple[str, ...] = field(default=())  # the caller's own lines (queue, step budget)
    kv_dtype: KVDtype = DEFAULT_KV_DTYPE  # the element type kv_bytes_per_position counts

    @property
    def pool_positions(self) -> int:
        return self.scheduler.num_blocks * self.scheduler.block_size

    def _below_slots(self) -> list[str]:
        """A line when the pool cannot hold every slot's whole context at once."""
        s = self.scheduler
        if self.pool_positions >= s.slots * s.context_tokens:
            return []
        return [
            f"the pool holds {self.pool_positions / s.context_tokens:.1f} whole contexts, "
            f"not {s.slots} (slots): long requests wait for room; --kv-memory, "
            "--kv-blocks or --context change it"
        ]

    def describe(self) -> str:
        mib = 1024 * 1024
        s = self.scheduler
        kv_total = self.kv_bytes_per_position * self.pool_positions
        return "\n".join(
            [
                f"weights: {self.weight_bytes / mib:.1f} MiB",
                f"KV cache: {self.kv_bytes_per_position} bytes per position"
                f" ({self.kv_dtype.value} K+V, all layers)",
                f"pool: {s.num_blocks} blocks x {s.block_size} positions = "
                f"{self.pool_positions} positions = {kv_total / mib:.1f} MiB",
                f"slots: {s.slots}; context: {s.context_tokens} positions per sequence",
                f"largest admissible request: prompt + max_tokens <= {s.largest_request} "
                f"positions (min of the context and the pool)",
                *self._below_slots(),
                *self.lines,
            ]
        )
