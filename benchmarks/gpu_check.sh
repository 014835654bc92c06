#!/usr/bin/env bash
# Every GPU check in one command, on a machine with one CUDA GPU, as root (tc for the throttled links):
#
#     bash benchmarks/gpu_check.sh [OUT]          # OUT defaults to benchmarks/results/gpu_check
#
# Parts, each under its own time limit, each writing <part>.log in OUT; OUT/results.md gathers the device, every
# part's exit status and time, and the numbers each part ends with:
#   sync-audit   gpt2-tiny fp32 (m(ξ) in host RAM, then on disk: --store lmdb) and llama-tiny bf16 (m(ξ) on the
#                GPU), 4 ranks on the GPU,
#                aqsgd:3 / directq:6, every step from the third under torch.cuda.set_sync_debug_mode
#                (AQPIPE_CUDA_SYNC_AUDIT=1): synchronizing calls per step and where
#   gpu-tests    python -m pytest -m gpu tests/test_gpu.py tests/test_gpu_codecs.py tests/test_gpu_cuda_graphs.py
#                tests/test_tied_deltas.py
#   codec-speed  benchmarks/codec_speed.py on the GPU, at GPT2-XL's activation shape and at SmolLM2-135M's (there
#                also at a GPU run's 8 × 1024 tokens, and with the fused kernels off, then the CUDA graphs too),
#                then benchmarks/codec_profile.py: an AQ-SGD message's host calls and device time,
#                and benchmarks/fused_delta_sizes.py: AQ-SGD's delta step unfused and fused, by micro-batch size
#   throughput   benchmarks/throughput.py: 4 ranks on the one GPU behind 100 Mbit/s tc links, fp32 vs aqsgd fw3 bw6
#   throughput-mps  the same under NVIDIA MPS (started and stopped here), where nvidia-cuda-mps-control exists
# About 4 minutes on an H200 (codec speed, then the GPU tests beside the sync audit, then the two throughput runs;
# each part stops at its own limit: 8.7 minutes in all at most). AQPIPE_BENCH_DATA names the file the throughput
# parts train on (default: the repository's WikiText-2 valid.txt), AQPIPE_GPU_CHECK_ROUNDS how many rounds each throughput part runs (default 1; each round
# about a minute more per part); AQPIPE_GPU_CHECK_PARTS picks a subset; AQPIPE_COMMIT names the commit the results
# files record, where the tree is not a git checkout (exported or copied without its history). The switches of the codecs' GPU paths pass through
# to every part: AQPIPE_FUSED_AQSGD=1 bash benchmarks/gpu_check.sh measures AQ-SGD's fused delta step throughout.
set -u -o pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu_check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
data=${AQPIPE_BENCH_DATA:-$PWD/benchmarks/data/wikitext-2/valid.txt}
rounds=${AQPIPE_GPU_CHECK_ROUNDS:-1}
results="$out/results.md"
# (an earlier run's logs in a reused OUT would be reported as this run's)
rm -rf "$out"/{gpu-tests,sync-audit,codec-speed,throughput,throughput-mps}.log "$out"/audit-fp32 "$out"/audit-bf16 "$out"/audit-lmdb
parts=${AQPIPE_GPU_CHECK_PARTS:-gpu-tests sync-audit throughput codec-speed throughput-mps}  # AQPIPE_GPU_CHECK_PARTS: a subset
export PYTHONUNBUFFERED=1
# An image that cannot keep bytecode (its site-packages read-only, or PYTHONDONTWRITEBYTECODE set)
# makes every process compile transformers and torch._dynamo from source at import: 15-30 s per launcher, fork server and
# fresh rank, enough to run a 3-launch GPU test past its time limit. Bytecode goes under /tmp here instead.
bytecode_before=$(python -c "import os, sys, sysconfig; purelib = sysconfig.get_paths()['purelib']; \
print('writes bytecode:', not sys.flags.dont_write_bytecode, '; site-packages writable:', os.access(purelib, os.W_OK))" 2>&1)
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/aqpipe-pycache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/aqpipe-triton-cache}  # (compiled kernels; a home may be read-only)

# shellcheck source=benchmarks/gpu_state.sh
source benchmarks/gpu_state.sh  # (gpu_state LABEL: the GPU's clocks, a line; between the timed scripts below)

part() {  # part NAME SECONDS COMMAND...: run COMMAND with its output in NAME.log, record status and time
  local name=$1 limit=$2 start rc
  shift 2
  [[ " $parts " == *" $name "* ]] || return 0
  start=$(date +%s)
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  echo "| $name | $rc$([ "$rc" = 124 ] && echo ' (time limit)') | $(($(date +%s) - start)) s |" >>"$results"
  return 0
}

sync_audit() {  # three short runs with every rank audited; their rank logs hold the per-step counts
  local flags=(--pp 4 --seq-len 32 --max-samples 64 --micro-batch-size 4 --micro-batches 4 --epochs 3
               --device cuda --no-progress --eval-every 0 --overwrite --fw aqsgd:3 --bw directq:6) status=0
  AQPIPE_CUDA_SYNC_AUDIT=1 python -m aqpipe launch --model gpt2-tiny "${flags[@]}" --out "$out/audit-fp32" || status=1
  AQPIPE_CUDA_SYNC_AUDIT=1 python -m aqpipe launch --model llama-tiny "${flags[@]}" --precision bf16 \
    --store-device cuda --out "$out/audit-bf16" || status=1
  AQPIPE_CUDA_SYNC_AUDIT=1 python -m aqpipe launch --model gpt2-tiny "${flags[@]}" --store lmdb \
    --out "$out/audit-lmdb" || status=1
  for run in audit-fp32 audit-bf16 audit-lmdb; do  # (each run's lines, whichever failed)
    echo "## $run"
    grep -h "cuda sync audit" "$out/$run"/logs/rank-*.log
  done
  return $status
}

{
  echo "# GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit ${AQPIPE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/- GPU: /'
  python -c 'import sys, torch, transformers; print(f"- python {sys.version.split()[0]}, torch {torch.__version__}, '\
'CUDA {torch.version.cuda}, transformers {transformers.__version__}, {torch.cuda.device_count()} GPU(s)")'
  python -c 'import triton; print(f"- triton {triton.__version__} (the fused codec kernels)")' 2>&1 | tail -n 1
  echo "- CPU cores: $(nproc)"
  echo "- before this script: $bytecode_before; bytecode kept under $PYTHONPYCACHEPREFIX"
  echo
  echo "| part | exit | time |"
  echo "|---|---|---|"
} >"$results"

throughput_mps() {  # the same pipeline with NVIDIA MPS: the four ranks' kernels share the GPU instead of time-slicing
  command -v nvidia-cuda-mps-control >/dev/null || { echo "no nvidia-cuda-mps-control on this machine"; return 3; }
  nvidia-cuda-mps-control -d || return
  python benchmarks/throughput.py --device cuda --pp 4 --bandwidths 100mbit --rounds "$rounds" --epochs 4 \
    --variants "fp32,aqsgd fw3 bw6" --no-deepspeed --data "$data" --out "$out/throughput_cuda_mps"
  local rc=$?
  echo quit | nvidia-cuda-mps-control
  return $rc
}

export -f sync_audit throughput_mps gpu_state
export out data rounds
# Codec speed first, alone on the GPU (its numbers are times); then the GPU tests beside the sync audit (neither
# times anything, and the audit's launches fit in the tests' shadow); then each throughput run alone.
# (at SmolLM2's shape: also the shape of a GPU run's micro-batch, 8 × 1024 tokens, and the same coders without the
# fused kernels — AQPIPE_FUSED_KERNELS=0 — and without the CUDA graphs as well: the torch ops one by one; AQ-SGD's
# delta step unfused against fused, at 8 × 1024 among other sizes, is fused_delta_sizes.py's)
part codec-speed 120 bash -c "gpu_state 'before codec_speed.py' && echo '### at GPT2-XL shape 4,512,1600 MB/s'; \
  python benchmarks/codec_speed.py --device cuda --out '$out/codec_speed_cuda' && \
  echo '### at SmolLM2-135M shape 4,128,576 MB/s' && \
  python benchmarks/codec_speed.py --device cuda --shape 4,128,576 --out '$out/codec_speed_cuda_smollm2' && \
  echo '### at SmolLM2-135M shape 8,1024,576 (a GPU run micro-batch) MB/s' && \
  python benchmarks/codec_speed.py --device cuda --shape 8,1024,576 --only-codecs --codecs directq:3,directq:4,rtq:4 \
    --out '$out/codec_speed_cuda_smollm2_8x1024' && \
  echo '### at SmolLM2-135M shape 4,128,576, fused kernels off (AQPIPE_FUSED_KERNELS=0) MB/s' && \
  AQPIPE_FUSED_KERNELS=0 python benchmarks/codec_speed.py --device cuda --shape 4,128,576 --only-codecs \
    --codecs directq:4 --out '$out/codec_speed_cuda_smollm2_no_fused' && \
  echo '### at SmolLM2-135M shape 4,128,576, fused kernels and CUDA graphs off (AQPIPE_CUDA_GRAPHS=0) MB/s' && \
  AQPIPE_FUSED_KERNELS=0 AQPIPE_CUDA_GRAPHS=0 python benchmarks/codec_speed.py --device cuda --shape 4,128,576 \
    --codecs directq:4,rtq:4 --out '$out/codec_speed_cuda_smollm2_no_graphs' && \
  gpu_state 'before codec_profile.py' && \
  echo '### where an aqsgd:3 message goes, m(xi) in GPU memory (benchmarks/codec_profile.py)' && \
  python benchmarks/codec_profile.py --device cuda --pairs 11 --out '$out/codec_profile_cuda' && \
  gpu_state 'before fused_delta_sizes.py' && \
  echo '### AQ-SGD delta step in torch ops against fused, by micro-batch size (benchmarks/fused_delta_sizes.py)' && \
  python benchmarks/fused_delta_sizes.py --repeats 15 --out '$out/fused_delta_sizes' && \
  gpu_state 'after fused_delta_sizes.py'"
part gpu-tests 210 python -m pytest -m gpu tests/test_gpu.py tests/test_gpu_codecs.py tests/test_gpu_cuda_graphs.py \
  tests/test_tied_deltas.py \
  -n 12 -p no:cacheprovider -v --timeout 150 -rfE &
tests=$!
part sync-audit 130 bash -c sync_audit
wait "$tests"
part throughput $((60 + 60 * rounds)) python benchmarks/throughput.py --device cuda --pp 4 --bandwidths 100mbit \
  --rounds "$rounds" --epochs 4 --variants "fp32,aqsgd fw3 bw6" --no-deepspeed --data "$data" --out "$out/throughput_cuda"
part throughput-mps $((10 + 60 * rounds)) bash -c throughput_mps

{
  echo
  echo "## synchronizing calls per audited step and rank, and where (rank logs)"
  for run in audit-fp32 audit-bf16 audit-lmdb; do
    [ -d "$out/$run/logs" ] || continue
    echo "### $run: calls per step (how many rank-steps saw each count)"
    grep -h "synchronizing calls" "$out/$run"/logs/rank-*.log | awk '{print $(NF-2)}' | sort -n | uniq -c
    echo "### $run: places, summed over ranks and steps"
    grep -h "cuda sync audit:  " "$out/$run"/logs/rank-*.log | awk '{n[$5" "$6]+=$4} END {for (p in n) print n[p], p}' | sort -rn
  done
  ran() { [ -f "$out/$1.log" ] || { echo "(not run)"; return 1; }; }  # ran PART: its log exists, else says so
  echo
  echo "## GPU tests"
  if ran gpu-tests; then
    for outcome in PASSED FAILED ERROR SKIPPED; do
      echo "- $outcome: $(grep -c " $outcome " "$out/gpu-tests.log")"
    done
    grep -E " (FAILED|ERROR) tests/" "$out/gpu-tests.log" | sed 's/^.* \(FAILED\|ERROR\) /- \1 /'
    tail -n 3 "$out/gpu-tests.log"
  fi
  echo
  echo "## codec speed"
  ran codec-speed && grep -h -E "MB/s|per pair|a pair's µs|most called|µs  |M values" "$out/codec-speed.log" | head -300  # (175 lines on an H100: 140 cut the profile's)
  echo "### the GPU's state between the codec scripts"
  ran codec-speed && grep -h "^   gpu " "$out/codec-speed.log"
  echo "### the codecs' GPU path falling back (rows after it are the fallback's: marked FELL BACK)"
  ran codec-speed && { grep -h -E "from now on|graphs held: further" "$out/codec-speed.log" || echo "none"; }
  echo
  echo "## throughput (samples/s)"
  ran throughput && grep -h -E "samples/s|≥|target" "$out/throughput.log" | head -20
  echo "### with NVIDIA MPS"
  ran throughput-mps && grep -h -E "samples/s|≥|target|MPS|mps" "$out/throughput-mps.log" | head -20
} >>"$results" 2>&1
cat "$results"
