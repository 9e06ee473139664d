"""The prefix cache: walk an sglang RadixCache (``root_node``, ``children``, ``value``, ``lock_ref``) for the sweep
(:func:`radix_sweep_source`) and the fault injector (:func:`idle_cached_slots`).

Which object is the RadixCache (the cache itself, or the one a wrapper holds) is the version module's
``radix_cache``; :func:`unwrap_radix_cache` is the shared rule it applies with its class."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

import torch

from kvcanary.streams import run_on_producer_stream


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


def radix_sweep_source(tree, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None
                       ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``() -> (slots, prevs, positions)`` of every slot the RadixCache ``tree`` holds (a SweepSource).

    ``producer_stream()`` returns the stream the tree's node values live on (sglang's scheduler stream), or None
    (CPU, or the event loop has not started): the gather runs there, because the scheduler frees and reuses node
    value blocks on that stream while the sweep's caller (the forward stream) may still lag behind
    (:mod:`kvcanary.streams`).
    """

    def gather() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Node values are int64 slot tensors on the KV device: gather them there (one cat), never read them on
        # the host (a .tolist() per node would be one device sync per node). Only depths and lengths, host
        # facts of the tree, build the positions and the predecessors' indices. A fixed number of torch ops
        # whatever the node count (two slices per node, as before, cost a few µs of host time per node).
        parts: list[torch.Tensor] = []
        depths: list[int] = []
        lengths: list[int] = []
        starts: list[int] = []
        before: list[int] = []  # per node: index (in the gathered slots) of the slot before its first, or -1
        last: dict[int, int] = {}  # id(node) -> index of its last slot
        total = 0
        for node, depth, parent in cached_nodes(tree):
            value = node.value if node.value.dtype == torch.int64 else node.value.to(torch.int64)
            n = int(value.shape[0])
            parts.append(value)
            depths.append(depth)
            lengths.append(n)
            starts.append(total)
            before.append(-1 if parent is None else last[id(parent)])
            total += n
            last[id(node)] = total - 1
        if not parts:
            empty = torch.zeros(0, dtype=torch.int64)
            return empty, empty, empty
        slots = torch.cat(parts)
        # one upload of the host facts; everything else on the slots' device, with sizes known on the host (no
        # device -> host read, no sync; on a GPU no host-side buffer of the sweep's size either)
        k = len(starts)
        meta = torch.tensor(starts + before + depths + lengths, dtype=torch.int64).to(slots.device, non_blocking=True)
        firsts, parents, node_depths, lens = meta[:k], meta[k : 2 * k], meta[2 * k : 3 * k], meta[3 * k :]
        # prev of an entry: the entry before it in its node, or the parent's last slot (-1 under the root)
        prevs = torch.empty_like(slots)
        prevs[1:] = slots[:-1]
        prevs[firsts] = torch.where(parents >= 0, slots[parents.clamp(min=0)], -1)
        # position of an entry: its node's depth + its index in the node
        positions = torch.repeat_interleave(node_depths - firsts, lens, output_size=total)
        positions += torch.arange(total, dtype=torch.int64, device=slots.device)
        return slots, prevs, positions

    def source() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        producer = producer_stream() if producer_stream is not None else None
        return run_on_producer_stream(producer, gather)

    return source


def idle_cached_slots(tree) -> list[int]:
    """Slots the RadixCache ``tree`` holds in nodes no running request locks (``TreeNode.lock_ref == 0``), in walk
    order. Reads slots on the host: fault injection only."""
    return [int(x) for node, _, _ in cached_nodes(tree) if getattr(node, "lock_ref", 0) == 0
            for x in node.value.tolist()]


def scheduler_stream_of(scheduler, attr: str) -> Callable[[], torch.cuda.Stream | None]:
    """The stream sglang's scheduler event loop runs on (``scheduler.<attr>``, created when the loop starts, after
    the cache), read when asked; None before that or off CUDA. Weak: never keeps the scheduler alive."""
    ref = weakref.ref(scheduler)

    def stream() -> torch.cuda.Stream | None:
        owner = ref()
        found = getattr(owner, attr, None) if owner is not None else None
        return found if isinstance(found, torch.cuda.Stream) else None

    return stream
