"""Codec speed: quantize+pack and unpack+dequantize, in MB/s of fp32 input, for every bit width — on one CPU core,
or on a GPU with --device cuda (where it also times AQ-SGD's whole encode and decode, m(ξ) update and checksum
included, with m(ξ) in GPU memory, and the bytes' copy to the host: message by message, and streamed, pairs queued
back to back as a pipeline's two ends run them) — then the whole link codecs of --codecs through their encode and
decode, header and bytes to the host included: rotated tile quantization, TAH-Quant, …, and AQ-SGD (`aqsgd:B`) on
either device, timed as a link's two ends with m(ξ) kept.

    python benchmarks/codec_speed.py --out benchmarks/results/codec_speed
    python benchmarks/codec_speed.py --only-codecs --codecs aqsgd:3,directq:4 --out benchmarks/results/codec_speed_aqsgd
    python benchmarks/codec_speed.py --device cuda --out benchmarks/results/codec_speed_cuda
The input is an activation-shaped batch [micro-batch, tokens, hidden] (default 4 × 512 × 1600 fp32, 13 MB: GPT2-XL)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from aqpipe.compress.grids import SCALES
from aqpipe.compress.link.directq import decode_samples, encode_samples
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecError, CodecSpec, parse_spec
from aqpipe.compress.quantize import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.codec_path import codec_path, fallback_note  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

# Seconds of pairs an AQ-SGD link runs, past its first four, before any is timed (`measure_pairs`; codec_profile.py
# twice that). Timed right after those four, one tree's pair read 23, 40 and 60 GB/s on one H200 in three scripts
# that timed 7, 11 and 21 pairs: as if a link's pairs got faster over its first few dozen (its graphs' first
# replays? the allocators?). A pipeline's link has been busy for a while. The early pairs are still recorded apart
# (`early`; codec_profile.py's `cold_pair_us`), to show whether they differ.
WARM_SECONDS = 0.25


def warm(fn, seconds: float = WARM_SECONDS) -> int:
    """Call fn() until `seconds` have passed (at least once); how many calls that took."""
    calls, until = 0, time.perf_counter() + seconds
    while calls == 0 or time.perf_counter() < until:
        fn()
        calls += 1
    return calls


def measure(fn, repeats: int, device: torch.device | None = None) -> float:
    """Median seconds of fn() after two warm-up calls — on a GPU the second captures the codec's CUDA graph — (the
    GPU synchronized around each call)."""
    sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    fn()
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_stream(fn, calls: int, device: torch.device) -> float:
    """Seconds per call of `calls` calls of fn() queued back to back with one synchronize at the end — the rate a
    pipeline sees, whose host queues a message's kernels (and its bytes' copy) without waiting for the GPU — after
    two warm-up calls."""
    fn()
    fn()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def time_pair(sender, receiver, x: torch.Tensor, ids: torch.Tensor, device: torch.device, pageable: bool = False
              ) -> tuple[float, float]:
    """Seconds of one AQ-SGD encode and of the decode of what it sent (the GPU synchronized around each). The
    decoder gets the bytes as a GPU's inbox receives them, page-locked (the encoder's own pinned copy), or with
    `pageable` as it received them before (ordinary host memory)."""
    from aqpipe.pipeline.links.transport import Header

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    encoded = sender.encode(x, ids, compress=True)
    sync()
    payload = encoded.payload.clone() if pageable else encoded.payload
    middle = time.perf_counter()
    receiver.decode(Header.for_encoded(encoded, sender.code), payload, ids)
    receiver.settle()  # (the checksum checked: a GPU receiver leaves it until the sums reach the host)
    sync()
    return middle - start, time.perf_counter() - middle


def measure_pairs(sender, receiver, x: torch.Tensor, ids: torch.Tensor, repeats: int,
                  device: torch.device, pageable: bool = False, early: list[float] | None = None
                  ) -> tuple[float, float]:
    """Median seconds of AQ-SGD's encode and of its decode, timed message by message: every message the sender
    encodes is decoded once, in order, so the two copies of m(ξ) move together (decoding one message twice would
    apply its delta twice, and the checksum would say so). Pairs are timed after the first four and `WARM_SECONDS`
    of pairs (`warm`); `early` (a list) gets the median seconds of a pair among the ten right after the four."""
    def pair() -> tuple[float, float]:
        return time_pair(sender, receiver, x, ids, device, pageable)

    # the first seeds m(ξ); then the delta path warms up and captures its CUDA graphs, by the fourth at the latest
    # (the fused step: its kernels' first run in the process, its graph's first call, then its capture)
    for _ in range(4):
        pair()
    if early is not None:
        early.append(statistics.median(sum(pair()) for _ in range(10)))
    warm(pair)
    timed = [pair() for _ in range(repeats)]
    return statistics.median(t for t, _ in timed), statistics.median(t for _, t in timed)


def aqsgd_rows(x: torch.Tensor, per: str, repeats: int, device: torch.device) -> list[dict]:
    """AQ-SGD's whole encode (delta, quantize, pack, m(ξ) update, checksum, bytes to the host) and decode, m(ξ) kept
    as `--store-device cuda` keeps it (on a GPU: slabs); at 3 bits, for paired comparisons, also kept a tensor per
    sample (the store before slabs), and on a GPU decoded from pageable bytes (as received before inboxes pinned),
    kept in host RAM (the default `--store-device cpu`), and sent as a bf16 activation (what a `--precision bf16`
    stage sends; MB/s of its own bytes, half the fp32 rows')."""
    from aqpipe.storage import MemoryStore, memory_store

    rows = []
    variants = [(2, memory_store, ""), (3, memory_store, ""), (4, memory_store, ""), (8, memory_store, ""),
                (3, MemoryStore, ", a tensor per sample")]
    if device.type == "cuda":
        variants += [(3, memory_store, ", bytes received pageable"),
                     (3, lambda dtype, _: MemoryStore(dtype, "cpu"), ", m(xi) in host RAM"),
                     (3, memory_store, ", a bf16 activation (MB/s of its bf16 bytes)")]
    for bits, kept, label in variants:
        rows.append(aqsgd_row(f"aqsgd:{bits}", x, per, repeats, device, kept, label))
    return rows


def aqsgd_row(spec: str, x: torch.Tensor, per: str, repeats: int, device: torch.device, kept=None,
              label: str = "") -> dict:
    """One AQ-SGD codec's whole encode and decode, timed as pairs of a link's two ends (`measure_pairs`), m(ξ) on
    both sides kept by `kept(dtype, device)` (default: `--store-device`'s slabs on `device`)."""
    from aqpipe.compress.link.factory import build_codec, message_bytes
    from aqpipe.storage import StoreView, memory_store

    kept = kept or memory_store
    ids = torch.arange(x.shape[0])
    send, recv = kept(torch.float16, device), kept(torch.float16, device)
    sender = build_codec(spec, "fw", StoreView(send, 0, "send"), QuantOptions(per=per), device=device)
    receiver = build_codec(spec, "fw", StoreView(recv, 0, "recv"), QuantOptions(per=per), device=device)
    given = x.to(torch.bfloat16) if "bf16" in label else x  # (what a bf16 run's stage sends)
    mb = given.numel() * given.element_size() / 1e6
    early: list[float] = []
    enc, dec = measure_pairs(sender, receiver, given, ids, repeats, device, pageable="pageable" in label, early=early)
    delta = message_bytes(spec, "fw", tuple(given.shape), given.dtype, QuantOptions(per=per))  # the timed messages' size
    row = {"codec": spec, "bits": sender.bits, "bits_per_value": 8 * delta / given.numel(),
           "rounding": f"aqsgd codec{label}", "encode_MBps": mb / enc,
           "decode_MBps": mb / dec, "round_trip_MBps": mb / (enc + dec), "early_pair_MBps": mb / early[0],
           "codec_path": codec_path()}
    streamed = ""
    if device.type == "cuda" and not label:  # the rate a pipeline sees: no wait but the sender's own
        row["streamed_round_trip_MBps"] = mb / stream_pairs(sender, receiver, given, ids, 20 * repeats)
        streamed = f"  streamed both {row['streamed_round_trip_MBps']:7.0f} MB/s"
    print(f"{spec} {row['bits_per_value']:5.2f} bits/value whole codec{label}   encode {mb / enc:7.0f} MB/s  "
          f"decode {mb / dec:7.0f} MB/s{streamed}"
          f"  (both, its 5th-14th pairs: {row['early_pair_MBps']:7.0f} MB/s){fallback_note(row['codec_path'])}",
          flush=True)
    return row


def stream_pairs(sender, receiver, x: torch.Tensor, ids: torch.Tensor, pairs: int) -> float:
    """Seconds per encode+decode pair, `pairs` queued back to back as a pipeline's two ends would run them: the
    sender still waits once per message for its verdicts (which samples go as deltas), the receiver never (its
    checksum checks are made as their sums arrive, and all of them before the clock stops)."""
    from aqpipe.pipeline.links.transport import Header

    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(pairs):
        encoded = sender.encode(x, ids, compress=True)
        receiver.decode(Header.for_encoded(encoded, sender.code), encoded.payload, ids)
    receiver.settle()
    sync()
    return (time.perf_counter() - start) / pairs


def cannot_code(x: torch.Tensor, specs: list[CodecSpec], per: str, device: torch.device) -> tuple[str, str] | None:
    """The first codec of `specs` (m(ξ)'s aside: theirs code any shape) that refuses to code `x`, with its reason; None
    if each codes it (one encode each, before anything is timed)."""
    from aqpipe.compress.link.factory import build_codec

    for parsed in specs:
        if parsed.keeps_messages:
            continue
        try:
            build_codec(parsed, "fw", options=QuantOptions(per=per), device=device).encode(x, torch.arange(x.shape[0]))
        except CodecError as e:
            return str(parsed), str(e)
    return None


def zstd_saving(*payloads: torch.Tensor) -> float:
    """The share of the messages' bytes zstd at level 1 would save, each message compressed on its own (what a
    general-purpose compressor finds left in coded bytes)."""
    import zstandard

    zstd = zstandard.ZstdCompressor(level=1)
    plain = [payload.cpu().numpy().tobytes() for payload in payloads]
    return 1 - sum(len(zstd.compress(data)) for data in plain) / sum(len(data) for data in plain)


def link_codec_rows(x: torch.Tensor, specs: list[CodecSpec], per: str, repeats: int, device: torch.device
                    ) -> list[dict]:
    """Each link codec's whole encode and decode, by spec (one that keeps m(ξ), as pairs of a link's two ends)."""
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.pipeline.links.transport import Header

    mb = x.numel() * 4 / 1e6
    ids = torch.arange(x.shape[0])
    rows = []
    for parsed in specs:
        spec = str(parsed)
        if parsed.keeps_messages:
            rows.append(aqsgd_row(spec, x, per, repeats, device))
            continue
        codec = build_codec(parsed, "fw", options=QuantOptions(per=per), device=device)
        box = {}

        def encode():
            box["e"] = codec.encode(x, ids)

        def decode():
            codec.decode(Header.for_encoded(box["e"], codec.code), box["e"].payload, ids)

        encode()
        enc, dec = measure(encode, repeats, device), measure(decode, repeats, device)
        bits = 8 * box["e"].payload.numel() / x.numel()
        row = {"codec": spec, "bits_per_value": bits, "encode_MBps": mb / enc, "decode_MBps": mb / dec,
               "round_trip_MBps": mb / (enc + dec), "zstd1_saving": zstd_saving(box["e"].payload),
               "codec_path": codec_path()}
        print(f"{spec:10s} {bits:5.2f} bits/value  encode {mb / enc:7.0f} MB/s  decode {mb / dec:7.0f} MB/s  "
              f"both {mb / (enc + dec):7.0f} MB/s  zstd -1 would save {row['zstd1_saving']:.1%}"
              f"{fallback_note(row['codec_path'])}", flush=True)
        if device.type == "cuda":  # queued back to back: encode, then decode of what it sent (host copies included)
            def round_trip():
                e = codec.encode(x, ids)
                codec.decode(Header.for_encoded(e, codec.code), e.payload, ids)

            both = measure_stream(round_trip, 20 * repeats, device)
            row.update(streamed_round_trip_MBps=mb / both)
            print(f"{spec:10s} streamed (no wait between messages)     both {mb / both:7.0f} MB/s", flush=True)
        if device.type == "cuda" and hasattr(codec, "coder"):  # the coder alone: its kernels, no bytes to the host
            coded = codec.coder.encode(x)[0]
            enc_k = measure(lambda: codec.coder.encode(x), repeats, device)
            dec_k = measure(lambda: codec.coder.decode(coded, tuple(x.shape)), repeats, device)
            both = measure_stream(lambda: codec.coder.decode(codec.coder.encode(x)[0], tuple(x.shape)),
                                  20 * repeats, device)
            row.update(kernels_encode_MBps=mb / enc_k, kernels_decode_MBps=mb / dec_k,
                       kernels_round_trip_MBps=mb / (enc_k + dec_k), kernels_streamed_round_trip_MBps=mb / both)
            print(f"{spec:10s} kernels only (on the GPU, no host copy)  encode {mb / enc_k:7.0f} MB/s  "
                  f"decode {mb / dec_k:7.0f} MB/s  both {mb / (enc_k + dec_k):7.0f} MB/s  "
                  f"streamed {mb / both:7.0f} MB/s", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4,512,1600")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--per", default=SCALES[0], choices=SCALES, help="scale granularity of every codec timed")
    parser.add_argument("--out", default="benchmarks/results/codec_speed")
    parser.add_argument("--device", default="cpu", help="cpu (one core) or cuda")
    parser.add_argument("--codecs", default="directq:4,rtq:3,rtq:4,rtqo:4,tahq",
                        help="link codecs timed whole, any --fw spec (aqsgd:B as a link's two ends, m(ξ) kept)")
    parser.add_argument("--only-codecs", action="store_true", help="skip the per-width quantizer rows")
    args = parser.parse_args()
    try:
        specs = [parse_spec(spec, "fw") for spec in args.codecs.split(",") if spec]
    except CodecError as e:
        parser.error(f"--codecs takes --fw specs: {e}")
    torch.set_num_threads(1)
    device = torch.device(args.device)
    shape = tuple(int(x) for x in args.shape.split(","))
    x = torch.randn(shape, device=device)
    refused = cannot_code(x, specs, args.per, device)
    if refused is not None:
        parser.error(f"--codecs {refused[0]} cannot code --shape {args.shape}: {refused[1]}")
    mb = x.numel() * 4 / 1e6
    rows = []
    for bits in range(1, 9) if not args.only_codecs else ():
        for stochastic in (False, True):
            opts = QuantOptions(per=args.per, stochastic=stochastic)
            g = torch.Generator(device=device).manual_seed(0)

            def encode():
                return encode_samples(quantize(x, bits, opts.per, opts.stochastic, g))

            packed = encode()
            enc = measure(encode, args.repeats, device)
            dec = measure(lambda: decode_samples(packed, shape, bits, opts.per), args.repeats, device)
            rows.append({"bits": bits, "rounding": "stochastic" if stochastic else "nearest",
                         "encode_MBps": mb / enc, "decode_MBps": mb / dec})
            print(f"{bits} bits {rows[-1]['rounding']:10s}  encode {mb / enc:7.0f} MB/s  decode {mb / dec:7.0f} MB/s",
                  flush=True)
    if device.type == "cuda":
        rows += aqsgd_rows(x, args.per, args.repeats, device)
    timed = {row.get("codec") for row in rows}  # (on a GPU, AQ-SGD's own rows)
    rows += link_codec_rows(x, [spec for spec in specs if str(spec) not in timed], args.per, args.repeats, device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"shape": shape, "per": args.per,
                                                    "device": str(device),
                                                    "machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
