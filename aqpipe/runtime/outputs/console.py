"""What a rank prints as it trains: progress lines where no launcher draws a progress bar, and evaluation lines."""

from __future__ import annotations

import os
import sys


def print_progress(record: dict, total: int) -> None:
    """A plain progress line every so often when no launcher draws a progress bar (torchrun, DeepSpeed)."""
    if os.environ.get("AQPIPE_EVENTS") == "1":
        return
    every = max(1, total // 20)
    if record["step"] % every == 0 or record["step"] == total:
        print(f"step {record['step']}/{total}  loss {record['loss']:.4f}  {record['samples_per_second']:.1f} samples/s",
              file=sys.stderr, flush=True)


def print_eval(step: int, result: dict) -> None:
    parts = [f"eval after step {step}: loss {result['loss']:.4f}"]
    if "accuracy" in result:
        parts.append(f"accuracy {result['accuracy']:.4f}, MCC {result['mcc']:.4f}")
    if "perplexity" in result:
        parts.append(f"perplexity {result['perplexity']:.2f}")
    print(", ".join(parts), file=sys.stderr, flush=True)
