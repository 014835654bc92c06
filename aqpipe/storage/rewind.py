"""The rewind journal of an on-disk m(ξ) store: what each value held at a checkpoint, so that a resume from that
checkpoint finds the store exactly as it was.

An LMDB store outlives a crash holding values written after the checkpoint a run resumes from (on both sides of a
link alike, so no comparison of the two copies can tell). From each checkpoint on, the first change of a value keeps
what it held in the journal, in the same transaction as the change; a rewind puts those back, newest checkpoint
first. It costs one more write per sample per checkpoint interval, and the disk of the values kept.

Layout: a named database in the store's LMDB environment. A key is a checkpoint's step (8 bytes, big-endian) alone,
the checkpoint's mark, or followed by a value's key: what that value held at the checkpoint (empty: nothing). Each
journal covers its checkpoint up to the next journal's. Dropping the journal of a checkpoint no resume can start
from merges what it holds into the next older journal where that lacks the key (a value unchanged since the older
checkpoint held the same at the dropped one), so every journal left still covers up to the next.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterator

NAME = b"rewind"  # the journal's database (its name is a key of the store's main database too)
MARK = struct.Struct(">Q")  # a journal key's first 8 bytes: the checkpoint's step
ABSENT = b""  # what a value held at a checkpoint when it did not exist
BATCH = 256  # journal entries read at a time


class RewindJournal:
    """The journals of one LMDB environment; `step`: the checkpoint changes are kept for now (None: none)."""

    def __init__(self, env, lmdb) -> None:
        self.env, self.db = env, None
        try:
            self.db = env.open_db(NAME, create=False)
        except lmdb.NotFoundError:  # made at the store's first checkpoint
            pass
        self.step: int | None = None
        if self.db is not None:
            with env.begin() as txn:
                self.step = max(self.checkpoints(txn), default=None)

    def create(self) -> None:
        """Make the journal's database (no transaction of this process may be open)."""
        if self.db is None:
            self.db = self.env.open_db(NAME, create=True)

    def keep(self, txn, key: bytes) -> None:
        """Before `key` changes in `txn`: what it held at the checkpoint of `step`, unless kept already."""
        if self.step is None:
            return
        entry = MARK.pack(self.step) + key
        if txn.get(entry, db=self.db) is None:
            held = txn.get(key)
            txn.put(entry, ABSENT if held is None else held, db=self.db)

    def start(self, txn, step: int, kept: Collection[int]) -> None:
        """The store as it is in `txn` belongs to the checkpoint of `step`: changes are kept for it from now on. The
        journals of checkpoints not in `kept` are merged into the next older journal kept, and dropped."""
        into = None
        for checkpoint in self.checkpoints(txn):
            if checkpoint in kept and checkpoint < step:
                into = checkpoint
                continue
            if into is not None and checkpoint < step:
                for key, held in self.entries(txn, checkpoint):
                    txn.put(MARK.pack(into) + key, held, db=self.db, overwrite=False)
            self._drop(txn, checkpoint)
        txn.put(MARK.pack(step), ABSENT, db=self.db)
        self.step = step

    def rewind(self, txn, step: int) -> int | None:
        """Every value in `txn` back to what it held at the checkpoint of `step`; returns how many journal entries
        were put back (a value changed after several checkpoints counts once for each). None when no journal reaches
        back to that checkpoint: the values stay as they are, and every journal is dropped (changes since were not
        all kept)."""
        checkpoints = self.checkpoints(txn)
        if step not in checkpoints:
            for checkpoint in checkpoints:
                self._drop(txn, checkpoint)
            self.step = None
            return None
        put_back = 0
        for checkpoint in sorted((c for c in checkpoints if c >= step), reverse=True):
            for key, held in self.entries(txn, checkpoint):
                if held == ABSENT:
                    txn.delete(key)
                else:
                    txn.put(key, held)
                put_back += 1
            self._drop(txn, checkpoint, keep_mark=checkpoint == step)
        self.step = step
        return put_back

    def checkpoints(self, txn) -> list[int]:
        """The checkpoints whose journals are kept, oldest first."""
        if self.db is None:
            return []
        cursor = txn.cursor(db=self.db)
        found: list[int] = []
        while cursor.set_range(MARK.pack(found[-1] + 1) if found else b""):
            found.append(MARK.unpack_from(cursor.key())[0])
        return found

    def entries(self, txn, checkpoint: int) -> Iterator[tuple[bytes, bytes]]:
        """(value key, what it held) of each value the journal of `checkpoint` keeps, read a batch at a time (the
        caller may write between batches)."""
        mark, start = MARK.pack(checkpoint), MARK.pack(checkpoint) + b"\0"
        while True:
            cursor, batch = txn.cursor(db=self.db), list[tuple[bytes, bytes]]()
            if cursor.set_range(start):
                for entry, held in cursor:
                    if not entry.startswith(mark) or len(batch) == BATCH:
                        break
                    batch.append((bytes(entry), bytes(held)))
            yield from ((entry[len(mark):], held) for entry, held in batch)
            if len(batch) < BATCH:
                return
            start = batch[-1][0] + b"\0"  # (the next key after the batch's last)

    def value_bytes(self, txn) -> int:
        """Bytes of the values the journals keep."""
        return 0 if self.db is None else sum(len(held) for _, held in txn.cursor(db=self.db))

    def disk_bytes(self, txn) -> int:
        """Bytes of the journals' pages (from LMDB's counts: nothing read)."""
        if self.db is None:
            return 0
        stat = txn.stat(self.db)
        return (stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]) * stat["psize"]

    def _drop(self, txn, checkpoint: int, keep_mark: bool = False) -> None:
        """Delete the journal of `checkpoint` (but its mark, with `keep_mark`)."""
        mark = MARK.pack(checkpoint)
        cursor = txn.cursor(db=self.db)
        if not cursor.set_range(mark):
            return
        while cursor.key().startswith(mark):
            if keep_mark and cursor.key() == mark:
                if not cursor.next():
                    return
            elif not cursor.delete():
                return
