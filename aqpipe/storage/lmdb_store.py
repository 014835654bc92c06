"""The on-disk message store: one LMDB environment per rank, values = a small header + a zstd-compressed body.

zstd runs at its fast level -1 by default: fp16 activations gain under 10% from level 1 (measured: ratio 1.09)
while level 1 costs six times the CPU, and on a CPU-bound pipeline that CPU is taken from training.

Key: link (u16), side (u8), sample id (u64), big-endian so entries sort by link, side, id. Value header: magic,
encoding, shape, the step it was written at, the CRC32 of the compressed body and its length. A value that fails
its CRC on read is counted, deleted, and reported absent, so AQ-SGD re-seeds that sample at full precision; it is
never used. Writes are single LMDB transactions, so a failed write (map or disk full) never leaves a torn store.

The store outlives a crash; its rewind journal (`aqpipe.storage.rewind`, a named database beside the values) brings it
back to the checkpoint a run resumes from.

The prefetch, writer and main threads share one environment. LMDB lets the map be resized only while this process
has no transaction open (it does not check), so every transaction holds the environment's gate shared and a resize
holds it exclusively.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from aqpipe.disk import ensure_room
from aqpipe.storage.base import SIDES, StoreStats, on_device
from aqpipe.storage.dtypes import STORE_DTYPES
from aqpipe.storage.encoding import decode_value, encode_value, storable_rows, value_dtype
from aqpipe.storage.rewind import RewindJournal

_KEY = struct.Struct(">HBQ")
_HEAD = struct.Struct("<4sBB8qqII")  # magic, encoding, ndim, shape[8], step, crc32, body length
MAGIC = b"AQM2"  # 2: quantized values on the zero-holding default grid
_CODES = {d.code: name for name, d in STORE_DTYPES.items()}
T = TypeVar("T")
WRITE_SLACK_BYTES = 1 << 20  # free space kept beyond a write's own pages: copied branch pages, the meta page


class StoreFullError(RuntimeError):
    """The store cannot grow: its cap (--store-max-gb) is reached (a full disk raises DiskFullError)."""


def pack_key(link: int, side: str, sample: int) -> bytes:
    return _KEY.pack(link, SIDES.index(side), sample)


def unpack_key(key: bytes) -> tuple[int, str, int]:
    link, side, sample = _KEY.unpack(key)
    return link, SIDES[side], sample


def is_value_key(key: bytes) -> bool:
    """Whether a key of the values' database names an m(ξ) (not the journal's database)."""
    return len(key) == _KEY.size


class TransactionGate:
    """Shared for transactions (any number, any thread, nested), exclusive for a map resize (once none is open)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._open = 0
        self._resizing = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._condition:
            while self._resizing:
                self._condition.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._condition:
                self._open -= 1
                self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            while self._resizing or self._open:
                self._condition.wait()
            self._resizing = True
        try:
            yield
        finally:
            with self._condition:
                self._resizing = False
                self._condition.notify_all()


class LMDBStore:
    """m(ξ) on disk for one rank."""

    def __init__(self, path: str | Path, encoding: str = "fp16", max_bytes: int | None = None,
                 initial_map_bytes: int = 64 << 20, level: int = -1, readonly: bool = False) -> None:
        import lmdb
        import zstandard

        if encoding not in STORE_DTYPES:
            raise ValueError(f"unknown store encoding {encoding!r}; use one of {', '.join(STORE_DTYPES)}")
        self.path, self.encoding, self.readonly = Path(path), encoding, readonly
        self.dtype = value_dtype(encoding)
        self.stats = StoreStats()
        self.max_bytes = max_bytes
        self.step = 0  # stamped into every value written
        self._lmdb = lmdb
        self._gate = TransactionGate()
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=initial_map_bytes, readonly=readonly, lock=not readonly,
                             sync=False, metasync=False, readahead=False, max_dbs=1)
        self.journal = RewindJournal(self.env, lmdb)
        self._zstd, self._level = zstandard, level
        self._contexts = threading.local()  # zstd contexts are not thread-safe: each thread gets its own pair
        self._read_ahead: dict[tuple[int, str, int], torch.Tensor] = {}

    # -- the MessageStore interface ------------------------------------------------------------------------------
    def contains(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether a sound m(ξ) exists for each id; a damaged one is counted, dropped and reported absent."""
        found = []
        with self._transaction() as txn:
            for i in ids:
                key = (link, side, int(i))
                value = self._read(txn, key)
                if value is not None:
                    self._read_ahead[key] = value
                found.append(value is not None)
        return self.stats.looked_up(found)

    def get(self, link: int, side: str, ids: Sequence[int]) -> list[torch.Tensor]:
        out = []
        with self._transaction() as txn:
            for i in ids:
                key = (link, side, int(i))
                value = self._read_ahead.pop(key, None)
                if value is None:
                    value = self._read(txn, key)
                if value is None:
                    raise KeyError(f"no sound m(xi) for link {link} side {side} sample {int(i)}")
                out.append(value)
        return out

    def put(self, link: int, side: str, ids: Sequence[int], values: Sequence[torch.Tensor]) -> None:
        on_host = on_device(values, "cpu")
        self.put_raw(link, side, ids, [self.encode_raw(v) for v in on_host], [tuple(v.shape) for v in values])

    def encode_raw(self, value: torch.Tensor):
        """The uncompressed bytes `value` is stored as (quantized, for the low-bit encodings)."""
        if value.dim() > 8:
            raise ValueError("m(xi) of more than 8 dimensions cannot be stored")
        return encode_value(value.detach().cpu(), self.encoding)

    def decode_raw(self, raw, shape: tuple[int, ...]) -> torch.Tensor:
        """The value `encode_raw` bytes stand for: what a read of them returns."""
        return decode_value(raw, self.encoding, shape)

    def storable_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Whether each row of a batch survives this store's encoding (finite, and in range for the quantized ones),
        as a bool tensor on its device (nothing read)."""
        return storable_rows(values, self.encoding)

    def put_raw(self, link: int, side: str, ids: Sequence[int], raws: Sequence, shapes: Sequence[tuple[int, ...]]
                ) -> None:
        """Write values already turned into bytes by `encode_raw`, in one transaction."""
        records = [(pack_key(link, side, int(i)), self._record(raw, shape)) for i, raw, shape in zip(ids, raws, shapes)]
        size = sum(len(v) for _, v in records)
        # LMDB cannot fail cleanly once the disk is full (a short write reads as an I/O error, and on tmpfs the
        # memory map faults: SIGBUS), so a write that might not fit is refused before it starts.
        needed = 2 * size * (1 if self.journal.step is None else 2) + WRITE_SLACK_BYTES  # (the journal's copies)
        ensure_room(self.path / "data.mdb", needed)

        def write(txn) -> None:
            for key, value in records:
                self.journal.keep(txn, key)
                txn.put(key, value)

        try:
            self._write_growing(write, size)
        except self._lmdb.Error as e:
            ensure_room(self.path / "data.mdb", needed)  # a disk that filled meanwhile is the likely cause
            raise StoreFullError(f"writing m(xi) to {self.path} failed: {e}") from None

    def present(self, link: int, side: str, ids: Sequence[int]) -> list[bool]:
        """Whether a sound m(ξ) exists for each id; not counted as lookups, but a damaged entry found here is
        dropped and counted as re-seeded, like on any read."""
        found = []
        with self._transaction() as txn:
            for i in ids:
                key = (link, side, int(i))
                found.append(key in self._read_ahead or self._read(txn, key) is not None)
        return found

    def delete(self, link: int, side: str, ids: Sequence[int]) -> None:
        """Remove m(ξ) of each id (its next sight goes at full precision and re-seeds it)."""
        keys = [pack_key(link, side, int(i)) for i in ids]
        self._room_to_keep(keys)
        with self._transaction(write=True) as txn:
            for key in keys:
                self.journal.keep(txn, key)
                txn.delete(key)
        for i in ids:
            self._read_ahead.pop((link, side, int(i)), None)

    def items(self):
        """Every ((link, side, id), value) pair; damaged values are skipped (and counted)."""
        with self._transaction() as txn:
            keys = [bytes(k) for k in txn.cursor().iternext(values=False) if is_value_key(k)]
            for key in keys:
                value = self._read(txn, unpack_key(key))
                if value is not None:
                    yield unpack_key(key), value

    def raw_records(self):
        """(key, header fields, stored body length, raw length) of every entry, for statistics."""
        with self._transaction() as txn:
            for key, value in txn.cursor():
                if not is_value_key(key):
                    continue
                fields = _HEAD.unpack_from(value)
                yield unpack_key(bytes(key)), fields, len(value) - _HEAD.size

    # -- the rewind journal (`aqpipe.storage.rewind`) ------------------------------------------------------------
    def checkpointed(self, step: int, kept: Collection[int]) -> None:
        """The store as it is now belongs to the checkpoint of `step`: from here on, the first change of each value
        keeps what it held, so that `rewind(step)` brings it back. The journals of checkpoints not in `kept` (none
        can be resumed from any more) are merged into older ones and dropped."""
        if self.journal.db is None:
            with self._gate.exclusive():  # (LMDB opens a database in a transaction of its own)
                self.journal.create()
        self._room_for_journals()
        self._write_growing(lambda txn: self.journal.start(txn, step, kept), WRITE_SLACK_BYTES)

    def rewind(self, step: int) -> int | None:
        """Every value back to what it held at the checkpoint of `step` (`RewindJournal.rewind`): how many entries
        were put back, or None when no journal reaches back to it (the values stay as they are)."""
        self._room_for_journals()
        put_back = self._write_growing(lambda txn: self.journal.rewind(txn, step), WRITE_SLACK_BYTES)
        self._read_ahead.clear()
        return put_back

    def journal_checkpoints(self) -> list[int]:
        """The checkpoints this store can be rewound to, oldest first."""
        with self._transaction() as txn:
            return self.journal.checkpoints(txn)

    def journal_bytes(self) -> int:
        """Bytes of the values the rewind journals keep."""
        with self._transaction() as txn:
            return self.journal.value_bytes(txn)

    def close(self) -> None:
        """Flush to disk (writers) and release the environment."""
        if not self.readonly:
            self.env.sync()
        self.env.close()

    # -- internals -------------------------------------------------------------------------------------------------
    @contextmanager
    def _transaction(self, write: bool = False):
        """A transaction under the shared gate; if another process grew the map (a repair tool, the other side of a
        shared disk), adopt its size first, with no transaction of this process open."""
        for attempt in range(2):
            with self._gate.shared():
                try:
                    txn = self.env.begin(write=write)
                except self._lmdb.MapResizedError:
                    if attempt:
                        raise
                else:
                    with txn as handle:
                        yield handle
                    return
            with self._gate.exclusive():
                self.env.set_mapsize(0)

    def _record(self, raw, shape: tuple[int, ...]) -> bytes:
        dims = list(shape)
        if len(dims) > 8:
            raise ValueError("m(xi) of more than 8 dimensions cannot be stored")
        body = self._context().compressor.compress(raw)
        head = _HEAD.pack(MAGIC, STORE_DTYPES[self.encoding].code, len(dims), *(dims + [0] * (8 - len(dims))), self.step,
                          zlib.crc32(body) & 0xFFFFFFFF, len(body))
        return head + body

    def _read(self, txn, key: tuple[int, str, int]) -> torch.Tensor | None:
        raw = txn.get(pack_key(*key))
        if raw is None:
            return None
        value = self.decode_record(bytes(raw))
        if value is None:
            self.stats.reseeded += 1
            if not self.readonly:  # inspection only reports damage; a training run drops the entry to re-seed it
                self._delete(key)
        return value

    def decode_record(self, raw: bytes) -> torch.Tensor | None:
        """The m(ξ) a stored record holds, or None if the record is damaged in any way."""
        if len(raw) < _HEAD.size:
            return None
        magic, encoding, ndim, *rest = _HEAD.unpack_from(raw)
        shape, crc, length = rest[:8], rest[9], rest[10]  # rest[8]: the step it was written at
        body = raw[_HEAD.size :]
        if magic != MAGIC or _CODES.get(encoding) != self.encoding or ndim > 8 or length != len(body):
            return None
        if zlib.crc32(body) & 0xFFFFFFFF != crc:
            return None
        try:
            return decode_value(self._context().decompressor.decompress(body), self.encoding, tuple(shape[:ndim]))
        except Exception:  # noqa: BLE001 - a body that passes its CRC but does not decode is damaged too
            return None

    def _context(self) -> threading.local:
        """This thread's zstd compressor and decompressor (the prefetch and write-behind threads use the store too)."""
        context = self._contexts
        if not hasattr(context, "compressor"):
            context.compressor = self._zstd.ZstdCompressor(level=self._level)
            context.decompressor = self._zstd.ZstdDecompressor()
        return context

    def _delete(self, key: tuple[int, str, int]) -> None:
        link, side, sample = key
        self.delete(link, side, [sample])

    def _room_to_keep(self, keys: list[bytes]) -> None:
        """Before deleting `keys` while a journal keeps changes: room for their values in it."""
        if self.journal.step is not None:
            with self._transaction() as txn:
                size = sum(len(txn.get(key) or b"") for key in keys)
            ensure_room(self.path / "data.mdb", 2 * size + WRITE_SLACK_BYTES)

    def _room_for_journals(self) -> None:
        """Before a rewind or a merge of journals: room for as much again as they hold (LMDB cannot reuse the pages a
        transaction frees within it)."""
        with self._transaction() as txn:
            held = self.journal.disk_bytes(txn)
        ensure_room(self.path / "data.mdb", 2 * held + WRITE_SLACK_BYTES)

    def _write_growing(self, work: Callable[[Any], T], size: int) -> T:
        """`work(txn)` in one write transaction; whenever the map fills, grown (for at least `size` bytes more) and the
        work done again."""
        for _ in range(64):
            try:
                with self._transaction(write=True) as txn:
                    return work(txn)
            except self._lmdb.MapFullError:
                self._grow(size)
        raise StoreFullError(f"the store at {self.path} kept running out of map space")

    def _grow(self, needed: int) -> None:
        current = self.env.info()["map_size"]
        target = max(current * 2, current + 4 * needed)
        if self.max_bytes is not None and target > self.max_bytes:
            if current >= self.max_bytes:
                raise StoreFullError(f"the m(xi) store at {self.path} reached its cap of {self.max_bytes / 1e9:.2f} GB "
                                     "(--store-max-gb); raise the cap or use a low-bit --store-dtype")
            target = self.max_bytes
        with self._gate.exclusive():  # LMDB forbids a resize while this process has a transaction open
            if self.env.info()["map_size"] < target:  # another thread may have grown it meanwhile
                self.env.set_mapsize(target)


def store_path(out: str | Path, rank: int) -> Path:
    """Where rank `rank` keeps its LMDB store in a run directory."""
    return Path(out) / "store" / f"rank-{rank}.lmdb"


