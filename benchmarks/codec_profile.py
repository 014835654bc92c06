"""Where an AQ-SGD message's time goes: a sender and a receiver of one link, fed the same batch message after
message (its m(ξ) kept in memory on the device, or in host RAM), timed pair by pair, then profiled with
torch.profiler — the device's busy time per pair beside the wall time, the kernels and copies that took it, and the
host's calls per pair (copies, kernel launches, graph launches): what the host does per message, apart from what
the device does.

    python benchmarks/codec_profile.py --device cuda --out benchmarks/results/codec_profile_cuda
    python benchmarks/codec_profile.py --shapes 4,16,64 --pairs 5      # on the host: the per-message Python alone
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from aqpipe.compress.link.codecs import QuantOptions, build_codec
from aqpipe.storage import MemoryStore, StoreView

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.codec_speed import time_pair  # noqa: E402

HOST_CALLS = ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cuLaunchKernel",
              "cudaStreamSynchronize", "cudaEventSynchronize")


def link(spec: str, device: torch.device, store_device: torch.device) -> tuple:
    """A sender and a receiver of `spec` whose m(ξ) (fp16) lives on `store_device`."""
    ends = []
    for side in ("send", "recv"):
        view = StoreView(MemoryStore(torch.float16, store_device), 0, side)
        ends.append(build_codec(spec, "fw", view, QuantOptions(), device=device))
    return tuple(ends)


def profile_shape(spec: str, shape: tuple[int, ...], device: torch.device, store_device: torch.device,
                  pairs: int) -> dict:
    """Wall time of encode and decode (medians of `pairs` pairs after five), the device's busy time per pair, the
    top kernels and copies by device time, and the host's calls per pair."""
    sender, receiver = link(spec, device, store_device)
    x = torch.randn(shape, device=device)
    ids = torch.arange(shape[0])

    def pair() -> tuple[float, float]:
        return time_pair(sender, receiver, x, ids, device)

    for _ in range(5):  # the first seeds m(ξ); then the delta path warms up and (on a GPU) captures its graphs
        pair()
    times = [pair() for _ in range(pairs)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            pair()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / 5 if device.type == "cuda" else None
    top = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[:12]
    calls = {e.key: e.count / 5 for e in events if e.key in HOST_CALLS}
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / 5
    frequent = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.count)[:10]
    encode_s = statistics.median(t for t, _ in times)
    decode_s = statistics.median(t for _, t in times)
    mb = x.numel() * 4 / 1e6
    return {"shape": list(shape), "encode_us": encode_s * 1e6, "decode_us": decode_s * 1e6,
            "round_trip_MBps": mb / (encode_s + decode_s), "device_busy_us_per_pair": device_us,
            "aten_ops_per_pair": ops, "host_calls_per_pair": calls,
            "most_called_ops_per_pair": {e.key: e.count / 5 for e in frequent},
            "top_device_time_us_per_pair": {e.key[:60]: e.self_device_time_total / 5 for e in top}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", default="aqsgd:3")
    parser.add_argument("--shapes", nargs="+", default=["8,1024,576", "4,128,576"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store-device", default=None, help="where m(ξ) lives (default: the device)")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--out", default="benchmarks/results/codec_profile")
    args = parser.parse_args()
    device = torch.device(args.device)
    store_device = torch.device(args.store_device or args.device)
    rows = []
    for text in args.shapes:
        shape = tuple(int(d) for d in text.split(","))
        row = profile_shape(args.codec, shape, device, store_device, args.pairs)
        rows.append(row)
        busy = row["device_busy_us_per_pair"]
        print(f"{args.codec} {shape} m(ξ) on {store_device}: encode {row['encode_us']:.0f} µs, decode "
              f"{row['decode_us']:.0f} µs ({row['round_trip_MBps']:.0f} MB/s both)"
              + ("" if busy is None else f"; device busy {busy:.0f} µs a pair"), flush=True)
        print(f"  per pair: {row['aten_ops_per_pair']:.0f} torch ops; host calls "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["host_calls_per_pair"].items())), flush=True)
        print("  most called: " + ", ".join(f"{k[6:]} {v:.0f}" for k, v in row["most_called_ops_per_pair"].items()),
              flush=True)
        for name, us in row["top_device_time_us_per_pair"].items():
            print(f"  {us:8.1f} µs  {name}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"codec": args.codec, "device": str(device),
                                                    "store_device": str(store_device), "torch": torch.__version__,
                                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
