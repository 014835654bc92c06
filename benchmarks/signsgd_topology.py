"""signSGD majority vote: aqpipe's ring (packed counts) vs an all-to-all exchange (the 1-bit-Adam pattern) when two
clusters of replicas are joined by one slow link — the All-Reducible signSGD paper's chain/cluster experiment.

Ranks 0..N/2−1 sit on one bridge and N/2..N−1 on another, every rank's own link shaped to --fast, the link
between the bridges to --slow (tc tbf, `aqpipe.launch.netns` with `slow_link_bits`). Each replica holds a
--numel gradient; the two methods compute the same majority vote:
- ring: `aqpipe.compress.grad.signsgd` — reduce-scatter of +1 counts in ⌈log2(i+1)⌉ bits, 1-bit all-gather;
  only two ring hops cross the slow link, one each way.
- all-to-all: each replica sends chunk j of its packed sign bits to replica j, which counts the votes and sends
  its majority chunk (1 bit) to every replica; every pair across the slow link uses it.

    python benchmarks/signsgd_topology.py --ranks 4,8 --rounds 3 --out benchmarks/results/signsgd_topology
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def all_to_all_majority(dp, flat, generator):
    """Majority vote of the replicas' signs by two all-to-all phases of packed bits; returns (±1 vector, bytes)."""
    import torch
    import torch.distributed as dist

    from aqpipe.compress.bitpack import pack, packed_bytes, unpack
    from aqpipe.compress.grad import ring
    from aqpipe.compress.grad.signsgd import majority

    n, me = dp.size, dp.index
    chunks = ring.split((flat > 0).to(torch.uint8), n)
    c = chunks[0].numel()

    def exchange(payloads):
        received = [payloads[me]] * n
        works = []
        for j in range(n):
            if j != me:
                works.append(dist.isend(payloads[j], dp.ranks[j], tag=0x4141))
                received[j] = torch.empty(packed_bytes(c, 1), dtype=torch.uint8)
                works.append(dist.irecv(received[j], dp.ranks[j], tag=0x4141))
        for w in works:
            w.wait()
        return received

    packed = [pack(chunk.view(1, -1), 1).view(-1) for chunk in chunks]
    votes = exchange(packed)
    count = sum(unpack(v.view(1, -1), 1, c).view(-1).to(torch.int32) for v in votes)
    mine = pack(majority(count, n, generator).view(1, -1), 1).view(-1)
    gathered = exchange([mine] * n)
    bits = torch.cat([unpack(g.view(1, -1), 1, c).view(-1) for g in gathered])[: flat.numel()]
    sent = 2 * (n - 1) * packed_bytes(c, 1)
    return bits.float().mul_(2).sub_(1), sent


def worker(method: str, numel: int, steps: int) -> None:
    """One replica: synchronize `steps` times after one warm-up; rank 0 prints seconds and bytes as JSON."""
    import torch
    import torch.distributed as dist

    from aqpipe.compress.grad import DPGroup
    from aqpipe.compress.grad.signsgd import SignSGD

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dp = DPGroup(None, tuple(range(world)), rank)
    generator = torch.Generator().manual_seed(rank)
    flat = torch.randn(numel, generator=generator)
    ring_sync = SignSGD(dp, seed=0)
    seconds, sent = [], []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        if method == "ring":
            before = ring_sync.bytes_sent
            ring_sync.combine(flat)
            nbytes = ring_sync.bytes_sent - before
        else:
            _, nbytes = all_to_all_majority(dp, flat, generator)
        dist.barrier()
        if step:
            seconds.append(time.perf_counter() - start)
            sent.append(nbytes)
    if rank == 0:
        print(json.dumps({"seconds": seconds, "bytes": sent}), flush=True)
    dist.destroy_process_group()


def run(method: str, ranks: int, args) -> dict:
    from aqpipe.launch import netns

    command = [sys.executable, __file__, "--worker", method, "--numel", str(args.numel), "--steps", str(args.steps)]
    with netns.throttled(ranks, netns.parse_rate(args.fast), slow_link_bits=netns.parse_rate(args.slow)) as topo:
        procs = [subprocess.Popen(topo.exec_prefix(r) + command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks),
                                                      MASTER_ADDR=topo.address(0), MASTER_PORT="29650",
                                                      GLOO_SOCKET_IFNAME=netns.INTERFACE, PYTHONPATH=str(ROOT)))
                 for r in range(ranks)]
        outputs = [p.communicate(timeout=1800) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{method} with {ranks} ranks failed: {outputs[0][1][-1500:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fast", default="500mbit")
    parser.add_argument("--slow", default="100mbit")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "signsgd_topology"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.numel, args.steps)
        return
    from benchmarks.provenance import machine, recorded

    results: dict = {}
    for ranks in [int(x) for x in args.ranks.split(",")]:
        results[ranks] = {"ring": [], "all-to-all": []}
        for r in range(args.rounds):
            for method in ("ring", "all-to-all"):
                measured = run(method, ranks, args)
                results[ranks][method].append(measured)
                print(f"round {r + 1} dp={ranks} {method:>10}: {statistics.median(measured['seconds']):.2f} s, "
                      f"{measured['bytes'][0] / 1e6:.2f} MB sent per replica", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine(), "settings": recorded(vars(args)),
                                                    "results": recorded(results)}, indent=2) + "\n")
    lines = [f"{args.numel / 1e6:.0f}M-value gradient; ranks' links {args.fast}, the link between the two halves "
             f"{args.slow}; median over {args.rounds} rounds × {args.steps} syncs.", "",
             "| dp | ring s/sync | all-to-all s/sync | ring speed-up | ring MB/replica | all-to-all MB/replica |",
             "|---|---|---|---|---|---|"]
    for ranks, by_method in results.items():
        med = {m: statistics.median(s for r in runs for s in r["seconds"]) for m, runs in by_method.items()}
        mb = {m: runs[0]["bytes"][0] / 1e6 for m, runs in by_method.items()}
        lines.append(f"| {ranks} | {med['ring']:.2f} | {med['all-to-all']:.2f} | {med['all-to-all'] / med['ring']:.2f}× | "
                     f"{mb['ring']:.2f} | {mb['all-to-all']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
