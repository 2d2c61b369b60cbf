"""A step that raises, offline: ``generate`` re-raises, and the same LLM then gives a fresh engine's tokens. Nothing
the failed step planned is kept (``LLMEngine.step``, ``EngineCore.abandon_steps``): a tier load or a swap-in never
copied leaves no computed block on the prefix tree, an offload never copied is neither found in the host tier nor
written to the disk, and the runner's batch drops what the failed step's diff was to drop."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import pytest

from kvserve import LLM, SamplingParams
from kvserve.worker.input_batch import PersistentBatch
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.sched.batch_diff import RunnerBatchMirror
from kvserve.worker.kv_transfers import HostCopies
from kvserve.worker.model_runner import ModelRunner
from tests.conftest import assert_all_blocks_free

MAX_NEW = 6
SMALL_POOL = {"num_kv_blocks": 12, "block_size": 16, "max_model_len": 160, "max_num_batched_tokens": 64,
              "max_num_seqs": 4}
HOST_ROWS_26 = 0.0002  # GiB: 26 host rows of the tiny llama's blocks


class InjectedFault(RuntimeError):
    pass


def _fail_once(monkeypatch: pytest.MonkeyPatch, owner: type, name: str, when: Callable[..., bool]) -> list[str]:
    """Make the first call of ``owner.name`` for which ``when(*args)`` holds raise; returns a list that names the
    method once it has."""
    original, fired = getattr(owner, name), []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if not fired and when(*args, **kwargs):
            fired.append(name)
            raise InjectedFault(f"injected into {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return fired


def _tokens(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(num_tokens)]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _llm(path: Path, **options: Any) -> LLM:
    return LLM(str(path), dtype="float32", **SMALL_POOL, **options)


def _assert_clean(llm: LLM) -> None:
    core = llm.engine.core
    core.kv_manager.check_integrity(core.scheduler.requests.values())
    assert_all_blocks_free(llm)


PROMPT = _tokens(1, 50)
FILLERS = [_tokens(10 + i, 100) for i in range(3)]  # they push PROMPT's blocks out of the pool, into the host tier


@pytest.fixture(scope="module")
def expected(tiny_checkpoints) -> list[int]:
    return _run(LLM(str(tiny_checkpoints["llama"]), dtype="float32"), [PROMPT])[0]


@pytest.mark.parametrize("where", ["load copy", "batch update"])
def test_a_load_never_copied_leaves_no_computed_block(tiny_checkpoints, expected, monkeypatch, where) -> None:
    llm = _llm(tiny_checkpoints["llama"], kv_offload_memory=HOST_ROWS_26)
    _run(llm, [PROMPT] + FILLERS)
    if where == "load copy":
        fired = _fail_once(monkeypatch, HostCopies, "load", lambda self, kv, moves: bool(moves))
    else:  # the step's plan is taken, and the runner fails before it copies anything
        fired = _fail_once(monkeypatch, PersistentBatch, "update", lambda self, out: bool(out.kv_transfers.loads))
    with pytest.raises(InjectedFault):
        _run(llm, [PROMPT])
    _assert_clean(llm)
    assert _run(llm, [PROMPT])[0] == expected and fired
    assert llm.stats()["kv_offload_host_hit_tokens"] > 0  # the host tier still serves the prefix
    _assert_clean(llm)


def test_a_schedule_that_raises_after_planning_loads_keeps_none_of_them(tiny_checkpoints, expected,
                                                                        monkeypatch) -> None:
    """The step never came to the runner: the request admitted over tier loads finished committing them (its
    blocks cached unfilled), and the loads stayed planned for blocks no longer its."""
    llm = _llm(tiny_checkpoints["llama"], kv_offload_memory=HOST_ROWS_26)
    _run(llm, [PROMPT] + FILLERS)
    fired = _fail_once(monkeypatch, RunnerBatchMirror, "rows",
                       lambda self, scheduled, drafts: any(r.num_computed_tokens for r, _ in scheduled))
    with pytest.raises(InjectedFault):
        _run(llm, [PROMPT])
    _assert_clean(llm)
    llm.engine.flush_kv_offload()  # takes what is planned: nothing
    assert _run(llm, [PROMPT])[0] == expected and fired
    _assert_clean(llm)


def test_an_offload_never_copied_is_neither_found_nor_written(tiny_checkpoints, expected, monkeypatch,
                                                               tmp_path) -> None:
    path = tiny_checkpoints["llama"]
    llm = _llm(path, kv_offload_memory=HOST_ROWS_26, kv_offload_dir=str(tmp_path))
    fired = _fail_once(monkeypatch, HostCopies, "offload", lambda self, kv, moves: bool(moves))
    with pytest.raises(InjectedFault):  # PROMPT's blocks, written through to the disk as computed
        _run(llm, [PROMPT])
    _run(llm, FILLERS)  # the next steps' copies go on
    _assert_clean(llm)
    assert _run(llm, [PROMPT])[0] == expected and fired
    llm.engine.flush_kv_offload()
    restarted = _llm(path, kv_offload_dir=str(tmp_path))
    assert _run(restarted, [PROMPT])[0] == expected


def test_a_swap_in_never_copied_leaves_no_computed_block(tiny_checkpoints, monkeypatch) -> None:
    path = tiny_checkpoints["llama"]
    prompts = [_tokens(20 + i, 40) for i in range(4)]
    reference = LLM(str(path), dtype="float32")
    alone = [_run(reference, [p], 40)[0] for p in prompts]
    llm = _llm(path, preemption_mode="swap", kv_offload_memory=HOST_ROWS_26)
    fired = _fail_once(monkeypatch, HostCopies, "swap_in", lambda self, kv, moves: bool(moves))
    with pytest.raises(InjectedFault):
        _run(llm, prompts, 40)
    _assert_clean(llm)
    assert _run(llm, prompts, 40) == alone and fired
    _assert_clean(llm)


def test_the_runner_drops_what_a_failed_diff_was_to_drop(tiny_checkpoints, monkeypatch) -> None:
    """The diff that failed named a request finished the step before: its runner row goes with the next diff, and
    its id is free again at once (the failed step counts as back)."""
    llm = _llm(tiny_checkpoints["llama"])
    engine, runner = llm.engine, llm.engine.core.runner
    fired = _fail_once(monkeypatch, PersistentBatch, "update", lambda self, out: bool(out.finished_request_ids))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (2, 10)]
    with pytest.raises(InjectedFault):
        llm.generate([{"prompt_token_ids": _tokens(1, 10)}, {"prompt_token_ids": _tokens(2, 10)}], params,
                     use_tqdm=False)
    assert fired
    expected = _run(llm, [_tokens(3, 10)])
    assert runner.batch.num_requests == 0 and runner.sampler.num_states == 0
    engine.add_request("a", {"prompt_token_ids": _tokens(3, 10)}, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                                 ignore_eos=True))
    assert _drain(engine) == expected
    with monkeypatch.context() as patch:  # a failed step, then the same id at once
        _fail_once(patch, PersistentBatch, "update", lambda self, out: True)
        engine.add_request("a", {"prompt_token_ids": _tokens(4, 10)}, SamplingParams(max_tokens=MAX_NEW))
        with pytest.raises(InjectedFault):
            engine.step()
    engine.add_request("a", {"prompt_token_ids": _tokens(3, 10)}, SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                                 ignore_eos=True))
    assert _drain(engine) == expected
    _assert_clean(llm)


def _drain(engine: Any) -> list[list[int]]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(final_only=True)
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_the_overlapped_loop_leaves_no_token_in_flight_nor_draw_waiting(tiny_checkpoints, monkeypatch) -> None:
    """CUDA's loop, forced on the CPU: a step read back while the next one's grammar draw waits for it fails; the
    next, unrelated request found that draw and the token in flight of a request gone ("scheduled but was never
    added to the runner's batch")."""
    path = tiny_checkpoints["llama"]
    prompt = [{"prompt_token_ids": _tokens(5, 6)}]
    plain = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    llms = [_llm(path), _llm(path)]
    for llm in llms:
        llm.engine.overlap_outputs = llm.engine.overlap_scheduling = True
    fresh, llm = llms
    expected = [list(o.outputs[0].token_ids) for o in fresh.generate(prompt, plain, use_tqdm=False)]
    fired = _fail_once(monkeypatch, ModelRunner, "_finish", lambda self, *args: self._deferred is not None)
    grammar = SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,40}"))
    with pytest.raises(InjectedFault):
        llm.generate([{"prompt_token_ids": _tokens(6, 4)}], grammar, use_tqdm=False)
    assert fired
    assert [list(o.outputs[0].token_ids) for o in llm.generate(prompt, plain, use_tqdm=False)] == expected
    _assert_clean(llm)
