"""The deferred write of issue 25: a bound check call with ``pending_write_tokens`` n >= 0 runs, inside its own
launch, the write of the previous forward over the first n snapshot tokens (``canary_check_bind`` with
``deferred_write_chain_assert`` and ``deferred_write_row_serials``: the two arguments of the runtime's write the check
does not take itself), before anything it verifies.

* Bit-identical: forwards through the bound check with each write deferred into the next check call leave exactly
  what the same forwards with each write launched on its own leave (records, attribution, state header with its
  counters and forward counter, ring rows and their metadata, write plan, snapshots), for any plan (extends too: the
  kernel walks one request per thread; the runtime defers decodes only).
* A batch the check refuses enqueues nothing: the write stays pending, and the next accepted call runs it.
* CUDA: the same results as the CPU's (ring rows as a multiset), grids of one block to a wave (the launch's other
  blocks wait at the gate for the opener's write).
* Errors: a pending count with no deferred write bound, one larger than the snapshot buffers, a count that is not
  an int, and the row serials bound without the chain flag or a flag of the wrong dtype are named.
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
    (as DeviceState builds them), the check with the write's flag and serials bound as its deferred write's."""
    state = kw["state"]
    write_args = write_state_args(state, chain_position_assert=True)
    write = WriteLaunch(
        canary_buf=kw["canary_buf"], write_plan=kw["write_plan"], input_ids=kw["input_ids_out"],
        positions=kw["positions_out"], out_cache_loc=kw["out_cache_loc_out"], kernel_kind=W,
        **write_args,  # (the write's own asserts reach rows too)
        real_kv_sources=kw["real_kv_sources"], real_kv_hash_mode=kw["real_kv_hash_mode"],
        violation_meta=kw["violation_meta"], forward_step=state[layout.STATE_FORWARD : layout.STATE_FORWARD + 1],
        slot_attribution=kw["slot_attribution"], row_serials=kw["row_serials"],
    )
    fixed = {k: v for k, v in kw.items() if k not in (*CHECK_PER_FORWARD, *CHECK_FLAGS, "row_serials")}
    deferred = {}
    if bind_write:  # (the write's own flag and serials: a runtime binds the same tensors into both)
        deferred = {"deferred_write_chain_assert": write_args["enable_chain_position_assert"],
                    "deferred_write_row_serials": kw["row_serials"]}
    check = CheckLaunch(**fixed, **deferred)
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
    """The refused call enqueues nothing (state, records untouched); the next accepted call runs the write, and the
    result is the separate write's."""
    case = _case(77)
    separate, deferred = _on_cpu(case), _on_cpu(case)
    forwards = _forwards(case)
    n = int(forwards[0][0].input_ids.shape[0])
    for kw, defer in ((separate, False), (deferred, True)):
        check, write = _launches(kw)
        batch = types.SimpleNamespace(**{k: kw[k] for k in CHECK_PER_FORWARD})
        check.of_batch(batch, 1, 5, -1)
        if not defer:
            write(n)
        before = (kw["state"].clone(), kw["canary_buf"].clone())
        bad = types.SimpleNamespace(**{**{k: kw[k] for k in CHECK_PER_FORWARD},
                                       "positions": torch.zeros(n + 1, dtype=torch.int64)})
        with pytest.raises(ValueError, match="^canary_check_step: positions: "):
            check.of_batch(bad, 1, 6, n if defer else -1)
        assert torch.equal(kw["state"], before[0]) and torch.equal(kw["canary_buf"], before[1])
        check.of_batch(batch, 1, 6, n if defer else -1)
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
                               "deferred_write_chain_assert"), got
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
    assert str(got).startswith(f"canary_check_step: pending_write_tokens: is {capacity + 1}, more than "
                               f"input_ids_out holds ({capacity})"), got
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


def test_deferred_write_arguments_are_named_at_binding() -> None:
    kw = _small_check_case()
    fixed = {k: v for k, v in kw.items() if k not in (*CHECK_PER_FORWARD, *CHECK_FLAGS)}
    serials = torch.zeros(kw["req_to_token"].shape[0], dtype=torch.int64)
    got = _raised(lambda: CheckLaunch(**fixed, deferred_write_row_serials=serials))
    assert type(got) is ValueError
    assert str(got).startswith("canary_check_step: deferred_write_row_serials: needs deferred_write_chain_assert"), got
    got = _raised(lambda: CheckLaunch(**fixed, deferred_write_chain_assert=torch.ones(1, dtype=torch.int64)))
    assert type(got) is TypeError or type(got) is ValueError
    assert str(got).startswith("canary_check_step: deferred_write_chain_assert: "), got


def _plan_aliases(kw: dict[str, Any]) -> bool:
    """Whether the write the last check planned breaks the write's aliasing rule (csrc/canary_write.cuh: the slots
    one launch writes are distinct and none is a seed of the same launch; otherwise which record wins is
    unspecified, and a launch that writes several requests at once may differ from the CPU's request order)."""
    plan = kw["write_plan"]
    valid = max(0, min(int(plan.write_num_valid_reqs[0]), plan.write_seed_slot_indices.shape[0]))
    end = int(plan.write_offsets[valid]) if valid else 0
    slots = [int(x) for x in kw["out_cache_loc_out"][:max(end, 0)] if int(x) >= 0]
    seeds = {int(x) for x in plan.write_seed_slot_indices[:valid] if int(x) >= 0}
    return len(set(slots)) != len(slots) or bool(seeds & set(slots))


def _comparable_on_cuda(case: dict[str, Any]) -> bool:
    """Whether a CUDA run of the case's sequence has one outcome to compare with the CPU's: no forward plans an
    aliasing write, and the ring neither overflows nor is reused (which rows a full ring keeps, and which rows a reuse
    keeps when the host's acknowledgement falls inside one launch's appends, depend on the order of that launch's
    appends, unspecified on CUDA). Checked on the CPU, forward by forward."""
    kw = _on_cpu(case)
    epoch = int(kw["state"][layout.STATE_RING_EPOCH])
    capacity = (kw["state"].shape[0] - H) // layout.VIOLATION_FIELDS
    check, write = _launches(kw)
    for batch, new_forward, step in _forwards(kw):
        check.of_batch(batch, new_forward, step, -1)
        if _plan_aliases(kw):
            return False
        write(int(batch.input_ids.shape[0]))
    index = int(kw["state"][layout.STATE_WRITE_INDEX]) & 0xFFFFFFFF
    return int(kw["state"][layout.STATE_RING_EPOCH]) == epoch and index <= capacity


@pytest.mark.gpu
def test_deferred_write_runs_on_the_calls_stream_on_cuda() -> None:
    """The launch's opener writes (one thread per request) while every other block waits at the gate; on a side
    stream kept busy first; the results equal the CPU's separate writes. Only sequences with one specified outcome
    compare (:func:`_comparable_on_cuda`: the CPU writes requests in order, the opener all at once)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    side = torch.cuda.Stream()
    compared = 0
    for scenario in range(60):
        case = _case(9000 + scenario)
        if not _comparable_on_cuda(case):
            continue
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
        compared += 1
    assert compared >= 8, f"only {compared} of 60 sequences are comparable"
