"""How host work a token or a step grows with the size of things, where it should stay flat: CPU microseconds a
unit at a few sizes, for each place session 45's audit found growing (each through public APIs, so the same
script measures an older tree on PYTHONPATH):

- the detokenizer a token, at positions 256 / 4k / 16k of one output: plain text, and a run of never-valid UTF-8
  bytes of a byte-level BPE model (a `logit_bias` forces it), which the detokenizer held whole;
- a step's sampling rows for 4 speculating requests (k = 4), at 256 / 4k / 16k / 64k outputs each;
- the n-gram proposer a step (one new output), at the same histories;
- the disk tier's index update for each block file written, at 10^3 / 10^4 / 3x10^4 files (no file I/O);
- (session 46) the output processor a token of a streamed request (its snapshot at every step), plain and with
  20 top logprobs, at positions 256 / 4k / 16k.

CPU time (`time.process_time`), so a busy machine shifts the figures little; run with OMP_NUM_THREADS=1:

    kvserve make-checkpoint /tmp/tiny --arch llama --size tiny --seed 0
    OMP_NUM_THREADS=1 python benchmarks/host_growth.py --tokenizer /tmp/tiny
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from typing import Callable

OUTPUT_MARKS = (256, 4096, 16384)
HISTORIES = (256, 4096, 16384, 65536)
INDEXED_FILES = (1_000, 10_000, 30_000)


def cpu_us(work: Callable[[], object], repeat: int) -> float:
    """CPU microseconds a call of ``work``, over ``repeat`` calls."""
    start = time.process_time()
    for _ in range(repeat):
        work()
    return 1e6 * (time.process_time() - start) / repeat


def detokenizer(tokenizer_path: str) -> None:
    from transformers import AutoTokenizer

    from kvserve.engine.detokenizer import IncrementalDetokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 4000, add_special_tokens=False)
    lone_byte = tokenizer.convert_tokens_to_ids("\u0122")  # GPT-2's byte alphabet: U+0122 is the byte 0x80
    for name, tokens in (("plain text", text), ("never-valid bytes (0x80)", [lone_byte] * OUTPUT_MARKS[-1])):
        detok, times = IncrementalDetokenizer(tokenizer, [5, 6]), []
        for token in tokens[: OUTPUT_MARKS[-1]]:
            start = time.process_time()
            detok.update([token])
            times.append(time.process_time() - start)
        marks = "  ".join(f"@{mark}: {1e6 * sum(times[mark - 128:mark]) / 128:8.1f}" for mark in OUTPUT_MARKS)
        print(f"detokenizer us/token, {name:<26} {marks}")


def output_processor(tokenizer_path: str) -> None:
    from transformers import AutoTokenizer

    from kvserve.engine.output_processor import OutputProcessor
    from kvserve.outputs import TokenLogprobs
    from kvserve.sampling_params import SamplingParams
    from kvserve.sched.output import EngineOutput

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 4000, add_special_tokens=False)
    for name, logprobs in (("plain", None), ("20 top logprobs", 20)):
        processor, times = OutputProcessor(tokenizer), []
        params = SamplingParams(max_tokens=OUTPUT_MARKS[-1] + 1, logprobs=logprobs)
        processor.add_request("r", None, [5, 6], params, frozenset())
        for token in text[: OUTPUT_MARKS[-1]]:
            top = None if logprobs is None else [TokenLogprobs([token, *range(20)], [-1.0] * 21, list(range(1, 22)))]
            start = time.process_time()
            processor.process([EngineOutput("r", [token], logprobs=top)])
            times.append(time.process_time() - start)
        marks = "  ".join(f"@{mark}: {1e6 * sum(times[mark - 128:mark]) / 128:8.1f}" for mark in OUTPUT_MARKS)
        print(f"output processor us/token, streamed, {name:<17} {marks}")


def speculative_rows() -> None:
    from kvserve.sample.metadata import SamplingBatch, SamplingRow
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=10)
    for num_outputs in HISTORIES:
        rows = [SamplingRow(params, 0, f"r{i}", [1] * 16, list(range(num_outputs))) for i in range(4)]
        cost = cpu_us(lambda: SamplingBatch.of_requests(rows, [(1, 2, 3, 4)] * 4), 100)
        print(f"sampling rows us/step, 4 requests speculating k=4, {num_outputs:>6} outputs each: {cost:9.1f}")


def ngram_proposer() -> None:
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams
    from kvserve.spec.ngram import NgramProposer

    rng, proposer = random.Random(0), NgramProposer(1, 4)
    for num_outputs in HISTORIES:
        request = Request(f"r{num_outputs}", [rng.randrange(512) for _ in range(16)], SamplingParams(max_tokens=10))
        request.output_token_ids.extend(rng.randrange(512) for _ in range(num_outputs))
        proposer.propose(request, 4)

        def step() -> None:
            request.output_token_ids.append(rng.randrange(512))
            proposer.propose(request, 4)

        print(f"n-gram proposer us/step (one new output), {num_outputs:>6} outputs: {cpu_us(step, 200):9.1f}")


def disk_tier_index() -> None:
    from kvserve.kv.disk_tier import BlockFormat, DiskTier

    block_format = BlockFormat("m", "float32", 16, 1024)
    with tempfile.TemporaryDirectory() as folder:
        for num_files in INDEXED_FILES:
            tier = DiskTier(folder, capacity_bytes=num_files * 1024, block_format=block_format)
            tier.trim([(i.to_bytes(16, "big"), 1024) for i in range(num_files)])  # full, as a listing found it
            keys = iter((num_files + i).to_bytes(16, "big") for i in range(10_000))
            cost = cpu_us(lambda: tier.add(next(keys), 1024), 300)  # each one evicts the oldest
            print(f"disk tier us/block written, {num_files:>6} files indexed: {cost:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a checkpoint folder with a byte-level BPE tokenizer")
    args = parser.parse_args()
    detokenizer(args.tokenizer)
    output_processor(args.tokenizer)
    speculative_rows()
    ngram_proposer()
    disk_tier_index()


if __name__ == "__main__":
    main()
