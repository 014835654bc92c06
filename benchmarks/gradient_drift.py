"""How a sample's activation gradient at a stage boundary moves between its visits, and whether AQ-SGD's idea would
pay in the backward direction.

    python benchmarks/gradient_drift.py --out benchmarks/results/gradient-drift [--samples 160] [--epochs 3]

AQ-SGD codes a forward activation as its change since the sample's last visit, which is small because the weights
upstream move little between visits. The gradient sent back at a boundary, ∂L/∂a, depends on the weights downstream
and on what the model still gets wrong about the sample, which training changes on purpose. This fine-tunes the
SmolLM2 benchmark's pipeline (SmolLM2-135M-Instruct split 11,10,8,3 as `benchmarks/llm_finetune.py` splits it, the
built-in instruction set, AdamW at lr 2e-5 after 5 warm-up steps, clip 1.0, 16 conversations a step) in fp32 in one
process, keeps every sample's gradient at the three boundaries at each visit (its real tokens only), and reports
per epoch, as means over samples and boundaries:

- the change ‖g_t − g_{t−1}‖/‖g_t‖ and the cosine between consecutive visits' gradients;
- the error a gradient arrives with, ‖g − ĝ‖/‖g‖: coded alone by rotated tiles at B bits (`rtq:B`, what
  `--bw rtq:B` sends) against coded as its change since the receiver's copy m of the last visit's decoded
  gradient, m + deQ(Q(g − m)) (what a backward AQ-SGD would send at the same bits).

Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from aqpipe.compress.link.options import QuantOptions  # noqa: E402
from aqpipe.compress.link.sample_coders import RotatedCoder  # noqa: E402
from aqpipe.config import RunConfig, resolve  # noqa: E402
from aqpipe.pipeline.numerics.optim import lr_factor  # noqa: E402
from aqpipe.runtime.plan import make_plan  # noqa: E402
from benchmarks.provenance import machine, recorded  # noqa: E402

BITS = (2, 3, 4)


def coded(coder: RotatedCoder, values: torch.Tensor) -> torch.Tensor:
    """What `values` [tokens, C] decode to after rotated-tile coding."""
    shape = (1, *values.shape)
    rows, _ = coder.encode(values.reshape(shape))
    return coder.decode(rows, shape).view(values.shape)


def relative(error: torch.Tensor, truth: torch.Tensor) -> float:
    return float(error.norm() / truth.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/gradient-drift")
    parser.add_argument("--samples", type=int, default=160)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    plan = make_plan(resolve(RunConfig(model="smollm2-135m", data="builtin-instruct", pp=4, partition="11,10,8,3",
                                       seq_len=96, max_samples=args.samples, micro_batch_size=args.batch,
                                       micro_batches=1, device="cpu", seed=args.seed,
                                       out="/tmp/aqpipe-gradient-drift")))
    train, stages = plan.dataset.train, [plan.build_stage(k).train() for k in range(4)]
    params = [p for stage in stages for p in stage.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * (len(train) // args.batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, 5, total))
    coders = {b: RotatedCoder(b, QuantOptions()) for b in BITS}
    last: dict[tuple[int, int], torch.Tensor] = {}  # (boundary, sample) -> its gradient at the last visit
    copies: dict[tuple[int, int, int], torch.Tensor] = {}  # (bits, boundary, sample) -> the receiver's m
    stats: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    order = torch.Generator().manual_seed(args.seed)
    for epoch in range(1, args.epochs + 1):
        for ids in torch.randperm(len(train), generator=order)[: total // args.epochs * args.batch].split(args.batch):
            x, mask = train.inputs(ids), train.mask(ids)
            outputs = []
            for k, stage in enumerate(stages):
                x = stage(x, mask)
                if k < 3:
                    x.retain_grad()
                    outputs.append(x)
            loss = plan.spec.loss(x, train.targets(ids))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            for boundary, out in enumerate(outputs):
                for row, sample in enumerate(ids.tolist()):
                    real = mask[row].bool() if mask is not None else slice(None)
                    g = out.grad[row][real].detach().clone()
                    key = (boundary, sample)
                    if key in last:
                        stats[epoch]["change"].append(relative(g - last[key], g))
                        stats[epoch]["cosine"].append(float(torch.nn.functional.cosine_similarity(
                            g.reshape(-1), last[key].reshape(-1), dim=0)))
                    for bits, coder in coders.items():
                        direct = coded(coder, g)
                        stats[epoch][f"direct{bits}"].append(relative(g - direct, g))
                        m = copies.get((bits, boundary, sample))
                        if m is None:  # a first sight: coded alone, and the copies seeded with it
                            copies[(bits, boundary, sample)] = direct
                            continue
                        new = m + coded(coder, g - m)
                        stats[epoch][f"delta{bits}"].append(relative(g - new, g))
                        copies[(bits, boundary, sample)] = new
                    last[key] = g
        print(f"epoch {epoch}: loss {float(loss):.4f}", {k: round(sum(v) / len(v), 4) for k, v in stats[epoch].items()},
              flush=True)
    table = {epoch: {k: sum(v) / len(v) for k, v in row.items()} for epoch, row in stats.items()}
    result = {"settings": recorded(vars(args)), "machine": machine(), "epochs": table}
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    head = ("| epoch | change ‖g_t − g_t−1‖/‖g_t‖ | cos(g_t, g_t−1) | "
            + " | ".join(f"error rtq:{b} / delta {b}-bit" for b in BITS) + " |")
    lines = [head, "|" + "---|" * (3 + len(BITS))]
    for epoch, row in table.items():
        if "change" not in row:
            continue
        cells = " | ".join(f"{row[f'direct{b}']:.3f} / {row[f'delta{b}']:.3f}" for b in BITS)
        lines.append(f"| {epoch} | {row['change']:.3f} | {row['cosine']:+.3f} | {cells} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
