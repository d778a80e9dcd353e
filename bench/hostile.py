"""Hostile constraints and prompts against a live server, each beside a neighbour stream.

Issue 28's probes as a generator: JSON Schemas deep through ``$ref`` chains and plain
nesting, wide and recursive schemas, Lark grammars of many rules and deep brackets,
``allOf``s of many patterns, long and deeply bracketed regexes, tools whose
parameters are such schemas, and prompts whose rendering cannot fit (thousands of
empty messages, hundreds of tools). Each probe is sent while a greedy neighbour
stream runs; the result records the probe's answer (a shaped 4xx naming its field,
or a 200 for the legitimate shapes), how long it took, whether the server still
answers ``/health``, whether the neighbour got its usual text, and the neighbour's
largest gap between two events.

``--full`` uses the sizes the issue found (a 1,000-deep ``$ref`` chain, 3,000 rules,
20 patterns); without it, sizes just past each limit (CI: tests/server/test_hostile_grammars.py).
``python bench/hostile.py [--full]`` serves the fixture model in this process and
prints one line per probe; ``bench/soak.py`` runs the full set after its mix.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadkit import FIXTURE_MODEL, Reply, exchange, http_request, reply_text, running_server

NEIGHBOUR_TOKENS = 48
# A liveness bound, not a speed claim: a probe or a neighbour past this is a hang.
LIVENESS_S = 60.0


@dataclass(frozen=True)
class Probe:
    name: str
    path: str
    body: dict[str, Any]
    legitimate: bool = False  # a shape that must be served (200), not refused
    either: bool = False  # served or refused by the context, as the model's template has it


@dataclass(frozen=True)
class ProbeResult:
    probe: Probe
    status: int | None
    error: dict[str, Any] | None
    seconds: float
    alive: bool
    neighbour_ok: bool
    neighbour_gap_s: float  # the neighbour's largest gap between events (incl. the first)

    @property
    def shaped(self) -> bool:
        """A 4xx naming its field (or a 200 for a legitimate shape)."""
        if self.probe.legitimate or (self.probe.either and self.status == 200):
            return self.status == 200
        return (
            self.status is not None
            and 400 <= self.status < 500
            and self.error is not None
            and bool(self.error.get("param") or self.error.get("code"))
        )


def ref_chain(n: int, root: str = "#") -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"{root}/$defs/d{i + 1}"}},
            "required": ["a"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": f"{root}/$defs/d0"}


def nested(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


def lark_chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "x" r{i + 1}' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "y"\n'


def probes(model: str, *, full: bool) -> list[Probe]:
    """The hostile shapes, at the issue's sizes (``full``) or just past each limit."""
    deep, rules, patterns, messages, tools = (
        (1000, 3000, 20, 20_000, 400) if full else (40, 600, 6, 3000, 120)
    )
    chat = {"model": model, "max_tokens": 4, "temperature": 0}
    chat_msgs = chat | {"messages": [{"role": "user", "content": "hi"}]}

    def schema(s: dict[str, Any]) -> dict[str, Any]:
        return chat_msgs | {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}
        }

    def tool(params: dict[str, Any]) -> dict[str, Any]:
        fn = {"name": "f", "parameters": params}
        return chat_msgs | {
            "tools": [{"type": "function", "function": fn}],
            "tool_choice": "required",
        }

    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    brackets = "(" * (200 if full else 80) + "a" + ")" * (200 if full else 80)
    pattern_list = [{"pattern": f"^.*{chr(97 + i % 26)}.{{{i % 5 + 4}}}$"} for i in range(patterns)]
    return [
        Probe("schema: $ref chain", "/v1/chat/completions", schema(ref_chain(deep))),
        Probe("schema: nested arrays", "/v1/chat/completions", schema(nested(deep // 2 + 80))),
        Probe(
            "schema: allOf of patterns",
            "/v1/chat/completions",
            schema({"type": "string", "allOf": pattern_list}),
        ),
        Probe("schema: recursive tree", "/v1/chat/completions", schema(tree), legitimate=True),
        Probe("schema: 300 properties", "/v1/chat/completions", schema(wide), legitimate=True),
        Probe(
            "grammar: rule chain",
            "/v1/chat/completions",
            chat_msgs | {"guided_grammar": lark_chain(rules)},
        ),
        Probe(
            "grammar: deep brackets",
            "/v1/chat/completions",
            chat_msgs
            | {"guided_grammar": f"start: {brackets.replace('a', chr(34) + 'a' + chr(34))}"},
        ),
        Probe(
            "regex: deep brackets", "/v1/chat/completions", chat_msgs | {"guided_regex": brackets}
        ),
        Probe("regex: long", "/v1/chat/completions", chat_msgs | {"guided_regex": "[a-z]" * 2000}),
        Probe(
            "tools: $ref chain",
            "/v1/chat/completions",
            tool(ref_chain(deep, "#/properties/arguments")),
        ),
        Probe("tools: nested parameters", "/v1/chat/completions", tool(nested(deep // 2 + 80))),
        Probe(
            "prompt: empty messages",
            "/v1/chat/completions",
            chat | {"messages": [{"role": "user", "content": ""}] * messages},
        ),
        Probe(
            "prompt: many tools",
            "/v1/chat/completions",
            chat_msgs
            | {
                "tools": [
                    {"type": "function", "function": {"name": f"f{i}", "description": "d" * 300}}
                    for i in range(tools)
                ],
                "tool_choice": "none",  # rendered, not called: the context is the limit
            },
            either=True,  # a template that does not render tools serves it
        ),
    ]


async def neighbour(port: int, model: str) -> Reply:
    body = {
        "model": model,
        "prompt": "The neighbour",
        "max_tokens": NEIGHBOUR_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    return await exchange(port, http_request("/v1/completions", body))


async def run_probe(port: int, model: str, probe: Probe, expected: str) -> ProbeResult:
    """Send ``probe`` while a neighbour streams; see :class:`ProbeResult`."""
    got: dict[str, Any] = {}

    async def side() -> None:
        got["neighbour"] = await neighbour(port, model)

    with trio.fail_after(LIVENESS_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(side)
            await trio.sleep(0.05)  # the neighbour is under way
            start = trio.current_time()
            reply = await exchange(port, http_request(probe.path, probe.body))
            seconds = trio.current_time() - start
        health = await exchange(port, http_request("/health", None, method="GET"))
    n: Reply = got["neighbour"]
    gaps = [g for g in [n.t_first, *n.gaps] if g is not None]
    return ProbeResult(
        probe,
        reply.status,
        reply.error,
        seconds,
        health.status == 200,
        n.status == 200 and reply_text(n) == expected,
        max(gaps, default=0.0),
    )


async def run_all(port: int, model: str, *, full: bool) -> list[ProbeResult]:
    expected = reply_text(await neighbour(port, model))
    return [await run_probe(port, model, p, expected) for p in probes(model, full=full)]


def report(results: list[ProbeResult], out: Any = sys.stdout) -> list[str]:
    """Print one line per probe; return the broken promises."""
    wrong = []
    for r in results:
        err = r.error or {}
        what = f"{r.status} {err.get('code') or ''} param={err.get('param')}".strip()
        print(
            f"  {r.probe.name:28s} {what:58s} {r.seconds * 1000:7.0f} ms; "
            f"neighbour largest gap {r.neighbour_gap_s * 1000:6.0f} ms",
            file=out,
        )
        if not r.shaped:
            wrong.append(f"{r.probe.name}: {what}: {str(err.get('message'))[:200]}")
        if not r.alive:
            wrong.append(f"{r.probe.name}: /health did not answer 200 afterwards")
        if not r.neighbour_ok:
            wrong.append(f"{r.probe.name}: the neighbour did not get its text")
    return wrong


async def main_async(args: argparse.Namespace) -> int:
    async with running_server(args.model, slots=2) as stack:
        await trio.to_thread.run_sync(stack.served.grammars.start)  # as `triollm serve` does
        results = await run_all(stack.port, stack.served.id, full=args.full)
    wrong = report(results)
    for w in wrong:
        print("BROKEN:", w)
    return 1 if wrong else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(FIXTURE_MODEL), help="model directory")
    p.add_argument("--full", action="store_true", help="the issue's sizes")
    return trio.run(main_async, p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
