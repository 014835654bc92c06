"""Is an LMDB m(ξ) store whole? Checked in a child process, because a damaged one can crash the reader.

LMDB maps the file into memory and trusts it: a `data.mdb` cut short makes a read past its end raise SIGBUS, and
a damaged page can send a walk anywhere. So `damage(path)` opens the store and walks every key in a separate
Python process (`python -m aqpipe.storage.health PATH`), and reads its verdict from the exit status: a crash by
signal is damage too; the rewind journal is walked too. Values are not read (their checksums catch damaged values
during the run), but the file must reach the last page the store's meta page names.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

CHECK_TIMEOUT_SECONDS = 600.0


def damage(path: str | Path) -> str | None:
    """Why the LMDB store at `path` cannot be used (one line), or None when it opens and walks cleanly."""
    data = Path(path) / "data.mdb"
    if not data.is_file():
        return f"{data} is missing"
    try:
        proc = subprocess.run([sys.executable, "-m", "aqpipe.storage.health", str(path)], capture_output=True,
                              text=True, timeout=CHECK_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        return f"walking {data} took over {CHECK_TIMEOUT_SECONDS:.0f} s"
    if proc.returncode == 0:
        return None
    if proc.returncode < 0:
        return f"reading {data} crashed the reader ({signal.Signals(-proc.returncode).name})"
    reason = proc.stdout.strip().splitlines()
    return f"{data}: {reason[-1] if reason else f'check exited with code {proc.returncode}'}"


def _walk(path: str) -> int:
    """In the child: open read-only without the lock file, compare the file with its meta page, walk every key."""
    import lmdb

    from aqpipe.storage.rewind import NAME as JOURNAL

    try:
        env = lmdb.open(path, readonly=True, lock=False, subdir=True, max_dbs=1)
    except lmdb.Error as e:
        print(f"cannot be opened: {e}")
        return 1
    try:
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = (Path(path) / "data.mdb").stat().st_size
        if size < needed:
            print(f"truncated: {size} bytes, its pages need {needed}")
            return 1
        databases: list[tuple[str, lmdb._Database | None]] = [("the values", None)]
        try:
            databases.append(("the rewind journal", env.open_db(JOURNAL, create=False)))
        except lmdb.NotFoundError:
            pass
        with env.begin(buffers=True) as txn:
            for name, db in databases:
                entries = sum(1 for _ in txn.cursor(db=db).iternext(keys=True, values=False))
                counted = txn.stat(db)["entries"] if db is not None else env.stat()["entries"]
                if entries != counted:
                    print(f"walked {entries} keys of {name}, the store counts {counted}")
                    return 1
    except lmdb.Error as e:
        print(f"damaged: {e}")
        return 1
    finally:
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(_walk(sys.argv[1]))


def drop_if_damaged(path: str | Path, rank: int) -> bool:
    """Before a resume: remove rank `rank`'s LMDB m(ξ) store at `path` when it does not open and walk cleanly
    (m(ξ) can always be rebuilt: the resumed ranks find its samples on one side of their links only and re-seed them
    at full precision), saying so on stderr; returns whether it did."""
    import shutil

    path = Path(path)
    problem = damage(path) if path.exists() else None
    if problem is None:
        return False
    print(f"aqpipe: rank {rank}'s m(xi) store is damaged ({problem}); dropping it: its samples are re-seeded at full "
          "precision and counted in store.reseeded", file=sys.stderr, flush=True)
    shutil.rmtree(path)
    return True
