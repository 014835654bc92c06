"""Gradient compressors on a 25M-parameter gradient: bytes on the wire per step per replica, and time.

Two gloo replicas on loopback synchronize a 25.2M-value gradient (24 weight matrices of 1024×1024 plus 24 bias
vectors, GPT-2-like magnitudes) with every `--grad-sync` method; each method first runs the steps it needs to
reach its steady state (PowerSGD's two plain steps, FFT's range calibration, qadam's warm-up, SIDCo's first three
stage adaptations), then is timed over `--steps` steps. Alongside, one process times each method's local encode and decode alone, and SIDCo's threshold
estimation against torch.topk at ratios 0.1, 0.01, 0.001.

    python benchmarks/grad_compressors.py --steps 3 --out benchmarks/results/grad_compressors
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import machine  # noqa: E402

METHODS = ["none", "fp16", "bf16", "powersgd:4", "ef:4", "qadam:4", "topk:0.01", "sidco:exp:0.01",
           "sidco:gamma:0.01", "sidco:gpareto:0.01", "fft:0.9:8", "signsgd", "marsit:0"]
SHAPES = [(1024, 1024)] * 24 + [(1024,)] * 24


def gradient(seed: int) -> list[torch.Tensor]:
    """A 25.2M-value gradient with heavy-tailed, GPT-2-like magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    # a Gaussian scaled by u**4 (u uniform): most values tiny, a heavy tail, like real gradients
    return [torch.randn(s, generator=generator).mul_(torch.rand(s, generator=generator).pow_(4)).mul_(1e-3)
            for s in SHAPES]


def _replica(rank: int, world: int, port: int, method: str, steps: int, queue) -> None:
    import torch.distributed as dist

    from aqpipe.compress.grad import DPGroup, build_grad_sync
    from aqpipe.compress.grad.qadam import QAdamSync, QuantizedAdam

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    sync = build_grad_sync(method, DPGroup(None, tuple(range(world)), rank), seed=0, freeze_after=1)
    optimizer = QuantizedAdam(params, sync) if isinstance(sync, QAdamSync) else None
    # steps to the steady state: PowerSGD's plain steps, FFT's range calibration, qadam's warm-up, and three of
    # SIDCo's stage adaptations (every 5 calls)
    warmup = {"powersgd": 2, "fft": 3, "qadam": 1, "sidco": 15}.get(method.split(":")[0], 0)
    seconds, sent = [], []
    for step in range(warmup + steps):
        for p, g in zip(params, gradient(100 * step + rank)):
            p.grad = g
        dist.barrier()
        before, start = sync.bytes_sent, time.perf_counter()
        sync.synchronize(params)
        if optimizer is not None:
            optimizer.step()
        if step >= warmup:
            seconds.append(time.perf_counter() - start)
            sent.append(sync.bytes_sent - before)
    if rank == 0:
        queue.put({"seconds": seconds, "bytes": sent})
    dist.barrier()
    dist.destroy_process_group()


def distributed(method: str, steps: int, world: int = 2) -> dict:
    """Bytes per step per replica and seconds per synchronize, `world` replicas on loopback."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_replica, args=(world, port, method, steps, queue), nprocs=world, start_method="spawn")
    return queue.get()


def local_codec_times(flat: torch.Tensor) -> dict[str, dict[str, float]]:
    """Encode and decode time on one core of the methods whose two halves are separate functions."""
    from aqpipe.compress.grad import DPGroup
    from aqpipe.compress.grad.fft import FFTSparsifier, inverse
    from aqpipe.compress.grad.quantized import decode, encode
    from aqpipe.compress.grad.sidco import SIDCo
    from aqpipe.compress.grad.topk import scatter_payloads, sparse_payload

    one = DPGroup(None, (0,), 0)

    def timed(fn, repeat=3) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(repeat):
            result = fn()
        del result
        return (time.perf_counter() - start) / repeat

    out = {}
    payload, _ = encode(flat, 4)
    out["ef:4"] = {"encode": timed(lambda: encode(flat, 4)), "decode": timed(lambda: decode(payload, flat.numel(), 4))}
    k = int(0.01 * flat.numel())
    top = flat.abs().topk(k, sorted=False).indices
    sparse = sparse_payload(flat[top], top)
    out["topk:0.01"] = {"encode": timed(lambda: sparse_payload(flat[flat.abs().topk(k, sorted=False).indices], top)),
                        "decode": timed(lambda: scatter_payloads([sparse], flat.numel()))}
    for dist_name in ("exp", "gamma", "gpareto"):
        sidco = SIDCo(one, dist_name, 0.01)
        out[f"sidco:{dist_name}:0.01"] = {"encode": timed(lambda: sparse_payload(flat[sidco.select(flat)], top)),
                                          "decode": out["topk:0.01"]["decode"]}
    fft = FFTSparsifier(one, 0.9, 8)
    for _ in range(4):
        fft.encode(flat)  # calibrate the range
    message = fft.encode(flat)
    out["fft:0.9:8"] = {"encode": timed(lambda: fft.encode(flat), repeat=1),
                        "decode": timed(lambda: inverse(fft.decode_spectrum(message, flat.numel()).to(
                            torch.complex128), flat.numel()), repeat=1)}
    return out


def threshold_vs_topk(flat: torch.Tensor) -> list[dict]:
    """SIDCo's multi-stage threshold estimate vs torch.topk (selection of the same k), seconds on one core."""
    from aqpipe.compress.grad.sidco import estimate_threshold

    rows = []
    for ratio in (0.1, 0.01, 0.001):
        k = int(ratio * flat.numel())
        start = time.perf_counter()
        flat.abs().topk(k, sorted=False)
        topk_seconds = time.perf_counter() - start
        for dist_name in ("exp", "gamma", "gpareto"):
            stages = 1 if ratio >= 0.1 else (2 if ratio >= 0.01 else 3)
            start = time.perf_counter()
            threshold = estimate_threshold(flat, ratio, dist_name, stages)
            selected = int((flat.abs() >= threshold).sum())
            rows.append({"ratio": ratio, "distribution": dist_name, "stages": stages,
                         "sidco_seconds": time.perf_counter() - start, "topk_seconds": topk_seconds,
                         "achieved_over_target": selected / k})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "grad_compressors"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    results = {}
    for method in args.methods.split(","):
        results[method] = distributed(method, args.steps)
        print(f"{method:>20}: {statistics.median(results[method]['bytes']) / 1e6:8.2f} MB/step/replica, "
              f"{statistics.median(results[method]['seconds']):.2f} s/step", flush=True)
    flat = torch.cat([g.reshape(-1) for g in gradient(0)])
    codecs = local_codec_times(flat)
    thresholds = threshold_vs_topk(flat)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "numel": numel, "sync": results,
                                                    "codecs": codecs, "thresholds": thresholds}, indent=2) + "\n")
    lines = [f"{numel / 1e6:.1f}M-value gradient, 2 replicas on loopback gloo, median of {args.steps} steps.", "",
             "| method | bytes/step/replica (MB) | bytes per value | sync s/step | encode s | decode s |",
             "|---|---|---|---|---|---|"]
    for method, r in results.items():
        b = statistics.median(r["bytes"])
        codec = codecs.get(method, {})
        times = f"{codec['encode']:.3f} | {codec['decode']:.3f} |" if codec else "— | — |"
        lines.append(f"| {method} | {b / 1e6:.2f} | {b / numel:.4f} | {statistics.median(r['seconds']):.2f} | " + times)
    lines += ["", "| ratio | distribution | stages | SIDCo threshold s | torch.topk s | speed-up | achieved/target |",
              "|---|---|---|---|---|---|---|"]
    for row in thresholds:
        lines.append(f"| {row['ratio']} | {row['distribution']} | {row['stages']} | {row['sidco_seconds']:.3f} | "
                     f"{row['topk_seconds']:.3f} | {row['topk_seconds'] / row['sidco_seconds']:.1f}× | "
                     f"{row['achieved_over_target']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
