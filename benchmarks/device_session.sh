#!/usr/bin/env bash
# A lent GPU machine's whole session of measurements in one device call (issue 30): the codec's A/B against a
# baseline tree, every GPU check, then the fused kernels' tile sweep in the time left. Made here first:
#
#     bash benchmarks/device_carry.sh                                   # .whl .deb .data: what the image lacks
#     mkdir -p .ab && git archive REV --prefix=base/ | tar -x -C .ab     # the A/B's baseline tree (optional)
#     # the device tool: run(carry=[".whl", ".deb", ".data", ".ab"], timeout_s=600,
#     #                      command="AQPIPE_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/device_session.sh")
#
# Steps, in this order, each given what is left of AQPIPE_SESSION_SECONDS (default 560, under the tool's 600):
#   ab        benchmarks/codec_ab.py against .ab/base, where it exists (AQPIPE_AB_ROUNDS rounds, default 3)
#   gpu-check benchmarks/gpu_check.sh (AQPIPE_GPU_CHECK_PARTS picks its parts)
#   tiles     benchmarks/fused_tiles.py, where at least 120 s are left
# The device tool brings back only so many files from OUT: gpu_check.sh's folder (tens of logs, JSON and rank logs)
# comes back as one gpu_check.tar.gz beside its results.md; each step's log and JSON sit at OUT's top. (The first
# such session lost every gpu_check file but what it printed: they were too many.)
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/device_session}
mkdir -p "$out"
out=$(cd "$out" && pwd)
deadline=$(($(date +%s) + ${AQPIPE_SESSION_SECONDS:-560}))
left() { echo $((deadline - $(date +%s))); }

# shellcheck source=benchmarks/device_carry.sh
source benchmarks/device_carry.sh --setup >"$out/setup.log" 2>&1 || { cat "$out/setup.log"; exit 1; }
# (as gpu_check.sh does: bytecode and Triton's kernels kept under /tmp, for every process of every step)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/aqpipe-pycache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/aqpipe-triton-cache} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: COMMAND under its limit, its output in NAME.log, its status and time printed
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc$([ "$rc" = 124 ] && echo ' (time limit)'), $(($(date +%s) - start)) s"
}

if [ -d .ab/base ]; then
  step ab $(($(left) < 200 ? $(left) : 200)) python benchmarks/codec_ab.py --baseline .ab/base --device cuda \
    --rounds "${AQPIPE_AB_ROUNDS:-3}" --out "$out/ab.json"
  grep -E "GB/s|graph's launch" "$out/ab.log"
fi
checks=/tmp/aqpipe-gpu-check
rm -rf "$checks"
step gpu-check $(($(left) - 10)) bash benchmarks/gpu_check.sh "$checks"
tar -czf "$out/gpu_check.tar.gz" -C "$(dirname "$checks")" "$(basename "$checks")"
cp "$checks/results.md" "$out/gpu_check.md" 2>/dev/null && grep -E "^\| |^- (PASSED|FAILED|ERROR)" "$out/gpu_check.md"
if [ "$(left)" -ge 120 ]; then
  step tiles $(($(left) - 5)) python benchmarks/fused_tiles.py --out "$out/tiles"
fi
echo "== done, $(left) s of the session's time left"
