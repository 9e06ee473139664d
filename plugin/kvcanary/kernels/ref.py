"""Plain Python/torch reference of the kernels (SPEC §2–§4.2), for differential tests.

Deliberately simple: Python ints for all hashing, one entry at a time, in the documented order.
Functions take the same keyword arguments as :mod:`kvcanary.kernels.ops` and update the given CPU tensors
in place. Semantics beyond the seed (out-of-range indices, reason ``SLOT_OUT_OF_RANGE``) follow the
contract blocks of ``csrc/canary_write.cuh`` and ``csrc/canary_verify.cuh``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.plan import VerifyPlan, WritePlan
from kvcanary.kernels.real_kv import RealKvSource

U64_MASK = (1 << 64) - 1


def to_u64(x: int) -> int:
    return x & U64_MASK


def to_i64(x: int) -> int:
    x &= U64_MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    x &= U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT1
    x = (x * layout.SPLITMIX_MUL1) & U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT2
    x = (x * layout.SPLITMIX_MUL2) & U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT3
    return x


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(a)
    h = splitmix64(h ^ to_u64(b))
    return splitmix64(h ^ to_u64(c))


def chain_head_hash() -> int:
    """Unsigned prev_hash of a chain head."""
    return splitmix64(layout.CHAIN_ANCHOR)


def chain_step(prev_hash: int, token: int, position: int) -> int:
    return mix3(to_u64(prev_hash), token, position)


def fold_bytes(data: bytes) -> int:
    """Per-source accumulator over 16-byte steps of ``data``."""
    acc = 0
    for off in range(0, len(data), layout.REAL_KV_ALIGN_BYTES):
        lo = int.from_bytes(data[off : off + 8], "little")
        hi = int.from_bytes(data[off + 8 : off + 16], "little")
        acc = splitmix64(acc ^ lo)
        acc = splitmix64(acc ^ hi)
    return acc


def slot_bytes(source: RealKvSource, slot: int, num_bytes: int) -> bytes:
    row, col = divmod(slot, source.page_size)
    col *= source.num_bytes_per_token
    return bytes(source.kv_bytes[row, col : col + num_bytes].cpu().tolist())


def real_kv_fingerprint(sources: Sequence[RealKvSource], mode: int, slot: int) -> int:
    """Unsigned real_kv_hash of ``slot``."""
    if mode == layout.REAL_KV_HASH_MODE_NONE:
        return 0
    total = 0
    for src in sources:
        n = src.read_bytes
        if mode == layout.REAL_KV_HASH_MODE_PARTIAL:
            n = min(n, layout.REAL_KV_PARTIAL_BYTES)
        if n <= 0:
            continue
        total = splitmix64(total ^ fold_bytes(slot_bytes(src, slot, n)))
    return total


@dataclass
class _Records:
    """A mutable byte image of a canary buffer."""

    buf: torch.Tensor
    data: bytearray = field(init=False)
    stride: int = field(init=False)
    num_slots: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_slots, self.stride = int(self.buf.shape[0]), int(self.buf.shape[1])
        self.data = bytearray(self.buf.cpu().flatten().tolist())

    def load(self, slot: int) -> tuple[int, int, int, int]:
        base = slot * self.stride
        return tuple(  # type: ignore[return-value]
            int.from_bytes(self.data[base + 8 * i : base + 8 * i + 8], "little", signed=True)
            for i in range(layout.RECORD_FIELDS)
        )

    def store(self, slot: int, fields: Sequence[int]) -> None:
        base = slot * self.stride
        for i, value in enumerate(fields):
            self.data[base + 8 * i : base + 8 * i + 8] = to_u64(value).to_bytes(8, "little")

    def commit(self) -> None:
        image = torch.tensor(list(self.data), dtype=torch.uint8).view(self.num_slots, self.stride)
        self.buf.copy_(image)


class _Sink:
    def __init__(self, ring: torch.Tensor, write_index: torch.Tensor, kernel_kind: int,
                 meta: torch.Tensor | None = None, step: int = layout.META_UNKNOWN) -> None:
        self.ring = ring
        self.write_index = write_index
        self.capacity = int(ring.shape[0])
        self.index = int(write_index[0])
        self.kernel_kind = kernel_kind
        self.rows: dict[int, list[int]] = {}
        self.meta = meta
        self.step = step
        self.meta_rows: dict[int, list[int]] = {}

    def record(self, *row: int, meta: tuple[int, int, int] | None = None) -> None:
        """Append a row; ``meta``: (request row, written step, writer serial), unknown when None."""
        index = self.index
        self.index = to_i64(index + 1) if index + 1 < 1 << 31 else index + 1 - (1 << 32)
        if 0 <= index < self.capacity:
            self.rows[index] = [self.kernel_kind, *row]
            unknown = layout.META_UNKNOWN
            self.meta_rows[index] = [self.step, *(meta if meta is not None else (unknown, unknown, unknown))]

    def commit(self) -> None:
        for index, row in self.rows.items():
            self.ring[index] = torch.tensor([to_i64(v) for v in row], dtype=torch.int64)
            if self.meta is not None:
                self.meta[index] = torch.tensor(self.meta_rows[index], dtype=torch.int64)
        self.write_index[0] = self.index


def canary_write_step(
    *,
    canary_buf: torch.Tensor,
    write_offsets: torch.Tensor,
    write_seed_slot_indices: torch.Tensor,
    write_num_valid_reqs: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    kernel_kind: int,
    enable_write_input_assert: bool,
    expected_input_tokens: torch.Tensor | None,
    expected_input_positions: torch.Tensor | None,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    enable_chain_position_assert: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
) -> None:
    records = _Records(canary_buf)
    sink = _Sink(violation_ring, violation_write_index, kernel_kind)
    offsets = write_offsets.tolist()
    seeds = write_seed_slot_indices.tolist()
    tokens, pos, locs = input_ids.tolist(), positions.tolist(), out_cache_loc.tolist()
    exp_tok = expected_input_tokens.tolist() if enable_write_input_assert else None
    exp_pos = expected_input_positions.tolist() if enable_write_input_assert else None
    chain_flag = int(enable_chain_position_assert[0]) != 0
    capacity, num_tokens = len(seeds), len(tokens)
    active = max(0, min(int(write_num_valid_reqs[0]), capacity))
    stored_total = 0
    for r in range(active):
        begin, end = offsets[r], offsets[r + 1]
        if begin >= end:
            continue
        if begin < 0 or end > num_tokens:
            sink.record(layout.SKIP_WRITE_SLOT, -1, -1, layout.NO_EXPECTED_TOKEN, r, begin if begin < 0 else end,
                        layout.REASON_SLOT_OUT_OF_RANGE)
            continue
        seed = seeds[r]
        running = chain_head_hash()
        prev_position = 0
        chain_assert = False
        if seed != layout.CHAIN_HEAD_SLOT:
            if 0 <= seed < records.num_slots:
                s_tok, s_pos, s_prev, _ = records.load(seed)
                running = chain_step(s_prev, s_tok, s_pos)
                prev_position = s_pos
                chain_assert = chain_flag
            else:
                sink.record(seed, -1, -1, layout.NO_EXPECTED_TOKEN, running, seed, layout.REASON_SLOT_OUT_OF_RANGE)
        for e in range(begin, end):
            slot = locs[e]
            if slot < 0:
                continue
            token, position = tokens[e], pos[e]
            if exp_tok is not None and exp_pos is not None:
                bits = (layout.REASON_WRITE_TOKEN if token != exp_tok[e] else 0) | (
                    layout.REASON_WRITE_POSITION if position != exp_pos[e] else 0
                )
                if bits:
                    sink.record(slot, position, token, exp_tok[e], running, exp_pos[e], bits)
            if chain_assert and position != prev_position + 1:
                sink.record(slot, position, token, token, running, prev_position + 1, layout.REASON_WRITE_POSITION)
            if slot >= records.num_slots:
                sink.record(slot, position, token, token, running, slot, layout.REASON_SLOT_OUT_OF_RANGE)
            else:
                fp = real_kv_fingerprint(real_kv_sources, real_kv_hash_mode, slot)
                records.store(slot, (token, position, running, fp))
                stored_total += 1
            running = chain_step(running, token, position)
            prev_position = position
    records.commit()
    sink.commit()
    kernel_run_counter[0] = to_i64(int(kernel_run_counter[0]) + 1)
    slot_run_counter[0] = to_i64(int(slot_run_counter[0]) + stored_total)


def canary_verify_step(
    *,
    canary_buf: torch.Tensor,
    verify_slot_indices: torch.Tensor,
    verify_expected_tokens: torch.Tensor,
    verify_expected_positions: torch.Tensor,
    verify_prev_slot_indices: torch.Tensor,
    verify_num_valid: torch.Tensor,
    verify_enable: torch.Tensor,
    kernel_kind: int,
    violation_ring: torch.Tensor,
    violation_write_index: torch.Tensor,
    slot_run_counter: torch.Tensor,
    kernel_run_counter: torch.Tensor,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    violation_meta: torch.Tensor | None = None,
    forward_step: torch.Tensor | None = None,
    verify_request_rows: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
) -> None:
    """Reference of ``ops.canary_verify_step`` (contract: csrc/canary_verify.cuh), metadata arguments included."""
    records = _Records(canary_buf)
    unknown = layout.META_UNKNOWN
    sink = _Sink(violation_ring, violation_write_index, kernel_kind, violation_meta,
                 int(forward_step[0]) if forward_step is not None else unknown)
    request_rows = verify_request_rows.tolist() if verify_request_rows is not None else None
    attribution = slot_attribution.tolist() if slot_attribution is not None else None
    slots, prevs = verify_slot_indices.tolist(), verify_prev_slot_indices.tolist()
    exp_tok, exp_pos = verify_expected_tokens.tolist(), verify_expected_positions.tolist()
    enabled = int(verify_enable[0]) != 0
    active = max(0, min(int(verify_num_valid[0]), len(slots))) if enabled else 0
    for e in range(active):
        slot = slots[e]
        if slot == layout.PADDING_SLOT:
            continue
        reported_token = exp_tok[e] if check_tokens else layout.NO_EXPECTED_TOKEN
        request_row = request_rows[e] if request_rows is not None else unknown
        if slot < 0 or slot >= records.num_slots:
            sink.record(slot, exp_pos[e], -1, reported_token, 0, slot, layout.REASON_SLOT_OUT_OF_RANGE,
                        meta=(request_row, unknown, unknown))
            continue
        token, position, prev_hash, kv_hash = records.load(slot)
        prev = prevs[e]
        bits = 0
        expected_aux = prev_hash
        if prev == layout.CHAIN_HEAD_SLOT:
            expected_aux = to_i64(chain_head_hash())
        elif layout.UNKNOWN_PREV_SLOT < prev < records.num_slots:
            p_tok, p_pos, p_prev, _ = records.load(prev)
            expected_aux = to_i64(chain_step(p_prev, p_tok, p_pos))
        elif prev != layout.UNKNOWN_PREV_SLOT:
            bits |= layout.REASON_SLOT_OUT_OF_RANGE
            expected_aux = prev
        if (prev == layout.CHAIN_HEAD_SLOT or layout.UNKNOWN_PREV_SLOT < prev < records.num_slots) and (
            prev_hash != expected_aux
        ):
            bits |= layout.REASON_VERIFY_CHAIN_HASH
        if check_tokens and exp_tok[e] != layout.NO_EXPECTED_TOKEN and token != exp_tok[e]:
            bits |= layout.REASON_VERIFY_TOKEN
        if position != exp_pos[e]:
            bits |= layout.REASON_VERIFY_POSITION
        if kv_hash != to_i64(real_kv_fingerprint(real_kv_sources, real_kv_hash_mode, slot)):
            bits |= layout.REASON_VERIFY_REAL_KV_HASH
        if bits:
            written = tuple(attribution[slot]) if attribution is not None else (unknown, unknown)
            sink.record(slot, position, token, reported_token, prev_hash, expected_aux, bits,
                        meta=(request_row, *written))
    sink.commit()
    kernel_run_counter[0] = to_i64(int(kernel_run_counter[0]) + 1)
    slot_run_counter[0] = to_i64(int(slot_run_counter[0]) + active)


def canary_plan_step(
    *,
    write_plan: WritePlan,
    verify_plan: VerifyPlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_tokens_valid_lens: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    out_cache_loc: torch.Tensor | None = None,
) -> None:
    """Reference of ``ops.canary_plan_step`` (contract: csrc/canary_plan.cuh), with the padding rows of
    ``out_cache_loc`` (a row that writes and whose first new token is on the padding slot)."""
    rps, prefixes, extends = req_pool_indices.tolist(), prefix_lens.tolist(), extend_lens.tolist()
    locs = out_cache_loc.tolist() if out_cache_loc is not None else None
    table = req_to_token.tolist()
    req_rows = len(table)
    max_ctx = int(req_to_token.shape[1])
    lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
    exp = expected_tokens.tolist() if expected_tokens is not None else None
    valid = expected_tokens_valid_lens.tolist() if expected_tokens_valid_lens is not None else None
    err = layout.encode_plan_index_error

    def translate(value: int) -> int:
        if lut is None or value < 0:
            return value
        return lut[value] if value < len(lut) else err(value)

    def expected(r: int, rp: int, pos: int) -> int:
        if exp is None or not 0 <= rp < len(exp):
            return layout.NO_EXPECTED_TOKEN
        index = pos + kv_token_id_vs_position_offset
        if index < 0 or index >= valid[r] or index >= len(exp[rp]):
            return layout.NO_EXPECTED_TOKEN
        return exp[rp][index]

    bs = len(rps)
    cap = write_plan.capacity
    offsets, seeds, row_offsets, request_rows = [0], [], [0], []
    entries: list[tuple[int, int, int, int]] = []  # slot, prev, token, position
    entry_rows: list[int] = []  # rp of each entry's batch row
    for r in range(cap):
        seed, write_count, row_entries = layout.CHAIN_HEAD_SLOT, 0, []
        rp = rps[r] if r < bs else layout.PADDING_REQ_POOL_ROW
        if rp != layout.PADDING_REQ_POOL_ROW:
            prefix, extend = prefixes[r], extends[r]
            start = offsets[-1]  # where the row's tokens start: padding rows before it took none
            padding = locs is not None and extend > 0 and start < len(locs) and locs[start] == layout.PADDING_SLOT
            write_count = 0 if padding else max(extend, 0)
            if not 0 <= rp < req_rows:
                row_entries.append((err(rp), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
            else:
                bad_prefix = prefix < 0 or prefix > max_ctx
                end = min(max(prefix, 0), max_ctx)
                window_start = max(0, end - swa_window_size) if swa_window_size > 0 else 0
                for pos in range(end if padding else window_start, end):  # a padding row: no window entries
                    prev = translate(table[rp][pos - 1]) if pos > 0 else layout.CHAIN_HEAD_SLOT
                    row_entries.append((translate(table[rp][pos]), prev, expected(r, rp, pos), pos))
                if bad_prefix:
                    row_entries.append((err(prefix), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
                if extend < 0:
                    row_entries.append((err(extend), layout.UNKNOWN_PREV_SLOT, -1, layout.NO_EXPECTED_POSITION))
                if not padding and not bad_prefix and prefix > 0 and extend > 0:
                    seed = translate(table[rp][prefix - 1])
        seeds.append(seed)
        request_rows.append(rp)
        offsets.append(offsets[-1] + write_count)
        entries.extend(row_entries)
        entry_rows.extend([rp] * len(row_entries))
        row_offsets.append(len(entries))
    write_plan.write_offsets.copy_(torch.tensor(offsets, dtype=torch.int64))
    write_plan.write_seed_slot_indices.copy_(torch.tensor(seeds, dtype=torch.int64))
    write_plan.verify_row_offsets.copy_(torch.tensor(row_offsets, dtype=torch.int64))
    write_plan.write_num_valid_reqs[0] = bs
    if write_plan.write_request_rows is not None:
        write_plan.write_request_rows.copy_(torch.tensor(request_rows, dtype=torch.int64))
    vcap = verify_plan.capacity
    overflow = len(entries) > vcap
    verify_plan.verify_num_valid[0] = vcap if overflow else len(entries)
    verify_plan.verify_enable[0] = 0 if overflow else 1
    if overflow:
        return
    for e, (slot, prev, token, position) in enumerate(entries):
        verify_plan.verify_slot_indices[e] = slot
        verify_plan.verify_prev_slot_indices[e] = prev
        verify_plan.verify_expected_tokens[e] = token
        verify_plan.verify_expected_positions[e] = position
        if verify_plan.verify_request_rows is not None:
            verify_plan.verify_request_rows[e] = entry_rows[e]


def reuse_drained_ring(state: torch.Tensor, violation_meta: torch.Tensor | None = None) -> None:
    """The drained-ring reuse at the start of ``canary_check_step`` (contract: csrc/canary_check.cuh), in place on
    ``state`` (the header, then the ring) and ``violation_meta``: with the host's acknowledgement (epoch E, index D) of
    the ring's current epoch, the rows appended since D move to the front (when they fit below D and the ring did not
    overflow), or, when every stored row was read and the rows past D were never stored (D >= capacity), they are
    counted in ``STATE_RING_LOST_AT_RESET``; either way the epoch advances and the acknowledgement is consumed."""
    drained_to = int(state[layout.STATE_DRAINED_TO])
    if drained_to <= 0:
        return
    shift = layout.DRAINED_TO_EPOCH_SHIFT
    acked = drained_to & ((1 << shift) - 1)
    if acked <= 0 or drained_to >> shift != int(state[layout.STATE_RING_EPOCH]):
        return  # nothing read, or read in an epoch already emptied
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    index = int(write_index[0])
    capacity = (int(state.shape[0]) - layout.STATE_HEADER_FIELDS) // layout.VIOLATION_FIELDS
    kept, lost = 0, 0
    if acked <= index <= capacity and index - acked <= acked:
        kept = index - acked
        ring = state[layout.STATE_HEADER_FIELDS :].view(-1, layout.VIOLATION_FIELDS)
        ring[:kept] = ring[acked:index].clone()
        if violation_meta is not None:
            violation_meta[:kept] = violation_meta[acked:index].clone()
    elif index > capacity and acked >= capacity and index >= acked:
        lost = index - acked
    else:
        return  # an overlapping move, unread stored rows past D, or a wrapped index: the host acknowledges again
    write_index[0] = kept
    state[layout.STATE_RING_EPOCH] += 1
    state[layout.STATE_DRAINED_TO] = -1
    state[layout.STATE_RING_LOST_AT_RESET] += lost
    state[layout.STATE_RING_REUSED_AT] = acked


def canary_check_step(
    *,
    state: torch.Tensor,
    canary_buf: torch.Tensor,
    write_plan: WritePlan,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    input_ids_out: torch.Tensor,
    positions_out: torch.Tensor,
    out_cache_loc_out: torch.Tensor,
    violation_meta: torch.Tensor | None = None,
    slot_attribution: torch.Tensor | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: torch.Tensor | None = None,
    expected_tokens: torch.Tensor | None = None,
    expected_valid_lens_by_row: torch.Tensor | None = None,
    kv_token_id_vs_position_offset: int = 0,
    real_kv_sources: Sequence[RealKvSource] = (),
    real_kv_hash_mode: int = layout.REAL_KV_HASH_MODE_NONE,
    check_tokens: bool = False,
    new_forward: bool = True,
    forward_step_value: int = -1,
) -> None:
    """Reference of ``ops.canary_check_step`` (contract: csrc/canary_check.cuh): the drained-ring reuse first, then
    the plan and verify references composed over a verify plan that cannot overflow, and the per-forward small ops."""
    i64 = torch.int64
    write_index = state[layout.STATE_WRITE_INDEX : layout.STATE_WRITE_INDEX + 1].view(torch.int32)[0:1]
    reuse_drained_ring(state, violation_meta)  # before this launch's appends: they follow the rows kept
    n = int(input_ids.shape[0])
    for src, dst in ((input_ids, input_ids_out), (positions, positions_out), (out_cache_loc, out_cache_loc_out)):
        dst[:n] = src.to(i64)
    rps = req_pool_indices.to(i64)
    valid = None
    if expected_valid_lens_by_row is not None:
        valid = expected_valid_lens_by_row[rps.clamp(0, int(expected_valid_lens_by_row.shape[0]) - 1)]
    bs = int(rps.shape[0])
    scratch = WritePlan.allocate(write_plan.capacity, "cpu")
    verify_plan = VerifyPlan.allocate(bs * (int(req_to_token.shape[1]) + 2), "cpu")  # every entry a row can plan
    canary_plan_step(
        write_plan=scratch, verify_plan=verify_plan, req_pool_indices=rps, prefix_lens=prefix_lens.to(i64),
        extend_lens=extend_lens.to(i64), req_to_token=req_to_token, swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping, expected_tokens=expected_tokens,
        expected_tokens_valid_lens=valid, kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        out_cache_loc=out_cache_loc,
    )
    write_plan.write_offsets.copy_(scratch.write_offsets)
    write_plan.write_seed_slot_indices.copy_(scratch.write_seed_slot_indices)
    write_plan.write_num_valid_reqs.copy_(scratch.write_num_valid_reqs)
    if write_plan.write_request_rows is not None and scratch.write_request_rows is not None:
        write_plan.write_request_rows.copy_(scratch.write_request_rows)
    counter = int(state[layout.STATE_FORWARD])
    step = counter if not new_forward else (forward_step_value if forward_step_value >= 0 else counter + 1)
    tag = layout.LAUNCH_TAG_VERIFY
    canary_verify_step(
        canary_buf=canary_buf,
        verify_slot_indices=verify_plan.verify_slot_indices,
        verify_expected_tokens=verify_plan.verify_expected_tokens,
        verify_expected_positions=verify_plan.verify_expected_positions,
        verify_prev_slot_indices=verify_plan.verify_prev_slot_indices,
        verify_num_valid=verify_plan.verify_num_valid,
        verify_enable=verify_plan.verify_enable,
        kernel_kind=tag,
        violation_ring=state[layout.STATE_HEADER_FIELDS :].view(-1, layout.VIOLATION_FIELDS),
        violation_write_index=write_index,
        slot_run_counter=state[layout.STATE_SLOT_RUNS + tag : layout.STATE_SLOT_RUNS + tag + 1],
        kernel_run_counter=state[layout.STATE_KERNEL_RUNS + tag : layout.STATE_KERNEL_RUNS + tag + 1],
        real_kv_sources=real_kv_sources,
        real_kv_hash_mode=real_kv_hash_mode,
        check_tokens=check_tokens,
        violation_meta=violation_meta,
        forward_step=torch.tensor([step], dtype=i64),
        verify_request_rows=verify_plan.verify_request_rows,
        slot_attribution=slot_attribution,
    )
    if new_forward:
        state[layout.STATE_FORWARD] = step
