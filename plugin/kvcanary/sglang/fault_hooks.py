"""The fault-injection layer of the SGLang adapter: :class:`FaultInjectingHooks` are the adapter's hooks
(:class:`kvcanary.sglang.hooks.AdapterHooks`) with the injector of ``KVCANARY_FAULT`` around the model.

Registration (:mod:`kvcanary.sglang`) takes this layer instead of the plain hooks only when ``KVCANARY_FAULT`` is set,
so the serving path of a normal deployment runs no fault-injection code and checks no fault plan. The layer adds:
the rank's fault plan to each new installation (none for a rank ``KVCANARY_FAULT_RANK`` leaves out, nor for an
EAGLE pool that does not inject), an injection before the model on the forwards the plan picks, the repair of a
swapped token's records after the model, the batch's requests for the injector, and the host-tier classes'
corruption of a HiCache load's copies before they are enqueued.
"""

from __future__ import annotations

from types import ModuleType

from kvcanary.runtime.installation import Installation
from kvcanary.sglang import hicache
from kvcanary.sglang.fault_injection import fault_plan_for_rank, inject_fault, repair_token_swaps, rows_remaining
from kvcanary.sglang.hooks import AdapterHooks
from kvcanary.sglang.hooks import hooks_for as adapter_hooks_for


class FaultInjectingHooks(AdapterHooks):
    """The adapter's hooks with ``KVCANARY_FAULT``'s injector (see the module docstring)."""

    def fault_plan(self, report_rank: int, role) -> object | None:
        return fault_plan_for_rank(report_rank) if role is None or role.inject_faults else None

    def before_model(self, inst: Installation, forward_batch) -> None:
        super().before_model(inst, forward_batch)
        if inst.fault_plan is not None:
            inst.host_before(lambda i, step, cls: inject_fault(i, step, forward_batch, cls, self.version))

    def after_model(self, inst: Installation, forward_batch) -> None:
        if inst.pending_repairs:
            repair_token_swaps(inst, forward_batch)
        super().after_model(inst, forward_batch)

    def batch_facts(self, inst: Installation, reqs) -> None:
        if inst.fault_plan is not None:
            inst.batch_reqs = list(reqs)
            inst.row_remaining = rows_remaining(reqs)

    def around_hicache_start_loading(self, original, controller, *args, **kwargs):
        """The host-tier classes corrupt a load's copies before they are enqueued."""
        follower = hicache.follower_of(controller)
        if follower is not None and follower.faults is not None:
            self._in_hicache_hook(follower, "injecting a host-tier fault", follower.faults.before_start_loading)
        return original(controller, *args, **kwargs)


def hooks_for(version: ModuleType) -> FaultInjectingHooks:
    """The one FaultInjectingHooks of ``version`` in this process."""
    return adapter_hooks_for(version, FaultInjectingHooks)  # type: ignore[return-value]
