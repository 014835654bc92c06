"""How long one rank's checkpoint takes to write, and what its progress reports look like: a state of --gib GiB of
m(ξ) samples (4 MiB each) saved with `save_rank`, its file put on the disk every --sync-mib MiB (0: once, at the end).

    python benchmarks/checkpoint_write.py --gib 2 --sync-mib 256 --out /var/tmp/ckpt
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from aqpipe.runtime.checkpoints import parts as checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--sync-mib", type=int, default=256, help="0: one fsync at the end")
    parser.add_argument("--out", type=Path, default=Path("/var/tmp/aqpipe-ckpt-bench"))
    args = parser.parse_args()
    checkpoint.SYNC_EVERY_BYTES = (args.sync_mib << 20) if args.sync_mib else 1 << 62
    samples = int(args.gib * 256)
    store = {i: torch.full((1 << 20,), float(i)) for i in range(samples)}  # 4 MiB each
    reports: list[tuple[float, int]] = []
    shutil.rmtree(args.out, ignore_errors=True)
    start = time.perf_counter()
    path = checkpoint.save_rank(args.out, 1, 0, {"store": store}, {"bench": True},
                                lambda done, total: reports.append((time.perf_counter() - start, done)))
    seconds = time.perf_counter() - start
    gaps = [b[0] - a[0] for a, b in zip([(0.0, 0)] + reports, reports)]
    print(f"{path.stat().st_size / 2**30:.2f} GiB in {seconds:.2f} s ({path.stat().st_size / 2**20 / seconds:.0f} MiB/s), "
          f"on the disk {f'every {args.sync_mib} MiB' if args.sync_mib else 'at the end'}: {len(reports)} progress reports, "
          f"longest gap {max(gaps):.2f} s")
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
