"""Start the pp × dp workers on this machine, stream their logs, draw progress, and tear everything down on failure.

Every line a rank prints goes to its log file (`<out>/logs/rank-K.log`). The terminal gets the ordinary lines, but
not tracebacks and torch's C++ log lines, and nothing once a rank has failed: the one-line cause stands alone.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TextIO

from aqpipe.launch.netns import INTERFACE, THROTTLED_NCCL, Topology, exec_prefix
from aqpipe.launch.signals import deferred_interrupts
from aqpipe.lifetime import PARENT_ENV
from aqpipe.pipeline.links.rendezvous import LOOPBACK_ENV
from aqpipe.runtime.events import EVENT_PREFIX, HEARTBEAT_SECONDS

# A worker whose error only says a peer went away is a consequence, not the cause.
_SECONDARY = ("TransportError", "Connection closed", "Connection reset", "peer", "Broken pipe", "ECONNRESET")
# torch's C++ log lines ("[W1123 13:00:00.123 ProcessGroupGloo.cpp:…]") and gloo's abort text: details, for the log.
_NATIVE_LOG = re.compile(r"^(\[[WEFI]\d{4} |terminate called|  what\(\): )")

# What a signal that killed a rank usually means, for the one-line message.
_SIGNAL_HINTS = {"SIGBUS": " (a memory-mapped file could not be read or grown: is the disk holding the run directory "
                           "full, or its m(xi) store damaged? see aqpipe store verify)",
                 "SIGKILL": " (by a user, or by the kernel's out-of-memory killer: see dmesg)",
                 "SIGABRT": " (a native library aborted it: see its log)"}
# The least silence that ends a start-up (see `launch_local`): a native call holding the interpreter's lock (a large
# cache unpickled) stops a rank's heartbeat for a while, and a short --stall-timeout is for steps.
STARTUP_SILENCE_SECONDS = 60.0
# What NCCL's watchdog prints before it aborts a rank whose collective outlived its process group's time-out.
_NCCL_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(.*?OpType=(\w+).*?"
                            r"Timeout\(ms\)=(\d+)")


@contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback TCP port held for as long as the context lasts: Linux gives it to no other socket of this network
    namespace that binds port 0 or connects (it skips a bound port when it picks one; unless
    net.ipv4.ip_autobind_reuse is set and every other port is taken), while rank 0's rendezvous, which binds it with
    SO_REUSEADDR, may still listen on it because the holder never listens.

    A port probed free and released (torchrun's way) was taken by another process's socket before rank 0 bound it
    when a dozen launches started at once on one machine: the run failed with `Address already in use`.
    """
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        yield holder.getsockname()[1]
    finally:
        holder.close()


@dataclass
class _Worker:
    rank: int
    name: str
    proc: RankProcess
    log: TextIO | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=30))
    error: str | None = None
    disk_full: bool = False  # its error was a full disk
    last_seen: float = field(default_factory=time.monotonic)
    beating: bool = False  # its heartbeat has begun (before it, the rank is importing what it runs)
    in_traceback: bool = False  # the lines now arriving belong to a traceback (log only)
    failed: bool = False  # it reported its error: whatever it prints after that is for the log only
    tracebacks: int = 0


INTERRUPTED = "interrupted (Ctrl-C or SIGTERM); all ranks stopped"


@dataclass
class LaunchResult:
    """How a local launch ended: exit code 0 or 1, and the failure message."""

    code: int
    message: str = ""
    summary: dict | None = None
    interrupted: bool = False
    disk_full: bool = False  # the run ended because a disk filled up (a resume continues once there is space)


class RankStarter(Protocol):
    """What starts a rank: a fork server (launch/forkserver.py), or a command run afresh per rank."""

    def start(self, rank: int, env: dict[str, str], netns: str | None = None) -> RankProcess:
        """Start rank `rank` with exactly the environment `env`, inside network namespace `netns` if given."""
        ...

    def close(self) -> None:
        """Release what starting ranks needed (called once every rank has ended)."""
        ...


class RankProcess(Protocol):
    """A started rank, as the launcher watches it (the part of `subprocess.Popen` it uses)."""

    pid: int
    returncode: int | None

    @property
    def stdout(self) -> Iterable[str] | None:
        """The rank's output and error stream, line by line."""

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass
class CommandStarter:
    """Start every rank as a fresh process running `command`, in its own session."""

    command: list[str]

    def start(self, rank: int, env: dict[str, str], netns: str | None = None) -> RankProcess:
        """Run the command (inside `ip netns exec NETNS` when given) with its output on a pipe."""
        argv = (exec_prefix(netns) if netns is not None else []) + self.command
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1, start_new_session=True, errors="replace")

    def close(self) -> None:
        """Nothing to release."""


def launch_local(
    starter: RankStarter, world_size: int, describe, env_extra: dict[str, str], total_steps: int,
    stall_timeout: float, port: int | None = None, progress: bool = True, topology: Topology | None = None,
    log_dir: Path | None = None,
) -> LaunchResult:
    """Start every rank with `starter` and torch.distributed's environment; `describe(rank)` names a rank in messages.

    With a `topology`, each rank runs inside its own network namespace and talks over the throttled bridge.
    With a `log_dir`, each rank's output is appended to `rank-K.log` there.
    """
    if not port:  # hold a port for the rendezvous until the run ends
        with reserved_port() as held:
            return launch_local(starter, world_size, describe, env_extra, total_steps, stall_timeout, held, progress,
                                topology, log_dir)
    events: queue.Queue = queue.Queue()
    workers: list[_Worker] = []
    if log_dir is not None:
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
        except OSError:  # logs are a convenience: a full disk shows up where it matters (the run's own files)
            log_dir = None
    bar = _progress_bar(total_steps) if progress else None
    result: LaunchResult | None = None
    # Set by the first event of training. Before it, loading a large model legitimately takes long (the ranks' own
    # collectives wait up to STARTUP_TIMEOUT_SECONDS for each other): only a rank silent for the stall time-out, not
    # even a heartbeat, ends a run then (a stopped or hung process), and only after STARTUP_SILENCE_SECONDS at least.
    last_progress: float | None = None
    startup_silence = max(stall_timeout, STARTUP_SILENCE_SECONDS)
    phases: dict[str, float] = {}
    summary = None
    try:
        for rank in range(world_size):
            env = dict(os.environ, **env_extra, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       AQPIPE_EVENTS="1", PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())})
            netns = None
            if topology is not None:  # rendezvous, gloo and NCCL all go over the shaped interface
                env.update(MASTER_ADDR=topology.address(0), GLOO_SOCKET_IFNAME=INTERFACE, **THROTTLED_NCCL)
                netns = topology.namespace(rank)
            else:  # one machine: nothing listens beyond loopback
                env.update({LOOPBACK_ENV: "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
            proc = starter.start(rank, env, netns)
            worker = _Worker(rank, describe(rank), proc, log=_open_log(log_dir, rank))
            workers.append(worker)
            threading.Thread(target=_pump, args=(worker, events), daemon=True).start()
        while result is None:
            try:
                kind, payload = events.get(timeout=0.1)
                if kind == "event":
                    # (a rank's `resumed` comes before every rank is ready to train: start-up goes on)
                    event = payload.get("event")
                    if event == "start" or (last_progress is not None and event != "alive"):
                        last_progress = time.monotonic()
                    summary = _on_event(payload, workers, bar, phases) or summary
                else:
                    _print_line(payload, bar)
            except queue.Empty:
                pass
            failed = [w for w in workers if w.proc.poll() not in (None, 0)]
            if failed:
                time.sleep(1.0)  # let the neighbours of a dead rank finish failing, then pick the cause
                _drain(events, workers, None, phases, quiet=True)
                result = LaunchResult(1, _root_cause(workers) + _log_hint(log_dir),
                                      disk_full=any(w.disk_full for w in workers))
            elif all(w.proc.poll() == 0 for w in workers):
                _drain(events, workers, bar, phases)
                for w in workers:
                    w.proc.wait()
                result = LaunchResult(0, summary=summary)
            elif last_progress is None and (hung := [w for w in _silent(workers, startup_silence) if w.beating]):
                result = LaunchResult(1, f"{hung[0].name} stopped responding during start-up (no heartbeat for "
                                      f"{startup_silence:.0f} s); stopping all ranks" + _log_hint(log_dir))
            elif last_progress is not None and time.monotonic() - last_progress > stall_timeout:
                silent = _silent(workers)
                who = (f"{silent[0].name} stopped responding" if silent
                       else "every rank is alive but none moved on (--stall-timeout S allows a longer wait)")
                result = LaunchResult(1, f"no progress for {stall_timeout:.0f} s (stalled): {who}; stopping all ranks"
                                      + _log_hint(log_dir))
    except KeyboardInterrupt:
        result = LaunchResult(1, INTERRUPTED, interrupted=True)
    finally:
        with deferred_interrupts():  # a second Ctrl-C must not cut the teardown short
            _terminate(workers)
            if bar is not None:
                bar.close()
            for w in workers:
                _close_log(w)
    if result.code == 0 and result.summary is None:
        result.summary = summary
    if result.code == 0:
        for w in workers:
            if w.tracebacks:
                print(f"aqpipe: {w.name} logged {w.tracebacks} traceback(s) and went on; see "
                      f"{log_dir / f'rank-{w.rank}.log' if log_dir else 'its output'}", file=sys.stderr, flush=True)
    return result


def _open_log(log_dir: Path | None, rank: int) -> TextIO | None:
    if log_dir is None:
        return None
    try:
        log = open(log_dir / f"rank-{rank}.log", "a", buffering=1, errors="replace")
        log.write(f"=== aqpipe launch {time.strftime('%Y-%m-%d %H:%M:%S')} (launcher pid {os.getpid()}) ===\n")
    except OSError:  # disk full: the rank runs without a log file (and its own writes will name the problem)
        return None
    return log


def _close_log(worker: _Worker) -> None:
    log, worker.log = worker.log, None
    if log is not None:
        log.close()


def _log_hint(log_dir: Path | None) -> str:
    return f" (every rank's output: {log_dir}/rank-K.log)" if log_dir is not None else ""


def _silent(workers: list[_Worker], seconds: float = 5 * HEARTBEAT_SECONDS) -> list[_Worker]:
    """Live workers that sent nothing, not even a heartbeat, for `seconds` (several heartbeat periods by default):
    stopped or hung."""
    now = time.monotonic()
    return [w for w in workers if w.proc.poll() is None and now - w.last_seen > seconds]


def _pump(worker: _Worker, events: queue.Queue) -> None:
    """Forward one worker's output lines: events to the launcher, everything else to its log file, and the
    ordinary lines (not tracebacks, not native log lines) to the terminal."""
    for line in worker.proc.stdout or ():
        worker.last_seen = time.monotonic()
        line = line.rstrip("\n")
        if line.startswith(EVENT_PREFIX):
            try:
                event = json.loads(line[len(EVENT_PREFIX):])
                if event.get("event") == "error":  # the traceback(s) that follow are for the log
                    worker.failed = True
                worker.beating = True
                events.put(("event", dict(event, _rank=worker.rank)))
                continue
            except ValueError:
                pass
        worker.tail.append(line)
        log = worker.log
        if log is not None:
            try:
                log.write(line + "\n")
            except (OSError, ValueError):  # disk full, or closed at teardown: the terminal still has the cause
                pass
        if line.startswith(("Traceback (most recent call last)", "Exception in thread")):
            worker.tracebacks += not worker.in_traceback
            worker.in_traceback = True
        elif worker.in_traceback and line and not line[0].isspace() and ":" in line and not line.startswith("During"):
            worker.in_traceback = False  # "SomeError: message" ends a traceback; this line is part of it
            continue
        if not worker.in_traceback and not worker.failed and not _NATIVE_LOG.match(line):
            events.put(("line", f"[rank {worker.rank}] {line}"))


# A long phase between step records (the held-out pass, the final weights' way to rank 0) is shown on the bar as it
# moves; without a bar, a line every this many seconds once it has lasted that long.
PHASE_LINE_SECONDS = 10.0


def phase_text(event: dict) -> str:
    """A progress event as the launcher shows it: "final weights: 1.2 of 5.3 MB"."""
    done, total, unit = event["done"], event["total"], event.get("unit", "")
    if unit == "bytes":
        return f"{event['phase']}: {done / 1e6:.1f} of {total / 1e6:.1f} MB"
    return f"{event['phase']}: {done} of {total} {unit}".rstrip()


def _on_event(event: dict, workers: list[_Worker], bar, phases: dict[str, float]) -> dict | None:
    """Take one worker event in; `phases`: when each long phase's line was last printed (no bar). Returns the run's
    summary once a `done` event brings it."""
    kind = event.get("event")
    if kind == "progress":
        if bar is not None and not bar.disable:
            bar.set_postfix_str(phase_text(event), refresh=True)
        elif event["done"] >= event["total"]:
            phases.pop(event["phase"], None)
        elif time.monotonic() - phases.setdefault(event["phase"], time.monotonic()) >= PHASE_LINE_SECONDS:
            phases[event["phase"]] = time.monotonic()
            print(phase_text(event), file=sys.stderr, flush=True)
    elif kind == "step" and bar is not None and not bar.disable:
        bar.n = event["step"]
        bar.set_postfix(loss=f"{event['loss']:.4f}", sps=f"{event['samples_per_second']:.1f}", refresh=False)
        bar.refresh()
    elif kind == "step":  # no terminal to draw a bar on: a plain line every 5% of the run
        step, total = event["step"], event["total_steps"]
        if step % max(1, total // 20) == 0 or step == total:
            print(f"step {step}/{total}  loss {event['loss']:.4f}  {event['samples_per_second']:.1f} samples/s",
                  file=sys.stderr, flush=True)
    elif kind == "error":
        workers[event["_rank"]].error = event.get("message")
        workers[event["_rank"]].disk_full = bool(event.get("disk_full"))
    elif kind == "done":
        return event.get("summary")
    return None


def _drain(events: queue.Queue, workers: list[_Worker], bar, phases: dict[str, float], quiet: bool = False) -> None:
    """Take in what the workers still had to say; `quiet` (a rank failed): keep their lines off the terminal."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            kind, payload = events.get(timeout=0.05)
        except queue.Empty:
            if all(w.proc.poll() is not None for w in workers):
                break
            continue
        if kind == "event":
            _on_event(payload, workers, bar, phases)
        elif not quiet:
            _print_line(payload, bar)


def _root_cause(workers: list[_Worker]) -> str:
    """The message naming the rank whose failure started it all."""
    failed = [w for w in workers if w.proc.poll() not in (None, 0)]
    full = [w for w in workers if w.disk_full]
    if full:  # a full disk explains whatever else failed (a memory-mapped store on it may even have faulted)
        return f"{full[0].name} failed: {full[0].error}"
    killed = [w for w in failed if (w.proc.returncode or 0) < 0]
    if killed:
        w = killed[0]
        name = signal.Signals(-(w.proc.returncode or 0)).name
        watchdog = next((m for m in map(_NCCL_WATCHDOG.search, reversed(w.tail)) if m), None)
        if name == "SIGABRT" and watchdog:  # the rank it waited for is the story: those still running may hold it
            running = ", ".join(other.name for other in workers if other.proc.poll() is None)
            return (f"{w.name} died: NCCL's watchdog aborted it when its {watchdog[1]} had waited "
                    f"{int(watchdog[2]) / 1000:.0f} s for its peers (--stall-timeout once training has begun)"
                    + (f"; still running: {running}" if running else ""))
        return f"{w.name} died: killed by signal {name}" + _SIGNAL_HINTS.get(name, "")
    silent = _silent(workers)
    if silent:  # its peers failed waiting for it
        return f"{silent[0].name} stopped responding (no heartbeat for {time.monotonic() - silent[0].last_seen:.0f} s)"
    primary = [w for w in failed if not any(s in (w.error or "") for s in _SECONDARY)]
    w = (primary or failed)[0]
    cause = w.error or next((line for line in reversed(w.tail) if line.strip()), f"exit code {w.proc.returncode}")
    return f"{w.name} failed: {cause}"


def _terminate(workers: list[_Worker]) -> None:
    """SIGTERM every live worker's process group, then SIGKILL whatever is left after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [w for w in workers if w.proc.poll() is None]
        for w in alive:
            try:
                os.killpg(w.proc.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while alive and time.monotonic() < deadline:
            alive = [w for w in alive if w.proc.poll() is None]
            time.sleep(0.05)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="training", unit="step", file=sys.stderr, dynamic_ncols=True,
                disable=not sys.stderr.isatty())


def _print_line(line: str, bar) -> None:
    if bar is not None and not bar.disable:
        bar.write(line, file=sys.stdout)
    else:
        print(line, flush=True)
