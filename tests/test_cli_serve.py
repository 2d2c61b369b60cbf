"""`kvserve serve`'s flags: what a vLLM user types from habit, and values refused before the server's imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cli import build_parser, main
from kvserve.cli_serve import VLLM_ONLY_FLAGS, engine_config, model_to_serve, server_settings
from kvserve.config import DEFAULT_MODEL


def parse(*argv: str):
    return build_parser("serve").parse_args(["serve", *argv])


@pytest.mark.parametrize("flag", sorted(VLLM_ONLY_FLAGS))
def test_a_vllm_flag_kvserve_does_not_take_is_refused_saying_what_to_do_instead(flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", flag, "4"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: vLLM's, not kvserve's: {VLLM_ONLY_FLAGS[flag]}" in capsys.readouterr().err


def test_a_model_the_served_names_took_is_refused_and_none_given_is_the_default_model() -> None:
    """`--served-model-name` takes every word after it: `serve --served-model-name foo MODEL` served the
    default model under the names foo and MODEL."""
    args = parse("--served-model-name", "foo", "/my/model")
    with pytest.raises(ValueError, match="no MODEL was given, and --served-model-name took foo /my/model: give MODEL "
                                         "first"):
        model_to_serve(args)
    for argv, model, names in [(["--served-model-name", "foo"], DEFAULT_MODEL, ("foo",)),
                               ([], DEFAULT_MODEL, (DEFAULT_MODEL,)),
                               (["--served-model-name", "a", "b", "--", "/my/model"], "/my/model", ("a", "b")),
                               (["/my/model", "--served-model-name", "a", "b"], "/my/model", ("a", "b"))]:
        args = parse(*argv)
        model_to_serve(args)
        assert (args.model, server_settings(args).served_model_names) == (model, names)


def test_several_api_keys_are_taken_as_vllm_takes_them_and_a_model_they_took_is_refused_unshown() -> None:
    """vLLM's `--api-key K1 K2` accepts either key (a rotation); the flag takes every word after it, so
    `serve --api-key KEY MODEL` would serve the default model with MODEL for a key."""
    args = parse("--api-key", "sekret", "/my/model")
    with pytest.raises(ValueError, match="no MODEL was given, and --api-key took 2 words: give MODEL first") as error:
        model_to_serve(args)
    assert "sekret" not in str(error.value)
    for argv, model, keys in [(["--api-key", "k"], DEFAULT_MODEL, ("k",)),
                              (["--api-key", "old", "new", "--", "/my/model"], "/my/model", ("old", "new")),
                              (["/my/model", "--api-key", "old", "new"], "/my/model", ("old", "new"))]:
        args = parse(*argv)
        model_to_serve(args)
        assert (args.model, server_settings(args).api_keys) == (model, keys)
    with pytest.raises(ValueError, match="--api-key must not be empty or hold a line break, got ''"):
        server_settings(parse("m", "--api-key", "k", ""))


def test_vllms_speculative_config_is_taken_as_json() -> None:
    config = engine_config(parse("m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'))
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    with pytest.raises(ValueError, match="speculative_method='draft' and speculative_config's 'ngram' disagree"):
        engine_config(parse("m", "--speculative-method", "draft", "--speculative-config", '{"method": "ngram"}'))
    with pytest.raises(ValueError, match=r"speculative_config: unknown keys \['k'\]"):
        engine_config(parse("m", "--speculative-config", '{"k": 1}'))
    with pytest.raises(SystemExit):
        parse("m", "--speculative-config", "{method: ngram}")


def test_auto_tool_choice_is_always_on() -> None:
    """vLLM's tool-calling recipe passes --enable-auto-tool-choice; kvserve serves 'auto' either way."""
    assert server_settings(parse("m", "--enable-auto-tool-choice")).tool_call_parser == "auto"
    with pytest.raises(ValueError, match="kvserve always serves tool_choice 'auto'"):
        server_settings(parse("m", "--no-enable-auto-tool-choice"))


def test_the_pythonic_tool_call_parser_is_taken() -> None:
    """vLLM's recipe for Llama 3.2 and Llama 4: --enable-auto-tool-choice --tool-call-parser pythonic."""
    settings = server_settings(parse("m", "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"))
    assert settings.tool_call_parser == "pythonic"


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "0"], "max_model_len must be >= 2"),
    (["--max-model-len", "1"], "max_model_len must be >= 2 (a prompt token and the token a request draws)"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
])
def test_a_bad_value_is_refused_before_the_server_is_imported(flags: list[str], message: str) -> None:
    """The configuration imports no torch: a bad value took 8-11 s to be refused, after FastAPI, uvicorn and
    transformers."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvserve.cli", "serve", "/nonexistent", *flags],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"kvserve.server.launch", "fastapi", "torch", "transformers"}
