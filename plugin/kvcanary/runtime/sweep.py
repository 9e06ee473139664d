"""The prefix-cache sweep (SPEC §5): its source, its plan and its cadence.

Every ``sweep_interval`` forwards the manager's ``step()`` asks the sweep source for every slot the prefix cache
holds, each with its predecessor slot (or -1 for a first token) and position; :meth:`Sweeper.run` copies the lists
into a verify plan of its own (non-blocking; the lists may be device tensors) and launches verify over them with
tag SWEEP and real-KV on, through :meth:`kvcanary.runtime.device_state.DeviceState.sweep`. This catches what no running
request reads: K/V of a cached but idle prefix that went bad.

Host cost per sweep (issues 15, 25). A source that follows its cache's changes keeps its own plan up to date and
hands back a :class:`SweepPlan` (:class:`kvcanary.runtime.sweep_index.SweepIndex`: a sweep of a changed cache costs a
few device operations for what changed, not a walk of the cache); it is launched as is. A walking source hands back
the entries: :meth:`Sweeper.run` copies them into a plan of its own, unless they are the very tensors of its
previous call (the cache holds the same entries: the plan already holds them, so only verify is launched again;
a tensor once handed over must therefore never be changed in place). The plan's entry count is set by a device-side
fill (no pinned host buffer to allocate, and none that a later sweep could overwrite before the copy ran); the
expected tokens (none) and the enable flag are set once, when the plan is allocated (no kernel writes a plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.plan import VerifyPlan
from kvcanary.runtime.device_state import DeviceState

_Ints = Sequence[int] | torch.Tensor
MIN_SWEEP_PLAN = 1024  # entries of the first sweep plan; it doubles (at least) when a sweep needs more


@dataclass(frozen=True)
class SweepPlan:
    """A sweep plan its source keeps up to date itself (:class:`kvcanary.runtime.sweep_index.SweepIndex`): launched as
    is.

    ``skipped``: entries of ``plan`` that are tombstones (the padding slot: verify skips them, but its entry counter
    counts every plan entry, so the sweep takes them off that count again)."""

    plan: VerifyPlan
    skipped: int = 0


# () -> (slots, prev slots or -1, positions) of every slot the prefix cache holds: int sequences, or int64
# tensors (slots and prevs may stay on the device the cache keeps them on: no device -> host copy); or a SweepPlan.
SweepSource = Callable[[], tuple[_Ints, _Ints, _Ints] | SweepPlan]


def allocate_sweep_plan(capacity: int, device: torch.device | str) -> VerifyPlan:
    """A sweep plan: no expected tokens (verify compares none) and enabled, once for all its sweeps."""
    plan = VerifyPlan.allocate(capacity, device)
    plan.verify_expected_tokens.fill_(layout.NO_EXPECTED_TOKEN)
    plan.verify_enable.fill_(1)
    return plan


@dataclass(frozen=True)
class SweepTally:
    """What the sweeps cost so far: host time (ns), sweeps, and of them the ones whose source walked its whole cache
    and the compactions of an incremental source's plan. Differences of two tallies give a period's."""

    host_ns: int = 0
    sweeps: int = 0
    walks: int = 0
    compactions: int = 0
    # an incremental source's host time following its cache's changes (inside the engine's own cache operations,
    # outside the sweeps and any forward hook)
    event_ns: int = 0

    def __add__(self, other: SweepTally) -> SweepTally:
        return SweepTally(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: SweepTally) -> SweepTally:
        return SweepTally(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


class Sweeper:
    """Sweep source, cadence (every ``interval`` steps; 0: never on its own) and plan, launching on ``state``."""

    def __init__(self, state: DeviceState, interval: int) -> None:
        self._state = state
        self.interval = interval
        self.source: SweepSource | None = None
        self._plan: VerifyPlan | None = None
        self._planned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # what the plan was copied from
        self.host_ns = 0  # host time of every sweep so far (source + launch)
        self.sweeps = 0  # sweeps run from the source so far

    @property
    def walks(self) -> int:
        """Sweeps so far whose source walked its whole cache (a source that counts them: its ``walks``; an
        incremental source walks on its first sweep and after a reset, a walking one on every sweep); 0 for a source
        that does not count them."""
        return getattr(self.source, "walks", 0)

    @property
    def compactions(self) -> int:
        """Compactions of an incremental source's plan so far (its ``compactions``; 0 for a source without)."""
        return getattr(self.source, "compactions", 0)

    def tally(self) -> SweepTally:
        """The sweeps' cost so far (the ``kvcanary host time`` line reports a period's)."""
        return SweepTally(self.host_ns, self.sweeps, self.walks, self.compactions,
                          getattr(self.source, "event_ns", 0))

    def due(self, steps: int) -> bool:
        """Whether the step that makes the step count ``steps`` runs the sweep: a source is set, the interval is
        positive and ``steps`` is a multiple of it."""
        interval = self.interval
        return self.source is not None and interval > 0 and steps % interval == 0

    def prime(self) -> None:
        """A first sweep's one-off work, done now (at start-up, before serving): the source is asked once and its
        answer dropped (the first sweep asks again); nothing is verified, launched by the sweep or counted. Why: a
        source's first call does what no later one does (the RadixCache index's walk and plan, and the first use of
        its compaction's torch kernels, which it runs once on scratch then: in the H200 engine that first use cost
        one forward 13-18 ms of host time, 2026-12-03), which no serving forward should pay. No-op without a
        source."""
        if self.source is not None:
            self.source()

    def run_source(self) -> None:
        """Ask the source for the cache's entries and verify them (:meth:`run`, or a :class:`SweepPlan` as is).
        Its host time adds to ``host_ns`` (the ``sweep_us`` of the ``kvcanary host time`` line)."""
        start = time.perf_counter_ns()
        found = self.source()
        if isinstance(found, SweepPlan):
            self._state.sweep(found.plan, skipped=found.skipped)
        else:
            self.run(*found)
        self.host_ns += time.perf_counter_ns() - start
        self.sweeps += 1

    def run(self, slots: _Ints, prevs: _Ints, positions: _Ints) -> None:
        """Verify the given entries (slot, predecessor slot or -1, position) with real-KV, tag SWEEP.

        Each argument is an int sequence or a 1-D int64 tensor on any device. The very tensors of the last call
        (the same objects) are not copied again: the plan still holds them. Host-called, outside graph capture;
        the copies are non-blocking. Raises ``ValueError`` for lengths that differ or a tensor of another dtype or
        rank.
        """
        planned = self._planned
        if planned is None or slots is not planned[0] or prevs is not planned[1] or positions is not planned[2]:
            self._fill(slots, prevs, positions)
        self._state.sweep(self._plan)

    def _fill(self, slots: _Ints, prevs: _Ints, positions: _Ints) -> None:
        """Copy the entries into the plan (growing it first when they do not fit) and set its entry count."""
        n = len(slots)
        if len(prevs) != n or len(positions) != n:
            raise ValueError(
                f"CanaryManager.sweep: slots/prevs/positions lengths differ: {n}/{len(prevs)}/{len(positions)}"
            )
        self._planned = None  # (until the copies are enqueued)
        plan = self._plan
        if plan is None or plan.capacity < n:
            plan = self._plan = allocate_sweep_plan(max(n, 2 * (plan.capacity if plan else 0), MIN_SWEEP_PLAN),
                                                    self._state.device)
        cuda = self._state.device.type == "cuda"
        for dst, src, name in ((plan.verify_slot_indices, slots, "slots"),
                               (plan.verify_prev_slot_indices, prevs, "prevs"),
                               (plan.verify_expected_positions, positions, "positions")):
            if isinstance(src, torch.Tensor):
                if src.dim() != 1 or src.dtype != torch.int64:
                    raise ValueError(f"CanaryManager.sweep: {name}: expected a 1-D int64 tensor, got {src.dtype} "
                                     f"{list(src.shape)}")
                if src.device.type == "cpu" and cuda:
                    src = src.pin_memory()
            else:
                src = torch.tensor(list(src), dtype=torch.int64)
                if cuda:
                    src = src.pin_memory()
            dst[:n].copy_(src, non_blocking=True)
        plan.verify_num_valid.fill_(n)  # a fill on the plan's device: stream-ordered after the copies, no host buffer
        if isinstance(slots, torch.Tensor) and isinstance(prevs, torch.Tensor) and isinstance(positions, torch.Tensor):
            self._planned = (slots, prevs, positions)
