"""`aqpipe store verify|stats`: compare the two copies of m(ξ) on every link of a run, and size up the stores."""

from __future__ import annotations

import json
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


def verify(run_dir: str) -> tuple[int, list[str]]:
    """(entries compared, mismatch descriptions) over every link of every replica."""
    config = _run_config(run_dir)
    pp, dp = config["pp"], config["dp"]
    compared, problems = 0, []
    for replica in range(dp):
        for link in range(pp - 1):
            sender = _open(run_dir, config, replica * pp + stage_holding(link, "send"))
            receiver = _open(run_dir, config, replica * pp + stage_holding(link, "recv"))
            try:
                sent = {k[2]: v for k, v in sender.items() if k[:2] == (link, "send")}
                got = {k[2]: v for k, v in receiver.items() if k[:2] == (link, "recv")}
            finally:
                sender.close()
                receiver.close()
            where = f"replica {replica} link {link}->{link + 1}"
            for sample in sorted(sent.keys() | got.keys()):
                compared += 1
                if sample not in got:
                    problems.append(f"{where} sample {sample}: only the sender holds m(xi)")
                elif sample not in sent:
                    problems.append(f"{where} sample {sample}: only the receiver holds m(xi)")
                elif not torch.equal(sent[sample].contiguous().view(torch.uint8), got[sample].contiguous().view(torch.uint8)):
                    diff = float((sent[sample].float() - got[sample].float()).abs().max())
                    problems.append(f"{where} sample {sample}: copies differ (max |difference| {diff:.3g})")
    return compared, problems


def stats(run_dir: str) -> list[dict]:
    """Per (replica, link, side): entries, bytes stored, raw bytes before zstd, and the compression ratio."""
    config = _run_config(run_dir)
    rows: dict[tuple[int, int, str], dict] = defaultdict(lambda: {"entries": 0, "stored_bytes": 0, "raw_bytes": 0})
    disk = 0
    for rank in range(config["pp"] * config["dp"]):
        store = _open(run_dir, config, rank)
        try:
            for (link, side, _sample), _fields, stored in store.raw_records():
                row = rows[(rank // config["pp"], link, side)]
                row["entries"] += 1
                row["stored_bytes"] += stored
            for (link, side, _sample), value in store.items():
                rows[(rank // config["pp"], link, side)]["raw_bytes"] += value.numel() * value.element_size()
        finally:
            store.close()
        disk += sum(f.stat().st_size for f in store_path(run_dir, rank).iterdir())
    out = [{"replica": r, "link": f"{link}->{link + 1}", "side": s, **v,
            "compression_ratio": v["raw_bytes"] / v["stored_bytes"] if v["stored_bytes"] else 0.0}
           for (r, link, s), v in sorted(rows.items())]
    out.append({"bytes_on_disk": disk})
    return out
