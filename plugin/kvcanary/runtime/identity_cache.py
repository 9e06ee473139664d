"""Values derived once per (object, key), for objects told apart by identity: slices of a tensor or of an engine's
buffers, the name of an enum member.

Why: on the per-forward path a tensor slice or a ``.name`` read is host time of its own (a torch call costs 7-11 µs
inside sglang's scheduler on the H200 host), while the objects it is taken from live as long as the engine. Keyed
by ``id``, not by the object: tensors do not hash by identity in a useful way, and IntEnum members compare equal to
ints and to other enums' members. Each entry holds its object, so no other object can take that id while the entry
exists; a cache that reaches its ``limit`` starts over (the objects a forward path meets are few: its graph sizes,
its buffers, a handful of modes).
"""

from __future__ import annotations

from typing import Any


class IdentityCache:
    """``get(obj, key)`` / ``put(obj, key, value)``: at most ``limit`` entries (then it starts over)."""

    __slots__ = ("_entries", "_limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"IdentityCache: limit must be >= 1, got {limit}")
        self._entries: dict[tuple[int, Any], tuple[object, Any]] = {}
        self._limit = limit

    def get(self, obj: object, key: Any = None) -> Any:
        """The value put for ``obj`` (this very object) and ``key``, or None."""
        entry = self._entries.get((id(obj), key))
        return None if entry is None else entry[1]

    def put(self, obj: object, key: Any, value: Any) -> Any:
        """Remember ``value`` for ``obj`` and ``key`` (holding ``obj``); returns ``value``."""
        entries = self._entries
        if len(entries) >= self._limit:
            entries.clear()
        entries[(id(obj), key)] = (obj, value)
        return value

    def __len__(self) -> int:
        return len(self._entries)
