"""``triollm demo NAME``: run one mechanism of the book section and watch it happen."""

from __future__ import annotations

import argparse
import importlib

from triollm.mechanisms import DEMOS


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="mechanism", required=True, metavar="MECHANISM")
    for name, (module, about) in DEMOS.items():
        demo = sub.add_parser(name, help=about, description=about)
        demo.set_defaults(_demo=module)
        importlib.import_module(module).configure(demo)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._demo).run(args) or 0)
