"""How the ranks of a run find each other (the rendezvous store, the interface gloo listens on) and agree, before any
collective, on what they must share."""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from aqpipe.compress.grad.methods import GradSpec, as_grad_spec

if TYPE_CHECKING:  # (the launcher imports this module before it may import torch: see launch/fork_safety)
    from aqpipe.pipeline.world.grid import ProcessGroups

# Set by `aqpipe launch` when every rank runs on this machine's loopback: the rendezvous binds to 127.0.0.1 only.
LOOPBACK_ENV = "AQPIPE_LOOPBACK"

# Start-up (each host loading or downloading its stage's weights, building its m(xi) store, rank 0 profiling a time
# partition, a resume checking every host's checkpoints) may keep one rank from the run's first collectives far
# longer than a step may take, so until training begins the rendezvous store and every process group wait this long
# (or --stall-timeout, when that is longer); `begin_training` then gives them the stall time-out.
STARTUP_TIMEOUT_SECONDS = 1800.0


def startup_timeout(stall_timeout: float) -> timedelta:
    """How long the rendezvous and every collective wait for a late rank until training begins."""
    return timedelta(seconds=max(stall_timeout, STARTUP_TIMEOUT_SECONDS))


def begin_training(store, groups: ProcessGroups, stall_timeout: float) -> None:
    """Once every rank of the world has come here (waiting under the start-up time-out: a replica's host may still be
    loading its weights while another's pipeline is ready), every collective of the world group and of this rank's
    `groups`, and every wait on the rendezvous `store` (NCCL's communicators of a group used for the first time meet
    there), time out after `stall_timeout` seconds. Every rank calls it."""
    from torch.distributed import distributed_c10d

    from aqpipe.pipeline.world import comm

    comm.barrier(comm.SETUP)
    timeout = timedelta(seconds=stall_timeout)
    # (torch >= 2.2; the world group named, since 2.2 took None for it wrongly)
    every: tuple[Any, ...] = (distributed_c10d._get_default_group(), groups.pipeline, groups.data_parallel)
    for group in every:
        distributed_c10d._set_pg_timeout(timeout, group)
    store.set_timeout(timeout)


def barrier_after_slow_work(stall_timeout: float) -> None:
    """A world barrier that waits for the slowest rank up to the start-up time-out, after work whose time scales with
    a rank's state rather than with a step (writing a checkpoint: an in-memory m(xi) store or Adam's moments on a slow
    disk take minutes); the world group's collectives time out after `stall_timeout` again afterwards. Every rank
    calls it."""
    from torch.distributed import distributed_c10d

    from aqpipe.pipeline.world import comm

    world = distributed_c10d._get_default_group()
    distributed_c10d._set_pg_timeout(startup_timeout(stall_timeout), world)
    try:
        comm.barrier()
    finally:
        distributed_c10d._set_pg_timeout(timedelta(seconds=stall_timeout), world)


def loopback_rendezvous(rank: int, world_size: int, timeout: timedelta):
    """The rendezvous store of a single-machine launch, listening on 127.0.0.1 only (torch's own listens on every
    interface); None when this launch spans hosts or network namespaces (torch's env:// rendezvous then)."""
    if os.environ.get(LOOPBACK_ENV) != "1":
        return None
    import torch.distributed as dist

    port = int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen()
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=listener.fileno())
    listener.detach()  # the store's server owns the socket now
    return store


# The variable naming the interface each backend listens and connects on, and how it names one interface exactly
# (NCCL reads a bare name as a prefix: `eth0` would take eth01 too).
SOCKET_INTERFACE = {"gloo": ("GLOO_SOCKET_IFNAME", ""), "nccl": ("NCCL_SOCKET_IFNAME", "=")}


def pin_socket_interface(backend: str) -> str | None:
    """Across hosts, make the collectives' backend use the interface that reaches MASTER_ADDR. By default gloo
    advertises the address this host's name resolves to, which on many machines (and in network namespaces) is
    127.0.0.1, so that the other hosts cannot connect; NCCL, failing an `ib*` interface, takes its first that is
    neither loopback nor docker's, which may be a bridge the other hosts cannot reach (virbr0, cni0), and its first
    collective hangs. Sets the backend's variable (`SOCKET_INTERFACE`) unless the user set it or the run is on
    loopback; returns the value set (None: left alone)."""
    variable, exactly = SOCKET_INTERFACE[backend]
    if os.environ.get(variable) or os.environ.get(LOOPBACK_ENV) == "1":
        return None
    from aqpipe.pipeline.links.streams import StreamError, local_address

    try:
        address = local_address()
    except StreamError:
        return None
    if address.startswith("127."):
        return None
    name = interface_of(address)
    if name is None:
        return None
    os.environ[variable] = exactly + name
    return os.environ[variable]


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address` (None: none does)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


# Settings that may differ between hosts: where each host keeps its own files, and its launcher's port.
HOST_LOCAL_SETTINGS = frozenset({"out", "resume", "port"})


class HostDisagreement(ValueError):
    """The ranks of a run, started on different hosts, resolved something differently that they must share."""


def rendezvous_store(rank: int, world_size: int, timeout: timedelta):
    """The store every rank of the run meets at: a local launch's loopback one, else torch's env:// rendezvous
    (MASTER_ADDR/MASTER_PORT, or torchrun's agent store)."""
    store = loopback_rendezvous(rank, world_size, timeout)
    if store is not None:
        return store
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    attempt = elastic_attempt(store)
    return dist.PrefixStore(f"aqpipe/{attempt}", store) if attempt else store


def elastic_attempt(store) -> str | None:
    """What names this start of the ranks among a torchrun job's restarts, for keys in `store`, torchrun's agent's
    (None: the store is this start's own, or no restart can come). Torch no longer keys a worker's entries by start,
    so where torchrun keeps one store for every start of a job the ranks of a restart would read the dead start's (its
    gloo addresses: they dial processes that are gone, and the job hangs). The static rendezvous keeps its agents'
    store (where their role records lie), and every agent counts each restart — its ranks fail whenever one fails,
    their links broken — so its count names the start. The c10d rendezvous keeps a store of its own for every round
    under TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; without it, one store for all rounds and nothing a rank can read to
    name its round (an agent whose workers are healthy restarts them for another host's failure without counting it):
    RendezvousConflict then, where restarts are allowed."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if store.check([f"{run_id}/torchelastic/role_info/0"]):  # (torch.distributed.elastic.agent.server.api's key)
        return f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        raise RendezvousConflict(
            "torchrun's c10d rendezvous shares one store among its rounds, where a restart's ranks would find the "
            "dead ranks' addresses and hang: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun on every host")
    return None


class RendezvousConflict(ValueError):
    """A torchrun set-up whose restarts cannot work (exit 2, before any collective)."""


def exchange(store, rank: int, world_size: int, topic: str, value):
    """Every rank's `value` (JSON) on `topic`, in rank order: this rank's published in the store, everyone's read
    (waiting for them); the store is this launch attempt's (`rendezvous_store`)."""
    key = f"aqpipe/{topic}/{{}}"
    store.set(key.format(rank), json.dumps(value, sort_keys=True))
    return [json.loads(store.get(key.format(r))) for r in range(world_size)]


def agree(store, rank: int, world_size: int, facts: dict) -> None:
    """Every rank publishes `facts` (JSON values: device kind, backend, grid, the resolved configuration…) and
    checks everyone's, before any collective: a rank that chose otherwise (a host without a GPU picking gloo while
    the others pick NCCL, a host given another flag) would otherwise hang the rendezvous or train something else.
    Raises HostDisagreement naming the first fact that differs, with each rank's host and value: the configuration's
    first, since a fact worked out from it (a backend, a GPU fact named for a method) differs because it does."""
    everyone = exchange(store, rank, world_size, "agree", {"host": socket.gethostname(), "facts": facts})
    flat = [_flatten(e["facts"]) for e in everyone]
    for name in sorted(set().union(*flat), key=lambda name: (not name.startswith("config "), name)):
        values = [json.dumps(f.get(name), sort_keys=True) for f in flat]
        if len(set(values)) > 1:
            seen = "; ".join(f"rank {r} on {e['host']}: {_short(values[r])}" for r, e in enumerate(everyone)
                             if r == 0 or values[r] != values[0])
            hint = (" (give --device explicitly)" if name in ("device", "backend", "config device") else
                    "; use one GPU model for every replica, or another --grad-sync" if name.startswith(GPU_MODEL) else "")
            raise HostDisagreement(f"the ranks disagree on {name} ({seen}); every host must run the same command "
                                   f"with the same flags{hint}")


def gpu_identity(device) -> str | None:
    """The GPU a rank computes on, as NCCL tells GPUs apart: its host and PCI address (the index differs with
    CUDA_VISIBLE_DEVICES; MIG slices of one GPU, which NCCL refuses to pair, share the address but not the UUID);
    its UUID where torch gives no PCI address. None on the host."""
    if device.type != "cuda":
        return None
    import torch

    props = torch.cuda.get_device_properties(device)
    pci = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None in pci:
        return f"uuid {props.uuid}"
    return f"{socket.gethostname()} pci {pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}"


def collective_backend(store, rank: int, world_size: int, gpu: str | None) -> str:
    """The torch.distributed backend of every rank: NCCL when each computes on a GPU (`gpu`: `gpu_identity`) that no
    other rank uses, gloo otherwise — on the host, and where ranks share a GPU (NCCL refuses two ranks of one
    communicator on one device; collectives then stage through host memory: `grid.collective_device`). Each rank
    publishes its GPU and reads everyone's, so all choose alike."""
    gpus = exchange(store, rank, world_size, "gpu", gpu)
    return "nccl" if all(gpus) and len(set(gpus)) == len(gpus) else "gloo"


# The fact a run whose replicas must compute bit for bit alike on their GPUs adds (a --grad-sync method whose every
# replica computes the result, `MethodKind.replica_computed`, agrees bit for bit only on the same GPU model, CUDA and
# torch), followed by the method that needs it.
GPU_MODEL = "GPU model"


def replica_gpu_facts(grad_sync: GradSpec | str, dp: int, device) -> dict:
    """What the replicas' GPUs must share for `grad_sync` to keep them bit-identical: with a method whose every
    replica computes the result and dp > 1 on CUDA, the GPU model with the CUDA and torch versions (mismatched GPUs
    would fail the replica digest only at the first checkpoint, as diverged weights); nothing otherwise."""
    spec = as_grad_spec(grad_sync)
    if dp < 2 or device.type != "cuda" or not spec.kind.replica_computed:
        return {}
    import torch

    name = f"{GPU_MODEL} (--grad-sync {spec.method} computes on every replica)"
    return {name: f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}, torch {torch.__version__}"}


def _flatten(facts: dict) -> dict:
    """A dict fact (the configuration) as one fact per setting, so a disagreement names the setting."""
    flat = {}
    for name, value in facts.items():
        if isinstance(value, dict):
            flat.update({f"{name} {key}": inner for key, inner in value.items()})
        else:
            flat[name] = value
    return flat


def _short(value: str, limit: int = 80) -> str:
    return value if len(value) <= limit else value[: limit - 1] + "…"
