"""The per-sample activation store m(ξ): the interface and its backends."""

from aqpipe.storage.base import STORE_DTYPES, MessageStore, StoreStats, StoreView
from aqpipe.storage.memory import MemoryStore

__all__ = ["STORE_DTYPES", "MemoryStore", "MessageStore", "StoreStats", "StoreView"]
