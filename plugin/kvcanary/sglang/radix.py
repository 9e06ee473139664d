"""The prefix cache: walk an sglang RadixCache (``root_node``, ``children``, ``value``, ``lock_ref``) for the sweep
(:func:`radix_sweep_source`) and the fault injector (:func:`idle_cached_slots`).

Which object is the RadixCache (the cache itself, or the one a wrapper holds) is the version module's
``radix_cache``; :func:`unwrap_radix_cache` is the shared rule it applies with its class.

The walk's host cost
--------------------
A walk visits every node in Python and then runs a few torch ops on the KV device: ~1.3 ms per sweep of a
~52k-entry, ~260-node tree on the H200 host. An exact RadixCache is therefore not walked per sweep but followed
(:mod:`kvcanary.sglang.radix_index`: the tree's changes kept in an incremental plan); the walker serves the trees
that cannot be followed (a subclass such as HiRadixCache, 0.5.23's legacy RadixCache) and walks on every call.
The walk is tight (no generator, no per-node dict, ``numel()`` as the cheapest size read of a node value) and the
gather is 11 torch calls whatever the node count (one cat behind a -1, so every predecessor is one
``index_select``; the host facts in one upload). Node values are read on the scheduler's stream, which frees and
reuses them (:mod:`kvcanary.runtime.streams`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import torch

from kvcanary.runtime.streams import run_on_producer_stream

_Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def unwrap_radix_cache(tree_cache, radix_cls: type):
    """The ``radix_cls`` instance behind sglang's prefix cache (itself, or the one a wrapper holds), or None."""
    inner = getattr(tree_cache, "inner", None) or getattr(tree_cache, "tree_cache", None)
    if not isinstance(tree_cache, radix_cls) and isinstance(inner, radix_cls):
        tree_cache = inner
    return tree_cache if isinstance(tree_cache, radix_cls) else None


def cached_nodes(tree) -> Iterator[tuple[object, int, object | None]]:
    """(node, depth, parent) of every RadixCache node that holds slots (``value`` not None and not empty), parents
    before children; an evicted node's subtree is skipped. ``parent`` is None under the root."""
    stack = [(tree.root_node, 0, None)]
    while stack:
        node, depth, parent = stack.pop()
        for child in list(node.children.values()):
            value = child.value
            if value is None or value.shape[0] == 0:  # evicted (to host, or gone): so is its subtree
                continue
            yield child, depth, parent
            stack.append((child, depth + int(value.shape[0]), child))


def gather_entries(tree) -> _Entries:
    """(slots, prevs, positions) of every slot the RadixCache ``tree`` holds, int64, on the device of the node
    values (CPU empties for an empty tree); nodes in :func:`cached_nodes` order, entries in node order.

    Node values are never read on the host (a ``.tolist()`` per node would be a device sync per node): one cat
    gathers them on their device behind a -1, and only depths and lengths, host facts of the tree, build the
    positions and the index of each entry's predecessor in that cat. 11 torch ops whatever the node count.
    """
    parts: list[torch.Tensor] = []
    firsts: list[int] = []  # per node: index of its first entry in the slots
    befores: list[int] = []  # per node: index in [-1, *slots] of the slot before its first (0: the -1, a head)
    offsets: list[int] = []  # per node: position - index of its entries (depth - first)
    lengths: list[int] = []
    total = 0
    stack = [(tree.root_node, 0, 0)]  # (node, depth, index in [-1, *slots] of its last slot: 0 for the root)
    while stack:
        node, depth, last = stack.pop()
        for child in list(node.children.values()):
            value = child.value
            if value is None:  # evicted (to host, or gone): so is its subtree
                continue
            n = value.numel()  # (a 1-D slot tensor: numel is its cheapest size read; len() is ~10x dearer)
            if n == 0:
                continue
            parts.append(value if value.dtype is torch.int64 else value.to(torch.int64))
            firsts.append(total)
            befores.append(last)
            offsets.append(depth - total)
            lengths.append(n)
            total += n
            stack.append((child, depth + n, total))  # its last slot is slots[total - 1], i.e. [-1, *slots][total]
    if not parts:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    device = parts[0].device
    headed = torch.cat([torch.full((1,), -1, dtype=torch.int64, device=device), *parts])  # [-1, *slots]
    # one upload of the host facts; everything else on the slots' device, with sizes known on the host (no
    # device -> host read, no sync; on a GPU no host-side buffer of the sweep's size either)
    meta = torch.tensor(firsts + befores + offsets + lengths, dtype=torch.int64)
    if device.type != "cpu":
        meta = meta.to(device, non_blocking=True)
    node_firsts, node_befores, node_offsets, node_lengths = meta.split(len(firsts))
    index = torch.arange(total, dtype=torch.int64, device=device)
    positions = torch.repeat_interleave(node_offsets, node_lengths, output_size=total)
    positions += index  # position of an entry: its node's depth + its index in the node
    index[node_firsts] = node_befores  # [-1, *slots][i] is the slot before entry i, but at a node's first
    return headed[1:], headed.index_select(0, index), positions


def radix_sweep_source(tree, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                       ) -> Callable[[], _Entries]:
    """``() -> (slots, prevs, positions)`` of every slot the RadixCache ``tree`` holds (a SweepSource).

    ``producer_stream()`` returns the stream the tree's node values live on (sglang's scheduler stream), or None
    (CPU, or the event loop has not started): the gather runs there, because the scheduler frees and reuses node
    value blocks on that stream while the sweep's caller (the forward stream) may still lag behind
    (:mod:`kvcanary.runtime.streams`). The source's ``walks`` counts its calls (each one walks the tree).
    """

    def gather() -> _Entries:
        return gather_entries(tree)

    def source() -> _Entries:
        producer = producer_stream() if producer_stream is not None else None
        source.walks += 1
        return run_on_producer_stream(producer, gather)

    source.walks = 0  # (every call walks: counted as an incremental source counts its walks, for the sweeper)
    return source


def idle_cached_slots(tree) -> list[int]:
    """Slots the RadixCache ``tree`` holds in nodes no running request locks (``TreeNode.lock_ref == 0``; an
    SWARadixCache node's ``full_lock_ref``), in walk order. Reads slots on the host: fault injection only."""
    return [int(x) for node, _, _ in cached_nodes(tree) if _lock_ref(node) == 0 for x in node.value.tolist()]


def _lock_ref(node) -> int:
    lock = getattr(node, "lock_ref", None)
    return lock if lock is not None else getattr(node, "full_lock_ref", 0)


def scheduler_stream_of(scheduler, attr: str) -> Callable[[], torch.cuda.Stream | None]:
    """The stream sglang's scheduler event loop runs on (``scheduler.<attr>``, created when the loop starts, after
    the cache), read when asked; None before that or off CUDA. Weak: never keeps the scheduler alive."""
    ref = weakref.ref(scheduler)

    def stream() -> torch.cuda.Stream | None:
        owner = ref()
        found = getattr(owner, attr, None) if owner is not None else None
        return found if isinstance(found, torch.cuda.Stream) else None

    return stream

