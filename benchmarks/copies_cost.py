"""What a checkpoint's copies cost the hosts that send and keep them, and the messages that share their link: four
simulated hosts (tests/hosts.py, 100 Mbit/s links shaped by tc tbf), each rank's copies' code (`copy_step`, in a
process at the lowest CPU priority, as aqpipe runs it) sending a 10 MiB part (a LoRA part of SmolLM2-135M with its
AdamW moments) to the next host at 1.25 MB/s (a tenth of the link: `--checkpoint-share 0.1`), while a probe on host 0
sends a 64 KiB message (a step's activations) to host 1 every 100 ms and times its acknowledgement. Variants:

- `kernel`: as aqpipe copies: each copy on a TCP stream the kernel paces packet by packet (SO_MAX_PACING_RATE), its
  receiver woken once a quarter MiB has arrived (SO_RCVLOWAT);
- `pieces`: the same streams paced by their sender, 16 KiB at a time (within a shaped link's burst) with TCP_NODELAY,
  so that the packet work runs in the sending process rather than from the kernel's timers;
- `every-packet`: as aqpipe, the receiver woken for every packet;
- `half-rate`: as aqpipe, at half the rate (0.625 MB/s: `--checkpoint-share 0.05`), to tell a cost per byte from a
  cost per second of copying;
- `none`: the probe alone.

Reported per variant (median over the runs): the copies' processes' CPU seconds (user and system, the four hosts
together), the machine's softirq seconds while they ran (the kernel's packet work: veth, the bridge, tbf), the
packets and the times tbf held one back (overlimits) on the hosts' links, and the probe's median, 90th percentile
and mean time. With `--where` two busy processes stand for the ranks (each 90% of a core, at normal priority) and
the machine is sampled by `perf record -a -g`: the softirq samples are counted by the task they ran in (whose CPU time
they took): the busy processes, the copies' processes, the idle task, any other.

    sudo python benchmarks/copies_cost.py --runs 3 --out benchmarks/results/copies-cost [--where]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import provenance  # noqa: E402

HOSTS = 4
RATE_BITS = 100_000_000
PART_BYTES = 10 << 20
COPY_RATE = 1.25e6
PROBE_BYTES = 64 << 10
PROBE_EVERY = 0.1
VARIANTS = ("kernel", "pieces", "every-packet", "half-rate", "none")
BUSY, COPIES = "aqpipe-busy", "aqpipe-copies"  # the task names `--where` counts by
SOFTIRQ = ("handle_softirqs", "__do_softirq", "net_rx_action")  # a sample in the kernel's packet work
STORE_PORT, PROBE_PORT = 29811, 29812


def copier(host: int, out: str, master: str, variant: str) -> None:
    """One host's copies' code: its part written, the group met, its part sent and the previous host's kept."""
    Path("/proc/self/comm").write_text(COPIES)  # (before any thread, torch's included: they take the name)
    from datetime import timedelta

    import torch.distributed as dist

    from aqpipe.runtime.checkpoints import copies
    from aqpipe.runtime.checkpoints.copier import set_priority
    from aqpipe.runtime.checkpoints.parts import rank_file, step_dir

    set_priority(os.getpid(), idle=True)
    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(STORE_PORT))  # (where the streams' address is found from)
    if variant == "pieces":
        copies._send = sender_paced_send
    if variant == "every-packet":
        copies.RECEIVE_LOW_WATER = 1
    directory = step_dir(out, 1)
    directory.mkdir(parents=True, exist_ok=True)
    data = os.urandom(PART_BYTES)
    rank_file(directory, host).write_bytes(data)
    rank_file(directory, host).with_suffix(".sha256").write_text(f"{hashlib.sha256(data).hexdigest()} rank={host}\n")
    store = dist.TCPStore(master, STORE_PORT, HOSTS, host == 0, timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=host, world_size=HOSTS)
    plan = copies.copy_plan([f"host-{h}" for h in range(HOSTS)], 1)
    dist.barrier()
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.time()
    rate = COPY_RATE / 2 if variant == "half-rate" else COPY_RATE
    copies.copy_step(Path(out), 1, host, plan, None, rate, sent=lambda nbytes: None, timeout=60)
    after, end = resource.getrusage(resource.RUSAGE_SELF), time.time()
    print(json.dumps({"user": after.ru_utime - before.ru_utime, "system": after.ru_stime - before.ru_stime,
                      "start": start, "end": end}), flush=True)
    dist.barrier()
    os._exit(0)


def sender_paced_send(stream, part, size, rate, counted, problems, timeout) -> None:
    """`copies._send` with the sender pacing the stream itself: 16 KiB at a time with TCP_NODELAY, a piece's time
    after the last (never sooner: a late piece is not made up for)."""
    try:
        stream.settimeout(timeout)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with open(part, "rb") as file:
            done, due = 0, time.monotonic()
            while done < size:
                time.sleep(max(0.0, due - time.monotonic()))
                began = time.monotonic()
                count = stream.sendfile(file, offset=done, count=min(16 << 10, size - done))
                if count == 0:
                    problems.append(f"reading its part: it ended {size - done} bytes early")
                    return
                done += count
                counted.add(count)
                due = max(due, began) + count / rate
    except Exception as e:  # noqa: BLE001 - as copies._send
        problems.append(f"sending its part: {e}")
    finally:
        stream.close()


def busy() -> None:
    """A stand-in for a rank: arithmetic 90% of the time, at normal priority, until killed."""
    Path("/proc/self/comm").write_text(BUSY)
    units = 0
    while True:
        x = 0
        for i in range(20_000):
            x += i * i
        units += 1
        if units % 8 == 0:
            time.sleep(0.0015)


def softirq_by_task(data: Path) -> dict:
    """perf's samples from `data` in the kernel's packet work, by the task they ran in; and all samples of the busy
    processes."""
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,ip,sym"], capture_output=True, text=True,
                          check=True).stdout
    found = {"busy": 0, "copies": 0, "idle": 0, "other": 0, "busy_all": 0}
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        if not lines:
            continue
        comm = lines[0].split()[0]
        kind = {BUSY: "busy", COPIES: "copies", "swapper": "idle"}.get(comm, "other")
        found["busy_all"] += kind == "busy"
        if any(name in block for name in SOFTIRQ):
            found[kind] += 1
    return found


def probe_server() -> None:
    """Host 1: acknowledge every message of PROBE_BYTES."""
    server = socket.create_server(("0.0.0.0", PROBE_PORT))
    conn, _ = server.accept()
    buffer = memoryview(bytearray(PROBE_BYTES))
    while True:
        got = 0
        while got < PROBE_BYTES:
            count = conn.recv_into(buffer[got:])
            if not count:
                return
            got += count
        conn.sendall(b"k")


def probe_client(address: str, seconds: float) -> None:
    """Host 0: a message every PROBE_EVERY seconds for `seconds`; prints each one's (start, seconds to its ack)."""
    for _ in range(200):
        try:
            conn = socket.create_connection((address, PROBE_PORT))
            break
        except OSError:
            time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, times, end = b"x" * PROBE_BYTES, [], time.time() + seconds
    while time.time() < end:
        start = time.time()
        conn.sendall(payload)
        conn.recv(1)
        times.append((start, time.time() - start))
        time.sleep(PROBE_EVERY)
    print(json.dumps(times), flush=True)


def softirq_sampler(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        with open("/proc/stat") as f:
            samples.append((time.time(), int(f.readline().split()[7])))
        stop.wait(0.05)


def qdisc_counts(namespace: str) -> tuple[int, int]:
    """Packets sent and overlimits of the tbf qdisc in `namespace`."""
    text = subprocess.run(["tc", "-n", namespace, "-s", "qdisc"], capture_output=True, text=True).stdout
    tbf = text[text.index("qdisc tbf"):]
    return (int(re.search(r"Sent \d+ bytes (\d+) pkt", tbf).group(1)),
            int(re.search(r"overlimits (\d+)", tbf).group(1)))


def one_run(variant: str, work: Path, where: bool = False) -> dict:
    """The copies of one variant (or the probe alone) on fresh simulated hosts (`where`: beside busy processes, under
    perf)."""
    from tests.hosts import simulated_hosts

    shutil.rmtree(work, ignore_errors=True)
    with simulated_hosts(work, HOSTS, 1, RATE_BITS, port=STORE_PORT) as hosts:
        me = [sys.executable, __file__]
        server = subprocess.Popen(hosts.command(1, [*me, "--probe-server"]))
        busy_ones = [subprocess.Popen([*me, "--busy"]) for _ in range(2)] if where else []
        perf = (subprocess.Popen(["perf", "record", "-a", "-g", "-q", "-o", str(work / "perf.data")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if where else None)
        copiers = [] if variant == "none" else [
            subprocess.Popen(hosts.command(h, [*me, "--copier", str(h), str(hosts.mount), hosts.topology.address(0),
                                               variant]), stdout=subprocess.PIPE, text=True) for h in range(HOSTS)]
        probe = subprocess.Popen(hosts.command(0, [*me, "--probe-client", hosts.topology.address(1), "16"]),
                                 stdout=subprocess.PIPE, text=True)
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=softirq_sampler, args=(samples, stop), daemon=True)
        sampler.start()
        copied = [json.loads(c.communicate()[0].strip().splitlines()[-1]) for c in copiers]
        probes = json.loads(probe.communicate()[0].strip().splitlines()[-1])
        server.kill()
        for proc in busy_ones:
            proc.kill()
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait()
        stop.set()
        sampler.join()
        counts = [qdisc_counts(hosts.topology.namespace(h)) for h in range(HOSTS)]
    if copied:
        begin, end = min(c["start"] for c in copied), max(c["end"] for c in copied)
    else:
        begin, end = probes[len(probes) // 4][0], probes[-1][0]  # (after the probe's own start)
    inside = [(t, v) for t, v in samples if begin <= t <= end]
    during = sorted(seconds for start, seconds in probes if begin <= start <= end)
    return {
        "variant": variant, "seconds": end - begin,
        "cpu_user": sum(c["user"] for c in copied), "cpu_system": sum(c["system"] for c in copied),
        "softirq": (inside[-1][1] - inside[0][1]) / os.sysconf("SC_CLK_TCK") if len(inside) > 1 else None,
        "packets": sum(p for p, _ in counts), "overlimits": sum(o for _, o in counts),
        "softirq_samples": softirq_by_task(work / "perf.data") if where else None,
        "probe_ms": {"median": 1000 * statistics.median(during), "p90": 1000 * during[int(0.9 * (len(during) - 1))],
                     "mean": 1000 * statistics.mean(during), "count": len(during)},
    }


def summarize(runs: list[dict]) -> dict:
    def median(key, sub=None):
        values = [r[key][sub] if sub else r[key] for r in runs if (r[key][sub] if sub else r[key]) is not None]
        return statistics.median(values) if values else None

    copied_mb = 0 if runs[0]["variant"] == "none" else HOSTS * PART_BYTES / 1e6
    cpu = median("cpu_user") + median("cpu_system")
    return {"variant": runs[0]["variant"], "runs": len(runs), "seconds": median("seconds"),
            "cpu_user": median("cpu_user"), "cpu_system": median("cpu_system"), "softirq": median("softirq"),
            "cpu_ms_per_mb": 1000 * cpu / copied_mb if copied_mb else None,
            "softirq_ms_per_mb": 1000 * median("softirq") / copied_mb if copied_mb else None,
            "packets": median("packets"), "overlimits": median("overlimits"),
            "probe_ms": {k: median("probe_ms", k) for k in ("median", "p90", "mean")},
            "softirq_samples": ({k: median("softirq_samples", k) for k in runs[0]["softirq_samples"]}
                                if runs[0].get("softirq_samples") else None)}


def net_of_probe(rows: list[dict]) -> None:
    """Each copying row's softirq per MB less what the probe alone (`none`) took in as long."""
    alone = next((r for r in rows if r["variant"] == "none"), None)
    for r in rows:
        r["softirq_net"] = (r["softirq"] - alone["softirq"] / alone["seconds"] * r["seconds"]
                            if alone and r["cpu_ms_per_mb"] else None)
        r["softirq_net_ms_per_mb"] = (1000 * r["softirq_net"] / (HOSTS * PART_BYTES / 1e6)
                                      if r["softirq_net"] is not None else None)


def cores_percent(seconds: float | None, over: float) -> str:
    """`seconds` of CPU over `over` seconds of wall time, as a share of all the machine's cores."""
    return "-" if seconds is None else f"{100 * seconds / over / (os.cpu_count() or 1):.2f}%"


def write_markdown(rows: list[dict], path: Path, commit: str) -> None:
    lines = [f"Checkpoint copies between {HOSTS} simulated hosts ({RATE_BITS // 10**6} Mbit/s links), a "
             f"{PART_BYTES >> 20} MiB part each at {COPY_RATE / 1e6:.2f} MB/s (half-rate: half that); commit {commit}, "
             f"{platform.node()}, {os.cpu_count()} cores; median of {rows[0]['runs']} runs.", "",
             "| variant | copy s | copies' CPU s (user + system) | ms CPU per MB | softirq s | ms softirq per MB (less the "
             "probe's) | softirq, share of both cores while copying (less the probe's) | packets | tbf overlimits | "
             "64 KiB probe ms: median / p90 / mean |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(value, digits=2):
            return "-" if value is None else f"{value:.{digits}f}"
        probe = r["probe_ms"]
        softirq_share = (f"{cores_percent(r['softirq'], r['seconds'])} ({cores_percent(r['softirq_net'], r['seconds'])})"
                         if r["cpu_user"] else "- (-)")
        lines.append(f"| {r['variant']} | {f(r['seconds'], 1) if r['cpu_user'] else '-'} | "
                     f"{f(r['cpu_user'])} + {f(r['cpu_system'])} | {f(r['cpu_ms_per_mb'], 1)} | {f(r['softirq'])} | "
                     f"{f(r['softirq_ms_per_mb'], 1)} ({f(r['softirq_net_ms_per_mb'], 1)}) | "
                     f"{softirq_share} | {r['packets']:.0f} | "
                     f"{r['overlimits']:.0f} | "
                     f"{probe['median']:.1f} / {probe['p90']:.1f} / {probe['mean']:.1f} |")
    if rows[0].get("softirq_samples"):
        lines += ["", "perf's samples in the kernel's packet work, by the task they ran in (two busy processes stand "
                  "for the ranks):", "",
                  "| variant | in the busy processes (share of all their samples) | in the copies' processes | "
                  "in the idle task | elsewhere |", "|---|---|---|---|---|"]
        for r in rows:
            n = r["softirq_samples"]
            lines.append(f"| {r['variant']} | {n['busy']:.0f} ({100 * n['busy'] / n['busy_all']:.2f}%) | "
                         f"{n['copies']:.0f} | {n['idle']:.0f} | {n['other']:.0f} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/copies-cost"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/aqpipe-copies-cost"))
    parser.add_argument("--where", action="store_true",
                        help="beside two busy processes, under `perf record`: where the packet work ran")
    args = parser.parse_args()
    if args.where and not shutil.which("perf"):
        parser.error("--where needs perf (Debian: apt install linux-perf)")
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for round_ in range(args.runs):  # (the variants interleaved: the machine's drift falls on each alike)
        for variant in variants:
            result = one_run(variant, args.work, args.where)
            runs[variant].append(result)
            print(f"run {round_ + 1} {variant}: {json.dumps(result)}", flush=True)
    rows = [summarize(runs[v]) for v in variants]
    net_of_probe(rows)
    commit = provenance.commit()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"commit": commit, "rows": rows, "runs": runs}, indent=1))
    write_markdown(rows, args.out.with_suffix(".md"), commit)
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--copier"]:
        copier(int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
    elif sys.argv[1:2] == ["--busy"]:
        busy()
    elif sys.argv[1:2] == ["--probe-server"]:
        probe_server()
    elif sys.argv[1:2] == ["--probe-client"]:
        probe_client(sys.argv[2], float(sys.argv[3]))
    else:
        main()
