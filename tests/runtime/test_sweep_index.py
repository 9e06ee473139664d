"""The incremental sweep plan (``kvcanary.runtime.sweep_index.SweepIndex``) on its own: after any sequence of appends,
splits and removals its live entries (plan entries that are not the padding slot) are exactly the (slot,
predecessor, position) of the spans it holds, checked against a model of chained spans; tombstones are counted for
the sweep to take off, and the plan is compacted by a rebuild."""

from __future__ import annotations

import random

import pytest
import torch

from kvcanary.kernels import layout
from kvcanary.runtime import sweep_index
from kvcanary.runtime.sweep import SweepPlan, SweepTally
from kvcanary.runtime.sweep_index import MIN_COMPACTION_ENTRIES, Span, SweepIndex, UnplacedSpan


def live(planned: SweepPlan) -> list[tuple[int, int, int]]:
    plan = planned.plan
    n = int(plan.verify_num_valid.item())
    rows = zip(plan.verify_slot_indices[:n].tolist(), plan.verify_prev_slot_indices[:n].tolist(),
               plan.verify_expected_positions[:n].tolist(), strict=True)
    return sorted(r for r in rows if r[0] != layout.PADDING_SLOT)


class Model:
    """Spans as lists of slots with a parent: what the plan must hold."""

    def __init__(self) -> None:
        self.slots: dict[str, list[int]] = {}
        self.after: dict[str, str | None] = {}

    def first_position(self, key: str) -> int:
        after = self.after[key]
        return 0 if after is None else self.first_position(after) + len(self.slots[after])

    def entries(self) -> list[tuple[int, int, int]]:
        out = []
        for key, slots in self.slots.items():
            after = self.after[key]
            prev = -1 if after is None else self.slots[after][-1]
            first = self.first_position(key)
            out += [(s, slots[i - 1] if i else prev, first + i) for i, s in enumerate(slots)]
        return sorted(out)


def test_append_split_remove_match_the_model() -> None:
    index, model = SweepIndex("cpu"), Model()
    index.append([Span("a", torch.tensor([11, 12, 13, 14])), Span("b", torch.tensor([15, 16], dtype=torch.int32),
                                                                  "a")])
    model.slots.update(a=[11, 12, 13, 14], b=[15, 16])
    model.after.update(a=None, b="a")
    assert live(index.commit()) == model.entries()
    index.append([Span("c", torch.tensor([27, 28]), "a")])  # a held span continues: its last slot is read on the device
    model.slots["c"], model.after["c"] = [27, 28], "a"
    assert live(index.commit()) == model.entries()
    index.split("a", "a0", 2)  # host only: the entries stay where they are
    model.slots.update(a0=[11, 12], a=[13, 14])
    model.after.update(a0=None, a="a0")
    planned = index.commit()
    assert live(planned) == model.entries() and planned.skipped == 0
    index.append([Span("d", torch.tensor([40]), "a0")])
    model.slots["d"], model.after["d"] = [40], "a0"
    index.remove("b")
    del model.slots["b"], model.after["b"]
    planned = index.commit()
    assert live(planned) == model.entries() and planned.skipped == 2 and len(index) == len(model.entries())


def test_an_unchanged_index_hands_back_the_same_plan_without_device_work() -> None:
    index = SweepIndex("cpu")
    index.append([Span("a", torch.tensor([1, 2]))])
    first = index.commit()
    assert not index.dirty() and index.commit() is first
    index.split("a", "h", 1)
    assert index.commit() is first  # a split changes no entry
    index.remove("h")
    assert index.dirty() and index.commit() is not first


def test_a_span_that_continues_an_unknown_span_changes_nothing() -> None:
    index = SweepIndex("cpu")
    index.append([Span("a", torch.tensor([1, 2]))])
    before = live(index.commit())
    with pytest.raises(UnplacedSpan):
        index.append([Span("b", torch.tensor([3])), Span("c", torch.tensor([4]), "nowhere")])
    assert "b" not in index and live(index.commit()) == before
    with pytest.raises(ValueError, match="already owns"):
        index.append([Span("a", torch.tensor([5]))])
    with pytest.raises(ValueError, match="empty span"):
        index.append([Span("e", torch.zeros(0, dtype=torch.int64))])


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "repeat-interleave"])
@pytest.mark.parametrize("seed", range(12))
def test_random_changes_match_the_model(seed: int, scan: bool, monkeypatch) -> None:
    """Appends (batches with in-batch and held parents), splits, removals of leaves, growth past the plan's
    capacity, many tombstone ranges at once, compactions and rebuilds; every expansion by a scan of uploaded
    differences, or every one by repeat_interleave."""
    monkeypatch.setattr(sweep_index, "SCAN_ENTRIES", 1 << 20 if scan else -1)
    rng = random.Random(seed)
    index, model = SweepIndex("cpu"), Model()
    next_slot, names = 1, 0
    for _ in range(60):
        op = rng.random()
        if op < 0.45 or not model.slots:
            batch, keys = [], list(model.slots)
            for _ in range(rng.randrange(1, 6)):
                after = rng.choice([None, *keys]) if keys else None
                n = rng.randrange(1, 300)
                key = f"n{names}"
                names += 1
                slots = list(range(next_slot, next_slot + n))
                next_slot += n
                batch.append(Span(key, torch.tensor(slots), after))
                model.slots[key], model.after[key] = slots, after
                keys.append(key)
            index.append(batch)
        elif op < 0.65:
            key = rng.choice(list(model.slots))
            slots = model.slots[key]
            if len(slots) > 1:
                cut = rng.randrange(1, len(slots))
                head = f"n{names}"
                names += 1
                index.split(key, head, cut)
                model.slots[head], model.after[head] = slots[:cut], model.after[key]
                model.slots[key], model.after[key] = slots[cut:], head  # (its children still continue it)
        elif op < 0.9:
            leaves = [k for k in model.slots if k not in model.after.values()]
            for key in rng.sample(leaves, min(len(leaves), rng.randrange(1, 5))):
                index.remove(key)
                del model.slots[key], model.after[key]
        elif op < 0.95:
            index.compact()  # (tombstones dropped by a gather of the live ranges: no rebuild)
            assert index.tombstones == 0
        else:
            order = []  # parents before children
            placed: set[str] = set()
            while len(order) < len(model.slots):
                for key in model.slots:
                    if key not in placed and (model.after[key] is None or model.after[key] in placed):
                        placed.add(key)
                        order.append(key)
            index.clear()  # (a rebuild from a walk, parents before children)
            index.append([Span(k, torch.tensor(model.slots[k]), model.after[k]) for k in order])
            assert index.tombstones == 0
        planned = index.commit()
        assert live(planned) == model.entries()
        assert planned.skipped == index.tombstones and len(index) == len(model.entries())


def test_compaction_is_wanted_once_tombstones_are_half_the_plan() -> None:
    index = SweepIndex("cpu")
    index.append([Span("a", torch.arange(1, MIN_COMPACTION_ENTRIES + 1)),
                  Span("b", torch.arange(10**6, 10**6 + MIN_COMPACTION_ENTRIES))])
    assert not index.wants_compaction()
    index.remove("b")
    assert index.wants_compaction() and index.commit().skipped == MIN_COMPACTION_ENTRIES
    index.clear()
    index.append([Span("a", torch.arange(1, MIN_COMPACTION_ENTRIES + 1))])
    planned = index.commit()
    assert not index.wants_compaction() and planned.skipped == 0 and int(planned.plan.verify_num_valid) == len(index)


def test_appends_splits_and_removals_before_one_commit() -> None:
    """Appends are written at the commit: spans appended by several calls, one continuing another of an earlier
    call, one split and one removed before the commit, land as the model says (the removed one's entries never
    count), and a compaction in between commits the appends first."""
    index, model = SweepIndex("cpu"), Model()
    index.append([Span("a", torch.tensor([1, 2, 3]))])
    index.append([Span("b", torch.tensor([4, 5]), "a"), Span("c", torch.tensor([6]))])
    index.split("a", "a0", 1)
    index.append([Span("d", torch.tensor([7, 8]), "a0")])
    index.remove("c")
    model.slots.update(a0=[1], a=[2, 3], b=[4, 5], d=[7, 8])
    model.after.update(a0=None, a="a0", b="a", d="a0")
    planned = index.commit()
    assert live(planned) == model.entries() and planned.skipped == 1
    index.append([Span("e", torch.tensor([9]), "d")])
    index.remove("b")
    index.compact()
    model.slots["e"], model.after["e"] = [9], "d"
    del model.slots["b"], model.after["b"]
    planned = index.commit()
    assert live(planned) == model.entries() and planned.skipped == 0
    assert int(planned.plan.verify_num_valid) == len(index) == 6


def test_compaction_gathers_the_live_ranges_without_a_rebuild() -> None:
    """A compaction keeps every live entry (slot, predecessor, position), drops the tombstones, and the spans it
    moved are still continued, split and removed correctly; the plan's last entry keeps the -1 a chain head reads
    (never inside the verified range), also after growth."""
    index, model = SweepIndex("cpu"), Model()
    index.append([Span("a", torch.arange(1, 3001)), Span("dead", torch.arange(5000, 10000), "a"),
                  Span("b", torch.arange(20000, 20100), "a")])
    model.slots.update(a=list(range(1, 3001)), b=list(range(20000, 20100)))
    model.after.update(a=None, b="a")
    index.remove("dead")
    assert index.wants_compaction()
    before = index.commit().plan
    index.reserve(0)  # (the caller's reserve, outside the producer stream, allocates the compaction's buffer)
    index.compact()
    planned = index.commit()
    assert planned.plan is not before and planned.skipped == 0 and int(planned.plan.verify_num_valid) == 3100
    assert live(planned) == model.entries() and not index.wants_compaction()
    index.split("b", "b0", 40)
    index.append([Span("c", torch.tensor([30000, 30001]), "b0"), Span("h", torch.tensor([40000]))])
    index.remove("b")
    model.slots.update(b0=list(range(20000, 20040)), c=[30000, 30001], h=[40000])
    model.after.update(b0="a", c="b0", h=None)
    del model.slots["b"], model.after["b"]
    planned = index.commit()
    assert live(planned) == model.entries()
    index.append([Span(f"g{i}", torch.arange(50000 + 100 * i, 50000 + 100 * i + 100)) for i in range(60)])  # grows
    planned = index.commit()
    for plan in (planned.plan, index._spare):
        if plan is not None:
            assert int(plan.verify_slot_indices[plan.capacity - 1]) == -1
    assert planned.plan.capacity > int(planned.plan.verify_num_valid)


def test_a_plan_is_a_sweep_plan() -> None:
    """No expected tokens (verify compares none) and enabled."""
    index = SweepIndex("cpu")
    index.append([Span("a", torch.tensor([3, 4]))])
    plan = index.commit().plan
    assert int(plan.verify_enable) == 1 and bool((plan.verify_expected_tokens == layout.NO_EXPECTED_TOKEN).all())


def test_the_sweeper_counts_its_host_time_and_the_host_line_reports_it() -> None:
    from kvcanary.runtime.installation import HostTime
    from kvcanary.runtime.sweep import Sweeper

    launched = []

    class State:  # (what the sweeper needs of DeviceState)
        device = torch.device("cpu")

        def sweep(self, plan, skipped=0):
            launched.append((plan, skipped))

    index = SweepIndex("cpu")
    index.append([Span("a", torch.tensor([1, 2]))])
    index.remove("a")
    sweeper = Sweeper(State(), interval=10)
    sweeper.source = index.commit
    sweeper.run_source()
    assert sweeper.host_ns > 0 and launched[0][1] == 2  # the tombstones go to the launch, to be taken off its count
    assert sweeper.sweeps == 1 and sweeper.walks == sweeper.compactions == 0  # (a source that counts neither)
    walking = lambda: index.commit()  # noqa: E731
    walking.walks, walking.compactions = 3, 2
    sweeper.source = walking
    sweeper.run_source()
    assert sweeper.sweeps == 2 and sweeper.walks == 3 and sweeper.compactions == 2  # the source's own counts
    host = HostTime(forwards=4, hook_ns=400_000)
    period = sweeper.tally() - SweepTally(host_ns=sweeper.host_ns - 100_000, sweeps=1)
    assert period == SweepTally(host_ns=100_000, sweeps=1, walks=3, compactions=2)
    assert host.line(step=4, sweep=period).endswith(
        " batch_init_us=0.0 sweep_us=25.0 sweeps=1 sweep_walks=3 sweep_compactions=2 sweep_event_us=0.0 "
        "max_forward_us=0.0 slow_forwards=0")
    # a source's time following its cache's changes is outside every hook: the line adds it to the canary's total
    followed = HostTime(forwards=4, hook_ns=400_000).line(step=4, sweep=SweepTally(sweeps=1, event_ns=40_000))
    assert "canary_us_per_forward=110.0 " in followed and " sweep_event_us=10.0 max_forward_us=" in followed
    assert "sweep_us" not in HostTime(forwards=4).line(step=4)
    assert "sweep_us" not in HostTime(forwards=4).line(step=4, sweep=SweepTally())  # a period without a sweep


def test_prime_runs_both_gather_index_builds_and_the_gather_and_changes_no_entry(monkeypatch) -> None:
    """``prime`` runs what a compaction launches (the scan and the segment ways of building its gather index, the
    gather), so that on a GPU their first launches come at start-up; the index is left as a fresh one: the same plans
    after the same changes, compaction included."""
    calls = []
    for name in ("cumsum", "repeat_interleave", "index_select"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    primed, fresh = SweepIndex("cpu"), SweepIndex("cpu")
    primed.prime()
    assert sorted(set(calls)) == ["cumsum", "index_select", "repeat_interleave"] and len(primed) == 0
    for index in (primed, fresh):
        index.append([Span("a", torch.arange(1, 3001)), Span("dead", torch.arange(5000, 10000), "a")])
        index.remove("dead")
        index.reserve(0)
        index.compact()
    assert live(primed.commit()) == live(fresh.commit()) and primed.compactions == fresh.compactions == 1
