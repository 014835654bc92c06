"""Whether this process can fork a rank soundly: no CUDA context, no initialised CUDA driver, and no thread but
those whose library makes a fork beside them sound (a fork copies every lock a thread held, not the thread).
The fork server (`forkserver`) asks before each fork."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from pathlib import Path

# Native threads that are sound to fork beside, by the name the kernel shows: the library itself quiesces them
# before fork() and resets them in the child. jemalloc's background purging thread (its pthread_atfork handlers
# take every allocator lock, and the child starts with background threads off); an image that preloads jemalloc
# with background_thread:true has one in every process, the fork server included.
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})


def unsafe_to_fork() -> str | None:
    """Why forking now would hand the rank a broken process, or None."""
    if cuda_initialised():
        return "a CUDA context exists in the fork server"
    if cuda_driver_initialised():
        return "an import initialised the CUDA driver in the fork server"
    threads = native_threads()
    if threads > 1:
        listed = other_threads()
        unsafe = [name for name, is_python in listed if not fork_safe(name, is_python)]
        if not unsafe and len(listed) == threads - 1:
            return None
        # a thread that ended or began between the two listings is counted as unsafe: the check is run again
        count = max(len(unsafe), threads - 1 - (len(listed) - len(unsafe)))
        return (f"an import started {count} thread(s) in the fork server ({', '.join(unsafe) or 'unnamed'}), and a "
                f"fork would copy their locks")
    return None


def native_threads() -> int:
    """How many threads this process has (Python's and native ones: OpenMP, tokenizers, CUDA's)."""
    return len(os.listdir("/proc/self/task"))


def other_threads() -> list[tuple[str, bool]]:
    """This process's threads other than the calling one, as (name, is a Python thread): a Python thread's own name,
    else the kernel's (a native library's thread is often named for it: OpenMP's, a CUDA library's, jemalloc's)."""
    python = {t.native_id: t.name for t in threading.enumerate()}
    threads = []
    for task in sorted(os.listdir("/proc/self/task"), key=int):
        if int(task) == threading.get_native_id():
            continue
        if int(task) in python:
            threads.append((python[int(task)], True))
            continue
        try:
            threads.append((Path(f"/proc/self/task/{task}/comm").read_text().strip(), False))
        except OSError:  # it ended meanwhile
            pass
    return threads


def fork_safe(name: str, is_python: bool) -> bool:
    """Whether a thread is one its own library makes sound to fork beside: a native thread named in
    FORK_SAFE_THREADS (a Python thread of that name is not jemalloc's)."""
    return not is_python and name in FORK_SAFE_THREADS


def fork() -> int:
    """os.fork, without Python 3.12's warning that a multi-threaded process forks: the only threads a fork is let
    beside are FORK_SAFE_THREADS, which their library quiesces around fork() itself."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is multi-threaded, use of fork\(\) may lead to deadlocks",
                                category=DeprecationWarning)
        return os.fork()


def cuda_initialised() -> bool:
    """Whether torch has created a CUDA context in this process (False when torch is not even imported)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


CUDA_ERROR_NOT_INITIALIZED = 3


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (cuInit), asked without initialising it. A mapped driver
    library alone is sound to fork: a CUDA build of torch maps libcuda.so at `import torch` (it preloads its CUDA
    libraries), and a child initialises the driver for itself. An initialised driver is not: its state does not
    survive a fork. A library that cannot be asked counts as initialised."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "libcuda.so" in line), None)
    return path is not None and _driver_initialised(path)


def _driver_initialised(path: str) -> bool:
    """Ask the driver library at `path`, already mapped (RTLD_NOLOAD: never loaded here), whether cuInit has run:
    before it, every driver call answers CUDA_ERROR_NOT_INITIALIZED."""
    try:
        driver = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        context = ctypes.c_void_p()
        return driver.cuCtxGetCurrent(ctypes.byref(context)) != CUDA_ERROR_NOT_INITIALIZED
    except (OSError, AttributeError):
        return True
