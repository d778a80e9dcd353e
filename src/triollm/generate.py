"""``triollm generate``: complete one prompt from a model directory, streamed to stdout.

The same path as the server, without HTTP: ``load_model`` -> tokenize (optionally
through the chat template) -> :class:`~triollm.offline.Engine` (the real Scheduler and
Batch) -> :class:`~triollm.textstream.TextStream` (the server's text rules) -> stdout,
one flushed write per piece of complete text.

``--json`` prints one object at the end instead::

    {"token_ids": [...], "text": "...", "prompt_token_ids": [...],
     "finish_reason": "stop" | "length",
     "timings": {"time_to_first_token_s": ..., "decode_tokens_per_s": ...,
                 "prompt_tokens": ..., "completion_tokens": ...}}

``token_ids`` are the generated ids only, including a final EOS/stop id when the model
produced one; ``text`` leaves that stop token and any ``--stop`` string out.

Every mistake the user can fix (no such directory, a broken config, a bad flag value, a
prompt that cannot fit the context) is a :class:`~triollm.errors.UserError`: one line on
stderr, exit status 2, no traceback. Tests: ``tests/test_generate.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from triollm.errors import FieldError, UserError
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype  # numpy only, no numba
from triollm.plan import FinishReason, SampledToken
from triollm.textstream import TextStream

if TYPE_CHECKING:
    from triollm.request import GenerationRequest
    from triollm.spec import GenerationSpec

DEFAULT_MAX_TOKENS = 128  # enough to see a model's voice; capped by the context left


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="a Hugging Face model directory or a GGUF file (default: the built-in demo model)",
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-ids", help="the prompt as comma-separated token ids: 1,2,3")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens to generate (default {DEFAULT_MAX_TOKENS}, capped by the context left)",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="positions for prompt + answer (default: the model's limit, at most 4096)",
    )
    parser.add_argument(
        "--exact-activations",
        action="store_true",
        help="quantized weights times float32 activations, as transformers (default: int8)",
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="reproduce a sampled run")
    parser.add_argument("--logprobs", type=int, default=None, help="with --json: top-n logprobs")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message")
    parser.add_argument("--json", action="store_true", help="print one JSON object at the end")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=[d.value for d in KVDtype],
        default=DEFAULT_KV_DTYPE.value,
        help=f"KV cache element type ({DEFAULT_KV_DTYPE.value}; f32 is exact)",
    )
    # One string per --stop (repeat the flag): nargs="+" would swallow a MODEL_DIR
    # written after it.
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="STR",
        help="stop before this string (repeat for several)",
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so `triollm generate --help` answers without loading numba.
    from triollm.demo import resolve_model_dir
    from triollm.model.loader import load_model
    from triollm.offline import Engine, engine_config
    from triollm.request import Preparer, ServedModel, eos_token_ids
    from triollm.scheduler import Infeasible

    params = _sampling_params(args)  # the flags' ranges, before the model loads
    stops = _stop_strings(args.stop)
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    loaded = load_model(resolve_model_dir(args.model_dir), exact_activations=args.exact_activations)
    tok = loaded.tokenizer
    try:
        config = engine_config(
            loaded, slots=1, context_tokens=args.context, kv_dtype=KVDtype(args.kv_cache_dtype)
        )
    except FieldError as exc:  # the one field the user sets here is the context
        raise UserError(f"--context: {exc}") from None
    engine = Engine(loaded, config, KVDtype(args.kv_cache_dtype))
    served = ServedModel(
        id="generate",
        tokenizer=tok,
        context_tokens=config.largest_request,
        created=0,
        eos_token_ids=eos_token_ids(tok, loaded.config),
        model_vocab_size=loaded.config.vocab_size,
    )
    # The server's own prepare: the same tokenizing, vocabulary checks and max_tokens
    # rule, with this command's default budget for an unset --max-tokens.
    preparer = Preparer(served, engine.scheduler, generate_default=DEFAULT_MAX_TOKENS)
    try:
        spec = preparer.prepare_now(_request(args, params, stops))
    except FieldError as exc:
        raise UserError(f"{_flag(args, exc.field)}: {exc}") from None
    if not spec.prompt_ids:
        raise UserError("the prompt is empty: give at least one token of text")
    t0 = time.perf_counter()
    try:
        generation = engine.start(spec)
    except Infeasible as exc:
        flag = "--max-tokens" if exc.field == "max_tokens" else "the prompt"
        raise UserError(f"{flag}: {exc}") from None

    try:
        return _drive(generation, args, tok, spec, t0)
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly, and point stdout at /dev/null so the
        # interpreter's own final flush does not raise the same error again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _flag(args: argparse.Namespace, field: str) -> str:
    """The flag to blame for a refused request field."""
    if field in ("prompt", "messages"):
        return "--prompt-ids" if args.prompt_ids is not None else "--prompt"
    return "--" + field.replace("_", "-")


def _drive(
    generation: Any, args: argparse.Namespace, tok: Any, spec: GenerationSpec, t0: float
) -> int:
    """Consume the generation: stream or collect the text, then print the result."""
    from triollm.model.tokenizer import IncrementalDetokenizer

    out: TextIO = sys.stdout
    stream = not args.json
    prompt_ids = spec.prompt_ids
    text_stream = TextStream(
        IncrementalDetokenizer(tok, prompt_ids), stops=spec.stop, stop_ids=spec.stop_token_ids
    )
    tokens: list[SampledToken] = []
    text: list[str] = []
    t_first = t_last = t0
    finish: FinishReason | None = None
    with generation:
        for token in generation:
            t_last = time.perf_counter()
            if not tokens:
                t_first = t_last
            tokens.append(token)
            piece = text_stream.push(token.token_id)
            _emit(piece.text, text, out if stream else None)
            if piece.finish is not None:  # a stop id or a stop string: the text ended
                finish = piece.finish
                break
        if finish is None:
            piece = text_stream.finish(generation.finish_reason or FinishReason.STOP)
            _emit(piece.text, text, out if stream else None)
            finish = piece.finish
    assert finish is not None

    if stream:
        out.write("\n")
        out.flush()
        return 0
    n = len(tokens)
    result: dict[str, Any] = {
        "token_ids": [t.token_id for t in tokens],
        "text": "".join(text),
        "prompt_token_ids": list(prompt_ids),
        "finish_reason": finish.value,
        "timings": {
            "time_to_first_token_s": round(t_first - t0, 6) if n else None,
            "decode_tokens_per_s": (
                round((n - 1) / (t_last - t_first), 3) if n > 1 and t_last > t_first else None
            ),
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": n,
        },
    }
    if spec.sampling.logprobs is not None:
        result["logprobs"] = [
            {"token_id": t.token_id, "logprob": t.logprob, "top_logprobs": t.top_logprobs}
            for t in tokens
        ]
    json.dump(result, out, ensure_ascii=False)
    out.write("\n")
    out.flush()
    return 0


def _emit(piece: str, text: list[str], out: TextIO | None) -> None:
    if not piece:
        return
    text.append(piece)
    if out is not None:
        out.write(piece)
        out.flush()  # the point of streaming: the user sees each piece as it is made


def _sampling_params(args: argparse.Namespace) -> Any:
    from triollm.model.sampling import SamplingParams

    # Every sampling field is a flag, except the grammar and prompt_logprobs (server
    # features: they arrive in a request body, not on a command line).
    server_only = {"grammar", "min_tokens", "prompt_logprobs"}
    fields = {f.name for f in dataclasses.fields(SamplingParams)} - server_only
    values = {name: getattr(args, name) for name in fields}
    try:
        return SamplingParams(**values)
    except FieldError as exc:
        raise UserError(f"--{exc.field.replace('_', '-')}: {exc}") from None


def _stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    for s in stops:
        if not s:
            raise UserError("--stop: stop strings must not be empty")
    return tuple(stops)


def _request(args: argparse.Namespace, params: Any, stops: tuple[str, ...]) -> GenerationRequest:
    """The flags as the request the server's ``prepare`` takes (its vocabulary checks
    name the field; ``_flag`` turns it back into the flag)."""
    from triollm.request import ChatMessage, GenerationRequest

    common: dict[str, Any] = {
        "model": None,
        "max_tokens": args.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "seed": params.seed,
        "stop": stops,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logprobs": params.logprobs,
        "ignore_eos": args.ignore_eos,
    }
    if args.prompt_ids is not None:
        if args.chat:
            raise UserError("--chat needs --prompt text, not --prompt-ids")
        try:
            ids = tuple(int(x) for x in args.prompt_ids.split(",") if x.strip())
        except ValueError:
            raise UserError(
                f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}"
            ) from None
        return GenerationRequest(kind="completion", prompt_ids=ids, **common)
    if args.chat:
        message = ChatMessage("user", args.prompt)
        return GenerationRequest(kind="chat", messages=(message,), **common)
    return GenerationRequest(kind="completion", prompt_text=args.prompt, **common)
