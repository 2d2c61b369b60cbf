"""Write a ``kvserve bench`` workload as token ids and exact output lengths, for peers that run without kvserve.

The workload is built by ``kvserve.bench.datasets.build_dataset`` from the same flags ``kvserve bench`` takes, so
a peer run in another virtual environment (``openvino_genai_offline.py``) sees exactly the requests kvserve
sees. Text prompts and chat messages are tokenized the way kvserve's ``InputProcessor`` does::

    python benchmarks/peers/dump_workload.py --dataset-name random --num-prompts 64 --seed 0 --out W.json

Output: ``{"workload": {the dataset flags}, "requests": [{"prompt_token_ids": [...], "output_len": N,
"group": G}, ...]}`` in the dataset's order (a prefix group's requests next to each other).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase

from hf_source import pretrained_args
from kvserve.bench.datasets import SampleRequest, add_dataset_arguments, build_dataset
from kvserve.engine.input_processor import InputProcessor
from kvserve.sampling_params import SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"
# Each turn's history holds the server's previous answers, which only a live server produces.
SERVE_ONLY_DATASETS = {"multiturn"}


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    directory, kwargs = pretrained_args(model)
    return transformers.AutoTokenizer.from_pretrained(directory, **kwargs)


def prompt_token_ids(processor: InputProcessor, request: SampleRequest) -> list[int]:
    if request.messages is not None:
        return processor.apply_chat_template(request.messages)["prompt_token_ids"]
    if isinstance(request.prompt, str):
        return processor.process(request.prompt, SamplingParams(max_tokens=request.output_len)).prompt_token_ids
    return list(request.prompt)


def workload_json(args: argparse.Namespace, requests: list[SampleRequest],
                  tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    # The peers check their own context limits; this only turns prompts into ids.
    processor = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=sys.maxsize)
    flags = {k: v for k, v in vars(args).items() if k != "out"}
    return {
        "workload": {**flags, "num_requests": len(requests)},
        "requests": [{"prompt_token_ids": prompt_token_ids(processor, r), "output_len": r.output_len,
                      "group": r.group} for r in requests],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="whose tokenizer builds the workload")
    parser.add_argument("--out", type=Path, required=True)
    add_dataset_arguments(parser)
    args = parser.parse_args()
    if args.dataset_name in SERVE_ONLY_DATASETS:
        raise SystemExit(f"{args.dataset_name} is a serve-only workload: each turn resends the server's answers")
    tokenizer = load_tokenizer(args.model)
    data = workload_json(args, build_dataset(args, tokenizer), tokenizer)
    args.out.write_text(json.dumps(data, default=str) + "\n")  # flags may hold Paths
    num_input = sum(len(r["prompt_token_ids"]) for r in data["requests"])
    print(f"wrote {len(data['requests'])} requests ({num_input} prompt tokens) to {args.out}")


if __name__ == "__main__":
    main()
