"""A rank's checkpoint copies' process forked from the rank itself (`prefork`), before the rank meets the others
and while it holds no thread, so that it starts with the rank's imports instead of importing torch again in an
interpreter of its own (`copier` starts one of those where no process was forked). It waits for its part of the run
(what a started one reads from its command line, and the rank's environment as the copies start) on a pipe, then
runs as a started one does (`copier.serve`, which the rank hands it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aqpipe.lifetime import die_with

CLOSE_SECONDS = 30.0  # how long a rank that is done waits for its copies' process to exit before it kills it
PROCESS_NAME = b"aqpipe-copies"  # the copies' process's name, as ps -o comm and top show it (a forked one's argv is its rank's)


class ForkedCopies:
    """A copies' process `prefork` forked, as `subprocess.Popen` shows a started one: its `pid`, its orders (`stdin`,
    the first line what a started one reads from its command line), its reports (`stdout`), `wait` and `kill`."""

    def __init__(self, pid: int, stdin, stdout) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has ended (subprocess.TimeoutExpired after `timeout` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            except ChildProcessError:  # (reaped elsewhere: its code is lost, as subprocess takes it)
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"copies' process {self.pid}", timeout or 0.0)
            else:
                time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """Let it go: its orders end (it exits, unless already copying), then wait for it, killed after
        CLOSE_SECONDS."""
        for stream in (self.stdin, self.stdout):
            try:
                stream.close()
            except OSError:  # (a line it never read: the pipe is gone with it)
                pass
        try:
            self.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()


_preforked: ForkedCopies | None = None  # this rank's copies' process, forked and waiting for its first order


def prefork(fork: Callable[[], int], serve: Callable[[dict, Any, Any], None]) -> None:
    """Fork this rank's copies' process now with `fork` (os.fork where the caller found it sound: no thread, no
    CUDA), before the rank meets the others: it waits for `CheckpointCopier` to give it its part of the run, then
    runs `serve(where, orders, reports)` (`copier.serve`), or for `release_preforked` to let it go. Once, on
    Linux."""
    global _preforked
    if _preforked is not None or not sys.platform.startswith("linux"):
        return
    import torch.distributed  # noqa: F401 - imported here, once for both processes

    for stream in (sys.stdout, sys.stderr):  # (what the rank printed must not be printed again by the child)
        stream.flush()
    orders, give = os.pipe()
    take, reports = os.pipe()
    parent = os.getpid()
    pid = fork()
    if pid == 0:
        code = 0
        try:
            os.close(give)
            os.close(take)
            die_with(parent)
            for number in (signal.SIGINT, signal.SIGTERM):  # (the rank's handlers raise into its own Python)
                signal.signal(number, signal.SIG_DFL)
            try:
                Path("/proc/self/comm").write_bytes(PROCESS_NAME)
            except OSError:  # (a sandbox that forbids it: the name is only for people looking)
                pass
            stream = os.fdopen(orders, "rb")
            first = stream.readline()
            if first:  # (none: its rank needs no copies, or ended)
                where = json.loads(first)
                os.environ.clear()
                os.environ.update(where.pop("env"))
                serve(where, stream, os.fdopen(reports, "wb"))
        except BaseException:  # noqa: BLE001 - whatever happens, this process must not return into its rank's code
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(orders)
    os.close(reports)
    _preforked = ForkedCopies(pid, os.fdopen(give, "wb"), os.fdopen(take, "rb"))


def take_preforked() -> ForkedCopies | None:
    """The copies' process `prefork` forked, now this caller's (None where there is none)."""
    global _preforked
    forked, _preforked = _preforked, None
    return forked


def release_preforked() -> None:
    """Let the copies' process `prefork` forked exit, unused (a run whose ranks keep no copies)."""
    forked = take_preforked()
    if forked is not None:
        forked.close()
