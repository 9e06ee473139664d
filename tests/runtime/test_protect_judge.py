"""kvcanary.runtime.protect.judge on its own (no engine): what a violation condemns of its request."""

from __future__ import annotations

from kvcanary.kernels import layout
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import Violation
from kvcanary.runtime import protect


def _violation(step: int, row: int, slot: int, position: int, bits: int) -> Violation:
    return Violation(int(LaunchTag.VERIFY), slot, position, 0, 0, 0, 0, bits, step, request_row=row)


def _history(req) -> protect.BatchHistory:
    h = protect.BatchHistory(8)
    # decode forwards of one request in row 3: forward s feeds position 40 + s (prefix 40 + s, seq_len 41 + s)
    for s in range(1, 6):
        h.note(s, [3], [41 + s], [40 + s], [req])
    return h


def test_a_bad_slot_keeps_what_the_verifying_forward_fed() -> None:
    req = object()
    j = protect.judge([_violation(4, 3, 900, 30, layout.REASON_VERIFY_REAL_KV_HASH)], [_history(req)])
    (v,) = j.verdicts
    assert (v.keep_len, v.taint_from, v.first_step) == (45, 44, 4) and j.bad_slots == {900}


def test_a_swapped_token_drops_what_was_produced_after_it() -> None:
    """A token swap fed forward 3 a wrong token at position 43; forward 4's verify sees the record (verify_token):
    forward 3's output (position 44) was computed from it and must not be kept."""
    req = object()
    j = protect.judge([_violation(4, 3, 777, 43, layout.REASON_VERIFY_TOKEN)], [_history(req)])
    (v,) = j.verdicts
    assert (v.keep_len, v.taint_from) == (44, 43) and not j.bad_slots
    # a redirected mapping (chain hash too) condemns only what the verifying forward read
    j = protect.judge([_violation(4, 3, 777, 20, layout.REASON_VERIFY_TOKEN | layout.REASON_VERIFY_CHAIN_HASH)],
                      [_history(req)])
    assert (j.verdicts[0].keep_len, j.verdicts[0].taint_from) == (45, 44)
    # the earliest bound wins when both come in one drain
    j = protect.judge([_violation(4, 3, 900, 30, layout.REASON_VERIFY_REAL_KV_HASH),
                       _violation(4, 3, 777, 43, layout.REASON_VERIFY_TOKEN)], [_history(req)])
    assert (j.verdicts[0].keep_len, j.verdicts[0].taint_from, j.verdicts[0].violations) == (44, 43, 2)


def test_a_slot_rewritten_during_the_previous_forward_drops_that_forwards_output() -> None:
    """A stale slot reuse: another request wrote slot 555 in forward 3, which this request's forward 3 read (after
    forward 3's verify); forward 4's verify sees it. Forward 3's output (position 44, fed in forward 4) was computed
    over it: the request keeps what forward 3 was fed (seq_len 44), its KV from forward 3's prefix (43) is bad."""
    req = object()
    bits = layout.REASON_VERIFY_CHAIN_HASH | layout.REASON_VERIFY_TOKEN
    v = Violation(int(LaunchTag.VERIFY), 555, 20, 0, 0, 0, 0, bits, 4, request_row=3, written_step=3)
    (verdict,) = protect.judge([v], [_history(req)]).verdicts
    assert (verdict.keep_len, verdict.taint_from) == (44, 43)
    # written before the previous forward's verify: that verify saw it clean, so the previous output stands
    old = Violation(int(LaunchTag.VERIFY), 555, 20, 0, 0, 0, 0, bits, 4, request_row=3, written_step=2)
    (verdict,) = protect.judge([old], [_history(req)]).verdicts
    assert (verdict.keep_len, verdict.taint_from) == (45, 44)


def test_a_decode_record_works_the_prefix_out_from_the_sequence_length() -> None:
    """A decode forward (one token fed per row) is recorded without a prefix list: its rows' prefix is seq_len - 1,
    worked out when a violation looks the row up; an extend forward keeps its own prefix lengths."""
    h = protect.BatchHistory(8)
    decode, extend = object(), object()
    h.note(5, [3, 4], [41, 17], None, [decode, extend])
    h.note(6, [4], [30], [12], [extend])
    assert h.owner(5, 3) == (decode, 41, 40)
    assert h.owner(6, 4) == (extend, 30, 12)
    assert h.previous(6, extend) == (5, 17, 16)
