"""Where a checkpoint is served from, measured with torchft's checkpoint transport (HTTPTransport, torchft 0.2.0):
from a thread of the training process, as torchft serves a healthy replica's state to one that rejoins, or from a
process of its own at idle priority (SCHED_IDLE), as aqpipe's checkpoint copies are sent. Two simulated hosts
(tests/hosts.py) joined by a 100 Mbit/s link; on host 0 a training loop (eight 256×256 linear layers, batch 64,
SGD, one thread) runs while host 1 fetches a 10.6 MB state dict (the size of a LoRA part of SmolLM2-135M with its
AdamW moments) twice in a row, then waits 2 s, twelve times over. Reported: the median fetch time, and the training
loop's slowdown: for each burst of fetches, the median iteration while it ran over the median iteration of the quiet
gap after it; the median over the bursts (so that the machine's drift over a minute cancels).

    pip install --no-deps torchft==0.2.0 && pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http \
        opentelemetry-exporter-otlp-proto-grpc
    sudo python benchmarks/torchft_transport.py --runs 3 --out benchmarks/results/torchft-transport
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_loss import wait_for  # noqa: E402

STATE_MB = 10.6
BURSTS = 12
FETCHES_PER_BURST = 2
GAP_SECONDS = 2.0
LOOP_SECONDS = 75.0
START_SECONDS = 5.0
PLACEMENTS = ("a thread of the training process", "a process of its own, SCHED_IDLE")


def state_dict() -> dict:
    """STATE_MB of float32 tensors in 16 entries."""
    import torch

    per = int(STATE_MB * 1e6 / 4 / 16)
    return {f"p{i}": torch.randn(per) for i in range(16)}


def serve(port_file: Path, idle: bool):
    """Start an HTTPTransport serving the state dict as step 1; write its port to `port_file`."""
    from torchft.checkpointing.http_transport import HTTPTransport

    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    transport = HTTPTransport(timeout=timedelta(seconds=120), num_chunks=0)
    transport.send_checkpoint([1], 1, state_dict(), timedelta(seconds=60))
    port_file.write_text(transport.address().rsplit(":", 1)[1].split("/")[0])
    return transport


def train(seconds: float) -> list[tuple[float, float]]:
    """(start, seconds) of each iteration (5 SGD steps) of a small training loop run for `seconds`."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    iterations = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        for _ in range(5):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        iterations.append((began, time.monotonic() - began))
    return iterations


def fetch(url: str, bursts: int) -> list[list[tuple[float, float]]]:
    """(start, seconds) of each fetch of the checkpoint at `url`, burst by burst."""
    from torchft.checkpointing.http_transport import HTTPTransport

    done = []
    for _ in range(bursts):
        burst = []
        for _ in range(FETCHES_PER_BURST):
            began = time.monotonic()
            HTTPTransport._load_from_address(url, timedelta(seconds=120))
            burst.append((began, time.monotonic() - began))
        done.append(burst)
        time.sleep(GAP_SECONDS)
    return done


def child(role: str, args: list[str]) -> None:
    """The processes the measurement starts on the simulated hosts."""
    import torch

    torch.set_num_threads(1)
    if role == "server":
        serve(Path(args[0]), idle=True)
        time.sleep(3600)
    elif role == "trainer":
        port_file, serving, out = Path(args[0]), args[1] == "thread", Path(args[2])
        if serving:
            serve(port_file, idle=False)  # (its server thread serves while the loop trains)
        else:
            port_file.write_text("")
        out.write_text(json.dumps(train(LOOP_SECONDS)))
    elif role == "fetch":
        print(json.dumps(fetch(args[0], int(args[1]))))


def measure(hosts, placement: str) -> dict:
    """One run of one placement on the simulated hosts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    me = [sys.executable, str(Path(__file__).resolve())]
    port_file, iterations = hosts.mount / "port", hosts.mount / "iterations.json"
    for path in (port_file, iterations):
        hosts.on_disk(0, path).unlink(missing_ok=True)
    in_thread = placement == PLACEMENTS[0]
    server = None if in_thread else subprocess.Popen(hosts.command(0, [*me, "server", str(port_file)]), env=env)
    if server:
        wait_for(lambda: hosts.on_disk(0, port_file).exists() and hosts.on_disk(0, port_file).read_text(), 60,
                 "the checkpoint server")
        port = hosts.on_disk(0, port_file).read_text()
        hosts.on_disk(0, port_file).unlink()
    trainer = subprocess.Popen(hosts.command(0, [*me, "trainer", str(port_file), "thread" if in_thread else "none",
                                                 str(iterations)]), env=env)
    wait_for(lambda: hosts.on_disk(0, port_file).exists(), 60, "the training loop")
    time.sleep(0.5)
    port = hosts.on_disk(0, port_file).read_text() if in_thread else port
    time.sleep(START_SECONDS)
    url = f"http://{hosts.topology.address(0)}:{port}/checkpoint/1/full"
    fetched = subprocess.run(hosts.command(1, [*me, "fetch", url, str(BURSTS)]), env=env, capture_output=True,
                             text=True, check=True)
    trainer.wait()
    if server:
        server.kill()
        server.wait()
    bursts = json.loads(fetched.stdout.strip().splitlines()[-1])
    loop = json.loads(hosts.on_disk(0, iterations).read_text())
    ratios = []
    for burst in bursts:
        first, last = burst[0][0], burst[-1][0] + burst[-1][1]
        during = [d for t, d in loop if first <= t and t + d <= last]
        quiet = [d for t, d in loop if last + 0.2 <= t and t + d <= last + GAP_SECONDS - 0.1]
        ratios.append(statistics.median(during) / statistics.median(quiet))
    seconds = statistics.median(d for burst in bursts for _, d in burst)
    return {"placement": placement, "fetch s": round(seconds, 3), "Mbit/s": round(STATE_MB * 8 / seconds, 1),
            "slowdown %": round(100 * (statistics.median(ratios) - 1), 1),
            "slowdown % per burst": [round(100 * (r - 1), 1) for r in ratios]}


def main() -> None:
    from tests.hosts import simulated_hosts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="torchft-transport", help="writes OUT.json and OUT.md")
    parser.add_argument("--work", default="/tmp/aqpipe-torchft-transport", help="where the hosts' disks go")
    args = parser.parse_args()
    rows = []
    with simulated_hosts(Path(args.work), 2, 1, 100_000_000, port=29651) as hosts:
        for run in range(args.runs):
            for placement in PLACEMENTS:
                rows.append({"run": run + 1, **measure(hosts, placement)})
                print(rows[-1], flush=True)
    Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = ["| served from | fetch of 10.6 MB (s) | training loop slowdown while fetched, per run | median |",
             "|---|---|---|---|"]
    for placement in PLACEMENTS:
        mine = [r for r in rows if r["placement"] == placement]
        table.append(f"| {placement} | {statistics.median(r['fetch s'] for r in mine):.2f} | "
                     + ", ".join(f"{r['slowdown %']:+.1f}%" for r in mine)
                     + f" | {statistics.median(r['slowdown %'] for r in mine):+.1f}% |")
    Path(f"{args.out}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("server", "trainer", "fetch"):
        child(sys.argv[1], sys.argv[2:])
    else:
        main()
