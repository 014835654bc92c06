"""The process that copies a rank's checkpoint parts to other hosts while training goes on.

Each rank starts, as the run begins, a process of its own (`python -m aqpipe.runtime.checkpoints.copier`), which
copies at the lowest CPU priority (SCHED_IDLE: on a core no training wants). On a host whose cores are never idle
that priority starves the copies (a run would end, or a host fail, before any was kept), so the rank takes its
process out of SCHED_IDLE, to its own priority, while a copy has outlasted twice its paced time (at least
`STARVED_SECONDS`) or while training waits for it; where Linux refuses (without CAP_SYS_NICE or `ulimit -e 20`),
the rank says so once and its copies wait for idle cores. These processes meet at the run's
rendezvous store, form a gloo group of their own and copy every rank's part of each checkpoint (`copies.copy_step`)
when their ranks ask. Why a process, not a thread of the rank: a thread that reads, hashes and writes pieces takes
Python's lock many times a second, and the step's own Python waits for it each time (at 2 MB/s such a thread made
SmolLM2's steps 12% slower on a host whose cores were all busy); a process of its own shares no lock with the step.
The rank tells its process which step to copy and at what pace (one JSON line on its stdin), and that training waits
for the copies (the run's last checkpoint, its end: from then on they go unpaced, since a pace would only make the
wait longer); the process reports the bytes it sent and each step's end (JSON lines on its stdout), and dies with
its rank. A rank under torchrun forks its process from itself before it meets the others, while it holds no thread
(`preforked.prefork`): the process then starts with torch imported, instead of importing it again in an interpreter
of its own (3 s of a core on a 2-core machine, and a quarter GB of memory, for every rank of every start); where a
fork would not be sound, it is started afresh.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from aqpipe.disk import write_atomic
from aqpipe.lifetime import die_with
from aqpipe.pipeline.links.rendezvous import LOOPBACK_ENV
from aqpipe.pipeline.links.transport import achieved_rate
from aqpipe.pipeline.world import comm
from aqpipe.pipeline.world.grid import Grid
from aqpipe.runtime.checkpoints.copies import COPYING, MIN_RATE, REPLICATED, copy_plan, copy_step
from aqpipe.runtime.checkpoints.parts import rank_file, step_dir
from aqpipe.runtime.checkpoints.preforked import CLOSE_SECONDS, ForkedCopies, take_preforked

NICE = 19  # the copies' process's nice value: on a host whose cores are all busy training, its work waits
# A copy may take twice its paced time (its part's bytes over its rate), at least this long, on idle cores alone;
# past that its process runs at its rank's priority until the copy ends
STARVED_SECONDS = 5.0
REPORT_SECONDS = 0.5  # the copies' process tells its rank the bytes it sent at most this often
UNPACE = {"unpace": True}  # the line that tells the copies' process that training waits for its copies


class CheckpointCopier:
    """One rank's side of the copies: asks its copies' process to send its part of a checkpoint to its copies' ranks
    and keep the parts other ranks send it (`start`; `busy` while it runs; `wait` for it). Every rank makes one,
    together."""

    def __init__(self, out: str | Path, grid: Grid, hosts: list[str], copies: int, timeout: timedelta,
                 share: float) -> None:
        self.out, self.grid, self.hosts = Path(out), grid, hosts
        self.share = share  # the share of the link between hosts a host's copies may take (--checkpoint-share)
        self.rank = grid.rank
        self.plan = copy_plan(hosts, copies)
        self.timeout = timeout
        self.peak = 0.0  # the highest rate this rank measured on a link to another host (bytes/s)
        # the same where no body byte arrived while timed (`achieved_rate`: a burst read at memory speed, or a
        # receiver that came late), used only while nothing else was measured
        self.burst_peak = 0.0
        self.step: int | None = None  # the checkpoint whose parts were copied last (or are being copied)
        self._process: subprocess.Popen | ForkedCopies | None = None
        self._pending = False  # a step asked of the process, its end not yet read
        self._asked = self._starved_after = 0.0  # when the copy in flight was asked for; when it counts as starved
        self._hurried = False  # the copies' process runs at this rank's priority (a starved copy, or one waited for)
        self.can_hurry = True  # (until Linux refuses it)
        self._unread = b""
        self.problem = ""  # why the last step's copies failed ("" where they were kept everywhere)
        # the store keys of these ranks' copies' processes: one name for every rank of this start, another for each
        # start (the store outlives a restart's ranks)
        names = [uuid.uuid4().hex]
        comm.broadcast_object_list(names, src=0, traffic=comm.SETUP)
        self.name = names[0]
        # started now, at the lowest priority, so that it has imported torch and met the others before the first
        # checkpoint (the copies of a run's first checkpoints are the ones a short run most needs)
        self._process = self._spawn()

    def observe(self, stats) -> None:
        """Take a step's link measurements (`StepStats`): the links whose other end is on another host; and count
        the bytes the copies sent since the last step."""
        for direction, peer_stage in (("fwd", self.grid.stage - 1), ("bwd", self.grid.stage + 1)):
            if not 0 <= peer_stage < self.grid.pp:
                continue
            peer = self.grid.rank_of(peer_stage, self.grid.replica)
            if self.hosts[peer] != self.hosts[self.rank]:
                body, arrived, seconds = (getattr(stats, f"{direction}_{name}")
                                          for name in ("recv_bytes", "arrived_bytes", "recv_seconds"))
                rate = achieved_rate(body, arrived, seconds)
                if arrived > 0:
                    self.peak = max(self.peak, rate)
                else:
                    self.burst_peak = max(self.burst_peak, rate)
        self._read(block=False)
        self._hurry_if_starved()

    def rate(self) -> float:
        """Bytes/s this rank's copies may take: its host's share of the link between hosts, split among its ranks."""
        host_ranks = self.hosts.count(self.hosts[self.rank])
        return max(self.share * (self.peak or self.burst_peak), MIN_RATE) / host_ranks

    def start(self, step: int, leader: bool) -> None:
        """Copy the parts of the checkpoint of `step` in the background (every rank calls it, after the checkpoint is
        marked complete on every host); `leader`: this rank marks its host's step directory."""
        self.wait()
        self.step, self.problem = step, ""
        marker = step_dir(self.out, step) / COPYING
        if leader and not marker.is_file():  # (a checkpoint's is written with it; a resumed one's may predate that)
            write_atomic(marker, b"", durable=True)
        if self._process is None:  # (it died, said on stderr: the others' copies fail at their time-out)
            self.problem = "the copies' process ended"
            return
        order = {"step": step, "rate": self.rate(), "leader": leader}
        try:  # (until the copies' process says how long the copy should take: this rank's part's paced time)
            part_bytes = rank_file(step_dir(self.out, step), self.rank).stat().st_size * len(self.plan[self.rank])
        except OSError:  # (the copies' process says what is wrong with it)
            part_bytes = 0
        self._asked = time.monotonic()
        self._paced(part_bytes / order["rate"])
        self._pending = self._tell(order)
        if not self._pending:
            self.problem = "the copies' process ended"

    @property
    def busy(self) -> bool:
        """Whether copies are in flight."""
        self._read(block=False)
        self._hurry_if_starved()
        return self._pending

    def wait(self) -> None:
        """Until the copies in flight are done (at this rank's priority and unpaced from now on: training waits for
        them)."""
        if self._pending:
            self._hurry()
            self._tell(UNPACE)  # (nothing else shares the link now: a pace would only make the wait longer)
        while self._pending:
            self._read(block=True)

    def _paced(self, seconds: float) -> None:
        """The copy in flight takes `seconds` at its pace: it counts as starved after twice that (at least
        STARVED_SECONDS) from when it was asked for."""
        self._starved_after = self._asked + max(STARVED_SECONDS, 2 * seconds)

    def _tell(self, message: dict) -> bool:
        """Write `message` to the copies' process (one JSON line on its stdin); whether it could be written."""
        if self._process is None:
            return False
        try:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(message).encode() + b"\n")
            self._process.stdin.flush()
            return True
        except OSError:  # (it died: its exit was told on stderr)
            return False

    def _hurry_if_starved(self) -> None:
        """Take the copies' process out of SCHED_IDLE once the copy in flight has outlasted its share of idle time."""
        if self._pending and not self._hurried and time.monotonic() > self._starved_after:
            self._hurry()

    def _hurry(self) -> None:
        """Run the copies' process at this rank's priority until the copy in flight ends; where Linux refuses, say so
        once and leave it idle."""
        if self._process is None or not self.can_hurry or self._hurried:
            return
        self._hurried = set_priority(self._process.pid, idle=False)
        if not self._hurried:
            set_priority(self._process.pid, idle=True)  # (a thread that took it goes back)
            self.can_hurry = False
            print(f"aqpipe: rank {self.rank} may not raise the CPU priority of its checkpoint copies (that needs "
                  "CAP_SYS_NICE or `ulimit -e 20`): on a host whose cores are all busy they wait for an idle core",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        """End the copies' process (once its copies are done: `wait` first)."""
        if self._process is not None:
            assert self._process.stdin is not None
            self._process.stdin.close()  # (its orders end: it exits)
            try:
                self._process.wait(timeout=CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process, self._pending = None, False

    def _spawn(self) -> subprocess.Popen | ForkedCopies:
        """Start this rank's copies' process (it joins the others' at the rendezvous store): the one `prefork` made,
        else a fresh one."""
        where = {"out": str(self.out), "rank": self.rank, "plan": self.plan, "name": self.name,
                 "timeout": self.timeout.total_seconds(), "parent": os.getpid()}
        forked = take_preforked()
        if forked is not None:
            try:  # (with this rank's environment now: the rank has set what its groups need since, GLOO_SOCKET_IFNAME)
                assert forked.stdin is not None
                forked.stdin.write(json.dumps({**where, "env": dict(os.environ)}).encode() + b"\n")
                forked.stdin.flush()
                return forked
            except OSError:  # (it died: one is started afresh)
                forked.close()
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        return subprocess.Popen([sys.executable, "-m", "aqpipe.runtime.checkpoints.copier", json.dumps(where)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)

    def _read(self, block: bool) -> None:
        """Take what the copies' process reported: bytes sent (counted as checkpoint traffic), a step's end. `block`:
        wait for one report at least."""
        if self._process is None or self._process.stdout is None:
            return
        fd = self._process.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], None if block else 0)
            if not ready:
                return
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # it ended: nothing more will come
                if self._pending:
                    self.problem = "the copies' process ended"
                self._pending = False
                self._process.wait()
                self._process = None
                return
            self._unread += chunk
            *lines, self._unread = self._unread.split(b"\n")
            for line in lines:
                report = json.loads(line)
                comm.TRAFFIC.add(comm.CHECKPOINT, report.get("sent", 0))
                if "expect" in report:  # (the copy's paced time, every part of it counted)
                    self._paced(report["expect"])
                if "ready" in report and self._hurried:  # (it lowered itself after a hurry: hurried again)
                    set_priority(self._process.pid, idle=False)
                if "done" in report:
                    self._pending, self.problem = False, report["problem"]
                    if self._hurried:  # (the next copy starts on idle cores again)
                        set_priority(self._process.pid, idle=True)
                        self._hurried = False
            block = False


def run_copies(where: dict, orders, reports) -> None:
    """The copies' process: join the other ranks' at the rendezvous store, then copy each step `orders` names (JSON
    lines; an UNPACE line lifts the pace of this copy and the next), writing to `reports` the bytes sent (at most
    every REPORT_SECONDS) and each step's end."""
    import torch.distributed as dist

    rank, plan = where["rank"], {int(src): holders for src, holders in where["plan"].items()}
    timeout = timedelta(seconds=where["timeout"])
    address = "127.0.0.1" if os.environ.get(LOOPBACK_ENV) == "1" else os.environ["MASTER_ADDR"]
    store = dist.TCPStore(address, int(os.environ["MASTER_PORT"]), None, False, timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"aqpipe/copies/{where['name']}", store), rank=rank,
                            world_size=len(plan), timeout=timeout)
    unpaced = threading.Event()
    for order in _orders(orders, unpaced):
        step, unsent, told = order["step"], 0, time.monotonic()

        def sent(nbytes: int) -> None:
            nonlocal unsent, told
            unsent += nbytes
            if time.monotonic() - told >= REPORT_SECONDS:
                _report(reports, {"sent": unsent})
                unsent, told = 0, time.monotonic()

        problem = ""
        try:
            copy_step(Path(where["out"]), step, rank, plan, None, order["rate"], sent,
                      planned=lambda seconds: _report(reports, {"expect": seconds}), timeout=timeout.total_seconds(),
                      unpaced=unpaced)
        except Exception as e:  # noqa: BLE001 - told to every rank below
            problem = f"rank {rank}: {type(e).__name__}: {e}"
        verdicts: list = [None] * len(plan)
        dist.all_gather_object(verdicts, problem)
        failed = [v for v in verdicts if v]
        if failed and rank == 0:
            print(f"aqpipe: the copies of the checkpoint of step {step} to other hosts failed ({failed[0]}); it counts "
                  "as complete only while every part is on its own host", file=sys.stderr, flush=True)
        elif not failed and order["leader"]:
            write_atomic(step_dir(where["out"], step) / REPLICATED, b"", durable=True)
        _report(reports, {"sent": unsent, "done": step, "problem": failed[0] if failed else ""})


def _orders(lines, unpaced: threading.Event) -> Iterator[dict]:
    """The copy orders among `lines` (JSON), read by a thread of their own so that the rank's UNPACE sets `unpaced`
    while a copy travels; ends with `lines`."""
    orders: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for line in lines:
                message = json.loads(line)
                if message == UNPACE:
                    unpaced.set()
                else:
                    orders.put(message)
        finally:  # (a line it cannot read ends the orders too, rather than leave the copies waiting for more)
            orders.put(None)

    threading.Thread(target=read, name="aqpipe-copy-orders", daemon=True).start()
    while (order := orders.get()) is not None:
        yield order


def set_priority(pid: int, idle: bool) -> bool:
    """Make every thread of process `pid` (and the threads they start) run, with `idle`, at nice `NICE` and only on a
    core no other work wants (Linux's SCHED_IDLE, which any waking thread of another policy preempts at once), else
    under SCHED_OTHER at this process's nice value; returns whether every thread took it."""
    tasks = Path(f"/proc/{pid}/task")
    has_idle = hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")
    took = True
    # (on Linux both are a thread's own, and importing torch has started threads of its own already)
    for thread in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [pid]:
        try:
            if idle:
                os.setpriority(os.PRIO_PROCESS, thread, NICE)
                if has_idle:
                    os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
            elif has_idle:
                os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, 0))
        except ProcessLookupError:  # (a thread that ended)
            pass
        except OSError:  # (a kernel without SCHED_IDLE, a sandbox that forbids it, no right to leave it)
            took = False
    return took


def _report(reports, report: dict) -> None:
    reports.write(json.dumps(report).encode() + b"\n")
    reports.flush()


def serve(where: dict, orders, reports) -> None:
    """The copies' process, whichever way it started: at the lowest priority, copy what `orders` asks; never
    returns."""
    os.dup2(2, 1)  # (anything else printed goes to the rank's stderr, never into the reports)
    set_priority(os.getpid(), idle=True)  # (before gloo starts its threads: they take it too)
    _report(reports, {"ready": True})  # (a rank that hurried it meanwhile does so again)
    code = 0
    try:
        run_copies(where, orders, reports)
        reports.close()
    except BaseException:  # noqa: BLE001 - told on stderr, then os._exit: the interpreter's shutdown would abort
        traceback.print_exc()  # on the orders' reader thread, which holds stdin's lock
        code = 1
    # no tear-down of the group: the other ranks' copies' processes end at the same moment, and a gloo group
    # destroyed while its peers close theirs can wait on them
    os._exit(code)


def main() -> None:
    """Entry point of a copies' process started afresh (its rank starts it)."""
    where = json.loads(sys.argv[1])
    die_with(where["parent"])
    import torch.distributed  # noqa: F401 - at the rank's priority: once, and the first copies wait for it

    serve(where, sys.stdin.buffer, os.fdopen(os.dup(1), "wb"))


if __name__ == "__main__":
    main()
