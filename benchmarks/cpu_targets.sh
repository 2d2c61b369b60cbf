#!/usr/bin/env bash
# The CPU targets of issues 21 (fp32 against llama.cpp F32 and OpenVINO GenAI, native and forced to AVX2) and 22
# (the shipped GGUFs against llama.cpp on the same files, start-up), one step at a time, on a quiet machine, from
# the repository root; benchmarks/peers/README.md says how to build the peers:
#   LLAMA_SERVER=<llama-server> LLAMA_SERVER_AVX2=<its AVX2 build> LLAMA_F32=<F32 GGUF> OV_PYTHON=<OpenVINO venv
#   python> OV_MODEL=<OpenVINO IR> OUT=docs/results/<run> benchmarks/cpu_targets.sh [steps...]
# steps: native-c1 native-c16 avx2-c1 avx2-c16 openvino openvino-avx2 startup shipped gemma3 (default: all).
# Forced AVX2 runs every system through benchmarks/avx2_only.sh, which shows it a CPU without AVX-512 (CPUID
# answered with those features cleared, and kvserve's kernels, torch, MKL and oneDNN held by their own switches), and
# serves llama.cpp's AVX2 build. OpenVINO's CPU plugin picks its kernels by CPUID, so only the CPUID mask holds it
# to AVX2 (session 23: no zmm register in its JIT code or its sampled hot loops under the mask; session 18 found
# zmm FMAs under ONEDNN_MAX_CPU_ISA alone).
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -euo pipefail
OUT=${OUT:-docs/results/cpu-targets-$(date +%Y%m%d-%H%M)}
AVX2_ONLY=benchmarks/avx2_only.sh
WORKLOAD="--dataset-name random --num-prompts 64 --random-input-len 272 --random-output-len 136 --random-range-ratio 0.88 --seed 0"
steps=${*:-"native-c1 native-c16 avx2-c1 avx2-c16 openvino openvino-avx2 startup shipped gemma3"}

served() {  # served OUT_DIR RUNNER LLAMA_SERVER LOAD: fp32 against llama.cpp F32
  $2 env OUT=$1 LLAMA_SERVER=$3 SYSTEMS="kvserve-f32 llamacpp-f32" LOADS=$4 C1_PROMPTS=8 benchmarks/peers_table.sh
}

offline() {  # offline OUT_DIR RUNNER: the issue-6 workload, fp32 against OpenVINO GenAI f32 (compute and KV)
  mkdir -p "$1"
  $2 kvserve bench throughput smollm2-135m-instruct --backend kvserve --threads 2 $WORKLOAD --quantization none \
    --result-json "$1/kvserve-f32.json"
  python benchmarks/peers/dump_workload.py $WORKLOAD --out "$1/workload.json"
  $2 "$OV_PYTHON" benchmarks/peers/openvino_genai_offline.py --model "$OV_MODEL" --workload "$1/workload.json" \
    --result-json "$1/openvino.json" --kv-cache-precision f32
  rm "$1/workload.json"
}

for step in $steps; do
  case $step in
    native-c1) served "$OUT/native" env "$LLAMA_SERVER" c1 ;;
    native-c16) served "$OUT/native" env "$LLAMA_SERVER" c16 ;;
    avx2-c1) served "$OUT/forced-avx2" $AVX2_ONLY "$LLAMA_SERVER_AVX2" c1 ;;
    avx2-c16) served "$OUT/forced-avx2" $AVX2_ONLY "$LLAMA_SERVER_AVX2" c16 ;;
    openvino) offline "$OUT/openvino" env ;;
    openvino-avx2) offline "$OUT/openvino-avx2" $AVX2_ONLY ;;
    startup)  # issue 22: process start to /health 200, the default layout, model cached
      mkdir -p "$OUT"
      for i in 1 2 3; do
        start=$(date +%s.%N)
        kvserve serve --port 18790 > /dev/null 2>&1 & pid=$!
        until curl -sf http://127.0.0.1:18790/health > /dev/null; do sleep 0.1; done
        echo "default layout, start to healthy: $(echo "$(date +%s.%N) - $start" | bc) s" | tee -a "$OUT/startup.txt"
        kill $pid; wait $pid 2>/dev/null || true
      done ;;
    shipped)  # issue 22: SmolLM2 as shipped (Q4_1) at 1 stream against llama.cpp on the file, at 16 against fp32
      OUT=$OUT/shipped SYSTEMS="kvserve llamacpp-q4_1" LOADS=c1 C1_PROMPTS=8 benchmarks/peers_table.sh
      OUT=$OUT/shipped SYSTEMS="kvserve kvserve-f32" LOADS=c16 benchmarks/peers_table.sh ;;
    gemma3)  # issue 22: Gemma 3 270M as shipped (Q4_K_M), one stream, against llama.cpp on the same file (and
             # kvserve with int8 activations, llama.cpp's numerics)
      OUT=$OUT/gemma3 MODEL=gemma-3-270m SYSTEMS="kvserve llamacpp-q4_1 kvserve-mmap kvserve-q8act" LOADS=c1 C1_PROMPTS=8 \
        benchmarks/peers_table.sh ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
