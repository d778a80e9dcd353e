"""``triollm bench serve`` and ``triollm bench compare``: the CLI of the load generator.

``serve`` asks the server for its model (``GET /v1/models``) unless ``--model`` is
given, sends warm-up requests, then runs each level (every ``--concurrency``, then
every ``--rate``) and prints one table row per level as it ends; ``--json FILE``
appends one JSON line per level. ``--peer FILE`` prints ours / the peer's ratios at
the end, as ``compare`` does for two files already written.

Exit status: 0 when every request of every level completed without a protocol
problem, 1 otherwise (the table says what went wrong), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import ipaddress
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from triollm.bench.compare import metrics_for, ratio_table, read_jsonl
from triollm.bench.stats import LevelSummary
from triollm.bench.workload import WORDS, Api, Span, Workload
from triollm.errors import UserError

DEFAULT_URL = "http://127.0.0.1:8000"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True, metavar="WHAT")
    s = sub.add_parser(
        "serve",
        help="load an OpenAI-compatible server with streaming requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.set_defaults(_bench=run_serve)
    target = s.add_argument_group("target")
    target.add_argument("--url", default=DEFAULT_URL, help=f"server base URL ({DEFAULT_URL})")
    target.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --url (a benchmark is a load attack on whoever runs it)",
    )
    target.add_argument("--model", help="the 'model' to send (default: the server's first)")
    target.add_argument(
        "--api", choices=[a.value for a in Api], default="completions", help="(completions)"
    )
    target.add_argument("--label", help="this system's name in the results (default: the URL)")
    load = s.add_argument_group("load")
    load.add_argument(
        "--concurrency", default=None, help="closed loop at each of these, e.g. 1,4,8,16"
    )
    load.add_argument("--rate", default=None, help="open loop, Poisson, requests/s, e.g. 0.5,2")
    load.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default: --requests-per-stream x concurrency; 16 per rate)",
    )
    load.add_argument(
        "--requests-per-stream",
        type=int,
        default=4,
        help="closed loop without --requests: this many x the concurrency, at least 8 (4)",
    )
    load.add_argument("--duration", type=float, help="stop issuing after this many s per level")
    load.add_argument("--warmup", type=int, default=1, help="requests sent before measuring (1)")
    load.add_argument("--timeout", type=float, default=600.0, help="per-request timeout s (600)")
    work = s.add_argument_group("work")
    work.add_argument(
        "--prompt-tokens", default="32", help="prompt length, N or LO-HI for mixed (32)"
    )
    work.add_argument("--max-tokens", default="128", help="output length, N or LO-HI (128)")
    work.add_argument(
        "--prompt-kind",
        choices=["words", "ids"],
        default="words",
        help="completions prompts of common words' token ids (the server's /tokenize), "
        "or of random ids from --token-ids (words)",
    )
    work.add_argument(
        "--token-ids",
        default="20-255",
        help="--prompt-kind ids: range the prompt's token ids come from (20-255)",
    )
    work.add_argument(
        "--turns", type=int, default=0, help="multi-turn chats of this many turns (chat API)"
    )
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let the model stop early (by default every request runs to --max-tokens)",
    )
    work.add_argument(
        "--no-timings-per-token",
        dest="timings_per_token",
        action="store_false",
        help="do not ask llama-server for each chunk's token count (timings_per_token): "
        "to measure what asking costs; ITL then counts one token per chunk where that adds up",
    )
    work.add_argument("--seed", type=int, default=0, help="the workload's seed (0)")
    out = s.add_argument_group("output")
    out.add_argument("--json", type=Path, help="append one JSON line per level to this file")
    out.add_argument("--peer", type=Path, help="a peer's results file: print the ratios")
    out.add_argument("--no-progress", dest="progress", action="store_false")

    c = sub.add_parser("compare", help="ratios of two results files (ours / peer)")
    c.set_defaults(_bench=run_compare)
    c.add_argument("ours", type=Path)
    c.add_argument("peer", type=Path)


def run(args: argparse.Namespace) -> int:
    return int(args._bench(args))


# ----------------------------------------------------------------------------- checks


def check_url(url: str, allow_remote: bool) -> str:
    """The base URL without a trailing slash; a non-loopback host needs the flag."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--url: expected http://HOST:PORT, got {url!r}")
    host = parts.hostname
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback and not allow_remote:
        raise UserError(
            f"--url: {host} is not a loopback address; pass --allow-remote to load it anyway"
        )
    return url.rstrip("/")


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected a list like 1,4,8,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag}: every value must be >= 1, got {text!r}")
    return values


def rate_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected a list like 0.5,2, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"{flag}: every rate must be > 0 requests/s, got {text!r}")
    return values


def machine() -> dict[str, Any]:
    """What the figures were measured on (CPU model, cores, load)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "load_avg": load_avg()}


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ----------------------------------------------------------------------------- output


def _ms(d: dict[str, float | None], key: str) -> str:
    v = d.get(key)
    return "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


# ITL is per token (stats.py); "chunk gap" is the old per-chunk figure, beside it; "k>1"
# counts the chunks that carried more than one token (of the chunks that carried any).
TABLE_HEAD = (
    "| level | done | tok/s | stream tok/s p50 | TTFT p50 / p90 / p99 ms | TPOT p50 / p99 ms "
    "| ITL per token p50 / p90 / p99 ms | chunk gap p99 ms | k>1 chunks | e2e p50 ms "
    "| statuses | problems |"
)
TABLE_RULE = "| --- |" + " ---: |" * 9 + " --- | --- |"


def table_row(label: str, s: LevelSummary) -> str:
    statuses = ", ".join(f"{k}: {v}" for k, v in s.by_outcome.items())
    if s.retry_after:
        statuses += (
            " (Retry-After " + ", ".join(f"{k} x{v}" for k, v in s.retry_after.items()) + ")"
        )
    problems = ", ".join(f"{k}: {v}" for k, v in s.problems.items()) or "none"
    ttft = " / ".join(_ms(s.ttft_ms, p) for p in ("p50", "p90", "p99"))
    itl = " / ".join(_ms(s.itl_ms, p) for p in ("p50", "p90", "p99"))
    if s.itl_unplaced:
        itl += f" ({s.itl_unplaced} req. unplaced)"
    tpot = " / ".join(_ms(s.tpot_ms, p) for p in ("p50", "p99"))
    row = (
        f"| {label} | {s.ok}/{s.requests} | {s.aggregate_tok_s:.1f} | "
        f"{_ms(s.stream_tok_s, 'p50')} | {ttft} | {tpot} | {itl} | "
        f"{_ms(s.chunk_gap_ms, 'p99')} | "
        f"{s.multi_token_chunks}/{s.token_chunks} | {_ms(s.e2e_ms, 'p50')} | "
        f"{statuses} | {problems} |"
    )
    return row


def turn_lines(label: str, s: LevelSummary) -> list[str]:
    if not s.ttft_by_turn_ms:
        return []
    per_turn = ", ".join(f"{t}: {_ms(v, 'p50')}" for t, v in s.ttft_by_turn_ms.items())
    return [
        f"{label}: TTFT p50 ms by turn: {per_turn}; "
        f"last turn p50 {_ms(s.last_turn_ttft_ms, 'p50')} p90 {_ms(s.last_turn_ttft_ms, 'p90')}"
    ]


def step_lines(label: str, steps: dict[str, dict[str, float]] | None, s: LevelSummary) -> list[str]:
    """The server's own mean decode step beside the client's ITL: the difference is
    what the path around the step (hand-off, SSE, the client) adds to a token."""
    decode = (steps or {}).get("decode")
    if decode is None:
        return []
    itl = s.itl_ms.get("mean")
    line = (
        f"{label}: server decode step mean {decode['mean_ms']:.2f} ms ({decode['steps']:.0f} steps)"
    )
    if itl is not None:
        line += f"; ITL mean {itl:.2f} ms, {itl - decode['mean_ms']:.2f} ms around the step"
    return [line]


# ----------------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    import trio

    return int(trio.run(serve_main, args))


async def serve_main(args: argparse.Namespace) -> int:
    try:
        import httpx
        import httpx_sse  # noqa: F401  (client.py's SSE reader)
        from tqdm import tqdm
    except ImportError as exc:
        raise UserError(f"triollm bench needs {exc.name}: pip install 'triollm[bench]'") from None

    from triollm.bench.client import read_step_totals, step_means_ms
    from triollm.bench.load import Level, run_level
    from triollm.bench.stats import summarise

    base = check_url(args.url, args.allow_remote)
    api = Api(args.api)
    if args.turns:
        api = Api.CHAT
    concs = int_list(args.concurrency, "--concurrency") if args.concurrency else []
    rates = rate_list(args.rate, "--rate") if args.rate else []
    if not concs and not rates:
        concs = [1]
    if args.requests is not None and args.requests < 1:
        raise UserError(f"--requests must be >= 1, got {args.requests}")
    if args.requests_per_stream < 1:
        raise UserError(f"--requests-per-stream must be >= 1, got {args.requests_per_stream}")
    per = max(args.turns, 1)
    levels = [
        Level(
            args.requests or max(8, args.requests_per_stream * c) * per,
            concurrency=c,
            duration_s=args.duration,
        )
        for c in concs
    ] + [Level(args.requests or 16 * per, rate=r, duration_s=args.duration) for r in rates]

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await _first_model(client, base)
        words: tuple[tuple[int, ...], ...] = ()
        if api is Api.COMPLETIONS and args.prompt_kind == "words":
            from triollm.bench.client import word_ids

            words = await word_ids(client, base, WORDS)
        workload = Workload(
            api=api,
            model=model,
            prompt_tokens=Span.parse(args.prompt_tokens, "--prompt-tokens"),
            max_tokens=Span.parse(args.max_tokens, "--max-tokens"),
            token_ids=Span.parse(args.token_ids, "--token-ids", minimum=0),
            turns=args.turns,
            ignore_eos=args.ignore_eos,
            word_ids=words,
            timings_per_token=args.timings_per_token,
            seed=args.seed,
        )
        # Both servers must get the same prompts: the same words' ids (one GGUF, one
        # tokenizer). The digest in every result line lets the tables check it.
        words_digest = hashlib.sha256(json.dumps(words).encode()).hexdigest()[:12]
        label = args.label or base
        print(
            f"# {label}: {api.path}, model {model}, prompt {workload.prompt_tokens} tokens, "
            f"max_tokens {workload.max_tokens}"
            + (f", prompts of words ({words_digest})" if words else "")
            + (f", {args.turns}-turn chats" if args.turns else ""),
            flush=True,
        )
        if args.warmup:
            warm = Level(args.warmup * per, concurrency=1)
            await run_level(client, base, workload, warm, level_seed=-1)
        print(TABLE_HEAD)
        print(TABLE_RULE, flush=True)
        results: list[dict[str, Any]] = []
        after_table: list[str] = []  # multi-turn TTFT per turn, below the table
        clean = True
        for n, level in enumerate(levels):
            before = machine()
            steps_before = await read_step_totals(client, base)
            with tqdm(
                total=level.requests,
                desc=level.label,
                unit="req",
                file=sys.stderr,
                leave=False,
                disable=not args.progress,
            ) as bar:
                records = await run_level(
                    client, base, workload, level, level_seed=n, on_done=lambda r: bar.update()
                )
            s = summarise(records)
            server_steps = step_means_ms(steps_before, await read_step_totals(client, base))
            clean = clean and s.ok == s.requests and not s.problems
            print(table_row(level.label, s), flush=True)
            after_table += turn_lines(level.label, s)
            after_table += step_lines(level.label, server_steps, s)
            record = {
                "tool": "triollm bench serve",
                "system": label,
                "row": level.label,
                "mode": level.mode,
                "concurrency": level.concurrency,
                "rate": level.rate,
                "url": base,
                "api": api.value,
                "model": model,
                "prompt_tokens": str(workload.prompt_tokens),
                "max_tokens": str(workload.max_tokens),
                "turns": args.turns,
                "prompt_kind": "words" if words else "ids" if api is Api.COMPLETIONS else "chat",
                "prompt_words_digest": words_digest if words else None,
                "timings_per_token": workload.timings_per_token,
                "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "machine": before,
                "load_avg_end": load_avg(),
                # The server's own mean step time per kind during the level (triollm's
                # /metrics), beside which the ITL shows what the server path adds.
                "server_step_ms": server_steps,
                **s.to_json(),
            }
            results.append(record)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        if after_table:
            print()
            print("\n".join(after_table))
        for r in results:
            for kind, detail in r["problem_examples"].items():
                print(f"  {r['row']}: {kind}, e.g. {detail}", file=sys.stderr)
    if args.peer:
        peer = read_jsonl(args.peer)
        print()
        print(ratio_table(results, peer, metrics_for(results), ours_name=label, peer_name="peer"))
    return 0 if clean else 1


async def _first_model(client: Any, base: str) -> str:
    import httpx

    try:
        r = await client.get(base + "/v1/models")
    except httpx.HTTPError as exc:
        raise UserError(f"--url: cannot reach {base}/v1/models ({type(exc).__name__})") from None
    try:
        models = r.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise UserError(
            f"{base}/v1/models answered {r.status_code} without a model list; pass --model"
        ) from None


def run_compare(args: argparse.Namespace) -> int:
    ours, peer = read_jsonl(args.ours), read_jsonl(args.peer)
    names = (
        ours[0].get("system", "ours") if ours else "ours",
        peer[0].get("system", "peer") if peer else "peer",
    )
    print(ratio_table(ours, peer, metrics_for(ours), ours_name=names[0], peer_name=names[1]))
    return 0
