"""A host KV tier's records (kvcanary.runtime.host_tier): backup and load-back move a request's prefix to new slots, and
the canary follows; a wrong copy on the way is reported with via=host_tier."""

from __future__ import annotations

import logging

import pytest
import torch
from one_request import OneRequest

from kvcanary.report import VIA_HOST_TIER
from kvcanary.runtime.writers import LOADED_FROM_HOST_TIER, WriterTable, loaded_from_host_tier
from kvcanary.settings import Mode

PREFIX = 6
NEW_BASE = 80  # the device slots the load-back puts the prefix in (slots 1..PREFIX held it before)


def _backed_up_and_loaded(r: OneRequest, *, corrupt_host_byte: bool = False) -> torch.Tensor:
    """Back the prefix up to host slots 10.., wipe its device slots (another request reuses them), load it back
    into new device slots with its K/V (a byte flipped on the way when asked), and point the request at them."""
    mgr = r.mgr
    mgr.attach_host_tier(32)
    old = torch.arange(1, PREFIX + 1)
    host = torch.arange(10, 10 + PREFIX)
    host_kv = r.kv[old].clone()  # the engine's host copy
    mgr.backup_to_host(old, host)
    r.kv[old] = 0
    mgr.canary_buf[old] = 0  # (the slots' next writer: whatever is there now is not the prefix)
    if corrupt_host_byte:
        host_kv[2, 0] ^= 0xFF
    new = torch.arange(NEW_BASE, NEW_BASE + PREFIX)
    mgr.load_from_host(host, new)
    r.kv[new] = host_kv
    r.req_to_token[1, :PREFIX] = new.to(torch.int32)
    return new


def test_a_loaded_back_prefix_verifies_clean() -> None:
    r = OneRequest(Mode.LOG)
    r.mgr.assign_requests([1], ["req-a"])
    assert r.forward(PREFIX) == []
    _backed_up_and_loaded(r)
    assert r.forward(1) == [] and r.forward(1) == []  # decodes verify the whole loaded prefix
    tier = r.mgr.host_tier
    assert (tier.slots_backed_up, tier.slots_loaded) == (PREFIX, PREFIX)


def test_a_host_copy_that_changed_is_reported_via_the_host_tier(caplog) -> None:
    r = OneRequest(Mode.LOG)
    r.mgr.assign_requests([1], ["req-a"])
    assert r.forward(PREFIX) == []
    new = _backed_up_and_loaded(r, corrupt_host_byte=True)
    with caplog.at_level(logging.WARNING):
        found = r.forward(1)
    assert [(v.slot, v.reasons, v.via, v.writer_rid) for v in found] == [
        (int(new[2]), ("verify_real_kv_hash",), VIA_HOST_TIER, "req-a")]  # the first writer, through the tier
    assert "via=host_tier" in caplog.text


def test_without_the_load_back_hand_off_the_moved_prefix_fails() -> None:
    """The records must follow: the same move with no load_from_host is reported on every moved slot."""
    r = OneRequest(Mode.LOG)
    assert r.forward(PREFIX) == []
    r.mgr.attach_host_tier(32)
    r.mgr.load_from_host = lambda host_slots, device_slots: None  # type: ignore[method-assign]
    new = _backed_up_and_loaded(r)
    assert {v.slot for v in r.forward(1)} == set(new.tolist())


def test_index_checks_name_the_argument() -> None:
    r = OneRequest(Mode.LOG)
    with pytest.raises(RuntimeError, match="attach_host_tier"):
        r.mgr.backup_to_host([1], [1])
    r.mgr.attach_host_tier(8)
    with pytest.raises(ValueError, match="host_slots: index 8 outside"):
        r.mgr.backup_to_host([1], [8])
    with pytest.raises(ValueError, match="device_slots: index 500 outside"):
        r.mgr.load_from_host([1], [500])
    with pytest.raises(ValueError, match="2 device slots but 1 host slots"):
        r.mgr.load_from_host([1], [1, 2])
    with pytest.raises(ValueError, match="8 slots is attached already"):
        r.mgr.attach_host_tier(9)
    assert r.mgr.attach_host_tier(8) is r.mgr.host_tier


def test_the_loaded_flag_names_the_first_writer() -> None:
    table = WriterTable(4)
    _, (serial,) = table.assign([1], ["req-a"])
    assert table.writer_id(serial | LOADED_FROM_HOST_TIER) == "req-a"
    assert loaded_from_host_tier(serial | LOADED_FROM_HOST_TIER) and not loaded_from_host_tier(serial)
    assert not loaded_from_host_tier(-1) and table.writer_id(-1) is None


def test_the_stats_line_counts_the_host_tier(caplog) -> None:
    r = OneRequest(Mode.LOG, stats_every=1)
    r.forward(PREFIX)
    _backed_up_and_loaded(r)
    with caplog.at_level(logging.INFO, logger="kvcanary"):
        r.forward(1)
    assert f"host_backed_up={PREFIX} host_loaded={PREFIX}" in caplog.text


def test_a_batch_naming_a_destination_twice_keeps_the_later_copy() -> None:
    """A host slot freed and backed up again before the next forward: one batch carries both copies, and the later
    one stands (index_copy_ alone leaves the winner undefined on a GPU)."""
    r = OneRequest(Mode.LOG)
    r.forward(4)
    mgr = r.mgr
    mgr.attach_host_tier(16)
    mgr.backup_to_host(torch.tensor([1, 2, 3]), torch.tensor([5, 6, 5]))
    tier = mgr.host_tier
    assert torch.equal(tier.records[5], mgr.canary_buf[3]) and torch.equal(tier.records[6], mgr.canary_buf[2])
    mgr.load_from_host(torch.tensor([6, 5]), torch.tensor([40, 41]))
    assert torch.equal(mgr.canary_buf[40], tier.records[6]) and torch.equal(mgr.canary_buf[41], tier.records[5])
    assert torch.equal(tier.records[16], mgr.canary_buf[1])  # the earlier copy to host slot 5 went to the scratch row


def test_a_write_row_on_a_loaded_slot_does_not_say_via_host_tier() -> None:
    """A write violation reports the token being written; the slot's old content having come through the host tier
    says nothing about it (the row's attribution is that old content's)."""
    from kvcanary.kernels.batch import BatchView, ForwardKind

    r = OneRequest(Mode.LOG)
    r.mgr.assign_requests([1], ["req-a"])
    assert r.forward(PREFIX) == []
    new = _backed_up_and_loaded(r)
    r.mgr.mark_init_finished()  # the chain-position assert: a position that is not its predecessor's + 1 is reported
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    slot = int(new[3])  # overwritten at a position its predecessor (position PREFIX - 1) does not lead to
    batch = BatchView(kind=ForwardKind.DECODE, input_ids=t([7]), positions=t([PREFIX + 5]), out_cache_loc=t([slot]),
                      req_pool_indices=t([1]), prefix_lens=t([PREFIX]), extend_lens=t([1]))
    r.req_to_token[1, PREFIX] = slot
    r.mgr.before_forward(batch)
    r.mgr.after_forward(batch)
    found = [v for v in r.mgr.step() + r.mgr.flush() if v.is_write]
    assert found and all(v.slot == slot and v.via is None for v in found)
