"""The incremental sweep source (``kvcanary.sglang.radix_index``) on a REAL sglang 0.5.12 RadixCache: after any
sequence of inserts, prefix matches (node splits), evictions, protect mode's split-and-delete and resets, the plan
it hands the sweep holds exactly the entries a fresh walk of the tree finds, without walking the tree again (only
the first sweep, a reset or a compaction walk). The adapter wires it in ``after_init_cache``
(tests/adapters/test_sglang_e2e.py runs it)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import random

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
if not importlib.metadata.version("sglang").startswith("0.5.12"):
    pytest.skip("the RadixCache API of sglang 0.5.12", allow_module_level=True)

from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from kvcanary.kernels import layout  # noqa: E402
from kvcanary.runtime.sweep_index import MIN_COMPACTION_ENTRIES  # noqa: E402
from kvcanary.sglang import radix, radix_index, v0_5_12  # noqa: E402


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


def planned(source) -> list[tuple[int, int, int]]:
    """The live entries of the plan the source hands the sweep now, sorted."""
    plan = source().plan
    n = int(plan.verify_num_valid.item())
    rows = zip(plan.verify_slot_indices[:n].tolist(), plan.verify_prev_slot_indices[:n].tolist(),
               plan.verify_expected_positions[:n].tolist(), strict=True)
    return sorted(r for r in rows if r[0] != layout.PADDING_SLOT)


def protect_evict(tree: RadixCache, node, index: int) -> None:
    """What protect mode does to a bad node (kvcanary.sglang.protect): split off its tail from the bad slot's page on,
    delete it, leaves first."""
    index -= index % tree.page_size
    if index > 0:
        tree._split_node(node.key, node, index)
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    for n in reversed(order):
        tree.token_to_kv_pool_allocator.free(n.value)
        tree._delete_leaf(n)


@pytest.fixture
def tree() -> RadixCache:
    tree = RadixCache.create_simulated(mock_allocator=Allocator())
    insert(tree, [1, 2, 3, 4, 5, 6], [11, 12, 13, 14, 15, 16])
    insert(tree, [1, 2, 3, 4, 7, 8], [11, 12, 13, 14, 27, 28])  # splits the first node after 4 tokens
    return tree


def test_the_version_follows_exactly_its_class(tree: RadixCache) -> None:
    assert radix.unwrap_radix_cache(tree, RadixCache) is tree and v0_5_12.radix_cache(tree) is tree
    assert isinstance(v0_5_12.sweep_source(tree), radix_index.RadixSweepIndex)

    class Sub(RadixCache):
        pass

    sub = Sub.create_simulated(mock_allocator=Allocator())
    sub.__class__ = Sub
    walker = v0_5_12.sweep_source(sub)
    assert not isinstance(walker, radix_index.RadixSweepIndex)  # walked every sweep
    walker(), walker()
    assert walker.walks == 2  # (counted like the incremental source's walks: the sweeper reports them)


def test_a_split_keeps_the_plan(tree: RadixCache) -> None:
    source = v0_5_12.sweep_source(tree)
    first = source()
    tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 9])))  # splits [1, 2, 3, 4] after 2 tokens
    assert source() is first and source.walks == 1
    assert planned(source) == sorted(walked(tree)) == sorted(
        [(11, -1, 0), (12, 11, 1), (13, 12, 2), (14, 13, 3), (15, 14, 4), (16, 15, 5), (27, 14, 4), (28, 27, 5)])


@pytest.mark.parametrize("mutation", ["insert", "insert into a split", "evict", "protect", "reset"])
def test_every_change_of_the_entries_is_followed(tree: RadixCache, mutation: str) -> None:
    source = v0_5_12.sweep_source(tree)
    before = planned(source)
    events, event_ns = source.events, source.event_ns
    if mutation == "insert":
        insert(tree, [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 37])
    elif mutation == "insert into a split":
        insert(tree, [1, 2, 30], [11, 12, 40])
    elif mutation == "evict":
        tree.evict(EvictParams(num_tokens=1))  # one unlocked leaf
    elif mutation == "protect":
        leaf = tree.root_node.children[1].children[5]  # [5, 6] under the split [1, 2, 3, 4]
        protect_evict(tree, leaf, 1)
    else:
        tree.reset()
    assert source.events > events and source.event_ns > event_ns  # (its host time, for the host-time line)
    after = planned(source)
    assert after == sorted(walked(tree)) != before
    assert source.walks == (2 if mutation == "reset" else 1)  # followed, not walked
    freed = set(tree.token_to_kv_pool_allocator.freed)
    assert not freed & {slot for slot, _, _ in after}  # a freed slot is never swept from a stale plan


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle-bigram"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(6))
def test_random_serving_matches_a_walk_after_every_sweep(seed: int, page_size: int, eagle: bool) -> None:
    """Requests over a few shared prefixes inserted, matched (splits), evicted by sglang and by protect mode, the
    tree reset now and then; two sources on one tree (EAGLE: the target's and the draft's installations, whose
    tree keys by token pairs: ``is_eagle``); page sizes 1 and 4."""
    rng = random.Random(seed)
    tree = RadixCache.create_simulated(mock_allocator=Allocator(), page_size=page_size)
    tree.is_eagle = eagle  # (what an EAGLE server's RadixCache is built with: bigram keys, one slot fewer per key)
    sources = [v0_5_12.sweep_source(tree), v0_5_12.sweep_source(tree)]
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    next_slot, resets = 1, 0
    for step in range(80):
        for _ in range(rng.randrange(0, 4)):
            tokens = rng.choice(prefixes)[: rng.randrange(1, 40)] + [rng.randrange(1, 50)
                                                                      for _ in range(rng.randrange(0, 24))]
            insert(tree, tokens, list(range(next_slot, next_slot + len(tokens))))
            next_slot += len(tokens)
        if rng.random() < 0.5:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 40)] + [rng.randrange(1, 50)]
            tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))  # (bigram view taken by the tree)
        if rng.random() < 0.3:
            tree.evict(EvictParams(num_tokens=rng.randrange(1, 60)))
        if rng.random() < 0.15:
            nodes = [n for n, _, _ in radix.cached_nodes(tree)]
            if nodes:
                node = rng.choice(nodes)
                protect_evict(tree, node, rng.randrange(0, len(node.value)))
        if rng.random() < 0.03:
            tree.reset()
            resets += 1
        if step % rng.choice([1, 3]) == 0:
            expected = sorted(walked(tree))
            for source in sources:
                assert planned(source) == expected
    for source in sources:
        assert planned(source) == sorted(walked(tree))
        assert source.walks <= 1 + resets  # first, resets: never a compaction, never an event it could not place
        assert source.walk_reasons["unplaced"] == source.walk_reasons["failed"] == 0


def test_a_pool_turning_over_is_compacted_without_a_walk() -> None:
    """A serving engine's pool turns over its whole size every few sweeps (the H200 driver: tombstones reach half the
    plan every ~4 sweeps at a sweep every 10 forwards): the plan is compacted by a gather of its live ranges on the
    device, never by a walk of the tree (before: a walk and a rebuild, ~1 in 4 sweeps)."""
    tree = RadixCache.create_simulated(mock_allocator=Allocator())
    source = v0_5_12.sweep_source(tree)
    next_slot = 1
    for round_ in range(6):
        for group in range(40):  # (requests over a few shared prefixes, then the pool evicts most of them)
            tokens = [group, *range(1000 * round_ + 100 * group, 1000 * round_ + 100 * group + 80)]
            insert(tree, tokens, list(range(next_slot, next_slot + len(tokens))))
            next_slot += len(tokens)
        assert planned(source) == sorted(walked(tree))
        tree.evict(EvictParams(num_tokens=3000))
        assert planned(source) == sorted(walked(tree))
    assert source.walks == 1  # the first sweep only
    assert next_slot > 4 * MIN_COMPACTION_ENTRIES and source.compactions >= 2 and source.walk_reasons["first"] == 1


def test_a_failure_to_follow_falls_back_to_a_walk(tree: RadixCache, monkeypatch) -> None:
    """A tree event the index cannot follow never fails sglang's own operation: the next sweep walks."""
    source = v0_5_12.sweep_source(tree)
    source()

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(source, "node_stored", broken)
    insert(tree, [1, 2, 3, 4, 5, 6, 99], [11, 12, 13, 14, 15, 16, 99])  # sglang's insert still succeeds
    assert planned(source) == sorted(walked(tree)) and source.walks == 2 and source.walk_reasons["failed"] == 1


def test_an_swa_radix_cache_is_walked_on_pages_of_one_slot_only() -> None:
    """An SWARadixCache's full slots are swept (walked each sweep) with --page-size 1, what has run under the sweep;
    on larger pages the sweep stays off (the adapter warns), until a run covers them."""
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    from kvcanary.sglang import v0_5_12

    tree = object.__new__(SWARadixCache)
    tree.page_size = 1
    assert v0_5_12.swept_tree(tree) is tree
    assert callable(v0_5_12.sweep_source(tree))
    tree.page_size = 16
    assert v0_5_12.sweep_source(tree) is None
