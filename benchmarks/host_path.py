"""The host's share of an AQ-SGD message on a GPU, measured on a machine without one: the Python a sender and a
receiver run per message in a GPU run's steady state (m(ξ) as rows of a slab, the fused delta step replayed from
its CUDA graph), with the device's work taken out.

On a GPU a message's time at a real run's shape is mostly its host's calls (benchmarks/README.md: ~250 of ~460 µs a
pair on an H100), and a machine without a GPU can still cut the Python among them. Here the codec takes the same
branches as on a GPU: the graphs are the tests' host stand-ins (tests/graph_stand_ins.py) whose replays do nothing,
and the fused kernels are launchers that do nothing but write "every sample may go as a delta, checksum sum 0". So
the time per pair (the garbage collector off while timed) is the orchestration alone: the store's lookups, the
graph's signature, the copies into its buffers (tiny here), the verdicts' read, the checksum's fold. It is not the
CUDA calls a GPU's host also makes (copies, graph launches, events: count those with `codec_profile.py` on a GPU).
Compare commits with `--baseline REV`, which runs REV's tree from a git worktree, its rounds alternating with this
tree's.

    python benchmarks/host_path.py                        # µs per encode and per decode, median of rounds
    python benchmarks/host_path.py --baseline HEAD~3      # the same, against an earlier commit, rounds alternating
    python benchmarks/host_path.py --profile tottime      # where the Python goes (cProfile)
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def steady_pairs(pairs: int, shape: tuple[int, ...], profile: str | None) -> dict:
    """Seconds per encode and per decode of `pairs` messages after the steady state is reached (this process's
    aqpipe: the tree on sys.path)."""
    os.environ.update(TRITON_INTERPRET="1", AQPIPE_FUSED_AQSGD="1")  # (the fused step's branches, on the host)
    import torch

    from aqpipe.compress.gpu import fused
    from aqpipe.compress.link.checksum import refuse_divergence
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.late_checks import LateChecks
    from aqpipe.compress.link.options import QuantOptions
    from aqpipe.pipeline.links.transport import Header
    from aqpipe.storage import StoreView
    from aqpipe.storage.slab import SlabStore
    from tests import graph_stand_ins

    def launch(grid):  # a kernel launch that computes nothing
        return lambda *args, **kwargs: None

    def verdicts(grid):  # every sample may go as a delta, its checksum sum 0 (the same at both ends)
        def write(*args, **kwargs):
            out = args[4]
            out[: out.shape[0] // 2] = 1
            out[out.shape[0] // 2:] = 0
        return write

    class Kernel:
        def __init__(self, run):
            self.run = run

        def __getitem__(self, grid):
            return self.run(grid)

    fake = types.SimpleNamespace(
        scales_kernel=Kernel(launch), codes_kernel=Kernel(launch), decode_kernel=Kernel(launch),
        verdicts_kernel=Kernel(verdicts), TILE_T=16, TILE_C=64, SCALE_T=128, SCALE_C=32, VERDICT_P=256, VERDICT_C=256,
        WARPS=dict.fromkeys(("scales", "codes", "decode", "delta_decode", "verdicts"), 4), OPTIONS={})
    fused._kernels = lambda: fake
    graph_stand_ins.install([])
    graph_stand_ins.StandInGraph.replay = lambda self: None  # (a replay's device work is not the host's)
    torch.set_num_threads(1)
    host = torch.device("cpu")
    ends = [build_codec("aqsgd:3", "fw", StoreView(SlabStore(torch.float16, host), 0, side), QuantOptions(),
                        device=host) for side in ("send", "recv")]
    # a GPU receiver's checksum checks, made once their sums arrive (here at once: host sums arrive as made)
    ends[1].late_checks = LateChecks(functools.partial(refuse_divergence, 0))
    x = torch.randn(shape)
    batches = itertools.cycle([torch.arange(shape[0]) + shape[0] * k for k in range(4)])

    def pair(clock: list[float]) -> None:
        ids = next(batches)
        start = time.perf_counter()
        encoded = ends[0].encode(x, ids, compress=True)
        middle = time.perf_counter()
        ends[1].decode(Header.for_encoded(encoded, ends[0].code), encoded.payload, ids)
        clock[0] += middle - start
        clock[1] += time.perf_counter() - middle

    warm = [0.0, 0.0]
    for _ in range(24):  # first sights, then the kernels' first runs, the graphs' first calls and captures
        pair(warm)
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(pairs):
            pair(warm)
        profiler.disable()
        pstats.Stats(profiler).sort_stats(profile).print_stats(30)
    clock = [0.0, 0.0]
    gc.collect()
    gc.disable()  # (a collection's pause depends on the whole heap — a training process's, not this one's)
    try:
        for _ in range(pairs):
            pair(clock)
    finally:
        gc.enable()
    return {"encode_us": clock[0] / pairs * 1e6, "decode_us": clock[1] / pairs * 1e6}


def run_tree(tree: Path, pairs: int, shape: str) -> dict:
    """`steady_pairs` in a fresh process importing aqpipe (and the tests' stand-ins) from `tree`."""
    code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(ROOT)!r}); "
            f"from benchmarks.host_path import steady_pairs; "
            f"print(json.dumps(steady_pairs({pairs}, ({shape},), None)))")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tree, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8,16,64", help="a micro-batch's activation (small: the Python alone)")
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a git revision (or a directory holding a tree) to compare with, its rounds "
                        "alternating with this tree's")
    parser.add_argument("--profile", choices=("tottime", "cumulative", "ncalls"), help="print a cProfile table")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # (in this process only: a tree's run imports that tree's aqpipe)
    from benchmarks.codec_ab import compared_trees

    if args.profile:
        steady_pairs(args.pairs, tuple(int(d) for d in args.shape.split(",")), args.profile)
        return
    with compared_trees(args.baseline) as trees:
        times: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                times[name].append(run_tree(tree, args.pairs, args.shape))
    for name, rows in times.items():
        encode = statistics.median(r["encode_us"] for r in rows)
        decode = statistics.median(r["decode_us"] for r in rows)
        spread = [round(r["encode_us"] + r["decode_us"], 1) for r in rows]
        print(f"{name:>12}: encode {encode:6.1f} µs  decode {decode:6.1f} µs  a pair, by round: {spread}")


if __name__ == "__main__":
    main()
