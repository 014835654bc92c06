"""`aqpipe store verify|stats|digest`: compare the two copies of m(ξ) on every link of a run (on one host, or across
hosts through digest files), and size up the stores."""

from __future__ import annotations

import hashlib
import json
import socket
from collections import defaultdict
from pathlib import Path

import torch

from aqpipe.storage.base import stage_holding
from aqpipe.storage.health import damage
from aqpipe.storage.lmdb_store import LMDBStore, store_path


class InspectError(ValueError):
    """A run directory whose stores cannot be inspected."""


class DamagedStore(InspectError):
    """A store that cannot be opened or walked (a finding about the run, exit 1, not a usage error)."""


def _run_config(run_dir: str) -> dict:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise InspectError(f"{run_dir!r} is not an aqpipe run directory (no config.json)")
    config = json.loads(path.read_text())
    if config.get("store") != "lmdb":
        raise InspectError(f"the run in {run_dir!r} kept m(xi) in {config.get('store')}, not --store lmdb; nothing on disk")
    return config


def _open(run_dir: str, config: dict, rank: int) -> LMDBStore:
    path = store_path(run_dir, rank)
    if not path.is_dir():
        raise InspectError(f"rank {rank}'s store {path} is missing")
    problem = damage(path)
    if problem is not None:
        raise DamagedStore(f"rank {rank}'s m(xi) store is damaged: {problem} (a --resume of the run drops it and "
                           "re-seeds its samples at full precision)")
    return LMDBStore(path, config["store_dtype"], readonly=True)


def _digest(value: torch.Tensor) -> str:
    """A short SHA-256 of one m(ξ) value's raw bytes (what two hosts compare when neither sees the other's store)."""
    return hashlib.sha256(value.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()[:32]


def _side_values(run_dir: str, config: dict, rank: int, link: int, side: str) -> dict[int, torch.Tensor]:
    store = _open(run_dir, config, rank)
    try:
        return {k[2]: v for k, v in store.items() if k[:2] == (link, side)}
    finally:
        store.close()


def digests(run_dir: str) -> dict:
    """The digest of every m(ξ) value in the stores this host holds of a run (`aqpipe store digest`): what
    `verify` on another host needs to compare the copies across a link between two hosts."""
    config = _run_config(run_dir)
    stores: dict[str, dict[str, dict[str, str]]] = {}
    for rank in range(config["pp"] * config["dp"]):
        if not store_path(run_dir, rank).is_dir():
            continue
        store = _open(run_dir, config, rank)
        try:
            table: dict[str, dict[str, str]] = defaultdict(dict)
            for (link, side, sample), value in store.items():
                table[f"{link}:{side}"][str(sample)] = _digest(value)
        finally:
            store.close()
        stores[str(rank)] = dict(table)
    return {"pp": config["pp"], "dp": config["dp"], "host": socket.gethostname(), "stores": stores}


def load_digests(paths: list[str]) -> dict[int, dict[str, dict[str, str]]]:
    """The stores the digest files of other hosts describe, by rank."""
    found: dict[int, dict[str, dict[str, str]]] = {}
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
            found.update({int(rank): table for rank, table in record["stores"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InspectError(f"{path!r} is not a digest file of `aqpipe store digest`: {e}") from None
    return found


def verify(run_dir: str, digest_files: list[str] | None = None) -> tuple[int, list[str]]:
    """(entries compared, mismatch descriptions) over every link of every replica. A side of a link whose store is
    not under `run_dir` (it is on another host) is read from the digest files that host's `aqpipe store digest`
    wrote; the values are then compared by digest."""
    config = _run_config(run_dir)
    remote = load_digests(digest_files or [])
    pp, dp = config["pp"], config["dp"]
    compared, problems = 0, []
    for replica in range(dp):
        for link in range(pp - 1):
            sides: dict[str, dict] = {}
            for side in ("send", "recv"):
                rank = replica * pp + stage_holding(link, side)
                if store_path(run_dir, rank).is_dir():
                    sides[side] = _side_values(run_dir, config, rank, link, side)
                elif rank in remote:
                    sides[side] = remote[rank].get(f"{link}:{side}", {})
                else:
                    raise InspectError(f"rank {rank}'s store {store_path(run_dir, rank)} is not on this host: run "
                                       f"`aqpipe store digest {run_dir} --out FILE` on the host that holds it and "
                                       "pass FILE after the run directory")
            sent, got = {int(k): v for k, v in sides["send"].items()}, {int(k): v for k, v in sides["recv"].items()}
            where = f"replica {replica} link {link}->{link + 1}"
            for sample in sorted(sent.keys() | got.keys()):
                compared += 1
                if sample not in got:
                    problems.append(f"{where} sample {sample}: only the sender holds m(xi)")
                elif sample not in sent:
                    problems.append(f"{where} sample {sample}: only the receiver holds m(xi)")
                else:
                    problems += _compare(where, sample, sent[sample], got[sample])
    return compared, problems


def _compare(where: str, sample: int, sent: torch.Tensor | str, got: torch.Tensor | str) -> list[str]:
    """The mismatch of one sample's two copies (values, or digests when one side is on another host), if any."""
    if isinstance(sent, torch.Tensor) and isinstance(got, torch.Tensor):
        if torch.equal(sent.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8)):
            return []
        diff = float((sent.float() - got.float()).abs().max())
        return [f"{where} sample {sample}: copies differ (max |difference| {diff:.3g})"]
    mine, theirs = (_digest(v) if isinstance(v, torch.Tensor) else v for v in (sent, got))
    return [] if mine == theirs else [f"{where} sample {sample}: copies differ (their digests do not match)"]


def stats(run_dir: str) -> list[dict]:
    """Per (replica, link, side): entries, bytes stored, raw bytes before zstd, and the compression ratio, of the
    stores on this host; the last item holds the bytes on disk, those the rewind journals keep and the checkpoints
    every store here can be rewound to, and the ranks whose stores are not here (another host's). InspectError when
    no store is here at all."""
    config = _run_config(run_dir)
    rows: dict[tuple[int, int, str], dict] = defaultdict(lambda: {"entries": 0, "stored_bytes": 0, "raw_bytes": 0})
    disk = journal = 0
    checkpoints: set[int] | None = None
    ranks = range(config["pp"] * config["dp"])
    elsewhere = [rank for rank in ranks if not store_path(run_dir, rank).is_dir()]
    if len(elsewhere) == len(ranks):
        raise InspectError(f"no m(xi) store of the run is under {run_dir!r} (rank 0's would be {store_path(run_dir, 0)})")
    for rank in ranks:
        if rank in elsewhere:
            continue
        store = _open(run_dir, config, rank)
        try:
            for (link, side, _sample), _fields, stored in store.raw_records():
                row = rows[(rank // config["pp"], link, side)]
                row["entries"] += 1
                row["stored_bytes"] += stored
            for (link, side, _sample), value in store.items():
                rows[(rank // config["pp"], link, side)]["raw_bytes"] += value.numel() * value.element_size()
            journal += store.journal_bytes()
            reach = set(store.journal_checkpoints())
            checkpoints = reach if checkpoints is None else checkpoints & reach
        finally:
            store.close()
        disk += sum(f.stat().st_size for f in store_path(run_dir, rank).iterdir())
    out = [{"replica": r, "link": f"{link}->{link + 1}", "side": s, **v,
            "compression_ratio": v["raw_bytes"] / v["stored_bytes"] if v["stored_bytes"] else 0.0}
           for (r, link, s), v in sorted(rows.items())]
    out.append({"bytes_on_disk": disk, "journal_bytes": journal, "journal_checkpoints": sorted(checkpoints or ()),
                "elsewhere": elsewhere})
    return out
