"""The sweep source's gather (``kvcanary.sglang.radix.radix_sweep_source``) on RadixCache-shaped trees, without
sglang: the same (slot, prev, position) entries, in the same order, as a plain host walk, for trees with evicted
nodes, int32 node values, deep chains and wide fans, on every call (the incremental source that follows an exact
RadixCache is tested on a real one in tests/adapters/test_sglang_radix_sweep.py; the real-engine tests are in
tests/adapters/test_sglang_e2e.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary.sglang.radix import radix_sweep_source


class Node:
    def __init__(self, value: torch.Tensor | None) -> None:
        self.children: dict = {}
        self.value = value
        self.lock_ref = 0


class Tree:
    def __init__(self, root: Node) -> None:
        self.root_node = root


def host_walk(tree: Tree) -> list[tuple[int, int, int]]:
    """(slot, prev, position) per cached slot in the gather's order: nodes as cached_nodes yields them (a stack,
    parents before children), entries in node order."""
    out = []
    stack = [(tree.root_node, 0, -1)]
    while stack:
        node, depth, prev = stack.pop()
        for child in list(node.children.values()):
            if child.value is None or child.value.shape[0] == 0:
                continue
            values = [int(x) for x in child.value.tolist()]
            out += [(slot, values[i - 1] if i else prev, depth + i) for i, slot in enumerate(values)]
            stack.append((child, depth + len(values), values[-1]))
    return out


def random_tree(rng: random.Random, nodes: int) -> Tree:
    root = Node(None)
    all_nodes = [root]
    for _ in range(nodes):
        parent = rng.choice(all_nodes)
        roll = rng.random()
        if roll < 0.05:
            value = None  # evicted: its subtree is skipped
        else:
            n = 0 if roll < 0.1 else rng.randrange(1, 9)
            value = torch.tensor([rng.randrange(1, 5000) for _ in range(n)],
                                 dtype=torch.int32 if roll < 0.3 else torch.int64)
        node = Node(value)
        parent.children[len(parent.children)] = node
        all_nodes.append(node)
    return Tree(root)


@pytest.mark.parametrize("seed", range(40))
def test_gather_equals_a_host_walk(seed: int) -> None:
    rng = random.Random(seed)
    tree = random_tree(rng, rng.choice([0, 1, 3, 30, 200]))
    slots, prevs, positions = radix_sweep_source(tree)()
    assert slots.dtype == prevs.dtype == positions.dtype == torch.int64
    got = list(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))
    assert got == host_walk(tree)


def test_gather_of_a_deep_chain_and_a_wide_fan() -> None:
    chain = Node(None)
    node = chain
    for k in range(300):  # a long request split into many nodes
        child = Node(torch.arange(10 * k + 1, 10 * k + 11))
        node.children[0] = child
        node = child
    fan = Node(None)
    for k in range(300):  # many requests, one node each
        fan.children[k] = Node(torch.tensor([k + 1]))
    for tree in (Tree(chain), Tree(fan)):
        slots, prevs, positions = radix_sweep_source(tree)()
        assert list(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True)) == host_walk(tree)
    slots, prevs, positions = radix_sweep_source(Tree(chain))()
    assert positions.tolist() == list(range(3000)) and prevs[0] == -1 and torch.equal(prevs[1:], slots[:-1])


def test_the_walker_walks_on_every_call() -> None:
    """What it serves (a RadixCache subclass, 0.5.23's legacy RadixCache) may change nodes in methods of its own:
    every call reads the tree as it is now."""
    tree = Tree(Node(None))
    tree.root_node.children["x"] = Node(torch.arange(1, 3))
    source = radix_sweep_source(tree)
    first = entries(source)
    tree.root_node.children["x"].value = torch.arange(5, 7)  # (changed behind any method's back)
    assert first != entries(source) == host_walk(tree)


def entries(source) -> list[tuple[int, int, int]]:
    slots, prevs, positions = source()
    return list(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))
