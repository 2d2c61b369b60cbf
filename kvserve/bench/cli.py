"""``kvserve bench serve | throughput | roofline | compare``."""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

from kvserve.bench import report


def add_arguments(bench: argparse.ArgumentParser, command: str | None = None) -> None:
    """Add the ``bench`` commands to ``kvserve bench``'s parser, with the flags of ``command`` only (of every one
    when None, of none when it names no command, as in ``kvserve bench --help``)."""
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="COMMAND")
    for name, (help_text, define_arguments) in COMMANDS.items():
        parser = commands.add_parser(name, help=help_text)
        if command in (None, name):
            define_arguments(parser)


def _module_arguments(module_name: str) -> Callable[[argparse.ArgumentParser], None]:
    """What defines a command whose module has ``add_arguments(parser)`` and ``main(args) -> int``. The module is
    imported only then: serve, throughput and roofline import torch and transformers (seconds)."""

    def define_arguments(parser: argparse.ArgumentParser) -> None:
        module = importlib.import_module(module_name)
        module.add_arguments(parser)
        parser.set_defaults(func=module.main)

    return define_arguments


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    report.add_compare_arguments(parser)
    parser.set_defaults(func=report.compare_main)


# name -> (help, what defines its flags)
COMMANDS = {
    "serve": ("drive an OpenAI-compatible server with a workload", _module_arguments("kvserve.bench.serve")),
    "throughput": ("run a workload through the offline API or transformers",
                   _module_arguments("kvserve.bench.throughput")),
    "roofline": ("this machine's bandwidth and FLOP/s, and the model's bounds",
                 _module_arguments("kvserve.bench.roofline")),
    "compare": ("result JSON files side by side, with ratios to the first", _compare_arguments),
}
