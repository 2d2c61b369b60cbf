#!/usr/bin/env bash
# Session 12's figures, in one quiet run on one machine (run from the repository root):
#   LLAMA_SERVER=<llama-server> LLAMA_SERVER_AVX2=<its AVX2 build> LLAMA_F32=<F32 GGUF> OV_PYTHON=<OpenVINO venv python> \
#   OV_MODEL=<OpenVINO IR> docs/results/session12-zen4/run.sh [steps...]
# steps: avx2-c16 native-c16 openvino startup gemma3 (default: all), as benchmarks/peers/README.md builds the peers.
set -euo pipefail
OUT=${OUT:-docs/results/session12-zen4}
AVX2_ENV="KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2"
WORKLOAD="--dataset-name random --num-prompts 64 --random-input-len 272 --random-output-len 136 --random-range-ratio 0.88 --seed 0"
steps=${*:-"avx2-c16 native-c16 openvino startup gemma3"}
for step in $steps; do
  case $step in
    avx2-c16)  # issue 21: 16 streams, fp32 against llama.cpp F32, both held to AVX2
      env $AVX2_ENV OUT=$OUT/forced-avx2 LLAMA_SERVER=$LLAMA_SERVER_AVX2 SYSTEMS="kvserve-f32 llamacpp-f32" LOADS=c16 \
        benchmarks/peers_table.sh ;;
    native-c16)
      OUT=$OUT/native SYSTEMS="kvserve-f32 llamacpp-f32" LOADS=c16 benchmarks/peers_table.sh ;;
    openvino)  # issue 21: offline, the issue-6 workload, fp32 against OpenVINO GenAI f32
      mkdir -p $OUT/openvino
      kvserve bench throughput smollm2-135m-instruct --backend kvserve --threads 2 $WORKLOAD --quantization none \
        --result-json $OUT/openvino/kvserve-f32.json
      python benchmarks/peers/dump_workload.py $WORKLOAD --out $OUT/openvino/workload.json
      $OV_PYTHON benchmarks/peers/openvino_genai_offline.py --model $OV_MODEL --workload $OUT/openvino/workload.json \
        --result-json $OUT/openvino/openvino.json --kv-cache-precision f32
      rm $OUT/openvino/workload.json ;;
    startup)  # issue 22: process start to /health 200, the default layout, model cached
      mkdir -p $OUT
      for i in 1 2 3; do
        start=$(date +%s.%N)
        kvserve serve --port 18790 > /dev/null 2>&1 & pid=$!
        until curl -sf http://127.0.0.1:18790/health > /dev/null; do sleep 0.1; done
        echo "default layout, start to healthy: $(echo "$(date +%s.%N) - $start" | bc) s" | tee -a $OUT/startup.txt
        kill $pid; wait $pid 2>/dev/null || true
      done ;;
    gemma3)  # issue 22: Gemma 3 270M as shipped (Q4_K_M), one stream, against llama.cpp on the same file
      OUT=$OUT/gemma3 MODEL=gemma-3-270m SYSTEMS="kvserve llamacpp-q4_1 kvserve-mmap" LOADS=c1 C1_PROMPTS=8 \
        benchmarks/peers_table.sh ;;
  esac
done
