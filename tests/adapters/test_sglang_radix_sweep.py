"""The sweep source's reuse of its last walk (``kvcanary.sglang.radix``) on a REAL sglang 0.5.12 RadixCache:
every change of the cached entries goes through ``insert``, ``evict`` or ``reset`` (the mutation counter), and a
node split (``match_prefix``, ``insert``) keeps the entries exactly, so a walk reused across a split is still the
tree's. The adapter wires the counter in ``after_init_cache`` (tests/adapters/test_sglang_e2e.py runs it)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
if not importlib.metadata.version("sglang").startswith("0.5.12"):
    pytest.skip("the RadixCache API of sglang 0.5.12", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from kvcanary.sglang import radix, v0_5_12  # noqa: E402


class Allocator:
    """The token-to-KV allocator the RadixCache frees evicted slots to."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free(self, slots: torch.Tensor) -> None:
        self.freed += slots.tolist()


def insert(tree: RadixCache, tokens: list[int], slots: list[int]) -> None:
    tree.insert(InsertParams(key=RadixKey(tokens), value=torch.tensor(slots, dtype=torch.int64)))


def walked(tree: RadixCache) -> list[tuple[int, int, int]]:
    """A fresh walk's entries, in order."""
    slots, prevs, positions = radix.gather_entries(tree)
    return list(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))


def listed(entries) -> list[tuple[int, int, int]]:
    slots, prevs, positions = entries
    return list(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))


@pytest.fixture
def tree() -> RadixCache:
    tree = RadixCache.create_simulated(mock_allocator=Allocator())
    insert(tree, [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
    insert(tree, [1, 2, 3, 4, 7, 8], [11, 12, 13, 14, 27, 28])  # splits the first node after 4 tokens
    return tree


def test_the_version_class_is_counted(tree: RadixCache) -> None:
    assert radix.unwrap_radix_cache(tree, RadixCache) is tree and v0_5_12.radix_cache(tree) is tree
    assert radix.mutation_counter(tree, RadixCache) is not None


def test_a_split_keeps_the_entries_and_is_not_counted(tree: RadixCache) -> None:
    count = radix.mutation_counter(tree, RadixCache)
    source = radix.radix_sweep_source(tree, changes=count)
    before, reused = count(), source()
    nodes = len(list(radix.cached_nodes(tree)))
    tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9])))  # splits [1, 2, 3, 4] after 2 tokens
    assert len(list(radix.cached_nodes(tree))) == nodes + 1 and count() == before
    assert source() is reused and listed(reused) == walked(tree)
    assert sorted(listed(reused)) == sorted([(11, -1, 0), (12, 11, 1), (13, 12, 2), (14, 13, 3), (15, 14, 4),
                                             (16, 15, 5), (27, 14, 4), (28, 27, 5)])


@pytest.mark.parametrize("mutation", ["insert", "insert into a split", "evict", "reset"])
def test_every_change_of_the_entries_is_counted_and_walked(tree: RadixCache, mutation: str) -> None:
    count = radix.mutation_counter(tree, RadixCache)
    source = radix.radix_sweep_source(tree, changes=count)
    first, before = source(), count()
    if mutation == "insert":
        insert(tree, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 37])
    elif mutation == "insert into a split":
        insert(tree, [1, 2, 30], [11, 12, 40])
    elif mutation == "evict":
        tree.evict(EvictParams(num_tokens=1))  # one unlocked leaf
    else:
        tree.reset()
    assert count() == before + 1
    again = source()
    assert again is not first and listed(again) == walked(tree) != listed(first)
