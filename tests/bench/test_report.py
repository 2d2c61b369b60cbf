"""Result files carry the whole configuration, and ``compare`` puts any of them side by side."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import pytest

import kvserve
from kvserve.bench.report import _git_state, check_output_path, compare_table, format_sweep, write_result_json
from kvserve.cli import main

IS_CHECKOUT = (Path(kvserve.__file__).resolve().parents[1] / ".git").exists()  # else an installed wheel


def write(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def test_result_json_holds_config_machine_versions_and_commit(tmp_path: Path) -> None:
    args = argparse.Namespace(dataset_name="random", dataset_path=Path("/data/x.json"), func=print)
    path = tmp_path / "r.json"
    write_result_json(path, {"kind": "serve", "label": "a", "runs": []}, args)
    document = json.loads(path.read_text())
    assert document["config"] == {"dataset_name": "random", "dataset_path": "/data/x.json"}
    assert document["label"] == "a" and document["machine"]["num_cpus"] >= 1 and document["machine"]["cpu"]
    versions = document["versions"]
    assert versions["kvserve"] and versions["torch"]
    if IS_CHECKOUT:  # an installed wheel has no commit to name
        assert len(versions["git_commit"]) == 40 and isinstance(versions["git_dirty"], bool)
    else:
        assert versions["git_commit"] is None and versions["git_dirty"] is None


def test_a_package_installed_inside_another_repository_names_no_commit(tmp_path: Path) -> None:
    """A wheel installed into a project's own .venv sits inside the project's repository: its commit is not
    kvserve's."""
    package = tmp_path / ".venv" / "site-packages" / "kvserve"
    package.mkdir(parents=True)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "a project"], check=True)
    assert _git_state(package) == {"git_commit": None, "git_dirty": None}
    (tmp_path / "kvserve").mkdir()
    assert len(_git_state(tmp_path / "kvserve")["git_commit"]) == 40  # a checkout: the package at its top


def test_result_json_never_holds_the_api_key(tmp_path: Path) -> None:
    argv = ["bench", "serve", "--api-key", "sk-SECRET123", "--label=x", "--api-key=sk-SECRET123"]
    args = argparse.Namespace(api_key="sk-SECRET123", argv=argv, label="x")
    path = tmp_path / "r.json"
    write_result_json(path, {"kind": "serve", "label": "a", "runs": []}, args)
    assert "SECRET" not in path.read_text()
    config = json.loads(path.read_text())["config"]
    assert config["api_key"] == "<redacted>" and config["label"] == "x"
    assert config["argv"] == ["bench", "serve", "--api-key", "<redacted>", "--label=x", "--api-key=<redacted>"]
    assert args.api_key == "sk-SECRET123"  # the run's own arguments are left as they were


def test_compare_puts_runs_side_by_side_with_ratios_to_the_first(tmp_path: Path) -> None:
    offline = write(tmp_path / "offline.json", {"kind": "throughput", "label": "offline",
                                                "output_throughput": 100.0, "request_throughput": 2.0})
    sweep = write(tmp_path / "sweep.json", {"kind": "serve", "label": "served", "runs": [
        {"request_rate": 1.0, "output_throughput": 50.0, "request_throughput": 1.0, "ttft_ms": {"p99": 30.0}},
        {"request_rate": "inf", "output_throughput": 150.0, "request_throughput": 3.0, "ttft_ms": None}]})
    table = compare_table([offline, sweep])
    header, *rows = table.splitlines()
    assert header.split() == ["offline", "served", "@1.0", "served", "@inf"]
    by_name = {row[:24].strip(): row[24:].split() for row in rows}
    assert by_name["output tok/s"] == ["100", "50", "(0.50x)", "150", "(1.50x)"]
    assert by_name["requests/s"] == ["2", "1", "(0.50x)", "3", "(1.50x)"]
    assert by_name["TTFT P99 ms"] == ["-", "30", "-"]  # no ratio without a first figure
    assert "TPOT median ms" not in by_name  # a figure no file has


def test_compare_tells_columns_of_one_label_apart_by_their_files(tmp_path: Path) -> None:
    runs = [write(tmp_path / f"{name}.json", {"kind": "serve", "label": label, "output_throughput": 1.0})
            for name, label in (("served", "kvserve random"), ("offline", "kvserve random"), ("peer", "llamacpp"))]
    assert compare_table(runs).splitlines()[0].split() == ["kvserve", "random", "(served)", "kvserve", "random",
                                                           "(offline)", "llamacpp"]
    before, after = (tmp_path / name / "kvserve-c16.json" for name in ("before", "after"))
    for path in (before, after):
        path.parent.mkdir()
        write(path, {"kind": "serve", "label": "kvserve", "output_throughput": 1.0})
    assert compare_table([before, after]).splitlines()[0].split() == ["kvserve", "(before/kvserve-c16)", "kvserve",
                                                                      "(after/kvserve-c16)"]


def test_compare_names_a_file_that_is_not_a_result(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="bad.json is not a result JSON"):
        compare_table([bad])
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe")  # not UTF-8: the error named no file
    with pytest.raises(ValueError, match="binary.json is not a result JSON"):
        compare_table([bad.with_name("binary.json")])


def test_sweep_table_has_a_row_per_rate() -> None:
    run = {"request_throughput": 1.5, "output_throughput": 96.0, "failed": 0, "ttft_ms": {"p99": 12.0},
           "tpot_ms": None, "e2e_ms": {"p99": 80.0}}
    lines = format_sweep([{**run, "request_rate": 2.0}, {**run, "request_rate": "inf"}]).splitlines()
    assert len(lines) == 3 and lines[1].split() == ["2.0", "1.500", "96.0", "12.0", "-", "80.0", "0"]
    assert lines[2].split()[0] == "inf"


def test_compare_keeps_large_figures_apart(tmp_path: Path) -> None:
    runs = [write(tmp_path / f"{label}.json", {"kind": "serve", "label": label, "ttft_ms": {"p99": value}})
            for label, value in (("a", 59064.2), ("b", 64540.0))]
    by_name = {row[:24].strip(): row[24:].split() for row in compare_table(runs).splitlines()[1:]}
    assert by_name["TTFT P99 ms"] == ["59064", "64540", "(1.09x)"]


@pytest.mark.parametrize("document", [[1], {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}])
def test_compare_refuses_json_that_is_not_a_result(tmp_path: Path, document: object) -> None:
    path = write(tmp_path / "config.json", document)
    with pytest.raises(ValueError, match=re.escape(f"{path} is not a kvserve result JSON (no 'kind')")):
        compare_table([path])


def test_compare_refuses_a_result_without_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path / "empty.json", {"kind": "serve", "label": "x", "runs": []})
    assert main(["bench", "compare", str(path)]) == 2
    assert capsys.readouterr().err == f"kvserve: error: {path}: 'runs' is not a non-empty list of runs\n"


def test_output_paths_are_checked_with_their_flag(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    check_output_path(tmp_path / "new.json", "--result-json")
    check_output_path(tmp_path / "new" / "plots", "--plot", directory=True)  # made with its parents
    check_output_path(tmp_path, "--plot", directory=True)
    for path, directory, message in ((tmp_path, False, "exists and is not a file"),
                                     (tmp_path / "a-file", True, "exists and is not a directory"),
                                     (tmp_path / "a-file" / "x.json", False, "a-file is not a directory"),
                                     (tmp_path / "a-file" / "plots", True, "a-file is not a directory"),
                                     (tmp_path / "none" / "x.json", False, "none does not exist")):
        with pytest.raises(ValueError, match=f"^--flag {re.escape(str(path))}: .*{message}"):
            check_output_path(path, "--flag", directory)
