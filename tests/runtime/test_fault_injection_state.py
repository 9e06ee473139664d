"""FaultInjectionState (kvcanary.runtime.faults): one runner's fault injection, held by the adapter's fault layer, not
by the Installation; its undo actions run around the managers' step through ``Installation.step_hooks``."""

from __future__ import annotations

import torch

from kvcanary.runtime.config import Config
from kvcanary.runtime.faults import FaultInjectionState, FaultPlan, Injection
from kvcanary.runtime.installation import Group, GroupSpec, Installation
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode


class _Reporter:
    def __init__(self) -> None:
        self.injections: list[Injection] = []

    def record_injection(self, injection: Injection) -> None:
        self.injections.append(injection)


def test_a_due_class_stays_pending_until_injected_and_is_skipped_when_due_again() -> None:
    reporter = _Reporter()
    state = FaultInjectionState(FaultPlan(classes=("real_kv_flip",), every=3), reporter)  # type: ignore[arg-type]
    tried: list[tuple[int, str]] = []

    def refuse(step: int, cls: str) -> Injection | None:
        tried.append((step, cls))
        return None

    for step in range(4):  # due at 0 and 3: the class of step 0 found no batch before step 3
        state.before_forward(step, refuse)
    assert tried == [(s, "real_kv_flip") for s in range(4)]
    assert state.skips == 1 and state.pending == ("real_kv_flip", 3) and state.injections == []
    done = Injection("real_kv_flip", 4, (5,), "flip")
    state.before_forward(4, lambda step, cls: done)
    assert state.pending is None and state.injections == [done] and reporter.injections == [done]
    state.before_forward(5, lambda step, cls: done)  # not due, nothing pending: the injector is not asked
    assert state.injections == [done]
    state.pending = ("token_swap", 5)
    state.skip_pending()  # this engine cannot take the class
    assert state.pending is None and state.skips == 2


def test_undo_actions_run_before_and_after_the_managers_step_of_host_after() -> None:
    cfg = Config(mode=Mode.LOG, stats_every=0)
    r2t = torch.zeros((4, 8), dtype=torch.int32)
    manager = CanaryManager(cfg, num_slots=16, req_to_token=r2t, device="cpu", max_batch_size=4,
                            max_tokens_per_forward=8)
    order: list[str] = []
    real_step = manager.step
    manager.step = lambda **kw: order.append("step") or real_step(**kw)  # type: ignore[method-assign]
    state = FaultInjectionState(FaultPlan(classes=("real_kv_flip",)), manager.reporter)
    inst = Installation(config=cfg, groups=[Group(GroupSpec("full", 16, ()), manager)], to_views=lambda *a: [],
                        req_to_token=r2t, step_hooks=state)
    state.undo_after_forward(lambda: order.append("after"), after_step=True)
    state.undo_after_forward(lambda: order.append("before"))
    inst.host_after()
    assert order == ["before", "step", "after"]
    inst.host_after()  # each action runs once
    assert order == ["before", "step", "after", "step"]
