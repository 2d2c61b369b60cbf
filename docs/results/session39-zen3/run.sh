#!/usr/bin/env bash
# Session 39's served figures on a real AVX2-only CPU (AMD EPYC Zen 3): kvserve at this tree and at the session's
# Run from the repository root.
# start (52b6680, PYTHONPATH), llama.cpp's llama-server built natively (AVX2) on the same file.
set -u
export LLAMA_SERVER=${LLAMA_SERVER:?the native llama-server: benchmarks/peers/README.md}
R=${R:-docs/results/session39-zen3}
T=benchmarks/peers_table.sh
for round in 1 2; do
  OUT=$R/c1-r$round SYSTEMS="kvserve llamacpp-q4_1" LOADS=c1 C1_PROMPTS=8 bash $T > /dev/null 2>&1
  OUT=$R/c1-start-r$round SYSTEMS="kvserve" LOADS=c1 C1_PROMPTS=8 PYTHONPATH=${START_TREE:?a worktree of 52b6680} bash $T > /dev/null 2>&1
done
OUT=$R/c16 SYSTEMS="kvserve-f32 kvserve llamacpp-q4_1" LOADS=c16 bash $T > /dev/null 2>&1
OUT=$R/c16-start SYSTEMS="kvserve-f32 kvserve" LOADS=c16 PYTHONPATH=${START_TREE:?a worktree of 52b6680} bash $T > /dev/null 2>&1
OUT=$R/gemma-c1 MODEL=gemma-3-270m SYSTEMS="kvserve llamacpp-q4_1" LOADS=c1 C1_PROMPTS=8 bash $T > /dev/null 2>&1
echo done
