"""Replicas behind Envoy on loopback: scaling, a replica's death, prefix routing.

``python bench/bench_cluster.py [--scenario NAME ...]`` (``just bench-cluster``)
starts a cluster (src/triollm/cluster/supervise.py: N ``triollm serve`` processes on
127.0.0.11, .12, ... and Envoy on 127.0.0.1:8080) and measures, with the demo model
unless ``--model`` says otherwise. Every loop is bounded (a request count and a
deadline). Scenarios:

- ``scale``: one replica alone (straight to its port) at C streams against two
  replicas behind Envoy at 2C, alternating for ``--rounds`` rounds; each replica
  runs ``--threads`` numba threads (1: a core each). Aggregate tokens/s and the
  ratio, and each process's CPU (replicas, Envoy, this client, the rest of the
  host) with tokens per replica-CPU-second. Answers come whole by default: the
  client shares the cores it measures, and a streamed answer costs it (and Envoy)
  an event per token.
- ``sigterm``: two replicas under load; replica 0 gets SIGTERM mid-load. Every
  request must succeed (drain: in-flight streams finish; /ready turns 503 and the
  health check takes it out; a 503 ``shutting_down`` in between is retried on the
  other). The supervisor starts it again; it must rejoin.
- ``sigkill``: the same with SIGKILL. Requests not yet streaming must succeed
  through Envoy's retry; streams cut mid-way are counted, each with the error the
  client saw; none may hang. Then it must rejoin and take requests again.
- ``prefix``: round robin against prefix_hash (Envoy's consistent hash on the
  prompt's opening) on conversations that share long system prompts: prefix-cache
  hit rate from the replicas' own counters, and TTFT p50.
- ``events`` (only when named): the KV events soak. One server in this process with
  a pool that evicts, a live subscriber rebuilding its cache from the events, waves
  of shared-prompt requests for ``--soak-s``; after each wave the rebuilt state must
  equal the pool's published set, with no ordering violation and no sequence gap.

Prints one block per scenario; ``--json FILE`` appends one JSON line each. Exit 1
when a promise broke (a failed or hung request where none may be). The machine is
shared: figures are labelled with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from triollm.cluster.load import (
    WORDS,
    CpuMeter,
    Result,
    closed_loop,
    counts,
    percentile,
    scrape,
    series,
    story_body,
)
from triollm.cluster.supervise import Cluster, ClusterConfig, spawn, wait_for

Record = dict[str, Any]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


ENVOY_COUNTERS = (
    "upstream_rq_retry",  # requests Envoy sent again
    "upstream_rq_retry_success",  # ... and the retry answered
    "upstream_rq_503",
    "upstream_cx_connect_fail",
    "outlier_detection.ejections_enforced_total",
)


async def envoy_counters(cluster: Cluster) -> dict[str, int]:
    """Envoy's own counts for the replicas' cluster (its admin /stats)."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(cluster.admin_url + "/stats?filter=^cluster.triollm.")).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        short = name.removeprefix("cluster.triollm.")
        if short in ENVOY_COUNTERS:
            out[short] = int(value)
    return out


def logs(args: argparse.Namespace, name: str) -> Path | None:
    """Where a scenario's cluster keeps its logs (``--log-dir``; None: a temporary
    directory, deleted when the cluster stops)."""
    return None if args.log_dir is None else args.log_dir / name


def tokens_per_s(results: list[Result], wall: float) -> float:
    return sum(r.tokens for r in results if r.outcome == "ok") / wall


async def warm(url: str, n: int = 4) -> None:
    await closed_loop(url, n, n, lambda rng: story_body(rng, 4), deadline_s=120)


def cores(used: dict[str, float], names: list[str]) -> str:
    """``name 0.97`` per process: its CPU seconds over the wall time (1.00 = a core)."""
    return ", ".join(f"{n} {used[n] / used['wall']:.2f}" for n in names)


async def scale(args: argparse.Namespace) -> Record:
    """One replica alone at C streams against two behind Envoy at 2C, alternating.

    Besides the rate, every level reads each process's CPU time (/proc/PID/stat)
    before and after: the replicas, Envoy, this process (the load client and the
    supervisor) and the machine's busy time nobody here accounts for (``other``).
    On a 2-core host the harness shares the cores with the replicas it measures;
    these figures say how much it took, and ``tokens per replica-CPU-second`` says
    how the servers themselves scale, apart from the cores they were given."""
    c = args.concurrency
    config = ClusterConfig(
        replicas=2,
        model=args.model,
        threads=args.threads,
        lb="least_request",
        log_dir=logs(args, "scale"),
    )
    stream = args.scale_client == "stream"
    max_tokens = args.scale_max_tokens
    rounds: list[dict[str, Any]] = []
    async with trio.open_nursery() as nursery:
        cluster: Cluster = await nursery.start(Cluster(config).run)
        one = cluster.replicas[0].url
        await warm(one)
        await warm(cluster.replicas[1].url)
        assert cluster.envoy is not None
        pids = {f"replica{r.index}": r.process.pid for r in cluster.replicas if r.process}
        pids |= {"envoy": cluster.envoy.pid, "client": os.getpid()}
        names = [*pids, "other"]
        for k in range(args.rounds):
            body = lambda rng: story_body(rng, max_tokens, stream=stream)  # noqa: E731
            levels = {}
            for level, url, n in (
                ("one", one + "/v1/completions", 1),
                ("two", cluster.url + "/v1/completions", 2),
            ):
                meter = CpuMeter(pids)
                meter.start()
                results, _ = await closed_loop(url, n * c, n * args.scale_requests, body, seed=k)
                used = meter.stop()
                tokens = sum(r.tokens for r in results if r.outcome == "ok")
                replica_cpu = sum(used[f"replica{i}"] for i in range(n))
                levels[level] = {
                    "tokens": tokens,
                    "tok_s": tokens / used["wall"],
                    "failed": len(results) - counts(results)["ok"],
                    "cpu_s": used,
                    # the servers' own efficiency, whatever share of the cores they got
                    "tok_per_replica_cpu_s": tokens / replica_cpu if replica_cpu else 0.0,
                    "replica_cores": replica_cpu / used["wall"],
                }
            r = {
                "one": levels["one"],
                "two": levels["two"],
                "ratio": levels["two"]["tok_s"] / levels["one"]["tok_s"],
                # ratio = server_scaling x core_ratio (tokens = efficiency x CPU seconds)
                "server_scaling": levels["two"]["tok_per_replica_cpu_s"]
                / levels["one"]["tok_per_replica_cpu_s"],
                "core_ratio": levels["two"]["replica_cores"] / levels["one"]["replica_cores"],
                "load": loadavg(),
            }
            rounds.append(r)
            one_l, two_l = levels["one"], levels["two"]
            print(
                f"  round {k + 1}: 1 replica {one_l['tok_s']:.1f} tok/s (c={c}), "
                f"2 behind Envoy {two_l['tok_s']:.1f} tok/s (c={2 * c}): {r['ratio']:.2f}x "
                f"= server scaling {r['server_scaling']:.2f} x replica cores "
                f"{two_l['replica_cores']:.2f}/{one_l['replica_cores']:.2f} [load {r['load']}]\n"
                f"    1 replica : cores {cores(one_l['cpu_s'], names)}; "
                f"{one_l['tok_per_replica_cpu_s']:.0f} tok per replica-CPU-s\n"
                f"    2 replicas: cores {cores(two_l['cpu_s'], names)}; "
                f"{two_l['tok_per_replica_cpu_s']:.0f} tok per replica-CPU-s",
                flush=True,
            )
        cluster.stop()

    def median(key: str) -> float:
        values = sorted(float(r[key]) for r in rounds)
        return values[len(values) // 2]

    each = ", ".join(f"{r['ratio']:.2f}" for r in rounds)
    print(
        f"  scale ({'streamed' if stream else 'whole'} answers of {max_tokens} tokens): "
        f"2 replicas / 1 replica, median {median('ratio'):.2f}x of rounds {each}; "
        f"server scaling (tokens per replica-CPU-s, 2 vs 1) median "
        f"{median('server_scaling'):.2f}, replica cores median {median('core_ratio'):.2f}x "
        "(the target: >= 1.8x; a verdict only on a quiet machine)",
        flush=True,
    )
    return {
        "scenario": "scale",
        "client": args.scale_client,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "median_ratio": median("ratio"),
        "median_server_scaling": median("server_scaling"),
        "median_core_ratio": median("core_ratio"),
    }


async def failover(args: argparse.Namespace, sig: signal.Signals) -> Record:
    """Two replicas at ``2 x --concurrency`` streams; ``sig`` to replica 0 after a
    third of the requests; then wait for it to rejoin and check it serves again."""
    c = 2 * args.concurrency
    total = 3 * args.requests * 2
    config = ClusterConfig(
        replicas=2,
        model=args.model,
        threads=args.threads,
        grace_s=args.grace,
        log_dir=logs(args, sig.name.lower()),
    )
    async with trio.open_nursery() as nursery:
        cluster: Cluster = await nursery.start(Cluster(config).run)
        for r in cluster.replicas:
            await warm(r.url)
        victim = cluster.replicas[0]
        killed_at: list[float] = []
        seen = 0

        def on_result(_: Result) -> None:
            nonlocal seen
            seen += 1
            if seen == total // 3 and victim.process is not None:
                victim.process.send_signal(sig)
                killed_at.append(time.perf_counter())

        body = lambda rng: story_body(rng, args.max_tokens)  # noqa: E731
        results, wall = await closed_loop(
            cluster.url + "/v1/completions",
            c,
            total,
            body,
            seed=int(sig),
            idle_timeout_s=args.idle_timeout,
            on_result=on_result,
        )
        started = time.perf_counter()
        await cluster.wait_restarted(0, 2)
        rejoin_s = time.perf_counter() - (killed_at[0] if killed_at else started)
        before = series(await scrape(victim.url), "triollm:request_success_total")
        after_results, _ = await closed_loop(
            cluster.url + "/v1/completions", c, 4 * c, body, seed=99
        )
        page = await scrape(victim.url)
        served_after = series(page, "triollm:request_success_total") - before
        retries = await envoy_counters(cluster)
        cluster.stop()
    n = counts(results)
    cut_details = sorted({r.detail.split(":")[0] for r in results if r.outcome == "cut"})
    return {
        "scenario": sig.name.lower(),
        "requests": len(results),
        "wall_s": wall,
        **n,
        "cut_errors": cut_details,
        "other_errors": sorted(
            {
                f"{r.outcome} {r.status}: {r.detail[:120]}"
                for r in results
                if r.outcome not in ("ok", "cut")
            }
        ),
        "exit_codes": victim.exits,
        "envoy": retries,
        "rejoined_after_s": rejoin_s,
        "after_rejoin_ok": counts(after_results)["ok"],
        "after_rejoin_requests": len(after_results),
        "restarted_replica_served": served_after,
    }


VLLM_ROUTER_PORT = 30000
KV_EVENTS_PORT = 5557  # each replica on its own address, so every one uses vLLM's port
KV_REPLAY_PORT = 5558
# Each replica substitutes its own address for {host} (ClusterConfig formats it).
# vllm-router (0.1.17) decodes only the map encoding, and its static sources take
# only messages whose topic is exactly vLLM's default, the empty one: under llm-d's
# kv@host:port@model it credited 0 tokens on every request.
KV_EVENT_SERVE_ARGS = (
    "--kv-events-endpoint",
    f"tcp://{{host}}:{KV_EVENTS_PORT}",
    "--kv-events-replay-endpoint",
    f"tcp://{{host}}:{KV_REPLAY_PORT}",
    "--kv-events-mode",
    "bind",
    "--kv-events-encoding",
    "map",
    "--kv-events-topic",
    "",
)


def moved(after: list[dict[str, float]], before: list[dict[str, float]], name: str) -> list[float]:
    """How far series ``name`` moved on each replica between two scrapes."""
    return [series(a, name) - series(b, name) for a, b in zip(after, before, strict=True)]


def kv_aware_args(cluster: Cluster, policy: str) -> list[str]:
    """vllm-router's kv_aware flags: each replica's KV events address, the block
    size and the model (the replicas' --kv-events-* flags are KV_EVENT_SERVE_ARGS)."""
    if policy != "kv_aware":
        return []
    out = ["--kv-event-block-size", "32", "--kv-event-model", "triollm-demo"]
    for r in cluster.replicas:
        out += ["--kv-event-source", f"{r.url}=tcp://{r.endpoint.host}:{KV_EVENTS_PORT}"]
        out += ["--kv-event-replay-source", f"{r.url}=tcp://{r.endpoint.host}:{KV_REPLAY_PORT}"]
    return out


async def start_vllm_router(cluster: Cluster, policy: str) -> tuple[Any, str]:
    """vllm-router (the PyPI wheel's binary) on 127.0.0.1:30000 over the replicas;
    returns the process and its URL once it answers."""
    import shutil

    binary = shutil.which("vllm-router")
    if binary is None:
        raise SystemExit("vllm-router is not installed (pip install vllm-router)")
    assert cluster.log_dir is not None
    log = open(cluster.log_dir / f"vllm-router-{policy}.log", "ab")  # noqa: SIM115
    proc = spawn(
        [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(VLLM_ROUTER_PORT),
            "--policy",
            policy,
            "--worker-urls",
            *(r.url for r in cluster.replicas),
            *kv_aware_args(cluster, policy),
        ],
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{VLLM_ROUTER_PORT}"
    async with httpx.AsyncClient(timeout=2) as client:
        for _ in range(240):  # bounded: two minutes
            if proc.poll() is not None:
                raise SystemExit(f"vllm-router exited {proc.returncode}; see {log.name}")
            try:
                if (await client.get(url + "/v1/models")).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            await trio.sleep(0.5)
    proc.kill()
    raise SystemExit(f"vllm-router did not answer in two minutes; see {log.name}")


SYSTEM_TOPICS = (
    "a lighthouse keeper",
    "a baker in a mountain village",
    "a fox who collects buttons",
    "a ship's cat",
    "an old clockmaker",
    "a girl who talks to rivers",
    "a robot gardener",
    "a bear who cannot sleep",
    "a tailor on a windy island",
    "twin kites",
    "a librarian of lost maps",
    "a snail racing the seasons",
    "a postman on the moon",
    "a choir of frogs",
    "a painter who sees sounds",
    "a tugboat in the fog",
)


def system_prompt(topic: str, sentences: int) -> str:
    rng = random.Random(topic)
    words = [
        " ".join(rng.choice(("quiet", "small", "bright", "old", "kind")) for _ in range(2))
        for _ in range(sentences)
    ]
    return f"You tell stories about {topic}. " + " ".join(
        f"The {w} {topic.split()[-1]} walked on." for w in words
    )


async def prefix(args: argparse.Namespace) -> Record:
    prompts = [system_prompt(t, args.system_sentences) for t in SYSTEM_TOPICS[: args.systems]]

    def body(rng: random.Random) -> dict[str, Any]:
        system = rng.choice(prompts)
        return {
            "prompt": system
            + "\nOnce upon a time "
            + " ".join(rng.choice(("river", "stone", "lamp", "cake", "hill")) for _ in range(6)),
            "max_tokens": args.max_tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    out: Record = {"scenario": "prefix", "systems": args.systems}
    for lb in args.prefix_lbs.split(","):
        # "vllm-router:POLICY": vllm-router (PyPI) in front of the replicas instead of
        # Envoy, straight to their ports.
        router_policy = lb.split(":", 1)[1] if lb.startswith("vllm-router:") else None
        serve_args = tuple(args.prefix_serve_args.split())
        if router_policy == "kv_aware":  # vllm-router reads the map encoding
            serve_args += KV_EVENT_SERVE_ARGS
        config = ClusterConfig(
            replicas=2,
            model=args.model,
            threads=args.threads,
            lb="round_robin" if router_policy else lb,
            serve_args=serve_args,
            log_dir=logs(args, "prefix-" + lb.replace(":", "-")),
        )
        async with trio.open_nursery() as nursery:
            cluster: Cluster = await nursery.start(Cluster(config).run)
            for r in cluster.replicas:
                await warm(r.url)
            pages = [await scrape(r.url) for r in cluster.replicas]
            url = cluster.url
            router = None
            if router_policy is not None:
                router, url = await start_vllm_router(cluster, router_policy)
            try:
                results, wall = await closed_loop(
                    url + "/v1/completions",
                    2 * args.concurrency,
                    2 * args.requests,
                    body,
                    seed=7,
                )
            finally:
                if router is not None:
                    router.terminate()
                    await wait_for(router)
            after = [await scrape(r.url) for r in cluster.replicas]
            cluster.stop()

        hits = sum(moved(after, pages, "triollm:prefix_cache_hits_total"))
        queries = sum(moved(after, pages, "triollm:prefix_cache_queries_total"))
        split = moved(after, pages, "triollm:request_success_total")
        ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
        out[lb] = {
            "hit_rate": hits / queries if queries else 0.0,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90),
            "tok_s": tokens_per_s(results, wall),
            "ok": counts(results)["ok"],
            "requests": len(results),
            "per_replica": split,
            "load": loadavg(),
        }
        print(f"  {lb}: {json.dumps(out[lb])}", flush=True)
    return out


class LiveSubscriber:
    """A router's view of one server, kept as a router keeps it: a SUB socket on the
    PUB address, every batch applied as it arrives (a thread: ZMQ blocks). What it
    missed before its subscription took effect (ZMQ's slow joiner) comes from the
    replay socket, asked once, at its first live message."""

    def __init__(self, pub_address: str, replay_address: str) -> None:
        from triollm.server.kvevents import CacheIndex

        self.pub_address = pub_address
        self.replay_address = replay_address
        self.index = CacheIndex()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.replayed = 0  # batches taken from the replay socket at the start
        self.live = 0  # batches taken from the PUB socket

    def run(self) -> None:
        import zmq

        from triollm.server.kvevents import fetch_replay

        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.pub_address)
        try:
            while not self.stop.is_set():
                if not sub.poll(100):
                    continue
                _topic, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                with self.lock:
                    if self.live == 0 and seq > 0:
                        for s, p in fetch_replay(self.replay_address, 0):
                            if s < seq:
                                self.index.apply_message(s, p)
                                self.replayed += 1
                    self.index.apply_message(seq, payload)
                    self.live += 1
        finally:
            sub.close()


async def events(args: argparse.Namespace, loaded: Any = None) -> Record:
    """The KV events over a soak: one server in this process (so its pool can be read)
    with a pool too small for the system prompts in use, publishing on loopback.

    Waves of requests run until ``--soak-s``: shared system prompts, one request in
    four with ``n=2`` (choices share the prompt's blocks), one in eight left by its
    client after the first chunk (its blocks freed mid-answer). After every wave, once
    the pool is idle and the subscriber has every batch published so far, the rebuilt
    index must equal the pool's published set exactly, with no block announced under a
    parent it never saw and no sequence gap."""
    from triollm.demo import resolve_model_dir
    from triollm.model.loader import load_model
    from triollm.server.command import build_stack, serve_stack
    from triollm.server.frontend import HttpConfig
    from triollm.server.kvevents import KVEventsConfig, hash63
    from triollm.service import ServiceConfig
    from triollm.sizing import Capacity

    if loaded is None:  # (a test passes the model it loaded once for both encodings)
        loaded = load_model(resolve_model_dir(args.model))
    kv = KVEventsConfig(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", encoding=args.soak_encoding, mode="bind"
    )
    stack = build_stack(
        loaded,
        Capacity(slots=4, num_blocks=args.soak_blocks, context_tokens=512),
        ServiceConfig(),
        kv_events=kv,
        model_name="soak",
    )
    publisher = stack.kv_publisher
    subscriber = LiveSubscriber(publisher.pub_address, publisher.replay_address)
    reader = threading.Thread(target=subscriber.run, daemon=True)
    reader.start()
    prompts = [system_prompt(t, args.system_sentences) for t in SYSTEM_TOPICS[: args.systems]]
    pool = stack.service.scheduler.kv.pool
    waves = requests = left = mismatches = 0
    transport_errors: list[str] = []
    shutdown = trio.Event()
    started = time.perf_counter()

    def pool_idle() -> bool:
        s = stack.service.scheduler.statistics()
        return s.blocks_free == s.blocks_total and s.running == 0 and s.waiting == 0

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve_stack, stack, HttpConfig(port=0, grace_s=5), shutdown)
        url = binds[0] + "/v1/completions"
        rng = random.Random(11)
        # Pooled connections expire before the server's 5 s keep-alive does, so the
        # client never reuses one the server is closing between waves.
        limits = httpx.Limits(keepalive_expiry=2.0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:

            async def one(k: int) -> None:
                nonlocal requests, left
                body = {
                    "prompt": rng.choice(prompts) + " Once upon a time " + rng.choice(WORDS),
                    "max_tokens": rng.randrange(2, 12),
                    "temperature": 0.8,
                    "ignore_eos": True,
                    "stream": True,
                    "n": 2 if k % 4 == 0 else 1,
                }
                requests += 1
                try:
                    async with http.stream("POST", url, json=body) as response:
                        async for _ in response.aiter_lines():
                            if k % 8 == 3:  # a client that leaves after the first chunk
                                left += 1
                                return
                except httpx.TransportError as exc:
                    # The load is only the means: a request that fails in transport
                    # (counted, shown) changes nothing the soak checks, which is the
                    # events against the pool.
                    transport_errors.append(f"{type(exc).__name__}: {exc}")

            while time.perf_counter() - started < args.soak_s:
                async with trio.open_nursery() as wave:
                    for k in range(args.concurrency * 4):
                        wave.start_soon(one, k)
                await stack.service.wait_until(pool_idle)
                target = publisher.next_seq - 1
                with trio.fail_after(60):  # a hang guard: every batch reaches the subscriber
                    while subscriber.index.last_seq < target:
                        await trio.sleep(0.01)
                published = {pool.content(b) for b in range(pool.num_blocks)} - {None}
                with subscriber.lock:
                    if set(subscriber.index.blocks) != {hash63(h) for h in published}:
                        mismatches += 1
                waves += 1
        shutdown.set()
    subscriber.stop.set()
    reader.join(timeout=5)
    index = subscriber.index
    return {
        "scenario": "events",
        "encoding": args.soak_encoding,
        "seconds": time.perf_counter() - started,
        "waves": waves,
        "requests": requests,
        "clients_left_early": left,
        "transport_errors": len(transport_errors),
        "transport_errors_sample": transport_errors[:3],
        "batches": index.batches,
        "events_published": publisher.published_events,
        "replayed_at_start": subscriber.replayed,
        "ordering_violations": len(index.violations),
        "violations_sample": index.violations[:5],
        "sequence_gaps": index.gaps,
        "dropped_batches": publisher.dropped_batches,
        "state_mismatches": mismatches,
        "blocks_at_end": len(index.blocks),
        "blocks_removed": index.removed,
        "pool_blocks": pool.num_blocks,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scenario",
        action="append",
        choices=("scale", "sigterm", "sigkill", "prefix", "events"),
        help="(scale, sigterm, sigkill, prefix; events only when named)",
    )
    p.add_argument("--model", help="MODEL_DIR for every replica (default: the demo model)")
    p.add_argument("--threads", type=int, default=1, help="numba threads per replica (1)")
    p.add_argument("--concurrency", type=int, default=4, help="streams per replica (4)")
    p.add_argument("--requests", type=int, default=24, help="requests per replica per level (24)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (48)")
    p.add_argument("--rounds", type=int, default=3, help="scale: alternating rounds (3)")
    p.add_argument(
        "--scale-client",
        choices=("whole", "stream"),
        default="whole",
        help="scale: answers sent whole (one JSON each: the light client) or streamed "
        "(an event per token, parsed in Python, forwarded by Envoy) (whole)",
    )
    p.add_argument(
        "--scale-max-tokens", type=int, default=128, help="scale: tokens per answer (128)"
    )
    p.add_argument(
        "--scale-requests",
        type=int,
        default=64,
        help="scale: requests per replica per level (64: long enough that the ramp and "
        "the tail of the closed loop are a small part of each level)",
    )
    p.add_argument("--grace", type=float, default=30.0, help="each replica's drain (30 s)")
    p.add_argument(
        "--idle-timeout", type=float, default=60.0, help="a stream silent this long: hung"
    )
    p.add_argument("--systems", type=int, default=16, help="prefix: distinct system prompts (16)")
    p.add_argument("--system-sentences", type=int, default=24, help="prefix: their length (24)")
    p.add_argument(
        "--prefix-serve-args",
        default="--kv-blocks 96",
        help="prefix: the replicas' flags (a pool too small for every system prompt at once)",
    )
    p.add_argument(
        "--prefix-lbs",
        default="round_robin,prefix_hash",
        help="prefix: the Envoy policies compared, in order (round_robin,prefix_hash)",
    )
    p.add_argument("--soak-s", type=float, default=300.0, help="events: soak length (300 s)")
    p.add_argument(
        "--soak-blocks", type=int, default=48, help="events: the server's pool in blocks (48)"
    )
    p.add_argument(
        "--soak-encoding", choices=("array", "map"), default="array", help="events: (array)"
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        help="keep every cluster's logs here, one directory per scenario (Envoy's access "
        "log says which replica answered each request and how it ended)",
    )
    p.add_argument("--json", type=Path, help="append one JSON line per scenario")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    scenarios = args.scenario or ["scale", "sigterm", "sigkill", "prefix"]
    broken = False

    async def run_all() -> None:
        nonlocal broken
        for name in scenarios:
            print(f"{name} [load {loadavg()}]", flush=True)
            began = time.perf_counter()
            if name == "scale":
                record = await scale(args)
            elif name == "prefix":
                record = await prefix(args)
            elif name == "events":
                record = await events(args)
                wrong = ("ordering_violations", "sequence_gaps", "state_mismatches")
                broken |= any(record[k] for k in wrong) or record["waves"] == 0
            else:
                sig = signal.SIGTERM if name == "sigterm" else signal.SIGKILL
                record = await failover(args, sig)
                # SIGTERM: nothing may fail. SIGKILL: only streams already cut may.
                bad = record["failed"] + record["hung"] + record["refused"]
                if sig is signal.SIGTERM:
                    bad += record["cut"]
                broken |= bad > 0 or record["after_rejoin_ok"] != record["after_rejoin_requests"]
            record["load_after"] = loadavg()
            record["scenario_s"] = round(time.perf_counter() - began, 1)
            print(json.dumps(record), flush=True)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps(record) + "\n")

    try:
        trio.run(run_all)
    except httpx.HTTPError as exc:
        print(f"bench_cluster: {exc}", file=sys.stderr)
        return 1
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
