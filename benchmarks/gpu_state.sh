#!/usr/bin/env bash
# gpu_state LABEL: one line with the GPU's clocks, power state, temperature, power draw and what holds its clocks
# back (where the driver can say), for the logs of benchmarks/gpu_check.sh and benchmarks/gpu_all.sh, which
# source this file. Printed between timed scripts: one tree's AQ-SGD pair has read 23 to 60 GB/s in different
# scripts of one command, unexplained, and a GPU that had idled, or was held back, would be one explanation.
gpu_state() {
  local fields=clocks.sm,clocks.max.sm,clocks.mem,pstate,temperature.gpu,power.draw state
  # (a field the driver does not know fails the query with its message on stdout: each answer is taken whole, the
  # reasons' current name first, then their older one, then none)
  state=$(nvidia-smi --query-gpu="$fields,clocks_event_reasons.active" --format=csv,noheader 2>&1) \
    || state=$(nvidia-smi --query-gpu="$fields,clocks_throttle_reasons.active" --format=csv,noheader 2>&1) \
    || state=$(nvidia-smi --query-gpu="$fields" --format=csv,noheader 2>&1)
  printf '   gpu %s: %s\n' "$1" "$(echo "$state" | grep -v '^\s*$' | paste -sd ' ' -)"
}
