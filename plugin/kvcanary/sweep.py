"""The prefix-cache sweep (SPEC §5): its source, its plan and its cadence.

Every ``sweep_interval`` forwards the manager's ``step()`` asks the sweep source for every slot the prefix cache
holds, each with its predecessor slot (or -1 for a first token) and position; :meth:`Sweeper.run` copies the lists
into a verify plan of its own (non-blocking; the lists may be device tensors) and launches verify over them with
tag SWEEP and real-KV on, through :meth:`kvcanary.device_state.DeviceState.sweep`. This catches what no running
request reads: K/V of a cached but idle prefix that went bad.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvcanary import layout
from kvcanary.device_state import DeviceState
from kvcanary.plan import VerifyPlan

# () -> (slots, prev slots or -1, positions) of every slot the prefix cache holds: int sequences, or int64
# tensors (slots and prevs may stay on the device the cache keeps them on: no device -> host copy).
_Ints = Sequence[int] | torch.Tensor
SweepSource = Callable[[], tuple[_Ints, _Ints, _Ints]]
MIN_SWEEP_PLAN = 1024  # entries of the first sweep plan; it doubles (at least) when a sweep needs more


class Sweeper:
    """Sweep source, cadence (every ``interval`` steps; 0: never on its own) and plan, launching on ``state``."""

    def __init__(self, state: DeviceState, interval: int) -> None:
        self._state = state
        self.interval = interval
        self.source: SweepSource | None = None
        self._plan: VerifyPlan | None = None

    def due(self, steps: int) -> bool:
        """Whether the step that makes the step count ``steps`` runs the sweep: a source is set, the interval is
        positive and ``steps`` is a multiple of it."""
        interval = self.interval
        return self.source is not None and interval > 0 and steps % interval == 0

    def run(self, slots: _Ints, prevs: _Ints, positions: _Ints) -> None:
        """Verify the given entries (slot, predecessor slot or -1, position) with real-KV, tag SWEEP.

        Each argument is an int sequence or a 1-D int64 tensor on any device. Host-called, outside graph capture;
        the copies are non-blocking. Raises ``ValueError`` for lengths that differ or a tensor of another dtype or
        rank.
        """
        n = len(slots)
        if len(prevs) != n or len(positions) != n:
            raise ValueError(
                f"CanaryManager.sweep: slots/prevs/positions lengths differ: {n}/{len(prevs)}/{len(positions)}"
            )
        device = self._state.device
        plan = self._plan
        if plan is None or plan.capacity < n:
            plan = self._plan = VerifyPlan.allocate(max(n, 2 * (plan.capacity if plan else 0), MIN_SWEEP_PLAN), device)
        cuda = device.type == "cuda"
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
        counts = torch.tensor([n, 1], dtype=torch.int32)
        if cuda:
            counts = counts.pin_memory()
        plan.verify_expected_tokens[:n].fill_(layout.NO_EXPECTED_TOKEN)
        plan.verify_num_valid.copy_(counts[0:1], non_blocking=True)
        plan.verify_enable.copy_(counts[1:2], non_blocking=True)
        self._state.sweep(plan)
