"""An LRU cache keyed by a schema's SHA-256 digest, evicting by size: the cache never holds a
schema's text (24 distinct 2 MB schemas once kept 82 MB in the HTTP process), and what it does
hold is counted in bytes against a budget rather than in entries."""

import hashlib
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")

# What an entry costs beyond its value: the digest, the dict slot and the tuple around them.
ENTRY_OVERHEAD_BYTES = 200


def schema_digest(schema: str) -> bytes:
    return hashlib.sha256(schema.encode()).digest()


class DigestCache(Generic[V]):
    """``digest -> value`` with each value's size in bytes; least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.size_bytes = 0
        self._entries: OrderedDict[bytes, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def get(self, digest: bytes) -> V | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        self._entries.move_to_end(digest)
        return entry[0]

    def put(self, digest: bytes, value: V, size_bytes: int) -> None:
        """Add or replace; an entry over the whole budget is not kept at all."""
        self.pop(digest)
        size_bytes += ENTRY_OVERHEAD_BYTES
        if size_bytes > self.budget_bytes:
            return
        self._entries[digest] = (value, size_bytes)
        self.size_bytes += size_bytes
        while self.size_bytes > self.budget_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.size_bytes -= evicted

    def resize(self, digest: bytes, size_bytes: int) -> None:
        """Recount an entry whose size became known later (a compile that finished)."""
        entry = self._entries.get(digest)
        if entry is not None:
            self.put(digest, entry[0], size_bytes)

    def pop(self, digest: bytes) -> V | None:
        entry = self._entries.pop(digest, None)
        if entry is None:
            return None
        self.size_bytes -= entry[1]
        return entry[0]
