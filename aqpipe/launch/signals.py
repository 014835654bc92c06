"""Ctrl-C and SIGTERM in the launcher: one interrupt path from the first moment, and teardown that finishes.

The contract is exit 1 with one line and nothing left behind whenever a launch is interrupted: during start-up,
namespace setup, the run, or its cleanup. SIGINT and SIGTERM therefore both raise KeyboardInterrupt (even when
the parent shell started us with SIGINT ignored), and while cleanup runs further signals are noted, not raised.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def _raise(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def interrupts_raise() -> None:
    """From now on SIGINT and SIGTERM raise KeyboardInterrupt in the main thread."""
    for sig in INTERRUPTS:
        signal.signal(sig, _raise)


def ignore_interrupts() -> None:
    """SIGINT and SIGTERM do nothing from now on (a process that is already on its way out after an interrupt)."""
    for sig in INTERRUPTS:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[int]]:
    """Run a cleanup block that SIGINT/SIGTERM cannot cut short; the signals received meanwhile are listed in the
    yielded list, and the previous handlers come back afterwards (a pending interrupt is not re-raised: the
    cleanup it asked for is what just ran)."""
    received: list[int] = []
    try:
        previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in INTERRUPTS}
    except ValueError:  # not the main thread: signals are not ours to manage here
        yield received
        return
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` prints every thread's Python stack to stderr (a run that seems stuck says where it is)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr is not a real file (captured, embedded): no dumps
            pass
