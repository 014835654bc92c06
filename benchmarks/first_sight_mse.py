"""How well each first-sight coder keeps SmolLM2-135M's real hidden states, at the stage boundaries of the
fine-tuning benchmark (`llm_finetune.py`'s partition 11,10,8,3: after decoder layers 10, 20 and 28): relative squared
error ‖x − Q(x)‖² / ‖x‖² and bits per value, over the whole batch and without each sample's first token (the
attention sink, whose one massive activation — ~25,000 against ~200 for a token's whole norm elsewhere — dominates
any squared error it is in).

    python benchmarks/first_sight_mse.py --out benchmarks/results/first_sight_mse
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from aqpipe.compress.link.factory import build_codec
from aqpipe.pipeline.links.transport import Header

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.provenance import machine  # noqa: E402

BOUNDARIES = (10, 20, 28)  # hidden_states index after the embedding and this many decoder layers


def hidden_states(samples: int, seq_len: int) -> dict[int, torch.Tensor]:
    """The model's hidden states at each boundary for the first `samples` training conversations of builtin-instruct
    (question and answer, padded or cut to `seq_len` tokens)."""
    import transformers

    from aqpipe.data.builtin_instruct import builtin_instructions
    from aqpipe.stages.gguf import converted_directory
    from aqpipe.stages.models import packaged_gguf

    directory = converted_directory(packaged_gguf("smollm2-135m"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    train, _ = builtin_instructions()
    batch = tokenizer([f"{q}\n{a}" for q, a in train[:samples]], return_tensors="pt", padding="max_length",
                      truncation=True, max_length=seq_len)
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    return {layer: states[layer] for layer in BOUNDARIES}


def measure(spec: str, x: torch.Tensor, micro_batch: int = 4) -> dict:
    """`spec`'s relative squared error on `x` [B, T, C], whole and without token 0, and its bits per value."""
    codec = build_codec(spec, "fw")
    error = torch.zeros(x.shape[:2])
    payload = 0
    for start in range(0, x.shape[0], micro_batch):
        part = x[start:start + micro_batch].contiguous()
        ids = torch.arange(part.shape[0])
        encoded = codec.encode(part, ids)
        back = codec.decode(Header.for_encoded(encoded, codec.code), encoded.payload, ids)
        error[start:start + micro_batch] = (back - part).pow(2).sum(dim=2)
        payload += encoded.payload.numel()
    energy = x.pow(2).sum(dim=2)
    return {"relative_error": float(error.sum() / energy.sum()),
            "relative_error_without_token_0": float(error[:, 1:].sum() / energy[:, 1:].sum()),
            "bits_per_value": 8 * payload / x.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="directq:4,rtq:3,rtq:4,rtq:5,tahq,rtqo:3,rtqo:4")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=96, help="the fine-tuning benchmark's")
    parser.add_argument("--out", default="benchmarks/results/first_sight_mse")
    args = parser.parse_args()
    states = hidden_states(args.samples, args.seq_len)
    rows = []
    print("| codec | bits/value | " + " | ".join(f"after layer {layer}: all / without token 0" for layer in states)
          + " |")
    print("|---|---|" + "---|" * len(states))
    for spec in args.codecs.split(","):
        results = {layer: measure(spec, x) for layer, x in states.items()}
        bits = results[BOUNDARIES[0]]["bits_per_value"]
        rows.append({"codec": spec, "bits_per_value": bits, "layers": results})
        cells = [f"{r['relative_error']:.5f} / {r['relative_error_without_token_0']:.5f}" for r in results.values()]
        print(f"| {spec} | {bits:.3f} | " + " | ".join(cells) + " |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"samples": args.samples, "seq_len": args.seq_len,
                                                    "machine": machine(),
                                                    "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
