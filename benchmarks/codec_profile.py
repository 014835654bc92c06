"""Where an AQ-SGD message's time goes: a sender and a receiver of one link, fed the same batch message after message
(its m(ξ) kept in memory on the device, or in host RAM), timed pair by pair, then profiled with torch.profiler — the
device's busy time per pair beside the wall time, the kernels and copies that took it, and the host's calls per pair
(copies, kernel launches, graph launches): what the host does per message, apart from what the device does — and, per
end, how long its host took to reach its graph's launch and how long it waited for the device (the round trip's
critical path: the host's time before each launch adds to the device's). It also counts the torch ops a pair runs
outside the codec's graphed calls, and those calls: on a GPU each such op is a call of the host's own and each
graphed call one graph launch, so the count, taken on the host, says what a GPU's host will do per message.

    python benchmarks/codec_profile.py --device cuda --out benchmarks/results/codec_profile_cuda
    python benchmarks/codec_profile.py --shapes 4,16,64 --pairs 5      # on the host: the per-message Python alone
    python benchmarks/codec_profile.py --shapes 8,4,64 --store slab    # ... with m(ξ) kept as a GPU run keeps it
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

from aqpipe.compress.gpu import cuda_graphs
from aqpipe.compress.gpu.graph_memory import held_bytes as graph_bytes
from aqpipe.compress.link import aqsgd, aqsgd_fused, sample_coders
from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.storage import MemoryStore, SlabStore, StoreView, memory_store

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.codec_path import codec_path, fallback_note  # noqa: E402
from benchmarks.codec_speed import WARM_SECONDS, time_pair, warm  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

HOST_CALLS = ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cuLaunchKernel",
              "cudaStreamSynchronize", "cudaEventSynchronize")
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")  # the host waiting for the device
ENDS = ("encode", "decode", "settle")  # a link's calls a pair makes, each marked in the profile


STORES = {"auto": memory_store,  # what a run keeps: slabs on a GPU, a tensor per sample in host RAM
          "slab": SlabStore, "samples": MemoryStore}


def link(spec: str, device: torch.device, store_device: torch.device, store: str = "auto") -> tuple:
    """A sender and a receiver of `spec` whose m(ξ) (fp16) lives on `store_device`, kept by `STORES[store]`."""
    ends = []
    for side in ("send", "recv"):
        view = StoreView(STORES[store](torch.float16, store_device), 0, side)
        ends.append(build_codec(spec, "fw", view, QuantOptions(), device=device))
    return tuple(ends)


class HostOps(TorchDispatchMode):
    """Counts the torch ops of what runs under it, apart: those outside the codecs' graphed calls (a GPU makes each
    one a call of its own) and the graphed calls (each, on a GPU, one graph launch with its input copies)."""

    def __init__(self) -> None:
        super().__init__()
        self.outside = self.inside = self.graphed = self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._depth:
            self.inside += 1
        else:
            self.outside += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, graphed):
        """`graphed`, counting its calls and the ops inside them apart."""
        def counted(*args, **kwargs):
            self.graphed += self._depth == 0
            self._depth += 1
            try:
                return graphed(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted


def host_ops(pair, pairs: int = 5) -> dict:
    """Torch ops per pair outside the graphed calls and inside them, and graphed calls per pair."""
    counter = HostOps()
    real = {module: module.graphed for module in (aqsgd, aqsgd_fused, sample_coders)}
    try:
        for module, graphed in real.items():
            module.graphed = counter.wrap(graphed)
        with counter:
            for _ in range(pairs):
                pair()
    finally:
        for module, graphed in real.items():
            module.graphed = graphed
    return {"ops_outside_graphs": counter.outside / pairs, "ops_inside_graphs": counter.inside / pairs,
            "graphed_calls": counter.graphed / pairs}


def marked(codec, names: tuple[str, ...] = ENDS) -> None:
    """Mark each call of `codec`'s methods `names` in a profile (as `aqsgd <name>`), until `unmarked`."""
    for name in names:
        method = getattr(codec, name)

        def call(*args, _method=method, _label=f"aqsgd {name}", **kwargs):
            with record_function(_label):
                return _method(*args, **kwargs)

        setattr(codec, name, call)


def unmarked(codec, names: tuple[str, ...] = ENDS) -> None:
    """Undo `marked`."""
    for name in names:
        codec.__dict__.pop(name, None)


def host_timeline(events, names: tuple[str, ...] = ENDS) -> dict:
    """Per marked call (`marked`; medians over the profiled pairs): µs from its start to its first graph launch
    (None where it launched none), µs it waited for the device in synchronizing calls, and µs it took. The host's
    events alone (a mark shows on the device's timeline too, under its name); every one within a mark's time is
    counted as its own, the benchmark making its calls from one thread."""
    host = [e for e in events if e.device_type == DeviceType.CPU]
    timeline = {}
    for name in names:
        rows = []
        for mark in (e for e in host if e.name == f"aqsgd {name}"):
            start, end = mark.time_range.start, mark.time_range.end
            inside = [e for e in host if start <= e.time_range.start and e.time_range.end <= end]
            launches = [e.time_range.start - start for e in inside if e.name == "cudaGraphLaunch"]
            waits = sum(e.time_range.elapsed_us() for e in inside if e.name in WAITS)
            rows.append((min(launches) if launches else None, waits, end - start))
        if rows:
            launched = [r[0] for r in rows if r[0] is not None]
            timeline[name] = {"to_graph_launch_us": statistics.median(launched) if launched else None,
                              "waiting_us": statistics.median(r[1] for r in rows),
                              "took_us": statistics.median(r[2] for r in rows)}
    return timeline


def profile_shape(spec: str, shape: tuple[int, ...], device: torch.device, store_device: torch.device,
                  pairs: int, store: str = "auto") -> dict:
    """Wall time of encode and decode (medians of `pairs` pairs after fifteen and `2 × WARM_SECONDS` of pairs; the
    median pair of the ten after the first five apart, as `cold_pair_us`), the device's busy time per pair, the
    top kernels and copies by device time, and the host's calls per pair."""
    cuda_graphs.clear()  # (the graphs counted below are this shape's alone)
    sender, receiver = link(spec, device, store_device, store)
    x = torch.randn(shape, device=device)
    ids = torch.arange(shape[0])

    def pair() -> tuple[float, float]:
        return time_pair(sender, receiver, x, ids, device)

    for _ in range(5):  # the first seeds m(ξ); then the delta path warms up and (on a GPU) captures its graphs
        pair()
    cold = [pair() for _ in range(10)]  # (what the timed pairs were before `warm`: see codec_speed.WARM_SECONDS)
    warm(pair, 2 * WARM_SECONDS)
    times = [pair() for _ in range(pairs)]
    counted = host_ops(pair)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for end in (sender, receiver):
        marked(end)
    try:
        with profile(activities=activities) as prof:
            for _ in range(5):
                pair()
    finally:
        for end in (sender, receiver):
            unmarked(end)
    timeline = host_timeline(prof.events())
    events = prof.key_averages()
    # the kernels and copies themselves: an op's row repeats its kernels' device time (summing every row counted
    # the device's busy time about 1.6 times over on an H200: 562 µs a pair where the kernels took 356), and so does
    # a mark's (`marked`: the device's timeline shows each as a user annotation spanning its call's work; counted, they
    # added about the pair's own time on an H200: 472 µs a pair, where the pair took 315)
    on_device = [e for e in events
                 if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    device_us = sum(e.self_device_time_total for e in on_device) / 5 if device.type == "cuda" else None
    top = sorted((e for e in on_device if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)[:12]
    calls = {e.key: e.count / 5 for e in events if e.key in HOST_CALLS}
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / 5
    frequent = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.count)[:10]
    encode_s = statistics.median(t for t, _ in times)
    decode_s = statistics.median(t for _, t in times)
    mb = x.numel() * 4 / 1e6
    pair_us = sorted((t + u) * 1e6 for t, u in times)
    return {"shape": list(shape), "encode_us": encode_s * 1e6, "decode_us": decode_s * 1e6,
            # (the spread of the timed pairs: the same tree's pair has read 40 and 60 GB/s on one H200 in two runs)
            "pair_us_fastest_slowest": [pair_us[0], pair_us[-1]],
            "cold_pair_us": statistics.median((t + u) * 1e6 for t, u in cold),
            "warm_pair_us": statistics.median(pair_us),  # (the same statistic as `cold_pair_us`, after the warm-up)
            # every pair in the order it ran, the ten early ones then the timed ones (a trend, or a few slow outliers?)
            "early_pairs_us": [round((t + u) * 1e6, 1) for t, u in cold],
            "timed_pairs_us": [round((t + u) * 1e6, 1) for t, u in times],
            "round_trip_MBps": mb / (encode_s + decode_s), "device_busy_us_per_pair": device_us,
            "aten_ops_per_pair": ops, "host_calls_per_pair": calls, **{f"{k}_per_pair": v for k, v in counted.items()},
            "host_timeline": timeline,
            "most_called_ops_per_pair": {e.key: e.count / 5 for e in frequent},
            "top_device_time_us_per_pair": {e.key[:60]: e.self_device_time_total / 5 for e in top},
            "graph_memory_MB": graph_memory(sender, receiver, shape) if device.type == "cuda" else {},
            "codec_path": codec_path()}  # (after the timed pairs: had the graphs or the fused kernels fallen back?)


def graph_memory(sender, receiver, shape: tuple[int, ...]) -> dict:
    """Per kind of graph captured: the MB its graphs hold on the GPU (pools and input copies, as the allocator
    reports them) beside what the capacity plan counts for it (`graph_calls`, measured on the meta device)."""
    planned = {call.name: graph_bytes(call) for end, sending in ((sender, True), (receiver, False))
               for call in end.graph_calls(shape, sending)}
    return {str(key[1]): {"held": held / 1e6, "planned": planned.get(key[1], 0) / 1e6}
            for key, held in cuda_graphs.device_bytes().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", default="aqsgd:3")
    parser.add_argument("--shapes", nargs="+", default=["8,1024,576", "4,128,576"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store-device", default=None, help="where m(ξ) lives (default: the device)")
    parser.add_argument("--store", choices=sorted(STORES), default="auto",
                        help="how m(ξ) is kept: as a run keeps it (auto), as slabs, or a tensor per sample")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--out", default="benchmarks/results/codec_profile")
    args = parser.parse_args()
    device = torch.device(args.device)
    store_device = torch.device(args.store_device or args.device)
    rows = []
    for text in args.shapes:
        shape = tuple(int(d) for d in text.split(","))
        row = profile_shape(args.codec, shape, device, store_device, args.pairs, args.store)
        rows.append(row)
        busy = row["device_busy_us_per_pair"]
        print(f"{args.codec} {shape} m(ξ) on {store_device}: encode {row['encode_us']:.0f} µs, decode "
              f"{row['decode_us']:.0f} µs ({row['round_trip_MBps']:.0f} MB/s both)"
              + ("" if busy is None else f"; device busy {busy:.0f} µs a pair") + fallback_note(row["codec_path"]),
              flush=True)
        fastest, slowest = row["pair_us_fastest_slowest"]
        print(f"  a pair's µs over {args.pairs} pairs: fastest {fastest:.0f}, median {row['warm_pair_us']:.0f}, slowest "
              f"{slowest:.0f}; the 10 pairs after the first 5, before {2 * WARM_SECONDS:g} s more of pairs: median "
              f"{row['cold_pair_us']:.0f}", flush=True)
        print(f"  per pair: {row['ops_outside_graphs_per_pair']:.0f} torch ops outside graphed calls (each a call of "
              f"its own on a GPU), {row['graphed_calls_per_pair']:.0f} graphed calls (each one launch on a GPU) of "
              f"{row['ops_inside_graphs_per_pair']:.0f} ops", flush=True)
        print(f"  per pair: {row['aten_ops_per_pair']:.0f} torch ops; host calls "
              + ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["host_calls_per_pair"].items())), flush=True)
        print("  most called: " + ", ".join(f"{k[6:]} {v:.0f}" for k, v in row["most_called_ops_per_pair"].items()),
              flush=True)
        for name, step in row["host_timeline"].items():
            launch = step["to_graph_launch_us"]
            print(f"  {name}: {step['took_us']:.0f} µs, of which waiting for the device {step['waiting_us']:.0f}"
                  + ("" if launch is None else f"; its graph launched after {launch:.0f} µs of host time"),
                  flush=True)
        for name, us in row["top_device_time_us_per_pair"].items():
            print(f"  {us:8.1f} µs  {name}", flush=True)
        for kind, mb in row["graph_memory_MB"].items():
            print(f"  graph {kind}: holds {mb['held']:.1f} MB on the GPU, the capacity plan counts "
                  f"{mb['planned']:.1f} MB", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"codec": args.codec, "device": str(device), "store": args.store,
                                                    "store_device": str(store_device),
                                                    "machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
