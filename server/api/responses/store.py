"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, per API key.

Each key has its own budget of entries and bytes (requests without a key share the budget of the
owner ""), so one key's traffic evicts only its own oldest entries, never another key's; the keys
are the configured ones, so the memory held is bounded by their number. An entry expires ``ttl_s``
after it was stored. A response belongs to the key that created it: to any other key it does not
exist (404), as a foreign model does.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from xinserve.server.errors import APIError


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]  # the Response object as returned
    messages: list[dict[str, Any]]  # the conversation through this response, as chat messages
    expires: float
    size: int  # bytes, as JSON


@dataclass(slots=True)
class _Bucket:
    """One key's entries, oldest first, and the bytes they hold."""

    entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    size: int = 0

    def pop_oldest(self) -> None:
        _, entry = self.entries.popitem(last=False)
        self.size -= entry.size


class ResponseStore:
    def __init__(self, max_entries: int = 1000, max_bytes: int = 64 * 1024 * 1024, ttl_s: float = 3600.0) -> None:
        """``max_entries`` and ``max_bytes``: per key."""
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self._buckets: dict[str, _Bucket] = {}

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep the response, evicting the owner's oldest entries to make room. One larger than the
        whole budget is not kept (a later ``get`` is a 404) and evicts nothing."""
        self._expire()
        # The JSON's length stands for the memory held: the conversation's strings dominate, and an
        # ASCII str costs about its length in bytes.
        size = len(msgspec.json.encode((response, messages)))
        if size > self.max_bytes:
            return
        bucket = self._buckets.setdefault(owner, _Bucket())
        bucket.entries[response["id"]] = Stored(response, messages, time.monotonic() + self.ttl_s, size)
        bucket.size += size
        while len(bucket.entries) > self.max_entries or bucket.size > self.max_bytes:
            bucket.pop_oldest()

    def get(self, response_id: str, owner: str, param: str | None = None) -> Stored:
        """The entry, or a 404 when it is unknown, expired or another key's."""
        self._expire()
        bucket = self._buckets.get(owner)
        entry = bucket.entries.get(response_id) if bucket is not None else None
        if entry is None:
            raise APIError(404, f"No response found with id '{response_id}'.", param=param, code="not_found")
        return entry

    def delete(self, response_id: str, owner: str) -> None:
        entry = self.get(response_id, owner)
        bucket = self._buckets[owner]
        del bucket.entries[response_id]
        bucket.size -= entry.size

    def bytes_held(self, owner: str) -> int:
        bucket = self._buckets.get(owner)
        return bucket.size if bucket is not None else 0

    def _expire(self) -> None:
        now = time.monotonic()
        for owner, bucket in list(self._buckets.items()):
            while bucket.entries and next(iter(bucket.entries.values())).expires <= now:
                bucket.pop_oldest()
            if not bucket.entries:
                del self._buckets[owner]
