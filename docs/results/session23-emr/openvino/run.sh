#!/usr/bin/env bash
# Issue 21's offline target on AVX2: the issue-6 workload, fp32, kvserve against OpenVINO GenAI f32 (compute and KV),
# both run through benchmarks/avx2_only.sh (CPUID without AVX-512), in rounds that alternate which runs first.
# From the repository root: OV_PYTHON=<OpenVINO venv python> OV_MODEL=<OpenVINO IR> ROUNDS=3 \
#   docs/results/session23-emr/openvino/run.sh   (add NATIVE=1 to run both without the mask instead)
set -euo pipefail
here=docs/results/session23-emr/openvino
runner=benchmarks/avx2_only.sh; kind=avx2
if [[ ${NATIVE:-0} == 1 ]]; then runner=env; kind=native; fi
WORKLOAD="--dataset-name random --num-prompts 64 --random-input-len 272 --random-output-len 136 --random-range-ratio 0.88 --seed 0"
workload=$(mktemp --suffix .json)
python benchmarks/peers/dump_workload.py $WORKLOAD --out "$workload" > /dev/null
kvserve_run() {
  $runner kvserve bench throughput smollm2-135m-instruct --backend kvserve --threads 2 $WORKLOAD --quantization none \
    --result-json "$here/$kind-round$1-kvserve.json" 2>&1 | grep -E "^kvserve " | tee -a "$here/$kind.log"
}
openvino_run() {
  $runner "$OV_PYTHON" benchmarks/peers/openvino_genai_offline.py --model "$OV_MODEL" --workload "$workload" \
    --result-json "$here/$kind-round$1-openvino.json" --kv-cache-precision f32 2>&1 | tail -1 | tee -a "$here/$kind.log"
}
for round in $(seq 1 "${ROUNDS:-3}"); do
  echo "round $round" | tee -a "$here/$kind.log"
  if (( round % 2 )); then kvserve_run "$round"; openvino_run "$round"; else openvino_run "$round"; kvserve_run "$round"; fi
done
rm "$workload"
