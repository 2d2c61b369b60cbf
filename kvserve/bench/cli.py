"""``kvserve bench serve | throughput | roofline | compare``."""

from __future__ import annotations

import argparse


def add_arguments(bench: argparse.ArgumentParser) -> None:
    """Add the ``bench`` commands to ``kvserve bench``'s parser. Each command's module has ``add_arguments(parser)``
    and ``main(args) -> int``; they are imported only when this parser is built."""
    from kvserve.bench import report, roofline, serve, throughput

    commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, help_text in (
        ("serve", serve, "drive an OpenAI-compatible server with a workload"),
        ("throughput", throughput, "run a workload through the offline API or transformers"),
        ("roofline", roofline, "this machine's bandwidth and FLOP/s, and the model's bounds"),
    ):
        parser = commands.add_parser(name, help=help_text)
        module.add_arguments(parser)
        parser.set_defaults(func=module.main)
    compare = commands.add_parser("compare", help="result JSON files side by side, with ratios to the first")
    report.add_compare_arguments(compare)
    compare.set_defaults(func=report.compare_main)
