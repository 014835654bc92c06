"""AQ-SGD's message time, this tree against a baseline, on one machine in alternating rounds: what a change to the
codec's GPU path bought, measured as `codec_profile.py` measures it (a sender and a receiver of one link, pair by
pair: encode, decode, both ends together, the device's busy time), each round a fresh process per tree. Both trees
are measured by this tree's `codec_profile.py`, each with its own package (so that only the package differs: the
script's warm-up changed, and with it what a tree's own script read); `--own-scripts` runs each tree's own.

Where git does not know the commits (a tree exported or copied without its history), the baseline can be
a directory: made where git knows them, git-ignored under `.ab/`, and copied with the tree.

    git archive 19b02cc --prefix=base/ | tar -x -C .ab            # (mkdir -p .ab first) a baseline tree
    python benchmarks/codec_ab.py --baseline .ab/base --device cuda --rounds 3
    python benchmarks/codec_ab.py --baseline HEAD~2 --shapes 4,16,64 --pairs 5   # on a host, for the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.codec_path import fallback_note  # noqa: E402

MEASURES = ("encode_us", "decode_us", "device_busy_us_per_pair", "cold_pair_us", "warm_pair_us")


@contextmanager
def compared_trees(baseline: str | None) -> Iterator[dict[str, Path]]:
    """The trees to time, by name, baseline first: `baseline` itself where it is a directory, else a git worktree
    of that revision (removed afterwards); then this tree. Without a baseline, this tree alone."""
    if baseline is None or Path(baseline).is_dir():
        yield ({baseline: Path(baseline).resolve()} if baseline else {}) | {"this tree": ROOT}
        return
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), baseline], check=True)
        try:
            yield {baseline: tree, "this tree": ROOT}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def profile(tree: Path, out: Path, args: argparse.Namespace) -> list[dict]:
    """`codec_profile.py` (this tree's, or with `--own-scripts` `tree`'s), run from `tree` with its aqpipe first on
    the path: its rows."""
    script = (tree if args.own_scripts else ROOT) / "benchmarks" / "codec_profile.py"
    command = [sys.executable, str(script), "--codec", args.codec, "--device", args.device,
               "--pairs", str(args.pairs), "--out", str(out), "--shapes", *args.shapes]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".json").read_text())["rows"]


def summary(rounds: list[list[dict]]) -> list[dict]:
    """Per shape, the median of each measure over the rounds, and both ends together in MB/s of input."""
    rows = []
    for at, first in enumerate(rounds[0]):
        row: dict = {"shape": first["shape"]}
        for measure in MEASURES:
            values = [r[at][measure] for r in rounds if r[at].get(measure) is not None]
            row[measure] = statistics.median(values) if values else None
        row["round_trip_MBps"] = statistics.median(r[at]["round_trip_MBps"] for r in rounds)
        # (each round's too: on an H200 one tree's pair read 59.9 GB/s here, the median of three rounds, and 40.2 in
        # gpu_check.sh's profile of the same tree — the spread says which to trust)
        row["round_trip_MBps_by_round"] = [r[at]["round_trip_MBps"] for r in rounds]
        row["host_timeline"] = [r[at].get("host_timeline") for r in rounds]  # (each round's, where the tree makes one)
        row["codec_path"] = [r[at].get("codec_path") for r in rounds]  # (each round's: had its GPU path fallen back?)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a directory holding the baseline's tree, or a git revision")
    parser.add_argument("--codec", default="aqsgd:3")
    parser.add_argument("--shapes", nargs="+", default=["8,1024,576"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--own-scripts", action="store_true",
                        help="measure each tree with its own codec_profile.py, not this tree's")
    parser.add_argument("--out", default="benchmarks/results/codec_ab.json")
    args = parser.parse_args()
    with compared_trees(args.baseline) as trees, tempfile.TemporaryDirectory() as scratch:
        runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
        for k in range(args.rounds):
            for i, (name, tree) in enumerate(trees.items()):
                runs[name].append(profile(tree, Path(scratch) / f"profile-{i}-{k}", args))
    results = {name: summary(rounds) for name, rounds in runs.items()}
    for name, rows in results.items():
        for row in rows:
            busy = row["device_busy_us_per_pair"]
            print(f"{name:>12} {tuple(row['shape'])}: encode {row['encode_us']:6.0f} µs  decode {row['decode_us']:6.0f} "
                  f"µs  both ends {row['round_trip_MBps'] / 1e3:6.1f} GB/s ("
                  + ", ".join(f"{v / 1e3:.1f}" for v in row["round_trip_MBps_by_round"]) + " by round)"
                  + ("" if busy is None else f"  device busy {busy:.0f} µs a pair"), flush=True)
            for k, path in enumerate(row["codec_path"]):
                if path and (note := fallback_note(path)):
                    print(f"{'':>12} round {k + 1}{note}", flush=True)
            if row["cold_pair_us"] is not None and row["warm_pair_us"] is not None:
                print(f"{'':>12} a pair (the median) before the warm-up: {row['cold_pair_us']:.0f} µs, after: "
                      f"{row['warm_pair_us']:.0f} µs", flush=True)
            launches = {end: [t[end]["to_graph_launch_us"] for t in row["host_timeline"] if t and end in t]
                        for end in ("encode", "decode")}
            if all(None not in found and found for found in launches.values()):
                print(f"{'':>12} host time to the graph's launch: encode "
                      f"{statistics.median(launches['encode']):.0f} µs, decode "
                      f"{statistics.median(launches['decode']):.0f} µs (profiled)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"baseline": args.baseline, "device": args.device, "codec": args.codec,
                               "rounds": args.rounds, "own_scripts": args.own_scripts, "results": results},
                              indent=2))


if __name__ == "__main__":
    main()
