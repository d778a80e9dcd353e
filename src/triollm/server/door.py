"""The door: who may talk to the server, before any route runs (an ASGI middleware).

Four checks, in this order, each answered in OpenAI's error shape:

1. **Host** (DNS rebinding). A web page the user visits can make the browser send
   requests to ``http://127.0.0.1:8000``; with DNS rebinding (a hostile name that
   resolves to 127.0.0.1) it can even read the replies. Such a request carries the
   hostile name in its ``Host`` header. On a loopback bind only loopback names are
   accepted (``localhost``, ``127.0.0.1``, ``::1``; ``--allowed-hosts`` adds more);
   anything else is a 400 ``invalid_host``. A ``--public`` bind accepts any Host
   unless ``--allowed-hosts`` is given.
2. **CORS** (opt-in, ``--allowed-origins``): an ``OPTIONS`` preflight from an
   allowed origin gets 204 with the ``Access-Control-Allow-*`` headers, and every
   answer to that origin carries ``Access-Control-Allow-Origin``. Without the flag
   no CORS header is ever sent, so browsers keep other sites' pages out; a preflight
   from such an origin still gets its 204 (not a 405), only without the headers that
   would let the page go on.
3. **API key** (opt-in, ``--api-key`` or ``TRIOLLM_API_KEY``): ``Authorization:
   Bearer <key>`` (OpenAI's clients, Ollama's) or ``x-api-key: <key>`` (what the
   ``anthropic`` client sends for ``/v1/messages``; without it that client could not
   authenticate with its default ``api_key=``), compared in constant time
   (``hmac.compare_digest``); a missing or
   wrong key is a 401 ``invalid_api_key`` with ``WWW-Authenticate: Bearer``, as
   OpenAI answers. ``/health``, ``/ready`` and ``/metrics`` stay open unless
   ``--open-paths`` says otherwise (an orchestrator probes them without a key).
4. **Content type**: a ``POST`` from a browser (it carries an ``Origin`` header, as
   every browser's POST does) must say ``Content-Type: application/json`` (415
   ``unsupported_media_type`` otherwise): a form post is what a hostile page can send
   cross-site without a preflight, and refusing it closes that door too. A POST with
   no ``Origin`` (``curl -d``, which says ``x-www-form-urlencoded``) is let through;
   its body must still parse as JSON (400 ``invalid_json``).

Where it sits: inside :class:`~triollm.server.lifetime.Lifetime` (which logs every
answer and closes a connection whose body was not read), around the Quart app.
Tests: tests/server/test_door.py.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})  # every address: not a Host name
DEFAULT_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
API_KEY_ENV = "TRIOLLM_API_KEY"


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class DoorPolicy:
    api_key: str | None = None
    open_paths: frozenset[str] = DEFAULT_OPEN_PATHS
    allowed_origins: frozenset[str] = frozenset()  # "*" = any origin
    # None: any Host header. A loopback bind gets LOOPBACK_HOSTS (see for_bind).
    allowed_hosts: frozenset[str] | None = None

    @classmethod
    def for_bind(
        cls,
        bind_host: str,
        *,
        api_key: str | None = None,
        open_paths: Iterable[str] | None = None,
        allowed_origins: Iterable[str] = (),
        allowed_hosts: Iterable[str] = (),
    ) -> DoorPolicy:
        """The policy for a server bound to ``bind_host``.

        The bind address is itself a name the server answers to: ``--host 127.0.0.2``
        answered every request with 400 ``invalid_host`` (issue 28, N7). An empty
        ``api_key`` is a ValueError, not "no key": a key variable set but empty is a
        deployment mistake, and running open because of it would go unnoticed (N10).
        """
        if api_key is not None and not api_key.strip():
            raise ValueError(
                "the API key is empty (--api-key '' or an empty $TRIOLLM_API_KEY): refusing "
                "to start without authentication; give a key, or unset it to run without one"
            )
        extra = frozenset(h.strip().lower() for h in allowed_hosts if h.strip())
        bound = host_name(bind_host if ":" not in bind_host else f"[{bind_host.strip('[]')}]")
        if bound not in WILDCARD_HOSTS:
            extra |= {bound}
        hosts = LOOPBACK_HOSTS | extra if is_loopback(bind_host) or extra - {bound} else None
        return cls(
            api_key=api_key,
            open_paths=DEFAULT_OPEN_PATHS if open_paths is None else frozenset(open_paths),
            allowed_origins=frozenset(o.strip().rstrip("/") for o in allowed_origins if o.strip()),
            allowed_hosts=hosts,
        )


def host_name(value: str) -> str:
    """The name in a Host header, without the port (``[::1]:8000`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


@dataclass
class Door:
    """ASGI middleware applying a :class:`DoorPolicy` (see the module docstring)."""

    app: Any
    policy: DoorPolicy
    refused: dict[str, int] = field(default_factory=dict)  # code -> count, for tests/metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        policy = self.policy
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if policy.allowed_hosts is not None and host not in policy.allowed_hosts:
            names = ", ".join(sorted(policy.allowed_hosts))
            await self._refuse(
                send,
                400,
                f"the Host header {host[:100]!r} is not a name this server answers to "
                f"({names}); add it with --allowed-hosts",
                "invalid_host",
            )
            return
        origin = headers.get(b"origin", b"").decode("latin-1").rstrip("/")
        cors = bool(origin) and ("*" in policy.allowed_origins or origin in policy.allowed_origins)
        method = scope["method"]
        if method == "OPTIONS" and b"access-control-request-method" in headers:
            # Answered whatever the origin (a 405 read as a broken server, issue 26); the
            # allow headers go only to an allowed origin, so the browser stops any other.
            asked = headers.get(b"access-control-request-headers", b"authorization, content-type")
            allow = [
                *_cors_headers(origin),
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", asked),
                (b"access-control-max-age", b"600"),
            ]
            await _respond(send, 204, b"", allow if cors else [])
            return
        if cors:
            send = _with_cors(send, origin)
        if policy.api_key is not None and scope["path"] not in policy.open_paths:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = given.partition(" ")
            key = policy.api_key.encode()
            ok = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
            if not ok and b"x-api-key" in headers:
                ok = hmac.compare_digest(headers[b"x-api-key"].strip(), key)
            if not ok:
                await self._refuse(
                    send,
                    401,
                    "Incorrect or missing API key: send it as 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>')",
                    "invalid_api_key",
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return
        if method == "POST" and b"origin" in headers:
            ctype = headers.get(b"content-type", b"").decode("latin-1")
            if ctype.split(";", 1)[0].strip().lower() != "application/json":
                await self._refuse(
                    send,
                    415,
                    f"the body must be JSON sent as 'Content-Type: application/json', "
                    f"got {ctype[:100]!r}",
                    "unsupported_media_type",
                )
                return
        await self.app(scope, receive, send)

    async def _refuse(
        self,
        send: Any,
        status: int,
        message: str,
        code: str,
        extra: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        await send_error(send, status, message, code, headers=extra)


async def send_error(
    send: Any,
    status: int,
    message: str,
    code: str,
    *,
    type: str = "invalid_request_error",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """An answer in OpenAI's error shape, sent straight on the ASGI ``send`` (the
    middlewares answer before any route runs)."""
    body = {"error": {"message": message, "type": type, "param": None, "code": code}}
    await _respond(send, status, json.dumps(body).encode(), [*(headers or [])], json_body=True)


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


def _with_cors(send: Any, origin: str) -> Any:
    async def cors_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *_cors_headers(origin)]}
        await send(message)

    return cors_send


async def _respond(
    send: Any,
    status: int,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    json_body: bool = False,
) -> None:
    head = [(b"content-length", str(len(body)).encode()), *headers]
    if json_body:
        head.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body, "more_body": False})
