"""The fused kernels' tile shapes and warp counts, swept on a GPU: AQ-SGD's delta encode (scales, codes and verdicts
kernels) and decode (decode and verdicts kernels) on one batch, each kernel's device time per call read from the
profiler, for every setting — each setting first checked to write the bits of the shipped one (payload, new m(ξ),
verdicts and checksum sums, decoded activation; the fidelity norms, summed in another order, to float rounding).
What `fused_kernels`' SCALE_T/SCALE_C (the scales kernel), TILE_T/TILE_C (codes and decode) and WARPS (each kernel's
warp count, read from each kernel's own column: the rows set one count for all) are set from.

    python benchmarks/fused_tiles.py --out benchmarks/results/fused_tiles_h100                  # on a GPU
    TRITON_INTERPRET=1 python benchmarks/fused_tiles.py --device cpu --shape 2,16,64 --quick    # the bits alone

Two sweeps, each varying one kernel's tiles with the other's as shipped: "scales" (SCALE_T × SCALE_C × warps) and
"codes" (TILE_T × TILE_C × warps, which the decode kernel shares). A row's warp count applies to every kernel.
m(ξ) is fp16 in a slab read through shuffled slots, as a run on a GPU keeps it; the new m(ξ) is written apart, so
every call sees the same inputs. Under Triton's interpreter (no GPU) only the bits are checked.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from aqpipe.compress.gpu import fused  # noqa: E402
from aqpipe.compress.link.aqsgd_rows import MODE_DELTA  # noqa: E402
from aqpipe.compress.link.checksum import CHECKSUM_WEIGHTS  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

KERNELS = ("scales_kernel", "codes_kernel", "decode_kernel", "verdicts_kernel")
WARPS = (2, 4, 8)
SWEEPS = {
    "scales": [{"SCALE_T": t, "SCALE_C": c} for t, c in itertools.product((16, 32, 64, 128), (16, 32, 64, 128))],
    "codes": [{"TILE_T": t, "TILE_C": c} for t, c in itertools.product((8, 16, 32, 64), (32, 64, 128, 256))],
}
QUICK = {"scales": [{"SCALE_T": 16, "SCALE_C": 16}], "codes": [{"TILE_T": 8, "TILE_C": 32}]}


class Batch:
    """One message's inputs on `device`: an activation [B, T, C], m(ξ) in a slab of 2B fp16 rows with the batch's
    slots shuffled, and (after `encode`) the coded rows the decode reads."""

    def __init__(self, shape: tuple[int, ...], device: torch.device, bits: int) -> None:
        generator = torch.Generator().manual_seed(0)
        b = shape[0]
        self.bits, self.shape = bits, shape
        self.x = torch.randn(shape, generator=generator).to(device)
        slab = torch.randn((2 * b, *shape[1:]), generator=generator) * 0.5
        self.slab = slab.to(torch.float16).to(device)
        self.slots = torch.randperm(2 * b, generator=generator)[:b].to(device)
        self.rows: torch.Tensor | None = None

    def encode(self) -> fused.DeltaEncoded:
        done = fused.delta_encode(self.x, self.slab, self.slots, self.bits, "signed", CHECKSUM_WEIGHTS, MODE_DELTA)
        if done is None:
            raise RuntimeError(f"the fused kernels failed: {fused._failed[-1]}")
        return done

    def decode(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        if self.rows is None:
            self.rows = self.encode().payload[self.shape[0]:].view(self.shape[0], -1)
        out = fused.delta_decode(self.rows, self.slab, self.slots, self.shape, self.bits, "signed", CHECKSUM_WEIGHTS)
        if out is None:
            raise RuntimeError(f"the fused kernels failed: {fused._failed[-1]}")
        return out


def outputs(batch: Batch) -> dict[str, torch.Tensor]:
    """Everything one encode and one decode of `batch` write, on the host."""
    done = batch.encode()
    m_new, values, verdicts = batch.decode()
    assert done.m_new is not None and m_new is not None  # (written apart: `in_place` is not asked)
    return {"payload": done.payload, "m_new": done.m_new, "verdicts": done.verdicts, "norms": done.norms,
            "squares": done.squares, "decoded_m_new": m_new, "decoded": values, "decoded_verdicts": verdicts}


def same_bits(got: dict[str, torch.Tensor], shipped: dict[str, torch.Tensor]) -> str | None:
    """What differs from the shipped tiles' outputs (None: nothing): every byte, but the norms to float rounding."""
    for name, want in shipped.items():
        have = got[name].cpu()
        if name in ("norms", "squares"):
            if not torch.allclose(have.double(), want.cpu().double(), rtol=1e-5, equal_nan=True):
                return name
        elif not torch.equal(have, want.cpu()):
            return name
    return None


def device_times(batch: Batch, repeats: int) -> dict[str, float]:
    """Each kernel's device µs per call over `repeats` encode+decode pairs (after two that compile and warm up), and
    the pair's wall µs (the GPU synchronized around each)."""
    for _ in range(2):
        batch.encode(), batch.decode()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            start = time.perf_counter()
            batch.encode(), batch.decode()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    times = {name: 0.0 for name in KERNELS}
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA and event.key in times:
            times[event.key] += event.self_device_time_total / repeats
    times["pair_wall"] = statistics.median(walls) * 1e6
    return times


def sweep(batch: Batch, settings: list[dict[str, int]], warps: tuple[int, ...], repeats: int,
          shipped: dict[str, torch.Tensor], timed: bool) -> list[dict]:
    """Each setting (with each warp count): its bits checked against the shipped tiles', then (`timed`) its kernels'
    device times. The kernels module's constants are restored after each."""
    kernels = fused._kernels()
    rows = []
    for setting, w in itertools.product(settings, warps):
        saved = {name: getattr(kernels, name) for name in (*setting, "WARPS")}
        try:
            for name, value in setting.items():
                setattr(kernels, name, value)
            if w:
                kernels.WARPS = dict.fromkeys(saved["WARPS"], w)
            row = {**setting, "num_warps": w or None, "differs": same_bits(outputs(batch), shipped)}
            if timed and row["differs"] is None:
                row.update({f"{k}_us": v for k, v in device_times(batch, repeats).items()})
        finally:
            for name, value in saved.items():
                setattr(kernels, name, value)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], keys: tuple[str, ...], by: tuple[str, ...], top: int = 10) -> str:
    """The `top` settings by the summed device µs of kernels `by`, as a markdown table."""
    timed = [r for r in rows if all(f"{k}_us" in r for k in by)]
    timed.sort(key=lambda r: sum(r[f"{k}_us"] for k in by))
    head = [*keys, "num_warps", *(f"{k} µs" for k in by), "pair wall µs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in timed[:top]:
        cells = [str(r[k]) for k in (*keys, "num_warps")] + [f"{r[f'{k}_us']:.1f}" for k in by]
        lines.append("| " + " | ".join(cells + [f"{r['pair_wall_us']:.0f}"]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8,1024,576", help="the batch: micro-batch, tokens, hidden")
    parser.add_argument("--bits", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20, help="pairs profiled per setting")
    parser.add_argument("--quick", action="store_true", help="one setting a sweep and the shipped warps")
    parser.add_argument("--out", default="benchmarks/results/fused_tiles")
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = tuple(int(d) for d in args.shape.split(","))
    if fused.interpreted():  # (the tests' fix of Triton 3.6's interpreter under numpy >= 2.4, before any kernel runs)
        from tests.fused_cases import INTERPRETER_PATCH
        exec(INTERPRETER_PATCH, {})  # (its own globals: the patch refers to its names from a function)
    if not fused.fusable(device, shape, args.bits, "channel", "signed"):
        raise SystemExit(f"the fused delta step does not run on {device} for {shape} (a GPU, or the interpreter)")
    timed = device.type == "cuda"
    batch = Batch(shape, device, args.bits)
    shipped = outputs(batch)
    warps = WARPS if timed and not args.quick else (0,)  # (0: the shipped count; the interpreter has none)
    results = {}
    for name, settings in (QUICK if args.quick else SWEEPS).items():
        results[name] = sweep(batch, settings, warps, args.repeats, shipped, timed)
    wrong = [r for rows in results.values() for r in rows if r["differs"] is not None]
    device_name = torch.cuda.get_device_name(device) if timed else "interpreter"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"device": device_name, "machine": machine(), "shape": shape,
         "bits": args.bits, "shipped": {k: getattr(fused._kernels(), k) for k in ("SCALE_T", "SCALE_C", "TILE_T",
                                                                                   "TILE_C")},
         "results": results}, indent=2))
    if timed:
        report = (f"# Fused kernel tiles on {device_name}, {shape}, {args.bits} bits\n\n## scales kernel\n\n"
                  + table(results["scales"], ("SCALE_T", "SCALE_C"), ("scales_kernel",))
                  + "\n\n## codes and decode kernels\n\n"
                  + table(results["codes"], ("TILE_T", "TILE_C"), ("codes_kernel", "decode_kernel")) + "\n")
        out.with_suffix(".md").write_text(report)
        print(report)
    if wrong:
        raise SystemExit(f"{len(wrong)} settings wrote other bits than the shipped tiles: {wrong}")
    print(f"every setting wrote the shipped tiles' bits ({sum(len(r) for r in results.values())} settings)")


if __name__ == "__main__":
    main()
