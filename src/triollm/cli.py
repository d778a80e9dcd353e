"""The ``triollm`` command: one subcommand per module, imported only when chosen.

Each subcommand module offers ``configure(parser)`` to add its flags and
``run(args) -> int`` to do the work; ``run`` returns the exit status. Errors the user
can fix (a missing file, a bad flag value) are raised as
:class:`~triollm.errors.UserError` and
printed as one line, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from triollm.errors import UserError

# name -> (module, one-line help). Imported lazily so `triollm simulate` never loads numba.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("triollm.server.command", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("triollm.generate", "generate text from a model directory, streamed to stdout"),
    "simulate": ("triollm.sim.command", "replay the seed's batching scenario under each policy"),
    "check-policy": (
        "triollm.check.command",
        "prove a scheduling policy's claims with a hypothesis state machine, or break one",
    ),
    "demo": ("triollm.mechanisms.command", "run one serving mechanism of the book and watch it"),
    "trace": (
        "triollm.mechanisms.trace",
        "one request through the real server beside a neighbour: each step, block and SSE event",
    ),
    "bench": ("triollm.bench.command", "load any OpenAI-compatible server and measure it"),
    "cluster": (
        "triollm.cluster.supervise",
        "N `serve` replicas behind Envoy on loopback (health checks, retries, restarts)",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="triollm")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        sp.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).configure(sp)
    args = parser.parse_args(argv)
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except UserError as exc:
        print(f"triollm: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `triollm simulate | head`: the reader left; not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
