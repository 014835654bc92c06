"""What the store tests share: a GPU's queued copy of m(ξ) to the host, stood in for on the host."""

from types import ModuleType


class QueuedCopy:
    """A stand-in for a GPU's queued copy to the host: counts the waits for it."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def queued_copies(monkeypatch, module: ModuleType, *gpu_checks: str) -> list[QueuedCopy]:
    """Make `module`'s stores take the path of a GPU's values (here: host values): each of its `gpu_checks` says
    yes, and each copy to the host is a `QueuedCopy`; returns the copies, in order."""
    queued: list[QueuedCopy] = []

    def queue_copy(batch):
        queued.append(QueuedCopy())
        return batch.clone(), queued[-1]

    for check in gpu_checks:
        monkeypatch.setattr(module, check, lambda *args: True)
    monkeypatch.setattr(module, "to_host", queue_copy)
    return queued
