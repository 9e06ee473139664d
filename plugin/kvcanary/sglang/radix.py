"""The prefix cache: walk an sglang RadixCache (``root_node``, ``children``, ``value``, ``lock_ref``) for the sweep
(:func:`radix_sweep_source`) and the fault injector (:func:`idle_cached_slots`).

Which object is the RadixCache (the cache itself, or the one a wrapper holds) is the version module's
``radix_cache``; :func:`unwrap_radix_cache` is the shared rule it applies with its class.

The sweep's host cost (issue 15)
--------------------------------
A sweep verifies every (slot, predecessor, position) the tree holds. Building those lists walks every node in
Python and then runs a few torch ops on the KV device: ~1.3 ms per sweep of a ~52k-entry, ~260-node tree on the
H200 host, ~120 µs per forward at interval 10. The verify launch itself is one launch whatever the tree. So the
source does not rebuild the lists when the tree has not changed since the last sweep:

* **What changes the lists.** In sglang 0.5.12's RadixCache every change of the set of cached entries goes through
  three public methods (:data:`RADIX_MUTATORS`): ``insert`` (new nodes, through ``_insert_helper``), ``evict``
  (removed leaves, through ``_delete_leaf``) and ``reset`` (a new root). ``match_prefix`` and ``insert`` also
  split nodes (``_split_node``), which keeps the set: the two halves hold the same slots at the same depths, and
  the second half's predecessor is the first half's last slot, the same slot as before. Lock counts do not
  matter (the sweep verifies locked and idle nodes alike).
* **Counting them.** :func:`mutation_counter` wraps those three methods on the one RadixCache instance the sweep
  walks (instance attributes: nothing else is patched) with a counter bumped after each call returns or raises,
  so a walk that starts after a mutation ended sees its count. The counter is only used for an instance of
  exactly the RadixCache class (``type(tree) is radix_cls``): a subclass (HiRadixCache's host eviction and load
  back set ``node.value`` in methods of its own) gets no counter and is walked on every sweep, as before.
* **Reusing the lists.** With a counter, the source remembers the count its last lists were gathered at and,
  when it is unchanged, hands back the very same tensors. :class:`kvcanary.sweep.Sweeper` then re-launches verify
  on the plan it already holds (no copy, no walk): a sweep of an unchanged tree costs a counter compare and one
  launch, whatever its size. The guarantee is unchanged: every sweep still verifies every cached entry against
  the KV bytes as they are at that launch (a corrupted idle slot is found by the next sweep), and a plan is only
  reused while the tree holds exactly its entries (a slot freed by an eviction is never verified from a stale
  plan after it was reused: the eviction changed the count).
* **Device memory.** The reused tensors are the gather's own results (allocated on the producer stream and
  handed to the consumer, :mod:`kvcanary.streams`), not node values: a node value freed by a split or an
  eviction is never read again. Reuse reads nothing at all on the host: no sync.
* **A changed tree** is walked and gathered again, with a tighter walk (no generator, no per-node dict,
  ``numel()`` as the cheapest size read of a node value) and 11 torch calls instead of ~20 (one cat behind a -1,
  so every predecessor is one ``index_select``; the host facts in one upload). Splitting one sweep over several
  forwards was not taken: it does not save the walk (a part must know its nodes' depths and predecessors, i.e.
  the tree above it, which may change between the parts), and every entry must still be verified within one
  interval.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator

import torch

from kvcanary.streams import run_on_producer_stream

# The RadixCache methods through which every change of its cached entries goes (see the module docstring).
RADIX_MUTATORS: tuple[str, ...] = ("insert", "evict", "reset")

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


class _MutationCount:
    """How many calls of a tree's mutators have returned (or raised) so far."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


# tree -> its counter: a tree shared by several installations is wrapped once (weak: never keeps a tree alive)
_counters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mutation_counter(tree, radix_cls: type) -> Callable[[], int] | None:
    """``() -> count`` of the calls of ``tree``'s :data:`RADIX_MUTATORS` so far, or None when ``tree`` is not
    exactly a ``radix_cls`` (a subclass may change its entries in methods of its own: it is walked every sweep).

    The first call wraps the mutators on the instance (the count is bumped after each call, also when it raises);
    later calls for the same tree return the same counter.
    """
    if type(tree) is not radix_cls:
        return None
    count = _counters.get(tree)
    if count is None:
        count = _counters[tree] = _MutationCount()
        for name in RADIX_MUTATORS:
            setattr(tree, name, _counted(getattr(tree, name), count))
    return count


def note_mutation(tree) -> None:
    """Count a change of ``tree``'s cached entries made outside its :data:`RADIX_MUTATORS` (protect mode evicts
    chosen nodes through the tree's internal ``_delete_leaf``), so the sweep walks the tree again."""
    count = _counters.get(tree)
    if count is not None:
        count.value += 1


def _counted(method: Callable, count: _MutationCount) -> Callable:
    @functools.wraps(method)
    def counted(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            count.value += 1  # after the change: a walk that reads the count after this sees the changed tree

    return counted


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


def radix_sweep_source(tree, producer_stream: Callable[[], torch.cuda.Stream | None] | None = None,
                       changes: Callable[[], int] | None = None) -> Callable[[], _Entries]:
    """``() -> (slots, prevs, positions)`` of every slot the RadixCache ``tree`` holds (a SweepSource).

    ``producer_stream()`` returns the stream the tree's node values live on (sglang's scheduler stream), or None
    (CPU, or the event loop has not started): the gather runs there, because the scheduler frees and reuses node
    value blocks on that stream while the sweep's caller (the forward stream) may still lag behind
    (:mod:`kvcanary.streams`).

    ``changes()`` (:func:`mutation_counter`) counts the tree's mutations: while it returns the count of the last
    gather, the source returns that gather's tensors again (the sweeper re-verifies the plan it holds). Without
    it every call walks the tree.
    """
    last: list = [None, None]  # [mutation count, entries] of the last gather (count None: not reusable)

    def gather() -> _Entries:
        return gather_entries(tree)

    def source() -> _Entries:
        count = changes() if changes is not None else None  # read before the walk (see mutation_counter)
        if count is not None and count == last[0]:
            return last[1]
        producer = producer_stream() if producer_stream is not None else None
        entries = run_on_producer_stream(producer, gather)
        last[0], last[1] = count, entries
        return entries

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

