#!/usr/bin/env bash
# Issue 8's served table: kvserve, llama.cpp's llama-server on the shipped Q4_1 GGUF and on the F32 GGUF of the
# same weights, each a fresh server with 16 slots / sequences, driven by `kvserve bench serve` over the same
# seeded `random` workload at concurrency 1, 4 and 16, then the `prefix` workload. One JSON per pass in $OUT
# (default docs/results/peers-<date>), with the machine's load average around it (.load), then `kvserve bench
# compare` tables per load.
#
#   LLAMA_SERVER=$PEERS_DIR/llamacpp/build/bin/llama-server LLAMA_F32=$PEERS_DIR/smollm2-f32.gguf \
#       benchmarks/peers_table.sh
#   (benchmarks/peers/README.md says how to build llama-server and make the F32 GGUF)
#   llama-server runs with THREADS threads (default: torch's thread count, the one kvserve runs with)
#   SYSTEMS="kvserve-nocache" LOADS="c16 prefix" benchmarks/peers_table.sh   # a subset; kvserve-nocache: the
#                                                                           # prefix cache off (issue 9)
#   SYSTEMS="kvserve-q8act llamacpp-q4_1" LOADS=c1 ...   # kvserve-q8act: int8 activations (issue 22)
#   SYSTEMS="kvserve-mmap kvserve-f32" LOADS=c16 ...     # kvserve-mmap: --load-format mmap (issue 22)
#   SYSTEMS="kvserve-mmap-q8act kvserve-f32" LOADS=c16 ...  # both: the file's blocks alone, int8 activations
#   SYSTEMS="kvserve llamacpp-q4_1 llamacpp-q4_1-repack" LOADS=c1 ...  # llama.cpp with its repacking on too
#   MODEL=gemma-3-270m SYSTEMS="kvserve kvserve-mmap llamacpp-q4_1" ...  # llamacpp-q4_1 serves the model's shipped
#                                                                       # file: Gemma 3's is Q4_K_M
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m-instruct}  # gemma-3-270m: its Q4_K_M file, as `kvserve pull` fetches it
Q4_GGUF=${Q4_GGUF:-$(kvserve pull "$MODEL" | tail -1)}
OUT=${OUT:-docs/results/peers-$(date +%Y%m%d-%H%M)}
SYSTEMS=${SYSTEMS:-"kvserve kvserve-f32 llamacpp-q4_1 llamacpp-f32"}
LOADS=${LOADS:-"c1 c4 c16 prefix"}
PORT=${PORT:-18710}
mkdir -p "$OUT"

RANDOM_FLAGS="--dataset-name random --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5"
load_flags() {
  case "$1" in
    c1) echo "$RANDOM_FLAGS --num-prompts ${C1_PROMPTS:-16} --max-concurrency 1" ;;
    c4) echo "$RANDOM_FLAGS --num-prompts 32 --max-concurrency 4" ;;
    c16) echo "$RANDOM_FLAGS --num-prompts 64 --max-concurrency 16" ;;
    # issue 9's prefix workload: 8 groups x 16 requests on a 1,024-token system prompt
    prefix) echo "--dataset-name prefix --prefix-num-groups 8 --prefix-group-size 16 --prefix-len 1024 --suffix-len 32 --random-output-len 64 --max-concurrency 16" ;;
  esac
}

server_command() {
  # llama.cpp gets the threads kvserve gets: torch's default, one per physical core
  local threads=${THREADS:-$(python3 -c "import torch; print(torch.get_num_threads())")}
  local llama=(-t "$threads" -tb "$threads" -np 16 -c 32768 -b 512 -ub 512 --metrics --host 127.0.0.1 --port "$PORT")
  case "$1" in
    kvserve) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 ;;
    kvserve-nocache) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --no-enable-prefix-caching ;;
    # issue 22's int8-activation block kernel (opt-in: it moves near-tie greedy choices)
    kvserve-q8act) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --quantize-activations ;;
    # every step op by op: no CPU step graphs
    kvserve-eager) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --enforce-eager ;;
    kvserve-f32-eager) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --quantization none --enforce-eager ;;
    # the default form keeps the GGUF's Q4_1 / Q8_0 blocks for single-stream steps; fp32 weights throughout:
    kvserve-f32) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --quantization none ;;
    kvserve-mmap) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --load-format mmap ;;
    kvserve-mmap-q8act)
      echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --load-format mmap --quantize-activations ;;
    # with int8 KV (issue 17): at 16 streams a step reads more K/V than weights
    kvserve-mmap-kv8) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --load-format mmap --kv-cache-dtype int8 ;;
    kvserve-mmap-q8act-kv8) echo kvserve serve "$MODEL" --port "$PORT" --max-num-seqs 16 --load-format mmap \
      --quantize-activations --kv-cache-dtype int8 ;;
    # its Q4_1 weight repacking segfaults while loading on a Sapphire Rapids Xeon (AMX): repacking off
    llamacpp-q4_1) echo "$LLAMA_SERVER" -m "$Q4_GGUF" "${llama[@]}" --no-repack ;;
    # llama.cpp's own default: its quantized weights repacked for the CPU's kernels at load, where it can
    llamacpp-q4_1-repack) echo "$LLAMA_SERVER" -m "$Q4_GGUF" "${llama[@]}" ;;
    llamacpp-f32) echo "$LLAMA_SERVER" -m "$LLAMA_F32" "${llama[@]}" ;;
  esac
}

# shellcheck source=wait_healthy.sh
source "benchmarks/wait_healthy.sh"

# Wall-clock figures mean nothing on a machine something else keeps busy: each pass records the load average
# before and after it, and says so where the load before it was above the machine's cores.
note_load() {
  local load; load=$(cut -d' ' -f1-3 /proc/loadavg)
  echo "load average $1: $load (cores: $(nproc))" >> "$2"
  if [ "$1" = before ] && awk -v l="${load%% *}" -v n="$(nproc)" 'BEGIN {exit !(l > n)}'; then
    echo "warning: load average $load is above the $(nproc) cores: this pass's figures are unreliable" >&2
  fi
}

for system in $SYSTEMS; do
  backend=llamacpp; [ "${system#kvserve}" = "$system" ] || backend=kvserve
  for load in $LOADS; do  # a fresh server per pass: no pass finds another's prompts cached
    # shellcheck disable=SC2046
    start_server "$OUT/$system-$load.server.log" $(server_command "$system")
    wait_healthy
    note_load before "$OUT/$system-$load.load"
    # shellcheck disable=SC2046
    kvserve bench serve --base-url "http://127.0.0.1:$PORT" --model "$MODEL" --label "$system" --backend "$backend" \
      --warmup 2 --result-json "$OUT/$system-$load.json" $(load_flags "$load") 2>/dev/null | tee "$OUT/$system-$load.txt"
    note_load after "$OUT/$system-$load.load"
    stop_server
  done
done
for load in $LOADS; do  # in $SYSTEMS order: the first system run is the baseline; older files in $OUT stay out
  results=()
  for system in $SYSTEMS; do results+=("$OUT/$system-$load.json"); done
  kvserve bench compare "${results[@]}" | tee "$OUT/compare-$load.txt"
done
