"""How a sample's activation moves between visits on the convergence benchmark, and whether that move repeats.

    python benchmarks/activation_drift.py --out benchmarks/results/activation-drift

AQ-SGD sends Q(a − m), the change since the sample's last visit. If the change of one epoch predicted the next
(a − m ≈ β·(m − m_prev)), both sides could send the change against the prediction instead, for the price of a
second stored copy. This trains the convergence benchmark's model and data (`benchmarks/convergence.py`: GPT-2
6×128 from scratch, 256 sequences of 128 byte-level tokens of WikiText-2 valid.txt, 16 per step, AdamW 1e-3 with
10 warm-up steps then linear decay, clip 1.0, 12 epochs) in fp32 in one process, records every sample's activation
at the three boundaries of the 4-stage partition at each visit, and reports per epoch (means over samples and
boundaries): the change ‖a_t − a_{t−1}‖/‖a_t‖, the cosine between consecutive changes, and what is left of the
change after the best per-sample prediction ‖Δ_t − β*·Δ_{t−1}‖/‖a_t‖ (β* fitted per sample with hindsight, so an
upper bound on what any such predictor gains). And what a general-purpose compressor would still find in coded
activations: zstd level 1's saving on each message's coded bytes (codes and scales, a message per --batch samples
of a boundary) — the first visit's activations as `--first-sight rtqo:3` codes them, every later visit's change as
AQ-SGD's 3-bit delta coder (DirectQ) codes it (the change of this uncompressed run; a real link's change is against
m(ξ), which carries that link's own coding error). Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from aqpipe.data.corpus import file_corpus
from aqpipe.data.samples import chunk
from aqpipe.data.tokenizer import train_bpe
from aqpipe.pipeline.numerics.optim import lr_factor
from aqpipe.stages.partition import partition

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.codec_speed import zstd_saving  # noqa: E402
from benchmarks.models import gpt2_6x128  # noqa: E402
from benchmarks.provenance import machine, recorded  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "wikitext-2"


def record_visits(args) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Train in fp32; return each (boundary, sample id)'s activation at every visit, in visit order."""
    torch.manual_seed(args.seed)
    tokenizer = train_bpe(file_corpus(str(args.data / "valid.txt")), 260)
    samples = chunk(tokenizer.encode((args.data / "valid.txt").read_text()), 128)
    spec = gpt2_6x128(tokenizer.vocab_size, 128)
    cuts = partition(spec, 4, "parameters")[1:-1]
    layers = [spec.build_layer(i) for i in range(len(spec))]
    params = [p for layer in layers for p in layer.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    total = args.epochs * args.samples // args.batch
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 10, total))
    visits: dict[tuple[int, int], list[torch.Tensor]] = {}
    order = torch.Generator().manual_seed(args.seed)
    for epoch in range(args.epochs):
        for ids in torch.randperm(args.samples, generator=order).split(args.batch):
            hidden = samples.inputs(ids)
            for index, layer in enumerate(layers):
                if index in cuts:
                    for row, sample in enumerate(ids.tolist()):
                        visits.setdefault((index, sample), []).append(hidden[row].detach().clone())
                hidden = layer(hidden)
            loss = spec.loss(hidden, samples.targets(ids))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
        print(f"epoch {epoch + 1}: last step's loss {loss.item():.4f}", flush=True)
    return visits


def drift_by_epoch(visits: dict[tuple[int, int], list[torch.Tensor]], epochs: int) -> list[dict]:
    """Per epoch from the third on: mean change, cosine of consecutive changes, and the best predictor's residual."""
    rows = []
    for t in range(2, epochs):
        change, cosine, residual = [], [], []
        for acts in visits.values():
            now, last, before = acts[t].double(), acts[t - 1].double(), acts[t - 2].double()
            delta, previous = now - last, last - before
            beta = float((delta * previous).sum() / (previous * previous).sum())
            change.append(float(delta.norm() / now.norm()))
            cosine.append(float((delta * previous).sum() / (delta.norm() * previous.norm())))
            residual.append(float((delta - beta * previous).norm() / now.norm()))
        rows.append(dict(epoch=t + 1, change=sum(change) / len(change), cosine=sum(cosine) / len(cosine),
                         best_residual=sum(residual) / len(residual)))
    return rows


def coded_saving(codec_spec: str, batch: torch.Tensor, message: int) -> float:
    """The share of the coded bytes zstd level 1 saves when `batch` goes under `codec_spec` (a link codec: its
    per-sample rows, codes and scales) in messages of `message` samples, each compressed on its own."""
    from aqpipe.compress.link.factory import build_codec
    from aqpipe.compress.link.options import QuantOptions

    codec = build_codec(codec_spec, "fw", options=QuantOptions())
    return zstd_saving(*(codec.encode(part, torch.arange(part.shape[0])).payload for part in batch.split(message)))


def zstd_by_epoch(visits: dict[tuple[int, int], list[torch.Tensor]], epochs: int, message: int) -> list[dict]:
    """Per epoch, zstd level 1's saving on coded activations in messages of `message` samples, the mean over the
    boundaries: the first sights (epoch 1, rtqo:3) and the changes since the last visit (later epochs, directq:3,
    AQ-SGD's delta coder)."""
    by_boundary: dict[int, list[list[torch.Tensor]]] = {}
    for (boundary, _), acts in sorted(visits.items()):
        by_boundary.setdefault(boundary, []).append(acts)
    rows = []
    for t in range(epochs):
        savings = []
        for acts in by_boundary.values():
            if t == 0:
                savings.append(coded_saving("rtqo:3", torch.stack([a[0] for a in acts]), message))
            else:
                savings.append(coded_saving("directq:3", torch.stack([a[t] - a[t - 1] for a in acts]), message))
        rows.append(dict(epoch=t + 1, coded="first sights, rtqo:3" if t == 0 else "changes, directq:3",
                         zstd1_saving=sum(savings) / len(savings)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/activation-drift"))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    visits = record_visits(args)
    rows, zstd_rows = drift_by_epoch(visits, args.epochs), zstd_by_epoch(visits, args.epochs, args.batch)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(dict(rows=rows, zstd=zstd_rows, machine=machine(),
                                                             **recorded(vars(args))), indent=1))
    lines = ["| epoch | change ‖Δ_t‖/‖a‖ | cos(Δ_t, Δ_t−1) | left after the best β·Δ_t−1 |", "|---|---|---|---|"]
    lines += [f"| {r['epoch']} | {r['change']:.3f} | {r['cosine']:+.3f} | {r['best_residual']:.3f} |" for r in rows]
    lines += ["", "| epoch | what crosses, coded | zstd level 1 would save |", "|---|---|---|"]
    lines += [f"| {r['epoch']} | {r['coded']} | {r['zstd1_saving']:.1%} |" for r in zstd_rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
