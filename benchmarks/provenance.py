"""What a measurement ran on, recorded beside its numbers: the commit of the tree and the machine (CPU model, cores,
torch, Python); a GPU script adds its device's name itself."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The tree's commit ($AQPIPE_COMMIT names one exported or copied without its history, where git cannot)."""
    return os.environ.get("AQPIPE_COMMIT") or subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def recorded(value):
    """`value` (settings, summaries: dicts, lists, numbers, text, paths) as a results file records it: every path
    inside the checkout (a `Path`, or text naming one absolutely) relative to it, since the checkout's own place on a
    machine is not part of the measurement; other paths as text, the rest as it is."""
    if isinstance(value, dict):
        return {key: recorded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [recorded(item) for item in value]
    if isinstance(value, Path) or (isinstance(value, str) and value.startswith("/")):
        path = Path(value).resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(value)
    return value


def machine() -> dict:
    """The commit and this machine, as a results file records them."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if line.startswith("Model name")), platform.processor() or platform.machine())
    return {"commit": commit(), "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version()}
