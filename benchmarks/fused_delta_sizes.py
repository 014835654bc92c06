"""Where AQ-SGD's fused delta step pays: one link's encode and decode timed pair by pair, the delta step in torch
ops (AQPIPE_FUSED_AQSGD=0) and fused (=1), across micro-batch sizes — what `fused.DELTA_MIN_ELEMENTS`, the size from
which a run fuses it by default, was set from. aqsgd:3, m(ξ) fp16 kept as a run keeps it on a GPU (slabs).

    python benchmarks/fused_delta_sizes.py --out benchmarks/results/fused_delta_sizes_h200     # on a GPU

Each row: median µs of an encode and of its decode (each timed with the GPU synchronized around it, after the
link's first four pairs and `codec_speed.WARM_SECONDS` of pairs), and "both": the input's bytes (fp32) over the two. A message's fixed cost — launches, a wait on
each side, the copies to and from the host — is most of a pair's time below a million values, so there the two
steps tie.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.codec_profile import link  # noqa: E402
from benchmarks.codec_speed import measure_pairs  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

SHAPES = ["4,128,576", "4,256,576", "8,256,576", "4,512,576", "8,512,576", "8,1024,576", "4,512,1600",
          "2,512,2048", "4,256,2048"]
SWITCH = "AQPIPE_FUSED_AQSGD"


def measure(shape: tuple[int, ...], fused: str, device: torch.device, repeats: int) -> dict:
    """One shape with the delta step fused ("1") or in torch ops ("0"): encode and decode µs, and GB/s both."""
    os.environ[SWITCH] = fused  # (read at every message: a fresh link per setting)
    sender, receiver = link("aqsgd:3", device, device)
    x = torch.randn(shape, device=device)
    encode_s, decode_s = measure_pairs(sender, receiver, x, torch.arange(shape[0]), repeats, device)
    return {"encode_us": encode_s * 1e6, "decode_us": decode_s * 1e6,
            "both_GBps": x.numel() * 4 / (encode_s + decode_s) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=25, help="pairs timed per shape and setting")
    parser.add_argument("--out", default="benchmarks/results/fused_delta_sizes")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for text in args.shapes:
        shape = tuple(int(d) for d in text.split(","))
        row = {"shape": list(shape), "values": math.prod(shape),
               "torch_ops": measure(shape, "0", device, args.repeats), "fused": measure(shape, "1", device, args.repeats)}
        rows.append(row)
        ops, fused = row["torch_ops"], row["fused"]
        print(f"{text:>12} {row['values'] / 1e6:5.2f} M values | torch ops: encode {ops['encode_us']:5.0f} decode "
              f"{ops['decode_us']:5.0f} µs, {ops['both_GBps']:5.1f} GB/s both | fused: encode {fused['encode_us']:5.0f} "
              f"decode {fused['decode_us']:5.0f} µs, {fused['both_GBps']:5.1f} GB/s both", flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"device": name,
                                                    "machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
