"""Prometheus metrics, vLLM-style names under the ``triollm:`` prefix.

Every :class:`Metrics` owns its own ``CollectorRegistry``. The process-global
default registry would make two services in one process (the test suite starts
many) collide on metric names, and would leak series between tests.

Gauges that mirror scheduler state (running, waiting, KV blocks) are computed
at scrape time from a ``statistics()`` callback, so they can never drift from
the truth the way hand-incremented gauges do when a code path forgets one.

Every ``triollm:`` series carries a ``model_name`` label on the page (vLLM's, so its
dashboards' queries select ours too). It is added in one place, at render time
(:class:`_ModelNameLabel`), so the metrics themselves and the code that reads them
(``registry.get_sample_value``) keep their own labels only. The process metrics
have none, as in vLLM.

The Gateway API Inference Extension's Model Server Protocol (docs/scale-out.md) asks
for three gauges whose names are free and whose meaning is fixed: queued requests
(``num_requests_waiting``), running requests (``num_requests_running``) and KV-cache
usage as a 0-1 fraction (``kv_cache_usage_perc``), plus ``cache_config_info`` (value
1; labels ``block_size`` and ``num_gpu_blocks``). Routers that hard-code vLLM's names
read them from ``--metrics-names vllm``: the same series under the ``vllm:`` prefix,
the usage also as ``vllm:gpu_cache_usage_perc`` (vLLM's name before 0.10, still read
by the production-stack router).

Trap: ``prometheus_client`` appends ``_total`` to counter names itself; the
names below are given without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from triollm.events import StepKind
from triollm.outcomes import EndCode, Refused, Unfinished
from triollm.plan import FinishReason

# Seconds. From 1 ms (a decode step of a tiny model) to a minute (a long queue wait).
# Up to two hours, as vLLM's request-latency buckets reach 7,680 s: a long answer on a
# CPU takes minutes, and a top bucket of 60 s would put it in +Inf.
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
    120, 300, 600, 1200, 2400, 4800, 7680,
)  # fmt: skip
# A step: from a few milliseconds (SmolLM2's decode) to minutes (a long prefill chunk
# on a large model).
STEP_BUCKETS = (
    0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
# Why a request ended without finishing: every member of both enums (outcomes.py).
REJECTION_REASONS: tuple[Unfinished, ...] = (*Refused, *EndCode)
FINISH_REASONS = (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS)  # how it can end
CONTENT_TYPE = CONTENT_TYPE_LATEST
OWN_PREFIX = "triollm:"
METRIC_PREFIXES = ("triollm", "vllm")  # --metrics-names
# Under vLLM's names, the usage gauge is also published under its pre-0.10 name.
VLLM_ALIASES = {"vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc"}


class _Stats(Protocol):
    @property
    def waiting(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def blocks_total(self) -> int: ...
    @property
    def blocks_held(self) -> int: ...
    @property
    def preemptions_total(self) -> int: ...
    @property
    def prefix_cache_queries_total(self) -> int: ...
    @property
    def prefix_cache_hits_total(self) -> int: ...


class _SchedulerCounters(Collector):
    """Counters the scheduler keeps itself, read at scrape time (never drift)."""

    def __init__(self, statistics: Callable[[], _Stats]) -> None:
        self.statistics = statistics

    def collect(self):  # type: ignore[no-untyped-def]
        yield CounterMetricFamily(
            "triollm:num_preemptions",
            "Sequences evicted to free KV blocks (policy preempt); each recomputes later.",
            value=self.statistics().preemptions_total,
        )
        # vLLM's two counters, in tokens: hits / queries is the prefix cache's hit rate.
        yield CounterMetricFamily(
            "triollm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission.",
            value=self.statistics().prefix_cache_queries_total,
        )
        yield CounterMetricFamily(
            "triollm:prefix_cache_hits",
            "Of those, tokens whose K/V was found (not computed again).",
            value=self.statistics().prefix_cache_hits_total,
        )


class _ModelNameLabel(Collector):
    """The ``triollm:`` families of ``inner``, each sample labelled ``model_name`` and
    renamed to ``prefix:`` (``--metrics-names``)."""

    def __init__(self, inner: CollectorRegistry, model_name: str, prefix: str = "triollm") -> None:
        self.inner = inner
        self.model_name = model_name
        self.prefix = prefix + ":"

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            labels = {"model_name": self.model_name, **sample.labels}
            sample_name = name + sample.name[len(family.name) :]
            out.add_sample(sample_name, labels, sample.value, sample.timestamp, sample.exemplar)
        return out

    def collect(self):  # type: ignore[no-untyped-def]
        for family in self.inner.collect():
            if not family.name.startswith(OWN_PREFIX):
                yield family
                continue
            name = self.prefix + family.name[len(OWN_PREFIX) :]
            yield self._renamed(family, name)
            if name in VLLM_ALIASES:
                yield self._renamed(family, VLLM_ALIASES[name])


class Metrics:
    """The service's counters and histograms; one instance per service.

    ``model_name``: the served model's id, the ``model_name`` label of every
    ``triollm:`` series on the rendered page. ``names``: the prefix on the page,
    ``triollm`` or ``vllm`` (the registry, and so every reader in the code, keeps
    ``triollm:``)."""

    def __init__(self, model_name: str, names: str = "triollm") -> None:
        if names not in METRIC_PREFIXES:
            raise ValueError(f"metric names must be one of {METRIC_PREFIXES}, got {names!r}")
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.page = CollectorRegistry(auto_describe=False)  # what /metrics renders
        self.page.register(_ModelNameLabel(r, model_name, names))
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: on a CPU
        # server the two a user watches first (the private registry drops them).
        ProcessCollector(registry=r)
        self.running = Gauge(
            "triollm:num_requests_running", "Sequences holding a slot.", registry=r
        )
        self.waiting = Gauge(
            "triollm:num_requests_waiting", "Requests in the admission queue.", registry=r
        )
        self.kv_blocks_used = Gauge(
            "triollm:kv_blocks_used", "KV cache blocks held by sequences.", registry=r
        )
        self.kv_blocks_total = Gauge(
            "triollm:kv_blocks_total", "KV cache blocks in the pool.", registry=r
        )
        self.kv_usage = Gauge(
            "triollm:kv_cache_usage_perc", "Fraction of KV blocks held (0-1).", registry=r
        )
        # vLLM's: value 1, the pool's shape in the labels (the endpoint picker reads
        # block_size and num_gpu_blocks). Set once the pool is sized (cache_config).
        self.cache_info = Gauge(
            "triollm:cache_config_info",
            "The KV cache's configuration, in the labels (value 1).",
            ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=r,
        )
        # Ours, in the same form: the step budget the scheduler runs with, so a user
        # reading ITL or TTFT on a dashboard sees which budget produced them.
        self.scheduler_info = Gauge(
            "triollm:scheduler_config_info",
            "The scheduler's step budget, in the labels (value 1).",
            ["slots", "chunk_tokens", "step_rows", "stall_rows", "policy"],
            registry=r,
        )
        self.ttft = Histogram(
            "triollm:time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "triollm:inter_token_latency_seconds",
            "Between consecutive tokens of one request.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "triollm:request_queue_time_seconds",
            "From arrival to admission (0 when admitted at once).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "triollm:e2e_request_latency_seconds",
            "From arrival to the last token, for requests that finished.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_rows = Histogram(
            "triollm:step_rows",
            "Rows computed per forward pass.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.step_width = Histogram(
            "triollm:step_sequences",
            "Sequences sharing one forward pass (the batch width).",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
            registry=r,
        )
        # The engine's share of a token, measured where it runs: a decode step's
        # time beside the inter-token latency says how much of a token the server
        # path adds (docs/performance.md, "The server path"; `triollm bench serve`
        # reads the mean per level from here).
        self.step_seconds = Histogram(
            "triollm:step_duration_seconds",
            "Compute time of one step (forward pass and sampling, in the worker "
            "thread), by kind: decode (no prompt rows) or prefill.",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._step_seconds = {k: self.step_seconds.labels(kind=k.value) for k in StepKind}
        self.prompt_tokens = Counter(
            "triollm:prompt_tokens",
            "Prompt tokens of admitted requests (once per request, however many choices).",
            registry=r,
        )
        # vLLM's request_params_n: how many choices (n) the admitted requests asked for.
        self.params_n = Histogram(
            "triollm:request_params_n",
            "Choices (n) per admitted request.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.generation_tokens = Counter(
            "triollm:generation_tokens", "Tokens generated.", registry=r
        )
        self.success = Counter(
            "triollm:request_success",
            "Requests that finished, by finish_reason.",
            ["finished_reason"],
            registry=r,
        )
        self.connections_aborted = Counter(
            "triollm:connections_aborted",
            "Connections aborted: a write stalled (client not reading) or shutdown.",
            registry=r,
        )
        self.rejections = Counter(
            "triollm:request_rejections",
            "Requests that ended without finishing, by reason.",
            ["reason"],
            registry=r,
        )
        self.server_errors = Counter(
            "triollm:http_server_errors",
            "HTTP responses with a 5xx status, by status.",
            ["status"],
            registry=r,
        )
        # One series per member, created now: zeros are exported (so rate() works from
        # the start), and a reason that is not a member has no series to be counted in.
        self._rejections = {r: self.rejections.labels(reason=r.value) for r in REJECTION_REASONS}
        self._success = {r: self.success.labels(finished_reason=r.value) for r in FINISH_REASONS}

    def bind(
        self, statistics: Callable[[], _Stats], hidden_running: Callable[[], int] = lambda: 0
    ) -> None:
        """Compute the state gauges from ``statistics()`` at every scrape.

        ``hidden_running``: sequences holding a slot that are not requests (the
        warm-up), left out of the running gauge."""
        self.running.set_function(lambda: statistics().running - hidden_running())
        self.registry.register(_SchedulerCounters(statistics))
        self.waiting.set_function(lambda: statistics().waiting)
        self.kv_blocks_used.set_function(lambda: statistics().blocks_held)
        self.kv_blocks_total.set_function(lambda: statistics().blocks_total)

        def usage() -> float:
            s = statistics()
            return s.blocks_held / s.blocks_total if s.blocks_total else 0.0

        self.kv_usage.set_function(usage)

    def cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        """Publish the pool's shape as ``cache_config_info`` (once, at start)."""
        self.cache_info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(num_blocks),
            enable_prefix_caching=str(prefix_caching),
        ).set(1)

    def scheduler_config(
        self, slots: int, chunk_tokens: int, step_rows: int, stall_rows: int, policy: str
    ) -> None:
        """Publish the step budget as ``scheduler_config_info`` (once, at start)."""
        self.scheduler_info.labels(
            slots=str(slots),
            chunk_tokens=str(chunk_tokens),
            step_rows=str(step_rows),
            stall_rows=str(stall_rows),
            policy=policy,
        ).set(1)

    # -- the service's Observer hooks (triollm.events.Observer) ---------------------

    def admitted(self, prompt_tokens: int, queue_seconds: float, choices: int = 1) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_time.observe(queue_seconds)
        self.params_n.observe(choices)

    def token(self, first: bool, seconds_since_previous: float) -> None:
        self.generation_tokens.inc()
        (self.ttft if first else self.itl).observe(seconds_since_previous)

    def finished(self, reason: FinishReason, e2e_seconds: float) -> None:
        self._success[reason].inc()
        self.e2e.observe(e2e_seconds)

    def ended_early(self, reason: Unfinished) -> None:
        """A request that ended without finishing: refused at the door or cut short.
        Runs inside the batch loop (via the service), so it cannot fail on a reason:
        the reasons are enum members, and every member has its series."""
        self._rejections[reason].inc()

    def step(self, rows: int, width: int, kind: StepKind, seconds: float) -> None:
        self.step_rows.observe(rows)
        self.step_width.observe(width)
        self._step_seconds[kind].observe(seconds)

    # -- reading ---------------------------------------------------------------------

    def rejection_count(self, reason: Unfinished) -> float:
        """The current count for one reason (tests read it)."""
        value = self.registry.get_sample_value(
            "triollm:request_rejections_total", {"reason": reason.value}
        )
        return value or 0.0

    def server_error(self, status: int) -> None:
        self.server_errors.labels(status=str(status)).inc()

    def server_error_count(self) -> float:
        return sum(
            s.value
            for m in self.server_errors.collect()
            for s in m.samples
            if s.name.endswith("_total")
        )

    def aborted_connections(self) -> float:
        return self.registry.get_sample_value("triollm:connections_aborted_total") or 0.0

    def render(self) -> bytes:
        return generate_latest(self.page)
