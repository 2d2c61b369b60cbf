"""The flags of ``kvserve serve`` (the server's own, then every engine option) and what they make: the engine's
configuration and the server's settings, each refused here, by name, before the model loads.

Apart from ``server/launch.py``, which runs the server, so that defining them (and ``kvserve serve --help``)
imports neither FastAPI and uvicorn nor transformers and torch, and a bad value is refused before those imports:
``cli.py`` imports ``server.launch`` only when ``serve`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

from kvserve.config import DEFAULT_MODEL, EngineConfig
from kvserve.engine_args import EngineArgs
from kvserve.logs import add_log_arguments
from kvserve.lora_request import LoRARequest
from kvserve.server.cors import CorsPolicy, add_cors_arguments
from kvserve.server.environment import allows_runtime_lora_updating, api_keys
from kvserve.server.reasoning_parsers import REASONING_PARSERS
from kvserve.server.request_log import RequestLog, add_request_log_arguments
from kvserve.server.state import DEFAULT_MAX_BODY_BYTES, ServerSettings
from kvserve.server.tools import TOOL_CALL_PARSERS

# vLLM's flags that kvserve has under another name, or not at all -> what to do instead; refused with that
VLLM_ONLY_FLAGS = {
    "--model": "give the model as the first argument: kvserve serve MODEL",
    "--swap-space": "preempted requests keep their KV in host memory with --preemption-mode swap, whose room is "
                    "--kv-offload-memory GiB",
    "--uvicorn-log-level": "--log-level sets kvserve's and uvicorn's logs",
    "--trust-remote-code": "kvserve runs no code of a checkpoint's own (`kvserve models` and the README list the "
                           "model families it runs); drop the flag",
    "--disable-log-requests": "requests are logged only with --enable-log-requests; drop the flag",
    "--pipeline-parallel-size": "kvserve splits a model over processes with --tensor-parallel-size, and runs "
                                "replicas with --data-parallel-size",
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvserve serve``: the server's own, then every engine option (MODEL defaults to the packaged
    default model)."""
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (default: %(default)s)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the name(s) clients use in 'model' (default: MODEL as given)")
    parser.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY', one of the keys given, on the /v1 routes, "
                             "/tokenize and /detokenize (/health and /metrics stay open; default: $KVSERVE_API_KEY's "
                             "lines, which `ps` does not show, else vLLM's $VLLM_API_KEY, else no key)")
    parser.add_argument("--max-waiting", type=int, default=None,
                        help="answer 503 (Retry-After) while more requests than this wait (default: no limit)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM before they are aborted "
                             "(default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies are answered 413 (default: %(default)s, 4 MiB)")
    add_log_arguments(parser)
    add_cors_arguments(parser)
    add_request_log_arguments(parser)
    parser.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSERS,
                        help="the format of the model's own tool calls, read under tool_choice auto (auto: the one "
                             "the chat template uses; hermes where the template takes no tools; default: "
                             "%(default)s)")
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="split a chat answer's thinking (<think>...</think>) into the message's 'reasoning', "
                             "'content' holding the answer alone, as vLLM's parsers of those names do (qwen3: "
                             "chat_template_kwargs enable_thinking false makes it all answer; default: none, the "
                             "thinking stays in 'content')")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to serve beside the model, with --enable-lora: a "
                             "request whose 'model' is NAME runs with the adapter at PATH")
    parser.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=False,
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with --enable-lora (as "
                             "vLLM's $VLLM_ALLOW_RUNTIME_LORA_UPDATING, which turns it on too): whoever may call "
                             "them loads files the server can read (default: off, a 404 saying so)")
    parser.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                        help="vLLM's, taken for its tool-calling recipes: kvserve always serves tool_choice 'auto' "
                             "(default: on; off is refused)")
    EngineArgs.add_cli_args(parser)
    # MODEL not given: the default model, unless --served-model-name took it for a name (``model_to_serve``)
    parser.set_defaults(model=None)
    for flag, instead in VLLM_ONLY_FLAGS.items():
        parser.add_argument(flag, action=_RefusedAsVllms, nargs="*", help=argparse.SUPPRESS, instead=instead)


class _RefusedAsVllms(argparse.Action):
    """A vLLM flag kvserve does not take: the usage error names it and says what to do instead."""

    def __init__(self, option_strings: Sequence[str], dest: str, instead: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise argparse.ArgumentError(self, f"vLLM's, not kvserve's: {self.instead}")


def model_to_serve(args: argparse.Namespace) -> None:
    """Fill in MODEL: the packaged default model where none was given; refused where none was given and
    ``--served-model-name`` or ``--api-key`` took several words, the last of them likely meant as MODEL (each
    flag takes every word after it). The keys are secrets: counted, never shown."""
    if args.model is not None:
        return
    names, keys = args.served_model_name or [], args.api_key or []
    if len(names) > 1:
        raise ValueError(f"no MODEL was given, and --served-model-name took {' '.join(names)}: give MODEL first "
                         f"(kvserve serve MODEL --served-model-name NAME...), or end the names with -- before "
                         f"MODEL; to serve the default model under several names, name it: kvserve serve "
                         f"{DEFAULT_MODEL} --served-model-name {' '.join(names)}")
    if len(keys) > 1:
        raise ValueError(f"no MODEL was given, and --api-key took {len(keys)} words: give MODEL first (kvserve "
                         f"serve MODEL --api-key KEY...), or end the keys with -- before MODEL; to serve the "
                         f"default model with several keys, name it: kvserve serve {DEFAULT_MODEL} --api-key KEY...")
    args.model = DEFAULT_MODEL


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's configuration from the flags; raises ValueError for a bad value before anything loads. A
    server lays out a GGUF's dense copies after /health answers (``ModelConfig.dense_layouts_in_background``)."""
    config = EngineArgs.from_cli_args(args).create_engine_config()
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dense_layouts_in_background=True))


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from the flags; raises ValueError for a bad value."""
    if not args.enable_auto_tool_choice:
        raise ValueError("--no-enable-auto-tool-choice: kvserve always serves tool_choice 'auto' (the model's own "
                         "calls, read by --tool-call-parser); a client that wants none sends tool_choice 'none'")
    return ServerSettings(
        served_model_names=tuple(args.served_model_name or [args.model]),
        model_root=args.model,
        api_keys=api_keys(args.api_key),
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        cors=CorsPolicy.from_cli_args(args),
        request_log=RequestLog.from_cli_args(args),
        lora_modules=lora_modules(args.lora_modules or [], args.enable_lora),
        allow_runtime_lora_updating=runtime_lora_updating(args.allow_runtime_lora_updating, args.enable_lora),
    )


def runtime_lora_updating(flag: bool, enable_lora: bool) -> bool:
    """Whether the flag or vLLM's variable turns runtime LoRA updating on; ValueError without --enable-lora."""
    allowed = allows_runtime_lora_updating(flag)
    if allowed and not enable_lora:
        how = "--allow-runtime-lora-updating" if flag else "$VLLM_ALLOW_RUNTIME_LORA_UPDATING"
        raise ValueError(f"{how} loads LoRA adapters, which --enable-lora turns on: give it too")
    return allowed


def lora_modules(specs: Sequence[str], enable_lora: bool) -> tuple[LoRARequest, ...]:
    """``--lora-modules NAME=PATH ...`` as the adapters' requests, ids 1, 2, ... in order; ValueError naming a bad
    one (vLLM's JSON form is not taken)."""
    if specs and not enable_lora:
        raise ValueError("--lora-modules serves LoRA adapters, which --enable-lora turns on: give it too")
    adapters = []
    for int_id, spec in enumerate(specs, start=1):
        name, equals, path = spec.partition("=")
        if not (name and equals and path):
            raise ValueError(f"--lora-modules {spec!r}: give each adapter as NAME=PATH")
        adapters.append(LoRARequest(name, int_id, path))
    return tuple(adapters)
