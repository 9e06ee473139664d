"""The deferred write of issue 25: a bound check call with ``pending_write_tokens`` n >= 0 runs the write of the
previous forward (``canary_write_bind``'s function, bound into ``canary_check_bind`` as ``deferred_write``) over the
first n snapshot tokens, then the check.

* Bit-identical: forwards through the bound check with each write deferred into the next check call leave exactly
  what the same forwards with each write launched on its own leave (records, attribution, state header with its
  counters and forward counter, ring rows and their metadata, write plan, snapshots).
* A batch the check refuses does not lose the pending write: it ran before the check validated the batch.
* CUDA: the nested write is enqueued on the stream of the check call (a side stream kept busy first: a write on any
  other stream would read the plan and snapshot before the previous check stored them).
* Errors: a pending count with no deferred write bound, one larger than the snapshot buffers, a count that is not
  an int, and a deferred write that is not a function are named (``pending_write_tokens`` / ``deferred_write``).
"""

from __future__ import annotations

import random
import types
from typing import Any

import pytest
import torch
from canary_cases import write_state_args
from test_bound_launch import CHECK_FLAGS, CHECK_PER_FORWARD, _decode_batch, _raised, _small_check_case
from test_check import _on, _results, assert_same, random_check_case

from kvcanary.kernels import layout
from kvcanary.kernels.check import CheckLaunch
from kvcanary.kernels.write import WriteLaunch

SCENARIOS = 60
H = layout.STATE_HEADER_FIELDS
W = layout.LAUNCH_TAG_WRITE


def _launches(kw: dict[str, Any], *, bind_write: bool = True) -> tuple[CheckLaunch, WriteLaunch]:
    """A runtime's two bound launches over one case's buffers: the write over the check's snapshot buffers and state
    (as DeviceState builds them), the check with the write's function as its deferred write."""
    state = kw["state"]
    write = WriteLaunch(
        canary_buf=kw["canary_buf"], write_plan=kw["write_plan"], input_ids=kw["input_ids_out"],
        positions=kw["positions_out"], out_cache_loc=kw["out_cache_loc_out"], kernel_kind=W,
        **write_state_args(state, chain_position_assert=True),  # (the write's own asserts reach rows too)
        real_kv_sources=kw["real_kv_sources"], real_kv_hash_mode=kw["real_kv_hash_mode"],
        violation_meta=kw["violation_meta"], forward_step=state[layout.STATE_FORWARD : layout.STATE_FORWARD + 1],
        slot_attribution=kw["slot_attribution"], row_serials=kw["row_serials"],
    )
    fixed = {k: v for k, v in kw.items() if k not in (*CHECK_PER_FORWARD, *CHECK_FLAGS, "row_serials")}
    check = CheckLaunch(**fixed, deferred_write=write.bound if bind_write else None)
    return check, write


def _forwards(kw: dict[str, Any]) -> list[tuple[Any, int, int]]:
    """Three forwards: the case's batch (its own flags), a decode over its rows (counted, the next step), the case's
    batch again without counting a forward (an adapter's re-plan)."""
    case_batch = types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD})
    step = int(kw["forward_step_value"])
    return [(case_batch, int(kw["new_forward"]), step),
            (types.SimpleNamespace(**_decode_batch(kw)), 1, step + 1 if step >= 0 else -1),
            (case_batch, 0, -1)]


def _run(kw: dict[str, Any], *, deferred: bool) -> None:
    """The forwards with each write launched after its forward, or recorded and passed to the next check call (the
    last forward's write then goes with a final decode's check)."""
    check, write = _launches(kw)
    pending = -1
    forwards = _forwards(kw)
    for batch, new_forward, step in forwards:
        check.of_batch(batch, new_forward, step, pending)
        n = int(batch.input_ids.shape[0])
        if deferred:
            pending = n
        else:
            write(n)
    last, new_forward, step = forwards[1]
    check.of_batch(last, new_forward, step + 1 if step >= 0 else -1, pending)


def _case(seed: int) -> dict[str, Any]:
    case = random_check_case(random.Random(seed))
    rows = case["req_to_token"].shape[0]
    case["row_serials"] = torch.tensor([random.Random(seed + 1).randint(1, 1 << 20) for _ in range(rows)])
    return case


def _on_cpu(case: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    kw = _on(case, device)  # (fresh copies: the two runs never share a buffer)
    kw["row_serials"] = case["row_serials"].clone().to(device)
    return kw


def test_deferred_write_equals_a_separate_write_before_the_check() -> None:
    written = appended = 0
    for scenario in range(SCENARIOS):
        case = _case(5000 + scenario)
        separate, deferred = _on_cpu(case), _on_cpu(case)
        _run(separate, deferred=False)
        _run(deferred, deferred=True)
        want, got = _results(separate), _results(deferred)
        assert_same(got, want, f"scenario {scenario}", ordered=True)
        written += int(want["header"][layout.STATE_SLOT_RUNS + W])
        before = case["state"][H:].view(-1, layout.VIOLATION_FIELDS)
        appended += int((want["ring"] != before).any(1).sum())  # ring rows the forwards stored
    assert written > 0, "the scenarios must write records"
    assert appended > 0, "the scenarios must reach violation rows"


def test_a_refused_batch_keeps_the_pending_write() -> None:
    """The write runs before the check validates its batch: the refused call leaves the records, counters and rows
    a separate write leaves."""
    case = _case(77)
    separate, deferred = _on_cpu(case), _on_cpu(case)
    forwards = _forwards(case)
    n = int(forwards[0][0].input_ids.shape[0])
    for kw, defer in ((separate, False), (deferred, True)):
        check, write = _launches(kw)
        check.of_batch(types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD}), 1, 5, -1)
        if not defer:
            write(n)
        bad = types.SimpleNamespace(**{**{k: kw[k] for k in CHECK_PER_FORWARD},
                                       "positions": torch.zeros(n + 1, dtype=torch.int64)})
        with pytest.raises(ValueError, match="^canary_check_step: positions: "):
            check.of_batch(bad, 1, 6, n if defer else -1)
    assert_same(_results(deferred), _results(separate), "refused batch", ordered=True)
    runs = layout.STATE_KERNEL_RUNS + W
    assert int(_results(deferred)["header"][runs]) == int(case["state"][runs]) + 1  # the write ran, once


def test_pending_write_without_a_deferred_write_is_named() -> None:
    kw = _small_check_case()
    kw["row_serials"] = None
    check, _ = _launches(kw, bind_write=False)
    batch = types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD})
    before = kw["state"].clone()
    got = _raised(lambda: check.of_batch(batch, 1, 1, 2))
    assert type(got) is ValueError
    assert str(got).startswith("canary_check_step: pending_write_tokens: is 2 but the check was bound without "
                               "deferred_write"), got
    assert torch.equal(kw["state"], before)  # refused before anything ran
    check.of_batch(batch, 1, 1, -1)  # -1: no write, nothing to refuse


def test_pending_write_larger_than_the_snapshot_is_named() -> None:
    kw = _small_check_case()
    kw["row_serials"] = None
    check, _ = _launches(kw)
    batch = types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD})
    capacity = kw["input_ids_out"].shape[0]
    before = kw["state"].clone()
    got = _raised(lambda: check.of_batch(batch, 1, 1, capacity + 1))
    assert type(got) is ValueError
    assert str(got).startswith(f"canary_check_step: pending_write_tokens: is {capacity + 1}, more than the snapshot "
                               f"buffers hold ({capacity} elements)"), got
    assert torch.equal(kw["state"], before)
    check.of_batch(batch, 1, 1, capacity)  # all of them: fine


@pytest.mark.parametrize("value", [None, [3]], ids=["None", "list"])
def test_non_integer_pending_write_is_named(value: Any) -> None:
    kw = _small_check_case()
    kw["row_serials"] = None
    check, _ = _launches(kw)
    batch = types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD})
    for call in (lambda: check.of_batch(batch, 1, 1, value),
                 lambda: check(*(kw[k] for k in CHECK_PER_FORWARD), pending_write_tokens=value)):
        got = _raised(call)
        assert type(got) is TypeError and str(got).startswith("canary_check_step: pending_write_tokens: "), got


def test_a_deferred_write_that_is_not_a_function_is_named_at_binding() -> None:
    kw = _small_check_case()
    fixed = {k: v for k, v in kw.items() if k not in (*CHECK_PER_FORWARD, *CHECK_FLAGS)}
    got = _raised(lambda: CheckLaunch(**fixed, deferred_write=5))
    assert type(got) is TypeError
    assert str(got).startswith("canary_check_step: deferred_write: expected a tvm_ffi.Function"), got


@pytest.mark.gpu
def test_deferred_write_runs_on_the_calls_stream_on_cuda() -> None:
    """On a side stream kept busy before each sequence: the nested write must wait for that stream's earlier check
    (it reads the plan and snapshot that check stores), i.e. be enqueued on it; the results equal the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    side = torch.cuda.Stream()
    for scenario in range(12):
        case = _case(9000 + scenario)
        want = _on_cpu(case)
        _run(want, deferred=False)
        got = _on_cpu(case, "cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # (~tens of ms: any launch on another stream would run first)
            _run(got, deferred=True)
        torch.cuda.synchronize()
        # (ring rows as a multiset: on CUDA the order of one launch's appends depends on which atomics won)
        assert_same(_results(got), _results(want), f"scenario {scenario}", ordered=False)
