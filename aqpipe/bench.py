"""`aqpipe bench`: measure on this machine what the capacity plan needs, and recommend link codecs.

For the run its flags describe (the same flags as `aqpipe launch`), it measures
- each stage's compute per micro-batch: forward and backward of the real stage (weights, precision, recompute,
  LoRA as configured) on the run's device, the median of a few repetitions after a warm-up;
- codec speed on that device: encode + decode of one micro-batch's activation (AQ-SGD at every bit width against a
  store that already holds m(ξ); DirectQ for gradients; fp32), in GB/s of the activation;
- the link rate: what one TCP stream achieves over this host's loopback (the links of a one-machine launch), or
  `--bandwidth` when the real links are slower than that (a shaped or wide-area link: this command cannot measure
  a link between hosts, so give its rate there);
then recommends the highest `--fw aqsgd:B --bw directq:2B` (gradients at twice the bits, the AQ-SGD paper's
pairing) whose wire time per micro-batch on the busiest rank's link (from three stages on, a middle stage's: its
activations and its gradients) stays within the slowest stage's compute, so the default eager 1F1B schedule keeps
the links busy without making them the bottleneck.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.compress.link.options import QuantOptions
from aqpipe.compress.link.specs import CodecSpec
from aqpipe.config import ResolvedConfig
from aqpipe.launch.gpu_sharing import local_sharing_note
from aqpipe.pipeline.links.transport import Header
from aqpipe.pipeline.numerics.mixed_precision import autocast
from aqpipe.runtime.capacity.links import LinkNeeds, steady_payload_bytes
from aqpipe.runtime.capacity.plan import TiedNeeds, plan_capacity
from aqpipe.runtime.capacity.rows import EVERY_POSITION, RowShapes, row_shapes
from aqpipe.runtime.capacity.step_wire import links_seconds, rank_traffic
from aqpipe.runtime.capacity.table import format_tied
from aqpipe.runtime.plan import RunPlan
from aqpipe.storage import StoreView, memory_store

FW_BITS = (8, 6, 4, 3, 2)  # the AQ-SGD widths the recommendation chooses among, most faithful first
REPEATS = 5


def candidate_links(bits: int) -> tuple[CodecSpec, CodecSpec]:
    """The links the recommendation weighs at `bits`: AQ-SGD forward, DirectQ gradients at twice the bits (at most 8)."""
    return CodecSpec("aqsgd", bits), CodecSpec("directq", min(2 * bits, 8))


@dataclass
class BenchResult:
    """What `aqpipe bench` measured and recommends."""

    stage_seconds: list[float]  # forward + backward of one micro-batch, per stage
    codec_gbps: dict[str, float]  # codec spec -> GB/s of activation encoded and decoded
    activation_bytes: int  # one micro-batch's fp32 activation (what the codec speeds are per)
    link_bytes_per_second: float
    link_source: str  # "loopback" or "--bandwidth"
    wire_seconds: dict[int, tuple[float, float]]  # fw bits -> (forward, backward) seconds per micro-batch
    recommended_bits: int
    link_bound: bool  # even the fewest bits leave the link slower than compute
    tied: TiedNeeds | None = None  # what keeping a tied table one tensor sends per step (the capacity plan's)
    first_sight_bytes: int = 0  # one micro-batch's forward message when its samples are all first sights
    run_bytes: tuple[int, int] = (0, 0)  # link bytes of the whole run on one replica, and with lossless links
    gpu_sharing: str | None = None  # ranks sharing a GPU: with NVIDIA MPS or time-slicing (aqpipe.launch.gpu_sharing)


def _time(fn, device: torch.device, repeats: int = REPEATS) -> float:
    """Median seconds of `fn()` after a warm-up — on a GPU two calls, the second capturing a codec's CUDA graph —
    (the GPU synchronized around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    if device.type == "cuda":
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stage_compute_seconds(plan: RunPlan, device: torch.device, link_shape: tuple[int, ...] | None) -> list[float]:
    """Forward + backward of one micro-batch on each stage, built one at a time (its weights only)."""
    cfg = plan.cfg
    batch = plan.first_micro_batch()
    mask = None if batch["mask"] is None else batch["mask"].to(device)
    seconds = []
    for s in range(cfg.pp):
        module = plan.build_stage(s).to(device).train()
        if s == 0:
            assert batch["inputs"] is not None
            inputs = batch["inputs"].to(device)
        else:
            assert link_shape is not None
            inputs = torch.randn(link_shape, device=device, requires_grad=True)
        targets = batch["targets"].to(device) if s == cfg.pp - 1 and batch["targets"] is not None else None

        def step(module=module, inputs=inputs, targets=targets) -> None:
            with autocast(device, cfg.precision):
                out = module(inputs, mask)
                loss = plan.spec.loss(out, targets) if targets is not None else out.float().square().mean()
            if loss.requires_grad:
                loss.backward()
            module.zero_grad(set_to_none=True)

        seconds.append(_time(step, device))
        del module
    return seconds


def codec_speeds(cfg: ResolvedConfig, shape: tuple[int, ...], device: torch.device) -> dict[str, float]:
    """GB/s of a [shape] fp32 activation through encode + decode for the candidate codecs on `device`."""
    options = QuantOptions.of(cfg)
    x = torch.randn(shape, device=device)
    ids = torch.arange(shape[0])
    speeds = {}
    coded_first = [] if cfg.first_sight_spec.lossless else [cfg.first_sight_spec]
    links = [candidate_links(bits) for bits in FW_BITS]
    for spec in [CodecSpec("fp32"), *[fw for fw, _ in links], *[bw for _, bw in links], CodecSpec("rtq", 4),
                 *coded_first]:
        if str(spec) in speeds:
            continue
        if spec.keeps_messages:
            send, recv = memory_store(torch.float16, device), memory_store(torch.float16, device)
            sender = build_codec(spec, "fw", StoreView(send, 0, "send"), options, device=device)
            receiver = build_codec(spec, "fw", StoreView(recv, 0, "recv"), options, device=device)
            first = sender.encode(x, ids, compress=True)  # seeds m(ξ) on both sides: every later visit is a delta
            receiver.decode(Header.for_encoded(first, sender.code), first.payload, ids)
        else:
            sender = receiver = build_codec(spec, "fw", options=options, device=device)

        def round_trip(sender=sender, receiver=receiver) -> None:
            encoded = sender.encode(x, ids, compress=True)
            receiver.decode(Header.for_encoded(encoded, sender.code), encoded.payload, ids)
            receiver.settle()  # (a GPU receiver's checksum check, made when its sums arrive)

        speeds[str(spec)] = x.numel() * 4 / _time(round_trip, device) / 1e9
    return speeds


def loopback_rate(nbytes: int = 64 << 20) -> float:
    """Bytes/s one TCP stream achieves over this host's loopback (a receiving thread drains it)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = [0]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received[0] += len(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    block = b"\0" * (1 << 20)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        for _ in range(nbytes // len(block)):
            conn.sendall(block)
    reader.join()
    server.close()
    return received[0] / (time.perf_counter() - start)


def recommend(link: LinkNeeds, cfg: ResolvedConfig, rate: float, compute: float, rows: RowShapes = EVERY_POSITION
              ) -> tuple[int, bool, dict[int, tuple[float, float]]]:
    """The highest fw bits whose wire time per micro-batch on the busiest rank's link fits within `compute` seconds;
    whether even the fewest bits leave the link the bottleneck; and the wire times (forward, backward) per candidate.
    Each rank is behind a link of its own: with two stages each sends one direction, but a middle stage sends its
    activations forward and its gradients backward over its link, at once under 1F1B, which the advice sets
    (`aqpipe.runtime.capacity.step_wire`; a tied table's rows on the end stages' links are left out). A micro-batch's
    messages are as `rows` says they travel (over real rows, the mean of the first steps' micro-batches)."""
    options = QuantOptions.of(cfg)
    dtype = getattr(torch, link.activation_dtype)
    shape = link.activation_shape

    def message(spec: CodecSpec, direction: str, dtype: torch.dtype) -> int:
        def coded(s: tuple[int, ...]) -> int:
            return steady_payload_bytes(spec, direction, s, dtype, options)
        return rows.step_bytes(coded, shape, 1)

    wire, busiest = {}, {}
    for bits in FW_BITS:
        fw_spec, bw_spec = candidate_links(bits)
        fw, bw = message(fw_spec, "fw", dtype), message(bw_spec, "bw", torch.float32)
        wire[bits] = (fw / rate, bw / rate)
        busiest[bits] = links_seconds(rank_traffic([(fw, bw)] * (cfg.pp - 1)), 8 * rate, overlapped=True)
    fitting = [b for b in FW_BITS if busiest[b] <= compute]
    return (fitting[0], False, wire) if fitting else (FW_BITS[-1], True, wire)


def run_bench(plan: RunPlan, bandwidth_bits: int | None) -> BenchResult:
    """Measure everything for this plan on its device."""
    cfg = plan.cfg
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    capacity = plan_capacity(plan)
    link = capacity.links[0] if capacity.links else None
    seconds = stage_compute_seconds(plan, device, link.activation_shape if link else None)
    speeds = codec_speeds(cfg, link.activation_shape, device) if link else {}
    rate, source = loopback_rate(), "loopback"
    if bandwidth_bits is not None and bandwidth_bits / 8 < rate:
        rate, source = bandwidth_bits / 8, "--bandwidth"
    sharing = local_sharing_note(cfg.device, cfg.world_size)
    if link is None:
        return BenchResult(seconds, speeds, 0, rate, source, {}, 8, False, capacity.tied, gpu_sharing=sharing)
    bits, bound, wire = recommend(link, cfg, rate, max(seconds), row_shapes(plan))
    return BenchResult(seconds, speeds, 4 * int(torch.Size(link.activation_shape).numel()), rate, source, wire, bits,
                       bound, capacity.tied, link.first_fwd_bytes // cfg.micro_batches, capacity.run_link_bytes(),
                       sharing)


def format_bench(result: BenchResult, cfg: ResolvedConfig) -> str:
    """The report `aqpipe bench` prints."""
    lines = [f"bench: {cfg.model}, --pp {cfg.pp}, micro-batch {cfg.micro_batch_size} x {cfg.seq_len} tokens on "
             f"{cfg.device}, --precision {cfg.precision}{', --recompute' if cfg.recompute else ''}"
             f"{f', --lora {cfg.lora}' if cfg.lora else ''}", "",
             "stage  forward+backward per micro-batch"]
    lines += [f"{s:<6} {t * 1e3:9.1f} ms" for s, t in enumerate(result.stage_seconds)]
    if result.gpu_sharing:  # the stage times above are each alone on the GPU; the run's ranks share it
        lines += ["", f"gpu: {result.gpu_sharing}"]
    if result.codec_gbps:
        lines += ["", "codec        encode+decode (GB/s of activation)"]
        lines += [f"{spec:<12} {gbps:8.3g}" for spec, gbps in result.codec_gbps.items()]
    source = "one TCP stream over this host's loopback" if result.link_source == "loopback" else "--bandwidth"
    lines += ["", f"link: {result.link_bytes_per_second * 8 / 1e6:,.0f} Mbit/s ({source})"]
    if result.tied is not None:
        seconds = result.tied.step_bytes / result.link_bytes_per_second
        lines.append(format_tied(result.tied, cfg) + f"; {seconds:.2f} s per step on this link")
    if result.wire_seconds:
        slowest = max(result.stage_seconds)

        def codec_ms(spec: str) -> float:
            gbps = result.codec_gbps.get(spec, 0.0)
            return result.activation_bytes / (gbps * 1e9) * 1e3 if gbps > 0 else float("nan")

        lines += ["", f"fw/bw bits            wire per micro-batch fwd / bwd   codecs fwd / bwd   (slowest stage computes "
                      f"{slowest * 1e3:.1f} ms)"]
        lines += [f"aqsgd:{b} directq:{min(2 * b, 8):<2} {f * 1e3:12.1f} / {w * 1e3:<8.1f} ms   "
                  f"{codec_ms(f'aqsgd:{b}'):7.1f} / {codec_ms(f'directq:{min(2 * b, 8)}'):<6.1f} ms"
                  f"{'   <- recommended' if b == result.recommended_bits else ''}"
                  for b, (f, w) in result.wire_seconds.items()]
        if result.first_sight_bytes and cfg.keeps_messages and cfg.warmup_epochs == 0:
            lines.append(f"first sights (--first-sight {cfg.first_sight}, --warmup-epochs 0): "
                         f"{result.first_sight_bytes / 1e6:.3g} MB, "
                         f"{result.first_sight_bytes / result.link_bytes_per_second * 1e3:.1f} ms per micro-batch fwd")
        sent, lossless = result.run_bytes
        if sent:
            lines.append(f"over the run: {sent / 1e6:,.1f} MB on the links of a replica with --fw {cfg.fw} --bw {cfg.bw}, "
                         f"{lossless / sent:.2f}x fewer than lossless links")
        b = result.recommended_bits
        advice = (f"recommended: --fw aqsgd:{b} --bw directq:{min(2 * b, 8)}"
                  + (" (the link stays the bottleneck even at 2 bits: expect link-bound steps)" if result.link_bound
                     else " (the link keeps up with compute)"))
        lines += ["", advice]
    return "\n".join(lines)
