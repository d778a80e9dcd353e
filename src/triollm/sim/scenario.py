"""A batching scenario: the shared constants and the requests, read from JSON or TOML.

The seed's interactive figure (20.3.2) is the default, shipped as
``seed_scenario.json`` beside this file. A scenario names no policy: the simulator
replays the same arrivals under each one.

File shape (JSON; TOML uses the same keys, with ``[[requests]]`` tables)::

    {"slots": 4, "num_blocks": 16, "block_size": 4, "chunk_tokens": 8,
     "step_rows": 12, "context_tokens": 64,
     "requests": [{"name": "A", "arrival": 0, "prompt": 10, "answer": 12}, ...]}

``answer`` is the number of tokens the request generates, ``arrival`` the step at
which it arrives. Optional, per request: ``max_tokens`` (default ``answer``; when
larger, the model says EOS at the ``answer``-th token, but admission reserves
for ``max_tokens``), ``cancel`` (the step at which the client leaves) and
``priority`` (for a policy that orders by it); for the whole scenario:
``overtake_limit``, ``preempt_watermark_blocks`` and ``stall_rows`` (SchedulerConfig's) and
``skip_admission`` (steps at which the loop plans without admitting). These are
what ``triollm check-policy`` writes to replay a counter-example.

Two optional keys make a shared-prefix variant (``triollm simulate
--shared-prefix N`` sets both): ``"shared_prefix": N``, every prompt opens with the
same N tokens (a system prompt; the rest of each prompt is its own), and
``"prefix_cache": true``, the Scheduler's prefix cache shares their full blocks.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from triollm.errors import UserError
from triollm.policies import SchedulingPolicy
from triollm.scheduler import Policy, SchedulerConfig

_INT_FIELDS = ("slots", "num_blocks", "block_size", "chunk_tokens", "step_rows", "context_tokens")


@dataclass(frozen=True, slots=True)
class SimRequest:
    name: str
    arrival: int  # the step it arrives at (0 = before the first step)
    prompt: int  # prompt tokens
    answer: int  # tokens it generates (then EOS, or max_tokens reached)
    max_tokens: int | None = None  # its budget; None: answer
    cancel: int | None = None  # the step at which its client leaves; None: never
    priority: int = 0

    @property
    def budget(self) -> int:
        return self.answer if self.max_tokens is None else self.max_tokens


@dataclass(frozen=True, slots=True)
class Scenario:
    slots: int
    num_blocks: int
    block_size: int
    chunk_tokens: int
    step_rows: int
    context_tokens: int
    requests: tuple[SimRequest, ...]
    source: str = "<built-in seed scenario>"
    shared_prefix: int = 0  # tokens every prompt opens with (the same ones)
    prefix_cache: bool = False  # the Scheduler's prefix cache (rule 9)
    overtake_limit: int | None = None  # K; None: the Scheduler's default (slots)
    preempt_watermark_blocks: int = 1  # the Scheduler's default
    skip_admission: frozenset[int] = frozenset()  # steps that plan without an admission pass
    stall_rows: int | None = None  # prefill rows beside a decoder; None: the chunk

    def config(self, policy: Policy | SchedulingPolicy) -> SchedulerConfig:
        # Unset, stall_rows is not passed: SchedulerConfig owns its default (the chunk).
        stall: dict[str, Any] = {} if self.stall_rows is None else {"stall_rows": self.stall_rows}
        return SchedulerConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            slots=self.slots,
            chunk_tokens=self.chunk_tokens,
            step_rows=self.step_rows,
            context_tokens=self.context_tokens,
            policy=policy,
            prefix_cache=self.prefix_cache,
            overtake_limit=self.overtake_limit,
            preempt_watermark_blocks=self.preempt_watermark_blocks,
            **stall,
        )

    def prompt_ids(self, index: int) -> list[int]:
        """Request ``index``'s token ids: the shared opening, then ids of its own."""
        n = self.requests[index].prompt
        shared = [1 + i % 97 for i in range(min(n, self.shared_prefix))]
        own = [1000 + 100 * index + i for i in range(n - len(shared))]
        return shared + own


def seed_scenario() -> Scenario:
    """The default: 4 slots, blocks of 4, chunks of 8, 12 rows a step, 7 requests."""
    text = resources.files("triollm.sim").joinpath("seed_scenario.json").read_text("utf-8")
    return parse_scenario(json.loads(text), "<built-in seed scenario>")


def load_scenario(path: str | Path) -> Scenario:
    """Read a scenario file (``.json`` or ``.toml``); UserError names the file and field."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise UserError(f"{p}: cannot read the scenario ({exc.strerror})") from None
    try:
        data = tomllib.loads(raw.decode()) if p.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, TOMLDecodeError
        kind = "TOML" if p.suffix == ".toml" else "JSON"
        raise UserError(f"{p}: not valid {kind}: {exc}") from None
    return parse_scenario(data, str(p))


def parse_scenario(data: Any, source: str) -> Scenario:
    if not isinstance(data, dict):
        raise UserError(f"{source}: the scenario must be an object with the keys {_INT_FIELDS}")
    values: dict[str, Any] = {}
    for key in _INT_FIELDS:
        if key == "context_tokens" and key not in data:
            values[key] = data.get("num_blocks", 0) * data.get("block_size", 0)
            continue
        value = data.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserError(f"{source}: field {key!r} must be an integer >= 1, got {value!r}")
        values[key] = value
    shared_prefix = data.get("shared_prefix", 0)
    if not isinstance(shared_prefix, int) or isinstance(shared_prefix, bool) or shared_prefix < 0:
        raise UserError(f"{source}: field 'shared_prefix' must be an integer >= 0")
    prefix_cache = data.get("prefix_cache", False)
    if not isinstance(prefix_cache, bool):
        raise UserError(f"{source}: field 'prefix_cache' must be true or false")
    optional: dict[str, Any] = {}  # the optional fields present, checked
    for key in ("overtake_limit", "preempt_watermark_blocks"):
        if key in data:
            v = data[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{source}: field {key!r} must be an integer >= 0, got {v!r}")
            optional[key] = v
    if "stall_rows" in data:
        v = data["stall_rows"]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UserError(f"{source}: field 'stall_rows' must be an integer >= 1, got {v!r}")
        optional["stall_rows"] = v
    if "skip_admission" in data:
        v = data["skip_admission"]
        if not isinstance(v, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v
        ):
            raise UserError(f"{source}: field 'skip_admission' must be a list of steps >= 0")
        optional["skip_admission"] = frozenset(v)
    unknown = set(data) - {*_INT_FIELDS, *optional, "requests", "shared_prefix", "prefix_cache"}
    if unknown:
        raise UserError(f"{source}: unknown field(s) {sorted(unknown)}")
    raw_requests = data.get("requests")
    if not isinstance(raw_requests, list) or not raw_requests:
        raise UserError(f"{source}: field 'requests' must be a non-empty list")
    requests = []
    for i, r in enumerate(raw_requests):
        where = f"{source}: requests[{i}]"
        if not isinstance(r, dict):
            raise UserError(f"{where} must be an object with arrival, prompt and answer")
        for key, least in (("arrival", 0), ("prompt", 1), ("answer", 1)):
            v = r.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise UserError(f"{where}.{key} must be an integer >= {least}, got {v!r}")
        extra: dict[str, Any] = {}
        optional_fields: tuple[tuple[str, int | None], ...] = (
            ("max_tokens", r["answer"]),
            ("cancel", r["arrival"]),
            ("priority", None),
        )
        for key, floor in optional_fields:
            if key not in r:
                continue
            v = r[key]
            if not isinstance(v, int) or isinstance(v, bool) or (floor is not None and v < floor):
                bound = "an integer" if floor is None else f"an integer >= {floor}"
                raise UserError(f"{where}.{key} must be {bound}, got {v!r}")
            extra[key] = v
        unknown_keys = set(r) - {"name", "arrival", "prompt", "answer", *extra}
        if unknown_keys:
            raise UserError(f"{where}: unknown field(s) {sorted(unknown_keys)}")
        name = str(r.get("name", chr(ord("A") + i) if i < 26 else f"R{i}"))
        requests.append(SimRequest(name, r["arrival"], r["prompt"], r["answer"], **extra))
    if len({r.name for r in requests}) != len(requests):
        raise UserError(f"{source}: request names must be unique")
    scenario = Scenario(
        requests=tuple(requests),
        source=source,
        shared_prefix=shared_prefix,
        prefix_cache=prefix_cache,
        **values,
        **optional,
    )
    try:
        scenario.config(Policy.RESERVE)
    except ValueError as exc:
        raise UserError(f"{source}: {exc}") from None
    return scenario
