"""canary_check_step (csrc/canary_check.cuh): the fused before-forward launch equals what it replaces.

* Differential: on random batches the fused launch leaves exactly what ``canary_plan_step`` (attributed, with a verify
  capacity that never overflows) + ``canary_verify_step`` (attributed, tag VERIFY) + the manager's small ops done by
  hand (drained-ring reuse before the launch, snapshot copies, per-row valid-length gather, int64 conversions) leave:
  write plan, snapshots, state header (counters, forward counter, epoch, drained_to, write index), ring rows and
  metadata rows. CPU: bit-exact, rows in order. CUDA: rows as multisets (appends race), and CUDA equals CPU.
* kvcanary.kernels.check_ref.canary_check_step (the plan and verify references composed) equals the CPU kernel.
* The forward counter, the drained-ring reuse (before the launch's appends) and the many-row / many-entry grid paths,
  by hand; on CUDA, a many-block launch whose blocks all append after the reuse.
* A CUDA graph of check + write replays with the counter +1 per replay.
* The status mirror gets the finished header (also from a replayed graph's check node).
* Argument errors name the argument.
"""

from __future__ import annotations

import functools
import random
import re
from collections import Counter
from typing import Any

import pytest
import torch
from canary_cases import capture_after_warmup

from kvcanary.kernels import check, check_ref, layout, plan_step, verify, write
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource

SCENARIOS = 400
CHUNKS = 4
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SENTINEL = -7
H = layout.STATE_HEADER_FIELDS
V = layout.LAUNCH_TAG_VERIFY
WRITE_PLAN_FIELDS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs", "write_request_rows")


def _skip_unavailable(backend: str) -> None:
    if backend == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def _ints(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _sources(rng: random.Random, num_slots: int) -> list[RealKvSource]:
    out = []
    for _ in range(rng.choice([0, 1, 1, 2, 4])):
        page = rng.choice([1, 2, 16])
        nbpt = rng.choice([16, 32, 64])
        rows = -(-num_slots // page) + rng.randint(0, 2)
        kv = torch.randint(0, 256, (rows, page * nbpt), dtype=torch.uint8, generator=torch.Generator().manual_seed(
            rng.randrange(1 << 30)))
        out.append(RealKvSource(kv, page, nbpt, rng.choice([b for b in range(16, nbpt + 1, 16)])))
    return out



def ack(epoch: int, index: int) -> int:
    """The host's acknowledgement of ring rows below ``index`` in ring epoch ``epoch`` (``STATE_DRAINED_TO``)."""
    return (epoch << layout.DRAINED_TO_EPOCH_SHIFT) | index

def random_check_case(rng: random.Random, *, bs_max: int = 8, ctx_max: int = 40) -> dict[str, Any]:
    """One launch's arguments (CPU tensors), over a canary buffer whose chains mostly verify clean.

    Request rows 1.. hold chains written by the write kernel (through the SWA LUT when there is one) with the
    tokens of the expected-token table (offset ``kv_token_id_vs_position_offset``); then records, KV bytes, table
    entries and tokens are corrupted a little, and the batch mixes decode/prefill rows with padding rows, bad
    req_pool_indices, prefixes and extends.
    """
    num_slots = rng.randint(2, 160)
    stride = rng.choice([32, 48, 64])
    req_rows = rng.randint(1, 10)
    max_ctx = rng.randint(1, ctx_max)
    offset = rng.choice([0, 0, 1])
    mode = rng.choice([0, 1, 2])
    sources = _sources(rng, num_slots)
    swa = rng.random() < 0.35
    full_slots = num_slots if not swa else rng.randint(2, 2 * num_slots)
    lengths = [0] + [rng.randint(0, max_ctx) for _ in range(req_rows - 1)]
    free = rng.sample(range(1, full_slots), full_slots - 1)  # distinct slots while they last: chains stay intact
    table = torch.tensor([[free.pop() if free and p < lengths[rr] else rng.randrange(1, full_slots)
                           for p in range(max_ctx)] for rr in range(req_rows)], dtype=torch.int32)
    lut = None
    window = 0
    if swa:
        window = rng.randint(1, max_ctx + 2)
        targets = rng.sample(range(1, num_slots), num_slots - 1)
        lut_list = [0 if rng.random() < 0.1 else targets[i % len(targets)]
                    for i in range(rng.randint(full_slots // 2, full_slots))]
        lut = _ints(lut_list)
    tokens = [[rng.randint(0, 30000) for _ in range(max_ctx + 2)] for _ in range(req_rows)]

    # Write every request row's chain: slot T(table[rr, p]) holds token (rr, p + offset) at position p.
    canary = torch.zeros((num_slots, stride), dtype=torch.uint8)
    offsets, locs, ids, pos = [0], [], [], []
    for rr in range(req_rows):
        for p in range(lengths[rr]):
            full = int(table[rr, p])
            slot = full if lut is None else (int(lut[full]) if full < lut.shape[0] else -1)
            locs.append(slot if slot < num_slots else -1)
            ids.append(tokens[rr][p + offset])
            pos.append(p)
        offsets.append(len(locs))
    sink = {"violation_ring": torch.zeros((1, layout.VIOLATION_FIELDS), dtype=torch.int64),
            "violation_write_index": _ints([0], torch.int32), "slot_run_counter": _ints([0]),
            "kernel_run_counter": _ints([0])}
    write.canary_write_step(
        canary_buf=canary, write_offsets=_ints(offsets), write_seed_slot_indices=_ints([-1] * req_rows),
        write_num_valid_reqs=_ints([req_rows], torch.int32), input_ids=_ints(ids), positions=_ints(pos),
        out_cache_loc=_ints(locs), kernel_kind=1, enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, enable_chain_position_assert=_ints([0], torch.int32), real_kv_sources=sources,
        real_kv_hash_mode=mode, **sink,
    )
    for _ in range(rng.choice([0, 0, 1, 3])):  # corrupt records
        canary[rng.randrange(num_slots), rng.randrange(32)] ^= 1 << rng.randrange(8)
    for src in sources:  # corrupt KV bytes
        if rng.random() < 0.2:
            src.kv_bytes[rng.randrange(src.kv_bytes.shape[0]), rng.randrange(16)] ^= 0xFF
    if rng.random() < 0.15:  # a table entry outside the pool / the LUT
        table[rng.randrange(req_rows), rng.randrange(max_ctx)] = rng.choice([-3, full_slots + 10, 1 << 30])
    if rng.random() < 0.2:  # a strided view of req_to_token
        wide = torch.zeros((req_rows, max_ctx + 3), dtype=torch.int32)
        wide[:, :max_ctx] = table
        table = wide[:, :max_ctx]

    bs = rng.randint(0, bs_max)
    rps, prefixes, extends = [], [], []
    for _ in range(bs):
        roll = rng.random()
        if roll < 0.15 or req_rows == 1:
            rp = 0
        elif roll < 0.2:
            rp = rng.choice([-1, req_rows, req_rows + 7])
        else:
            rp = rng.randrange(1, req_rows)
        length = lengths[rp] if 0 <= rp < req_rows else max_ctx
        prefix = rng.choice([length, length, rng.randint(0, length), 0])
        if rng.random() < 0.05:
            prefix = rng.choice([-2, max_ctx + 1, max_ctx + 9])
        extend = rng.choice([0, 1, 1, rng.randint(0, 6)])
        if rng.random() < 0.04:
            extend = -rng.randint(1, 3)
        rps.append(rp)
        prefixes.append(prefix)
        extends.append(extend)
    n = sum(max(e, 0) for e in extends) if rng.random() < 0.8 else rng.randint(0, 12)
    batch_dtype = [rng.choice([torch.int32, torch.int64]) for _ in range(6)]
    case: dict[str, Any] = {
        "canary_buf": canary,
        "req_pool_indices": _ints(rps, batch_dtype[0]),
        "prefix_lens": _ints(prefixes, batch_dtype[1]),
        "extend_lens": _ints(extends, batch_dtype[2]),
        "req_to_token": table,
        "swa_window_size": window,
        "full_to_swa_index_mapping": lut,
        "kv_token_id_vs_position_offset": offset,
        "input_ids": _ints([rng.randint(0, 30000) for _ in range(n)], batch_dtype[3]),
        "positions": _ints([rng.randint(0, 100) for _ in range(n)], batch_dtype[4]),
        "out_cache_loc": _ints([rng.randint(-1, num_slots) for _ in range(n)], batch_dtype[5]),
        "real_kv_hash_mode": mode,
        "check_tokens": rng.random() < 0.5,
        "new_forward": rng.random() < 0.7,
        "forward_step_value": rng.choice([-1, -1, rng.randint(0, 1 << 40)]),
    }
    extra = rng.choice([0, 0, 1, 5])
    for name in ("input_ids_out", "positions_out", "out_cache_loc_out"):
        case[name] = torch.full((n + extra,), SENTINEL, dtype=torch.int64)
    if rng.random() < 0.6:
        exp = torch.tensor(tokens, dtype=torch.int64)[:, : rng.randint(1, max_ctx + 2)]
        if rng.random() < 0.3:  # a few wrong expectations
            exp[rng.randrange(req_rows), rng.randrange(exp.shape[1])] += 1
        case["expected_tokens"] = exp.to(rng.choice([torch.int32, torch.int64]))
        case["expected_valid_lens_by_row"] = _ints(
            [rng.choice([length + offset, length, rng.randint(0, max_ctx + 3)]) for length in lengths])
    else:
        case["expected_tokens"] = None
        case["expected_valid_lens_by_row"] = None
    ring_capacity = rng.choice([0, 1, 4, 64, 64])
    # ring rows of earlier launches, distinct: a reuse that moves rows changes which rows the ring holds
    state = _ints([rng.randint(0, 1000) for _ in range(H)]
                  + [rng.randint(0, 1 << 40) for _ in range(ring_capacity * layout.VIOLATION_FIELDS)])
    start = rng.choice([0, 0, 1, 3, 20, 40, 40, 70])
    state[layout.STATE_WRITE_INDEX] = start
    epoch = int(state[layout.STATE_RING_EPOCH])
    # the host's acknowledgement: every row read (emptied), some rows appended since (moved, when they fit below
    # it), rows not read yet, of a stale epoch, or (ring_capacity: after an overflow) every stored row read
    acked = rng.choice([start, start, start + 1, max(1, start // 2), max(1, start - 1), max(1, start - 1),
                        max(1, 2 * start // 3), ring_capacity])
    state[layout.STATE_DRAINED_TO] = rng.choice([-1, 0, ack(epoch, acked), ack(epoch, acked), ack(epoch, acked),
                                                 ack(epoch + 1, acked), acked])
    for scratch in (layout.STATE_DONE_BLOCKS, layout.STATE_ARRIVALS, layout.STATE_REUSE_GATE):
        state[scratch] = 0  # canary_check_step's scratch is 0 at rest
    case["state"] = state
    case["violation_meta"] = (torch.randint(0, 1 << 40, (ring_capacity, layout.VIOLATION_META_FIELDS))
                              if rng.random() < 0.85 else None)
    case["slot_attribution"] = (torch.tensor([[rng.randint(1, 999), rng.randint(1, 999)] for _ in range(num_slots)],
                                             dtype=torch.int64) if rng.random() < 0.8 else None)
    case["write_capacity"] = bs + rng.choice([0, 0, 1, 4])
    case["sources"] = sources
    return case


def _on(case: dict[str, Any], device: str) -> dict[str, Any]:
    """Fresh copies of the case's arguments on ``device`` (a fresh write plan filled with sentinels)."""
    out = {k: (v.clone().to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()
           if k not in ("write_capacity", "sources")}
    out["real_kv_sources"] = tuple(
        RealKvSource(s.tensor.clone().to(device), s.page_size, s.num_bytes_per_token, s.read_bytes)
        for s in case["sources"])
    plan = WritePlan.allocate(case["write_capacity"], device)
    for name in WRITE_PLAN_FIELDS:
        getattr(plan, name).fill_(SENTINEL)
    out["write_plan"] = plan
    return out


def run_fused(fn: Any, case: dict[str, Any], device: str) -> dict[str, Any]:
    kw = _on(case, device)
    fn(**kw)
    _sync(device)
    return _results(kw)


def run_composed(case: dict[str, Any], device: str) -> dict[str, Any]:
    """What the manager did before canary_check_step: plan + verify launches and the small torch ops."""
    kw = _on(case, device)
    state = kw["state"]
    # the drained-ring reuse, before the launch's appends (the reference's, on the host: a test helper)
    host_state = state.cpu()
    host_meta = kw["violation_meta"].cpu() if kw["violation_meta"] is not None else None
    check_ref.reuse_drained_ring(host_state, host_meta)
    state.copy_(host_state)
    if host_meta is not None:
        kw["violation_meta"].copy_(host_meta)
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    n = kw["input_ids"].shape[0]
    for src, dst in (("input_ids", "input_ids_out"), ("positions", "positions_out"),
                     ("out_cache_loc", "out_cache_loc_out")):
        kw[dst][:n].copy_(kw[src])
    rps = kw["req_pool_indices"].to(torch.int64)
    expected = {}
    if kw["expected_tokens"] is not None:
        by_row = kw["expected_valid_lens_by_row"]
        valid = torch.index_select(by_row, 0, rps.clamp(0, by_row.shape[0] - 1))
        expected = {"expected_tokens": kw["expected_tokens"], "expected_tokens_valid_lens": valid}
    max_ctx = kw["req_to_token"].shape[1]
    verify_plan = VerifyPlan.allocate(max(1, rps.shape[0] * (max_ctx + 2)), device)  # never overflows
    counter = state[layout.STATE_FORWARD : layout.STATE_FORWARD + 1]
    plan_step.canary_plan_step(
        write_plan=kw["write_plan"], verify_plan=verify_plan, req_pool_indices=rps,
        prefix_lens=kw["prefix_lens"].to(torch.int64), extend_lens=kw["extend_lens"].to(torch.int64),
        req_to_token=kw["req_to_token"], swa_window_size=kw["swa_window_size"],
        full_to_swa_index_mapping=kw["full_to_swa_index_mapping"],
        kv_token_id_vs_position_offset=kw["kv_token_id_vs_position_offset"], **expected,
        forward_counter=counter if kw["new_forward"] else None, forward_step_value=kw["forward_step_value"],
        out_cache_loc=kw["out_cache_loc"],
    )
    verify.canary_verify_step(
        canary_buf=kw["canary_buf"], **verify_plan.kernel_args(), kernel_kind=V,
        violation_ring=state[H:].view(-1, layout.VIOLATION_FIELDS), violation_write_index=write_index,
        slot_run_counter=state[layout.STATE_SLOT_RUNS + V : layout.STATE_SLOT_RUNS + V + 1],
        kernel_run_counter=state[layout.STATE_KERNEL_RUNS + V : layout.STATE_KERNEL_RUNS + V + 1],
        real_kv_sources=kw["real_kv_sources"], real_kv_hash_mode=kw["real_kv_hash_mode"],
        check_tokens=kw["check_tokens"], violation_meta=kw["violation_meta"], forward_step=counter,
        slot_attribution=kw["slot_attribution"],
    )
    _sync(device)
    assert int(verify_plan.verify_enable[0]) == 1, "the composed plan overflowed: raise its capacity"
    return _results(kw)


def _results(kw: dict[str, Any]) -> dict[str, Any]:
    out = {name: getattr(kw["write_plan"], name).cpu() for name in WRITE_PLAN_FIELDS}
    for name in ("input_ids_out", "positions_out", "out_cache_loc_out", "canary_buf"):
        out[name] = kw[name].cpu()
    state = kw["state"].cpu()
    out["header"] = state[:H]
    out["ring"] = state[H:].view(-1, layout.VIOLATION_FIELDS)
    meta = kw["violation_meta"]
    out["meta"] = meta.cpu() if meta is not None else None
    out["attribution"] = kw["slot_attribution"].cpu() if kw["slot_attribution"] is not None else None
    return out


def _appended(result: dict[str, Any], start: int) -> int:
    """Rows appended by the launch from write index ``start`` (0 after a reuse): the header's index moved by them."""
    index = int(result["header"][layout.STATE_WRITE_INDEX]) & 0xFFFFFFFF
    return max(0, index - start)


def assert_same(a: dict[str, Any], b: dict[str, Any], ctx: str, *, ordered: bool) -> None:
    """Equal results; ``ordered``: ring rows in the same order (else as multisets of (row, meta) pairs, and only
    when the ring did not overflow: on CUDA which rows a full ring keeps depends on which atomics won)."""
    for key in (*WRITE_PLAN_FIELDS, "input_ids_out", "positions_out", "out_cache_loc_out", "canary_buf", "header",
                "attribution"):
        ta, tb = a[key], b[key]
        if ta is None or tb is None:
            assert ta is None and tb is None, f"{key} ({ctx})"
            continue
        assert torch.equal(ta, tb), f"{key} differs ({ctx}): {ta.tolist()} != {tb.tolist()}"
    if ordered:
        assert torch.equal(a["ring"], b["ring"]), f"ring differs ({ctx})"
        assert (a["meta"] is None) == (b["meta"] is None) and (a["meta"] is None or torch.equal(a["meta"], b["meta"]))
        return
    index = int(a["header"][layout.STATE_WRITE_INDEX]) & 0xFFFFFFFF
    if index > a["ring"].shape[0]:
        return

    def pairs(r: dict[str, Any]) -> Counter:
        metas = r["meta"].tolist() if r["meta"] is not None else [[]] * r["ring"].shape[0]
        return Counter(tuple(row) + tuple(m) for row, m in zip(r["ring"].tolist(), metas, strict=True))

    assert pairs(a) == pairs(b), f"ring rows differ ({ctx})"


# ---------------------------------------------------------------------------------------------- differential


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_fused_equals_plan_verify_and_small_ops(backend: str, chunk: int) -> None:
    _skip_unavailable(backend)
    seen = Counter()
    for seed in range(chunk * SCENARIOS // CHUNKS, (chunk + 1) * SCENARIOS // CHUNKS):
        case = random_check_case(random.Random(seed))
        ctx = f"seed={seed} backend={backend}"
        fused = run_fused(check.canary_check_step, case, backend)
        composed = run_composed(case, backend)
        assert_same(fused, composed, ctx, ordered=backend == "cpu")
        if backend == "cuda":  # the CUDA kernel equals the CPU loop
            assert_same(fused, run_fused(check.canary_check_step, case, "cpu"), ctx + " vs cpu", ordered=False)
        reused = int(fused["header"][layout.STATE_RING_EPOCH]) != int(case["state"][layout.STATE_RING_EPOCH])
        start = 0 if reused else int(case["state"][layout.STATE_WRITE_INDEX])
        appended = _appended(fused, start)
        seen["rows"] += appended > 0
        seen["overflow"] += start + appended > fused["ring"].shape[0]
        seen["reuse"] += reused
        seen["rows_after_reuse"] += reused and appended > 0
        seen["swa"] += case["full_to_swa_index_mapping"] is not None
        seen["tokens_i32"] += case["expected_tokens"] is not None and case["expected_tokens"].dtype == torch.int32
        seen["check_tokens"] += case["check_tokens"] and case["expected_tokens"] is not None
        seen["offset1"] += case["kv_token_id_vs_position_offset"] == 1
        seen["padding"] += int((case["req_pool_indices"] == 0).any())
        seen["rp_i32"] += case["req_pool_indices"].dtype == torch.int32
        seen["kept_forward"] += not case["new_forward"]
        seen["real_kv"] += case["real_kv_hash_mode"] != 0 and bool(case["sources"])
    assert all(v >= 5 for v in seen.values()) and len(seen) == 12, seen


def test_reference_equals_the_cpu_kernel() -> None:
    for seed in range(60):
        case = random_check_case(random.Random(10**6 + seed), bs_max=5, ctx_max=16)
        got = run_fused(check.canary_check_step, case, "cpu")
        want = run_fused(check_ref.canary_check_step, case, "cpu")
        assert_same(got, want, f"seed={seed}", ordered=True)


def _mirror(device: str) -> torch.Tensor:
    """A status mirror as the runtime allocates it: host memory, pinned for a CUDA launch; sentinels until written."""
    return torch.full((H,), SENTINEL, dtype=torch.int64, pin_memory=device == "cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_status_mirror_gets_the_finished_header(backend: str) -> None:
    """The launch's end writes its finished header (reuse, counters, forward counter, scratch at rest) to the host
    mirror in place; everything else the launch leaves is the same with and without a mirror."""
    _skip_unavailable(backend)
    for seed in range(40):
        case = random_check_case(random.Random(2 * 10**6 + seed))
        mirror = _mirror(backend)
        with_mirror = run_fused(functools.partial(check.canary_check_step, status_mirror=mirror), case, backend)
        assert mirror.tolist() == with_mirror["header"].tolist(), f"seed={seed}"
        assert_same(with_mirror, run_fused(check.canary_check_step, case, backend), f"seed={seed}",
                    ordered=backend == "cpu")
        ref_mirror = _mirror("cpu")
        run_fused(functools.partial(check_ref.canary_check_step, status_mirror=ref_mirror), case, "cpu")
        assert torch.equal(ref_mirror, mirror.cpu()), f"reference, seed={seed}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_rows_and_many_entries(backend: str) -> None:
    """Rows in several chunks of the block (bs 700), and more entries than the grid has threads."""
    _skip_unavailable(backend)
    rng = random.Random(7)
    for bs, ctx_max in ((700, 6), (3, 1)):
        case = random_check_case(rng, bs_max=1, ctx_max=ctx_max)
        req_rows = case["req_to_token"].shape[0]
        case["req_pool_indices"] = torch.tensor([rng.randrange(req_rows) for _ in range(bs)])
        case["prefix_lens"] = torch.tensor([rng.randint(0, ctx_max) for _ in range(bs)], dtype=torch.int32)
        case["extend_lens"] = torch.tensor([rng.randint(0, 2) for _ in range(bs)])
        case["write_capacity"] = bs + 300
        if bs == 3:  # 3 rows of 200k entries each: every CUDA thread visits several entries
            ctx = 200_000
            case["req_to_token"] = torch.randint(0, case["canary_buf"].shape[0], (2, ctx), dtype=torch.int32)
            case["req_pool_indices"] = torch.tensor([1, 1, 1])
            case["prefix_lens"] = torch.tensor([ctx, ctx - 5, 1000])
            case["full_to_swa_index_mapping"], case["swa_window_size"] = None, 0
            case["expected_tokens"], case["expected_valid_lens_by_row"] = None, None
            case["state"][H:] = SENTINEL
            case["state"][layout.STATE_WRITE_INDEX] = 0
            case["violation_meta"] = torch.full((case["state"][H:].numel() // layout.VIOLATION_FIELDS,
                                                 layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64)
        fused = run_fused(check.canary_check_step, case, backend)
        assert_same(fused, run_composed(case, backend), f"bs={bs}", ordered=backend == "cpu")
        if bs == 3:
            at = layout.STATE_SLOT_RUNS + V
            assert int(fused["header"][at]) - int(case["state"][at]) == 2 * 200_000 - 5 + 1000


# ---------------------------------------------------------------------------------------------- state by hand


def _hand(device: str, *, index: int, drained_to: int, corrupt: bool, new_forward: bool = True,
          step_value: int = -1, forward: int = 41, epoch: int = 0,
          marked_rows: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Request row 1 holds a 4-token chain at slots 11..14; the batch decodes it (prefix 4, extend 1). The ring
    holds 4 rows; ``marked_rows``: ring row i of earlier launches is all 100 + i (its metadata row 200 + i)."""
    case = random_check_case(random.Random(3))
    canary = torch.zeros((16, 32), dtype=torch.uint8)
    table = torch.zeros((2, 8), dtype=torch.int32)
    table[1, :5] = torch.tensor([11, 12, 13, 14, 15])
    z = {"violation_ring": torch.zeros((1, 8), dtype=torch.int64), "violation_write_index": _ints([0], torch.int32),
         "slot_run_counter": _ints([0]), "kernel_run_counter": _ints([0])}
    write.canary_write_step(
        canary_buf=canary, write_offsets=_ints([0, 4]), write_seed_slot_indices=_ints([-1]),
        write_num_valid_reqs=_ints([1], torch.int32), input_ids=_ints([5, 6, 7, 8]), positions=_ints([0, 1, 2, 3]),
        out_cache_loc=_ints([11, 12, 13, 14]), kernel_kind=1, enable_write_input_assert=False,
        expected_input_tokens=None, expected_input_positions=None,
        enable_chain_position_assert=_ints([0], torch.int32), **z,
    )
    if corrupt:
        canary[12, 8] ^= 1  # slot 12's position
    state = torch.zeros(H + 4 * layout.VIOLATION_FIELDS, dtype=torch.int64)
    state[layout.STATE_WRITE_INDEX] = index
    state[layout.STATE_DRAINED_TO] = drained_to
    state[layout.STATE_FORWARD] = forward
    state[layout.STATE_RING_EPOCH] = epoch
    meta = torch.full((4, layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64)
    if marked_rows:
        state[H:] = (100 + torch.arange(4)).repeat_interleave(layout.VIOLATION_FIELDS)
        meta[:] = (200 + torch.arange(4)).unsqueeze(1)
    case.update({
        "canary_buf": canary, "req_to_token": table, "req_pool_indices": _ints([1], torch.int32),
        "prefix_lens": _ints([4], torch.int32), "extend_lens": _ints([1], torch.int32),
        "swa_window_size": 0, "full_to_swa_index_mapping": None, "expected_tokens": None,
        "expected_valid_lens_by_row": None, "kv_token_id_vs_position_offset": 0,
        "input_ids": _ints([9], torch.int32), "positions": _ints([4], torch.int32),
        "out_cache_loc": _ints([15], torch.int32), "input_ids_out": _ints([0, 0]), "positions_out": _ints([0, 0]),
        "out_cache_loc_out": _ints([0, 0]), "real_kv_hash_mode": 0, "check_tokens": False,
        "new_forward": new_forward, "forward_step_value": step_value, "state": state,
        "violation_meta": meta,
        "slot_attribution": torch.full((16, 2), layout.META_UNKNOWN, dtype=torch.int64), "write_capacity": 2,
        "sources": [],
    })
    return case, run_fused(check.canary_check_step, case, device)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_built_decode(backend: str) -> None:
    _skip_unavailable(backend)
    _, out = _hand(backend, index=0, drained_to=-1, corrupt=False)
    assert out["write_offsets"].tolist() == [0, 1, 1]
    assert out["write_seed_slot_indices"].tolist() == [14, -1]
    assert out["write_num_valid_reqs"].tolist() == [1]
    assert out["write_request_rows"].tolist() == [1, 0]
    assert out["input_ids_out"].tolist() == [9, 0] and out["out_cache_loc_out"].tolist() == [15, 0]
    header = out["header"].tolist()
    assert header[layout.STATE_KERNEL_RUNS + V] == 1 and header[layout.STATE_SLOT_RUNS + V] == 4
    assert header[layout.STATE_FORWARD] == 42 and header[layout.STATE_WRITE_INDEX] == 0
    assert header[layout.STATE_DONE_BLOCKS] == 0 and header[layout.STATE_RING_LOST_AT_RESET] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_graph_padding_is_planned_as_padding(backend: str) -> None:
    """A decode graph's batch padded as sglang 0.5.12 pads it: the padded rows' out_cache_loc is 0, their
    req_pool_indices and positions an earlier fill's (here a finished request's row whose slots hold other records).
    No verify entry, no write range, no seed for them: no violation, on the device as in the reference; the plan
    kernel given out_cache_loc plans the same write plan."""
    _skip_unavailable(backend)
    case, _ = _hand("cpu", index=0, drained_to=-1, corrupt=False)
    table = torch.zeros((3, 8), dtype=torch.int32)
    table[1, :5] = torch.tensor([11, 12, 13, 14, 15])
    table[2, :4] = torch.tensor([13, 12, 11, 3])  # a finished request's row, its slots reused since
    case.update({
        "req_to_token": table, "req_pool_indices": _ints([1, 2, 1]), "prefix_lens": _ints([4, 4, 2]),
        "extend_lens": _ints([1, 1, 1]), "input_ids": _ints([9, 9, 9]), "positions": _ints([4, 4, 2]),
        "out_cache_loc": _ints([15, 0, 0]), "input_ids_out": _ints([0] * 3), "positions_out": _ints([0] * 3),
        "out_cache_loc_out": _ints([0] * 3), "write_capacity": 4,
    })
    out = run_fused(check.canary_check_step, case, backend)
    assert out["header"][layout.STATE_WRITE_INDEX] == 0, out["ring"]  # no violation row
    assert out["header"][layout.STATE_SLOT_RUNS + V] == 4  # row 1's prefix only
    assert out["write_offsets"].tolist() == [0, 1, 1, 1, 1]
    assert out["write_seed_slot_indices"].tolist() == [14, -1, -1, -1]
    assert_same(out, run_fused(check_ref.canary_check_step, case, "cpu"), backend, ordered=backend == "cpu")
    assert_same(out, run_composed(case, backend), backend + " composed", ordered=backend == "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("new_forward", "step_value", "want"), [(True, -1, 42), (True, 7, 7), (False, -1, 41),
                                                                  (False, 7, 41)])
def test_forward_counter_and_row_step(backend: str, new_forward: bool, step_value: int, want: int) -> None:
    """The counter becomes the new value (or stays), and the violation's metadata row carries that value."""
    _skip_unavailable(backend)
    _, out = _hand(backend, index=0, drained_to=-1, corrupt=True, new_forward=new_forward, step_value=step_value)
    assert int(out["header"][layout.STATE_FORWARD]) == want
    assert int(out["header"][layout.STATE_WRITE_INDEX]) == 2  # slot 12's position, and slot 13's chain
    assert out["meta"][:2, layout.VIOLATION_META_COL_STEP].tolist() == [want, want]
    assert sorted(out["meta"][:2, layout.VIOLATION_META_COL_REQUEST_ROW].tolist()) == [1, 1]
    assert sorted(out["ring"][:2, layout.VIOLATION_COL_SLOT].tolist()) == [12, 13]
    assert set(out["ring"][:2, layout.VIOLATION_COL_KERNEL_KIND].tolist()) == {V}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("index", "acked", "stale", "corrupt", "kept_from", "kept", "lost"), [
    (5, 5, False, False, 5, 0, 0),  # acknowledged, nothing appended since: emptied
    (5, 5, False, True, 5, 0, 0),  # emptied first, this launch's 2 rows then start at row 0 (issue 15)
    (3, 2, False, False, 2, 1, 0),  # one row appended since the acknowledgement: it moves to row 0
    (3, 2, False, True, 2, 1, 0),  # ... and this launch's 2 rows follow it (the persistent-violation case)
    (4, 2, False, True, 2, 2, 0),  # two rows since, the ring full: both kept, this launch's rows counted lost
    (4, 1, False, False, None, 0, 0),  # three rows since the acknowledgement of one: a move would overlap, none
    (5, 3, False, False, None, 0, 0),  # rows 3 (stored) and 4 (lost) not read yet: none
    (6, 4, False, True, 4, 0, 2),  # every stored row read (4 >= capacity): the 2 rows never stored counted lost
    (5, 5, True, False, None, 0, 0),  # an acknowledgement of an epoch already emptied: ignored
    (0, 0, False, True, None, 0, 0),  # a zeroed header: nothing acknowledged
    (0, -1, False, False, None, 0, 0),
    (0, -1, False, True, None, 0, 0),
])
def test_drained_ring_reuse(backend: str, index: int, acked: int, stale: bool, corrupt: bool, kept_from: int | None,
                            kept: int, lost: int) -> None:
    """The reuse happens before the launch's appends (the old manager's order), so a forward that finds violations
    again still gets the emptied ring instead of counting them all as lost; the rows appended since the host's
    acknowledgement move to the front in order, with their metadata (the H200's phase 15, 2026-12-02: a violation
    repeated on every forward never let the ring empty, and 1,643 rows were lost)."""
    _skip_unavailable(backend)
    epoch = 7
    drained_to = ack(epoch - 1 if stale else epoch, acked) if acked > 0 else acked
    case, out = _hand(backend, index=index, drained_to=drained_to, corrupt=corrupt, epoch=epoch, marked_rows=True)
    header = out["header"].tolist()
    rows = 2 if corrupt else 0  # slot 12's position and slot 13's chain
    assert header[layout.STATE_ARRIVALS] == 0 and header[layout.STATE_REUSE_GATE] == 0  # scratch back at rest
    reused = kept_from is not None
    first = kept if reused else index  # where this launch's rows start
    if reused:
        assert header[layout.STATE_WRITE_INDEX] == kept + rows and header[layout.STATE_DRAINED_TO] == -1
        assert header[layout.STATE_RING_EPOCH] == epoch + 1 and header[layout.STATE_RING_LOST_AT_RESET] == lost
        moved = list(range(100 + kept_from, 100 + kept_from + kept))
        assert out["ring"][:kept, 0].tolist() == moved and out["ring"][:kept].eq(out["ring"][:kept, :1]).all()
        assert out["meta"][:kept, 0].tolist() == [m + 100 for m in moved], "metadata moves with its rows"
    else:
        assert header[layout.STATE_WRITE_INDEX] == index + rows
        assert header[layout.STATE_DRAINED_TO] == drained_to and header[layout.STATE_RING_EPOCH] == epoch
        assert header[layout.STATE_RING_LOST_AT_RESET] == 0
    stored = max(0, min(first + rows, 4) - first)  # the ring holds 4 rows
    assert sorted(out["ring"][first : first + stored, layout.VIOLATION_COL_SLOT].tolist()) == [12, 13][:stored]
    assert out["meta"][first : first + stored, layout.VIOLATION_META_COL_STEP].tolist() == [42] * stored
    untouched = [i for i in range(4) if not (reused and i < kept) and not first <= i < first + stored]
    assert out["ring"][untouched, 0].tolist() == [100 + i for i in untouched], "rows nothing moved stay"
    assert_same(out, run_fused(check_ref.canary_check_step, case, "cpu"), backend + " vs ref", ordered=backend == "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [0, 8000])
def test_many_blocks_all_append_after_the_reuse(kept: int) -> None:
    """A batch whose failing entries span every block of a many-block grid, into a ring the host acknowledged
    nearly full: the ring is emptied before ANY block appends (the reuse gate), so the kept rows are 0..count-1,
    nothing is lost, and the count equals the failing entries (the CPU loop's, same rows as a multiset).
    ``kept``: rows appended after the acknowledgement, moved to the front by the opener block's threads first."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = random.Random(11)
    req_rows, length, bs = 64, 60, 512
    num_slots = req_rows * (length + 1) + 1
    table = torch.zeros((req_rows, length + 1), dtype=torch.int32)
    slots = list(range(1, num_slots))
    rng.shuffle(slots)
    for rr in range(1, req_rows):
        table[rr] = torch.tensor(slots[(rr - 1) * (length + 1) : rr * (length + 1)], dtype=torch.int32)
    canary = torch.zeros((num_slots, 32), dtype=torch.uint8)
    locs = table[1:, :length].reshape(-1).to(torch.int64)
    z = {"violation_ring": torch.zeros((1, 8), dtype=torch.int64), "violation_write_index": _ints([0], torch.int32),
         "slot_run_counter": _ints([0]), "kernel_run_counter": _ints([0])}
    write.canary_write_step(  # request rows 1.. hold clean chains of `length` tokens
        canary_buf=canary, write_offsets=torch.arange(0, req_rows * length, length, dtype=torch.int64),
        write_seed_slot_indices=_ints([-1] * (req_rows - 1)), write_num_valid_reqs=_ints([req_rows - 1], torch.int32),
        input_ids=torch.randint(0, 30000, (locs.numel(),)), positions=torch.arange(length).repeat(req_rows - 1),
        out_cache_loc=locs, kernel_kind=1, enable_write_input_assert=False, expected_input_tokens=None,
        expected_input_positions=None, enable_chain_position_assert=_ints([0], torch.int32), **z,
    )
    for slot in rng.sample(locs.tolist(), locs.numel() // 3):  # a third of the records corrupt
        canary[slot, 8] ^= 1 << rng.randrange(8)
    ring_capacity = 32768
    state = torch.zeros(H + ring_capacity * layout.VIOLATION_FIELDS, dtype=torch.int64)
    state[H:] = SENTINEL
    index = ring_capacity - 3 if not kept else 20_000  # read nearly full, or with rows appended since
    state[layout.STATE_WRITE_INDEX] = index
    state[layout.STATE_DRAINED_TO] = ack(4, index - kept)
    state[layout.STATE_RING_EPOCH] = 4
    ring = state[H:].view(ring_capacity, layout.VIOLATION_FIELDS)
    ring[index - kept : index] = torch.arange(1, kept + 1).unsqueeze(1)  # row i of them: all i + 1
    state[layout.STATE_FORWARD] = 99
    rps = [rng.randrange(1, req_rows) for _ in range(bs)]
    case = random_check_case(random.Random(3))
    case.update({
        "canary_buf": canary, "req_to_token": table, "req_pool_indices": _ints(rps),
        "prefix_lens": _ints([length] * bs), "extend_lens": _ints([1] * bs), "swa_window_size": 0,
        "full_to_swa_index_mapping": None, "expected_tokens": None, "expected_valid_lens_by_row": None,
        "kv_token_id_vs_position_offset": 0, "input_ids": _ints([1] * bs), "positions": _ints([length] * bs),
        "out_cache_loc": _ints([int(table[rp, length]) for rp in rps]), "input_ids_out": _ints([0] * bs),
        "positions_out": _ints([0] * bs), "out_cache_loc_out": _ints([0] * bs), "real_kv_hash_mode": 0,
        "check_tokens": False, "new_forward": True, "forward_step_value": -1, "state": state,
        "violation_meta": torch.full((ring_capacity, layout.VIOLATION_META_FIELDS), SENTINEL, dtype=torch.int64),
        "slot_attribution": None, "write_capacity": bs, "sources": [],
    })
    want = run_fused(check.canary_check_step, case, "cpu")
    got = run_fused(check.canary_check_step, case, "cuda")
    count = int(want["header"][layout.STATE_WRITE_INDEX])
    # about 2/3 of the 30720 entries (one per thread of a ~126-block grid) fail: every block appends, all are kept
    assert 15_000 + kept < count < ring_capacity
    header = got["header"].tolist()
    assert header[layout.STATE_WRITE_INDEX] == count and header[layout.STATE_RING_EPOCH] == 5
    assert header[layout.STATE_DRAINED_TO] == -1 and header[layout.STATE_FORWARD] == 100
    assert header[layout.STATE_ARRIVALS] == header[layout.STATE_REUSE_GATE] == header[layout.STATE_DONE_BLOCKS] == 0
    assert not (got["ring"][:count] == SENTINEL).any() and (got["ring"][count:] == SENTINEL).all()
    assert got["ring"][:kept, 0].tolist() == list(range(1, kept + 1)), "the kept rows, moved in order"
    assert (got["meta"][kept:count, layout.VIOLATION_META_COL_STEP] == 100).all()
    assert_same(got, want, "many blocks", ordered=False)


# ---------------------------------------------------------------------------------------------- CUDA graph


@pytest.mark.gpu
def test_graph_replays_count_forwards() -> None:
    """check + write captured once; each replay plans, verifies (clean), writes and counts one forward."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = "cuda"
    case, _ = _hand("cpu", index=0, drained_to=-1, corrupt=False)
    kw = _on(case, dev)
    state = kw["state"]
    write_index = state[0:1].view(torch.int32)[0:1]
    write_tag = layout.LAUNCH_TAG_WRITE

    mirror = _mirror(dev)

    def forward() -> None:
        check.canary_check_step(**{**kw, "new_forward": True, "forward_step_value": -1, "status_mirror": mirror})
        write.canary_write_step(
            canary_buf=kw["canary_buf"], **kw["write_plan"].kernel_args(), input_ids=kw["input_ids_out"][:1],
            positions=kw["positions_out"][:1], out_cache_loc=kw["out_cache_loc_out"][:1], kernel_kind=write_tag,
            enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None,
            violation_ring=state[H:].view(-1, layout.VIOLATION_FIELDS), violation_write_index=write_index,
            slot_run_counter=state[layout.STATE_SLOT_RUNS + write_tag : layout.STATE_SLOT_RUNS + write_tag + 1],
            kernel_run_counter=state[layout.STATE_KERNEL_RUNS + write_tag : layout.STATE_KERNEL_RUNS + write_tag + 1],
            enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=dev),
            violation_meta=kw["violation_meta"], forward_step=state[layout.STATE_FORWARD : layout.STATE_FORWARD + 1],
            slot_attribution=kw["slot_attribution"],
        )

    graph = capture_after_warmup(forward)  # (the warm-up run loads the module: forward 42)
    before = state[:H].cpu().tolist()
    for replay in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        header = state[:H].cpu().tolist()
        # each replay's check node wrote the pinned mirror: the header as the check left it (before the write node)
        assert mirror[layout.STATE_FORWARD].item() == header[layout.STATE_FORWARD]
        assert mirror[layout.STATE_KERNEL_RUNS + V].item() == header[layout.STATE_KERNEL_RUNS + V]
        assert mirror[layout.STATE_KERNEL_RUNS + layout.LAUNCH_TAG_WRITE].item() == header[
            layout.STATE_KERNEL_RUNS + layout.LAUNCH_TAG_WRITE] - 1
        assert header[layout.STATE_FORWARD] == before[layout.STATE_FORWARD] + replay
        assert header[layout.STATE_KERNEL_RUNS + V] == before[layout.STATE_KERNEL_RUNS + V] + replay
        assert header[layout.STATE_KERNEL_RUNS + write_tag] == before[layout.STATE_KERNEL_RUNS + write_tag] + replay
        assert header[layout.STATE_DONE_BLOCKS] == 0
        assert header[layout.STATE_WRITE_INDEX] == 0, "a clean chain verifies clean on every replay"
    # the write of the replays stored slot 15 at the replays' forward number
    assert kw["slot_attribution"][15, layout.SLOT_ATTRIBUTION_COL_WRITTEN_STEP].item() == before[
        layout.STATE_FORWARD] + 2


# ---------------------------------------------------------------------------------------------- arguments


def _valid_kwargs() -> dict[str, Any]:
    case, _ = _hand("cpu", index=0, drained_to=-1, corrupt=False)
    return {**_on(case, "cpu"), "status_mirror": _mirror("cpu")}


@pytest.mark.gpu
@pytest.mark.parametrize(("where", "pattern"), [
    ("cuda", r"status_mirror: expected host memory \(pinned"),
    ("pageable", r"status_mirror: expected pinned host memory the device can read.*pageable host memory"),
])
def test_a_cuda_launch_needs_a_pinned_status_mirror(where: str, pattern: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case, _ = _hand("cpu", index=0, drained_to=-1, corrupt=False)
    mirror = torch.zeros(H, dtype=torch.int64, device="cuda") if where == "cuda" else torch.zeros(H, dtype=torch.int64)
    _expect({**_on(case, "cuda"), "status_mirror": mirror}, ValueError, "^canary_check_step: " + pattern)


def test_valid_call_runs() -> None:
    check.canary_check_step(**_valid_kwargs())


TENSORS = ("state", "canary_buf", "req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "input_ids",
           "positions", "out_cache_loc", "input_ids_out", "positions_out", "out_cache_loc_out")
OPTIONAL = ("violation_meta", "slot_attribution", "status_mirror")


def _expect(kwargs: dict[str, Any], exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern) as info:
        check.canary_check_step(**kwargs)
    assert type(info.value) is exc
    assert "frame #" not in str(info.value) and "Mismatched type" not in str(info.value)


@pytest.mark.parametrize("name", TENSORS + OPTIONAL)
def test_none_list_and_meta_tensor_are_named(name: str) -> None:
    kwargs = _valid_kwargs()
    value = kwargs[name]
    if name not in OPTIONAL:
        _expect({**kwargs, name: None}, TypeError, f"^canary_check_step: {name}: expected a torch.Tensor, got None")
    _expect({**_valid_kwargs(), name: value.tolist()}, TypeError,
            f"^canary_check_step: {name}: expected a torch.Tensor, got list")
    meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
    _expect({**_valid_kwargs(), name: meta}, ValueError, f"^canary_check_step: {name}: expected a cpu or cuda tensor")


@pytest.mark.parametrize("name", ["swa_window_size", "kv_token_id_vs_position_offset", "real_kv_hash_mode",
                                  "forward_step_value"])
def test_non_integer_ints_are_named(name: str) -> None:
    _expect({**_valid_kwargs(), name: None}, TypeError, f"^canary_check_step: {name}: expected an int, got NoneType")


def test_write_plan_is_named() -> None:
    _expect({**_valid_kwargs(), "write_plan": object()}, TypeError,
            "^canary_check_step: write_plan: expected WritePlan")
    kwargs = _valid_kwargs()
    plan = kwargs["write_plan"]
    broken = WritePlan(plan.write_offsets, None, plan.write_num_valid_reqs, plan.verify_row_offsets)  # type: ignore
    _expect({**kwargs, "write_plan": broken}, TypeError,
            "^canary_check_step: write_plan.write_seed_slot_indices: expected a torch.Tensor, got None")


@pytest.mark.parametrize(("name", "value", "exc", "pattern"), [
    ("state", torch.zeros(H + 8, dtype=torch.int32), TypeError, r"state: expected dtype int64"),
    ("state", torch.zeros(H + 5, dtype=torch.int64), ValueError, r"state: expected 16 header elements then"),
    ("state", torch.zeros(H - 1, dtype=torch.int64), ValueError, r"state: expected 16 header elements"),
    ("violation_meta", torch.zeros((3, 4), dtype=torch.int64), ValueError,
     r"violation_meta: expected shape \[ring_capacity=4, 4\].*bound by state"),
    ("slot_attribution", torch.zeros((15, 2), dtype=torch.int64), ValueError,
     r"slot_attribution: expected shape \[num_slots=16, 2\]"),
    ("req_pool_indices", torch.ones(1, dtype=torch.float32), TypeError,
     r"req_pool_indices: expected dtype int32 or int64, got float32"),
    ("prefix_lens", torch.ones(2, dtype=torch.int64), ValueError, r"prefix_lens: expected shape \[batch_rows=1\]"),
    ("extend_lens", torch.ones(1, dtype=torch.int16), TypeError, r"extend_lens: expected dtype int32 or int64"),
    ("req_to_token", torch.zeros((2, 8), dtype=torch.int64), TypeError, r"req_to_token: expected dtype int32"),
    ("positions", torch.ones(2, dtype=torch.int64), ValueError, r"positions: expected shape \[num_tokens=1\]"),
    ("out_cache_loc", torch.ones(1, dtype=torch.uint8), TypeError, r"out_cache_loc: expected dtype int32 or int64"),
    ("input_ids_out", torch.zeros(0, dtype=torch.int64), ValueError,
     r"input_ids_out: holds 0 elements, fewer than num_tokens=1"),
    ("positions_out", torch.zeros(4, dtype=torch.int32), TypeError, r"positions_out: expected dtype int64"),
    ("full_to_swa_index_mapping", torch.zeros((2, 2), dtype=torch.int64), ValueError,
     r"full_to_swa_index_mapping: expected a 1-d tensor"),
    ("expected_tokens", torch.zeros((2, 8), dtype=torch.int32), ValueError,
     r"expected_valid_lens_by_row: expected_tokens and expected_valid_lens_by_row must be given together"),
    ("expected_valid_lens_by_row", torch.zeros(2, dtype=torch.int64), ValueError,
     r"expected_tokens: expected_tokens and expected_valid_lens_by_row must be given together"),
    ("status_mirror", torch.zeros(H - 1, dtype=torch.int64), ValueError, r"status_mirror: expected shape \[16\]"),
    ("status_mirror", torch.zeros(H, dtype=torch.int32), TypeError, r"status_mirror: expected dtype int64"),
    ("swa_window_size", -1, ValueError, r"swa_window_size: must be >= 0"),
    ("check_tokens", 2, ValueError, r"check_tokens: must be 0 or 1"),
    ("new_forward", 2, ValueError, r"new_forward: must be 0 or 1"),
    ("real_kv_hash_mode", 5, ValueError, r"real_kv_hash_mode: must be 0 \(NONE\)"),
])
def test_kernel_names_bad_arguments(name: str, value: Any, exc: type[Exception], pattern: str) -> None:
    _expect({**_valid_kwargs(), name: value}, exc, "^canary_check_step: " + pattern)


def test_batch_larger_than_the_write_plan_is_refused() -> None:
    kwargs = _valid_kwargs()
    kwargs["write_plan"] = WritePlan.allocate(0, "cpu")
    _expect(kwargs, ValueError, r"^canary_check_step: req_pool_indices: batch has 1 rows, more than the write plan")


def test_empty_expected_valid_lens_is_refused() -> None:
    kwargs = {**_valid_kwargs(), "expected_tokens": torch.zeros((2, 8), dtype=torch.int32),
              "expected_valid_lens_by_row": torch.zeros(0, dtype=torch.int64)}
    _expect(kwargs, ValueError, r"^canary_check_step: expected_valid_lens_by_row: needs at least one row")


def _mail_kwargs(**overrides: Any) -> dict[str, Any]:
    kwargs = _valid_kwargs()
    rows = kwargs["req_to_token"].shape[0]
    kwargs.update(expected_tokens=torch.zeros((rows, 8), dtype=torch.int32),
                  expected_valid_lens_by_row=torch.zeros(rows, dtype=torch.int64),
                  token_mail=torch.zeros((layout.TOKEN_MAIL_FIELDS, 4), dtype=torch.int64),
                  token_mail_published=torch.zeros(1, dtype=torch.int64))
    kwargs.update(overrides)
    return kwargs


_TOGETHER = "token_mail and token_mail_published must be given together"
MAIL_ERRORS = [
    ({"token_mail_published": None}, f"token_mail_published: {_TOGETHER}"),
    ({"token_mail": None}, f"token_mail: {_TOGETHER}"),
    ({"expected_tokens": None, "expected_valid_lens_by_row": None}, "token_mail: needs int32 expected_tokens"),
    ({"expected_tokens": torch.zeros((8, 8), dtype=torch.int64)}, "token_mail: needs int32 expected_tokens"),
    ({"token_mail": torch.zeros((3, 4), dtype=torch.int64)}, "token_mail: expected shape"),
    ({"token_mail": torch.zeros((layout.TOKEN_MAIL_FIELDS, 0), dtype=torch.int64)},
     "token_mail: expected at least one"),
    ({"token_mail_published": torch.zeros(2, dtype=torch.int64)}, "token_mail_published: expected shape"),
]


@pytest.mark.parametrize(("override", "text"), MAIL_ERRORS, ids=[str(i) for i in range(len(MAIL_ERRORS))])
def test_token_mail_arguments_are_named(override: dict[str, Any], text: str) -> None:
    kwargs = _mail_kwargs(**override)
    if override.get("expected_tokens") is not None:
        kwargs["expected_valid_lens_by_row"] = torch.zeros(8, dtype=torch.int64)
    _expect(kwargs, ValueError, "^canary_check_step: " + re.escape(text))


def test_a_valid_token_mail_runs() -> None:
    check.canary_check_step(**_mail_kwargs())


@pytest.mark.gpu
def test_a_cuda_launch_needs_a_pinned_token_mail() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    case, _ = _hand("cpu", index=0, drained_to=-1, corrupt=False)
    kwargs = {**_on(case, "cuda"), "status_mirror": _mirror("cuda")}
    rows = kwargs["req_to_token"].shape[0]
    kwargs.update(expected_tokens=torch.zeros((rows, 8), dtype=torch.int32, device="cuda"),
                  expected_valid_lens_by_row=torch.zeros(rows, dtype=torch.int64, device="cuda"),
                  token_mail=torch.zeros((layout.TOKEN_MAIL_FIELDS, 4), dtype=torch.int64),
                  token_mail_published=torch.zeros(1, dtype=torch.int64).pin_memory())
    _expect(kwargs, ValueError, "^canary_check_step: token_mail: expected pinned host memory")


def _mail_case(rng: random.Random) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor] | None:
    """A random check case with an int32 token table and a token mail: records (some outside the table, steps in
    order around the launch's), a ring of 4 / 8 / 130 records (wrapping), a read cursor, and a published count
    (now and then behind the cursor or past a ring: nothing applies)."""
    case = random_check_case(rng)
    table = case["expected_tokens"]
    if table is None or table.dtype != torch.int32:
        return None
    rows, width = table.shape
    state = case["state"]
    counter = int(state[layout.STATE_FORWARD])
    step = counter if not case["new_forward"] else (
        case["forward_step_value"] if case["forward_step_value"] >= 0 else counter + 1)
    capacity = rng.choice([4, 8, 130])
    n = rng.randint(0, capacity)
    read = rng.randint(0, 3 * capacity)
    state[layout.STATE_TOKEN_MAIL_READ] = read
    ring = torch.zeros((layout.TOKEN_MAIL_FIELDS, capacity), dtype=torch.int64)  # (a column per field)
    record_steps = sorted(rng.choice([step - 2, step - 1, step, step, step + 1]) for _ in range(n))
    for k, record_step in enumerate(record_steps):
        ring[:, (read + k) % capacity] = torch.tensor([rng.randint(-1, rows), rng.randint(-1, width),
                                                       rng.randrange(1 << 40), record_step])
    published = rng.choice([read + n] * 8 + [read - 1, read + capacity + 1])
    return case, ring, torch.tensor([published], dtype=torch.int64)


def _run_with_mail(fn: Any, case: dict[str, Any], device: str, ring: torch.Tensor,
                   published: torch.Tensor) -> dict[str, Any]:
    kw = _on(case, device)
    pinned = device == "cuda"  # (the mail is host memory: pinned for a CUDA launch)
    mail = ring.clone().pin_memory() if pinned else ring.clone()
    count = published.clone().pin_memory() if pinned else published.clone()
    fn(**kw, token_mail=mail, token_mail_published=count)
    _sync(device)
    out = _results(kw)
    out["expected_tokens"] = kw["expected_tokens"].cpu()
    out["valid_lens"] = kw["expected_valid_lens_by_row"].cpu()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_mail_equals_the_reference(backend: str) -> None:
    """The token mail (issue 25) is applied as check_ref.apply_token_mail says, before the verify: the table, the valid
    lengths, the read cursor in the header, and every verify result (token checks of the appended positions included)
    equal the reference's."""
    _skip_unavailable(backend)
    ran = applied = 0
    for seed in range(300):
        made = _mail_case(random.Random(3 * 10**6 + seed))
        if made is None:
            continue
        case, ring, published = made
        got = _run_with_mail(check.canary_check_step, case, backend, ring, published)
        want = _run_with_mail(check_ref.canary_check_step, case, "cpu", ring, published)
        ctx = f"seed={seed}"
        assert torch.equal(got["expected_tokens"], want["expected_tokens"]), ctx
        assert torch.equal(got["valid_lens"], want["valid_lens"]), ctx
        assert_same(got, want, ctx, ordered=backend == "cpu")
        ran += 1
        applied += int(got["header"][layout.STATE_TOKEN_MAIL_READ]) != int(case["state"][layout.STATE_TOKEN_MAIL_READ])
    assert ran >= 20 and applied >= 10, (ran, applied)
