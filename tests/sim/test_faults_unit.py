"""Each injector in kvcanary.runtime.faults mutates exactly what it says, logs it, and returns an Injection;
FaultPlan.from_env parses good values and names the variable on bad ones."""

from __future__ import annotations

import logging

import pytest
import torch

from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime import faults
from kvcanary.runtime.faults import FaultPlan, Injection


def _r2t() -> torch.Tensor:
    return torch.arange(1, 25, dtype=torch.int32).view(3, 8)


def _changed(before: torch.Tensor, after: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(i) for i in (before != after).nonzero().tolist()]


def _logged(caplog, inj: Injection) -> None:
    lines = [r.getMessage() for r in caplog.records
             if r.name == "kvcanary.runtime.faults" and r.levelno == logging.WARNING]
    assert len(lines) == 1, lines
    assert inj.fault in lines[0] and inj.detail in lines[0]
    caplog.clear()


def test_redirect_req_to_token(caplog) -> None:
    t = _r2t()
    before = t.clone()
    inj = faults.redirect_req_to_token(t, 1, 3, 20, step=7)
    assert _changed(before, t) == [(1, 3)] and int(t[1, 3]) == 20
    assert inj == Injection("req_to_token_redirect", 7, (20, 12, 13), "req_to_token[1, 3]: 12 -> 20")
    _logged(caplog, inj)
    t[1, 4] = 0  # no successor mapped: only the new and old slots
    assert faults.redirect_req_to_token(t, 1, 3, 5).slots == (5, 20)
    with pytest.raises(IndexError, match="row"):
        faults.redirect_req_to_token(t, 3, 0, 1)


def test_keep_stale_mapping(caplog) -> None:
    t = _r2t()
    before = t.clone()
    inj = faults.keep_stale_mapping(t, 2, 0, 99, step=1)
    assert _changed(before, t) == [(2, 0)] and int(t[2, 0]) == 99
    assert inj.fault == "stale_slot_reuse" and inj.slots == (99,) and inj.step == 1
    _logged(caplog, inj)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    "fn,name", [(faults.flip_real_kv, "real_kv_flip"), (faults.flip_cached_idle, "cached_idle_corruption")]
)
def test_flip_bytes(caplog, page_size: int, fn, name: str) -> None:
    buf = torch.arange(8 * page_size * 32, dtype=torch.int32).to(torch.uint8).view(8, page_size * 32)
    src = RealKvSource(buf, page_size, 32, 32)
    before = buf.clone()
    slot = 5 if page_size == 1 else 4 * 3 + 2
    inj = fn(src, slot, byte=3, mask=0x0F, step=2)
    row, col = divmod(slot, page_size)
    assert _changed(before, buf) == [(row, col * 32 + 3)]
    assert int(buf[row, col * 32 + 3]) == int(before[row, col * 32 + 3]) ^ 0x0F
    assert inj.fault == name and inj.slots == (slot,) and inj.step == 2
    _logged(caplog, inj)
    fn(src, slot, byte=3, mask=0x0F)  # the same flip again restores the byte
    assert torch.equal(buf, before)
    with pytest.raises(IndexError, match="byte"):
        fn(src, slot, byte=32)
    with pytest.raises(IndexError, match="slot"):
        fn(src, src.num_slots)
    with pytest.raises(ValueError, match="mask"):
        fn(src, 1, mask=0)


def _host_source(page_size: int, rows: int = 6) -> tuple[torch.Tensor, RealKvSource]:
    buf = (torch.arange(rows * page_size * 32, dtype=torch.int32) * 7).to(torch.uint8).view(rows, page_size * 32)
    return buf, RealKvSource(buf, page_size, 32, 32)


@pytest.mark.parametrize("page_size", [1, 4])
def test_flip_host_copy(caplog, page_size: int) -> None:
    buf, src = _host_source(page_size)
    before = buf.clone()
    host_slot = 3 if page_size == 1 else 4 * 2 + 1
    inj = faults.flip_host_copy(src, host_slot, 77, byte=5, mask=0x30, step=9)
    row, col = divmod(host_slot, page_size)
    assert _changed(before, buf) == [(row, col * 32 + 5)]
    assert int(buf[row, col * 32 + 5]) == int(before[row, col * 32 + 5]) ^ 0x30
    # the injection names the device slot the bad copy is loaded into: that is where the canary reports it
    assert inj.fault == "host_tier_flip" and inj.slots == (77,) and inj.step == 9
    assert f"host slot {host_slot}" in inj.detail and "device slot 77" in inj.detail
    _logged(caplog, inj)
    faults.flip_host_copy(src, host_slot, 77, byte=5, mask=0x30)  # the same flip again restores the byte
    assert torch.equal(buf, before)
    with pytest.raises(IndexError, match="slot"):
        faults.flip_host_copy(src, src.num_slots, 1)
    with pytest.raises(IndexError, match="byte"):
        faults.flip_host_copy(src, 1, 1, byte=32)
    with pytest.raises(ValueError, match="mask"):
        faults.flip_host_copy(src, 1, 1, mask=0x100)
    with pytest.raises(ValueError, match="device_slot"):
        faults.flip_host_copy(src, 1, -1)
    assert torch.equal(buf, before)  # a refused call changes nothing


def test_misdirect_load(caplog) -> None:
    slots = torch.tensor([10, 11, 12, 13])
    inj, kv_slots = faults.misdirect_load(slots, step=4)
    assert slots.tolist() == [10, 11, 12, 13]  # the records' slots stay as the engine has them
    assert kv_slots.tolist() == [11, 12, 13, 10]  # host slot i's K/V lands where slot i + 1 is recorded
    assert inj.fault == "load_wrong_slots" and inj.slots == (10, 11, 12, 13) and inj.step == 4
    _logged(caplog, inj)
    _, two = faults.misdirect_load(torch.tensor([5, 5, 6]))
    assert two.tolist() == [5, 6, 5]
    for bad in (torch.tensor([7]), torch.tensor([7, 7]), torch.tensor([], dtype=torch.int64)):
        with pytest.raises(ValueError, match=">= 2 distinct"):
            faults.misdirect_load(bad)
    with pytest.raises(ValueError, match="1-D"):
        faults.misdirect_load(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("page_size", [1, 4])
def test_stale_host_read(caplog, page_size: int) -> None:
    k_buf, k = _host_source(page_size)
    v_buf, v = _host_source(page_size)
    v_buf.add_(3)
    before_k, before_v = k_buf.clone(), v_buf.clone()
    host_slots, device_slots = [1, page_size + 2], [40, 41]
    inj, undo = faults.stale_host_read([k, v], host_slots, device_slots, step=2)
    assert inj.fault == "load_before_backup" and inj.slots == (40, 41) and inj.step == 2
    _logged(caplog, inj)
    for buf, before in ((k_buf, before_k), (v_buf, before_v)):
        changed = {(r, c) for r, c in _changed(before, buf)}
        want = {(h // page_size, (h % page_size) * 32 + b) for h in host_slots for b in range(32)}
        assert changed == want  # every byte of each host slot, in both sources, and nothing else
        assert torch.equal(buf ^ before, torch.where(before != buf, 0x5A, 0).to(torch.uint8))
    undo()  # the backup lands: the host copies are right again
    assert torch.equal(k_buf, before_k) and torch.equal(v_buf, before_v)
    k_buf[0, 0] ^= 1  # written after the undo ...
    undo()  # ... and a second undo does not touch it
    assert int(k_buf[0, 0]) == int(before_k[0, 0]) ^ 1
    with pytest.raises(ValueError, match="as many"):
        faults.stale_host_read([k], [1, 2], [3])
    with pytest.raises(ValueError, match="as many"):
        faults.stale_host_read([k], [], [])
    with pytest.raises(ValueError, match="host_sources"):
        faults.stale_host_read([], [1], [3])
    with pytest.raises(IndexError, match="slot"):
        faults.stale_host_read([k], [k.num_slots], [3])


def test_host_tier_classes_are_fault_classes() -> None:
    assert faults.HOST_TIER_CLASSES == ("host_tier_flip", "load_wrong_slots", "load_before_backup")
    assert faults.FAULT_CLASSES[-3:] == faults.HOST_TIER_CLASSES
    for c in faults.HOST_TIER_CLASSES:
        assert faults.EXPECTED_REASONS[c] == ("verify_real_kv_hash",)
    assert FaultPlan.from_env({"KVCANARY_FAULT": "load_before_backup"}).classes == ("load_before_backup",)


def test_swap_tokens(caplog) -> None:
    ids, loc = torch.tensor([10, 11, 12, 13]), torch.tensor([5, 6, 7, 8])
    inj = faults.swap_tokens(ids, 1, 3, out_cache_loc=loc, step=4)
    assert ids.tolist() == [10, 13, 12, 11] and loc.tolist() == [5, 6, 7, 8]
    assert inj.fault == "token_swap" and inj.slots == (6, 8)
    _logged(caplog, inj)
    assert faults.swap_tokens(ids, 0, 2).slots == ()


def test_skew_position(caplog) -> None:
    pos, loc = torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6])
    inj = faults.skew_position(pos, 2, -2, out_cache_loc=loc)
    assert pos.tolist() == [0, 1, 0] and inj.slots == (6,) and inj.fault == "position_skew"
    _logged(caplog, inj)
    with pytest.raises(ValueError, match="delta"):
        faults.skew_position(pos, 0, 0)


def test_out_of_range_slot(caplog) -> None:
    loc = torch.tensor([3, 4, 5])
    inj = faults.out_of_range_slot(loc, 1, 64, offset=2)
    assert loc.tolist() == [3, 66, 5] and inj.slots == (66, 4) and inj.fault == "out_of_range_index"
    _logged(caplog, inj)
    t = _r2t()
    before = t.clone()
    inj = faults.out_of_range_slot(t, (0, 5), 64)
    assert _changed(before, t) == [(0, 5)] and int(t[0, 5]) == 64 and inj.slots == (64, 6)
    _logged(caplog, inj)
    with pytest.raises(ValueError, match="indices"):
        faults.out_of_range_slot(t, 1, 64)
    with pytest.raises(ValueError, match="int32"):
        faults.out_of_range_slot(t, (0, 0), 1 << 31)
    with pytest.raises(ValueError, match="offset"):
        faults.out_of_range_slot(loc, 0, 64, offset=-1)


def test_every_class_has_expected_reasons() -> None:
    from kvcanary.kernels import layout

    names = set(layout.reason_names(sum(int(r) for r in layout.FailReason)))
    assert set(faults.EXPECTED_REASONS) == set(faults.FAULT_CLASSES)
    for reasons in faults.EXPECTED_REASONS.values():
        assert reasons and set(reasons) <= names


def test_fault_plan_from_env_good() -> None:
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({"KVCANARY_FAULT": "  "}) is None
    plan = FaultPlan.from_env({"KVCANARY_FAULT": "Real_KV_Flip, token_swap,real_kv_flip", "KVCANARY_FAULT_EVERY": "7",
                               "KVCANARY_FAULT_WARMUP": "20", "KVCANARY_FAULT_SEED": "3"})
    assert plan == FaultPlan(("real_kv_flip", "token_swap"), every=7, warmup=20, seed=3)
    assert [s for s in range(40) if plan.due(s)] == [20, 27, 34]
    assert plan.pick(27) == plan.pick(27) and plan.pick(27) in plan.classes
    assert FaultPlan.from_env({"KVCANARY_FAULT": "all"}).classes == faults.FAULT_CLASSES
    assert FaultPlan.from_env({"KVCANARY_FAULT": "position_skew"}) == FaultPlan(("position_skew",), 100, 0, 0)


@pytest.mark.parametrize(
    "env,var,allowed",
    [
        ({"KVCANARY_FAULT": "bitrot"}, "KVCANARY_FAULT", "req_to_token_redirect"),
        ({"KVCANARY_FAULT": "token_swap,"}, "KVCANARY_FAULT", "out_of_range_index"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_EVERY": "0"}, "KVCANARY_FAULT_EVERY", ">= 1"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_EVERY": "ten"}, "KVCANARY_FAULT_EVERY", ">= 1"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_WARMUP": "-1"}, "KVCANARY_FAULT_WARMUP", ">= 0"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_SEED": "x"}, "KVCANARY_FAULT_SEED", ">= 0"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_RANK": "-1"}, "KVCANARY_FAULT_RANK", ">= 0"),
        ({"KVCANARY_FAULT": "token_swap", "KVCANARY_FAULT_RANK": "one"}, "KVCANARY_FAULT_RANK", ">= 0"),
    ],
)
def test_fault_plan_from_env_bad(env: dict[str, str], var: str, allowed: str) -> None:
    with pytest.raises(ValueError) as err:
        FaultPlan.from_env(env)
    assert var in str(err.value) and allowed in str(err.value)


def test_fault_plan_reads_os_environ(monkeypatch) -> None:
    monkeypatch.setenv("KVCANARY_FAULT", "out_of_range_index")
    monkeypatch.setenv("KVCANARY_FAULT_EVERY", "5")
    assert FaultPlan.from_env() == FaultPlan(("out_of_range_index",), every=5)


def test_fault_plan_rank_filter() -> None:
    everywhere = FaultPlan.from_env({"KVCANARY_FAULT": "real_kv_flip"})
    assert everywhere.rank is None and everywhere.applies_to(0) and everywhere.applies_to(3)
    rank1 = FaultPlan.from_env({"KVCANARY_FAULT": "real_kv_flip", "KVCANARY_FAULT_RANK": " 1 "})
    assert rank1.rank == 1 and rank1.applies_to(1) and not rank1.applies_to(0)
