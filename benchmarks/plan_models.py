"""Planning models before downloading them: `aqpipe launch --dry-run` on checkpoint directories holding only the real
config.json of Qwen3-8B and Gemma-3-12B (text), over 8 stages, full fine-tuning in fp32 and LoRA r=8 in bf16 with
recomputation: memory per stage, bytes per step on the links, and whether the run fits this machine (exit 0) or is
refused (exit 2, with the numbers).

    python benchmarks/plan_models.py --out benchmarks/results/plan-models

Writes <out>.json (each plan's text and exit code) and <out>.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The models' published config.json values (text model of Gemma 3 12B).
CONFIGS = {
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                               max_position_embeddings=40960, tie_word_embeddings=False, rms_norm_eps=1e-6)),
    "gemma-3-12b": ("gemma3_text", dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                                        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=256, sliding_window=1024, query_pre_attn_scalar=256,
                                        max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-6)),
}
VARIANTS = {"full fp32": [], "LoRA r=8, bf16, recompute": ["--lora", "8", "--precision", "bf16", "--recompute"]}
COMMON = ["--pp", "8", "--seq-len", "1024", "--micro-batch-size", "1", "--micro-batches", "8", "--max-samples", "256",
          "--data", "builtin-instruct", "--dry-run"]


def save_config(kind: str, values: dict, directory: Path) -> None:
    from aqpipe.stages.llama import FAMILIES

    FAMILIES[kind].config_class()(**values).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan-models"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for name, (kind, values) in CONFIGS.items():
            directory = Path(work) / name
            save_config(kind, values, directory)
            for variant, flags in VARIANTS.items():
                proc = subprocess.run([sys.executable, "-m", "aqpipe", "launch", "--model", str(directory), *COMMON,
                                       *flags, "--out", str(Path(work) / "run")], capture_output=True, text=True,
                                      cwd=ROOT)
                plan = proc.stdout.replace(str(directory), name)
                results.append({"model": name, "variant": variant, "exit": proc.returncode, "plan": plan,
                                "error": proc.stderr.strip().splitlines()[-1:] if proc.returncode else []})
                print(f"== {name}, {variant}: exit {proc.returncode}\n{plan}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = []
    for r in results:
        lines += [f"### {r['model']}, {r['variant']} (exit {r['exit']})", "", "```", r["plan"].strip(), "```", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
