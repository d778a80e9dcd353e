"""Grammar compilation that cannot hurt anyone else (issue 28, N1/N2).

A grammar is code the client sends us: llguidance recurses once per rule or schema
level while it validates, so a 3,000-rule Lark chain or a 1,000-deep ``$ref`` chain
overflowed the worker thread's stack and the whole server died with SIGSEGV. These
tests drive the same call the server makes (``GrammarCache.get`` in a worker thread)
in a subprocess, so a crash shows as the subprocess's exit status instead of taking
the test run with it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from triollm.model import constrained
from triollm.model.constrained import (
    MAX_GRAMMAR_RULES,
    MAX_PATTERNS_PER_ALLOF,
    MAX_SCHEMA_DEPTH,
    ConstraintTokenizer,
    GrammarCache,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    check_limits,
)
from triollm.model.tokenizer import Tokenizer

DEMO = Path(__file__).resolve().parents[2] / "src" / "triollm" / "demo" / "model"
SRC = Path(__file__).resolve().parents[2] / "src"


def lark_chain(n: int) -> str:
    """``start: r0``, ``r0: "x" r1`` ... ``rn: "y"``: one rule per level."""
    rules = "\n".join(f'r{i}: "x" r{i + 1}' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "y"\n'


def ref_chain(n: int, root: str = "#") -> dict:
    """A schema whose ``$defs`` chain n objects deep through ``$ref`` (``root``: where
    the schema sits in the document its pointers resolve in)."""
    defs = {
        f"d{i}": {
            "type": "object",
            "properties": {"a": {"$ref": f"{root}/$defs/d{i + 1}"}},
            "required": ["a"],
        }
        for i in range(n)
    }
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": f"{root}/$defs/d0"}


def nested(n: int) -> dict:
    """Objects nested n deep through ``properties`` (no refs)."""
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# The three ~75 KB requests of N1, as the server compiles them: in a worker thread.
CRASHERS = """
import json, sys, threading
sys.path.insert(0, {src!r})
sys.path.insert(0, {tests!r})
from test_grammar_limits import lark_chain, ref_chain
from triollm.model.constrained import *
from triollm.model.tokenizer import Tokenizer
from triollm.toolcalls import ToolCallFormat, tool_grammar
tok = Tokenizer.from_dir({demo!r})
cache = GrammarCache(ConstraintTokenizer.from_tokenizer(tok))
# A forced call's grammar embeds the parameters at /properties/arguments.
tool = {{"name": "f", "parameters": ref_chain(1000, "#/properties/arguments")}}
specs = [
    GrammarSpec(GrammarKind.LARK, lark_chain(3000), "guided_grammar"),
    GrammarSpec(GrammarKind.JSON_SCHEMA, ref_chain(1000), "response_format.json_schema.schema"),
    GrammarSpec(GrammarKind.LARK, tool_grammar(ToolCallFormat.HERMES, (tool,), parallel=False,
        marker_token_id=tok.special_token_id, json_options=JSON_OPTIONS), "tools"),
]
out = []
def run():
    for spec in specs:
        try:
            cache.get(spec)
            out.append("compiled")
        except GrammarError as exc:
            out.append(f"{{exc.field}}: {{exc}}")
t = threading.Thread(target=run)
t.start()
t.join()
print(json.dumps(out))
"""


def test_a_grammar_deep_enough_to_overflow_a_thread_stack_is_refused_not_a_crash():
    script = CRASHERS.format(src=str(SRC), tests=str(Path(__file__).parent), demo=str(DEMO))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    # Before the fix: returncode -11 (SIGSEGV) at the first grammar.
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lark, schema, tool = json.loads(proc.stdout.strip().splitlines()[-1])
    assert lark.startswith("guided_grammar: ") and f"{MAX_GRAMMAR_RULES} rules" in lark
    assert schema.startswith("response_format.json_schema.schema: ")
    assert f"{MAX_SCHEMA_DEPTH}" in schema
    assert tool.startswith("tools: ") and f"{MAX_SCHEMA_DEPTH} levels" in tool


# --------------------------------------------------------------------------- the limits


def spec(kind: GrammarKind, source: object) -> GrammarSpec:
    return GrammarSpec(kind, source, "f")


def refused(s: GrammarSpec) -> str:
    with pytest.raises(GrammarError) as info:
        check_limits(s)
    assert info.value.field == "f"
    return str(info.value)


def test_each_limit_is_named_in_the_refusal():
    assert f"{MAX_GRAMMAR_RULES} rules" in refused(
        spec(GrammarKind.LARK, lark_chain(MAX_GRAMMAR_RULES + 1))
    )
    assert f"{MAX_SCHEMA_DEPTH} levels" in refused(
        spec(GrammarKind.JSON_SCHEMA, ref_chain(MAX_SCHEMA_DEPTH))
    )
    deep: dict = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    assert f"{MAX_SCHEMA_DEPTH} levels" in refused(spec(GrammarKind.JSON_SCHEMA, deep))
    many = {
        "type": "string",
        "allOf": [{"pattern": f"^a{{{i}}}"} for i in range(MAX_PATTERNS_PER_ALLOF + 1)],
    }
    assert f"{MAX_PATTERNS_PER_ALLOF} patterns" in refused(spec(GrammarKind.JSON_SCHEMA, many))
    assert "characters" in refused(spec(GrammarKind.REGEX, "a" * (constrained.MAX_REGEX_CHARS + 1)))
    assert "nested" in refused(spec(GrammarKind.REGEX, "(" * 100 + "a" + ")" * 100))


def test_schemas_and_grammars_within_the_limits_pass():
    check_limits(spec(GrammarKind.LARK, lark_chain(MAX_GRAMMAR_RULES - 5)))
    check_limits(spec(GrammarKind.JSON_SCHEMA, ref_chain(MAX_SCHEMA_DEPTH // 4 - 1)))
    # A recursive schema (a tree) is a rule that refers to itself, not an endless chain.
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            }
        },
        "$ref": "#/$defs/node",
    }
    check_limits(spec(GrammarKind.JSON_SCHEMA, tree))


# --------------------------------------------------------------------------- the sandbox


@pytest.fixture(scope="module")
def ctok() -> ConstraintTokenizer:
    return ConstraintTokenizer.from_tokenizer(Tokenizer.from_dir(DEMO))


def test_a_compile_that_overruns_its_time_limit_is_killed_and_refused(ctok, monkeypatch):
    # Stands in for a runaway compile (N2: an allOf of 20 patterns ran 46 s and took
    # 2.3 GB): the sandbox child is told to sleep instead of compiling.
    cache = GrammarCache(ctok, time_limit_s=0.5)
    monkeypatch.setenv("TRIOLLM_GRAMMAR_SANDBOX_TEST_SLEEP_S", "30")
    with pytest.raises(GrammarError) as info:
        cache.get(spec(GrammarKind.REGEX, "[0-9]+"))
    assert "0.5 s" in str(info.value)
    monkeypatch.delenv("TRIOLLM_GRAMMAR_SANDBOX_TEST_SLEEP_S")
    # The next compile gets a fresh child and works.
    assert cache.get(spec(GrammarKind.REGEX, "[0-9]+")) is not None
    cache.close()


def test_a_compile_whose_client_left_is_killed(ctok, monkeypatch):
    cache = GrammarCache(ctok)
    monkeypatch.setenv("TRIOLLM_GRAMMAR_SANDBOX_TEST_SLEEP_S", "30")
    cancel = threading.Event()
    cancel.set()  # the client is already gone
    with pytest.raises(GrammarError, match="cancelled"):
        cache.get(spec(GrammarKind.REGEX, "[a-z]+"), cancel=cancel)
    cache.close()


def test_a_compile_past_the_memory_limit_is_refused(ctok, monkeypatch):
    cache = GrammarCache(ctok, memory_limit_bytes=64 * 1024 * 1024)
    monkeypatch.setenv("TRIOLLM_GRAMMAR_SANDBOX_TEST_ALLOCATE_MIB", "512")
    with pytest.raises(GrammarError, match="MiB"):
        cache.get(spec(GrammarKind.REGEX, "[a-c]+"))
    cache.close()


def test_a_repeated_schema_and_a_repeated_refusal_cost_nothing(ctok):
    cache = GrammarCache(ctok)
    s = spec(GrammarKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "string"}}})
    first = cache.get(s)
    assert cache.get(s) is first and cache.misses == 1 and cache.hits == 1
    bad = spec(GrammarKind.REGEX, "(unclosed")
    for _ in range(2):
        with pytest.raises(GrammarError):
            cache.get(bad)
    assert cache.sandbox_runs == 2  # the good schema and the bad regex, once each
    cache.close()
