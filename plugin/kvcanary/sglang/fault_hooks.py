"""The fault-injection layer of the SGLang adapter: :class:`FaultInjectingHooks` are the adapter's hooks
(:class:`kvcanary.sglang.hooks.AdapterHooks`) with the injector of ``KVCANARY_FAULT`` around the model.

Registration (:mod:`kvcanary.sglang`) takes this layer instead of the plain hooks only when ``KVCANARY_FAULT`` is set,
so the serving path of a normal deployment runs no fault-injection code and checks no fault plan. The layer adds:
the rank's fault injection to each new runner (its ``RunnerState.faults``: none for a rank ``KVCANARY_FAULT_RANK``
leaves out, nor for an EAGLE pool that does not inject), an injection before the model on the forwards the plan
picks, the repair of a swapped token's records after the model, the batch's requests for the injector, and the
host-tier classes' corruption of a HiCache load's copies before they are enqueued.
"""

from __future__ import annotations

from types import ModuleType

from kvcanary.runtime.installation import Installation
from kvcanary.sglang import hicache
from kvcanary.sglang.fault_injection import SglangFaultInjection, fault_plan_for_rank, inject_fault, repair_token_swaps
from kvcanary.sglang.hooks import AdapterHooks
from kvcanary.sglang.hooks import hooks_for as adapter_hooks_for
from kvcanary.sglang.installed import RunnerState


class FaultInjectingHooks(AdapterHooks):
    """The adapter's hooks with ``KVCANARY_FAULT``'s injector (see the module docstring)."""

    def fault_injection(self, inst: Installation, report_rank: int, role) -> SglangFaultInjection | None:
        plan = fault_plan_for_rank(report_rank) if role is None or role.inject_faults else None
        # settle: deferral stays allowed with faults (issue 25); the installation's pending writes are launched
        # before each injection and undo, in the forward hooks, on the forward's stream (FaultInjectionState.settle)
        return None if plan is None else SglangFaultInjection(plan, inst.manager.reporter,
                                                              settle=inst.flush_pending_writes)

    def before_model(self, state: RunnerState, forward_batch) -> None:
        super().before_model(state, forward_batch)
        if state.faults is not None:
            state.faults.before_forward(
                state.inst.steps, lambda step, cls: inject_fault(state, step, forward_batch, cls, self.version))

    def after_model(self, state: RunnerState, forward_batch) -> None:
        if state.faults is not None and state.faults.pending_repairs:
            repair_token_swaps(state.inst, state.faults, forward_batch)
        super().after_model(state, forward_batch)

    def batch_facts(self, state: RunnerState, reqs) -> None:
        if state.faults is not None:
            state.faults.note_batch(reqs)

    def around_hicache_start_loading(self, original, controller, *args, **kwargs):
        """The host-tier classes corrupt a load's copies before they are enqueued."""
        follower = hicache.follower_of(controller)
        if follower is not None and follower.faults is not None:
            self._in_hicache_hook(follower, "injecting a host-tier fault", follower.faults.before_start_loading)
        return original(controller, *args, **kwargs)


def hooks_for(version: ModuleType) -> FaultInjectingHooks:
    """The one FaultInjectingHooks of ``version`` in this process."""
    return adapter_hooks_for(version, FaultInjectingHooks)  # type: ignore[return-value]
