"""``triollm demo NAME``: run one mechanism of the book section and watch it happen."""

from __future__ import annotations

import argparse
import importlib

from triollm.mechanisms import DEMOS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "mechanisms:\n" + "\n".join(
        f"  {name:<16}{about}" for name, (_, about) in DEMOS.items()
    )
    parser.add_argument("mechanism", choices=list(DEMOS), metavar="MECHANISM")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(DEMOS[args.mechanism][0])
    return int(module.run(args) or 0)
