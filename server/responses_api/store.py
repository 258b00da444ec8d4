"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in memory, per API key.

Bounded (the oldest goes first) and expiring (``ttl_s`` after it was stored). A response belongs to
the key that created it: to any other key it does not exist (404), as a foreign model does.
"""

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from xinserve.server.errors import APIError


@dataclass(slots=True)
class Stored:
    owner: str  # the API key's name ("" without auth)
    response: dict[str, Any]  # the Response object as returned
    messages: list[dict[str, Any]]  # the conversation through this response, as chat messages
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int = 1000, ttl_s: float = 3600.0) -> None:
        self.max_entries, self.ttl_s = max_entries, ttl_s
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, owner: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._entries[response["id"]] = Stored(owner, response, messages, time.monotonic() + self.ttl_s)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, owner: str, param: str | None = None) -> Stored:
        """The entry, or a 404 when it is unknown, expired or another key's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            raise APIError(404, f"No response found with id '{response_id}'.", param=param, code="not_found")
        return entry

    def delete(self, response_id: str, owner: str) -> None:
        self.get(response_id, owner)
        del self._entries[response_id]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.expires > now:
                break
            self._entries.popitem(last=False)
