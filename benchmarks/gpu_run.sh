#!/usr/bin/env bash
# Issues 16, 17 and 22's GPU checks and figures, run on the lent GPU machine from the repository root:
#
#     OUT=dir [DEADLINE=seconds] benchmarks/gpu_run.sh STEP...
#
# Steps: info, tests (the -m gpu tests, and the interpreter's Triton tests natively), kernels (attention and
# GGUF kernel micro-benchmarks), profile (decode steps with their kernel tables), splits (one stream with and
# without flash-decoding's split, and its splits merged in the decode launch or apart), ab (one stream with each
# of the latest one-stream changes turned off in turn), decode and decode_eager
# (gpu_decode_step.py: SmolLM2 and Llama-3-8B shapes, with CUDA graphs or without), overlap (decode steps with the overlapped scheduler and without), structured
# (JSON-schema rows through structured_output.py, the overlap on and off), roofline, batch1 (issue 16's (a): one
# stream of Llama-3-8B), sweep (issue 16's (e): a served sweep of Poisson rates), throughput (issue 16's (b): the
# random workload beside transformers), fixed (issue 16's (c): 1,000 in / 1,000 out), weight_only (issue 22:
# Llama-3-8B decode steps with INT4 weights against bf16, and the weight-only GEMM against cuBLAS per layer), kv
# (issue 17: decode steps over 2,000-token contexts in each KV dtype; the host and disk tiers' later-turn TTFT
# against recomputing; a restarted server's prefix from the disk tier), offload (issue 22: half of Llama-3-8B's
# weights streamed from host memory against the PCIe bound, and resident).
#
# The device tool brings back at most 8 files from $OUT, so the steps write into a folder of their own, packed
# after each step into $OUT/results.tar.gz, with the headline figures (benchmarks/gpu_summary.py) in
# $OUT/summary.txt, printed again last. No step starts after DEADLINE seconds (default 540), and a running one is
# stopped there, so that a call ends, packed, inside the tool's limit.
#
# A lease is 15 minutes of device time, the machine's start (a minute or two) included, and one call runs at
# most 10: two calls, the second at once while the machine is warm. At sessions 14 and 15's speeds (tests 230 s
# in one process, profile 45 s, ab and splits ~35 s a run, throughput about 150 s, fixed 320 s, sweep 120 s;
# weight_only about 180 s, estimated) a lease holds:
#
#     run(timeout_s=560): OUT=$OUT DEADLINE=530 benchmarks/gpu_run.sh info tests profile ab
#     run(timeout_s=240): OUT=$OUT DEADLINE=210 benchmarks/gpu_run.sh weight_only
#
# (profile and ab measure issue 16's (a) after sessions 24-26's kernels: the fused norm's warps, the rotary
# embedding in the K/V store, flash-decoding's merge in the decode launch, the skinny GEMM with the MLP's
# activation in its loads, programmatic dependent launch; if the tests step shows a failure, `tests` alone first,
# then `ab` with the failing part off), and later leases `fixed`, `throughput`, `kv`, `offload`, `sweep` (its
# latency half has never been measured), `kernels` (session 25's cascade rows) and `splits`. benchmarks/GPU_NOTES.md has each figure's
# floor and what to expect.
#
# The machine has torch, triton and transformers but not every kvserve dependency: wheels of the others are
# installed from .whl/ when it exists. Here, before the call (carry .whl; the device tool's README has the
# platform flags, and .git/info/exclude should name /.whl/):
#
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp <platform flags> \
#         -d .whl gguf platformdirs xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
#         typing-inspection typing-extensions "fastapi<0.125" "starlette<0.51" uvicorn jsonschema \
#         jsonschema-specifications referencing rpds-py attrs
#
# (pydantic and pydantic-core must be a matching pair; tests that need openai are not collected.)
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -u
DEST=${OUT:-gpu-out}
mkdir -p "$DEST"
OUT=$(mktemp -d)  # what the steps write; packed into $DEST after each step
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
kv() { python3 -m kvserve.cli "$@"; }
shapes=$(mktemp -d)

step_info() {
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
}

step_tests() {  # every -m gpu test, then the Triton tests CI runs through the interpreter, natively; in
    # TEST_WORKERS processes where pytest-xdist is there (the tests take their KV pools by block count, not by
    # the share of free memory, so they can share the GPU; most of their time is Triton compiling on the CPU)
    local workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-8}")
    python3 -m pytest "${workers[@]}" -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests
    python3 -m pytest "${workers[@]}" -q -p no:cacheprovider tests/attention/test_triton_paged.py \
        tests/model/test_triton_fused_ops.py tests/model/test_triton_skinny.py tests/sample/test_triton_first_max.py
}

step_kernels() {
    (cd benchmarks && python3 triton_attention.py --dtype bfloat16 && python3 triton_ggml.py --dtype bfloat16)
}

step_profile() {
    python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1 --steps 32 --profile-steps 8 \
        --json "$OUT/profile-llama3-8b.json"
    python3 benchmarks/gpu_decode_step.py --shape smollm2-135m --batch 1,64 --steps 32 --profile-steps 8 \
        --json "$OUT/profile-smollm2.json"
}

step_splits() {  # flash-decoding's split at one stream: the default against no split and against the splits
    for prompt in ${SPLIT_PROMPTS:-128}; do  # merged by a kernel of their own (SPLIT_PROMPTS="128 512": two contexts)
        for keys in 64 4096; do
            python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1 --steps 32 --prompt-len $prompt \
                --min-split-keys $keys --json "$OUT/splits-$prompt-$keys.json"
        done
        python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1 --steps 32 --prompt-len $prompt \
            --separate-merge --json "$OUT/splits-$prompt-separate-merge.json"
    done
}

step_ab() {  # issue 16's (a): one stream of Llama-3-8B with each of sessions 25 and 26's changes turned off in
    # turn (the skinny GEMMs, programmatic dependent launch, the merge in the decode launch), the same call; and
    # SmolLM2's shape (launch-bound) with PDL and without
    for flag in "" --torch-gemms --no-pdl --separate-merge; do
        python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1 --steps 32 $flag \
            --json "$OUT/ab-llama3-8b${flag:+-${flag#--}}.json"
    done
    for flag in "" --no-pdl; do
        python3 benchmarks/gpu_decode_step.py --shape smollm2-135m --batch 1,64 --steps 32 $flag \
            --json "$OUT/ab-smollm2${flag:+-${flag#--}}.json"
    done
}

step_decode() {
    python3 benchmarks/gpu_decode_step.py --shape smollm2-135m --batch 1,64,256 --json "$OUT/decode-smollm2.json"
    python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1,64 --json "$OUT/decode-llama3-8b.json"
}

step_weight_only() {  # issue 22: Llama-3-8B with INT4 (and INT8) weights against bf16's decode steps, one call
    for quantization in ${QUANTS:-auto int4}; do
        python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1,16 --steps 32 --quantization "$quantization" \
            --json "$OUT/weight-only-$quantization.json"
    done
    (cd benchmarks && python3 triton_weight_only.py)
}

step_kv() {  # issue 17 on the GPU, Llama-3-8B shape: decode steps over long contexts in each KV dtype, then the
    # tiers: later turns of conversations whose histories outgrow a small device pool, and a restarted server
    kv make-checkpoint "$shapes/llama3-8b" --config-only --shape llama3-8b >/dev/null
    for kv_dtype in ${KV_DTYPES:-auto int8 fp8}; do
        python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 64 --steps 32 --prompt-len 2000 \
            --kv-cache-dtype "$kv_dtype" --json "$OUT/kv-decode-$kv_dtype.json"
    done
    local model=(--model "$shapes/llama3-8b" --load-format dummy --device cuda --dtype bfloat16)
    python3 benchmarks/kv_offload.py multiturn "${model[@]}" --num-kv-blocks 128 --large-pool-blocks 1024 \
        --json "$OUT/kv-multiturn.json"
    python3 benchmarks/kv_offload.py restart "${model[@]}" --server-log "$OUT/kv-restart-server.log" \
        --json "$OUT/kv-restart.json"
}

step_offload() {  # issue 22: Llama-3-8B with 8 GiB of its weights streamed from pinned host memory, against the
    # PCIe bound, then resident, on a GPU held to 24 GiB free (weights that fit in half the free memory stay)
    for gib in 8 0; do
        python3 benchmarks/gpu_offload.py --offload-gib "$gib" --json "$OUT/offload-$gib.json"
    done
}

step_overlap() {  # the overlapped scheduler against scheduling each step after the one before, same call
    for flag in "" --no-overlap-scheduling; do
        python3 benchmarks/gpu_decode_step.py --shape smollm2-135m --batch 1,64,256 $flag \
            --json "$OUT/overlap-smollm2${flag:+-off}.json"
    done
}

step_structured() {  # JSON-schema rows (their continued steps' draws deferred) with the overlap and without
    kv make-checkpoint "$shapes/smollm2-135m" --config-only --shape smollm2-135m >/dev/null
    for flag in "" --no-overlap-scheduling; do
        python3 benchmarks/structured_output.py --model "$shapes/smollm2-135m" --load-format dummy --device cuda \
            --loads 64:8,256:8 --max-tokens 128 $flag > "$OUT/structured${flag:+-off}.json"
    done
}

step_decode_eager() {
    python3 benchmarks/gpu_decode_step.py --shape smollm2-135m --batch 1,64 --enforce-eager \
        --json "$OUT/decode-smollm2-eager.json"
    python3 benchmarks/gpu_decode_step.py --shape llama3-8b --batch 1 --enforce-eager \
        --json "$OUT/decode-llama3-8b-eager.json"
}

step_roofline() {
    kv make-checkpoint "$shapes/llama3-8b" --config-only --shape llama3-8b >/dev/null
    kv bench roofline "$shapes/llama3-8b" --device cuda --dtypes bfloat16 --copy-mib 2048 \
        --result-json "$OUT/roofline-llama3-8b.json"
}

llama8b_throughput() {  # label, then kvserve bench throughput's flags
    local label=$1; shift
    [ -d "$shapes/llama3-8b" ] || kv make-checkpoint "$shapes/llama3-8b" --config-only --shape llama3-8b >/dev/null
    kv bench throughput "$shapes/llama3-8b" --device cuda --dtype bfloat16 --load-format dummy --step-trace \
        --label "$label" --result-json "$OUT/$label.json" "$@"
}

step_batch1() {  # issue 16's (a): one stream, 128-token prompt, 512 new tokens
    llama8b_throughput batch1 --dataset-name random --num-prompts 1 --random-input-len 128 \
        --random-output-len 512 --random-range-ratio 0
}

step_throughput() {  # (b): prompts 128-1,024, 256 out, beside transformers' generate_batch (NUM_PROMPTS: the
    # issue's 512 takes transformers about 5 minutes at 8B, more than a lease spares; 128 by default)
    llama8b_throughput random --backend kvserve,hf --hf-mode "${HF_MODE:-generate_batch}" --hf-batch-size 32 --dataset-name random \
        --num-prompts "${NUM_PROMPTS:-128}" --random-input-len 576 --random-output-len 256 --random-range-ratio 0.778 --random-output-range-ratio 0 \
        --max-num-seqs 256 --max-num-batched-tokens 8192
}

step_fixed() {  # (c): 1,000 requests of 1,000 in / 1,000 out. At 512 sequences the H200's pool (864k tokens)
    # fills before a wave ends (128 preemptions in session 14, 22% more prefill), and steps near a full pool are
    # not scheduled ahead; at MAX_SEQS=384 the waves fit (a scheduler simulation: none; GPU_NOTES.md)
    llama8b_throughput fixed --dataset-name random --num-prompts 1000 --random-input-len 1000 \
        --random-output-len 1000 --random-range-ratio 0 --max-num-seqs "${MAX_SEQS:-384}" --max-num-batched-tokens 8192
}

step_sweep() {  # (e): kvserve serve, then kvserve bench serve over Poisson rates, ShareGPT-like lengths
    local shape=${SWEEP_SHAPE:-llama3-8b} port=${SWEEP_PORT:-8321} device=${SWEEP_DEVICE:-cuda}
    [ -d "$shapes/$shape" ] || kv make-checkpoint "$shapes/$shape" --config-only --shape "$shape" >/dev/null
    python3 -m kvserve.cli serve "$shapes/$shape" --device "$device" --dtype "${SWEEP_DTYPE:-bfloat16}" --load-format dummy --port "$port" \
        --served-model-name "$shape" --max-num-seqs 256 --max-model-len 2048 >"$OUT/sweep-server.log" 2>&1 &
    local server=$!
    python3 - "$port" <<'PY' || { kill "$server"; tail -20 "$OUT/sweep-server.log"; return 1; }
import sys, time, urllib.request
for _ in range(1200):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)
        sys.exit(0)
    except OSError:
        time.sleep(0.5)
sys.exit("the server did not answer /health in 10 minutes")
PY
    kv bench serve --base-url "http://127.0.0.1:$port" --model "$shape" --tokenizer "$shapes/$shape" --label "$shape" \
        --dataset-name random --random-input-len 256 --random-output-len 224 --random-range-ratio 0.9 \
        --num-prompts "${SWEEP_PROMPTS:-128}" --request-rate "${RATES:-4,16,32,inf}" --warmup 4 \
        --plot "$OUT/sweep" --result-json "$OUT/sweep.json"
    kill -TERM "$server"; wait "$server"
}

pack() {
    tar -czf "$DEST/results.tar.gz" -C "$OUT" .
    python3 benchmarks/gpu_summary.py "$OUT" >"$DEST/summary.txt" 2>&1
}

export -f $(compgen -A function)  # so that `timeout` can run a step in a shell of its own
export OUT shapes
for step in "$@"; do
    left=$(( ${DEADLINE:-540} - SECONDS ))
    if [ "$left" -lt 20 ]; then
        echo "=== $step not started: ${DEADLINE:-540} s deadline"
        continue
    fi
    echo "=== $step $(date +%T), $left s left"
    timeout -k 10 "$left" bash -c "step_$step" 2>&1 | tee "$OUT/$step.log"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "STOPPED: $step at the ${DEADLINE:-540} s deadline" | tee -a "$OUT/$step.log"
    fi
    pack
done
echo "=== done $(date +%T)"
cat "$DEST/summary.txt"
