"""Warm method state (issue 10, item 5): what a method parsed from its stored bytes, kept in memory for the next
request, so a warm worker answers without parsing (or, with the worker's own byte cache, reading) its state again.

Keyed by the identity of the bytes object the state was parsed from, with a reference to it held, so the identity
cannot be reused while the entry lives: the worker keeps stored artifacts in memory by digest
(app/jobs/tabular.py) and hands the same object for the same digest, and a method registers the state it has just
computed under the bytes it returns. Content-addressed bytes never change, so a hit is always the right state.
Entries are read-only: a method that changes its state works on a copy (or builds a new one).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
WARM_ENTRIES = 16
"""Parsed states kept per method kind (least recently used dropped first)."""


_EVERY: weakref.WeakSet[WarmStates] = weakref.WeakSet()


def keep_only(data: list[bytes]) -> None:
    """Drop, from every method's warm states, those not parsed from one of these bytes objects (the worker's cached
    blobs: a state parsed from another, superseded by an erasure or computed and never stored, may hold the erased
    rows' terms, and no lookup would find it again)."""
    for states in list(_EVERY):
        states.keep_only(data)


class WarmStates:
    def __init__(self, max_entries: int = WARM_ENTRIES):
        _EVERY.add(self)
        self.max_entries = max_entries
        self._entries: OrderedDict[int, tuple[bytes, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, data: bytes, parse: Callable[[bytes], T]) -> T:
        """The state parsed from ``data``: from memory when this very object was seen, else ``parse(data)``."""
        with self._lock:
            entry = self._entries.get(id(data))
            if entry is not None and entry[0] is data:
                self._entries.move_to_end(id(data))
                self.hits += 1
                return entry[1]
        value = parse(data)
        self.put(data, value)
        with self._lock:
            self.misses += 1
        return value

    def put(self, data: bytes, value: Any) -> None:
        """Remember ``value`` as the state ``data`` parses to (a method's freshly computed state)."""
        with self._lock:
            self._entries[id(data)] = (data, value)
            self._entries.move_to_end(id(data))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def find(self, match: Callable[[Any], bool]) -> Any | None:
        """A kept state that ``match`` accepts (most recent first), or None: a state another method of the same
        kind has just computed at the same point (newton and influence keep the same state, issue 21)."""
        with self._lock:
            values = [value for _, value in reversed(self._entries.values())]
        return next((value for value in values if match(value)), None)

    def keep_only(self, data: list[bytes]) -> None:
        """Forget every state not parsed from one of these very objects."""
        kept = {id(item) for item in data}  # alive while ``data`` is: no other object can have their ids
        with self._lock:
            for key in [k for k in self._entries if k not in kept]:
                del self._entries[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
