"""What torchrun's elastic rendezvous needs for a host to leave a job and come back, shown on a program with no
aqpipe in it: three simulated hosts (tests/hosts.py: network namespaces, names that resolve), each running
`torchrun --nnodes 3 --nproc-per-node 1 … --max-restarts 3` over a gloo program that all-reduces a tensor every
0.2 s for 60 steps. Once every rank has done 10 steps, host 1 dies whole (its torchrun and its rank SIGKILLed) and
the same command starts again in its place. A row passes when every host's torchrun exits 0 within the time limit
and each host's newest rank finished its 60 steps.

    sudo python benchmarks/elastic_membership.py --out benchmarks/results/elastic-membership

Rows: the static rendezvous (`--node-rank`, `--master-addr`), torchrun's c10d rendezvous as it comes, and c10d
with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (a store of its own for each rendezvous round; aqpipe's ranks refuse
c10d without it wherever restarts may come: `aqpipe.pipeline.links.rendezvous.elastic_attempt`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hosts import ELASTIC_ENV, Hosts, simulated_hosts, wait_all  # noqa: E402

STEPS = 60
PROGRAM = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
x = torch.ones(4)
for step in range(1, STEPS + 1):
    dist.all_reduce(x)
    x.fill_(1.0)
    print(f"rank {dist.get_rank()} start {start} step {step}", flush=True)
    time.sleep(0.2)
dist.destroy_process_group()
""".replace("STEPS", str(STEPS))

SETTINGS = {
    "static rendezvous": ({}, False),
    "c10d rendezvous, torchrun's defaults": ({}, True),
    "c10d rendezvous, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": (ELASTIC_ENV, True),
}


def torchrun(hosts: Hosts, host: int, program: Path, elastic: bool) -> list[str]:
    """The torchrun command host `host` types for `program`."""
    if elastic:
        where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.name(0)}:{hosts.port}", "--rdzv-id", "repro"]
    else:
        where = ["--node-rank", str(host), "--master-addr", hosts.topology.address(0), "--master-port", str(hosts.port)]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts.count), "--nproc-per-node", "1",
            *where, "--max-restarts", "3", str(program)]


def start(hosts: Hosts, host: int, program: Path, env: dict, elastic: bool) -> subprocess.Popen:
    """Host `host`'s torchrun, its output appended to torchrun.log on its disk."""
    log = open(hosts.disk(host) / "torchrun.log", "ab")
    try:
        return subprocess.Popen(hosts.command(host, torchrun(hosts, host, program, elastic)), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    finally:
        log.close()


def steps_done(hosts: Hosts) -> dict[tuple[int, str], int]:
    """(rank, start) → the highest step it printed, over every host's log."""
    done: dict[tuple[int, str], int] = {}
    for host in range(hosts.count):
        for rank, begun, step in re.findall(r"rank (\d+) start (\d+) step (\d+)", _log(hosts, host)):
            key = (int(rank), begun)
            done[key] = max(done.get(key, 0), int(step))
    return done


def last_step(hosts: Hosts, host: int) -> int:
    """The step of the last progress line in host `host`'s log (that of its newest rank), 0 if none."""
    steps = re.findall(r"rank \d+ start \d+ step (\d+)", _log(hosts, host))
    return int(steps[-1]) if steps else 0


def _log(hosts: Hosts, host: int) -> str:
    return (hosts.disk(host) / "torchrun.log").read_text(errors="replace")


def one(root: Path, name: str, env: dict, elastic: bool, limit: float) -> dict:
    """Run the scenario under one setting; what happened."""
    work = root / re.sub(r"\W+", "-", name)
    shutil.rmtree(work, ignore_errors=True)  # (the logs are appended to)
    with simulated_hosts(work, 3, 1, 200_000_000, port=29641) as hosts:
        program = hosts.mount / "allreduce.py"
        for host in range(hosts.count):
            hosts.on_disk(host, program).write_text(PROGRAM)
        procs = [start(hosts, h, program, env, elastic) for h in range(hosts.count)]
        began = time.monotonic()
        while not (len(steps_done(hosts)) >= 3 and min(steps_done(hosts).values()) >= 10):
            if time.monotonic() - began > 120 or any(p.poll() is not None for p in procs):
                codes = wait_all(procs, 5)
                return {"setting": name, "passed": False, "exit codes": codes, "seconds": None,
                        "what happened": "the job never reached step 10", "tail": _tail(hosts)}
            time.sleep(0.2)
        hosts.kill(procs[1])
        procs[1] = start(hosts, 1, program, env, elastic)
        lost = time.monotonic()
        codes = wait_all(procs, limit)
        seconds = round(time.monotonic() - lost, 1)
        finished = [host for host in range(hosts.count) if last_step(hosts, host) == STEPS]
        passed = codes == [0, 0, 0] and finished == [0, 1, 2]
        happened = (f"every host's rank of the last round did its {STEPS} steps" if passed else
                    f"exit codes {codes} ({-9} = still running after {limit:.0f} s, killed); hosts whose last rank "
                    f"did its {STEPS} steps: {finished or 'none'}")
        return {"setting": name, "passed": passed, "exit codes": codes, "seconds": seconds, "what happened": happened,
                "tail": "" if passed else _tail(hosts)}


def _tail(hosts: Hosts) -> str:
    """The last lines of every host's log that are not the program's own progress."""
    lines = []
    for host in range(hosts.count):
        text = _log(hosts, host).splitlines()
        lines += [f"host {host}: {line}" for line in text if " step " not in line][-6:]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="elastic-membership", help="writes OUT.json and OUT.md")
    parser.add_argument("--limit", type=float, default=180, help="seconds a job may take after the host is lost")
    parser.add_argument("--work", default="/tmp/aqpipe-elastic-membership", help="where the hosts' disks go")
    args = parser.parse_args()
    rows = [one(Path(args.work), name, env, elastic, args.limit) for name, (env, elastic) in SETTINGS.items()]
    Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = ["| setting | host 1 lost and started again | seconds from the loss to the end |", "|---|---|---|"]
    table += [f"| {r['setting']} | {'**finishes**: ' if r['passed'] else '**fails**: '}{r['what happened']} | "
              f"{r['seconds'] if r['passed'] else '—'} |" for r in rows]
    Path(f"{args.out}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    for r in rows:
        if r["tail"]:
            print(f"\n--- {r['setting']}\n{r['tail']}")


if __name__ == "__main__":
    main()
