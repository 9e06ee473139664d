"""kvcanary.runtime.identity_cache: one value per (object, key), objects told apart by identity."""

from __future__ import annotations

import enum
import gc

import pytest
import torch

from kvcanary.runtime.identity_cache import IdentityCache


def test_values_are_per_object_identity_and_key() -> None:
    cache = IdentityCache(8)
    a, b = torch.zeros(4), torch.zeros(4)  # equal tensors, different objects
    cache.put(a, 2, "a2")
    assert cache.get(a, 2) == "a2" and cache.get(a, 3) is None and cache.get(b, 2) is None

    class One(enum.IntEnum):
        X = 1

    class Other(enum.IntEnum):
        Y = 1

    cache.put(One.X, None, "X")
    assert One.X == Other.Y == 1 and cache.get(Other.Y) is None and cache.get(1) is None and cache.get(One.X) == "X"


def test_an_entry_keeps_its_object_so_its_id_is_never_reused_meanwhile() -> None:
    cache = IdentityCache(8)
    cache.put(torch.zeros(3), None, "gone?")
    gc.collect()
    for _ in range(100):  # new objects never take the id the entry names: it still holds its tensor
        t = torch.zeros(3)
        assert cache.get(t) is None
        del t


def test_it_starts_over_at_its_limit() -> None:
    cache = IdentityCache(2)
    objs = [object() for _ in range(3)]
    for i, o in enumerate(objs):
        cache.put(o, None, i)
    assert len(cache) == 1 and cache.get(objs[2]) == 2 and cache.get(objs[0]) is None
    with pytest.raises(ValueError, match="limit"):
        IdentityCache(0)
