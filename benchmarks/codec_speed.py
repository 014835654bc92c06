"""Codec speed on one core: quantize+pack and unpack+dequantize, in MB/s of fp32 input, for every bit width.

    python benchmarks/codec_speed.py --out benchmarks/results/codec_speed
The input is an activation-shaped batch [micro-batch, tokens, hidden] (default 4 × 512 × 1600 fp32, 13 MB: GPT2-XL).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from aqpipe.compress.codecs import QuantOptions
from aqpipe.compress.directq import decode_samples, encode_samples
from aqpipe.compress.quantize import quantize


def measure(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,512,1600")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per", default="channel")
    parser.add_argument("--out", default="benchmarks/results/codec_speed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = tuple(int(x) for x in args.shape.split(","))
    x = torch.randn(shape)
    mb = x.numel() * 4 / 1e6
    rows = []
    for bits in range(1, 9):
        for stochastic in (False, True):
            opts = QuantOptions(per=args.per, stochastic=stochastic)
            g = torch.Generator().manual_seed(0)

            def encode():
                return encode_samples(quantize(x, bits, opts.per, opts.stochastic, g))

            packed = encode()
            enc = measure(encode, args.repeats)
            dec = measure(lambda: decode_samples(packed, shape, bits, opts.per), args.repeats)
            rows.append({"bits": bits, "rounding": "stochastic" if stochastic else "nearest",
                         "encode_MBps": mb / enc, "decode_MBps": mb / dec})
            print(f"{bits} bits {rows[-1]['rounding']:10s}  encode {mb / enc:7.0f} MB/s  decode {mb / dec:7.0f} MB/s",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"shape": shape, "per": args.per, "torch": torch.__version__,
                                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
