#!/usr/bin/env bash
# Session 41's served fp32 rows on a real AVX2-only CPU (AMD EPYC Zen 3): kvserve `--quantization none` against
# llama.cpp's llama-server on the F32 GGUF (benchmarks/peers/README.md makes both), one stream, in both orders.
# Run from the repository root.
set -u
export LLAMA_SERVER=${LLAMA_SERVER:?the native llama-server: benchmarks/peers/README.md}
export LLAMA_F32=${LLAMA_F32:?the F32 GGUF: benchmarks/peers/README.md}
R=${R:-docs/results/session41-zen3}
OUT=$R/c1-f32-a SYSTEMS="kvserve-f32 llamacpp-f32" LOADS=c1 C1_PROMPTS=8 bash benchmarks/peers_table.sh > /dev/null 2>&1
OUT=$R/c1-f32-b SYSTEMS="llamacpp-f32 kvserve-f32" LOADS=c1 C1_PROMPTS=8 bash benchmarks/peers_table.sh > /dev/null 2>&1
# start-up: process start to /health 200, the default model cached
TREES="$(pwd)" N=3 docs/results/session17-emr/startup.sh > $R/startup.txt
echo done
