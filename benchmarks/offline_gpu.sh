#!/usr/bin/env bash
# What a GPU machine without network access needs beside the checkout to run benchmarks/gpu_check.sh, where its
# image lacks lmdb, zstandard or iproute2 (`tc`, for the throttled links). This script makes them on a machine that
# has a network, into git-ignored folders to copy along with the checkout, and installs them on the GPU machine:
#
#     bash benchmarks/offline_gpu.sh                        # with a network: .whl, .deb
#     # copy the checkout with .whl .deb to the GPU machine, then there:
#     source benchmarks/offline_gpu.sh --setup && bash benchmarks/gpu_check.sh OUT
#
# .whl  lmdb and zstandard wheels for the GPU machine's CPython (GPU_PYTHON, default 3.12)
# .deb  Debian's iproute2 (ip, tc: the throttled links) and the libraries it links to
#
# --setup (sourced, on the GPU machine) installs what its image lacks under /tmp/aqpipe-offline:
# - the wheels with pip --target, on PYTHONPATH;
# - the .debs unpacked with dpkg-deb;
# - ip and tc wrapped so that they find only the libraries the image lacks (its own glibc and the rest stay its own).
# AQPIPE_OFFLINE_FORCE=1 installs all of it even where the image has it (to try the wrappers on a machine that has
# iproute2).

offline_make() {
  local root py
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  py=${GPU_PYTHON:-3.12}
  cd "$root" || return 1
  rm -rf .whl .deb && mkdir -p .whl .deb || return 1
  python -m pip download --quiet --only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64 \
    --dest .whl lmdb zstandard || return 1
  # iproute2 and its libraries, without the ones every image has (glibc, libselinux, libbsd); a wrapper finds
  # those the image lacks
  (cd .deb && apt-get download iproute2 libbpf1 libelf1 libmnl0 libxtables12 libcap2 libdb5.3 libtirpc3) \
    || return 1
  echo "made: $(ls .whl | tr '\n' ' ')| $(ls .deb | wc -l) .debs"
}

offline_setup() {
  local at=/tmp/aqpipe-offline force=${AQPIPE_OFFLINE_FORCE:-0} known lib so tool path
  mkdir -p "$at/bin" "$at/lib" "$at/root"
  if [ "$force" = 1 ] || ! python -c "import lmdb, zstandard" 2>/dev/null; then
    python -m pip install --quiet --no-index --no-deps --target "$at/py" .whl/*.whl || return 1
    export PYTHONPATH="$at/py:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  if [ "$force" = 1 ] || ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
    for deb in .deb/*.deb; do dpkg-deb -x "$deb" "$at/root" || return 1; done
    # the libraries the image has (none known without ldconfig: then every one made here is used)
    known=$({ command -v ldconfig || echo /sbin/ldconfig; } | { read -r tool; "$tool" -p 2>/dev/null; })
    for so in "$at"/root/{lib,usr/lib}/x86_64-linux-gnu/*.so*; do
      [ -e "$so" ] || continue
      lib=$(basename "$so")
      # (a library the image has stays the image's: only the missing ones are put where the wrapper looks)
      if [ "$force" = 1 ] || ! grep -q "[[:space:]]$lib " <<<"$known"; then ln -sf "$so" "$at/lib/$lib"; fi
    done
    for tool in ip tc; do
      path=$(ls "$at"/root/{sbin,usr/sbin,bin,usr/bin}/"$tool" 2>/dev/null | head -1)
      [ -n "$path" ] || { echo "no $tool in the iproute2 made here" >&2; return 1; }
      printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' "$at/lib" "$path" \
        > "$at/bin/$tool"
      chmod +x "$at/bin/$tool"
    done
    export PATH="$at/bin:$PATH"
  fi
  echo "offline set-up: python $(python -c 'import lmdb, zstandard; print("lmdb", lmdb.__version__, "zstandard", zstandard.__version__)'); $(tc -V 2>&1 | head -1)"
}

if [ "${1:-}" = "--setup" ]; then
  offline_setup  # (sourced: the caller's shell options are left as they are)
else
  set -uo pipefail
  offline_make
fi
