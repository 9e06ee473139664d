"""Padding rows by slot (csrc/canary_plan.cuh): a row whose first new token lands on the padding slot is planned as a
padding row, whatever its req_pool_indices and positions (CanaryManager on CPU, and the reference).

* A CUDA-graph batch padded the way sglang 0.5.12's decode graphs pad it (out_cache_loc 0 in the padded rows, their
  req_pool_indices and positions an earlier fill's) gives no violation and no write, without any host zeroing.
* A buggy engine that hands a real request slot 0 is still reported: the skipped row's prefix is verified on its next
  forward, and the write after it finds slot 0 holding no record of the request (chain-position assert).
"""

from __future__ import annotations

import torch
from test_manager_attribution import KV_BYTES, Harness, t64

from kvcanary.kernels import check_ref, layout
from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.plan import WritePlan
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.settings import Mode


def _stale_decode_batch(h: Harness, rows: list[int], stale: list[tuple[int, int]]) -> BatchView:
    """A decode graph's batch: ``rows`` decode one token each, then the padded rows with a stale (req_pool_index,
    position) each and out_cache_loc 0 (what populate_from_forward_batch leaves in them)."""
    entries = {row: h.new_entries(row, 1)[0] for row in rows}
    for row, (p, _, slot) in entries.items():
        h.req_to_token[row, p] = slot
    ids = [token for _, token, _ in entries.values()] + [777] * len(stale)
    pos = [p for p, _, _ in entries.values()] + [p for _, p in stale]
    locs = [slot for _, _, slot in entries.values()] + [layout.PADDING_SLOT] * len(stale)
    rps = rows + [rp for rp, _ in stale]
    ones = [1] * len(rps)
    return BatchView(ForwardKind.DECODE, t64(ids), t64(pos), t64(locs), t64(rps), t64(pos), t64(ones))


def _finished_request_row(h: Harness) -> int:
    """Row 3 held a request of 5 tokens that finished; its slots were handed to other requests since (a stale
    padded row pointing at it would be verified against records it no longer owns)."""
    h.forward({3: h.new_entries(3, 5)})
    h.forward({1: h.new_entries(1, 3), 2: h.new_entries(2, 2)})
    h.req_to_token[3, :5] = h.req_to_token[1, 0]  # (the allocator reused row 3's slots: the row is garbage now)
    return 3


def test_stale_padded_rows_are_neither_verified_nor_written() -> None:
    h = Harness(Mode.LOG, drain_every=1)
    h.mgr.mark_init_finished()
    stale_row = _finished_request_row(h)
    padding_record = h.mgr.canary_buf[layout.PADDING_SLOT].clone()
    batch = _stale_decode_batch(h, [1, 2], [(stale_row, 4), (stale_row, 2)])
    h.mgr.before_forward(batch)
    h.mgr.after_forward(batch)
    h.mgr.step()
    assert h.mgr.violations == []
    plan = h.mgr.device_state.write_plan
    assert plan.write_offsets[:5].tolist() == [0, 1, 2, 2, 2]  # the padded rows' ranges are empty
    assert plan.write_seed_slot_indices[2:4].tolist() == [layout.CHAIN_HEAD_SLOT] * 2
    assert torch.equal(h.mgr.canary_buf[layout.PADDING_SLOT], padding_record)  # nothing written to slot 0
    h.decode([1, 2])  # and the real rows' chains go on clean
    assert h.mgr.violations == []


def test_the_reference_plans_stale_padded_rows_as_padding() -> None:
    h = Harness(Mode.LOG, drain_every=1)
    stale_row = _finished_request_row(h)
    batch = _stale_decode_batch(h, [1, 2], [(stale_row, 4)])
    plan = WritePlan.allocate(4, "cpu")
    state = torch.zeros(layout.STATE_HEADER_FIELDS + 8 * layout.VIOLATION_FIELDS, dtype=torch.int64)
    n = batch.num_tokens
    check_ref.canary_check_step(
        state=state, canary_buf=h.mgr.canary_buf.clone(), write_plan=plan,
        req_pool_indices=batch.req_pool_indices, prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens,
        req_to_token=h.req_to_token, input_ids=batch.input_ids, positions=batch.positions,
        out_cache_loc=batch.out_cache_loc, input_ids_out=torch.zeros(n, dtype=torch.int64),
        positions_out=torch.zeros(n, dtype=torch.int64), out_cache_loc_out=torch.zeros(n, dtype=torch.int64),
        real_kv_sources=[RealKvSource(h.kv, 1, KV_BYTES, KV_BYTES)], real_kv_hash_mode=h.mgr.device_state.real_kv_mode,
    )  # fmt: skip
    assert int(state[layout.STATE_WRITE_INDEX]) & 0xFFFFFFFF == 0  # no violation row
    assert plan.write_offsets.tolist() == [0, 1, 2, 2, 2]
    assert plan.write_seed_slot_indices[2] == layout.CHAIN_HEAD_SLOT


def test_a_real_row_on_slot_0_is_still_reported() -> None:
    """A buggy engine allocates slot 0 to request row 1's next token (req_to_token and out_cache_loc both say 0).
    That forward plans the row as padding (its prefix is not verified, its token not written); the row's next forward
    verifies the prefix again (a record corrupted before is reported there) and its write, seeded by slot 0, finds no
    record of the row's previous position there (chain-position assert: the old plan wrote slot 0 and saw nothing)."""
    h = Harness(Mode.LOG, drain_every=1)
    h.forward({1: h.new_entries(1, 4)})
    h.mgr.mark_init_finished()
    corrupted = int(h.req_to_token[1, 1])
    h.mgr.canary_buf[corrupted, 8] ^= 1  # a record of the row's prefix, corrupted before the slot-0 forward
    h.forward({1: [(4, 104, layout.PADDING_SLOT)]})
    assert h.mgr.violations == []  # (the row is padding in this forward)
    h.decode([1])
    found = {(v.tag_name, v.slot) for v in h.mgr.violations}
    assert ("verify", corrupted) in found
    assert any(tag == "write" for tag, _ in found), found
