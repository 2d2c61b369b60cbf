"""Export a GGUF checkpoint (by default the shipped SmolLM2-135M-Instruct Q4_1) as a Hugging Face fp32 directory.

The peers are compared on the same weights kvserve runs: transformers dequantizes the GGUF to fp32 on load;
dropping the quantizer and its config makes ``save_pretrained`` write plain fp32 safetensors that llama.cpp's
``convert_hf_to_gguf.py`` (an F32 GGUF) and ``optimum-cli export openvino`` (an fp32 IR) both read::

    python benchmarks/peers/export_f32.py --out "$PEERS_DIR/smollm2-f32-hf"            # $PEERS_DIR: your choice
    python benchmarks/peers/export_f32.py --out "$PEERS_DIR/smollm2-f32-hf" --check    # greedy tokens checked too
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_source import pretrained_args

DEFAULT_MODEL = "smollm2-135m-instruct"
CHECK_PROMPT = "The three primary colours are"
CHECK_NUM_TOKENS = 32


def load_gguf_fp32(model: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The GGUF behind kvserve's ``model`` string, dequantized by transformers to fp32."""
    directory, kwargs = pretrained_args(model)
    if "gguf_file" not in kwargs:
        raise ValueError(f"{model!r} resolves to the Hugging Face directory {directory}, not a GGUF file")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, **kwargs)
    return hf_model.eval(), tokenizer


def save_fp32(hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    # Without this the directory would claim to be GGUF-quantized and loaders would look for the GGUF file.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def greedy_ids(hf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    input_ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    out = hf_model.generate(input_ids, max_new_tokens=CHECK_NUM_TOKENS, min_new_tokens=CHECK_NUM_TOKENS,
                            do_sample=False)
    return out[0, input_ids.shape[1]:].tolist()


def check_same_greedy(reference: list[int], out: Path) -> None:
    """The saved directory, reloaded, must produce the GGUF's greedy tokens."""
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = greedy_ids(reloaded, transformers.AutoTokenizer.from_pretrained(out))
    if tokens != reference:
        raise SystemExit(f"greedy tokens differ: GGUF {reference} vs {out} {tokens}")
    print(f"same {len(tokens)} greedy tokens from the GGUF and {out}: {tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a packaged model name or a .gguf file")
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    parser.add_argument("--check", action="store_true", help="compare greedy tokens of the GGUF and the export")
    args = parser.parse_args()
    hf_model, tokenizer = load_gguf_fp32(args.model)
    reference = greedy_ids(hf_model, tokenizer) if args.check else None
    save_fp32(hf_model, tokenizer, args.out)
    print(f"wrote {args.out}")
    if reference is not None:
        check_same_greedy(reference, args.out)


if __name__ == "__main__":
    main()
