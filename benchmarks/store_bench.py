"""The on-disk m(ξ) store: end-to-end samples/s with --store lmdb vs --store memory, store read/write MB/s, the zstd
ratio and bytes on disk per sample for every encoding, and what the rewind journal costs a write (an epoch of new
m(ξ) over the last, with a checkpoint before it — each old value kept — or none).

    python benchmarks/store_bench.py --rounds 3 --out benchmarks/results/store
    python benchmarks/store_bench.py --journal-only --rounds 5 --out benchmarks/results/store-journal
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.provenance import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "wikitext-2" / "valid.txt"


def end_to_end(store: str, args, work: Path) -> float:
    out = work / f"{store}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "aqpipe", "launch", "--overwrite", "--model", "benchmarks.models:gpt2_6x128", "--pp", "4",
           "--data", str(args.data), "--seq-len", "128", "--max-samples", str(args.samples), "--vocab-size", "260",
           "--micro-batch-size", "4", "--micro-batches", "4", "--epochs", str(args.epochs), "--fw", "aqsgd:3",
           "--bw", "directq:6", "--store", store, "--device", "cpu", "--out", str(out), "--no-progress",
           "--warmup-epochs", "1", "--first-sight", "fp32"]  # an fp32 first epoch, as in every fine-tuning benchmark
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads((out / "summary.json").read_text())["samples_per_second"]


def activation_like(samples: int, shape: tuple[int, int], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Values like m(ξ) of a transformer block: a smooth per-channel profile plus noise."""
    torch.manual_seed(seed)
    return [(torch.randn(1, shape[1]) * 2 + torch.randn(shape) * 0.5).to(dtype) for _ in range(samples)]


def overwrite_speed(encoding: str, work: Path, journaled: bool, samples: int = 512, shape=(128, 128)) -> float:
    """MB/s (of fp16 m(ξ)) writing a new value over every sample's, 16 at a time, with a checkpoint just before (the
    journal keeps each old value) or none since the store was filled."""
    from aqpipe.storage.lmdb_store import LMDBStore

    store = LMDBStore(work / f"over-{encoding}-{journaled}-{time.monotonic_ns()}", encoding)
    first, second = (activation_like(samples, shape, store.dtype, seed) for seed in (0, 1))
    for i in range(0, samples, 16):
        store.put(0, "send", list(range(i, i + 16)), first[i : i + 16])
    if journaled:
        store.checkpointed(1, kept={1})
    start = time.perf_counter()
    for i in range(0, samples, 16):
        store.put(0, "send", list(range(i, i + 16)), second[i : i + 16])
    seconds = time.perf_counter() - start
    store.close()
    return samples * shape[0] * shape[1] * 2 / seconds / 1e6


def store_speed(encoding: str, work: Path, samples: int = 512, shape=(128, 128)) -> dict:
    from aqpipe.storage.encoding import encode_value
    from aqpipe.storage.lmdb_store import LMDBStore

    store = LMDBStore(work / f"speed-{encoding}", encoding)
    values = activation_like(samples, shape, store.dtype, 0)
    raw = sum(v.numel() * 2 for v in values)  # measured against fp16 m(ξ), the default
    start = time.perf_counter()
    for i in range(0, samples, 16):
        store.put(0, "send", list(range(i, i + 16)), values[i : i + 16])
    write = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, samples, 16):
        store.get(0, "send", list(range(i, i + 16)))
    read = time.perf_counter() - start
    stored = sum(n for _, _, n in store.raw_records())
    store.close()
    disk = sum(f.stat().st_size for f in (work / f"speed-{encoding}").iterdir())
    return {"encoding": encoding, "write_MBps": raw / write / 1e6, "read_MBps": raw / read / 1e6,
            "zstd_ratio": sum(encode_value(v, encoding).nbytes for v in values) / stored,
            "stored_bytes_per_sample": stored / samples, "disk_bytes_per_sample": disk / samples,
            "fp16_bytes_per_sample": shape[0] * shape[1] * 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "store"))
    parser.add_argument("--journal-only", action="store_true", help="only the journal's cost to a write (fp16, q4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        journal = {f"{encoding} {'journal' if on else 'no journal'}": [] for encoding in ("fp16", "q4") for on in (0, 1)}
        for _ in range(args.rounds):  # (alternating, so that drift of the machine meets both alike)
            for name, runs in journal.items():
                encoding, on = name.split(" ", 1)
                runs.append(overwrite_speed(encoding, work, on == "journal"))
        print({name: round(statistics.median(runs), 1) for name, runs in journal.items()}, flush=True)
        if args.journal_only:
            Path(args.out).with_suffix(".json").write_text(json.dumps(
                {"machine": machine(), "overwrite_MBps": journal}, indent=2) + "\n")
            return
        speeds = [store_speed(e, work) for e in ("fp32", "fp16", "bf16", "q8", "q4", "q2")]
        for row in speeds:
            print(row, flush=True)
        runs = {"memory": [], "lmdb": []}
        for r in range(args.rounds):
            for store in ("memory", "lmdb"):
                runs[store].append(end_to_end(store, args, work))
            print(f"round {r + 1}: memory {runs['memory'][-1]:.1f}  lmdb {runs['lmdb'][-1]:.1f} samples/s", flush=True)
    result = {"machine": machine(), "store_speed": speeds, "overwrite_MBps": journal,
              "samples_per_second": runs,
              "lmdb_over_memory": statistics.median(runs["lmdb"]) / statistics.median(runs["memory"])}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "store_speed"}, indent=2))


if __name__ == "__main__":
    main()
