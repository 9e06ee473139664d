"""The incremental sweep source of an sglang RadixCache (issue 25): the tree's changes, followed as they happen.

Why. Walking the tree on every sweep whose tree changed (:func:`kvcanary.sglang.radix.radix_sweep_source`) costs
~1-2 ms of host time per sweep in a serving engine, where the tree changes between nearly every two sweeps (phase 2
of the H200 driver: 141 µs per forward at a sweep every 10 forwards, most of kvcanary's host cost). Here each node
of the tree is a span of a :class:`kvcanary.runtime.sweep_index.SweepIndex`, and the tree's own methods tell the index
what changed (instance attributes of the one tree, wrapped once; nothing else is patched):

* **a node stored** (the version's ``RadixNodeHooks.stored``: 0.5.12's ``_record_store_event``, which
  ``_insert_helper`` calls with every node it creates, and only then): the node is *pending*; at the next sweep all
  pending nodes are appended at once, parents before children, each continuing its parent's span (a child of the
  root starts a chain);
* **a node split** (``_split_node(key, child, split_len)`` returns the new head): the head takes the span's first
  ``split_len`` entries, the child keeps the rest, host only (a split keeps every slot, predecessor and position);
  a pending child makes its head pending too;
* **a leaf deleted** (``_delete_leaf``: sglang's eviction and protect mode's): a pending node is forgotten, an
  appended one's entries become tombstones;
* **a reset**: the next sweep rebuilds from a walk of the new tree.

A change the index cannot place (a node deleted or split that it never saw stored) marks it *stale*: the next sweep
walks the whole tree and rebuilds the plan. The first sweep walks too (the tree may hold nodes from before the
source existed). A plan whose tombstones reach half its entries is compacted on the device, without a walk
(:meth:`kvcanary.runtime.sweep_index.SweepIndex.compact`): the engine's pool turns over every few sweeps, and a
walk per compaction was ~1 sweep in 4 (issue 25). So every sweep verifies exactly the entries the tree holds at that
moment; a sweep of an unchanged tree launches verify on the plan as it is (no device work before it), a sweep after
changes costs 2 device operations for what changed (a cat and one kernel launch:
:meth:`kvcanary.runtime.sweep_index.SweepIndex.commit`). ``walks`` counts the walks, ``walk_reasons``
says why (:data:`WALK_REASONS`), ``compactions`` counts the gathers, ``events`` the tree events followed.

Streams: the appends read node values, which sglang's scheduler stream produces and frees. The plan is the forward
stream's (the sweep verifies it there), so the update runs on the forward stream after the scheduler stream's queued
work, with the node values it reads held until it has run
(:func:`kvcanary.runtime.streams.update_after_producer`). Until 2026-12-02 it ran on the scheduler stream, which
first waited for the forward stream: that held sglang's next batch back behind the forward in flight whenever the
tree had changed, ~10 ms of decode TTFT on a Llama-3.1-8B shape (issue 28).

Only an exact ``RADIX_CACHE_CLASS`` instance is followed (:func:`kvcanary.sglang.base.sweep_source`): a subclass
(HiRadixCache moves node values to and from the host in methods of its own) is walked on every sweep.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvcanary.runtime.streams import update_after_producer
from kvcanary.runtime.sweep import SweepPlan
from kvcanary.runtime.sweep_index import Span, SweepIndex, UnplacedSpan

logger = logging.getLogger(__name__)


# Why a sweep walked the tree (RadixSweepIndex.walk_reasons): its first sweep; the tree was reset; a split or deletion
# of a node the index never saw stored, or a stored node under one; a listener that failed. (A compaction walks no
# more: the index gathers its live ranges on the device.)
WALK_REASONS = ("first", "reset", "unplaced", "failed")


@dataclass(frozen=True)
class RadixNodeHooks:
    """The RadixCache methods (names on the instance) through which its cached entries change.

    Attributes:
        stored: called with each node an insert creates, once it is in the tree.
        split: ``(key, child, split_len) -> head``: cuts ``child`` after ``split_len`` slots into a new head.
        deleted: ``(node)``: a leaf leaves the tree.
        reset: ``()``: the tree is emptied (a new root).
    """

    stored: str
    split: str
    deleted: str
    reset: str


class RadixSweepIndex:
    """A sweep source (``() -> SweepPlan``) over one RadixCache, following its changes (see the module docstring)."""

    def __init__(self, tree, hooks: RadixNodeHooks,
                 producer_stream: Callable[[], torch.cuda.Stream | None] | None = None) -> None:
        self._tree = tree
        self._index = SweepIndex(getattr(tree, "device", None) or "cpu")
        self._pending: dict[object, None] = {}  # nodes stored since the last sweep (an ordered set)
        self._stale = "first"  # why the next sweep walks the tree (None: it does not): see WALK_REASONS
        self._producer_stream = producer_stream
        self.walks = 0  # sweeps that walked the whole tree
        self.walk_reasons: dict[str, int] = dict.fromkeys(WALK_REASONS, 0)  # those walks, by reason
        self.events = 0  # tree events followed (inserted nodes, splits, deletions, resets)
        # their host time (ns): spent inside sglang's own tree operations in the scheduler, outside any forward hook,
        # so the ``kvcanary host time`` line adds it (``sweep_event_us``)
        self.event_ns = 0
        _watch(tree, hooks).add(self)

    # ------------------------------------------------------------------------------------------ tree events
    def node_stored(self, node) -> None:
        self.events += 1
        if not self._stale:
            self._pending[node] = None

    def node_split(self, head, child, head_length: int) -> None:
        self.events += 1
        if self._stale:
            return
        if child in self._index:
            self._index.split(child, head, head_length)
        elif child in self._pending:
            self._pending[head] = None
        else:
            self._stale = "unplaced"

    def node_deleted(self, node) -> None:
        self.events += 1
        if self._stale:
            return
        if node in self._pending:
            del self._pending[node]
        elif node in self._index:
            self._index.remove(node)
        else:
            self._stale = "unplaced"

    def invalidate(self, reason: str = "reset") -> None:
        """Walk the whole tree at the next sweep (the tree was reset, or a tree event could not be followed)."""
        self.events += 1
        if not self._stale:
            self._stale = reason
        self._pending.clear()

    # ------------------------------------------------------------------------------------------ the source
    @property
    def compactions(self) -> int:
        """Compactions of the plan (tombstones dropped by a gather on the device, no walk)."""
        return self._index.compactions

    def __call__(self) -> SweepPlan:
        index = self._index
        if not self._stale and not self._pending and not index.dirty():
            return index.commit()  # the tree holds what the plan holds: verify it again as it is
        if not self._stale:
            try:
                return self._update(self._pending_spans(), rebuild=False)
            except UnplacedSpan:  # (a node whose parent the index never saw: placed by a walk instead)
                self._stale = "unplaced"
        if self._stale == "first":  # (at start-up when the sweep primes its source: kvcanary.runtime.sweep)
            self._index.prime()
        self.walk_reasons[self._stale] += 1
        plan = self._update(walk_spans(self._tree), rebuild=True)
        self.walks += 1
        return plan

    def _update(self, spans: list[Span], rebuild: bool) -> SweepPlan:
        index = self._index
        if rebuild:
            index.clear()
        compact = index.wants_compaction()
        index.reserve(sum(span.slots.numel() for span in spans))
        planned: list[SweepPlan] = []

        def update() -> None:
            index.append(spans)  # (host only: an unplaced span raises before any device work)
            if compact:
                index.compact()  # (writes the appends, then drops the tombstones by a gather on the device: no walk)
            planned.append(index.commit())

        producer = self._producer_stream() if self._producer_stream is not None else None
        update_after_producer(producer, update, [span.slots for span in spans])
        self._pending.clear()
        self._stale = None
        return planned[0]

    def _pending_spans(self) -> list[Span]:
        """The pending nodes as spans, each after its parent (pending parents first; a child of the root starts a
        chain)."""
        root = self._tree.root_node
        pending = self._pending
        spans: list[Span] = []
        placed: set[int] = set()
        for node in pending:
            chain = []
            while node in pending and id(node) not in placed:
                placed.add(id(node))
                chain.append(node)
                node = node.parent
            for node in reversed(chain):
                parent = node.parent
                spans.append(Span(node, node.value, None if parent is root else parent))
        return spans


def walk_spans(tree) -> list[Span]:
    """Every node of ``tree`` that holds slots, as spans, parents before children (a node without slots, and its
    subtree, is skipped: evicted)."""
    spans: list[Span] = []
    stack = [(tree.root_node, None)]
    while stack:
        node, parent_key = stack.pop()
        for child in list(node.children.values()):
            value = child.value
            if value is None or value.numel() == 0:
                continue
            spans.append(Span(child, value, parent_key))
            stack.append((child, child))
    return spans


# ---------------------------------------------------------------------------------------------- the tree's methods
class _TreeWatch:
    """The listeners of one tree's events (weak: a dropped source stops listening)."""

    def __init__(self) -> None:
        self._listeners: list[weakref.ref[RadixSweepIndex]] = []
        self.failed = False

    def add(self, listener: RadixSweepIndex) -> None:
        self._listeners = [r for r in self._listeners if r() is not None] + [weakref.ref(listener)]

    def emit(self, event: str, *args) -> None:
        for ref in self._listeners:  # (a plain list: every insert and eviction of sglang's passes here)
            listener = ref()
            if listener is None:
                continue
            start = time.perf_counter_ns()
            try:
                getattr(listener, event)(*args)
            except Exception:  # never fail sglang's own tree operation: fall back to a walk
                listener.invalidate("failed")
                if not self.failed:
                    self.failed = True
                    logger.exception("kvcanary: following the RadixCache's %s failed; the next sweep walks the tree",
                                     event)
            listener.event_ns += time.perf_counter_ns() - start


_watches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tree -> its _TreeWatch (wrapped once)


def _watch(tree, hooks: RadixNodeHooks) -> _TreeWatch:
    watch = _watches.get(tree)
    if watch is not None:
        return watch
    watch = _watches[tree] = _TreeWatch()
    stored, split, deleted, reset = (getattr(tree, name) for name in
                                     (hooks.stored, hooks.split, hooks.deleted, hooks.reset))

    @functools.wraps(split)
    def on_split(key, child, split_len, *args, **kwargs):
        head = split(key, child, split_len, *args, **kwargs)
        watch.emit("node_split", head, child, int(split_len))
        return head

    @functools.wraps(reset)
    def on_reset(*args, **kwargs):
        result = reset(*args, **kwargs)
        watch.emit("invalidate")
        return result

    for name, wrapper in ((hooks.stored, _node_event(stored, "node_stored", watch)), (hooks.split, on_split),
                          (hooks.deleted, _node_event(deleted, "node_deleted", watch)), (hooks.reset, on_reset)):
        setattr(tree, name, wrapper)
    return watch


def _node_event(method: Callable, event: str, watch: _TreeWatch) -> Callable:
    """``method(node, ...)``, then ``event`` with that node to the tree's listeners."""

    @functools.wraps(method)
    def wrapper(node, *args, **kwargs):
        result = method(node, *args, **kwargs)
        watch.emit(event, node)
        return result

    return wrapper
