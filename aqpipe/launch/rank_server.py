"""The rank fork server itself (launch/forkserver.py is the launcher's handle on it): a process that imports what
ranks need once, then forks a rank for every request of the launcher until the launcher closes the socket.

It runs as `python -m aqpipe.launch.rank_server`, as a fork of the launcher, or as one more run of a user's script
stopped at `aqpipe.train` (`serve_script`). A forked rank takes its environment, process group, network namespace
and output pipe from the request, and dies with the server.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from aqpipe import lifetime
from aqpipe.launch.fork_safety import fork, unsafe_to_fork
from aqpipe.lifetime import PARENT_ENV, die_with

MAX_MESSAGE = 1 << 20  # a rank's environment with its resolved configuration is a few KiB
_CLONE_NEWNET = 0x40000000
_PR_SET_NAME = 15

def _libc() -> ctypes.CDLL:
    return ctypes.CDLL("libc.so.6", use_errno=True)


def import_for_ranks(modules: list[str], run: dict | None = None) -> None:
    """Import `modules` and what the ranks of `run` import, then take all that from the garbage collector's view."""
    if run is not None:
        from aqpipe.launch.worker_entry import rank_imports

        modules = [*modules, *rank_imports(**run)]
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the rank imports it again and reports the error where it belongs
            pass
    # Modules live as long as the process (the launcher, the server and its ranks; in a script's run, also what the
    # script built before aqpipe.train, which its ranks keep as the script would): a full collection walking them (a
    # quarter of a second after importing torch and a model's code) finds nothing, and in a forked rank it also
    # writes to, and so copies, every page of them it shares with the server.
    gc.freeze()


def serve(sock: socket.socket, preload: list[str], run: dict | None = None) -> None:
    """Import `preload` and what the ranks of `run` need, then fork a rank for every request until the launcher
    closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with(int(os.environ[PARENT_ENV]))
    import_for_ranks(preload, run)
    sock.send(json.dumps({"ready": True}).encode())
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # a Python handler, so SIGCHLD wakes the select
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _report_exits(sock)
        if sock.fileno() not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            return  # the launcher is done (or gone): its ranks have ended, or die with this process
        request = json.loads(data)
        if not fds:
            sock.send(json.dumps({"rank": request.get("rank"), "error": "no output pipe came with the request"}).encode())
            continue
        why = unsafe_to_fork()
        if why is not None:
            os.close(fds[0])
            sock.send(json.dumps({"rank": request["rank"], "unsafe": why}).encode())
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = fork()
        if pid == 0:
            for fd in (wake_read, wake_write):
                os.close(fd)
            sock.close()
            _become_rank(request, fds[0])
        # Its own process group, set here too so that it exists before the launcher learns the pid (the launcher
        # stops a rank and whatever it started by signalling the group): whichever side runs first sets it.
        _own_group(pid)
        os.close(fds[0])
        sock.send(json.dumps({"rank": request["rank"], "pid": pid}).encode())


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        try:
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            return


def _become_rank(request: dict, output: int) -> None:
    """In the forked child: become rank `request["rank"]` and run it; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with(int(request["env"][PARENT_ENV]))  # no child outlives its server, whatever it runs
        _own_group(0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(output)
        # New stream objects on the pipe: the ones inherited may have been replaced (a caller's redirect, a test's
        # capture) and would not write to fd 1 and 2.
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        name = f"aqpipe-rank-{request['rank']}"[:15].encode()  # what ps -o comm and top show
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
        if request["netns"] is not None:
            enter_namespace(request["netns"])
        module, function = request["target"].split(":")
        result = getattr(importlib.import_module(module), function)()
        code = result if isinstance(result, int) else 0 if result is None else 1
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 - whatever happens, this process must not return into the server's loop
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _own_group(pid: int) -> None:
    """Make `pid` (0: this process) the leader of a process group of its own; a no-op once it is."""
    try:
        os.setpgid(pid, 0)
    except (PermissionError, ProcessLookupError):  # the child set it and went on (or already ended)
        pass


def enter_namespace(name: str) -> None:
    """Move this process into the named network namespace (what `ip netns exec NAME` does before it execs)."""
    path = Path("/run/netns") / name
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


_script_spec_factory = None  # the spec factory a script stopped in serve_script gave


def script_call() -> int | None:
    """In a script's run started by `ForkServer.for_script`: which of its calls of `aqpipe.train` (1, 2, …) is to
    serve the ranks (the calls before it return at once: their runs are done); None in any other process."""
    return None if lifetime.script_server is None else lifetime.script_server["call"]


def serve_script(spec_factory) -> NoReturn:
    """In a script started by `ForkServer.for_script`, at the call of `aqpipe.train(spec_factory, ...)` it is to
    stop at (`script_call`): serve the launcher's ranks, each running `spec_factory`, until the launcher is done;
    then end the process (what follows the call in the script is for the command that started the run)."""
    global _script_spec_factory
    given = lifetime.script_server
    assert given is not None, "serve_script runs only in a script's run started by ForkServer.for_script"
    _script_spec_factory = spec_factory
    os.environ[PARENT_ENV] = str(given["parent"])  # (serve's die_with; the ranks get the launcher's environment)
    try:
        serve(socket.socket(fileno=given["socket"]), [], given["run"])
    except BaseException:  # noqa: BLE001 - the launcher learns that the server ended; here is why
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _run_script_rank() -> int:
    """What a rank forked from a script runs: the rank, of the spec factory the script gave."""
    from aqpipe.launch.worker_entry import run_rank

    return run_rank(_script_spec_factory)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), sys.argv[3:], json.loads(sys.argv[2]))
    os._exit(0)  # nothing to flush or close: tearing down the imported modules would only delay the launcher
