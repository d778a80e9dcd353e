"""From what a client asked to what the server runs: one ``prepare`` for every entry point.

The HTTP edge (each API's handler) parses a body into a :class:`GenerationRequest`,
plain values of the client's own words; ``triollm generate`` builds one from its
flags. :class:`Preparer` turns it into the frozen :class:`~triollm.spec.GenerationSpec`
every layer below takes, and it is the one place that:

1. refuses text that cannot fit before tokenizing it (a 7.9 MB prompt against a
   4,096-token context is refused in microseconds);
2. tokenizes the prompt, or renders the chat template (mapping OpenAI's ``developer``
   role onto ``system`` for a template that has no branch for it, as vLLM does), off
   the event loop in :data:`TEXT_LIMITER`'s threads;
3. checks every token id against the vocabulary (the tokenizer's and the model's);
4. compiles the output grammar (``response_format``, ``guided_*``) or the grammar that
   forces a tool call (``tool_choice`` required or named), off the loop, through
   ``model/constrained.py``'s cache;
5. builds the complete :class:`~triollm.model.sampling.SamplingParams` (whose
   constructor owns every range) and the ids the answer ends on (the model's EOS ids,
   :func:`eos_token_ids`, unless the client ignores them, and the client's own);
6. applies the one rule for an unset ``max_tokens`` (:func:`answer_budget`).

Feasibility proper (the prompt and the budget against the context, the pool and the
slots) is the scheduler's ``check_group``, which the admission queue asks before it
queues: its :class:`~triollm.scheduler.Infeasible` names the field.

Errors: a field the client can fix is a :class:`~triollm.errors.FieldError` naming it
(the edge answers 400 with that ``param``); text that cannot fit is ``Infeasible``
(``context_length_exceeded``); a chat template that breaks is :class:`TemplateBroken`,
the server's configuration (500).

The server's modules import the model layer only through this one (the import-layering
test, ``tests/test_layers.py``, holds them to it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import trio

from triollm.errors import FieldError, UserError
from triollm.model.constrained import (
    JSON_OPTIONS,
    GrammarCache,
    GrammarKind,
    GrammarSpec,
    bounded_numbers,
    check_limits,
)
from triollm.model.sampling import SamplingParams
from triollm.model.tokenizer import ChatTemplateError, Tokenizer, TooManyTokens
from triollm.scheduler import Infeasible, Scheduler
from triollm.spec import GenerationSpec, SequenceSpec
from triollm.toolcalls import ToolCallFormat, ToolChoice, Tools, tool_grammar

__all__ = [
    "COMPLETIONS_DEFAULT_MAX_TOKENS",
    "TEXT_LIMITER",
    "ChatMessage",
    "GenerationRequest",
    "GrammarKind",
    "GrammarSpec",
    "Preparer",
    "ServedModel",
    "TemplateBroken",
    "answer_budget",
    "check_limits",
    "eos_token_ids",
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default on /v1/completions (vLLM follows it)

# Threads that tokenize prompts, render chat templates and compile grammars (their own
# pool: the batch loop's step thread must never wait behind them for trio's default
# limiter).
TEXT_LIMITER = trio.CapacityLimiter(2)


class TemplateBroken(Exception):
    """The served model's chat template failed to render: the server's configuration,
    not the request (HTTP 500, ``chat_template_error``)."""


# --------------------------------------------------------------------------- what the client asked


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One message as the chat template gets it. ``tools`` holds a message's tool
    fields (``tool_calls``, ``tool_call_id``, ``name``), already shaped for the
    template (``server/structured.py``)."""

    role: str
    content: str
    tools: tuple[tuple[str, Any], ...] = ()

    def for_template(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content, **dict(self.tools)}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One validated request, completion or chat, with every field resolved.

    Exactly one of ``prompt_text`` / ``prompt_ids`` / ``messages`` is set.
    ``max_tokens`` None means "until a stop or the end of the context".
    ``logprobs`` None means no log-probabilities; an int is the number of
    alternatives per token (0 = only the chosen token's).
    """

    kind: Literal["completion", "chat"]
    model: str | None  # None: the client left it out and means the served model
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None  # the output constraint (response_format, guided_*)
    tools: Tools | None = None  # chat: the functions the model may call, and how
    cache_salt: str = ""  # the prefix cache's domain: only equal salts share K/V blocks
    priority: int = 0  # vLLM's extension: smaller is served earlier (the scheduler owns the range)
    # vLLM's stop extensions (textstream.py owns the text side, batch.py the sampling)
    stop_token_ids: tuple[int, ...] = ()  # end the answer like EOS (even with ignore_eos)
    min_tokens: int = 0  # no stop id or stop string ends the answer before this many tokens
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text
    echo: bool = False  # completions: the answer's text starts with the prompt's
    n: int = 1  # choices: answers to the one prompt, sampled apart (choice i: seed + i)
    # chat: further variables for the chat template (vLLM's chat_template_kwargs), as
    # (name, JSON value) pairs; the tokenizer refuses the names it sets itself
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    # chat: assistant prefill (vLLM's continue_final_message): the answer continues the
    # final assistant message's text instead of starting a new turn; the generation
    # prompt (the template's assistant header) is then off
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's truncate_prompt_tokens: keep only the prompt's last k tokens (-1: as many as
    # the context holds); None: a prompt that cannot fit is refused, never cut
    truncate_prompt_tokens: int | None = None
    # vLLM's skip_special_tokens: False keeps special tokens (chat markers) in the text
    skip_special_tokens: bool = True
    # vLLM's prompt_logprobs: each prompt token's log-probability and the k likeliest
    # tokens at its place, beside the answer (None: not asked)
    prompt_logprobs: int | None = None
    # The body's fields that no table here lists: the edge logs each name once
    # (apifields.UnknownFields); they change nothing.
    unknown: tuple[str, ...] = ()

    @property
    def scores_prompt(self) -> bool:
        """Does the echoed answer need the prompt's log-probabilities? ``echo`` with
        ``logprobs`` (what lm-eval's loglikelihood tasks send), or ``echo`` with
        ``max_tokens`` 0: the answer is the prompt alone (Scheduler rule 11)."""
        return self.echo and (self.logprobs is not None or self.max_tokens == 0)

    @property
    def scores(self) -> bool:
        """Is the prompt scored at all: for the echo, or for ``prompt_logprobs``?"""
        return self.scores_prompt or self.prompt_logprobs is not None


# --------------------------------------------------------------------------- the model served


@dataclass
class ServedModel:
    """What the edge and :class:`Preparer` know about the model being served."""

    id: str
    tokenizer: Tokenizer
    context_tokens: int  # the largest request admitted (SchedulerConfig.largest_request)
    created: int
    # The ids an answer ends on unless the client ignores EOS (eos_token_ids()).
    eos_token_ids: frozenset[int] = frozenset()
    # The model's embedding rows (config.vocab_size). A tokenizer may know more ids
    # (added tokens past the checkpoint's vocabulary); such an id must be refused
    # here, or the forward pass it reaches fails for every request in the step.
    model_vocab_size: int | None = None
    # Structured output: the compiled grammars, over the vocabulary as the grammar
    # library sees it (model/constrained.GrammarCache), built once at startup.
    grammars: GrammarCache | None = None
    # How this model writes tool calls: --tool-call-parser, else read from its chat
    # template (toolcalls.detect_format); None: requests with tools are refused.
    tool_format: ToolCallFormat | None = None

    @property
    def vocab_limit(self) -> int:
        """Token ids must be below this: min(tokenizer vocabulary, model vocabulary)."""
        tok = int(self.tokenizer.vocab_size)
        return tok if self.model_vocab_size is None else min(tok, self.model_vocab_size)


def _too_long(exc: TooManyTokens, param: str) -> Infeasible:
    """A text the tokenizer refused part-way (``Tokenizer.at_least_tokens``): the
    context's 400 (``context_length_exceeded``)."""
    return Infeasible(param, f"'{param}': {exc} (this server's maximum context length)")


def eos_token_ids(tokenizer: Any, config: Any) -> frozenset[int]:
    """The ids that end an answer on their own: the tokenizer's EOS ids and the model
    config's (``generation_config.json`` often names more than the tokenizer does).
    The one owner of that union: the server and ``triollm generate`` both ask here."""
    return frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)


def answer_budget(
    requested: int | None, room: int, *, configured: int | None, api_default: int | None
) -> int | None:
    """The one rule for ``max_tokens``: what the client asked for, if it asked.

    Left out, it is the server's configured default (``--max-tokens-default``), else
    the API's own (``api_default``: 16 on /v1/completions, none on chat), capped by
    ``room``, the largest budget every choice can have at once
    (``Scheduler.room``): "the rest of the context" must also fit the pool, or with a
    pool smaller than slots x context every request without ``max_tokens`` (the chat
    default) would be refused. With no room at all (``room < 1``) it is left to the
    configured default or ``None``, so the scheduler's refusal names the limit the
    prompt breaks, not a budget the client never gave.
    """
    if requested is not None:
        return requested
    if room < 1:
        return configured
    wanted = configured if configured is not None else api_default
    return room if wanted is None else min(wanted, room)


# --------------------------------------------------------------------------- prepare


class Preparer:
    """Turns :class:`GenerationRequest` values into :class:`GenerationSpec` values for one
    served model and one scheduler (see the module docstring for the steps).

    ``max_tokens_default``: the server's ``--max-tokens-default`` (None: the API's
    default, else the room left); ``generate_default``: the budget of an unset
    ``max_tokens`` when the API has none (``triollm generate`` gives its own).
    """

    def __init__(
        self,
        model: ServedModel,
        scheduler: Scheduler,
        *,
        max_tokens_default: int | None = None,
        generate_default: int | None = None,
    ) -> None:
        self.model = model
        self.scheduler = scheduler
        self.max_tokens_default = max_tokens_default
        self.generate_default = generate_default

    # -- the async shell (the edge) --------------------------------------------------

    async def prepare(self, req: GenerationRequest) -> GenerationSpec:
        """The request's spec. Tokenizing, the chat template and a grammar's compile run
        in worker threads: a long prompt or a large schema must not stall every other
        stream's event loop (tests/server/test_hostile_input.py)."""
        self.check_before_tokenizing(req)
        prompt_ids = await trio.to_thread.run_sync(self.prompt_ids, req, limiter=TEXT_LIMITER)
        tool_format = self.tool_format(req)
        constraint = self.constraint(req, tool_format)
        grammar = None
        if constraint is not None:
            # A grammar refused is a GrammarError (a FieldError): 400. A client that
            # leaves meanwhile sets `cancel`: its compile's sandbox child is killed.
            cancel = threading.Event()
            try:
                grammar = await trio.to_thread.run_sync(
                    partial(self._grammars().get, constraint, cancel=cancel),
                    abandon_on_cancel=True,
                )
            finally:
                cancel.set()
        return self.spec(req, prompt_ids, grammar, tool_format)

    async def tokenize(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids alone (``/tokenize``): the same checks and thread."""
        self.check_before_tokenizing(req)
        return await trio.to_thread.run_sync(self.prompt_ids, req, limiter=TEXT_LIMITER)

    async def decode(self, token_ids: Iterable[int]) -> str:
        """Token ids back to text (``/detokenize``, an echoed prompt), off the loop."""
        ids = list(token_ids)
        return await trio.to_thread.run_sync(self.model.tokenizer.decode, ids, limiter=TEXT_LIMITER)

    # -- the sync core (also ``triollm generate``'s) ------------------------------------

    def prepare_now(self, req: GenerationRequest) -> GenerationSpec:
        """:meth:`prepare` in this thread, for a caller with no event loop."""
        self.check_before_tokenizing(req)
        prompt_ids = self.prompt_ids(req)
        tool_format = self.tool_format(req)
        constraint = self.constraint(req, tool_format)
        grammar = None if constraint is None else self._grammars().get(constraint)
        return self.spec(req, prompt_ids, grammar, tool_format)

    def check_before_tokenizing(self, req: GenerationRequest) -> None:
        self._refuse_text_that_cannot_fit(req)
        limit = self.model.vocab_limit
        bad = [t for t in req.stop_token_ids if t >= limit]
        if bad:
            raise FieldError(
                "stop_token_ids",
                f"'stop_token_ids' holds token id {bad[0]}, past the model's vocabulary of {limit}",
            )

    def _refuse_text_that_cannot_fit(self, req: GenerationRequest) -> None:
        """Refuse, before tokenizing, text that holds more tokens than the largest request.

        One token stands for at most ``max_chars_per_token`` characters, so a text of n
        characters is at least n / that many tokens; half that is taken as the bound,
        a margin for normalizers that merge characters. A prompt to be truncated is
        exempt: only its tokens say how much is cut (the body limit bounds its text)."""
        model = self.model
        if req.truncate_prompt_tokens is not None:
            return
        if req.prompt_text is not None:
            chars, param = len(req.prompt_text), "prompt"
        elif req.messages is not None:
            chars, param = sum(len(m.content) for m in req.messages), "messages"
        else:
            return
        per_token = 2 * int(getattr(model.tokenizer, "max_chars_per_token", 0) or 0)
        if per_token <= 0:
            return
        at_least = chars // per_token
        if at_least >= model.context_tokens:
            raise Infeasible(
                param,
                f"'{param}' is {chars} characters, at least {at_least} tokens (one token is at "
                f"most {per_token // 2} characters), past this server's maximum context length "
                f"of {model.context_tokens} tokens",
            )

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids: given, encoded, or rendered through the chat template;
        each checked against the vocabulary."""
        model = self.model
        tokenizer = model.tokenizer
        limit = model.vocab_limit
        # A prompt to be truncated is tokenized whole; any other is refused part-way
        # once it certainly holds more tokens than the context.
        cap = None if req.truncate_prompt_tokens is not None else model.context_tokens
        if req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            what = "holds token id"
        elif req.prompt_text is not None:
            try:
                ids = list(tokenizer.encode(req.prompt_text, limit=cap))
            except TooManyTokens as exc:
                raise _too_long(exc, "prompt") from None
            what = "encodes to token id"
        else:
            assert req.messages is not None
            ids = self._render_chat(req, cap)
            what = "encodes to token id"
        if req.truncate_prompt_tokens is not None:
            keep = req.truncate_prompt_tokens
            ids = ids[-(model.context_tokens if keep == -1 else keep) :]  # vLLM keeps the end
        bad = [t for t in ids if not 0 <= t < limit]
        if bad:
            param = "messages" if req.messages is not None else "prompt"
            raise FieldError(
                param,
                f"'{param}' {what} {bad[0]}, past the model's vocabulary of {limit} "
                f"(tokenizer {tokenizer.vocab_size}, model {model.model_vocab_size})",
            )
        return ids

    def _render_chat(self, req: GenerationRequest, cap: int | None) -> list[int]:
        assert req.messages is not None
        tokenizer = self.model.tokenizer
        messages = [m.for_template() for m in req.messages]
        # A template without a 'developer' branch would drop or refuse that message;
        # OpenAI's developer role is the system role of older templates (as vLLM maps it).
        if "developer" not in getattr(tokenizer, "chat_templates", {}).get("default", ""):
            for message in messages:
                if message.get("role") == "developer":
                    message["role"] = "system"
        tools = list(req.tools.definitions) if req.tools is not None else None
        prefill: dict[str, bool] = {}  # only when asked: a test's tokenizer may not know them
        if not req.add_generation_prompt:
            prefill["add_generation_prompt"] = False
        if req.continue_final_message:
            prefill["continue_final_message"] = True
        try:
            return list(
                tokenizer.encode_chat(
                    messages,
                    tools=tools,
                    template_kwargs=dict(req.template_kwargs),
                    limit=cap,
                    **prefill,
                )
            )
        except TooManyTokens as exc:
            raise _too_long(exc, "messages") from None
        except FieldError:  # a template variable the server sets itself
            raise
        except UserError as exc:
            raise FieldError("messages", str(exc)) from None
        except ChatTemplateError as exc:
            raise TemplateBroken(
                f"{exc} (a server configuration problem: the served model's chat template "
                "is broken; the request itself may be fine)"
            ) from None

    def tool_format(self, req: GenerationRequest) -> ToolCallFormat | None:
        """The format to parse tool calls in, or None when the request's calls are not
        parsed (no tools, or ``tool_choice: none``).

        The model's own syntax when it has one. Without one, a forced call (``required``
        or a named function) is constrained to the call's JSON alone (the ``json``
        format: vLLM forces calls on any model so); ``auto`` is refused, since the model
        would write its calls, if any, as text the client cannot act on."""
        if req.tools is None or req.tools.choice is ToolChoice.NONE:
            return None
        if self.model.tool_format is not None:
            return self.model.tool_format
        if req.tools.forced():
            return ToolCallFormat.JSON
        raise FieldError(
            "tools",
            "this model's chat template shows no tool-call format this server reads "
            f"({', '.join(f.value for f in ToolCallFormat if f is not ToolCallFormat.JSON)})"
            ", so 'auto' cannot tell a call from text: start the server with "
            "--tool-call-parser to name one, or force a call with tool_choice 'required' "
            "or a named function",
        )

    def constraint(
        self, req: GenerationRequest, tool_format: ToolCallFormat | None
    ) -> GrammarSpec | None:
        """The grammar the answer must follow: the request's own, or, for ``tool_choice``
        ``required`` or a named function, one that forces a call in the model's syntax
        (markers by token id, arguments held to each tool's schema, numbers bounded)."""
        forced = req.tools.forced() if req.tools is not None else ()
        if not forced:
            return req.grammar
        assert req.tools is not None and tool_format is not None  # tool_format() said so
        tokenizer = self.model.tokenizer
        marker_id = getattr(tokenizer, "added_token_id", None) or tokenizer.special_token_id
        functions = [
            {**f, "parameters": bounded_numbers(f.get("parameters") or {"type": "object"})}
            for f in forced
        ]
        lark = tool_grammar(
            tool_format,
            functions,
            parallel=req.tools.parallel and req.tools.choice is ToolChoice.REQUIRED,
            marker_token_id=marker_id,
            json_options=JSON_OPTIONS,
        )
        return GrammarSpec(GrammarKind.LARK, lark, "tools")

    def _grammars(self) -> GrammarCache:
        if self.model.grammars is None:
            raise FieldError("response_format", "this server compiles no output grammars")
        return self.model.grammars

    def spec(
        self,
        req: GenerationRequest,
        prompt_ids: Iterable[int],
        grammar: Any,
        tool_format: ToolCallFormat | None,
    ) -> GenerationSpec:
        """The spec from a request whose prompt is tokenized and grammar compiled. A
        sampling value out of range raises ``SamplingParams``' FieldError (the one owner
        of the ranges)."""
        ids = tuple(prompt_ids)
        sampling = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            grammar=grammar,
            min_tokens=req.min_tokens,
        )
        # stop_token_ids end the answer like EOS, also with ignore_eos (as in vLLM).
        eos = frozenset() if req.ignore_eos else self.model.eos_token_ids
        api_default = self.generate_default
        if req.kind == "completion" and api_default is None:
            # OpenAI's default; a min_tokens above it raises it (the client asked for that many).
            api_default = max(COMPLETIONS_DEFAULT_MAX_TOKENS, req.min_tokens)
        room = self.scheduler.room(SequenceSpec(ids, n=max(req.n, 1)))
        budget = answer_budget(
            req.max_tokens, room, configured=self.max_tokens_default, api_default=api_default
        )
        return GenerationSpec(
            ids,
            sampling,
            budget,
            eos | frozenset(req.stop_token_ids),
            n=req.n,
            stop=req.stop,
            include_stop=req.include_stop_str_in_output,
            score_prompt=req.scores,
            priority=req.priority,
            cache_salt=req.cache_salt,
            tool_format=tool_format,
            skip_special_tokens=req.skip_special_tokens,
        )
