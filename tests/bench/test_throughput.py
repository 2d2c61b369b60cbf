"""``kvserve bench throughput`` on a tiny checkpoint: exact token counts for every system, transformers fed the
same ids as kvserve, multiturn run turn by turn, the engine's options and stats, and compare reading the result."""

from __future__ import annotations

import argparse
import copy
import json
import weakref
import random
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from kvserve import LLM
from kvserve.bench import hf_backend, throughput
from kvserve.bench.datasets import SampleRequest, add_dataset_arguments, build_dataset, ordinary_token_ids
from kvserve.bench.report import compare_table, versions
from kvserve.cli import main
from kvserve.engine.input_processor import InputProcessor
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

PROBE = ["--gemm-size", "32", "--gemm-tokens", "8", "--num-repeats", "1"]  # a compute bound in milliseconds
SYSTEMS = ["kvserve", "hf-single", "hf-static3", "hf-generate_batch"]


def test_the_result_json_is_written_before_the_report_is_printed(tiny_checkpoint: Path, tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A reader of the report that had gone (a pager quit, `| true`) lost a finished run's --result-json."""
    import builtins

    def gone(*args: object, **kwargs: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    result_json = tmp_path / "throughput.json"
    monkeypatch.setattr(builtins, "print", gone)
    with pytest.raises(BrokenPipeError):
        main(["bench", "throughput", str(tiny_checkpoint), "--dataset-name", "random", "--num-prompts", "2",
              "--random-input-len", "8", "--random-output-len", "2", *PROBE, "--backend", "kvserve", "--device", "cpu",
              "--result-json", str(result_json)])
    assert json.loads(result_json.read_text())["kind"] == "throughput"


def test_every_system_counts_exactly_the_workloads_tokens_and_compare_reads_the_result(
    tiny_checkpoint: Path, tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    workload = ["--dataset-name", "random", "--num-prompts", "7", "--random-input-len", "12",
                "--random-output-len", "6", "--random-range-ratio", "0.5", "--seed", "3"]
    result_json = tmp_path / "throughput.json"
    assert main(["bench", "throughput", str(tiny_checkpoint), *workload, *PROBE, "--backend", "kvserve,hf",
                 "--hf-mode", "single,static,generate_batch", "--hf-batch-size", "3", "--device", "cpu",
                 "--result-json", str(result_json)]) == 0
    requests = build_dataset(_dataset_args(workload), tokenizer)
    num_prompt, num_output = sum(r.prompt_len for r in requests), sum(r.output_len for r in requests)
    assert len({r.output_len for r in requests}) > 1  # static batches run to their longest: only requested count
    result = json.loads(result_json.read_text())
    assert list(result["systems"]) == SYSTEMS
    for figures in result["systems"].values():
        assert (figures["completed"], figures["input_tokens"], figures["output_tokens"]) == (7, num_prompt, num_output)
        assert figures["total_throughput"] == pytest.approx((num_prompt + num_output) / figures["duration_s"])
        assert 0 < figures["share_of_compute_bound"]
    assert result["output_throughput"] == result["systems"]["kvserve"]["output_throughput"]
    ratios = result["ratios"]
    rates = {name: figures["total_throughput"] for name, figures in result["systems"].items()}
    assert ratios["kvserve"]["hf-single"] == pytest.approx(rates["kvserve"] / rates["hf-single"])
    stats = result["systems"]["kvserve"]["details"]["stats"]
    assert stats["num_preemptions"] == 0 and stats["peak_num_blocks_used"] > 0 and stats["prefix_caching"]
    assert stats["prefix_cache_queries"] == num_prompt  # the run's prompts looked up, the warm-up's left out
    # every token but each request's last output, less the prompt tokens found in the cache: the run's alone
    assert stats["num_tokens_computed"] == num_prompt - stats["prefix_cache_hits"] + num_output - 7
    assert result["config"]["hf_batch_size"] == 3 and result["versions"] == versions()
    table = capsys.readouterr().out
    assert all(name in table for name in SYSTEMS) and "row over column" in table
    assert "total tok/s" in compare_table([result_json, result_json])


def test_kvserves_engine_is_gone_before_transformers_loads(tiny_checkpoint: Path, monkeypatch) -> None:
    """One model in memory at a time: on a GPU kvserve's KV pool takes most of the free memory."""
    engines, alive_at_hf_load = [], []
    load_kvserve, load_hf_model = throughput.load_kvserve, hf_backend.load_hf_model

    def recorded_kvserve(*args, **kwargs):
        llm = load_kvserve(*args, **kwargs)
        engines.append(weakref.ref(llm))
        return llm

    def probed_hf_model(*args, **kwargs):
        alive_at_hf_load.append(sum(engine() is not None for engine in engines))
        return load_hf_model(*args, **kwargs)

    monkeypatch.setattr(throughput, "load_kvserve", recorded_kvserve)
    monkeypatch.setattr(hf_backend, "load_hf_model", probed_hf_model)
    assert main(["bench", "throughput", str(tiny_checkpoint), "--dataset-name", "random", "--num-prompts", "2",
                 "--random-input-len", "8", "--random-output-len", "2", *PROBE, "--backend", "kvserve,hf",
                 "--hf-mode", "single", "--device", "cpu", "--step-trace"]) == 0
    assert len(engines) == 1 and alive_at_hf_load == [0]


def test_a_chat_workload_renders_with_the_runs_chat_template(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A model without a template (the packaged gemma-3-270m) runs chat workloads with ``--chat-template``."""
    plain = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, plain)
    (plain / "chat_template.jinja").unlink()
    workload = ["--dataset-name", "grounded", "--num-prompts", "2", "--random-input-len", "32",
                "--random-output-len", "2", *PROBE, "--backend", "kvserve", "--device", "cpu"]
    assert main(["bench", "throughput", str(plain), *workload]) == 2  # refused: no template
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    assert main(["bench", "throughput", str(plain), *workload, "--chat-template", template]) == 0


def test_engine_options_pass_through_and_the_profile_and_the_trace_split_step_time(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    result_json = tmp_path / "kvserve.json"
    assert main(["bench", "throughput", str(tiny_checkpoint), "--dataset-name", "prefix", "--prefix-num-groups", "2",
                 "--prefix-group-size", "3", "--prefix-len", "40", "--suffix-len", "4", "--random-output-len", "3",
                 *PROBE, "--num-kv-blocks", "40", "--max-num-seqs", "2", "--no-enable-prefix-caching",
                 "--profile", "--profile-every", "2", "--step-trace", "--device", "cpu", "--result-json",
                 str(result_json)]) == 0
    result = json.loads(result_json.read_text())
    stats = result["systems"]["kvserve"]["details"]["stats"]
    assert stats["num_blocks_total"] == 40 and not stats["prefix_caching"] and stats["prefix_cache_hits"] == 0
    assert result["completed"] == 6 and result["output_tokens"] == 6 * 3
    profile = result["profile"]
    assert profile["num_profiled_steps"] == profile["num_steps"] // 2 > 0
    assert sum(profile["groups_s"].values()) == pytest.approx(profile["wall_s"])
    assert profile["groups_s"]["GEMMs"] > 0
    trace = result["systems"]["kvserve"]["details"]["step_trace"]
    assert trace["num_steps"] >= 6 * 3 // 2 and sum(trace["share"].values()) == pytest.approx(1.0)


def test_transformers_gets_the_same_ids_and_agrees_with_kvserve_through_eos(tiny_checkpoint: Path) -> None:
    """Greedy with EOS ignored: kvserve and every transformers mode give the same tokens, exactly as many as
    asked, including continuations that pass through EOS (which must neither stop nor be masked)."""
    rng = random.Random(0)
    requests = [SampleRequest(p, len(p), rng.randint(4, 24)) for p in
                ([rng.randrange(4, 500) for _ in range(rng.randint(3, 30))] for _ in range(24))]
    expected = throughput.kvserve_generator(LLM(str(tiny_checkpoint), device="cpu", dtype="float32"))(requests)
    assert [len(out) for out in expected] == [r.output_len for r in requests]
    checkpoint = load_checkpoint(resolve_model(str(tiny_checkpoint)), torch.float32)
    assert any(eos in out for out in expected for eos in checkpoint.eos_token_ids)
    model = hf_backend.load_hf_model(str(tiny_checkpoint), torch.float32, torch.device("cpu"))
    for mode in hf_backend.HF_MODES:
        generate = hf_backend.hf_generator(model, mode, pad_token_id=0, batch_size=5, max_batch_tokens=64,
                                           max_num_seqs=8)
        assert generate(requests) == expected, mode


def test_multiturn_resends_each_history_with_the_systems_own_answers(tokenizer) -> None:
    workload = ["--dataset-name", "multiturn", "--num-conversations", "2", "--num-turns", "3",
                "--first-turn-len", "12", "--turn-len", "5", "--random-output-len", "4"]
    requests = build_dataset(_dataset_args(workload), tokenizer)
    chat = InputProcessor(tokenizer, len(tokenizer), 512)
    ordinary = ordinary_token_ids(tokenizer)
    calls: list[list[SampleRequest]] = []

    def system_answer(turn: int, group: int) -> list[int]:
        return ordinary[100 + 10 * turn + group:][:4]

    def generate(batch: list[SampleRequest]) -> list[list[int]]:
        calls.append(batch)
        return [system_answer(r.turn, r.group) for r in batch]

    lengths = throughput.run_workload(generate, requests, chat)
    assert [[(r.turn, r.group) for r in batch] for batch in calls] == [[(t, 0), (t, 1)] for t in range(3)]
    scripted = next(r for r in requests if (r.group, r.turn) == (1, 2)).messages
    answers = iter(tokenizer.decode(system_answer(turn, 1), skip_special_tokens=True) for turn in range(2))
    history = [{**m, "content": next(answers)} if m["role"] == "assistant" else m for m in scripted]
    assert calls[2][1].prompt == chat.apply_chat_template(history)["prompt_token_ids"]
    assert lengths == [(len(r.prompt), 4) for batch in calls for r in batch]


def test_a_grounded_prompt_is_its_messages_through_the_template_as_the_server_makes_it(tokenizer) -> None:
    """On a tokenizer that adds BOS and a template that writes it (Gemma 3's, Llama 3's), the templated text
    tokenized again got BOS twice."""
    bos_adding = copy.deepcopy(tokenizer)
    bos = bos_adding.bos_token
    bos_adding._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A",
                                                              special_tokens=[(bos, bos_adding.bos_token_id)])
    bos_adding.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    workload = ["--dataset-name", "grounded", "--num-prompts", "2", "--random-input-len", "40"]
    requests = build_dataset(_dataset_args(workload), bos_adding)
    chat = InputProcessor(bos_adding, len(bos_adding), 512)
    for request, offline in zip(requests, throughput.tokenized(requests, chat)):
        served = chat.apply_chat_template(request.messages)["prompt_token_ids"]
        assert offline.prompt == served and served.count(bos_adding.bos_token_id) == 1
        assert offline.prompt_len == len(served) and offline.messages is None


def test_what_a_runner_counts_as_no_generation_of_its_own_is_not_timed(tokenizer, monkeypatch) -> None:
    """transformers' continuous-batching session takes ~0.5 s to shut down after its last result, whatever the
    work: a fake clock, a runner that generates for 5 s and shuts down for 2, a wall of 5."""
    now = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now[0])
    runner = hf_backend.ContinuousBatching(model=None, max_batch_tokens=8, max_num_seqs=2, desc="fake")

    def generate(requests):
        now[0] += 5.0
        collected = now[0]
        now[0] += 2.0
        runner.untimed_s += now[0] - collected
        return [[1] * r.output_len for r in requests]

    monkeypatch.setattr(hf_backend.ContinuousBatching, "__call__", lambda self, requests: generate(requests))
    size = throughput.roofline.ModelSize(64, 128, 2, 4, 2, 16, len(tokenizer), True)
    bench = throughput.Bench([SampleRequest([5, 6, 7], 3, 2)], InputProcessor(tokenizer, len(tokenizer), 64),
                             torch.device("cpu"), size, 1e12)
    assert bench.timed("hf-generate_batch", runner).wall_s == 5.0
    assert runner.untimed_s == 2.0


def test_bad_backends_and_modes_are_named() -> None:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    with pytest.raises(ValueError, match="--backend 'vllm'"):
        throughput.selected_systems(parser.parse_args(["--backend", "vllm"]))
    with pytest.raises(ValueError, match="--hf-mode 'beam'"):
        throughput.selected_systems(parser.parse_args(["--backend", "hf", "--hf-mode", "beam"]))
    args = parser.parse_args(["--backend", "hf,kvserve,hf", "--hf-mode", "static,single,static"])
    assert throughput.selected_systems(args) == [("hf", "static"), ("hf", "single"), ("kvserve", None)]


def test_run_stats_count_the_run_alone() -> None:
    before = {"num_preemptions": 1, "prefix_cache_queries": 100, "prefix_cache_hits": 20, "prefix_cache_evictions": 0,
              "peak_num_blocks_used": 3, "prefix_cache_hit_rate": 0.2}
    after = {**before, "num_preemptions": 4, "prefix_cache_queries": 300, "prefix_cache_hits": 170,
             "peak_num_blocks_used": 9}
    stats = throughput.run_stats(before, after)
    assert stats["num_preemptions"] == 3 and stats["prefix_cache_queries"] == 200
    assert stats["prefix_cache_hit_rate"] == 150 / 200 and stats["peak_num_blocks_used"] == 9


def _dataset_args(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    return parser.parse_args(flags)


@pytest.mark.parametrize("flags, message", [
    (["--num-repeats", "0"], "--num-repeats must be >= 1, got 0"),
    (["--gemm-size", "-5"], "--gemm-size must be >= 1, got -5"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--hf-batch-size", "0"], "--hf-batch-size must be >= 1, got 0"),
    (["--backend", "kvserve,hf", "--hf-batch-size", "-2"], "--hf-batch-size must be >= 1, got -2"),
    (["--result-json", "/"], "--result-json /: exists and is not a file"),
])
def test_bad_probe_flags_and_output_paths_are_refused_before_the_run(flags: list[str], message: str,
                                                                     capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "throughput", "/nonexistent/model", *flags]) == 2  # refused before the model is read
    assert capsys.readouterr().err == f"kvserve: error: {message}\n"
