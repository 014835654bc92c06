"""Ranks forked from a process that has already imported what they need: the launcher's rank fork server.

Importing torch and a model's transformers code costs seconds of CPU. Paid once per rank, four ranks on two cores
queue behind each other before their first step. `aqpipe launch` therefore imports what its ranks need in its own
process (it plans with the same modules), forks a server from itself while it still holds one thread and no CUDA
state (`ForkServer.forked_here`), and every rank of the launch is a `fork()` of that server.

Why a server rather than forking the launcher when the ranks start: by then the launcher holds threads (its log
readers, OpenMP's pool after a capacity trace) and may hold a CUDA context, and neither survives a fork. The server
does nothing but wait, and refuses to fork if a thread, a CUDA context or an initialised CUDA driver is in it (the
driver's library merely mapped, as `import torch` leaves it in a CUDA build, is sound to fork); the ranks then
start as fresh processes. A caller that already holds threads (a test, a program calling `run_job`) gets a server
started as a fresh process that does the imports itself (`ForkServer.for_run`). A script's `aqpipe.train` gets one
more run of the script, stopped at that call (`ForkServer.for_script`): only a run of the script holds the spec
factory it builds, and ranks forked from it skip the script's own imports and set-up. Why not `multiprocessing`'s
forkserver: ranks must start in their own process group and network namespace with their output on a pipe of the
launcher's, the launcher must see their exit statuses, and the server must be gone when the launcher returns.

Protocol (one SOCK_SEQPACKET socket pair, one JSON object per message): the server says `{"ready": true}` once it has
imported what the ranks need (the launcher waits for that, or for the server's end, where a Ctrl-C can interrupt the
wait); the launcher sends `{"rank", "env", "netns", "target"}` (target: "module:function" returning the exit code)
with the write end of the rank's output pipe attached; the server answers `{"rank", "pid"}` (or `{"rank",
"unsafe"}`: it will not fork), and `{"exit": pid, "code": c}` when a rank ends (`c` negative: killed by signal -c,
as in `subprocess`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from aqpipe.launch.env import TRAIN_CALL_ENV
from aqpipe.launch.fork_safety import fork, unsafe_to_fork
from aqpipe.launch.local import CommandStarter, RankProcess
from aqpipe.launch.rank_server import MAX_MESSAGE, import_for_ranks, serve
from aqpipe.launch.signals import deferred_interrupts
from aqpipe.lifetime import PARENT_ENV, SCRIPT_SERVER_ENV

WORKER_COMMAND = [sys.executable, "-m", "aqpipe.launch.worker_entry"]  # a rank as a fresh process
RANK_TARGET = "aqpipe.launch.worker_entry:run_rank"  # what a forked rank runs
SCRIPT_TARGET = "aqpipe.launch.rank_server:_run_script_rank"  # what a rank forked from a script (for_script) runs

SERVER_ENV = {
    # numpy's OpenBLAS starts a thread server at import unless it is to run one thread; ranks run one compute
    # thread per core share anyway, and a server without threads forks cleanly.
    "OPENBLAS_NUM_THREADS": "1",
    # Should an import ask torch whether CUDA is there, NVML answers: cudaGetDeviceCount would initialise the
    # driver, and a fork of a process that did cannot use CUDA.
    "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
}


class ForkServerError(RuntimeError):
    """The fork server could not start a rank; the text says why."""


class UnsafeFork(ForkServerError):
    """The fork server holds a thread or a CUDA context, so a fork of it would not be a sound rank."""


@contextlib.contextmanager
def fork_safe_environment() -> Iterator[None]:
    """SERVER_ENV's settings, where the user set none, for what runs inside (imports, asking torch whether CUDA is
    there) in a process that will fork ranks; the environment the user gave afterwards, which the ranks get."""
    given = {name: os.environ.get(name) for name in SERVER_ENV}
    os.environ.update({name: value for name, value in SERVER_ENV.items() if given[name] is None})
    try:
        yield
    finally:
        for name, value in given.items():
            if value is None:
                os.environ.pop(name, None)


def _run(model: str | None, lora: int | None, store: str) -> dict:
    """rank_imports' arguments for a run of `--model model` (None: a spec factory's) with that --lora and --store."""
    return {"model": model, "lora": lora is not None, "store": store}


def _start_server(argv: list[str], sock: socket.socket, env: dict[str, str],
                  stdout: int | None = None) -> subprocess.Popen:
    """Run `argv` as a server on `sock` (its end of the pair, closed here), with `env` on top of this process's."""
    env = dict(os.environ, **{PARENT_ENV: str(os.getpid()), **SERVER_ENV, **env})
    # Its own session: a Ctrl-C at the terminal is the launcher's to handle, not the server's. No input: the
    # terminal's is the launcher's too.
    process = subprocess.Popen(argv, pass_fds=[sock.fileno()], env=env, stdin=subprocess.DEVNULL, stdout=stdout,
                               start_new_session=True)
    sock.close()
    return process


def _wait_for(poll, timeout: float | None, what: str) -> int:
    """Poll until `poll()` gives an exit code; raises subprocess.TimeoutExpired after `timeout` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (code := poll()) is None:
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(what, timeout or 0.0)
        time.sleep(0.02)
    return code


class ForkedRank:
    """A rank the fork server started, with the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, server: ForkServer, pid: int, stdout: TextIO) -> None:
        self._server = server
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the rank has ended (negative: the signal that killed it), else None."""
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the rank ends; raises subprocess.TimeoutExpired after `timeout` seconds."""
        return _wait_for(self.poll, timeout, f"rank pid {self.pid}")


class ForkedChild:
    """A child this process forked, with the part of `subprocess.Popen`'s interface ForkServer uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code once the child has ended, else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child ends; raises subprocess.TimeoutExpired after `timeout` seconds."""
        return _wait_for(self.poll, timeout, f"pid {self.pid}")

    def kill(self) -> None:
        """SIGKILL it, unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class ForkServer:
    """The launcher's handle on one fork server: start ranks, learn how they ended, stop the server."""

    def __init__(self, preload: list[str], run: dict | None = None) -> None:
        """Start a server as a fresh process that imports `preload` (modules; one that fails to import is left to
        the rank to report), then, given `run` (rank_imports' arguments), what the ranks of that run import."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "aqpipe.launch.rank_server", str(theirs.fileno()), json.dumps(run), *preload]
        self._attach(_start_server(argv, theirs, {}), ours)

    @classmethod
    def for_script(cls, command: list[str], lora: int | None = None, store: str = "memory",
                   call: int = 1) -> ForkServer:
        """A server that is `command` (a Python script, run again) stopped in `serve_script` at its `call`-th call
        of `aqpipe.train`, with what the ranks of a run of its spec factory import (with --lora, with that --store):
        ranks forked from it run the factory the script gave there, where fresh processes would each run the script
        once more (they do, should the server end before it serves or hold a thread there)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        given = json.dumps({"socket": theirs.fileno(), "run": _run(None, lora, store), "call": call})
        # (its output: what the script printed before aqpipe.train, printed already by the command itself; its
        # errors and warnings are left to show, as a traceback there may be the only word of why it ended)
        server = cls.__new__(cls)
        server._attach(_start_server(command, theirs, {SCRIPT_SERVER_ENV: given}, subprocess.DEVNULL), ours,
                       fallback=command, target=SCRIPT_TARGET)
        server._script_call = call
        return server

    def _attach(self, process: subprocess.Popen | ForkedChild, sock: socket.socket,
                fallback: list[str] = WORKER_COMMAND, target: str = RANK_TARGET) -> None:
        self.process = process
        self._socket = sock
        self._fallback_command = fallback  # a rank as a fresh process, should the server not fork it
        self._target = target
        # Set when the server is a run of the user's script (for_script, in a session of its own): which of its
        # aqpipe.train calls it stops at.
        self._script_call: int | None = None
        self._ready = threading.Event()  # set once the server has imported what the ranks need, or has ended
        self._replies: queue.Queue = queue.Queue()
        self._exits: dict[int, int] = {}
        self._gone = False  # the server ended: every rank it had is gone too (they die with it)
        self._lock = threading.Lock()
        self._fallback: CommandStarter | None = None  # set when the server cannot fork safely
        self.started = 0
        threading.Thread(target=self._read, name="aqpipe-forkserver", daemon=True).start()

    @classmethod
    def for_run(cls, model: str, lora: int | None = None, store: str = "memory") -> ForkServer:
        """A server, as a fresh process, for the ranks of a run of `--model model` (with --lora, with that
        --store): what a caller with threads of its own uses (a fork of it would not be sound)."""
        return cls([], _run(model, lora, store))

    @classmethod
    def forked_here(cls, model: str, lora: int | None = None, store: str = "memory") -> ForkServer:
        """Import what the ranks of this run need in this process, which plans with the same modules, then fork the
        server from it: one import for the launcher and every rank. A server of its own (`for_run`) when this
        process already holds a thread or a CUDA context."""
        with fork_safe_environment():
            if unsafe_to_fork() is None:  # imports cannot make it safe, and would be paid twice
                import_for_ranks([], _run(model, lora, store))
        if unsafe_to_fork() is not None:
            return cls.for_run(model, lora, store)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        launcher = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = fork()
        if pid == 0:
            try:
                ours.close()
                os.setsid()  # out of the terminal's process group: a Ctrl-C there is the launcher's
                for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
                    signal.signal(sig, signal.SIG_DFL)
                os.environ[PARENT_ENV] = str(launcher)
                serve(theirs, [])
            finally:
                os._exit(0)
        theirs.close()
        server = cls.__new__(cls)
        server._attach(ForkedChild(pid), ours)
        return server

    def start(self, rank: int, env: dict[str, str], netns: str | None = None) -> RankProcess:
        """Fork rank `rank` with exactly the environment `env`, inside network namespace `netns` if given (started
        as a fresh process instead, with a note saying why, if the server cannot fork safely)."""
        if self._fallback is None:
            try:
                return self.fork(rank, env, netns)
            except UnsafeFork as e:
                why = str(e)
            except ForkServerError:
                if self._script_call is None or self.started:
                    raise
                why = "the run of the script that was to fork them ended before it reached aqpipe.train"
            print(f"aqpipe: note: ranks start as fresh processes, not forked ({why})", file=sys.stderr, flush=True)
            if not self.started:  # no rank depends on the server: it goes now, with what it holds
                self.close()
            self._fallback = CommandStarter(self._fallback_command)
        if self._script_call is not None:  # (a rank running the script afresh must know which call it is for)
            env = dict(env, **{TRAIN_CALL_ENV: str(self._script_call)})
        return self._fallback.start(rank, env, netns)

    def fork(self, rank: int, env: dict[str, str], netns: str | None = None, target: str | None = None) -> ForkedRank:
        """Fork a child of the server that runs `target` ("module:function" returning the exit code; by default
        what this server's ranks run) as rank `rank`; raises UnsafeFork when the server holds a thread or a CUDA
        context."""
        while not self._ready.wait(0.1):  # (a plain wait would hold a Ctrl-C until the server is ready, if ever)
            pass
        with deferred_interrupts():  # a Ctrl-C now is delivered once the rank is the launcher's to stop
            return self._fork(rank, env, netns, target or self._target)

    def _fork(self, rank: int, env: dict[str, str], netns: str | None, target: str) -> ForkedRank:
        read_end, write_end = os.pipe()
        try:
            message = json.dumps({"rank": rank, "env": dict(env, **{PARENT_ENV: str(self.process.pid)}),
                                  "netns": netns, "target": target}).encode()
            try:
                socket.send_fds(self._socket, [message], [write_end])
            except OSError as e:
                raise ForkServerError(f"the rank fork server is gone ({e.strerror})") from None
        finally:
            os.close(write_end)
        reply = self._replies.get()
        if reply is not None and "unsafe" in reply:
            os.close(read_end)
            raise UnsafeFork(reply["unsafe"])
        if reply is None or "error" in reply:
            os.close(read_end)
            code = self.process.poll()
            why = reply["error"] if reply else f"it exited with code {code}" if code is not None else "it closed"
            raise ForkServerError(f"the rank fork server could not start rank {rank}: {why}")
        stdout = open(read_end, encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115 - the rank's pipe
        self.started += 1
        return ForkedRank(self, reply["pid"], stdout)

    def exit_code(self, pid: int) -> int | None:
        """How rank `pid` ended, or None while it runs."""
        with self._lock:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._gone else None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server and wait until it has ended (its ranks have ended before, or die with it); closing it
        again does nothing."""
        if self.process.returncode is not None:
            return
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        # Perhaps still importing, for a launch that ended before its ranks: no need to wait. A script's run goes at
        # once, with whatever the script started (its ranks, in groups of their own, have ended), while its pid, the
        # group's, cannot yet be another process's.
        if not self.started or self._script_call is not None:
            self._kill()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._kill()
            self.process.wait()

    def _kill(self) -> None:
        """SIGKILL the server (a script's run: its whole process group)."""
        if self._script_call is None:
            self.process.kill()
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it and everything in its group have ended
            pass

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                with self._lock:
                    self._gone = True
                self._ready.set()
                self._replies.put(None)
                return
            message = json.loads(data)
            if "ready" in message:
                self._ready.set()
            elif "exit" in message:
                with self._lock:
                    self._exits[message["exit"]] = message["code"]
            else:
                self._replies.put(message)
