"""The Envoy configuration in front of N triollm replicas, as data.

Each setting answers one way a replica can fail a request that another replica
would have served (docs/scale-out.md walks through them):

- **Active health checks on ``/ready``** (every second, two failures in a row take
  a host out, one success brings it back): a replica that is warming up or draining
  (SIGTERM) answers 503 there, so Envoy stops sending it new requests within about
  two seconds, and the requests that reach it in between get 503 ``shutting_down``,
  which the retry below sends elsewhere; a restarted replica rejoins at its first
  200. Two and not one: on a loaded host a busy replica can be slow to answer a
  check, and one slow answer must not empty the pool.
- **Retries to another host before the response headers**: ``connect-failure``
  (the process is gone: connection refused), ``reset`` (it died holding the
  request) and the statuses 429 (its queue is full) and 503 (it is draining, or
  failed). ``previous_hosts`` makes each retry pick a host not tried yet. Envoy
  never retries once response headers went downstream: a stream cut mid-way is
  cut for the client (it sees the chunked body end without its last chunk), since
  replaying it elsewhere would repeat tokens the client already has.
- **Outlier detection**: one gateway failure (refused or reset connection) ejects
  the host at once, before the next health check has noticed.
- **No route timeout** (``timeout: 0s``): Envoy's default of 15 s would cut every
  longer answer with a 504. ``stream_idle_timeout`` still ends a stream that
  stays silent for 5 minutes.
- **Upstream idle timeout below hypercorn's keep-alive (5 s)**: otherwise Envoy
  may reuse a pooled connection at the moment the replica closes it (a reset that
  only the retry would hide).
- **Envoy's panic threshold is kept** (50%): when fewer than half the hosts look
  healthy Envoy sends to all of them, on the grounds that health checks are more
  likely wrong than most replicas dead. With the retries above that is the right
  bet: a request that lands on a dead host is retried on another. (With the panic
  threshold at 0, a slow health check on the one live replica while the other was
  dead answered five requests 503 ``no healthy upstream`` in a test run.)

``lb`` chooses how a host is picked: ``round_robin``, ``least_request`` (the host
with fewer requests in flight: queue-aware with what Envoy itself sees), or
``prefix_hash``: a Lua filter hashes the first bytes of the prompt (from the
``"messages"`` or ``"prompt"`` key on) into a header, and a consistent-hash ring on
that header sends requests that open alike to the same replica, where their prefix
is cached. That is llm-d's *approximate* prefix routing done in the proxy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LB_POLICIES = ("round_robin", "least_request", "prefix_hash")
PREFIX_HEADER = "x-triollm-prefix"
# Bytes of the prompt hashed by prefix_hash: about a system prompt's opening. Longer
# makes two prompts that share only their first sentences land apart.
PREFIX_BYTES = 512
HEALTH_PATH = "/ready"
BALANCE_FACTOR = 125  # prefix_hash: a host takes at most 1.25x the average load
RETRIABLE_STATUSES = (429, 503)
UPSTREAM_IDLE_S = 4  # below hypercorn's keep-alive timeout of 5 s
ACCESS_LOG = (
    "[%START_TIME%] %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% flags=%RESPONSE_FLAGS% "
    "replica=%UPSTREAM_HOST% attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% %DURATION%ms "
    "%UPSTREAM_TRANSPORT_FAILURE_REASON%\n"
)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def prefix_lua(prefix_bytes: int = PREFIX_BYTES) -> str:
    """The Lua filter of ``prefix_hash``: a 32-bit polynomial hash of the prompt's
    first ``prefix_bytes`` bytes into the ``x-triollm-prefix`` header. Arithmetic
    stays below 2^53 (h < 2^32, times 31), exact in LuaJIT's doubles."""
    return f"""\
function envoy_on_request(handle)
  local body = handle:body()
  if body == nil then return end
  local n = body:length()
  if n == 0 then return end
  local s = body:getBytes(0, n)
  local i = string.find(s, '"messages"', 1, true) or string.find(s, '"prompt"', 1, true) or 1
  local h = 0
  for k = i, math.min(n, i + {prefix_bytes} - 1) do
    h = (h * 31 + string.byte(s, k)) % 4294967296
  end
  handle:headers():replace("{PREFIX_HEADER}", tostring(h))
end
"""


def envoy_config(
    replicas: list[Endpoint],
    *,
    listen: Endpoint = Endpoint("127.0.0.1", 8080),
    admin: Endpoint = Endpoint("127.0.0.1", 9901),
    lb: str = "round_robin",
    health_interval_s: float = 1.0,
    ejection_s: float = 5.0,
    health_host: str = "127.0.0.1",
) -> dict[str, Any]:
    """The bootstrap config (Envoy's v3 API) as a dict; ``render`` writes it as YAML.

    ``health_host``: the Host header of the health checks (Envoy's default is the
    cluster's name, which triollm's DNS-rebinding guard refuses on a loopback bind)."""
    if lb not in LB_POLICIES:
        raise ValueError(f"lb must be one of {', '.join(LB_POLICIES)}, got {lb!r}")
    if not replicas:
        raise ValueError("at least one replica")
    retries = max(1, len(replicas) - 1) + 1  # every other host once, then one more
    route: dict[str, Any] = {
        "cluster": "triollm",
        "timeout": "0s",
        "retry_policy": {
            "retry_on": "reset,connect-failure,retriable-status-codes",
            "retriable_status_codes": list(RETRIABLE_STATUSES),
            "num_retries": retries,
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/"
                        "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    },
                }
            ],
            "host_selection_retry_max_attempts": 5,
            "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
        },
    }
    http_filters: list[dict[str, Any]] = []
    if lb == "prefix_hash":
        route["hash_policy"] = [{"header": {"header_name": PREFIX_HEADER}}]
        # Consistent hashing with bounded loads: a host already carrying more than
        # BALANCE_FACTOR% of the average in-flight requests passes the key on to the
        # next host of the ring. Without it, a few hot prefixes that hash to one
        # replica pile onto it while the other idles (seen: 44 of 48 requests on one
        # of two replicas with 8 system prompts).
        http_filters.append(
            {
                "name": "envoy.filters.http.lua",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                    "default_source_code": {"inline_string": prefix_lua()},
                },
            }
        )
    http_filters.append(
        {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
            },
        }
    )
    manager = {
        "@type": "type.googleapis.com/"
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "openai",
        "codec_type": "AUTO",
        "stream_idle_timeout": "300s",
        "request_timeout": "0s",
        # One line per request on Envoy's stdout: which replica answered, how many
        # attempts it took, and Envoy's response flags (UC: the replica closed the
        # connection mid-response; URX: retries exhausted; UF: connect failure). The
        # only place a stream cut mid-body can be traced to its replica.
        "access_log": [
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    "log_format": {"text_format_source": {"inline_string": ACCESS_LOG}},
                },
            }
        ],
        "route_config": {
            "name": "openai",
            "virtual_hosts": [
                {
                    "name": "triollm",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        "http_filters": http_filters,
    }
    cluster: dict[str, Any] = {
        "name": "triollm",
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": {"round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST"}.get(
            lb, "RING_HASH"
        ),
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/"
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "common_http_protocol_options": {"idle_timeout": _duration(UPSTREAM_IDLE_S)},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "triollm",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": r.host, "port_value": r.port}
                                }
                            }
                        }
                        for r in replicas
                    ]
                }
            ],
        },
        "health_checks": [
            {
                "timeout": "2s",
                "interval": _duration(health_interval_s),
                "no_traffic_interval": _duration(health_interval_s),
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": HEALTH_PATH, "host": health_host},
            }
        ],
        "outlier_detection": {
            "consecutive_gateway_failure": 1,
            "enforcing_consecutive_gateway_failure": 100,
            "consecutive_5xx": 5,
            "interval": _duration(health_interval_s),
            "base_ejection_time": _duration(ejection_s),
            "max_ejection_percent": 100,
        },
        # Envoy's defaults (1024 requests, 3 retries in flight per cluster) would turn
        # a burst of retries after a replica's death into 503s of Envoy's own.
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 4096,
                    "max_pending_requests": 4096,
                    "max_requests": 4096,
                    "max_retries": 4096,
                }
            ]
        },
    }
    if lb == "prefix_hash":
        cluster["common_lb_config"] = {
            "consistent_hashing_lb_config": {"hash_balance_factor": BALANCE_FACTOR}
        }
    return {
        "admin": {"address": {"socket_address": {"address": admin.host, "port_value": admin.port}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "openai",
                    "address": {
                        "socket_address": {"address": listen.host, "port_value": listen.port}
                    },
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [cluster],
        },
    }


HEADER = """\
# Envoy in front of triollm replicas: generated by `triollm cluster --write-config`
# (src/triollm/cluster/envoy.py explains every setting; docs/scale-out.md the why).
# Copy it and change the addresses under load_assignment to your replicas'.
"""


def render(config: dict[str, Any]) -> str:
    """The config as YAML (PyYAML, from the ``cluster`` extra), keys in their order."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        pass

    def _str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    _Dumper.add_representer(str, _str)
    return HEADER + yaml.dump(config, Dumper=_Dumper, sort_keys=False, width=100)


def replica_endpoints(count: int, *, first_octet: int = 11, port: int = 8000) -> list[Endpoint]:
    """``count`` replicas on 127.0.0.11, .12, ... all on ``port``: distinct loopback
    addresses let every replica use the conventional ports (8000, 5557 for events),
    as pods do."""
    if not 1 <= count <= 254 - first_octet:
        raise ValueError(f"replicas must be 1-{254 - first_octet}, got {count}")
    return [Endpoint(f"127.0.0.{first_octet + i}", port) for i in range(count)]
