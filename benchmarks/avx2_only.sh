#!/usr/bin/env bash
# Run a command as on an AVX2-only CPU (AVX2 + FMA, no AVX-512, AMX or AVX-VNNI), on an AVX-512 machine:
#
#     benchmarks/avx2_only.sh COMMAND [ARGS...]
#
# The command and every process it starts see CPUID without those features (avx2_only.c, an LD_PRELOAD library
# built here once), so peers that pick their kernels by CPUID, as OpenVINO's CPU plugin does, run their AVX2
# paths; glibc's string functions, torch, MKL, oneDNN and kvserve's kernels are also held by their own switches.
# Needs CPUID faulting (the "cpuid_fault" flag in /proc/cpuinfo); without it the command is not run (exit 97).
if [[ ${1:-} == -h || ${1:-} == --help ]]; then  # -h / --help: the header above, nothing run
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0
fi
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvserve
lib=$cache/avx2_only-$(sha256sum "$here/avx2_only.c" | cut -c1-16).so
if [[ ! -f $lib ]]; then
  mkdir -p "$cache"
  tmp=$(mktemp "$lib.XXXXXX")  # a build of its own: two runs at once each rename a whole library into place
  gcc -O2 -shared -fPIC -o "$tmp" "$here/avx2_only.c" -ldl || { rm -f "$tmp"; exit 1; }
  chmod 755 "$tmp" && mv "$tmp" "$lib"
fi
exec env LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" \
  GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD \
  KVSERVE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 "$@"
