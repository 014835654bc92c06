#!/usr/bin/env bash
# Every GPU measurement in one command within a time limit: the codec's A/B against a baseline tree, every GPU
# check, then the fused kernels' tile sweep in the time left, its results under OUT. Prepared on a machine with a
# network (for a GPU machine without one, with benchmarks/offline_gpu.sh):
#
#     bash benchmarks/offline_gpu.sh                                    # .whl .deb: what the image may lack
#     mkdir -p .ab && git archive REV --prefix=base/ | tar -x -C .ab     # the A/B's baseline tree (optional)
#     # on the GPU machine, with the checkout and those folders:
#     AQPIPE_COMMIT=$(git rev-parse --short HEAD) OUT=results bash benchmarks/gpu_all.sh
#
# Steps, in this order, each given what is left of AQPIPE_GPU_ALL_SECONDS (the whole command's limit; unset: none):
#   ab        benchmarks/codec_ab.py against .ab/base, where it exists (AQPIPE_AB_ROUNDS rounds, default 3)
#   gpu-check benchmarks/gpu_check.sh (AQPIPE_GPU_CHECK_PARTS picks its parts)
#   tiles     benchmarks/fused_tiles.py, with AQPIPE_GPU_ALL_TILES=1 and at least 240 s left (its sweep took 200 s on
#             an H200, and writes its results only at its end)
# The files: gpu_all.log (the set-up and the GPU), ab.log and ab.json, gpu-check.log (which ends with gpu_check.sh's
# results.md), gpu_check.tar.gz (its whole folder: logs, JSON, rank logs), tiles.log, tiles.json and tiles.md.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/gpu_all}
mkdir -p "$out"
out=$(cd "$out" && pwd)
deadline=$(($(date +%s) + ${AQPIPE_GPU_ALL_SECONDS:-86400}))  # (unset: a day, no limit in practice)
left() { echo $((deadline - $(date +%s))); }

log="$out/gpu_all.log"
# shellcheck source=benchmarks/offline_gpu.sh
source benchmarks/offline_gpu.sh --setup >"$log" 2>&1 || { cat "$log"; exit 1; }
# (as gpu_check.sh does: bytecode and Triton's kernels kept under /tmp, for every process of every step)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/aqpipe-pycache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/aqpipe-triton-cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$log" 2>&1
# shellcheck source=benchmarks/gpu_state.sh
source benchmarks/gpu_state.sh  # (gpu_state LABEL: the GPU's clocks, a line)

step() {  # step NAME SECONDS COMMAND...: COMMAND under its limit, its output in NAME.log, its status and time printed
  local name=$1 limit=$(($2 > 1 ? $2 : 1)) start rc  # (timeout 0 would mean no limit)
  shift 2
  start=$(date +%s)
  gpu_state "before $name" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  gpu_state "after $name" >>"$log"
  echo "== $name: exit $rc$([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo ' (time limit)'), $(($(date +%s) - start)) s" \
    | tee -a "$log"
}

if [ -d .ab/base ]; then
  step ab $(($(left) < 200 ? $(left) : 200)) python benchmarks/codec_ab.py --baseline .ab/base --device cuda \
    --rounds "${AQPIPE_AB_ROUNDS:-3}" --out "$out/ab.json"
  grep -E "GB/s|graph's launch" "$out/ab.log"
else
  echo "== ab: skipped, no .ab/base (the baseline tree: see above)" | tee -a "$log"
fi
checks=/tmp/aqpipe-gpu-check
rm -rf "$checks"
step gpu-check $(($(left) - 10)) bash benchmarks/gpu_check.sh "$checks"
# (stopped at its limit inside its MPS part, gpu_check.sh leaves the MPS daemon running: the tile sweep would run
# under it)
command -v nvidia-cuda-mps-control >/dev/null && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
tar -czf "$out/gpu_check.tar.gz" -C "$(dirname "$checks")" "$(basename "$checks")"
grep -s -E "^\| |^- (PASSED|FAILED|ERROR)" "$checks/results.md"
if [ "${AQPIPE_GPU_ALL_TILES:-0}" = 1 ] && [ "$(left)" -ge 240 ]; then
  step tiles $(($(left) - 5)) python benchmarks/fused_tiles.py --out "$out/tiles"
fi
echo "== done${AQPIPE_GPU_ALL_SECONDS:+, $(left) s of the time limit left}" | tee -a "$log"
