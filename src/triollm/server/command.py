"""``triollm serve [MODEL_DIR]``: load a model, print the memory arithmetic, serve it.

The task tree (one ``trio.run``)::

    main nursery
    |- signal watcher            SIGINT/SIGTERM -> graceful shutdown; a second one -> now
    `- Service.run (its nursery)
       |- admission driver       admission.py
       |- batch loop             service.py
       `- HTTP frontend          server/app.py: hypercorn.trio.serve + a shutdown watchdog

Shutdown: the first signal closes the admission queue (waiters get 503), hypercorn
stops accepting, and in-flight streams get ``--grace`` seconds to finish; then the
remaining connections are aborted and the process exits 0.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import math
import re
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from triollm.errors import UserError
from triollm.scheduler import Policy, Scheduler, SchedulerConfig
from triollm.server.app import (
    DEFAULT_MAX_BODY_BYTES,
    HttpConfig,
    ServedModel,
    create_app,
    serve_http,
)
from triollm.server.metrics import Metrics
from triollm.service import MemoryReport, Service, ServiceConfig

log = logging.getLogger("triollm.server")

REFUSED_POLICIES = {
    "static": "static runs a batch to completion before admitting anyone else "
    "(head-of-line blocking); it is in the simulator for teaching only",
    "free-slot": "free-slot admits on a free slot alone and deadlocks when the pool runs dry; "
    "it is in the simulator for teaching only",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="a Hugging Face model directory (default: the built-in demo model)",
    )
    parser.add_argument("--model", dest="model_opt", metavar="DIR", help="same as MODEL_DIR")
    parser.add_argument("--model-name", help="the id clients send as 'model' (default: dir name)")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    net.add_argument(
        "--public",
        action="store_true",
        help="allow a non-loopback --host (there is NO authentication)",
    )
    cap = parser.add_argument_group("capacity")
    cap.add_argument("--slots", type=int, default=4, help="sequences running at once (4)")
    mem = cap.add_mutually_exclusive_group()
    mem.add_argument("--kv-blocks", type=int, help="KV pool size in blocks")
    mem.add_argument(
        "--kv-memory", help="KV pool budget, e.g. 256MiB or 2G (default: slots x context)"
    )
    cap.add_argument("--block-size", type=int, default=32, help="positions per KV block (32)")
    cap.add_argument(
        "--context", type=int, help="positions per sequence (default: the model's, at most 4096)"
    )
    # The step budget (docs/serving.md, "Choosing the step budget";
    # bench/bench_step_rows.py): a step carrying a prefill chunk stalls every
    # decoding stream for as long as the chunk takes, and the stall grows with the
    # chunk, while the long prompt's time to first token barely depends on it
    # down to ~64-128 tokens (a prefill is compute bound; the per-step weight read
    # is a few percent of a 128-row step). 128 keeps stalls ~4x shorter than 512
    # at the same TTFT. step_rows = chunk + slots so a chunk never pushes a
    # decoder out of its step (step_rows = chunk measured 1.5x longer stalls).
    cap.add_argument(
        "--chunk",
        type=int,
        default=128,
        help="prefill tokens per sequence per step (128: short decode stalls, same TTFT)",
    )
    cap.add_argument(
        "--step-rows",
        type=int,
        help="rows per forward pass (default: chunk + slots: a full chunk plus every decoder)",
    )
    cap.add_argument(
        "--policy",
        default="reserve",
        help="admission policy: reserve (default; never deadlocks) or preempt",
    )
    q = parser.add_argument_group("queue and streams")
    q.add_argument("--queue-depth-per-slot", type=int, default=8, help="waiters per slot (8)")
    q.add_argument("--queue-wait", type=float, default=30.0, help="seconds a waiter may wait (30)")
    q.add_argument(
        "--stream-buffer",
        type=int,
        default=256,
        help="steps a client may fall behind before it is cut off (256)",
    )
    q.add_argument("--max-tokens-default", type=int, help="max_tokens when a request gives none")
    q.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="abort a connection whose socket accepts nothing for this long (30 s; 0 = never)",
    )
    q.add_argument("--grace", type=float, default=30.0, help="shutdown grace period (30 s)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"256MiB"``, ``"2G"``, ``"1048576"`` -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"--kv-memory: cannot read {text!r}; write e.g. 256MiB or 2G")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * 1024**power)


DEMO_MODEL_NAME = "triollm-demo"


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir and args.model_opt and args.model_dir != args.model_opt:
        raise UserError("give the model once: MODEL_DIR or --model, not both")
    from triollm.demo import resolve_model_dir

    return resolve_model_dir(args.model_dir or args.model_opt)


@dataclass
class Stack:
    """Everything one server holds, built from a loaded model (tests build it too)."""

    service: Service
    app: Any
    metrics: Metrics
    served: ServedModel
    report: MemoryReport
    warm_prompt: list[int]


# The configs name their own fields; a user typed flags. Longest names first, so
# "max_tokens_default" is not half-replaced as "max_tokens".
FLAG_OF_FIELD = {
    "queue_depth_per_slot": "--queue-depth-per-slot",
    "stream_buffer_steps": "--stream-buffer",
    "max_tokens_default": "--max-tokens-default",
    "context_tokens": "--context",
    "chunk_tokens": "--chunk",
    "queue_wait_s": "--queue-wait",
    "num_blocks": "--kv-blocks (or --kv-memory)",
    "block_size": "--block-size",
    "step_rows": "--step-rows",
    "slots": "--slots",
}


def flag_names(message: str) -> str:
    """``message`` with config field names replaced by the flags that set them."""
    pattern = r"\b(" + "|".join(sorted(FLAG_OF_FIELD, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: FLAG_OF_FIELD[m.group(1)], message)


def build_stack(
    loaded: Any,
    *,
    slots: int = 4,
    num_blocks: int | None = None,
    kv_memory_bytes: int | None = None,
    block_size: int = 32,
    context_tokens: int | None = None,
    chunk_tokens: int = 128,
    step_rows: int | None = None,
    policy: str = "reserve",
    overtake_limit: int | None = None,
    queue_depth_per_slot: int = 8,
    queue_wait_s: float = 30.0,
    stream_buffer_steps: int = 256,
    max_tokens_default: int | None = None,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Stack:
    """Scheduler + Batch + Service + app for ``loaded``; validates every knob."""
    from triollm.batch import Batch
    from triollm.model.sampling import SamplingParams
    from triollm.model.tokenizer import IncrementalDetokenizer

    if policy in REFUSED_POLICIES:
        raise UserError(f"--policy {policy} is refused here: {REFUSED_POLICIES[policy]}")
    if policy not in ("reserve", "preempt"):
        raise UserError(f"--policy must be reserve or preempt, got {policy!r}")
    cfg = loaded.config
    from triollm.engine import DEFAULT_CONTEXT_CAP

    # A long-context model's own limit (Llama-3.1: 131072 positions) would make the
    # default pool slots x 131072 x 128 KiB = 64+ GiB: capped, as `generate` does;
    # --context asks for more explicitly.
    context = context_tokens or min(cfg.max_position_embeddings, DEFAULT_CONTEXT_CAP)
    if context > cfg.max_position_embeddings:
        raise UserError(
            f"--context {context} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    per_position = cfg.kv_bytes_per_position()
    if num_blocks is None:
        if kv_memory_bytes is not None:
            num_blocks = kv_memory_bytes // (per_position * block_size)
            if num_blocks < 1:
                raise UserError(
                    f"--kv-memory {kv_memory_bytes} bytes holds no block: one block is "
                    f"{block_size} positions x {per_position} bytes = {block_size * per_position}"
                )
        else:
            num_blocks = math.ceil(slots * context / block_size)  # every slot can fill its context
    rows = step_rows if step_rows is not None else chunk_tokens + slots
    try:
        sched_config = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            slots=slots,
            chunk_tokens=chunk_tokens,
            step_rows=rows,
            context_tokens=context,
            policy=Policy(policy),
            overtake_limit=overtake_limit,
        )
        service_config = ServiceConfig(
            queue_depth_per_slot=queue_depth_per_slot,
            queue_wait_s=queue_wait_s,
            stream_buffer_steps=stream_buffer_steps,
            max_tokens_default=max_tokens_default,
        )
    except ValueError as exc:
        raise UserError(flag_names(str(exc))) from None
    try:
        batch = Batch(loaded, num_blocks=num_blocks, block_size=block_size)
    except MemoryError:
        need = num_blocks * block_size * per_position
        raise UserError(
            f"cannot allocate the KV pool: {num_blocks} blocks x {block_size} positions x "
            f"{per_position} bytes = {need / 2**30:.1f} GiB ({slots} slots x {context} "
            "positions of context); give it a budget with --kv-memory (e.g. 2G) or shorten "
            "--context"
        ) from None
    metrics = Metrics()
    tokenizer = loaded.tokenizer
    service = Service(
        Scheduler(sched_config),
        batch,
        detokenizer=partial(IncrementalDetokenizer, tokenizer),
        eos_token_ids=frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids),
        config=service_config,
        observer=metrics,
    )
    metrics.bind(service.scheduler.statistics, lambda: service.internal_running)
    served = ServedModel(
        id=model_name or Path(loaded.model_dir).name,
        tokenizer=tokenizer,
        # /v1/models' max_model_len: the largest request this server admits, which
        # a pool smaller than slots x context makes less than the context.
        context_tokens=min(context, num_blocks * block_size),
        created=int(time.time()),
        make_params=SamplingParams,
        model_vocab_size=cfg.vocab_size,
    )
    report = MemoryReport(
        weight_bytes=loaded.weight_bytes,
        kv_bytes_per_position=per_position,
        num_blocks=num_blocks,
        block_size=block_size,
        slots=slots,
        context_tokens=context,
        lines=(
            f"queue: {slots} slots x {queue_depth_per_slot} = {slots * queue_depth_per_slot} "
            f"waiters, wait budget {queue_wait_s:g} s; stream buffer {stream_buffer_steps} steps",
            f"step: up to {rows} rows; prefill chunk {chunk_tokens} tokens; policy {policy}",
        ),
    )
    warm = list(tokenizer.encode("Hello")) or [0]
    app = create_app(service, served, metrics, max_body_bytes=max_body_bytes)
    return Stack(service, app, metrics, served, report, warm)


async def serve_stack(
    stack: Stack,
    http: HttpConfig,
    shutdown: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the service and its HTTP frontend until ``shutdown`` has drained them.

    Reports the bound addresses once the service is warm and ready."""
    from triollm.model.sampling import SamplingParams

    async with trio.open_nursery() as nursery:
        frontend = partial(serve_http, stack.service, stack.app, http, shutdown)
        binds = await nursery.start(stack.service.run, frontend)
        await stack.service.warm_up(stack.warm_prompt, SamplingParams(temperature=0.0))
        stack.service.ready = True
        task_status.started(binds)


async def _main(stack: Stack, http: HttpConfig) -> None:
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:

        async def signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                async for signum in received:
                    if not shutdown.is_set():
                        print(
                            f"triollm: {signal.Signals(signum).name}: not accepting new requests; "
                            f"letting streams finish (up to {http.grace_s:g} s)",
                            file=sys.stderr,
                        )
                        shutdown.set()
                    else:
                        print("triollm: second signal: stopping now", file=sys.stderr)
                        nursery.cancel_scope.cancel()
                        return

        nursery.start_soon(signals)

        async def server(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_stack(stack, http, shutdown, task_status=task_status)
            nursery.cancel_scope.cancel()  # drained: stop watching for signals

        binds = await nursery.start(server)
        for bind in binds:
            print(f"triollm: serving {stack.served.id} on {bind} (ready)", file=sys.stderr)


BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _find_oserror(exc: BaseException) -> OSError | None:
    """The OSError inside ``exc`` (possibly nested exception groups), if any."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _find_oserror(inner)
            if found is not None:
                return found
    return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not _is_loopback(args.host) and not args.public:
        raise UserError(
            f"--host {args.host} is not a loopback address; add --public to serve it "
            "(there is no authentication: anyone who can reach the port can use the model)"
        )
    if args.public:
        print(
            "triollm: WARNING: --public: no authentication; anyone who can reach "
            f"{args.host}:{args.port} can use this server",
            file=sys.stderr,
        )
    for name in ("slots", "block_size", "chunk", "queue_depth_per_slot", "stream_buffer"):
        value = getattr(args, name)
        if value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0-65535, got {args.port}")
    # A negative grace would end the drain before it began; a negative write
    # timeout would put every socket write's deadline in the past (every stream
    # aborted at its first byte). NaN compares false with everything: refused too.
    for name, value in (("write-timeout", args.write_timeout), ("grace", args.grace)):
        if not (value >= 0 and math.isfinite(value)):
            raise UserError(f"--{name} must be a number of seconds >= 0, got {value}")
    from triollm.model.loader import load_model

    model_dir = _model_dir(args)
    started = time.monotonic()
    loaded = load_model(model_dir)
    stack = build_stack(
        loaded,
        slots=args.slots,
        num_blocks=args.kv_blocks,
        kv_memory_bytes=parse_size(args.kv_memory) if args.kv_memory else None,
        block_size=args.block_size,
        context_tokens=args.context,
        chunk_tokens=args.chunk,
        step_rows=args.step_rows,
        policy=args.policy,
        queue_depth_per_slot=args.queue_depth_per_slot,
        queue_wait_s=args.queue_wait,
        stream_buffer_steps=args.stream_buffer,
        max_tokens_default=args.max_tokens_default,
        model_name=args.model_name
        or (None if args.model_dir or args.model_opt else DEMO_MODEL_NAME),
    )
    print(
        f"triollm: loaded {model_dir} in {time.monotonic() - started:.1f} s\n"
        + "\n".join(f"  {line}" for line in stack.report.describe().splitlines()),
        file=sys.stderr,
    )
    http = HttpConfig(
        host=args.host,
        port=args.port,
        grace_s=args.grace,
        write_timeout_s=args.write_timeout or None,
    )
    print(
        "triollm: compiling kernels and warming up (the first run can take ~30 s)...",
        file=sys.stderr,
    )
    try:
        trio.run(_main, stack, http)
    except (OSError, BaseExceptionGroup) as exc:
        # A bind failure surfaces from inside hypercorn's nursery, wrapped in
        # exception groups: show the one line that matters, not the traceback.
        oserror = _find_oserror(exc)
        if oserror is None or oserror.errno not in BIND_ERRNOS:
            raise
        raise UserError(
            f"cannot listen on {args.host}:{args.port}: {oserror.strerror or oserror}"
            + (
                " (another server is using the port; pick another with --port, or 0 for any)"
                if oserror.errno == errno.EADDRINUSE
                else ""
            )
        ) from None
    print("triollm: shut down cleanly", file=sys.stderr)
    return 0
