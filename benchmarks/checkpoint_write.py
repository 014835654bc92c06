"""How long one rank's checkpoint takes to write and to read back, what its progress reports look like, and the
process's peak memory on each side: a state of --gib GiB of m(ξ) samples (4 MiB each) saved with `save_rank`, its
file put on the disk every --sync-mib MiB (0: once, at the end), then loaded with `load_rank` (the state held in
memory dropped first).

    python benchmarks/checkpoint_write.py --gib 1 --sync-mib 256 --out /var/tmp/ckpt --results benchmarks/results/checkpoint-write

Peak memory is the process's resident high-water mark, reset before each side (Linux's clear_refs); with --results
writes <results>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from aqpipe.pipeline.execution.worker import process_peak_rss_bytes
from aqpipe.runtime.checkpoints import parts as checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.provenance import machine  # noqa: E402

GIB = 1 << 30


def resident_bytes() -> int:
    """This process's resident memory now, in bytes (its high-water mark: `process_peak_rss_bytes`)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:"))
    return int(line.split()[1]) << 10


def reset_peak() -> None:
    """Start the resident high-water mark again from the memory held now."""
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--sync-mib", type=int, default=256, help="0: one fsync at the end")
    parser.add_argument("--out", type=Path, default=Path("/var/tmp/aqpipe-ckpt-bench"), help="the checkpoint's directory")
    parser.add_argument("--results", type=Path, help="write the numbers to <results>.json")
    args = parser.parse_args()
    checkpoint.SYNC_EVERY_BYTES = (args.sync_mib << 20) if args.sync_mib else 1 << 62
    samples = int(args.gib * 256)
    store = {i: torch.full((1 << 20,), float(i)) for i in range(samples)}  # 4 MiB each
    reports: list[tuple[float, int]] = []
    shutil.rmtree(args.out, ignore_errors=True)
    held = resident_bytes()
    reset_peak()
    start = time.perf_counter()
    path = checkpoint.save_rank(args.out, 1, 0, {"store": store}, {"bench": True},
                                lambda done, total: reports.append((time.perf_counter() - start, done)))
    save_seconds = time.perf_counter() - start
    save_peak = process_peak_rss_bytes()
    size = path.stat().st_size
    gaps = [b[0] - a[0] for a, b in zip([(0.0, 0)] + reports, reports)]
    print(f"{size / GIB:.2f} GiB in {save_seconds:.2f} s ({size / 2**20 / save_seconds:.0f} MiB/s), on the disk "
          f"{f'every {args.sync_mib} MiB' if args.sync_mib else 'at the end'}: {len(reports)} progress reports, longest "
          f"gap {max(gaps):.2f} s; peak {save_peak / GIB:.2f} GiB resident ({held / GIB:.2f} GiB held before)")
    del store
    gc.collect()
    before_load = resident_bytes()
    reset_peak()
    start = time.perf_counter()
    loaded = checkpoint.load_rank(args.out, 1, 0, {"bench": True})
    load_seconds = time.perf_counter() - start
    load_peak = process_peak_rss_bytes()
    assert len(loaded["store"]) == samples
    print(f"loaded in {load_seconds:.2f} s; peak {load_peak / GIB:.2f} GiB resident ({before_load / GIB:.2f} GiB before)")
    shutil.rmtree(args.out, ignore_errors=True)
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.with_suffix(".json").write_text(json.dumps({
            "machine": machine(), "gib": args.gib, "sync_mib": args.sync_mib, "file_bytes": size,
            "save_seconds": save_seconds, "save_peak_resident_bytes": save_peak, "held_before_save_bytes": held,
            "progress_reports": len(reports), "longest_report_gap_seconds": max(gaps),
            "load_seconds": load_seconds, "load_peak_resident_bytes": load_peak,
            "resident_before_load_bytes": before_load}, indent=2))


if __name__ == "__main__":
    main()
