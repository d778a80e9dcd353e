"""``triollm serve [MODEL_DIR]``: load a model, print the memory arithmetic, serve it.

The task tree (one ``trio.run``)::

    main nursery
    |- signal watcher            SIGINT/SIGTERM -> graceful shutdown; a second one -> now
    `- Service.run (its nursery)
       |- admission driver       admission.py
       |- batch loop             service.py
       `- HTTP frontend          server/app.py: hypercorn.trio.serve + a shutdown watchdog

Shutdown: the first signal closes the admission queue (waiters get 503), and
in-flight streams get ``--grace`` seconds to finish, while new requests get 503 with
``Retry-After``; once they have ended hypercorn stops accepting, the remaining
connections are aborted and the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import ipaddress
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from triollm.errors import UserError
from triollm.model.embed import Embedder, Pooling
from triollm.model.kvstore import DEFAULT_KV_DTYPE, KVDtype, kv_bytes_per_position
from triollm.policies import Claim, Policy, SchedulingPolicy, load_policy, policy_name
from triollm.request import ServedModel
from triollm.scheduler import Scheduler, serving_chunk_tokens, serving_stall_rows
from triollm.server.app import DEFAULT_BODY_TIMEOUT_S, body_limit_for, create_app
from triollm.server.door import API_KEY_ENV, DoorPolicy
from triollm.server.frontend import HttpConfig, Serving, serve_http
from triollm.server.lifetime import Lifetime
from triollm.server.metrics import Metrics
from triollm.server.ollama import ModelFacts
from triollm.service import Service, ServiceConfig
from triollm.sizing import DEFAULT_KV_MEMORY_BYTES, Capacity, MemoryReport, default_of
from triollm.toolcalls import ToolCallFormat, detect_format

log = logging.getLogger("triollm.server")

REFUSED_POLICIES = {
    Policy.STATIC: "static runs a batch to completion before admitting anyone else "
    "(head-of-line blocking); it is in the simulator for teaching only",
    Policy.FREE_SLOT: "free-slot admits on a free slot alone and deadlocks when the pool runs dry; "
    "it is in the simulator for teaching only",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        help="a Hugging Face model directory or a GGUF file (default: the built-in demo model)",
    )
    parser.add_argument("--model", dest="model_opt", metavar="DIR", help="same as MODEL_DIR")
    parser.add_argument(
        "--quantize",
        choices=("q8_0", "q4_0"),
        help="quantize a model directory's weight matrices at load (GGUF's Q8_0 / Q4_0 blocks)",
    )
    parser.add_argument(
        "--exact-activations",
        action="store_true",
        help="multiply quantized weights with float32 activations, as transformers does "
        "(default: int8 activations and integer dot products, faster, ~0.5%% off per product)",
    )
    parser.add_argument("--model-name", help="the id clients send as 'model' (default: dir name)")
    parser.add_argument(
        "--tool-call-parser",
        choices=[f.value for f in ToolCallFormat],
        help="how the model writes tool calls (default: read from its chat template)",
    )
    parser.add_argument(
        "--pooling",
        choices=[p.value for p in Pooling],
        default=Pooling.LAST.value,
        help="how /v1/embeddings pools the final hidden states: last (the last token's, "
        "Qwen3-Embedding's rule; the default) or mean",
    )
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    net.add_argument(
        "--public",
        action="store_true",
        help="allow a non-loopback --host (add --api-key: there is no authentication otherwise)",
    )
    ev = parser.add_argument_group("KV events for prefix-aware routers (docs/scale-out.md)")
    ev.add_argument(
        "--kv-events-endpoint",
        metavar="ADDR",
        help="publish KV events (vLLM's format) on this ZMQ PUB address, e.g. "
        "tcp://127.0.0.1:5557 (needs the events extra; default: none)",
    )
    ev.add_argument(
        "--kv-events-replay-endpoint",
        metavar="ADDR",
        help="serve missed events to late subscribers on this ZMQ ROUTER address (bound)",
    )
    ev.add_argument(
        "--kv-events-encoding",
        choices=("array", "map"),
        default="array",
        help="array: vLLM's positional events (llm-d); map: named fields (vllm-router)",
    )
    ev.add_argument(
        "--kv-events-mode",
        choices=("auto", "bind", "connect"),
        default="auto",
        help="auto (vLLM's rule): bind a wildcard or ipc address, connect to a named host",
    )
    ev.add_argument(
        "--kv-events-topic",
        metavar="TOPIC",
        help="the topic on every message (default: kv@HOST:PORT@MODEL, llm-d's convention; "
        "'' for vllm-router's --kv-event-source, which matches the topic exactly)",
    )
    net.add_argument(
        "--metrics-names",
        choices=("triollm", "vllm"),
        default="triollm",
        help="the prefix of /metrics' series: triollm (default) or vllm, for routers that "
        "read vLLM's names (the Gateway API Inference Extension's default; docs/scale-out.md)",
    )
    sec = parser.add_argument_group("access (docs/reliability.md)")
    sec.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; none = no key)",
    )
    sec.add_argument(
        "--open-paths",
        default="/health,/ready,/metrics",
        help="paths served without the API key, comma-separated ('' = none)",
    )
    sec.add_argument(
        "--allowed-origins",
        default="",
        help="CORS: origins whose pages may call the API, comma-separated ('*' = any)",
    )
    sec.add_argument(
        "--allowed-hosts",
        default="",
        help="Host names accepted besides loopback ones (DNS-rebinding guard)",
    )
    # Every default below is read from the config dataclass that owns it, where its
    # reason is written (SchedulerConfig, ServiceConfig, sizing.py, HttpConfig).
    svc = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}
    http = {f.name: f.default for f in dataclasses.fields(HttpConfig)}
    cap = parser.add_argument_group("capacity")
    cap.add_argument("--slots", type=int, help=f"sequences running at once ({default_of('slots')})")
    mem = cap.add_mutually_exclusive_group()
    mem.add_argument("--kv-blocks", type=int, help="KV pool size in blocks")
    mem.add_argument(
        "--kv-memory",
        help="KV pool budget, e.g. 256MiB or 2G (default: slots x context, at most "
        f"{DEFAULT_KV_MEMORY_BYTES // 2**30} GiB when --context is not given)",
    )
    cap.add_argument(
        "--block-size", type=int, help=f"positions per KV block ({default_of('block_size')})"
    )
    cap.add_argument(
        "--kv-cache-dtype",
        choices=[d.value for d in KVDtype],
        default=DEFAULT_KV_DTYPE.value,
        help=f"KV cache element type ({DEFAULT_KV_DTYPE.value}; f32 is exact, q8_0 a quarter)",
    )
    cap.add_argument(
        "--context",
        type=int,
        help="positions per sequence (default: the model's own; the default pool then "
        f"takes at most {DEFAULT_KV_MEMORY_BYTES // 2**30} GiB)",
    )
    cap.add_argument(
        "--chunk",
        type=int,
        help=f"prefill tokens per sequence per step (default: {default_of('chunk_tokens')} "
        "for a ~100M model, fewer for a larger one, at least 32: short decode stalls, "
        "same TTFT; see scheduler.serving_chunk_tokens)",
    )
    cap.add_argument(
        "--stall-rows",
        type=int,
        help="prefill rows of a whole step while any sequence decodes, at most the chunk "
        "(default: about one decode step's worth for the model, at least 8: each such row "
        "delays every stream's next token; see scheduler.serving_stall_rows)",
    )
    cap.add_argument(
        "--step-rows",
        type=int,
        help="rows per forward pass (default: chunk + slots: a full chunk plus every decoder)",
    )
    cap.add_argument(
        "--policy",
        default=Policy.RESERVE.value,
        help="admission policy: reserve (default; never deadlocks), preempt, or your own as "
        "module:Name / file.py:Name (it must claim no-deadlock; prove it with check-policy)",
    )
    cap.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default="on" if Capacity.prefix_cache else "off",
        help="share the K/V of a prompt's opening with later prompts that start the same "
        "(on: a returning conversation prefills only what is new; off: the plain pool)",
    )
    q = parser.add_argument_group("queue and streams")
    q.add_argument(
        "--queue-depth-per-slot",
        type=int,
        default=svc["queue_depth_per_slot"],
        help=f"waiters per slot ({svc['queue_depth_per_slot']})",
    )
    q.add_argument(
        "--queue-wait",
        type=float,
        default=svc["queue_wait_s"],
        help=f"seconds a waiter may wait ({svc['queue_wait_s']:g})",
    )
    q.add_argument(
        "--stream-buffer",
        type=int,
        default=svc["stream_buffer_steps"],
        help=f"steps a client may fall behind before it is cut off ({svc['stream_buffer_steps']})",
    )
    q.add_argument("--max-tokens-default", type=int, help="max_tokens when a request gives none")
    q.add_argument(
        "--write-timeout",
        type=float,
        default=http["write_timeout_s"],
        help="abort a connection whose socket accepts nothing for this long "
        f"({http['write_timeout_s']:g} s; 0 = never)",
    )
    q.add_argument(
        "--grace",
        type=float,
        default=http["grace_s"],
        help=f"shutdown grace period ({http['grace_s']:g} s)",
    )


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


def _chosen_model_dir(args: argparse.Namespace) -> str | None:
    """MODEL_DIR or --model, whichever was given (None: neither)."""
    given = {d for d in (args.model_dir, args.model_opt) if d is not None}
    if len(given) > 1:
        raise UserError("give the model once: MODEL_DIR or --model, not both")
    return given.pop() if given else None


def _model_dir(args: argparse.Namespace) -> Path:
    from triollm.demo import resolve_model_dir

    return resolve_model_dir(_chosen_model_dir(args))


@dataclass
class Stack:
    """Everything one server holds, built from a loaded model (tests build it too).

    The ASGI app is built by the frontend inside its own nursery (``make_app``), the
    one its refused-body drainers need; ``app`` is that app once serving started."""

    service: Service
    make_app: Callable[[trio.Nursery], Lifetime]
    metrics: Metrics
    served: ServedModel
    report: MemoryReport
    warm_prompt: list[int]
    app: Lifetime | None = None  # set by serve_stack while it serves
    max_body_bytes: int = 0  # the body limit in force (413 past it)
    kv_publisher: Any = None  # a kvevents.KVEventPublisher with --kv-events-endpoint


# The configs name their own fields; a user typed flags. Longest names first, so
# "max_tokens_default" is not half-replaced as "max_tokens".
FLAG_OF_FIELD = {
    "queue_depth_per_slot": "--queue-depth-per-slot",
    "stream_buffer_steps": "--stream-buffer",
    "max_tokens_default": "--max-tokens-default",
    "context_tokens": "--context",
    "chunk_tokens": "--chunk",
    "queue_wait_s": "--queue-wait",
    "kv_memory_bytes": "--kv-memory",
    "num_blocks": "--kv-blocks (or --kv-memory)",
    "block_size": "--block-size",
    "step_rows": "--step-rows",
    "stall_rows": "--stall-rows",
    "slots": "--slots",
}


def flag_names(message: str) -> str:
    """``message`` with config field names replaced by the flags that set them."""
    pattern = r"\b(" + "|".join(sorted(FLAG_OF_FIELD, key=len, reverse=True)) + r")\b"
    return re.sub(pattern, lambda m: FLAG_OF_FIELD[m.group(1)], message)


def parse_policy(text: str) -> Policy | SchedulingPolicy:
    """``--policy``: the two built-ins the server runs, or a user's policy that claims
    no deadlock (a deadlocked server hangs every client); the teaching ones are
    refused with why."""
    if text not in {p.value for p in Policy}:
        if ":" not in text:
            raise UserError(f"--policy must be reserve or preempt (or module:Name), got {text!r}")
        try:
            mine = load_policy(text)
        except ValueError as exc:
            raise UserError(f"--policy: {exc}") from None
        if Claim.NO_DEADLOCK not in mine.claims:
            raise UserError(
                f"--policy {text} does not claim no-deadlock, and a server that deadlocks "
                f"hangs every client; claim it and prove it: triollm check-policy {text}"
            )
        return mine
    policy = Policy(text)
    refuse_policy(policy)
    return policy


def refuse_policy(policy: Policy | SchedulingPolicy | None) -> None:
    """The one check of :data:`REFUSED_POLICIES` (the flag's parser and ``build_stack``,
    which a test or a tool may call with a config that never saw a flag)."""
    if isinstance(policy, Policy) and policy in REFUSED_POLICIES:
        raise UserError(f"--policy {policy.value} is refused here: {REFUSED_POLICIES[policy]}")


def row_weights(cfg: Any) -> int:
    """Weights one prompt row multiplies in the layers of a model of config ``cfg``
    (q/k/v/o and the MLP, or a sparse layer's ``top_k`` experts and router): what a
    prefill chunk's stall grows with (``scheduler.serving_chunk_tokens``)."""
    h = cfg.hidden_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = h * (q_dim + 2 * kv_dim) + q_dim * h
    total = 0
    for i in range(cfg.num_hidden_layers):
        moe = cfg.moe
        if moe is not None and i in moe.sparse_layers:
            mlp = moe.top_k * 3 * h * moe.intermediate_size + h * moe.num_experts
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += attention + mlp
    return total


def build_stack(
    loaded: Any,
    capacity: Capacity,
    service_config: ServiceConfig,
    *,
    model_name: str | None = None,
    max_body_bytes: int | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    tool_call_parser: ToolCallFormat | None = None,
    door: DoorPolicy | None = None,
    metrics_names: str = "triollm",
    kv_events: Any = None,
    pooling: Pooling = Pooling.LAST,
) -> Stack:
    """Scheduler + Batch + Service + app for ``loaded``, sized by ``sizing.py``.

    Raises :class:`UserError` naming the flag for a capacity the model or the
    machine cannot have (the configs refuse their own bad values)."""
    from triollm.batch import Batch
    from triollm.model.constrained import ConstraintTokenizer, GrammarCache
    from triollm.model.tokenizer import IncrementalDetokenizer
    from triollm.request import eos_token_ids

    refuse_policy(capacity.policy)
    cfg = loaded.config
    chunk = capacity.chunk_tokens
    if chunk is None:  # unset: the default follows the model's size
        chunk = serving_chunk_tokens(row_weights(cfg))
        capacity = dataclasses.replace(capacity, chunk_tokens=chunk)
    # Unset: about one decode step's worth of prefill. A chunk below 1 is left for
    # SchedulerConfig to refuse by its name (--chunk), not blamed on this derivation.
    if capacity.stall_rows is None and chunk >= 1:
        stall = serving_stall_rows(row_weights(cfg), loaded.weight_bytes, chunk)
        capacity = dataclasses.replace(capacity, stall_rows=stall)
    per_position = kv_bytes_per_position(cfg, capacity.kv_dtype)
    try:
        sched_config = capacity.resolve(cfg.max_position_embeddings, per_position)
    except ValueError as exc:  # FieldError or the SchedulerConfig's own refusal
        raise UserError(flag_names(str(exc))) from None
    # LongRoPE (Phi-3 128k) picks its factor list by the context served (model/phi3.py)
    loaded.model.use_context(sched_config.context_tokens)
    try:
        batch = Batch(
            loaded,
            num_blocks=sched_config.num_blocks,
            block_size=sched_config.block_size,
            kv_dtype=capacity.kv_dtype,
        )
    except MemoryError:
        s = sched_config
        need = s.num_blocks * s.block_size * per_position
        raise UserError(
            f"cannot allocate the KV pool: {s.num_blocks} blocks x {s.block_size} positions x "
            f"{per_position} bytes = {need / 2**30:.1f} GiB ({s.slots} slots x "
            f"{s.context_tokens} positions of context); give it a budget with --kv-memory "
            "(e.g. 2G) or shorten --context"
        ) from None
    served_id = Path(loaded.model_dir).name if model_name is None else model_name
    # vLLM's model_name label on every series; --metrics-names vllm: vLLM's prefix too.
    metrics = Metrics(model_name=served_id, names=metrics_names)
    metrics.cache_config(
        sched_config.block_size, sched_config.num_blocks, sched_config.prefix_cache
    )
    metrics.scheduler_config(
        sched_config.slots,
        sched_config.chunk_tokens,
        sched_config.step_rows,
        sched_config.stall_rows,
        policy_name(sched_config.policy),
    )
    tokenizer = loaded.tokenizer
    observer: Any = metrics
    publisher = None
    if kv_events is not None:  # a kvevents.KVEventsConfig (issue 25)
        from triollm.server.kvevents import KVEventsFeed

        sched_config = dataclasses.replace(sched_config, kv_events=True)
    scheduler = Scheduler(sched_config)
    if kv_events is not None:
        try:
            publisher = kv_events.publisher(served_id)
        except ImportError:
            raise UserError(
                "--kv-events-endpoint needs pyzmq and msgpack: pip install -e '.[events]'"
            ) from None
        # The first batch tells a router to forget what an earlier process on this
        # address had cached (the manager records it; the first step publishes it).
        scheduler.kv.clear_cache()
        observer = KVEventsFeed(metrics, scheduler.kv.drain_events, publisher)
    service = Service(
        scheduler,
        batch,
        detokenizer=partial(IncrementalDetokenizer, tokenizer),
        token_texts=tokenizer,
        config=service_config,
        observer=observer,
    )
    metrics.bind(service.scheduler.statistics, lambda: service.internal_running)
    served = ServedModel(
        id=served_id,
        tokenizer=tokenizer,
        # /v1/models' max_model_len: the largest request this server admits, which
        # a pool smaller than slots x context makes less than the context.
        context_tokens=sched_config.largest_request,
        created=int(time.time()),
        eos_token_ids=eos_token_ids(tokenizer, cfg),
        model_vocab_size=cfg.vocab_size,
        # Built once (a few ms for a 50k vocabulary, more for 150k); every grammar a
        # request compiles is checked against it.
        grammars=GrammarCache(ConstraintTokenizer.from_tokenizer(tokenizer, cfg.vocab_size)),
        tool_format=tool_call_parser or detect_format(tokenizer.chat_templates.get("default")),
    )
    sc, q = sched_config, service_config
    report = MemoryReport(
        weight_bytes=loaded.weight_bytes,
        kv_bytes_per_position=per_position,
        kv_dtype=capacity.kv_dtype,
        scheduler=sched_config,
        lines=(
            f"queue: {sc.slots} slots x {q.queue_depth_per_slot} = "
            f"{sc.slots * q.queue_depth_per_slot} waiters, wait budget {q.queue_wait_s:g} s; "
            f"stream buffer {q.stream_buffer_steps} steps",
            f"step: up to {sc.step_rows} rows; prefill chunk {sc.chunk_tokens} tokens, "
            f"{sc.stall_rows} rows a step while any sequence decodes; "
            f"policy {policy_name(sc.policy)}; prefix cache {'on' if sc.prefix_cache else 'off'}",
        ),
    )
    warm = list(tokenizer.encode("Hello")) or [0]
    if max_body_bytes is None:  # sized to the context: a bigger body cannot fit anyway
        max_body_bytes = body_limit_for(
            sched_config.largest_request, getattr(tokenizer, "max_chars_per_token", 1)
        )
    make_app = partial(
        create_app,
        service,
        served,
        metrics,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
        door=DoorPolicy.for_bind("127.0.0.1") if door is None else door,
        # /v1/embeddings: the served model's hidden states, pooled (model/embed.py), in
        # the pool's chunk and block layout
        embedder=Embedder(
            batch.model,
            pooling=pooling,
            chunk_tokens=sched_config.chunk_tokens,
            block_size=sched_config.block_size,
            kv_dtype=capacity.kv_dtype,
        ),
        facts=ModelFacts(family=cfg.model_type, size_bytes=loaded.weight_bytes),
    )

    def app_in(nursery: trio.Nursery) -> Lifetime:
        return make_app(drain_nursery=nursery)

    return Stack(
        service,
        app_in,
        metrics,
        served,
        report,
        warm,
        max_body_bytes=max_body_bytes,
        kv_publisher=publisher,
    )


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

    try:
        async with trio.open_nursery() as nursery:
            frontend = partial(serve_http, stack.service, stack.make_app, http, shutdown)

            async def service(*, task_status: trio.TaskStatus[Serving]) -> None:
                await stack.service.run(frontend, task_status=task_status)
                nursery.cancel_scope.cancel()  # the KV events' replay server ends with it

            if stack.kv_publisher is not None:
                nursery.start_soon(stack.kv_publisher.serve_replay)
            serving: Serving = await nursery.start(service)
            stack.app = serving.app
            await stack.service.warm_up(stack.warm_prompt, SamplingParams(temperature=0.0))
            task_status.started(serving.binds)
    finally:
        # The grammar sandbox's idle children (they would also exit with the process).
        if stack.served.grammars is not None:
            stack.served.grammars.close()
        if stack.kv_publisher is not None:
            stack.kv_publisher.close()


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
        if stack.served.grammars is not None:
            # A grammar sandbox child now, so the first constrained request does not
            # wait ~1 s for its start-up (model/grammar_sandbox.py). Not in serve_stack:
            # the test suite's hundred servers would each start one.
            await trio.to_thread.run_sync(stack.served.grammars.start)


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


def configs_from_args(args: argparse.Namespace) -> tuple[Capacity, ServiceConfig]:
    """The flags as config objects; an unset flag stays None so the config's own
    default (and its reason) applies. Raises :class:`UserError` naming the flag."""
    capacity = Capacity(
        slots=args.slots,
        block_size=args.block_size,
        context_tokens=args.context,
        num_blocks=args.kv_blocks,
        kv_memory_bytes=None if args.kv_memory is None else parse_size(args.kv_memory),
        chunk_tokens=args.chunk,
        stall_rows=args.stall_rows,
        step_rows=args.step_rows,
        policy=parse_policy(args.policy),
        prefix_cache=args.prefix_cache == "on",
        kv_dtype=KVDtype(args.kv_cache_dtype),
    )
    try:
        service_config = ServiceConfig(
            queue_depth_per_slot=args.queue_depth_per_slot,
            queue_wait_s=args.queue_wait,
            stream_buffer_steps=args.stream_buffer,
            max_tokens_default=args.max_tokens_default,
        )
    except ValueError as exc:
        raise UserError(flag_names(str(exc))) from None
    return capacity, service_config


def _kv_events(args: argparse.Namespace) -> Any:
    """The --kv-events-* flags as a kvevents.KVEventsConfig (None: no events)."""
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise UserError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    from triollm.server.kvevents import KVEventsConfig

    try:
        return KVEventsConfig(
            args.kv_events_endpoint,
            args.kv_events_replay_endpoint,
            encoding=args.kv_events_encoding,
            mode=args.kv_events_mode,
            topic_prefix=f"kv@{args.host}:{args.port}",
            topic=args.kv_events_topic,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not _is_loopback(args.host) and not args.public:
        raise UserError(
            f"--host {args.host} is not a loopback address; add --public to serve it "
            "(there is no authentication: anyone who can reach the port can use the model)"
        )
    if args.public and not args.api_key:
        print(
            "triollm: WARNING: --public: no authentication; anyone who can reach "
            f"{args.host}:{args.port} can use this server (add --api-key)",
            file=sys.stderr,
        )
    try:
        door = DoorPolicy.for_bind(
            args.host,
            api_key=args.api_key,
            open_paths=[p.strip() for p in args.open_paths.split(",") if p.strip()],
            allowed_origins=args.allowed_origins.split(","),
            allowed_hosts=args.allowed_hosts.split(","),
        )
    except ValueError as exc:  # an empty API key: refused at start-up (door.py says why)
        raise UserError(str(exc)) from None
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be 0-65535, got {args.port}")
    # A negative grace would end the drain before it began; a negative write
    # timeout would put every socket write's deadline in the past (every stream
    # aborted at its first byte). NaN compares false with everything: refused too.
    for name, value in (("write-timeout", args.write_timeout), ("grace", args.grace)):
        if not (value >= 0 and math.isfinite(value)):
            raise UserError(f"--{name} must be a number of seconds >= 0, got {value}")
    if args.model_name is not None and not args.model_name:
        raise UserError("--model-name must not be empty")
    capacity, service_config = configs_from_args(args)
    kv_events = _kv_events(args)  # refused before the model loads, not after
    from triollm.model.loader import load_model

    model_dir = _model_dir(args)
    started = time.monotonic()
    loaded = load_model(model_dir, quantize=args.quantize, exact_activations=args.exact_activations)
    stack = build_stack(
        loaded,
        capacity,
        service_config,
        tool_call_parser=ToolCallFormat(args.tool_call_parser) if args.tool_call_parser else None,
        model_name=args.model_name
        if args.model_name is not None
        else (None if _chosen_model_dir(args) is not None else DEMO_MODEL_NAME),
        door=door,
        metrics_names=args.metrics_names,
        kv_events=kv_events,
        pooling=Pooling(args.pooling),
    )
    print(
        f"triollm: loaded {model_dir} in {time.monotonic() - started:.1f} s\n"
        + "\n".join(f"  {line}" for line in stack.report.describe().splitlines()),
        file=sys.stderr,
    )
    problem = getattr(stack.served.tokenizer, "chat_template_problem", None)
    if problem:
        print(
            f"triollm: WARNING: {problem}\n  /v1/chat/completions will answer 500 "
            "chat_template_error (fix the template, or use /v1/completions)",
            file=sys.stderr,
        )
    http = HttpConfig(
        host=args.host,
        port=args.port,
        grace_s=args.grace,
        write_timeout_s=None if args.write_timeout == 0 else args.write_timeout,  # 0 = never
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
