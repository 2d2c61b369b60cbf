#!/usr/bin/env bash
# Which vector registers OpenVINO's CPU plugin runs, masked by benchmarks/avx2_only.sh and not (ONEDNN_MAX_CPU_ISA=AVX2
# alone): (1) its JIT kernels, dumped by oneDNN's ONEDNN_JIT_DUMP and disassembled, counting lines that name zmm and
# ymm registers; (2) its compiled kernels, sampled by perf (cpu-clock) over 16 requests of the issue-6 shape and
# each sampled instruction disassembled (isa_mix.py). From the repository root:
#   OV_PYTHON=<OpenVINO venv python> OV_MODEL=<OpenVINO IR> docs/results/session23-emr/openvino/isa_check.sh
set -euo pipefail
repo=$(pwd); here=$repo/docs/results/session23-emr/openvino
scratch=$(mktemp -d)
plugin=$(find "$(dirname "$(dirname "$OV_PYTHON")")" -name libopenvino_intel_cpu_plugin.so | head -1)
python benchmarks/peers/dump_workload.py --dataset-name random --num-prompts 16 --random-input-len 272 \
  --random-output-len 64 --random-range-ratio 0.88 --seed 0 --out "$scratch/requests.json" > /dev/null
for mode in masked unmasked; do
  runner="$repo/benchmarks/avx2_only.sh"; [[ $mode == unmasked ]] && runner="env ONEDNN_MAX_CPU_ISA=AVX2"
  mkdir -p "$scratch/$mode" && cd "$scratch/$mode"
  ONEDNN_JIT_DUMP=1 $runner "$OV_PYTHON" "$repo/benchmarks/peers/openvino_genai_offline.py" --model "$OV_MODEL" \
    --workload "$scratch/requests.json" --result-json r.json --kv-cache-precision f32 > /dev/null 2>&1
  for f in *.bin; do objdump -D -b binary -mi386:x86-64 "$f"; done > jit.s
  echo "$mode: $(ls ./*.bin | wc -l) JIT kernels, lines naming zmm $(grep -c zmm jit.s), ymm $(grep -c ymm jit.s)"
  perf record -q -e cpu-clock -F 999 -o perf.data -- $runner "$OV_PYTHON" \
    "$repo/benchmarks/peers/openvino_genai_offline.py" --model "$OV_MODEL" --workload "$scratch/requests.json" \
    --result-json r.json --kv-cache-precision f32 > /dev/null 2>&1
  perf report -i perf.data --no-children --sort dso,sym --stdio -g none 2>/dev/null \
    | awk '/libopenvino_intel_cpu_plugin/ {print $1, $NF}' > hot.txt
  echo "$mode: the plugin's sampled instructions by register, $(python3 "$here/isa_mix.py" "$plugin" hot.txt)"
  cd "$repo"
done
rm -rf "$scratch"
