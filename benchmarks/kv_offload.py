"""KV tiers (issue 17), SmolLM2-135M on CPU by default, each scenario against its baseline in the same run.

    PYTHONPATH=. python benchmarks/kv_offload.py multiturn [--conversations 8] [--turns 4] [--num-kv-blocks 128]
    PYTHONPATH=. python benchmarks/kv_offload.py restart [--prefix-len 1500]
    # on a GPU, at a published shape with dummy weights (``kvserve make-checkpoint DIR --config-only --shape ...``)
    PYTHONPATH=. python benchmarks/kv_offload.py multiturn --model DIR --load-format dummy --device cuda ...

``multiturn``: conversations take turns one request at a time (conversation 0 turn 0, conversation 1 turn 0, ...,
conversation 0 turn 1, ...), each turn resending its history as token ids (the previous turn's prompt, a
scripted answer, a new message), through an offline engine whose device pool (``--num-kv-blocks``) is too small
to keep the histories between turns. Each turn asks for one token, so its time is its TTFT. Variants, each a
fresh engine on the same requests: ``recompute`` (no tiers: evicted histories are prefilled again), ``host``
(``kv_offload_memory``), ``disk`` (``kv_offload_dir`` alone: the host slab only stages its reads and writes;
the files sit in the OS page cache, as on a machine with memory to spare), and ``device`` (a pool that keeps
every history, ``--large-pool-blocks``: the floor). Their first tokens must agree.

``restart``: ``kvserve serve --kv-offload-dir DIR`` answers a ``--prefix-len``-token prompt, is stopped with
SIGTERM and started again on DIR; the second server answers the same prompt (its prefix from the disk tier)
and a fresh prompt of the same length (a cold prefill, the baseline), streaming; TTFT is the first streamed
token's arrival. The two answers to the same prompt must be byte-identical.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import ordinary_token_ids
from kvserve.model.loader import load_checkpoint
from kvserve.model.sources import resolve_model

MODEL = "smollm2-135m-instruct"


def conversations(tokenizer, num_conversations: int, num_turns: int, first_len: int, turn_len: int,
                  answer_len: int, seed: int) -> list[list[int]]:
    """The prompts in the order they are sent: turn by turn, each turn going round the conversations."""
    rng = random.Random(seed)
    ids = ordinary_token_ids(tokenizer)
    histories = [rng.choices(ids, k=first_len) for _ in range(num_conversations)]
    prompts = []
    for _ in range(num_turns):
        for history in histories:
            prompts.append(list(history))
            history += rng.choices(ids, k=answer_len) + rng.choices(ids, k=turn_len)
    return prompts


def run_turns(llm: LLM, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each prompt alone, one token each: (seconds per turn, first tokens)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    seconds, first_tokens = [], []
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        seconds.append(time.perf_counter() - start)
        first_tokens.append(out.outputs[0].token_ids[0])
    return seconds, first_tokens


def multiturn(args: argparse.Namespace) -> dict:
    variants = {
        "recompute": {"num_kv_blocks": args.num_kv_blocks},
        "host": {"num_kv_blocks": args.num_kv_blocks, "kv_offload_memory": 2.0},
        "disk": {"num_kv_blocks": args.num_kv_blocks, "kv_offload_dir": tempfile.mkdtemp(prefix="kv-blocks-")},
        "device": {"num_kv_blocks": args.large_pool_blocks},
    }
    results, tokens = {}, {}
    prompts = None
    for name, options in variants.items():
        llm = LLM(args.model, max_num_seqs=1, **engine_options(args), **options)
        prompts = prompts or conversations(llm.get_tokenizer(), args.conversations, args.turns, args.first_turn_len,
                                           args.turn_len, args.answer_len, args.seed)
        seconds, tokens[name] = run_turns(llm, prompts)
        later = seconds[args.conversations:]  # turns after the first of each conversation
        stats = llm.stats()
        results[name] = {
            "later_turn_ttft_median_s": statistics.median(later),
            "later_turn_ttft_mean_s": statistics.mean(later),
            "first_turn_ttft_median_s": statistics.median(seconds[: args.conversations]),
            "num_kv_blocks": stats["num_blocks_total"],
            "prefix_cache_hits": stats["prefix_cache_hits"],
            **{key: value for key, value in stats.items() if key.startswith("kv_offload") or key.startswith("kv_reload")},
        }
        print(f"{name:9s} later turns TTFT median {results[name]['later_turn_ttft_median_s'] * 1e3:8.1f} ms  "
              f"mean {results[name]['later_turn_ttft_mean_s'] * 1e3:8.1f} ms  prefix hits {stats['prefix_cache_hits']}",
              flush=True)
    results["first_tokens_agree"] = all(t == tokens["device"] for t in tokens.values())
    check_same_answers(args, results["first_tokens_agree"], "the variants' first tokens differ")
    base = results["recompute"]["later_turn_ttft_median_s"]
    for name in ("host", "disk", "device"):
        results[name]["speedup_vs_recompute"] = base / results[name]["later_turn_ttft_median_s"]
        print(f"{name}: later turns' TTFT {results[name]['speedup_vs_recompute']:.2f}x lower than recomputing")
    return results


def check_same_answers(args: argparse.Namespace, same: bool, what: str) -> None:
    """Real weights must answer alike however the KV got there. Dummy weights give flat logits (every token's
    about -ln(vocabulary)), whose greedy choice rounding decides, and a GPU's GEMMs round differently in steps of
    other shapes: there a difference is reported, and the timings still kept."""
    if same:
        return
    if args.load_format != "dummy":
        raise AssertionError(what)
    print(f"note: {what}; with dummy weights rounding picks among tied tokens, so this says nothing of the KV")


def engine_options(args: argparse.Namespace) -> dict[str, str]:
    return {"device": args.device, "load_format": args.load_format, "dtype": args.dtype}


def serve(args: argparse.Namespace, blocks_dir: str, log_path: str) -> subprocess.Popen:
    log = open(log_path, "ab")
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in engine_options(args).items()]
    server = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", args.model, "--port", str(args.port),
                               "--served-model-name", MODEL, "--kv-offload-dir", blocks_dir, *flags],
                              stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{args.port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}; see {log_path}")
        time.sleep(0.5)
    raise RuntimeError(f"the server did not come up; see {log_path}")


def stream_ttft(port: int, prompt: list[int], max_tokens: int) -> tuple[float, str, int]:
    """(seconds to the first streamed token, the whole text, cached prompt tokens)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, first, text, cached = time.perf_counter(), None, [], 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter() - start
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert first is not None, "no token was streamed"
    return first, "".join(text), cached


def restart(args: argparse.Namespace) -> dict:
    tokenizer = load_checkpoint(resolve_model(args.model), torch.float32, args.load_format).tokenizer
    rng = random.Random(args.seed)
    ids = ordinary_token_ids(tokenizer)
    prompt, fresh = rng.choices(ids, k=args.prefix_len), rng.choices(ids, k=args.prefix_len)
    blocks_dir = tempfile.mkdtemp(prefix="kv-blocks-")
    log_path = args.server_log or blocks_dir + ".log"
    first_server = serve(args, blocks_dir, log_path)
    try:
        cold_first, text_first, _ = stream_ttft(args.port, prompt, args.max_tokens)
    finally:
        first_server.send_signal(signal.SIGTERM)
        first_server.wait(120)
    second_server = serve(args, blocks_dir, log_path)
    try:
        stream_ttft(args.port, rng.choices(ids, k=16), 2)  # warm-up: the first request's one-off costs
        disk, text_second, cached = stream_ttft(args.port, prompt, args.max_tokens)
        cold, _, _ = stream_ttft(args.port, fresh, args.max_tokens)
    finally:
        second_server.send_signal(signal.SIGTERM)
        second_server.wait(120)
    check_same_answers(args, text_second == text_first, "the restarted server answered the same prompt differently")
    result = {"prefix_len": args.prefix_len, "ttft_cold_first_server_s": cold_first, "ttft_cold_s": cold,
              "ttft_from_disk_s": disk, "cached_tokens": cached, "speedup": cold / disk,
              "identical_text": text_second == text_first}
    print(f"restart: {args.prefix_len}-token prompt, TTFT from the disk tier {disk * 1e3:.1f} ms vs a cold prefill "
          f"{cold * 1e3:.1f} ms on the same server ({cold / disk:.1f}x sooner; {cached} tokens cached); the first "
          f"server's cold TTFT {cold_first * 1e3:.1f} ms; answers "
          f"{'byte-identical' if text_second == text_first else 'different (dummy weights)'}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="scenario", required=True)
    turns = sub.add_parser("multiturn")
    turns.add_argument("--conversations", type=int, default=8)
    turns.add_argument("--turns", type=int, default=4)
    turns.add_argument("--first-turn-len", type=int, default=1000)
    turns.add_argument("--turn-len", type=int, default=100)
    turns.add_argument("--answer-len", type=int, default=64)
    turns.add_argument("--num-kv-blocks", type=int, default=128, help="the small device pool (blocks of 16)")
    turns.add_argument("--large-pool-blocks", type=int, default=1024, help="the pool that keeps every history")
    again = sub.add_parser("restart")
    again.add_argument("--prefix-len", type=int, default=1500)
    again.add_argument("--max-tokens", type=int, default=32)
    again.add_argument("--port", type=int, default=18711)
    again.add_argument("--server-log", help="both servers' output (default: beside the blocks' temporary folder)")
    for p in (turns, again):
        p.add_argument("--model", default=MODEL)
        p.add_argument("--device", default="auto")
        p.add_argument("--load-format", default="auto", help="dummy: random weights (a --config-only shape)")
        p.add_argument("--dtype", default="auto")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = multiturn(args) if args.scenario == "multiturn" else restart(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
