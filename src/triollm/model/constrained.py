"""Constrained decoding: a grammar decides which tokens may come next, the sampler obeys.

Structured output (``response_format``, the extras ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, and tool calls with ``tool_choice``
``required`` or a named function) all reduce to one mechanism: a grammar, a
*matcher* per sequence that tracks how far the answer has come through it, and
each step a *token mask*, one bit per vocabulary entry, that says which next
tokens keep the answer inside the grammar. Every piece of grammar work is done by
``llguidance`` (the engine llama.cpp and vLLM use): JSON Schema and Lark
compilation, the lexer/parser, the token trie, the parallel mask fill. This
module only connects it to our tokenizer and our step.

Theory of operation, for one constrained sequence in one step (``batch.py``):

1. **Fill** (:meth:`MaskFiller.fill`): the matchers of every constrained sequence
   that samples this step write their masks into one preallocated bitmask,
   ``(rows, ceil(vocab / 32))`` int32, with the GIL released, in a thread of its
   own that runs beside the forward pass. Many rows go through ``llguidance``'s
   parallel executor; a few are filled one after another, which measured faster
   (see :data:`PARALLEL_MIN_ROWS`).
2. **Apply** (:meth:`MaskFiller.apply`): the disallowed logits of that
   sequence's row become ``-inf`` *before* the sampler sees the row, so
   penalties, temperature, top-k/top-p/min-p, the seeded draw and greedy argmax
   all choose among allowed tokens only, and log-probabilities are those of the
   masked distribution (the one the token was drawn from).
3. **Advance** (:meth:`SequenceMatcher.advance`): the sampled token moves the
   matcher on. When no further token can extend the answer the grammar is
   *complete*: the sequence ends with ``stop``.

Unconstrained sequences have no matcher and never touch any of this.

Failure is per sequence. A grammar the library refuses is a
:class:`GrammarError` (the client's fault, with ``.field``) raised when the
request is compiled, before it is queued. A matcher that fails *during*
generation (a parser limit hit, or a token it refuses) raises
:class:`MatcherFailed` for that sequence alone; the others in the step go on.

Replay: a matcher is a function of the tokens generated so far, so one rebuilt
for a sequence that already has tokens (re-added after recompute) is brought up
to date with :meth:`SequenceMatcher.replay` instead of restarting the grammar.

Tests: ``tests/model/test_constrained.py``; the cost per step:
``bench/bench_constrained.py``.
"""

from __future__ import annotations

import enum
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llnp
import numpy as np

from triollm.errors import FieldError
from triollm.model.grammar_sandbox import (
    GrammarSandbox,
    SandboxLimits,
    SandboxRefusal,
    server_thread_stack_bytes,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("triollm.constrained")

# JSON is generated compact but with the separators of Python's json.dumps (", ",
# ": "), the spelling most training data uses. Flexible whitespace (llguidance's
# default) lets a model spend its whole max_tokens on spaces and newlines between
# two keys, which a small model on a CPU will do; one fixed spelling cannot loop.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

# A number's integral digits in every JSON grammar (schemas, json_object, forced tool
# calls): at most 16, as llama.cpp's JSON-schema grammars allow. Left free, a weak
# model can stay inside a valid prefix until max_tokens: SmolLM2 at temperature 0
# wrote "population_millions": 1111111... (issue 26). Written as the exclusive bounds
# -10^16 < x < 10^16 (exact in a double), added to every number and integer of a
# schema that sets no bound of its own (bounded_numbers).
MAX_INTEGRAL_DIGITS = 16
NUMBER_BOUND = 10**MAX_INTEGRAL_DIGITS

# Where a JSON Schema holds further schemas; every other key holds data (const, enum,
# default, examples ...), which is never rewritten.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONES = (
    "items",
    "additionalItems",
    "additionalProperties",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every ``number`` and ``integer`` that sets no bound of its own
    held to :data:`MAX_INTEGRAL_DIGITS` integral digits (a new object: the caller's
    is left as it is).

    Trap: only typed numbers are bounded; a value the schema leaves free (``{}``, or
    an object's additional properties) may still hold any number. The recursion is
    as deep as the schema, which :func:`check_limits` bounds first.
    """
    if isinstance(schema, list):  # a draft-4 tuple of item schemas
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(s) for s in out[key]]
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = bounded_numbers(out[key])
    kind = out.get("type")
    kinds = {kind} if isinstance(kind, str) else set()
    if isinstance(kind, list):
        kinds = {k for k in kind if isinstance(k, str)}
    if kinds & {"number", "integer"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["exclusiveMinimum"] = -NUMBER_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["exclusiveMaximum"] = NUMBER_BOUND
    return out


# response_format json_object: any JSON object, its numbers bounded as a schema's are
# (llguidance's own "any object" leaves them free). A value is an object or a list of
# values, or a scalar.
_VALUE = {"$ref": "#/$defs/value"}
JSON_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": _VALUE,
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "object", "additionalProperties": _VALUE},
                {"type": "array", "items": _VALUE},
                {"type": "string"},
                {
                    "type": "number",
                    "exclusiveMinimum": -NUMBER_BOUND,
                    "exclusiveMaximum": NUMBER_BOUND,
                },
                {"type": "boolean"},
                {"type": "null"},
            ]
        }
    },
}


class GrammarError(FieldError):
    """A grammar refused: past a limit (:func:`check_limits`), or one the constraint
    library refuses (bad regex, unknown Lark rule, a JSON Schema keyword it does not
    implement), or one that failed in the sandbox. ``field`` names the request field it
    came from (the HTTP 400's ``param``); the message is ``'<field>' <reason>``.
    ``remember``: the same grammar would be refused again (not so for a time limit on
    a busy machine, or a client that left), so :class:`GrammarCache` may remember it."""

    def __init__(self, field: str, message: str, *, reason: str = "", remember: bool = True):
        super().__init__(field, message)
        self.reason = reason or message
        self.remember = remember

    @classmethod
    def of(cls, spec: GrammarSpec, reason: str, *, remember: bool = True) -> GrammarError:
        """The refusal of ``spec``: its field, then ``reason``."""
        return cls(spec.field, f"'{spec.field}' {reason}", reason=reason, remember=remember)


class MatcherFailed(RuntimeError):
    """One sequence's matcher failed mid-generation (a parser limit, a refused token).

    The sequence cannot go on under its grammar; the others in the step are unaffected.
    ``str()`` is what the client may read: no grammar internals (they reached clients
    as 1.5 KB error events, issue 26); ``detail`` holds the library's own words, which
    go to the log.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


class GrammarKind(enum.Enum):
    """What a request's constraint is written in."""

    JSON_OBJECT = "json_object"  # any JSON object (response_format json_object)
    JSON_SCHEMA = "json_schema"  # a JSON Schema (response_format json_schema, guided_json)
    REGEX = "regex"  # a regular expression (guided_regex)
    CHOICE = "choice"  # one of a list of strings (guided_choice)
    LARK = "lark"  # a Lark grammar (llguidance's dialect) or a GBNF one (guided_grammar)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A request's constraint as plain data, before compilation.

    ``source`` is the schema (a dict), the regex or Lark text, or the list of choices;
    ``field`` is the request field it came from, for a 400 that names it.
    """

    kind: GrammarKind
    source: Any
    field: str


# --------------------------------------------------------------------------- limits
#
# A grammar is a program the client sends us, compiled by native code that trusts it.
# llguidance recurses once per rule and per schema level while it validates: measured
# on this machine's 8 MiB worker-thread stack, a Lark chain of ~2,000 rules and a
# $ref chain of ~300 objects were enough for SIGSEGV, taking every stream with it
# (issue 28, N1). So the shapes below are refused before anything is compiled, each
# limit named in the 400; whatever they miss, the sandbox (grammar_sandbox.py) meets
# in a child process. The figures (tests/model/test_grammar_limits.py):
# ~4 KiB of stack per Lark rule, ~32 KiB per object level of a $ref chain.

# Lark/GBNF rules in one grammar. 500 rules need ~2 MiB of stack: 4x headroom on the
# server's 8 MiB threads, 2x in the sandbox's half-size stack. llama.cpp's example
# GBNF grammars have 5-60 rules.
MAX_GRAMMAR_RULES = 500
# Characters of a Lark/GBNF grammar (llguidance's own max_grammar_size counts symbols
# after parsing; this bounds the text the parser recurses over first).
MAX_GRAMMAR_CHARS = 64 * 1024
# Characters of a regex (guided_regex, or one JSON Schema "pattern").
MAX_REGEX_CHARS = 4096
# Brackets nested inside one another in a regex or a grammar: the parsers recurse per
# bracket. 64 is far past any hand-written expression.
MAX_NESTING = 64
# Levels of a JSON Schema along any path, counting each object/array of the schema
# and following every $ref into its target (a ref chain is as deep as its unfolding).
# A $ref back to a schema already on the path is recursion (a tree type), a rule
# that refers to itself, and is not followed. 64 levels: ~20 nested objects of
# properties; OpenAI's structured outputs allow 10 levels of nesting.
MAX_SCHEMA_DEPTH = 64
# The schema as JSON text: 128 KiB holds thousands of properties.
MAX_SCHEMA_BYTES = 128 * 1024
# Regexes that must hold at once on one string (an allOf of patterns, plus the
# string's own): their intersection is what grew to 2.3 GB in 46 s at 20 patterns.
MAX_PATTERNS_PER_ALLOF = 4
# The sandbox (grammar_sandbox.py): time and memory one compile may take. A large
# but reasonable schema compiles in well under a second on a 150k vocabulary.
COMPILE_TIME_LIMIT_S = 10.0
COMPILE_MEMORY_LIMIT_BYTES = 512 * 1024 * 1024
# llguidance's own limits (LLParserLimits), applied in the sandbox and the server
# alike. Its defaults, except max_lexer_states (250,000 at 1-2 KB each, up to ~500 MB:
# lowered to fit the memory limit above) and verbose_errors (off: an error message
# goes back to the client and into the log; the grammar's internals need not).
PARSER_LIMITS: dict[str, Any] = {
    "max_lexer_states": 100_000,
    "verbose_errors": False,
}


def _refuse(spec: GrammarSpec, reason: str) -> GrammarError:
    return GrammarError.of(spec, reason)


def _nesting(text: str) -> int:
    """The deepest nesting of (), [] and {} in ``text``, quoted strings skipped."""
    depth = deepest = 0
    quote = ""
    escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch == '"':
            quote = ch
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return deepest


_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][\w-]*(?:\.-?\d+)?\s*(?::|::=)", re.MULTILINE)


def _check_regex(spec: GrammarSpec, regex: str, where: str) -> None:
    if len(regex) > MAX_REGEX_CHARS:
        raise _refuse(
            spec, f"{where}is {len(regex)} characters, past the limit of {MAX_REGEX_CHARS}"
        )
    if _nesting(regex) > MAX_NESTING:
        raise _refuse(spec, f"{where}is nested past the limit of {MAX_NESTING} brackets")


def _check_schema(spec: GrammarSpec, schema: Any) -> None:
    """The schema limits: depth through $refs, size, patterns per allOf."""
    try:
        size = len(json.dumps(schema))
    except (RecursionError, ValueError, TypeError):
        raise _refuse(spec, f"is nested past the limit of {MAX_SCHEMA_DEPTH} levels") from None
    if size > MAX_SCHEMA_BYTES:
        raise _refuse(spec, f"is {size} bytes of JSON, past the limit of {MAX_SCHEMA_BYTES} bytes")
    heights: dict[str, int] = {}  # $ref target -> levels below it, once known

    def resolve(ref: str) -> Any:
        node = schema
        for part in ref[2:].split("/") if ref.startswith("#/") else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if ref.startswith("#") else None

    def too_deep() -> GrammarError:
        return _refuse(
            spec,
            f"is nested past the limit of {MAX_SCHEMA_DEPTH} levels (counting each "
            "object and array of the schema, and the schemas its $refs point to)",
        )

    # Recursion here is bounded by the limit itself: it raises at MAX_SCHEMA_DEPTH.
    def height(node: Any, depth: int, path: frozenset[str]) -> int:
        if depth > MAX_SCHEMA_DEPTH:
            raise too_deep()
        if isinstance(node, list):
            return 1 + max((height(v, depth + 1, path) for v in node), default=0)
        if not isinstance(node, dict):
            return 0
        patterns = []
        if isinstance(node.get("pattern"), str):
            patterns.append(node["pattern"])
        if isinstance(node.get("allOf"), list):
            patterns += [
                p["pattern"]
                for p in node["allOf"]
                if isinstance(p, dict) and isinstance(p.get("pattern"), str)
            ]
        if len(patterns) > MAX_PATTERNS_PER_ALLOF:
            raise _refuse(
                spec,
                f"asks one string to match {len(patterns)} patterns at once (allOf), past "
                f"the limit of {MAX_PATTERNS_PER_ALLOF} patterns",
            )
        for p in patterns:
            _check_regex(spec, p, "holds a pattern that ")
        below = 0
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in path:
            if ref in heights:
                if depth + heights[ref] > MAX_SCHEMA_DEPTH:
                    raise too_deep()
                below = heights[ref]
            else:
                target = resolve(ref)
                if target is not None:
                    heights[ref] = height(target, depth + 1, path | {ref}) + 1
                    below = heights[ref]
        for key, value in node.items():
            if key != "$ref" and isinstance(value, dict | list):
                below = max(below, height(value, depth + 1, path))
        return 1 + below

    height(schema, 1, frozenset())


def check_limits(spec: GrammarSpec) -> None:
    """Refuse ``spec`` (a :class:`GrammarError` naming its field and the limit) when it
    is past a limit above. Cheap and pure Python; run before anything is compiled."""
    source = spec.source
    if spec.kind is GrammarKind.JSON_SCHEMA:
        _check_schema(spec, source)
    elif spec.kind is GrammarKind.REGEX and isinstance(source, str):
        _check_regex(spec, source, "")
    elif spec.kind is GrammarKind.LARK and isinstance(source, str):
        # Schemas embedded in the grammar (%json {...}: forced tool calls are built so)
        # are held to the schema limits; the rest of the text to the grammar's.
        decoder = json.JSONDecoder()
        rest: list[str] = []
        pos = 0
        for found in re.finditer(r"%json\s*", source):
            if found.start() < pos:
                continue  # inside a schema already checked
            try:
                embedded, end = decoder.raw_decode(source, found.end())
            except (ValueError, RecursionError):
                continue  # not JSON: the library's parser will say so
            _check_schema(spec, embedded)
            rest.append(source[pos : found.start()])
            pos = end
        rest.append(source[pos:])
        grammar = "".join(rest)
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise _refuse(
                spec, f"is {len(grammar)} characters, past the limit of {MAX_GRAMMAR_CHARS}"
            )
        rules = len(_RULE.findall(grammar))
        if rules > MAX_GRAMMAR_RULES:
            raise _refuse(spec, f"has {rules} rules, past the limit of {MAX_GRAMMAR_RULES} rules")
        if _nesting(grammar) > MAX_NESTING:
            raise _refuse(spec, f"is nested past the limit of {MAX_NESTING} brackets")


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec`` (not yet checked: :func:`compile_grammar` does)."""
    try:
        if spec.kind is GrammarKind.JSON_OBJECT:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    JSON_OBJECT_SCHEMA, defaults=JSON_OPTIONS
                )
            )
        if spec.kind is GrammarKind.JSON_SCHEMA:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    bounded_numbers(spec.source), defaults=JSON_OPTIONS
                )
            )
        if spec.kind is GrammarKind.REGEX:
            return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
        if spec.kind is GrammarKind.CHOICE:
            # Each choice is a Lark string literal; json.dumps escapes it the way Lark reads.
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.source)
            return str(llguidance.LLMatcher.grammar_from_lark(lark))
        # Lark (llguidance's dialect), or llama.cpp's GBNF, which the library converts.
        return str(llguidance.grammar_from("grammar", spec.source))
    except (ValueError, TypeError) as exc:  # a schema that is not a JSON object
        raise GrammarError.of(spec, f"is not a valid grammar: {exc}") from None


class ConstraintTokenizer:
    """The vocabulary as llguidance sees it: every token's bytes, built once per model.

    Built from the ``tokenizer.json`` text itself (no transformers). ``vocab_size``
    is the width of the model's logits, which may exceed the tokenizer's (padded
    embedding tables): ids past the tokenizer are never allowed. It may also be
    smaller (a tokenizer with added tokens the checkpoint has no rows for): the
    masks then cover the tokenizer (``mask_vocab``) and are cut to the logits.
    ``eos_token_ids`` are the ids that end a complete answer (the model's stop set).
    """

    def __init__(
        self, tokenizer_json: str, *, vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        eos = sorted(eos_token_ids)
        try:
            ll = llguidance.LLTokenizer(
                tokenizer_json, n_vocab=vocab_size, eos_token=eos if eos else None
            )
        except ValueError:  # "vocab size too small": the tokenizer knows more ids
            ll = llguidance.LLTokenizer(tokenizer_json, eos_token=eos if eos else None)
        self.ll = ll
        self.json = tokenizer_json  # the sandbox's children build their own from it
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = vocab_size
        self.mask_vocab: int = ll.vocab_size  # >= vocab_size

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> ConstraintTokenizer:
        """From a :class:`~triollm.model.tokenizer.Tokenizer` (``vocab_size``: the model's)."""
        return cls(
            tokenizer.to_json(),
            vocab_size=vocab_size or tokenizer.vocab_size,
            eos_token_ids=tokenizer.eos_token_ids,
        )


class Grammar:
    """A compiled, validated grammar: immutable, shared by every sequence that uses it.

    :meth:`start` gives each sequence its own matcher (a copy of a prototype built
    at compile time, so the expensive construction happens once, where the caller
    chose to run it: off the event loop).
    """

    def __init__(self, spec: GrammarSpec, tokenizer: ConstraintTokenizer, text: str) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.text = text
        self.mask_vocab = tokenizer.mask_vocab
        # Construction drops the GIL and may take 100+ ms for a large schema.
        self._prototype = llguidance.LLMatcher(
            tokenizer.ll, text, log_level=0, limits=parser_limits()
        )
        if self._prototype.is_error():
            raise GrammarError.of(spec, f"is not supported: {self._prototype.get_error()}")

    def start(self) -> SequenceMatcher:
        """A fresh matcher at the grammar's start, for one sequence."""
        return SequenceMatcher(self._prototype.deep_copy(), self.mask_vocab)


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's resource limits as configured here (:data:`PARSER_LIMITS`)."""
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def compile_grammar(spec: GrammarSpec, tokenizer: ConstraintTokenizer) -> Grammar:
    """Compile and validate ``spec`` against the model's vocabulary.

    Raises :class:`GrammarError` naming ``spec.field`` for anything past a limit
    (:func:`check_limits`) or that the library refuses (it lists unsupported JSON
    Schema keywords by name). Blocking and possibly slow: call it in a worker thread,
    never on the event loop.

    Trap: this compiles in the calling process, so a grammar the limits do not foresee
    can still crash it. A server compiles a client's grammar through
    :meth:`GrammarCache.get`, which runs it in the sandbox first.
    """
    check_limits(spec)
    text = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        text, tokenizer.ll, limits=parser_limits()
    )
    if is_error:
        raise GrammarError.of(spec, f"is not supported: {messages[0].strip()}")
    return Grammar(spec, tokenizer, text)


# Compiled grammars kept per server. A client library sends the same schema with
# every request (the openai client's parse() does); compiling costs 2-10 ms for a
# small schema on SmolLM2's vocabulary (bench/bench_constrained.py) and far more for
# a large one, plus the sandbox's own run. A compiled Grammar is immutable (each
# sequence gets a copy of its matcher), so one may serve every request that asks.
GRAMMAR_CACHE_SIZE = 64
# Refusals remembered, so a client that resends a grammar past a limit costs nothing
# either (only refusals that would come again: not a time limit, not a client that left).
REFUSAL_CACHE_SIZE = 256


class GrammarCache:
    """The last :data:`GRAMMAR_CACHE_SIZE` grammars compiled for one vocabulary.

    :meth:`get` is :func:`compile_grammar` with memory and a sandbox: the same
    constraint (kind and source, whatever field it came in) compiles once, and a
    constraint that is new is first compiled in a child process
    (:class:`~triollm.model.grammar_sandbox.GrammarSandbox`) that may crash, run
    out of memory or be killed without harm. Thread-safe: requests compile in worker
    threads. A refusal is a :class:`GrammarError` naming the field.

    ``sandbox=False`` compiles in this process only (the limits still apply): for
    tools that compile grammars they wrote themselves.
    """

    def __init__(
        self,
        tokenizer: ConstraintTokenizer,
        size: int = GRAMMAR_CACHE_SIZE,
        *,
        sandbox: bool = True,
        time_limit_s: float = COMPILE_TIME_LIMIT_S,
        memory_limit_bytes: int = COMPILE_MEMORY_LIMIT_BYTES,
        workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.size = size
        self._grammars: OrderedDict[tuple[GrammarKind, str], Grammar] = OrderedDict()
        self._refusals: OrderedDict[tuple[GrammarKind, str], str] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._sandbox: GrammarSandbox | None = None
        if sandbox:
            self._sandbox = GrammarSandbox(
                tokenizer.json,
                vocab_size=tokenizer.vocab_size,
                eos_token_ids=sorted(tokenizer.eos_token_ids),
                limits=SandboxLimits(
                    time_limit_s=time_limit_s,
                    memory_limit_bytes=memory_limit_bytes,
                    # Half the server's: what compiled there compiles here with room.
                    stack_bytes=server_thread_stack_bytes() // 2,
                ),
                parser_limits=PARSER_LIMITS,
                workers=workers,
            )

    @property
    def sandbox_runs(self) -> int:
        """Grammars compiled in the sandbox so far (each new one, once)."""
        return self._sandbox.runs if self._sandbox is not None else 0

    def get(self, spec: GrammarSpec, *, cancel: threading.Event | None = None) -> Grammar:
        """The compiled grammar of ``spec`` (blocking on a miss: call it off the loop).

        ``cancel``: set it when the client leaves; a compile in the sandbox is then
        killed within :data:`~triollm.model.grammar_sandbox.POLL_S`."""
        try:
            key = (spec.kind, json.dumps(spec.source, sort_keys=True))
        except (RecursionError, ValueError, TypeError):
            raise _refuse(spec, f"is nested past the limit of {MAX_SCHEMA_DEPTH} levels") from None
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                self.hits += 1
                return grammar
            refusal = self._refusals.get(key)
            if refusal is not None:
                self.hits += 1
                raise GrammarError.of(spec, refusal)
        # Compiled outside the lock: two requests missing at once both compile, and
        # the second result replaces the first (equal grammars; no one waits).
        try:
            grammar = self._compile(spec, cancel)
        except GrammarError as exc:
            if exc.remember:
                self._remember(self._refusals, key, exc.reason, REFUSAL_CACHE_SIZE)
            raise
        with self._lock:
            self.misses += 1
        self._remember(self._grammars, key, grammar, self.size)
        return grammar

    def _compile(self, spec: GrammarSpec, cancel: threading.Event | None) -> Grammar:
        check_limits(spec)
        if self._sandbox is not None:
            text = grammar_text(spec)
            try:
                self._sandbox.check(text, cancel=cancel)
            except SandboxRefusal as exc:
                raise GrammarError.of(spec, str(exc), remember=exc.deterministic) from None
        return compile_grammar(spec, self.tokenizer)

    def _remember(self, table: OrderedDict[Any, Any], key: Any, value: Any, size: int) -> None:
        with self._lock:
            table[key] = value
            table.move_to_end(key)
            while len(table) > size:
                table.popitem(last=False)

    def start(self) -> None:
        """Start a sandbox child ahead of the first grammar (blocking: off the loop)."""
        if self._sandbox is not None:
            self._sandbox.start()

    def close(self) -> None:
        """Stop the sandbox's idle children (they also exit with this process)."""
        if self._sandbox is not None:
            self._sandbox.close()


class SequenceMatcher:
    """Where one sequence stands in its grammar. Not thread-safe: one step at a time.

    Trap: :meth:`advance` only with the token actually sampled for this sequence and
    committed by the scheduler; a token advanced for a step that is then discarded
    puts the matcher one token ahead of the sequence.
    """

    def __init__(self, ll: llguidance.LLMatcher, mask_vocab: int) -> None:
        self.ll = ll
        self.mask_vocab = mask_vocab  # the width of its masks (MaskFiller's vocab_size)
        self.n_consumed = 0

    @property
    def complete(self) -> bool:
        """No token can extend the answer: the grammar is satisfied and the sequence ends."""
        return bool(self.ll.is_stopped()) and not self.ll.is_error()

    def check(self) -> None:
        """Raise :class:`MatcherFailed` if the matcher is in its (permanent) error state."""
        if self.ll.is_error():
            detail = str(self.ll.get_error())
            log.warning("a grammar matcher failed: %s", detail[:2000])
            raise MatcherFailed(
                "the answer's grammar could not go on (the constraint engine stopped)", detail
            )

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token; True when it completed the grammar.

        Raises :class:`MatcherFailed` when the matcher refuses it (it was not allowed:
        a mask was not applied) or fails on it.
        """
        if not self.ll.consume_token(token_id):
            self.check()
            raise MatcherFailed(f"the grammar matcher refused token {token_id}")
        self.n_consumed += 1
        return self.complete

    def replay(self, token_ids: Sequence[int]) -> None:
        """Bring a fresh matcher up to date with tokens the sequence already generated."""
        if self.n_consumed:
            self.ll.reset()
            self.n_consumed = 0
        if token_ids and not self.ll.consume_tokens(list(token_ids)):
            self.check()
            raise MatcherFailed("the grammar matcher refused the replayed tokens")
        self.n_consumed = len(token_ids)


# From this many constrained rows in one step, masks are filled by llguidance's
# parallel executor; below it, one after another on the calling thread. Measured with
# bench/bench_constrained.py on the 2-core test machine (SmolLM2's 49k vocabulary, a
# JSON schema, fresh grammar states each step): at 4 and 16 rows the parallel fill
# took 6-8x longer than filling one at a time (16 rows: ~10 ms against ~1.6 ms), with
# 1 or 2 executor threads alike. vLLM measured its own threshold at 128 requests. On
# a many-core machine, measure with the benchmark and lower it.
PARALLEL_MIN_ROWS = 64


class MaskFiller:
    """Computes and applies the masks of every constrained sequence in a step.

    One per Batch: it owns the bitmask buffer (grown to the widest step seen) and
    llguidance's executor (its thread pool for parallel fills).

    Trap: :meth:`fill` writes into the buffer with the GIL released; nothing may read
    or resize the buffer until it returns.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        threads: int | None = None,
        parallel_min_rows: int = PARALLEL_MIN_ROWS,
    ) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.parallel_min_rows = parallel_min_rows
        self._executor = llguidance.LLExecutor(threads)
        self._mask = llnp.allocate_token_bitmask(1, vocab_size)  # (rows, words) int32

    def fill(self, matchers: Sequence[SequenceMatcher]) -> None:
        """Compute the mask of ``matchers[i]`` into row ``i`` (blocking; GIL released).

        From ``parallel_min_rows`` matchers on, llguidance's executor fills them in
        parallel on its own threads.
        """
        if len(matchers) > self._mask.shape[0]:
            self._mask = llnp.allocate_token_bitmask(len(matchers), self.vocab_size)
        if len(matchers) >= max(2, self.parallel_min_rows):
            llnp.fill_next_token_bitmask_par(
                self._executor, [(m.ll, i) for i, m in enumerate(matchers)], self._mask
            )
            return
        for i, m in enumerate(matchers):
            llnp.fill_next_token_bitmask(m.ll, self._mask, i)

    def allowed(self, row: int) -> np.ndarray:
        """Row ``row``'s mask as booleans, ``(vocab,)``."""
        bits = np.unpackbits(
            self._mask[row].view(np.uint8), bitorder="little", count=self.vocab_size
        )
        return bits.view(np.bool_)

    def apply(self, row: int, logits: np.ndarray) -> None:
        """Set every logit that mask row ``row`` forbids to -inf, in place.

        ``logits`` is one sequence's ``(vocab,)`` float32 row; a mask wider than the
        row (ids the model has no logits for) is cut to it. Raises
        :class:`MatcherFailed` if the mask allows nothing (a matcher in its error
        state fills an empty mask): sampling from it would pick an arbitrary token.
        """
        allowed = self.allowed(row)[: logits.shape[0]]
        if not allowed.any():
            raise MatcherFailed("the grammar allows no next token")
        np.putmask(logits, ~allowed, np.float32(-np.inf))
