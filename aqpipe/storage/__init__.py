"""The per-sample activation store m(ξ): the interface and counters (`base`), its backends — in memory (`memory`), as
GPU slabs (`slab`), on disk in LMDB (`lmdb_store`, each value laid out by `encoding`, rewound to a checkpoint by
`rewind`, checked whole by `health`) — prefetch and write-behind around a store (`prefetch`), `aqpipe store`'s
commands (`inspect`), and the table of store dtypes (`dtypes`).

Names are imported on first use, so `aqpipe.storage.dtypes` (the vocabulary the configuration and the CLI help
read) loads without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"MessageStore": "base", "StoreStats": "base", "StoreView": "base", "MemoryStore": "memory", "SlabStore": "slab",
            "memory_store": "memory", "in_memory": "memory",
            "STORE_DTYPES": "dtypes"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"aqpipe.storage.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'aqpipe.storage' has no attribute {name!r}")
