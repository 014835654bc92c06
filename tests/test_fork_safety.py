"""Whether the fork server may fork a rank: a CUDA context or an initialised CUDA driver forbids it, a mapped but
uninitialised driver does not; threads forbid it unless their library makes a fork beside them sound (jemalloc's),
and the refusal names them."""

import io
import sys
from types import SimpleNamespace

from aqpipe.launch import fork_safety


def test_a_cuda_context_in_the_server_forbids_a_fork(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: True)))
    assert "CUDA context" in fork_safety.unsafe_to_fork()


def _maps_with_the_cuda_driver(monkeypatch):
    """This process's memory map as a CUDA build of torch leaves it at import: the driver's library mapped."""
    line = "7f0000000000-7f0000001000 r-xp 00000000 00:00 0 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04\n"
    real = open

    def fake_open(path, *args, **kwargs):
        return io.StringIO(line) if path == "/proc/self/maps" else real(path, *args, **kwargs)

    monkeypatch.setattr(fork_safety, "open", fake_open, raising=False)
    monkeypatch.setattr(fork_safety, "native_threads", lambda: 1)


def test_a_cuda_driver_mapped_but_not_initialised_allows_a_fork(monkeypatch):
    """torch 2.11's CUDA build maps libcuda.so at `import torch` (its CUDA libraries are preloaded): on a GPU machine
    the fork server refused every fork, and ranks started as fresh processes. Only an initialised driver (cuInit)
    makes a fork unsound."""
    _maps_with_the_cuda_driver(monkeypatch)
    monkeypatch.setattr(fork_safety, "_driver_initialised", lambda path: False, raising=False)
    assert fork_safety.unsafe_to_fork() is None


def test_an_initialised_cuda_driver_forbids_a_fork(monkeypatch):
    _maps_with_the_cuda_driver(monkeypatch)
    monkeypatch.setattr(fork_safety, "_driver_initialised", lambda path: True)
    assert "initialised the CUDA driver" in fork_safety.unsafe_to_fork()


def test_a_driver_that_cannot_be_asked_counts_as_initialised(monkeypatch):
    """The library named in the map cannot be opened (here: no such file): the server assumes the worst."""
    _maps_with_the_cuda_driver(monkeypatch)
    assert fork_safety.cuda_driver_initialised() is True


def test_the_refusal_names_the_threads_that_make_a_fork_unsafe():
    """On a GPU machine an import started a thread in the fork server; the note must say which, so that the import
    can be found (the kernel's thread name, as `ps -L` shows it)."""
    import threading as _threading

    stop = _threading.Event()
    worker = _threading.Thread(target=stop.wait, name="probe-thread", daemon=True)
    worker.start()
    try:
        why = fork_safety.unsafe_to_fork()
        assert why is not None and "probe-thread" in why and "started" in why
        assert [name for name, _ in fork_safety.other_threads()].count("probe-thread") == 1
    finally:
        stop.set()
        worker.join()


def test_a_jemalloc_background_thread_does_not_stop_a_fork(monkeypatch):
    """Where an image preloads jemalloc, its background purging thread is the one thread in the fork server.
    jemalloc quiesces and resets it around fork() itself (its pthread_atfork handlers), so it does
    not make a fork unsound; any other thread beside it still does, and only that one is named. The name must be
    the kernel's: a Python thread that calls itself that is not jemalloc's."""
    monkeypatch.setattr(fork_safety, "native_threads", lambda: 2)
    monkeypatch.setattr(fork_safety, "other_threads", lambda: [("jemalloc_bg_thd", False)])
    assert fork_safety.unsafe_to_fork() is None
    monkeypatch.setattr(fork_safety, "native_threads", lambda: 3)
    monkeypatch.setattr(fork_safety, "other_threads", lambda: [("jemalloc_bg_thd", False), ("OMP worker", False)])
    why = fork_safety.unsafe_to_fork()
    assert why is not None and "1 thread(s)" in why and "OMP worker" in why and "jemalloc" not in why
    monkeypatch.setattr(fork_safety, "native_threads", lambda: 2)
    monkeypatch.setattr(fork_safety, "other_threads", lambda: [("jemalloc_bg_thd", True)])
    assert "1 thread(s)" in fork_safety.unsafe_to_fork()


def test_a_thread_that_ends_between_the_two_listings_still_refuses_the_fork(monkeypatch):
    """Two threads counted, one listed (the other ended meanwhile): the count says two, not zero."""
    monkeypatch.setattr(fork_safety, "native_threads", lambda: 3)
    monkeypatch.setattr(fork_safety, "other_threads", lambda: [("jemalloc_bg_thd", False)])
    assert "started 1 thread(s)" in fork_safety.unsafe_to_fork()
    monkeypatch.setattr(fork_safety, "other_threads", lambda: [])
    assert "started 2 thread(s) in the fork server (unnamed)" in fork_safety.unsafe_to_fork()


def test_a_fork_beside_a_safe_thread_does_not_warn(monkeypatch):
    """Python 3.12 warns on every fork of a multi-threaded process; beside jemalloc's thread that is each rank's
    launch printing a false alarm."""
    import warnings

    def warning_fork():
        warnings.warn("This process (pid=1) is multi-threaded, use of fork() may lead to deadlocks in the child.",
                      DeprecationWarning, stacklevel=2)
        return 4242

    monkeypatch.setattr(fork_safety.os, "fork", warning_fork)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert fork_safety.fork() == 4242
        warnings.warn("another deprecation", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["another deprecation"]
