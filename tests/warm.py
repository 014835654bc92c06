"""`aqpipe` commands and ranks for tests, started from warm processes instead of fresh interpreters.

A test that launches a run pays for importing torch and transformers (about 10 s of CPU on these 2-core machines)
in the launcher, and again in a spawned rank fork server when it calls `run_job` in-process; over a hundred
launches that was half of the suite's time. Here each test worker keeps:

- a *command zygote*: a process that has imported what `aqpipe launch` imports and forks one child per command.
  The child becomes the command exactly as `python -m aqpipe ARGS` would be (its own environment, working
  directory, stdin from /dev/null, stdout and stderr to files, `aqpipe.cli.console` as the entry point), so the
  launcher's own path runs unchanged: it forks its rank fork server from itself, as a real launcher does.
- a *rank server*: one `ForkServer` (the launcher's own) shared by the in-process `run_job` calls of a test
  worker, so their ranks are forks of one warm process, as they are under `aqpipe launch`.

Tests of start-up itself, of signals sent to a terminal's launcher and of the README's commands keep starting
real interpreters. If the zygote holds a thread after its imports (a fork of it would copy a held lock), commands
fall back to `subprocess`.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback

from aqpipe.launch.forkserver import _wait_for

MAX_MESSAGE = 1 << 20
# What `aqpipe launch` imports for the models the suite runs, so each command's launcher (and the rank fork server
# it forks from itself) finds them imported.
MODELS = [("gpt2-tiny", True, "lmdb"), ("llama-tiny", True, "memory"), ("bert-tiny", False, "memory"),
          ("deberta-tiny", False, "memory")]
# matplotlib: rank 0 draws the loss plot at the end of every run (about a second of imports here).
PRELOAD = ["aqpipe.cli", "aqpipe.launch.job", "aqpipe.launch.forkserver", "aqpipe.runtime.capacity.plan", "matplotlib.figure",
           "matplotlib.backends.backend_agg", "matplotlib.pyplot"]


# The zygote's side.

def _zygote(sock: socket.socket, parent: int) -> None:
    from aqpipe.lifetime import die_with

    die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is pytest's
    from aqpipe.launch.fork_safety import native_threads
    from aqpipe.launch.rank_server import _report_exits, import_for_ranks
    from aqpipe.launch.worker_entry import rank_imports

    modules = list(PRELOAD)
    for model, lora, store in MODELS:
        modules += rank_imports(model, lora, store)
    import_for_ranks(modules)
    threads = native_threads()
    sock.send(json.dumps({"ready": threads == 1, "threads": threads}).encode())
    if threads != 1:
        return
    while True:
        _report_exits(sock)
        ready, _, _ = select.select([sock], [], [], 0.05)
        if not ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
        except OSError:
            return
        if not data:
            return
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            if request.get("serve"):
                _become_rank_server(fds[0], os.getppid())
            _become_command(request, fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _become_rank_server(fd: int, zygote: int) -> None:
    """In the forked child: be a rank fork server (aqpipe's own) on socket `fd`; never returns."""
    try:
        from aqpipe.launch.rank_server import serve
        from aqpipe.lifetime import PARENT_ENV

        os.setsid()
        os.environ[PARENT_ENV] = str(zygote)  # it dies with the zygote, its ranks with it
        serve(socket.socket(fileno=fd), [])
    finally:
        os._exit(0)


def _become_command(request: dict, fds: list[int]) -> None:
    """In the forked child: run `aqpipe ARGV` as `python -m aqpipe ARGV` would; never returns."""
    code = 1
    try:
        from aqpipe.lifetime import die_with

        die_with(os.getppid())  # a command never outlives its zygote (nor, through it, its test worker)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (stdin, *fds):
            os.close(fd)
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["aqpipe", *request["argv"]]
        from aqpipe.cli import console

        console()  # leaves by os._exit unless a thread still works: then by SystemExit, below
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        for thread in threading.enumerate():  # as interpreter shutdown would: wait for the non-daemon threads
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
    except BaseException:  # noqa: BLE001 - this process must never return into the zygote's loop
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# The test's side.

class _ZygoteChild:
    """A process the zygote forked, with the part of `subprocess.Popen`'s interface tests and ForkServer use."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        """The exit code once the process has ended (negative: the signal that killed it), else None."""
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the process ends; raises subprocess.TimeoutExpired after `timeout` seconds."""
        return _wait_for(self.poll, timeout, f"pid {self.pid}")

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the process, unless it has ended."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the process, unless it has ended."""
        self.send_signal(signal.SIGKILL)


class WarmCommand(_ZygoteChild):
    """An `aqpipe` command forked from the zygote, its stdout and stderr in files."""

    def __init__(self, zygote: _Zygote, argv: list[str], env: dict[str, str], cwd: str) -> None:
        self.args = ["aqpipe", *argv]
        self._files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]  # noqa: SIM115 - closed by communicate
        super().__init__(zygote, zygote.fork({"argv": argv, "env": env, "cwd": cwd}, [f.fileno() for f in self._files]))

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end, then (stdout, stderr) as text."""
        self.wait(timeout)
        texts = []
        for f in self._files:
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
            f.close()
        return texts[0], texts[1]


class _Zygote:
    def __init__(self) -> None:
        from aqpipe.launch.forkserver import SERVER_ENV

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The repository root is on sys.path only while this module is imported: a command finds what
        # `python -m aqpipe` in its working directory would find, no more.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = (f"import socket, sys; sys.path.insert(0, {root!r}); import tests.warm as w; sys.path.remove({root!r}); "
                f"w._zygote(socket.socket(fileno={theirs.fileno()}), {os.getpid()})")
        env = dict(os.environ, **SERVER_ENV)
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._socket = ours
        self._exits: dict[int, int] = {}
        self._replies: list[dict] = []
        self._cond = threading.Condition()
        self._gone = False
        threading.Thread(target=self._read, name="warm-zygote", daemon=True).start()
        hello = self._reply()
        self.ready = bool(hello and hello.get("ready"))

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._gone = True
                elif "exit" in (message := json.loads(data)):
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies.append(message)
                self._cond.notify_all()
            if not data:
                return

    def _reply(self) -> dict | None:
        with self._cond:
            self._cond.wait_for(lambda: self._replies or self._gone)
            return self._replies.pop(0) if self._replies else None

    def fork(self, request: dict, fds: list[int]) -> int:
        socket.send_fds(self._socket, [json.dumps(request).encode()], fds)
        reply = self._reply()
        if reply is None:
            raise RuntimeError(f"the command zygote is gone (exit code {self.process.poll()})")
        return reply["pid"]

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._gone else None


_lock = threading.Lock()
_zygote_here: _Zygote | None = None
_ranks_here = None


def _zygote_for_this_process() -> _Zygote | None:
    global _zygote_here
    with _lock:
        if _zygote_here is None or (_zygote_here.ready and _zygote_here._gone):  # an unsafe one is not retried
            _zygote_here = _Zygote()
        return _zygote_here if _zygote_here.ready else None


def start(*argv: str, env: dict[str, str] | None = None, cwd=None) -> WarmCommand | subprocess.Popen:
    """Start `aqpipe ARGV` (as `python -m aqpipe ARGV` would run) with stdout and stderr captured as text."""
    env = dict(os.environ if env is None else env)
    cwd = str(cwd or os.getcwd())
    zygote = _zygote_for_this_process()
    if zygote is None:
        return subprocess.Popen([sys.executable, "-m", "aqpipe", *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return WarmCommand(zygote, [str(a) for a in argv], env, cwd)


def run(*argv: str, env: dict[str, str] | None = None, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `aqpipe ARGV` to its end, like `subprocess.run([python, -m, aqpipe, *ARGV], capture_output=True,
    text=True, timeout=timeout)`; on a time-out the command is killed and subprocess.TimeoutExpired raised."""
    command = start(*argv, env=env, cwd=cwd)
    try:
        out, err = command.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.communicate()
        raise
    return subprocess.CompletedProcess(["aqpipe", *argv], command.returncode, out, err)


class _SharedRanks:
    """The test worker's rank fork server, lent to one `run_job` at a time; `run_job`'s close leaves it running."""

    def __init__(self, server) -> None:
        self._server = server

    def start(self, rank: int, env: dict[str, str], netns: str | None = None):
        return self._server.start(rank, env, netns)

    def close(self) -> None:
        pass


def ranks():
    """A rank starter for `run_job(..., starter=ranks())`: ranks forked from this test worker's warm fork server."""
    global _ranks_here
    from aqpipe.launch.forkserver import ForkServer
    from aqpipe.launch.worker_entry import rank_imports

    zygote = _zygote_for_this_process()
    with _lock:
        if _ranks_here is None or _ranks_here._server.process.poll() is not None:
            if zygote is None:  # a server of its own, which imports what the ranks need
                modules = [*PRELOAD[-3:], *(m for model, lora, store in MODELS for m in rank_imports(model, lora, store))]
                _ranks_here = _SharedRanks(ForkServer(modules))
            else:  # forked from the zygote, which has imported all that already
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                pid = zygote.fork({"serve": True}, [theirs.fileno()])
                theirs.close()
                server = ForkServer.__new__(ForkServer)
                server._attach(_ZygoteChild(zygote, pid), ours)
                _ranks_here = _SharedRanks(server)
        return _ranks_here
