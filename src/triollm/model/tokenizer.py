"""Text <-> token ids for a Hugging Face model directory, and chat templates.

A checkpoint's tokenizer lives in three places, and a server has to read all three
the way ``transformers`` does or it silently feeds the model a different prompt than
the one the model was trained on:

- ``tokenizer.json``: the whole pipeline (normalizer, pre-tokenizer, model, decoder),
  run by the Rust ``tokenizers`` library. We never re-implement any of it.
- ``tokenizer_config.json``: which strings are BOS/EOS (a string, or an ``AddedToken``
  dict with a ``content`` field), whether BOS is prepended (``add_bos_token``), and the
  ``chat_template`` (a jinja2 string, or a list of ``{"name", "template"}``; newer
  checkpoints keep it in ``chat_template.jinja`` beside it, which wins).
- ``config.json`` / ``generation_config.json``: more EOS ids (``eos_token_id``, an int or
  a list). Instruct models often stop on an id that the tokenizer config does not name
  (Llama 3's ``<|eot_id|>``), so the stop set is the union of all of them.

Chat templates are code shipped with a download. They run in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute access to ``__class__`` and friends, no
mutation of the messages passed in) with the same helpers ``transformers`` provides
(``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``), so a
template written for the Hub renders the same text here.

The second half of this module is :class:`IncrementalDetokenizer`, which turns a stream
of generated ids into a stream of complete characters. Tests:
``tests/model/test_tokenizer.py``, ``tests/model/test_detok.py``.
"""

from __future__ import annotations

import contextvars
import json
import os
import re
import time
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from triollm.errors import FieldError, ModelLoadError, UserError

REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode prints for an incomplete character


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """The parsed JSON object at ``path``, None when it is absent and optional.

    Trap: a file that exists but is broken is always an error, even when optional:
    silently ignoring a corrupt ``tokenizer_config.json`` would drop the BOS and the chat
    template and produce plausible-looking garbage.
    """
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path}: file not found (the tokenizer needs it)")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: broken JSON at line {exc.lineno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_string(value: object, path: Path, field: str) -> str | None:
    """A special-token field as its text: a string, or an AddedToken dict's ``content``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise ModelLoadError(
        f"{path}: field {field!r} must be a string or an object with a 'content' string, "
        f"got {value!r}"
    )


def _id_list(value: object, path: Path, field: str) -> list[int]:
    """An ``eos_token_id``-style field (absent, an int, or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ModelLoadError(f"{path}: field {field!r} must be an int or a list of ints, got {value!r}")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    Some templates mark the assistant's text with this tag (transformers uses it to build
    a training mask). Without the extension such a template does not even compile; for
    inference the body is all that matters.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2's API is a class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class TemplateRefusal(jinja2.exceptions.TemplateError):
    """The template called ``raise_exception``: it refuses *these messages* (the client's
    problem, a 400). Any other failure of a template is the model's (see ChatTemplateError)."""


class ChatTemplateError(Exception):
    """The model's chat template failed (it crashed, tried an unsafe operation, or ran
    past its time or size bound). A server configuration problem, not the client's:
    the HTTP edge answers 500 ``chat_template_error``, and the start-up probe reports it."""


class TooManyTokens(UserError):
    """A text holds more tokens than ``limit`` for certain, found before tokenizing it
    (:meth:`Tokenizer.at_least_tokens`). ``at_least`` is the bound, ``size_bytes`` the
    text's UTF-8 size: the HTTP edge answers 400 ``context_length_exceeded``."""

    def __init__(self, at_least: int, limit: int, size_bytes: int, per_token: int) -> None:
        super().__init__(
            f"the prompt as rendered is {size_bytes} bytes, at least {at_least} tokens (one "
            f"token of this model stands for at most {per_token} bytes), past the limit of "
            f"{limit} tokens"
        )
        self.at_least = at_least
        self.limit = limit


def _raise_exception(message: str) -> None:
    # Templates call this to refuse a conversation ("roles must alternate ...").
    raise TemplateRefusal(message)


# Bounds on one rendering (a template is code shipped with a download: a loop over
# range(3000) x range(3000) or "x" * 10**9 must not hold the server). Operations are
# counted at every call, attribute/item access, range() step and output piece.
RENDER_TIME_LIMIT_S = 2.0
RENDER_OPERATION_LIMIT = 1_000_000
RENDER_OUTPUT_LIMIT_CHARS = 16 * 1024 * 1024


class _RenderBudget:
    def __init__(self, output_limit: int) -> None:
        self.deadline = time.monotonic() + RENDER_TIME_LIMIT_S
        self.operations = 0
        self.output_limit = output_limit

    def tick(self, n: int = 1) -> None:
        self.operations += n
        if self.operations > RENDER_OPERATION_LIMIT:
            raise ChatTemplateError(
                f"the chat template ran past {RENDER_OPERATION_LIMIT} operations in one rendering"
            )
        if self.operations % 1024 < n and time.monotonic() > self.deadline:
            raise ChatTemplateError(
                f"the chat template ran past {RENDER_TIME_LIMIT_S:g} s in one rendering"
            )


_budget: contextvars.ContextVar[_RenderBudget | None] = contextvars.ContextVar(
    "triollm_render_budget", default=None
)


def _tick(n: int = 1) -> None:
    budget = _budget.get()
    if budget is not None:
        budget.tick(n)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with every call, lookup and ``*``/``**`` counted against the budget."""

    intercepted_binops = frozenset({"*", "**"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        size = None
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    size = len(seq) * n
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            size = max(right, 0) * abs(left).bit_length() // 8  # bytes of the power
        if size is not None and size > RENDER_OUTPUT_LIMIT_CHARS:
            raise ChatTemplateError(
                f"the chat template built a value of ~{size} items, past the limit of "
                f"{RENDER_OUTPUT_LIMIT_CHARS}"
            )
        return super().call_binop(context, operator, left, right)


def _bounded_range(*args: int) -> Iterable[int]:
    r = range(*args)
    if len(r) > jinja2.sandbox.MAX_RANGE:
        raise ChatTemplateError(
            f"the chat template asked for range() of {len(r)} items, past the sandbox's "
            f"{jinja2.sandbox.MAX_RANGE}"
        )
    for i in r:
        _tick()
        yield i


# Names jinja gives a meaning inside templates (a variable by that name would shadow it).
_JINJA_RESERVED = frozenset({"self", "loop", "super", "caller", "varargs", "kwargs", "context"})

# The conversation rendered at load: a template that cannot render it is broken.
PROBE_CONVERSATION = ({"role": "user", "content": "Hello"},)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes '<' and '&' (it is meant for <script> tags): a tool
    # schema rendered that way is not what the model saw in training.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox with the helpers Hub templates expect.

    ``trim_blocks``/``lstrip_blocks`` match transformers, so ``{% if %}`` lines do not leave
    stray newlines in the prompt. Raises ``jinja2.TemplateSyntaxError`` for a broken
    template (the caller turns it into a ModelLoadError naming the file).
    """
    env = _BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    return env.from_string(source)


class Tokenizer:
    """A model directory's tokenizer: encode, decode, and chat templates.

    Build it with :meth:`from_dir`. ``eos_token_ids`` is the full stop set (tokenizer
    config + config.json + generation_config.json); ``add_bos`` says whether
    :meth:`encode` prepends ``bos_token_id``.

    Trap: ``encode`` never adds BOS to text that already starts with it (a rendered chat
    template usually does), so ``encode(apply_chat_template(m))`` has exactly one BOS.
    """

    def __init__(
        self,
        hf: _HFTokenizer,
        *,
        bos_token: str | None,
        eos_tokens: Iterable[str],
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_templates: Mapping[str, str],
        special_token_strings: Mapping[str, str],
        byte_fallback: bool = False,
        source: str = "",
    ) -> None:
        self._hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token: str | None = bos_token
        self.bos_token_id: int | None = None if bos_token is None else hf.token_to_id(bos_token)
        eos_strings = list(eos_tokens)  # iterated twice below: a generator would run dry
        eos_ids = set(eos_token_ids)
        for tok in eos_strings:
            tid = hf.token_to_id(tok)
            if tid is not None:
                eos_ids.add(tid)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.eos_token: str | None = eos_strings[0] if eos_strings else None
        self.add_bos: bool = bool(add_bos and self.bos_token_id is not None)
        self.chat_templates: dict[str, str] = dict(chat_templates)
        self._compiled: dict[str, jinja2.Template] = {}
        self._special_strings = dict(special_token_strings)
        self._source = source
        # Why the chat template failed its probe at load (None: it works, or there is none).
        self.chat_template_problem: str | None = None
        # The special (control) tokens' strings, and a copy of the pipeline that reads
        # them as plain text: user-written text must never become a control token.
        self._control_strings = sorted(
            {a.content for a in hf.get_added_tokens_decoder().values() if a.special},
            key=len,
            reverse=True,
        )
        self._control_re = (
            re.compile("|".join(re.escape(c) for c in self._control_strings))
            if self._control_strings
            else None
        )
        self._plain: _HFTokenizer | None = None
        self._max_chars: int | None = None
        self._max_bytes: int | None = None
        self._normal: tuple[str | None, int] | None = None
        # Ids that decode(skip_special_tokens=True) drops: the detokenizer skips them too.
        self.special_token_ids: frozenset[int] = frozenset(
            tid for tid, added in hf.get_added_tokens_decoder().items() if added.special
        )
        # Every added token by its text, special or not. Qwen's `<tool_call>` is an
        # added token that is *not* special (GGUF type 4; transformers marks it
        # non-special too): a grammar must still name it by id (issue 26).
        self._added_ids: dict[str, int] = {
            added.content: tid for tid, added in hf.get_added_tokens_decoder().items()
        }
        # Ids of "<0xNN>" byte tokens when the decoder groups them (SentencePiece byte
        # fallback). Empty for byte-level BPE, whose bytes are ordinary tokens.
        self.byte_fallback_ids: frozenset[int] = (
            frozenset(
                tid
                for text, tid in hf.get_vocab(with_added_tokens=False).items()
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">")
            )
            if byte_fallback
            else frozenset()
        )

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` and its companions from a model directory.

        Raises :class:`~triollm.errors.ModelLoadError` naming the file and the field for a
        missing ``tokenizer.json``, broken JSON anywhere, a special token that is not in
        the vocabulary, or a chat template that does not compile.
        """
        d = Path(model_dir)
        if not d.is_dir():
            raise ModelLoadError(f"{d}: not a directory")
        tok_path = d / "tokenizer.json"
        tok_json = _read_json(tok_path, required=True) or {}
        try:
            hf = _HFTokenizer.from_file(str(tok_path))
        except Exception as exc:  # the Rust side raises a bare Exception subclass
            raise ModelLoadError(
                f"{tok_path}: not a tokenizer the tokenizers library reads: {exc}"
            ) from None

        cfg_path = d / "tokenizer_config.json"
        cfg = _read_json(cfg_path, required=False) or {}
        model_cfg_path = d / "config.json"
        model_cfg = _read_json(model_cfg_path, required=False) or {}
        gen_cfg_path = d / "generation_config.json"
        gen_cfg = _read_json(gen_cfg_path, required=False) or {}

        special: dict[str, str] = {}
        for field in ("bos_token", "eos_token", "unk_token", "pad_token"):
            text = _token_string(cfg.get(field), cfg_path, field)
            if text is None:
                continue
            if hf.token_to_id(text) is None:
                raise ModelLoadError(
                    f"{cfg_path}: field {field!r} is {text!r}, which is not in the vocabulary "
                    f"of {tok_path}"
                )
            special[field] = text

        bos = special.get("bos_token")
        if bos is None:
            # No bos_token in the tokenizer config: fall back to config.json's id.
            ids = _id_list(model_cfg.get("bos_token_id"), model_cfg_path, "bos_token_id")
            if ids and ids[0] < hf.get_vocab_size(with_added_tokens=True):
                bos = hf.id_to_token(ids[0])

        eos_ids = _id_list(model_cfg.get("eos_token_id"), model_cfg_path, "eos_token_id")
        eos_ids += _id_list(gen_cfg.get("eos_token_id"), gen_cfg_path, "eos_token_id")
        eos_strings = [special["eos_token"]] if "eos_token" in special else []

        add_bos_field = cfg.get("add_bos_token")
        if add_bos_field is not None and not isinstance(add_bos_field, bool):
            raise ModelLoadError(
                f"{cfg_path}: field 'add_bos_token' must be true or false, got {add_bos_field!r}"
            )
        add_bos = (
            add_bos_field
            if add_bos_field is not None
            else _post_processor_adds(hf, None if bos is None else hf.token_to_id(bos))
        )

        templates = _read_chat_templates(d, cfg, cfg_path)
        tokenizer = cls(
            hf,
            bos_token=bos,
            eos_tokens=eos_strings,
            eos_token_ids=eos_ids,
            add_bos=add_bos,
            chat_templates=templates,
            special_token_strings=special,
            byte_fallback=_uses_byte_fallback(tok_json.get("decoder")),
            source=str(d),
        )
        for name in templates:  # compile now: a broken template is a load error, not a 500
            tokenizer._template(name)
        tokenizer.chat_template_problem = tokenizer._probe_chat_template()
        return tokenizer

    def _probe_chat_template(self) -> str | None:
        """Render a one-message conversation: why it fails (a server configuration
        problem to report at start-up), or None when the template works."""
        if not self.has_chat_template:
            return None
        try:
            self.apply_chat_template([dict(m) for m in PROBE_CONVERSATION])
        except (ChatTemplateError, UserError) as exc:
            return f"the model's chat template cannot render a one-message conversation: {exc}"
        return None

    # -- encode / decode -------------------------------------------------------------------

    def encode(
        self, text: str, *, add_special_tokens: bool = True, limit: int | None = None
    ) -> list[int]:
        """Token ids for ``text``; BOS first when the model wants it and it is not there yet.

        Special tokens written in the text (``<|im_start|>``) become their ids, as in
        transformers. We run the tokenizers pipeline without its post-processor and add
        BOS ourselves, so ``add_bos_token`` from the config is the single source of truth.
        ``limit``: a text that certainly holds more tokens is refused before it is
        tokenized (:class:`TooManyTokens`).
        """
        self._check_limit(text, limit)
        ids: list[int] = _encode(self._hf, text).ids
        if (
            add_special_tokens
            and self.add_bos
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``. Special tokens (BOS, EOS, chat markers) are dropped by default.

        Trap: decoding a slice is not the slice of the decoding: a SentencePiece model
        drops the leading space of the first token, and a byte-level model prints U+FFFD
        for a character whose bytes are cut. Stream with :class:`IncrementalDetokenizer`.
        """
        # decode_batch drops the GIL while it works; decode holds it (a 1M-token decode
        # would freeze the event loop).
        out = self._hf.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)
        return str(out[0])

    def to_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what llguidance builds its
        vocabulary from; also right for a tokenizer that was built in memory)."""
        return str(self._hf.to_str())

    @property
    def max_chars_per_token(self) -> int:
        """The most characters one token can stand for: the longest vocabulary string
        (added tokens included). ``len(text) / max_chars_per_token`` is a lower bound on
        the tokens of ``text``, cheap enough to refuse a prompt before tokenizing it."""
        if self._max_chars is None:
            vocab = self._hf.get_vocab(with_added_tokens=True)
            self._max_chars = max((len(t) for t in vocab), default=1) or 1
        return self._max_chars

    @property
    def max_token_bytes(self) -> int:
        """The most bytes of (normalized) text one token stands for: the longest vocabulary
        entry, added tokens included, counted in the bytes it covers (a byte-level
        vocabulary spells each byte as one character; ``▁`` stands for a space)."""
        if self._max_bytes is None:
            vocab = self._hf.get_vocab(with_added_tokens=True)
            added = {a.content for a in self._hf.get_added_tokens_decoder().values()}
            longest = 1
            for piece in vocab:
                if piece not in added and all(c in _BYTE_LEVEL for c in piece):
                    size = len(piece)  # byte-level: one character per byte
                else:
                    size = len(piece.replace("\u2581", " ").encode("utf-8"))
                longest = max(longest, size)
            self._max_bytes = longest
        return self._max_bytes

    def at_least_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, cheap enough to refuse a text before
        tokenizing it: its bytes (after the normalizer's Unicode form, which may
        shrink it) over :attr:`max_token_bytes`. Tight for ordinary text only in the
        sense that no token is longer; a normalizer we cannot follow (lowercasing,
        stripping) gets a margin of 2."""
        form, margin = self._normal_form()
        if form is not None:
            text = unicodedata.normalize(form, text)  # type: ignore[arg-type]
        return len(text.encode("utf-8", "surrogatepass")) // (self.max_token_bytes * margin)

    def _normal_form(self) -> tuple[str | None, int]:
        if self._normal is None:
            spec = json.loads(self._hf.to_str()).get("normalizer")
            self._normal = _normalizer_bound(spec)
        return self._normal

    def _check_limit(self, text: str, limit: int | None) -> None:
        if limit is None:
            return
        at_least = self.at_least_tokens(text)
        if at_least > limit:
            size = len(text.encode("utf-8", "surrogatepass"))
            raise TooManyTokens(at_least, limit, size, self.max_token_bytes)

    def token_text(self, token_id: int) -> str | None:
        """The vocabulary string of one id (``"Ġthe"``, ``"▁the"``, ``"<0xF0>"``), or None."""
        return self._hf.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for, when its vocabulary string spells bytes.

        A token that is part of a UTF-8 character decodes to U+FFFD on its own, so its
        text says nothing; its bytes do (logprobs show them as ``bytes:\\xNN``). Two
        spellings carry them: SentencePiece byte fallback's ``<0xNN>``, and byte-level
        BPE, whose every character stands for one byte (:data:`_BYTE_LEVEL`). None for
        an unknown id or a string that is neither.
        """
        piece = self.token_text(token_id)
        if piece is None:
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                return None
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return None

    # -- chat ------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return "default" in self.chat_templates

    def _template(self, name: str) -> jinja2.Template:
        compiled = self._compiled.get(name)
        if compiled is None:
            try:
                compiled = compile_chat_template(self.chat_templates[name])
            except jinja2.TemplateSyntaxError as exc:
                raise ModelLoadError(
                    f"{self._source}: chat template {name!r} does not compile "
                    f"(line {exc.lineno}: {exc.message})"
                ) from None
            self._compiled[name] = compiled
        return compiled

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's template.

        ``add_generation_prompt`` appends the assistant header so the model answers rather
        than continuing the user's turn. ``tools`` are OpenAI function tools, passed to
        the template as transformers passes them (``tools=``; a message's own tool fields,
        ``tool_calls`` / ``tool_call_id``, stay in the message). ``template_kwargs`` are
        further variables for the template (vLLM's ``chat_template_kwargs``, e.g.
        Qwen3's ``enable_thinking``); a name the renderer sets itself
        (``messages``, ``tools``, ``bos_token`` ...) is a ``FieldError``. Raises
        :class:`~triollm.errors.UserError` when the model has no chat template (a base
        model) or the template refuses the messages.
        """
        if not self.has_chat_template:
            names = sorted(self.chat_templates)
            extra = f" (named templates: {', '.join(names)}; none is 'default')" if names else ""
            raise UserError(
                f"{self._source or 'this model'} has no chat template{extra}: "
                "use a plain prompt instead of chat"
            )
        template = self._template("default")
        # The token variables come from tokenizer_config.json only, as in transformers:
        # a BOS known only from config.json's id is not something the template says.
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "tools": tools or None,  # as transformers: no tools is None, not []
            "documents": None,
            "bos_token": self._special_strings.get("bos_token", ""),
            "eos_token": self._special_strings.get("eos_token", ""),
            "unk_token": self._special_strings.get("unk_token", ""),
            "pad_token": self._special_strings.get("pad_token", ""),
        }
        # A client's variable may not replace one the server sets, a helper the template
        # calls (raise_exception, range: the template then crashed, a 500), or a name
        # jinja reserves (self: it collided with generate()'s own parameter, a 500).
        owned = variables.keys() | template.environment.globals.keys() | _JINJA_RESERVED
        taken = sorted(owned & (template_kwargs or {}).keys())
        if taken:
            raise FieldError(
                "chat_template_kwargs",
                f"'chat_template_kwargs.{taken[0]}': the chat template variable {taken[0]!r} "
                f"is set by the server or the template engine (it sets "
                f"{', '.join(sorted(variables))}, and the helpers "
                f"{', '.join(sorted(template.environment.globals))}); it cannot be passed",
            )
        budget = _RenderBudget(RENDER_OUTPUT_LIMIT_CHARS)
        token = _budget.set(budget)
        try:
            out: list[str] = []
            size = 0
            # One dict, not keywords: no client name can meet generate()'s own parameters.
            for piece in template.generate({**(template_kwargs or {}), **variables}):
                size += len(piece)
                if size > budget.output_limit:
                    raise ChatTemplateError(
                        f"the chat template's output passed {budget.output_limit} characters"
                    )
                budget.tick()
                out.append(piece)
            return "".join(out)
        except TemplateRefusal as exc:
            # The one failure that is the client's: the template says why it refuses.
            raise UserError(f"the chat template refused these messages: {exc}") from None
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(
                f"the chat template tried an unsafe operation: {_cut(str(exc))}"
            ) from None
        except Exception as exc:  # a crash inside the model's template code
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {_cut(str(exc))}"
            ) from None
        finally:
            _budget.reset(token)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        limit: int | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS when the model has one.

        ``continue_final_message`` (vLLM's name; assistant prefill): the ids end with the
        final message's own text, so the answer continues it; the template's end of
        turn after it is cut off, and no generation prompt is added. A template that
        does not write that text as given is a :class:`FieldError` naming the field.

        ``limit``: a rendering that certainly holds more tokens (everything the template
        wrote: every message, name, tool and variable) is refused before it is
        tokenized (:class:`TooManyTokens`).

        Control tokens come from the template only. A message whose text spells one
        (``<|im_end|>`` typed by a user, to forge a system turn) gets it as plain text:
        the characters the user typed, tokenized as text, as OpenAI treats it
        (transformers, vLLM and llama-server turn it into the control token). A raw
        ``/v1/completions`` prompt is different: its writer does the templating, so
        :meth:`encode` keeps reading control tokens there.
        """
        add_generation_prompt = add_generation_prompt and not continue_final_message
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        # Where the prompt ends: the whole rendering, or the final message's text.
        # Spans of client strings (below) are found in the whole text; the ids are the
        # tokens of text[:end] (a control token past `end` is gone with the cut).
        end = _final_message_end(text, messages) if continue_final_message else len(text)
        self._check_limit(text[:end], limit)
        if self._control_re is None:
            return self.encode(text[:end], add_special_tokens=True)  # limit checked above
        # Every string the client wrote (contents, names, tool calls and their
        # arguments, tool definitions, template variables) that spells a control token
        # is marked; without any, the text is tokenized as it is.
        marks = _Marks(self._control_re)
        marked_messages = [
            {k: v if k == "role" else marks.mark(v, f"messages[{i}].{k}") for k, v in m.items()}
            for i, m in enumerate(messages)
        ]
        marked_tools = None if tools is None else marks.mark(tools, "tools")
        marked_kwargs = (
            None
            if template_kwargs is None
            else {k: marks.mark(v, f"chat_template_kwargs.{k}") for k, v in template_kwargs.items()}
        )
        if not marks.originals:
            return self.encode(text[:end], add_special_tokens=True)  # limit checked above
        spans = self._client_spans(
            marks, text, marked_messages, add_generation_prompt, marked_tools, marked_kwargs
        )
        if spans is None:
            where, found = marks.first
            raise UserError(
                f"'{where}' holds the control token {found!r}, and this model's chat "
                "template changes the text it is given, so it cannot be kept as plain "
                f"text: remove it from '{where}'"
            )
        enc = _encode(self._hf, text[:end])
        ids: list[int] = []
        for tid, (start, end) in zip(enc.ids, enc.offsets, strict=True):
            if tid in self.special_token_ids and any(a <= start and end <= b for a, b in spans):
                ids.extend(_encode(self._plain_pipeline(), text[start:end]).ids)
            else:
                ids.append(tid)
        if (
            self.add_bos
            and self.bos_token_id is not None
            and (not ids or ids[0] != self.bos_token_id)
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def special_token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one special token (``[TOOL_CALLS]``), else None."""
        tid = self._hf.token_to_id(text)
        return tid if tid is not None and tid in self.special_token_ids else None

    def added_token_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one added token, special (``[TOOL_CALLS]``) or
        not (Qwen's ``<tool_call>``), else None: what a grammar names by id (``<[id]>``).

        Trap: :meth:`special_token_id` answers None for Qwen's markers; a grammar that
        trusted it wrote them as text and every forced call failed (issue 26).
        """
        return self._added_ids.get(text)

    def _plain_pipeline(self) -> _HFTokenizer:
        """The same tokenizer with ``encode_special_tokens`` on: control strings are text."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _client_spans(
        self,
        marks: _Marks,
        text: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Any,
        template_kwargs: Mapping[str, Any] | None,
    ) -> list[tuple[int, int]] | None:
        """Where the client's marked strings sit in the rendered ``text``, as character
        spans; None when the template does not copy them recognizably.

        Found by rendering again with each such string replaced by a unique marker: the
        text between markers must be the same, and at each marker the text must hold the
        string as it was (or as JSON spells it: a template writes tools with tojson).
        """
        try:
            skeleton = self.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=template_kwargs,
            )
        except (UserError, ChatTemplateError, FieldError):
            return None
        spans: list[tuple[int, int]] = []
        pos = 0  # in text
        last = 0  # in skeleton
        found = list(_MARK.finditer(skeleton))
        for n, m in enumerate(found):
            between = skeleton[last : m.start()]
            if not text.startswith(between, pos):
                return None
            pos += len(between)
            after = skeleton[m.end() : found[n + 1].start() if n + 1 < len(found) else None]
            original = marks.originals[int(m.group(1))]
            for form in _spellings(original):
                if text.startswith(form, pos) and text.startswith(after, pos + len(form)):
                    spans.append((pos, pos + len(form)))
                    pos += len(form)
                    break
            else:
                return None
            last = m.end()
        return spans if text[pos:] == skeleton[last:] else None


def _final_message_end(text: str, messages: list[dict[str, Any]]) -> int:
    """Where the final message's text ends in the rendered ``text`` (assistant prefill:
    the answer continues it, so what the template wrote after it is cut off)."""
    content = messages[-1].get("content") if messages else None
    at = text.rfind(content) if isinstance(content, str) and content else -1
    if at < 0:
        raise FieldError(
            "continue_final_message",
            "'continue_final_message' continues the final message's text, and this one is "
            "empty or the chat template does not write it as given",
        )
    assert isinstance(content, str)
    return at + len(content)


def _encode(hf: _HFTokenizer, text: str) -> Any:
    """``hf.encode(text)`` without the post-processor, with the GIL released.

    ``encode`` holds the GIL for the whole call: a 1.3M-character text held every
    other thread (the event loop) for 3-10 s on this machine. ``encode_batch`` does
    the same work with the GIL dropped (the neighbour's gap fell to 0.1-0.3 s at the
    same size, busy machine; docs/reliability.md has the figures)."""
    return hf.encode_batch([text], add_special_tokens=False)[0]


# Normalizers whose effect on the byte count is known: none (the text as it is), a
# space spelled as "▁" (longer), a prefix (longer), Unicode composition (may shrink:
# followed by normalizing the same way before counting).
_GROWING = {"Prepend"}
_FORMS = {"NFC": "NFC", "NFKC": "NFKC", "NFD": "NFD", "NFKD": "NFKD"}


def _normalizer_bound(spec: Any) -> tuple[str | None, int]:
    """(Unicode form to apply before counting, margin) for a tokenizer.json normalizer."""
    if spec is None:
        return None, 1
    kind = spec.get("type")
    if kind == "Sequence":
        forms = [_normalizer_bound(n) for n in spec.get("normalizers") or ()]
        named = [f for f, _ in forms if f is not None]
        margin = max((m for _, m in forms), default=1)
        if len(named) > 1:
            return None, 2
        return (named[0] if named else None), margin
    if kind in _GROWING:
        return None, 1
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        grows = pattern.get("String") == " " and len(str(spec.get("content", "")).encode()) >= 1
        return None, 1 if grows else 2
    if kind in _FORMS:
        return _FORMS[kind], 1
    return None, 2


_MARK = re.compile("\ue000(\\d+)\ue001")


class _Marks:
    """Replaces each client string that spells a control token with a unique marker
    (private-use characters no tokenizer merges with text), remembering the original
    and where it came from (for the error that names it)."""

    def __init__(self, control: re.Pattern[str]) -> None:
        self.control = control
        self.originals: list[str] = []
        self.first: tuple[str, str] = ("", "")

    def mark(self, value: Any, where: str) -> Any:
        if isinstance(value, str):
            found = self.control.search(value)
            if found is None:
                return value
            if not self.originals:
                self.first = (where, found.group(0))
            self.originals.append(value)
            return f"\ue000{len(self.originals) - 1}\ue001"
        if isinstance(value, dict):
            return {
                self.mark(k, f"{where}.{k}"): self.mark(v, f"{where}.{k}") for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.mark(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value


def _spellings(text: str) -> list[str]:
    """How a template may have written ``text``: as it is, or inside a JSON string."""
    forms = [text, json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]]
    return list(dict.fromkeys(forms))


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _post_processor_adds(hf: _HFTokenizer, bos_id: int | None) -> bool:
    """Whether tokenizer.json's post-processor prepends BOS (Llama 3 style, no config flag).

    Probed rather than parsed: post-processors come in several shapes (TemplateProcessing,
    Sequence, RobertaProcessing) and the library already knows what each one does.
    """
    if bos_id is None:
        return False
    with_special = hf.encode("a", add_special_tokens=True).ids
    without = hf.encode("a", add_special_tokens=False).ids
    return (
        bool(with_special) and with_special[0] == bos_id and (not without or without[0] != bos_id)
    )


def _uses_byte_fallback(decoder: object) -> bool:
    """Whether tokenizer.json's decoder (possibly a Sequence) contains ByteFallback."""
    if isinstance(decoder, dict):
        if decoder.get("type") == "ByteFallback":
            return True
        return any(_uses_byte_fallback(d) for d in decoder.get("decoders") or ())
    return False


def _read_chat_templates(d: Path, cfg: Mapping[str, Any], cfg_path: Path) -> dict[str, str]:
    """Named chat templates; ``"default"`` is the one used for chat."""
    jinja_path = d / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return {"default": jinja_path.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{jinja_path}: cannot be read: {exc}") from None
    value = cfg.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for i, item in enumerate(value):
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise ModelLoadError(
                    f"{cfg_path}: field 'chat_template[{i}]' must be an object with "
                    "'name' and 'template' strings"
                )
            out[item["name"]] = item["template"]
        return out
    raise ModelLoadError(
        f"{cfg_path}: field 'chat_template' must be a string or a list of named templates"
    )


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE (GPT-2's) spells each byte as one printable character: bytes that
    are printable Latin-1 stand for themselves, the other 68 are shifted to 256 + n in
    order. This is the inverse map (character -> byte)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_decoder()


# How many prompt tokens the detokenizer keeps as decoding context. One is enough for the
# leading-space rule (the context token absorbs the "first token" treatment); a few more
# cover decoders that look further back. It only costs a slightly longer decode per push.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turn generated ids, one at a time, into text that can be sent as it comes.

    Two things make "decode each new token and send it" wrong:

    1. **Split characters.** A byte-level vocabulary has tokens that are a *part* of a
       UTF-8 character (an emoji is four bytes, often two or three tokens). Decoding such
       a token alone gives U+FFFD; sending that would put a replacement character in the
       client's text that the final answer does not contain. So text that ends in U+FFFD
       is held back until a later token completes the character (or :meth:`flush`).
    2. **Leading spaces.** SentencePiece-style decoders (``▁`` metaspace) drop the leading
       space of the *first* token they decode, so ``decode([▁world])`` is ``"world"``
       while ``decode([▁hello, ▁world])`` is ``"hello world"``. We therefore decode a
       window that starts a few tokens *before* the new ones (the context) and emit only
       the difference between the window with and without the new tokens.

    Invariant: ``prefix < read <= len(ids)``-ish: ``ids[prefix:read]`` is the context
    (already sent), ``ids[read:]`` is pending (not sent yet), and ``read`` always sits
    on a complete-character boundary.

    Special tokens (EOS, chat markers) are skipped as ``Tokenizer.decode`` skips them, so
    ``"".join(push(t) for t in ids) + flush()`` equals ``tokenizer.decode(ids)`` when the
    prompt is empty (and the continuation of ``decode(prompt)`` otherwise).

    Byte-fallback vocabularies (``<0x..>`` tokens) are held until the run of byte tokens
    ends, because the decoder renders a run as a whole (see ``_emit``).

    Trap: call :meth:`flush` once at the end; text held back for an incomplete
    character is only emitted there (as U+FFFD, exactly as the full decode shows it).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        skip = tokenizer.special_token_ids
        context = [t for t in prompt_ids if t not in skip][-_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix = 0  # start of the decoding window (context tokens)
        self._read = len(context)  # everything before this has been emitted (or is prompt)
        self._keep: frozenset[int] = frozenset()  # special ids emitted as text (keep_special)

    def keep_special(self, texts: Iterable[str]) -> None:
        """Emit these special tokens as their text instead of dropping them.

        A tool-call parser needs its family's markers (Mistral's ``[TOOL_CALLS]``,
        Llama's ``<|python_tag|>``), which the tokenizer marks special; strings that
        are not one special token are ignored (they are ordinary text already).
        """
        ids = (self._tok.special_token_id(t) for t in texts)
        self._keep |= frozenset(i for i in ids if i is not None)

    def keep_every_special(self) -> None:
        """Emit every special token as its text (vLLM's ``skip_special_tokens: false``):
        the answer's text is then ``decode(ids, skip_special_tokens=False)``, chat
        markers and all. The ids the answer *ends* on never reach the detokenizer
        (``TextStream`` stops before pushing them), so EOS stays out, as in vLLM."""
        self._keep = self._tok.special_token_ids

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often ``""``)."""
        if token_id in self._keep:
            # Whatever is pending goes first, then the marker; the decoding window
            # restarts after it, as after any emitted text.
            return self._emit(final=True) + self._tok.decode([token_id], skip_special_tokens=False)
        if token_id in self._tok.special_token_ids:
            return ""  # decode() drops it; keeping it would break the leading-space context
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Everything still held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        sent = self._tok.decode(self._ids[self._prefix : self._read])
        window = self._tok.decode(self._ids[self._prefix :])
        if not final and (
            len(window) <= len(sent)
            or window.endswith(REPLACEMENT_CHAR)
            or self._ids[-1] in self._tok.byte_fallback_ids
        ):
            # Hazard 1: an incomplete character; sending now would send U+FFFD.
            # Hazard 2: ByteFallback decodes a *run* of "<0xNN>" tokens as one unit and
            # turns the whole run into U+FFFDs if any byte in it is bad, so even a
            # complete character at the end of a run may still change. Wait for the run
            # to end (one token of latency for characters spelled in bytes).
            return ""
        # The window normally starts with the text already sent; when the context ended
        # in the first bytes of a character (a prompt cut mid-emoji), the completed
        # character replaces the U+FFFD that was shown, so emit from where they differ.
        if window.startswith(sent):
            new = window[len(sent) :]
        else:
            same = next(
                (i for i, (a, b) in enumerate(zip(sent, window, strict=False)) if a != b),
                min(len(sent), len(window)),
            )
            new = window[same:]
        self._prefix = self._read
        self._read = len(self._ids)
        return new
