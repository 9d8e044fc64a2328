"""Stored Responses API responses (``store: true``), in memory within a byte budget: each entry is the response
object (what ``GET /v1/responses/{id}`` returns) and the conversation it ends — the input items of every turn so far
and the response's output items — which ``previous_response_id`` continues. The least recently used entries go
first when the budget is full; an entry larger than the whole budget is not kept. Sizes are the entries' JSON
lengths in bytes. Entries are read and written on the event loop's thread only.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    items: tuple
    size: int


class ResponseStore:
    """An LRU map of response id -> ``StoredResponse`` holding at most ``budget_bytes`` (0: nothing is kept)."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, items: list[dict]) -> bool:
        """Keep ``response`` (by its ``id``) with the conversation ``items``; False if it alone exceeds the budget."""
        size = len(json.dumps(response, ensure_ascii=False).encode()) + len(json.dumps(items, ensure_ascii=False)
                                                                            .encode())
        if size > self.budget:
            return False
        self.delete(response["id"])
        while self.used + size > self.budget:
            _, old = self._entries.popitem(last=False)
            self.used -= old.size
        self._entries[response["id"]] = StoredResponse(response, tuple(items), size)
        self.used += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None: never stored, evicted or deleted."""
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.used -= entry.size
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
