"""Several ranks on one GPU: whether NVIDIA's Multi-Process Service (MPS) is running, and what to tell a user whose
ranks would otherwise time-slice the GPU.

Without MPS, every rank's process has a CUDA context of its own and the GPU runs one context at a time, switching
between them: four ranks on one GPU take turns rather than overlap, however small their kernels. With the MPS
control daemon running (`nvidia-cuda-mps-control -d`, as the GPU's owner), the ranks' kernels share the GPU's
multiprocessors at once. The daemon is found by its control pipe, without touching CUDA (the launcher must not
initialise it before it forks its ranks).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PIPE_DIRECTORY_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
START_MPS = "nvidia-cuda-mps-control -d"


def mps_running() -> bool:
    """Whether an MPS control daemon listens for this process's CUDA clients (its control pipe exists)."""
    control = Path(os.environ.get(PIPE_DIRECTORY_ENV) or DEFAULT_PIPE_DIRECTORY) / "control"
    try:
        return stat.S_ISFIFO(control.stat().st_mode)
    except OSError:
        return False


def ranks_per_gpu(local_ranks: int, gpus: int) -> int:
    """The most ranks any one GPU holds (rank r runs on GPU r mod gpus)."""
    return -(-local_ranks // gpus) if gpus > 0 else 0


def local_sharing_note(device: str, world_size: int) -> str | None:
    """`sharing_note` for this machine: its ranks (LOCAL_WORLD_SIZE under torchrun, else every rank of a local
    launch) over its GPUs, counted as torch counts them (through NVML where the launcher asks it to: no context)."""
    if device != "cuda":
        return None
    import torch

    return sharing_note(device, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), torch.cuda.device_count())


def sharing_note(device: str, local_ranks: int, gpus: int, mps: bool | None = None) -> str | None:
    """What to tell a user whose ranks share a GPU (None when none do): with MPS their kernels overlap, without it
    their contexts take turns, and how to start it."""
    shared = ranks_per_gpu(local_ranks, gpus)
    if device != "cuda" or shared <= 1:
        return None
    if mps_running() if mps is None else mps:
        return f"{shared} ranks share each GPU through NVIDIA MPS (their kernels run side by side)"
    return (f"{shared} ranks share each GPU without NVIDIA MPS: their CUDA contexts take turns on it (time-slicing); "
            f"`{START_MPS}` before the launch lets their kernels run side by side (README: several ranks on one GPU)")
