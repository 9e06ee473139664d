"""canary_token_update (csrc/canary_tokens.cuh) and TokenTable's uploads through it.

* Differential: TokenTable.update equals the implementation it replaced (Python lists, a pinned upload and two
  index_put_ scatters, kept below as the reference) over random batches: decode-like single tokens, whole-row
  uploads, clipping at the width, and rows repeated in one batch.
* Repeated rows: the kernel applies a batch in order (the later update wins). The old code was not ordered: its long
  updates (> 32 tokens) were copied before the short ones were scattered, so a short update beat a later long one,
  and index_put_ leaves the winner among duplicate indices undefined on CUDA. Batches without that mix agree with
  the old code; every batch agrees with the old code applied one update at a time.
* The op on hand-built stagings (layout, int64 -> int32 conversion), its argument errors, each naming the argument.
* The staging ring with simulated events: a staging is handed out again only after an event recorded after its
  last launch on its stream (its cover) completed (the host waits when the device is behind), and is replaced by a
  larger one only then; the ring records one event per EVENT_EVERY launches (a group), not one per launch.
* GPU (skipped without CUDA): uploads from pinned memory while the device is kept busy, more batches than the ring
  holds, checked against the reference.
"""

from __future__ import annotations

import gc
import random
import re
import weakref
from collections.abc import Sequence

import pytest
import torch

from kvcanary.kernels import layout
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.tokens import canary_token_append, canary_token_update
from kvcanary.runtime import staging as staging_module
from kvcanary.runtime.staging import (
    MIN_STAGING_VALUES,
    CudaStagingEvent,
    StagingRing,
    device_events,
    launch_stream_of,
)
from kvcanary.runtime.token_table import RING_SIZE, TOKEN_EVENT_EVERY, TokenMail, TokenTable

CPU = torch.device("cpu")
FIELDS = layout.TOKEN_UPDATE_FIELDS
Updates = Sequence[tuple[int, int, Sequence[int]]]

# ---------------------------------------------------------------------------------------------- the old code

REFERENCE_SCATTER_MAX_TOKENS = 32


def reference_update(table: torch.Tensor, valid_lens: torch.Tensor, updates: Updates) -> None:
    """TokenTable.update before canary_token_update (CPU, same semantics and errors)."""
    if not updates:
        return
    rows_total, width = table.shape
    tok_rows: list[int] = []
    tok_cols: list[int] = []
    tok_vals: list[int] = []
    len_rows: list[int] = []
    len_vals: list[int] = []
    for row, start, tokens in updates:
        if not 0 <= row < rows_total:
            raise ValueError(f"CanaryManager.update_expected_tokens: row {row} outside [0, {rows_total})")
        if start < 0:
            raise ValueError(f"CanaryManager.update_expected_tokens: start {start} < 0 (row {row})")
        count = max(0, min(len(tokens), width - start))
        if count > REFERENCE_SCATTER_MAX_TOKENS:
            table[row, start : start + count].copy_(torch.tensor(list(tokens[:count]), dtype=torch.int64))
        elif count:
            tok_rows += [row] * count
            tok_cols += range(start, start + count)
            tok_vals += tokens[:count]
        len_rows.append(row)
        len_vals.append(min(start + len(tokens), width))
    n, m = len(tok_vals), len(len_rows)
    dev = torch.tensor(tok_rows + tok_cols + tok_vals + len_rows + len_vals, dtype=torch.int64)
    if n:
        table.index_put_((dev[:n], dev[n : 2 * n]), dev[2 * n : 3 * n].to(torch.int32))
    valid_lens.index_put_((dev[3 * n : 3 * n + m],), dev[3 * n + m :])


def reference_tables(rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((rows, width), layout.NO_EXPECTED_TOKEN, dtype=torch.int32),
            torch.zeros(rows, dtype=torch.int64))


def assert_same(table: TokenTable, ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(table.expected_tokens, ref[0])
    assert torch.equal(table.valid_lens_by_row, ref[1])


# ---------------------------------------------------------------------------------------------- random batches

ROWS, WIDTH = 24, 96


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-(1 << 40), 1 << 40) if rng.random() < 0.05 else rng.randrange(200_000) for _ in range(n)]


def decode_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    rows = rng.sample(range(ROWS), rng.randint(1, ROWS))
    return [(r, rng.randrange(WIDTH), tokens(rng, 1)) for r in rows]


def whole_rows_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    rows = rng.sample(range(ROWS), rng.randint(1, 6))
    return [(r, 0, tokens(rng, rng.randint(0, WIDTH))) for r in rows]


def clipped_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    rows = rng.sample(range(ROWS), rng.randint(1, 8))
    return [(r, rng.randint(WIDTH - 40, WIDTH + 5), tokens(rng, rng.randint(0, 60))) for r in rows]


def mixed_distinct_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    rows = rng.sample(range(ROWS), rng.randint(1, ROWS))
    return [(r, rng.randrange(WIDTH + 3), tokens(rng, rng.choice([0, 1, 2, 5, 33, 70]))) for r in rows]


def repeated_short_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    """Rows repeat; every update <= 32 tokens (the old code scattered them all: the later one won on the CPU)."""
    n = rng.randint(2, 12)
    return [(rng.randrange(4), rng.randrange(WIDTH), tokens(rng, rng.randint(0, 32))) for _ in range(n)]


def repeated_mixed_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    """Rows repeat with long and short updates: applied in order (the old code was not)."""
    return [(rng.randrange(3), rng.randrange(WIDTH // 2), tokens(rng, rng.choice([1, 4, 40, 80])))
            for _ in range(rng.randint(2, 10))]


DISTINCT_OR_SHORT = [decode_batch, whole_rows_batch, clipped_batch, mixed_distinct_batch, repeated_short_batch]


@pytest.mark.parametrize("seed", range(6))
def test_token_table_equals_the_index_put_implementation(seed: int) -> None:
    rng = random.Random(seed)
    table, ref = TokenTable(ROWS, WIDTH, CPU), reference_tables(ROWS, WIDTH)
    for _ in range(40):
        batch = rng.choice(DISTINCT_OR_SHORT)(rng)
        table.update(batch)
        reference_update(*ref, batch)
        assert_same(table, ref)


@pytest.mark.parametrize("seed", range(6))
def test_repeated_rows_apply_in_batch_order(seed: int) -> None:
    """Every batch equals the old code applied one update at a time (the later update of a row wins)."""
    rng = random.Random(100 + seed)
    table, ref = TokenTable(ROWS, WIDTH, CPU), reference_tables(ROWS, WIDTH)
    for _ in range(30):
        batch = rng.choice([repeated_mixed_batch, repeated_short_batch, decode_batch])(rng)
        table.update(batch)
        for update in batch:
            reference_update(*ref, [update])
        assert_same(table, ref)


def test_a_later_long_update_wins_over_an_earlier_short_one() -> None:
    """The case the old code got backwards (long copies first, short scatters after)."""
    long = list(range(100, 140))
    table, ref = TokenTable(2, 64, CPU), reference_tables(2, 64)
    table.update([(1, 0, [7, 8]), (1, 0, long)])
    assert table.expected_tokens[1, :40].tolist() == long and int(table.valid_lens_by_row[1]) == 40
    reference_update(*ref, [(1, 0, [7, 8]), (1, 0, long)])
    assert ref[0][1, :2].tolist() == [7, 8]  # the old order: the earlier short update won


def test_update_errors_are_the_old_ones_and_write_nothing() -> None:
    table = TokenTable(4, 8, CPU)
    table.update([(1, 0, [1, 2])])
    before = (table.expected_tokens.clone(), table.valid_lens_by_row.clone())
    for bad, message in (([(1, 0, [5]), (4, 0, [1])], "row 4 outside [0, 4)"),
                         ([(-1, 0, [1])], "row -1 outside [0, 4)"),
                         ([(2, 0, [5]), (1, -1, [1])], "start -1 < 0 (row 1)")):
        with pytest.raises(ValueError, match=re.escape(f"CanaryManager.update_expected_tokens: {message}")):
            table.update(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            reference_update(*reference_tables(4, 8), bad)
    assert torch.equal(table.expected_tokens, before[0]) and torch.equal(table.valid_lens_by_row, before[1])
    table.update([])  # nothing to do


def test_a_batch_larger_than_the_staging_grows_it() -> None:
    table, ref = TokenTable(3, 4 * MIN_STAGING_VALUES, CPU), reference_tables(3, 4 * MIN_STAGING_VALUES)
    batch = [(r, 0, list(range(r, r + 2 * MIN_STAGING_VALUES))) for r in range(3)]
    table.update(batch)
    reference_update(*ref, batch)
    assert_same(table, ref)
    assert table.staging.grows == 1  # the staging allocated with the ring (MIN_STAGING_VALUES) replaced
    table.update(batch * 2)
    assert table.staging.grows == 2
    reference_update(*ref, batch)
    assert_same(table, ref)


# ---------------------------------------------------------------------------------------------- the op itself


def stage(updates: Sequence[tuple[int, int, int, int, Sequence[int]]], extra: int = 0) -> tuple[torch.Tensor, int]:
    """A staging from (row, start, count, valid_len, tokens) headers; offsets computed, `extra` spare values."""
    n = len(updates)
    header = [[0] * n for _ in range(FIELDS)]
    packed: list[int] = []
    for u, (row, start, count, valid_len, toks) in enumerate(updates):
        for field, value in ((layout.TOKEN_UPDATE_FIELD_ROW, row), (layout.TOKEN_UPDATE_FIELD_START, start),
                             (layout.TOKEN_UPDATE_FIELD_COUNT, count),
                             (layout.TOKEN_UPDATE_FIELD_VALID_LEN, valid_len),
                             (layout.TOKEN_UPDATE_FIELD_OFFSET, FIELDS * n + len(packed))):
            header[field][u] = value
        packed += toks
    values = [v for field in header for v in field] + packed
    return torch.tensor(values + [0] * extra, dtype=torch.int64), len(values)


def op_args(rows: int = 4, width: int = 8, **overrides):
    staging, staged_len = stage([(1, 2, 3, 5, [10, 11, 12]), (3, 0, 1, 6, [1 << 33 | 9])], extra=4)
    args = dict(expected_tokens=torch.full((rows, width), -1, dtype=torch.int32),
                valid_lens_by_row=torch.zeros(rows, dtype=torch.int64), staging=staging, num_updates=2,
                staged_len=staged_len)
    args.update(overrides)
    return args


def test_op_applies_a_hand_built_staging() -> None:
    args = op_args()
    canary_token_update(**args)
    assert args["expected_tokens"][1].tolist() == [-1, -1, 10, 11, 12, -1, -1, -1]
    assert args["expected_tokens"][3].tolist() == [9] + [-1] * 7  # the low 32 bits, like .to(torch.int32)
    assert args["valid_lens_by_row"].tolist() == [0, 5, 0, 6]
    assert int(torch.tensor([1 << 33 | 9]).to(torch.int32)) == 9


def test_op_with_no_updates_writes_nothing() -> None:
    args = op_args(num_updates=0, staged_len=0)
    canary_token_update(**args)
    assert (args["expected_tokens"] == -1).all() and (args["valid_lens_by_row"] == 0).all()


def op_error(op: str, arg: str, text: str) -> str:
    """The start of ``op``'s error naming ``arg`` (both exports word their argument errors alike)."""
    return "^" + re.escape(f"{op}: {arg}: {text}")


def arg_error(arg: str, text: str) -> str:
    return op_error("canary_token_update", arg, text)


ARGUMENT_ERRORS = [
    ({"expected_tokens": torch.zeros((4, 8), dtype=torch.int64)}, TypeError, "expected_tokens", "expected dtype int32"),
    ({"expected_tokens": None}, TypeError, "expected_tokens", "expected a torch.Tensor, got None"),
    ({"valid_lens_by_row": torch.zeros(5, dtype=torch.int64)}, ValueError, "valid_lens_by_row", "expected shape"),
    ({"valid_lens_by_row": torch.zeros(4, dtype=torch.int32)}, TypeError, "valid_lens_by_row", "expected dtype int64"),
    ({"staging": torch.zeros(40, dtype=torch.int32)}, TypeError, "staging", "expected dtype int64"),
    ({"staging": torch.zeros((2, 20), dtype=torch.int64)}, ValueError, "staging", "expected a 1-d tensor"),
    ({"staging": torch.zeros(40, dtype=torch.int64, device="meta")}, ValueError, "staging", "expected a cpu or cuda"),
    ({"staging": [0] * 40}, TypeError, "staging", "expected a torch.Tensor, got list"),
    ({"num_updates": -1}, ValueError, "num_updates", "must be in [0, 2^31), got -1"),
    ({"num_updates": "2"}, TypeError, "num_updates", "expected an int, got str"),
    ({"staged_len": 1000}, ValueError, "staged_len", "expected 5 * num_updates = 10 <= staged_len <= staging length"),
    ({"staged_len": 9}, ValueError, "staged_len", "expected 5 * num_updates = 10 <= staged_len"),
]


@pytest.mark.parametrize(("override", "kind", "arg", "text"), ARGUMENT_ERRORS,
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(ARGUMENT_ERRORS)])
def test_op_argument_errors_name_the_argument(override: dict, kind: type, arg: str, text: str) -> None:
    args = op_args(**override)
    with pytest.raises(kind, match=arg_error(arg, text)):
        canary_token_update(**args)


HEADER_ERRORS = [
    ([(1, 0, 1, 1, [5]), (9, 0, 1, 1, [5])], "update 1 (row 9): row outside [0, 4)"),
    ([(1, -2, 1, 1, [5])], "update 0 (row 1): start -2 < 0"),
    ([(1, 6, 3, 8, [5, 6, 7])], "update 0 (row 1): count 3 outside [0, 2] (tokens past the width 8 must be clipped)"),
    ([(1, 9, 1, 8, [5])], "update 0 (row 1): count 1 outside [0, 0]"),
    ([(1, 0, -1, 0, [])], "update 0 (row 1): count -1 outside [0, 8]"),
    ([(1, 0, 1, 9, [5])], "update 0 (row 1): valid length 9 outside [0, 8]"),
]


@pytest.mark.parametrize(("headers", "text"), HEADER_ERRORS, ids=[str(i) for i in range(len(HEADER_ERRORS))])
def test_op_bad_headers_name_the_update_and_write_nothing(headers: list, text: str) -> None:
    staging, staged_len = stage(headers)
    args = op_args(staging=staging, num_updates=len(headers), staged_len=staged_len)
    with pytest.raises(ValueError, match=arg_error("staging", text)):
        canary_token_update(**args)
    assert (args["expected_tokens"] == -1).all() and (args["valid_lens_by_row"] == 0).all()


def test_op_token_offsets_outside_the_staged_tokens() -> None:
    staging, staged_len = stage([(1, 0, 2, 2, [5, 6])])
    staging[layout.TOKEN_UPDATE_FIELD_OFFSET] = 1  # inside the header
    with pytest.raises(ValueError, match=arg_error("staging", "update 0 (row 1): tokens [1, 3) outside the staged "
                                                   "tokens [5, 7)")):
        canary_token_update(**op_args(staging=staging, num_updates=1, staged_len=staged_len))
    staging[layout.TOKEN_UPDATE_FIELD_OFFSET] = 6  # runs past staged_len
    with pytest.raises(ValueError, match=re.escape("tokens [6, 8) outside the staged tokens [5, 7)")):
        canary_token_update(**op_args(staging=staging, num_updates=1, staged_len=staged_len))


# ---------------------------------------------------------------------------------------------- canary_token_append

APPEND_FIELDS = layout.TOKEN_APPEND_FIELDS


def append_staging(updates: Sequence[tuple[int, int, int]], extra: int = 0) -> torch.Tensor:
    """The staging of canary_token_append from (row, start, token) updates: the rows, the starts, the tokens."""
    runs = [[u[field] for u in updates] for field in (layout.TOKEN_APPEND_FIELD_ROW, layout.TOKEN_APPEND_FIELD_START,
                                                      layout.TOKEN_APPEND_FIELD_TOKEN)]
    return torch.tensor([v for run in runs for v in run] + [0] * extra, dtype=torch.int64)


def append_args(updates: Sequence[tuple[int, int, int]] = ((1, 2, 10), (3, 0, 1 << 33 | 9)), rows: int = 4,
                width: int = 8, **overrides):
    args = dict(expected_tokens=torch.full((rows, width), -1, dtype=torch.int32),
                valid_lens_by_row=torch.zeros(rows, dtype=torch.int64), staging=append_staging(updates, extra=2),
                num_updates=len(updates))
    args.update(overrides)
    return args


def test_append_op_writes_one_token_per_row_like_the_general_op() -> None:
    updates = [(1, 2, 10), (3, 0, 1 << 33 | 9), (0, 7, -5)]
    args = append_args(updates)
    canary_token_append(**args)
    general = op_args(staging=stage([(r, s, 1, s + 1, [t]) for r, s, t in updates])[0], num_updates=3,
                      staged_len=stage([(r, s, 1, s + 1, [t]) for r, s, t in updates])[1])
    canary_token_update(**general)
    assert args["expected_tokens"][1].tolist() == [-1, -1, 10, -1, -1, -1, -1, -1]
    assert args["expected_tokens"][3].tolist() == [9] + [-1] * 7  # the low 32 bits, like .to(torch.int32)
    assert args["valid_lens_by_row"].tolist() == [8, 3, 0, 1]  # start + 1
    assert torch.equal(args["expected_tokens"], general["expected_tokens"])
    assert torch.equal(args["valid_lens_by_row"], general["valid_lens_by_row"])


def test_append_op_applies_a_repeated_row_in_batch_order() -> None:
    args = append_args([(2, 4, 40), (1, 0, 10), (2, 4, 41), (2, 1, 11)])
    canary_token_append(**args)
    assert args["expected_tokens"][2].tolist() == [-1, 11, -1, -1, 41, -1, -1, -1]  # the later token at 4 wins
    assert args["valid_lens_by_row"].tolist() == [0, 1, 2, 0]  # the row's last update: start 1 + 1


def test_append_op_with_no_updates_writes_nothing() -> None:
    args = append_args([], staging=torch.zeros(0, dtype=torch.int64))
    canary_token_append(**args)
    assert (args["expected_tokens"] == -1).all() and (args["valid_lens_by_row"] == 0).all()


def append_error(arg: str, text: str) -> str:
    return op_error("canary_token_append", arg, text)


APPEND_ARGUMENT_ERRORS = [
    ({"expected_tokens": torch.zeros((4, 8), dtype=torch.int64)}, TypeError, "expected_tokens", "expected dtype int32"),
    ({"valid_lens_by_row": torch.zeros(5, dtype=torch.int64)}, ValueError, "valid_lens_by_row", "expected shape"),
    ({"staging": torch.zeros(8, dtype=torch.int32)}, TypeError, "staging", "expected dtype int64"),
    ({"staging": torch.zeros(8, dtype=torch.int64, device="meta")}, ValueError, "staging", "expected a cpu or cuda"),
    ({"num_updates": -1}, ValueError, "num_updates", "must be in [0, 2^31), got -1"),
    ({"num_updates": 3}, ValueError, "num_updates", "expected 3 * num_updates = 9 <= staging length 8"),
]


@pytest.mark.parametrize(("override", "kind", "arg", "text"), APPEND_ARGUMENT_ERRORS,
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(APPEND_ARGUMENT_ERRORS)])
def test_append_op_argument_errors_name_the_argument(override: dict, kind: type, arg: str, text: str) -> None:
    with pytest.raises(kind, match=append_error(arg, text)):
        canary_token_append(**append_args(**override))


APPEND_UPDATE_ERRORS = [
    ([(1, 0, 5), (4, 0, 5)], "update 1 (row 4): row outside [0, 4)"),
    ([(-1, 0, 5)], "update 0 (row -1): row outside [0, 4)"),
    ([(1, -1, 5)], "update 0 (row 1): start -1 outside [0, 8)"),
    ([(2, 3, 5), (1, 8, 5)], "update 1 (row 1): start 8 outside [0, 8) (an append past the width must be clipped: "
                             "canary_token_update)"),
]


@pytest.mark.parametrize(("updates", "text"), APPEND_UPDATE_ERRORS,
                         ids=[str(i) for i in range(len(APPEND_UPDATE_ERRORS))])
def test_append_op_bad_updates_name_the_update_and_write_nothing(updates: list, text: str) -> None:
    args = append_args(updates)
    with pytest.raises(ValueError, match=append_error("staging", text)):
        canary_token_append(**args)
    assert (args["expected_tokens"] == -1).all() and (args["valid_lens_by_row"] == 0).all()


# ---------------------------------------------------------------------------------------------- the bound append


def bind_append(args: dict, device: str = "cpu"):
    """canary_token_append_bind of ``append_args``' tensors (moved to ``device``; the staging pinned there)."""
    table, lens = args["expected_tokens"].to(device), args["valid_lens_by_row"].to(device)
    staging = args["staging"].pin_memory() if device == "cuda" else args["staging"]
    return load_module(device).canary_token_append_bind(table, lens, staging), table, lens, staging


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_bound_append_equals_the_export(device: str, seed: int) -> None:
    """The bound append (issue 25: tensors validated and the staging's device address resolved once) writes what
    the export writes, for batches of distinct rows and with a row repeated (the ordered launch)."""
    rng = random.Random(300 + seed)
    rows, width = 16, 64
    for repeat in (False, True):
        picked = rng.sample(range(rows), 8) + ([rng.randrange(rows)] * 2 if repeat else [])
        updates = [(r, rng.randrange(width), rng.randrange(1 << 40)) for r in picked]
        args = append_args(updates, rows=rows, width=width)
        bound, table, lens, staging = bind_append(args, device)
        bound(lens, len(updates))
        canary_token_append(**args)
        assert torch.equal(table.cpu(), args["expected_tokens"])
        assert torch.equal(lens.cpu(), args["valid_lens_by_row"])
        del staging  # (kept until the launch has run: the comparison above synchronised)


BOUND_APPEND_CALL_ERRORS = [
    (-1, "num_updates", "must be in [0, 2^31), got -1"),
    (3, "num_updates", "expected 3 * num_updates = 9 <= staging length 8"),
]


@pytest.mark.parametrize(("num_updates", "arg", "text"), BOUND_APPEND_CALL_ERRORS)
def test_bound_append_call_errors_are_the_exports(num_updates: int, arg: str, text: str) -> None:
    args = append_args()
    bound, table, lens, _ = bind_append(args)
    with pytest.raises(ValueError, match=op_error("canary_token_append_bound", arg, text)):
        bound(lens, num_updates)
    assert (table == -1).all() and (lens == 0).all()


@pytest.mark.parametrize(("updates", "text"), APPEND_UPDATE_ERRORS,
                         ids=[str(i) for i in range(len(APPEND_UPDATE_ERRORS))])
def test_bound_append_bad_updates_name_the_update_and_write_nothing(updates: list, text: str) -> None:
    args = append_args(updates)
    bound, table, lens, _ = bind_append(args)
    with pytest.raises(ValueError, match=op_error("canary_token_append_bound", "staging", text)):
        bound(lens, len(updates))
    assert (table == -1).all() and (lens == 0).all()


def test_bound_append_reads_what_the_staging_holds_at_each_call() -> None:
    """The staging is read at every call (the ring packs a new batch into it between launches), never at binding."""
    args = append_args([(1, 2, 10)])
    bound, table, lens, staging = bind_append(args)
    staging[:3] = torch.tensor([3, 5, 77])
    bound(lens, 1)
    assert table[3, 5].item() == 77 and lens.tolist() == [0, 0, 0, 6]
    assert (table[1] == -1).all()


# (not the meta staging: an owned tvm-ffi Tensor argument takes torch's DLPack export, which refuses meta tensors)
@pytest.mark.parametrize(("override", "kind", "arg", "text"), APPEND_ARGUMENT_ERRORS[:3],
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(APPEND_ARGUMENT_ERRORS[:3])])
def test_bind_refuses_what_the_export_refuses(override: dict, kind: type, arg: str, text: str) -> None:
    args = append_args(**override)
    with pytest.raises(kind, match=op_error("canary_token_append_bound", arg, text)):
        load_module("cpu").canary_token_append_bind(args["expected_tokens"], args["valid_lens_by_row"],
                                                    args["staging"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bound_append_refuses_a_stream_tensor_off_the_tables_device() -> None:
    """The stream tensor says which stream the launch goes on: one on another device is refused, nothing written."""
    bound, table, lens, _ = bind_append(append_args(), "cuda")
    with pytest.raises(ValueError, match=op_error("canary_token_append_bound", "stream_tensor",
                                                  "expected a tensor on cuda:0")):
        bound(torch.zeros(1), 2)
    assert (table == -1).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bind_refuses_a_staging_that_is_not_pinned() -> None:
    args = append_args()
    table, lens = args["expected_tokens"].cuda(), args["valid_lens_by_row"].cuda()
    refused = op_error("canary_token_append_bound", "staging", "expected pinned host memory")
    with pytest.raises(ValueError, match=refused):
        load_module("cuda").canary_token_append_bind(table, lens, args["staging"])


def test_the_ring_binds_each_staging_it_makes() -> None:
    """``bind`` makes each staging's ``bound`` from its own buffer, again for a staging replaced by a larger one."""
    made: list[torch.Tensor] = []
    ring = StagingRing(2, pinned=False, event_factory=None, min_values=8, bind=lambda b: made.append(b) or len(made))
    assert [s.bound for s in (ring.acquire(1), ring.acquire(1))] == [1, 2]
    grown = ring.acquire(100)
    assert grown.bound == 3 and made[-1] is grown.buffer and grown.capacity >= 100
    assert StagingRing(1, pinned=False, event_factory=None).acquire(1).bound is None


def test_a_decode_batch_is_staged_in_three_values_a_row() -> None:
    """One token per row (a decode forward): staged for canary_token_append (rows, starts, tokens), not as the
    general header of five values a row and the tokens."""
    table = TokenTable(ROWS, WIDTH, CPU)
    table.update([(5, 10, [50]), (2, 3, [20]), (7, 0, [70])])
    staging = table.staging.acquire(9)  # the CPU ring's one staging, as the launch read it
    assert staging.buffer[:9].tolist() == [5, 2, 7, 10, 3, 0, 50, 20, 70]
    assert table.valid_lens_by_row[[5, 2, 7]].tolist() == [11, 4, 1]


def decode_at_the_width_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    """One token per row, some at or past the width (the append refuses them: the general path clips)."""
    rows = rng.sample(range(ROWS), rng.randint(1, ROWS))
    return [(r, rng.randint(WIDTH - 3, WIDTH + 2), tokens(rng, 1)) for r in rows]


@pytest.mark.parametrize("seed", range(3))
def test_decode_batches_at_the_width_are_clipped_as_before(seed: int) -> None:
    rng = random.Random(200 + seed)
    table, ref = TokenTable(ROWS, WIDTH, CPU), reference_tables(ROWS, WIDTH)
    for _ in range(20):
        batch = rng.choice([decode_batch, decode_at_the_width_batch])(rng)
        table.update(batch)
        reference_update(*ref, batch)
        assert_same(table, ref)


# ---------------------------------------------------------------------------------------------- the staging ring


class FakeEvent:
    """A simulated CUDA event: recorded, then complete when the test says so (or when the host waits on it)."""

    log: list[str] = []

    def __init__(self) -> None:
        self.recorded = 0
        self.done = True
        self.waited = 0
        self.streams: list = []  # the stream of each record (None: the current one)
        self.name = f"e{len([x for x in FakeEvent.log if x.startswith('new')])}"
        FakeEvent.log.append(f"new {self.name}")

    def record(self, stream=None) -> None:
        self.recorded += 1
        self.streams.append(stream)
        self.done = False
        FakeEvent.log.append(f"record {self.name}")

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        FakeEvent.log.append(f"wait {self.name}")
        self.done = True


@pytest.fixture
def fake_events():
    FakeEvent.log = []
    yield FakeEvent
    FakeEvent.log = []


def test_ring_hands_a_staging_out_again_only_after_its_event_completed(fake_events) -> None:
    ring = StagingRing(3, pinned=False, event_factory=fake_events)
    handed: list = []
    for i in range(9):
        staging = ring.acquire(10)
        # whatever the ring hands out is not read by the device any more: its last launch's event is complete
        assert staging.event is not None and staging.event.query()
        staging.buffer[0] = i
        ring.launched(staging)
        handed.append(staging)
        if i % 2:  # the device finishes every other launch by itself; the others are waited for
            staging.event.done = True
    assert [h.buffer.data_ptr() for h in handed[:3]] * 3 == [h.buffer.data_ptr() for h in handed]  # round robin
    assert len({id(h.event) for h in handed}) == 3  # an event per staging, made once
    assert ring.waits == sum(h.event.waited for h in handed[:3]) == 3  # for launches 0, 2 and 4
    assert ring.grows == 0


def test_ring_grows_a_staging_only_after_its_launch_completed(fake_events) -> None:
    ring = StagingRing(2, pinned=False, event_factory=fake_events)
    first = ring.acquire(10)
    ring.launched(first)
    old = weakref.ref(first.buffer)
    event = first.event
    second = ring.acquire(10)
    ring.launched(second)
    del first
    gc.collect()
    assert old() is not None  # pending: the ring still holds it
    grown = ring.acquire(3 * MIN_STAGING_VALUES)  # the first staging's turn, too small
    assert event is not None and event.waited == 1 and event.query()  # waited for before it was replaced
    assert grown.event is event and grown.buffer.numel() == 4 * MIN_STAGING_VALUES
    gc.collect()
    assert old() is None  # dropped once complete
    assert ring.grows == 1 and ring.waits == 1


def test_token_table_with_simulated_events_waits_when_the_device_is_a_ring_behind(fake_events) -> None:
    table = TokenTable(ROWS, WIDTH, CPU, event_factory=fake_events, ring_size=4)
    ref = reference_tables(ROWS, WIDTH)
    rng = random.Random(7)
    for _ in range(10):
        batch = decode_batch(rng)
        table.update(batch)
        reference_update(*ref, batch)
    assert_same(table, ref)
    # No event ever completed by itself. With a record per launch (before EVENT_EVERY) each of launches 4..9 waited
    # for its staging's own event; now a ring of 4 records one event per group of 4 launches (EVENT_EVERY = 4,
    # capped at the ring size), the last staging's (e3), which covers the group: the first staging of the next turn
    # waits for it, and the other three find it complete.
    assert table.staging.size == 4 and table.staging.waits == 2
    assert FakeEvent.log == ["new e0", "new e1", "new e2", "new e3", "record e3", "wait e3", "record e3", "wait e3"]


def test_cpu_table_without_events_reuses_one_staging() -> None:
    table = TokenTable(4, 8, CPU)
    table.update([(1, 0, [1])])
    table.update([(2, 0, [2])])
    assert table.staging.size == 1 and table.staging.waits == 0


def test_ring_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="size must be >= 1, got 0"):
        TokenTable(4, 8, CPU, ring_size=0)
    with pytest.raises(ValueError, match="event_every must be >= 1, got 0"):
        StagingRing(4, pinned=False, event_factory=None, event_every=0)


def test_ring_records_one_event_per_event_every_launches(fake_events) -> None:
    """The per-forward host cost of issue 25: an event record per TOKEN_EVENT_EVERY uploads, not one per upload."""
    # a ring larger than a group: no turn comes while its group is open
    assert TOKEN_EVENT_EVERY == 8 and RING_SIZE == 32
    table = TokenTable(ROWS, WIDTH, CPU, event_factory=fake_events)
    assert table.staging.size == RING_SIZE
    events = [slot.event for slot in table.staging._slots]
    rng = random.Random(11)
    for _ in range(32):
        table.update(decode_batch(rng))
    assert sum(e.recorded for e in events) == 4  # after launches 7, 15, 23 and 31: each group's last staging's
    assert [e.recorded for e in events] == [0] * 7 + [1] + [0] * 7 + [1] + [0] * 7 + [1] + [0] * 7 + [1]
    for e in events:
        e.done = True  # the device caught up
    for _ in range(32):
        table.update(decode_batch(rng))
    assert sum(e.recorded for e in events) == 8 and table.staging.waits == 0


def test_ring_waits_for_the_cover_even_when_the_staging_s_own_event_was_never_recorded(fake_events) -> None:
    """Staging 0's own event is never recorded (its group's last staging's is): a ring that tested staging 0's own
    event would find it complete (never recorded) and hand the staging out while its launch may still be pending."""
    ring = StagingRing(8, pinned=False, event_factory=fake_events, event_every=4)
    first = ring.acquire(10)
    ring.launched(first)
    for _ in range(3):
        ring.launched(ring.acquire(10))
    cover = first.cover
    assert first.event.recorded == 0 and first.event.query()  # its own event: never recorded
    assert cover is not None and cover is not first.event and cover.recorded == 1 and not cover.query()
    for _ in range(4):  # the rest of the ring: not in flight, no wait
        ring.launched(ring.acquire(10))
    assert ring.waits == 0
    again = ring.acquire(10)  # staging 0's turn: its cover reports not complete, so the host waits on it
    assert again is first and cover.waited == 1 and ring.waits == 1 and first.event.waited == 0
    assert not first.in_flight and first.cover is None


def test_ring_records_an_open_group_when_one_of_its_stagings_comes_round(fake_events) -> None:
    """Launches refused between two turns of a staging (acquire without launched) leave its group open when its turn
    comes: the ring then records the group's event at once (the last launch's staging's) and tests that."""
    ring = StagingRing(4, pinned=False, event_factory=fake_events, event_every=4)
    first = ring.acquire(10)
    ring.launched(first)
    second = ring.acquire(10)
    ring.launched(second)
    ring.acquire(10), ring.acquire(10)  # two refused launches: the group of 4 is still open
    assert first.cover is None and second.cover is None and first.in_flight
    assert ring.acquire(10) is first
    assert second.event.recorded == 1 and first.event.recorded == 0  # recorded at the turn, covering both
    assert second.event.waited == 1 and ring.waits == 1
    assert ring.acquire(10) is second and ring.waits == 1  # the same event, now complete: no second wait


def test_ring_reuses_a_staging_whose_cover_completed_without_a_wait(fake_events) -> None:
    ring = StagingRing(8, pinned=False, event_factory=fake_events, event_every=4)
    handed = []
    for _ in range(8):
        staging = ring.acquire(10)
        ring.launched(staging)
        handed.append(staging)
    first_cover, second_cover = handed[0].cover, handed[4].cover
    assert [h.cover for h in handed] == [first_cover] * 4 + [second_cover] * 4
    first_cover.done = True  # the device ran the first group; the second is still pending
    for h in handed[:4]:
        assert ring.acquire(10) is h
    assert ring.waits == 0 and first_cover.waited == 0  # own events never recorded, never waited on either
    assert ring.acquire(10) is handed[4] and ring.waits == 1 and second_cover.waited == 1


def test_ring_grows_a_staging_only_after_its_cover_completed(fake_events) -> None:
    ring = StagingRing(4, pinned=False, event_factory=fake_events, event_every=4)
    first = ring.acquire(10)
    ring.launched(first)
    for _ in range(3):
        ring.launched(ring.acquire(10))
    old, event, cover = weakref.ref(first.buffer), first.event, first.cover
    assert cover is not event and not cover.query()
    del first
    gc.collect()
    assert old() is not None  # pending: the ring still holds it
    grown = ring.acquire(3 * MIN_STAGING_VALUES)
    assert cover.waited == 1 and cover.query()  # waited for before it was replaced
    assert grown.event is event and grown.cover is None and grown.buffer.numel() == 4 * MIN_STAGING_VALUES
    gc.collect()
    assert old() is None  # dropped once complete
    assert ring.grows == 1 and ring.waits == 1
    # an open group's staging, grown: its group is recorded and waited for first
    ring.launched(grown)
    pending = weakref.ref(grown.buffer)
    del grown
    for _ in range(3):
        ring.acquire(10)  # refused launches
    regrown = ring.acquire(9 * MIN_STAGING_VALUES)
    assert event.recorded == 1 and event.waited == 1 and ring.grows == 2 and ring.waits == 2
    assert regrown.buffer.numel() == 16 * MIN_STAGING_VALUES
    gc.collect()
    assert pending() is None


def test_ring_records_a_group_on_its_own_stream_when_the_launches_change_stream(fake_events) -> None:
    """An event covers only its own stream's launches: a launch on another stream than its group's closes the group,
    with a record on the group's stream (the ring's launch_stream reads a launch's stream)."""
    current = ["A"]
    ring = StagingRing(8, pinned=False, event_factory=fake_events, event_every=4, launch_stream=lambda: current[0])
    handed = []
    for stream in ["A", "A", "B", "B", "B", "B", "A", "A"]:
        current[0] = stream
        staging = ring.acquire(10)
        ring.launched(staging)
        handed.append(staging)
    assert handed[1].event.streams == ["A"] and handed[0].cover is handed[1].cover is handed[1].event
    assert handed[5].event.streams == ["B"] and all(h.cover is handed[5].event for h in handed[2:6])
    assert handed[6].cover is None and handed[7].cover is None  # a group on A, still open
    assert [h.event.recorded for h in handed] == [0, 1, 0, 0, 0, 1, 0, 0]
    current[0] = "B"
    assert ring.acquire(10) is handed[0] and handed[1].event.waited == 1 and ring.waits == 1
    assert ring.acquire(10) is handed[1] and ring.waits == 1
    assert ring.acquire(10) is handed[2] and handed[5].event.waited == 1 and ring.waits == 2
    for h in handed[3:6]:
        assert ring.acquire(10) is h  # refused launches (nothing launched on B since)
    # the open group's turn, with B current: its event is recorded on the group's stream, A
    assert ring.acquire(10) is handed[6] and handed[7].event.streams == ["A"] and ring.waits == 3


def test_cuda_staging_event_records_on_the_given_stream_or_the_current_one(monkeypatch) -> None:
    """CudaStagingEvent and launch_stream_of, without a GPU (torch.cuda.Event and the current stream stood in for):
    the ring records a group's event on the stream launch_stream_of read at its launches."""
    recorded = []

    class Event:
        def record(self, stream) -> None:
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(staging_module, "current_stream", lambda index: f"stream of {index}")
    event = CudaStagingEvent(torch.device("cuda", 1))
    event.record()
    event.record("the group's stream")
    CudaStagingEvent(torch.device("cuda")).record()  # no index: the current device's
    assert recorded == ["stream of 1", "the group's stream", "stream of 3"]
    assert launch_stream_of(torch.device("cuda", 1))() == "stream of 1"
    assert launch_stream_of(torch.device("cuda"))() == "stream of 3"


def test_device_events_are_cuda_events_on_the_launch_stream_or_the_ones_given(monkeypatch) -> None:
    """The ring's events every upload takes (token table, writer serials, sweep plan): on CUDA CudaStagingEvents
    recorded on the device's current stream, none on the CPU, and a test's own factory as given (on one stream)."""
    monkeypatch.setattr(torch.cuda, "Event", lambda: "a cuda event")
    monkeypatch.setattr(staging_module, "current_stream", lambda index: f"stream of {index}")
    factory, stream = device_events(torch.device("cuda", 2))
    assert isinstance(factory(), CudaStagingEvent) and stream() == "stream of 2"
    assert device_events(CPU) == (None, None)
    own = object
    assert device_events(torch.device("cuda", 2), own) == (own, None) and device_events(CPU, own) == (own, None)


class SimulatedDevice:
    """Streams that run their launches in order, each at its own pace; events recorded on them (SimulatedEvent)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.queued = {"A": 0, "B": 0}  # launches queued per stream
        self.done = {"A": 0, "B": 0}  # launches run per stream (in order)

    def launch(self, stream: str) -> tuple[str, int]:
        self.queued[stream] += 1
        return stream, self.queued[stream]

    def run_some(self) -> None:
        for stream in self.done:
            self.done[stream] = self.rng.randint(self.done[stream], self.queued[stream])

    def ran(self, launch: tuple[str, int]) -> bool:
        return self.done[launch[0]] >= launch[1]


def test_ring_never_hands_out_a_staging_a_launch_may_still_read() -> None:
    """Random launches on two streams, refused launches, a device at a random pace: whatever the ring hands out was
    last read by a launch the device has run, and no event is recorded while an in-flight staging's test is on it."""
    rng = random.Random(5)
    device = SimulatedDevice(rng)
    current = ["A"]
    records = [0]
    ring: StagingRing

    class SimulatedEvent:
        def __init__(self) -> None:
            self.at: tuple[str, int] | None = None

        def record(self, stream=None) -> None:
            assert stream is not None
            assert not any(s.in_flight and s.cover is self for s in ring._slots)  # no record of it is pending a test
            self.at = (stream, device.queued[stream])
            records[0] += 1

        def query(self) -> bool:
            return self.at is None or device.ran(self.at)

        def synchronize(self) -> None:
            stream, n = self.at
            device.done[stream] = max(device.done[stream], n)

    for size, every in [(16, 4), (4, 4), (3, 4), (5, 2), (1, 1)]:
        ring = StagingRing(size, pinned=False, event_factory=SimulatedEvent, event_every=every,
                           launch_stream=lambda: current[0])
        last_launch: dict[int, tuple[str, int]] = {}
        launches = records[0] = 0
        for _ in range(400):
            if rng.random() < 0.05:
                current[0] = "B" if current[0] == "A" else "A"
            staging = ring.acquire(10)
            assert id(staging) not in last_launch or device.ran(last_launch[id(staging)])
            if rng.random() < 0.1:
                continue  # refused before anything was queued
            last_launch[id(staging)] = device.launch(current[0])
            ring.launched(staging)
            launches += 1
            if rng.random() < 0.3:
                device.run_some()
        assert 0 < ring.waits < launches
        assert records[0] < launches if every > 1 else records[0] == launches


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_uploads_from_pinned_memory_while_the_device_is_busy() -> None:
    dev = torch.device("cuda")
    rows, width = 64, 2048
    table, ref = TokenTable(rows, width, dev), reference_tables(rows, width)
    rng = random.Random(3)
    batches = []
    for step in range(5 * table.staging.size):
        if step % 7 == 0:
            batches.append([(r, 0, tokens(rng, rng.randint(1, 1500))) for r in rng.sample(range(rows), 16)])
        else:
            batches.append([(r, rng.randrange(width), tokens(rng, 1)) for r in range(rows)])
    batches.append([(5, 0, [1, 2, 3]), (5, 1, [9]), (5, 0, list(range(50)))])  # a repeated row: one ordered block
    batches.append([(6, 3, [1]), (7, 0, [5]), (6, 4, [2]), (6, 3, [3])])  # one token each, a row repeated: in order
    for batch in batches:
        for update in batch:  # in order, like the kernel (the same as the whole batch for distinct rows)
            reference_update(*ref, [update])
    # Every staging of the ring grown to the largest batch first: a pinned allocation is one of CUDA's implicit
    # synchronisations, so a staging grown inside the loop below would wait for the queued sleep and the ring would
    # never find a launch pending.
    largest = max(layout.TOKEN_UPDATE_FIELDS * len(batch) + sum(len(t) for _, _, t in batch) for batch in batches)
    for _ in range(table.staging.size):
        table.staging.acquire(largest)
    grown = table.staging.grows
    # Every kernel the loop launches launched once first: under CUDA's lazy module loading (the default) the first
    # launch of a kernel loads it, which synchronises with the device; the H200 run of 2026-12-02 (third session)
    # timed it: the loop's first update waited 1.01 s for the queued sleep, a raw launch of a loaded kernel 19 µs.
    scratch = TokenTable(rows, width, dev)
    scratch.update([(0, 0, [1, 2, 3])])  # canary_token_update_kernel (also the one a repeated row launches)
    scratch.update([(0, 3, [4]), (1, 0, [5])])  # canary_token_append_kernel
    scratch.update([(2, 0, [4]), (2, 1, [5])])  # canary_token_append_ordered_kernel (a row repeated)
    torch.cuda.synchronize()
    # ~4 s of device time queued first: the host issues a ring's worth of batches long before the device reads the
    # first staging, so the ring must come round while its launches are pending (a per-batch sleep raced the host's
    # own pace: the H200 run of 2026-11-30 saw no wait; ~0.5 s did not outlast a ring of 32 under compute-sanitizer,
    # whose host is slow: the H200 gpu_check of 2026-12-03 saw no wait)
    torch.cuda._sleep(8_000_000_000)
    for batch in batches:
        table.update(batch)
    torch.cuda.synchronize()
    assert table.staging.grows == grown  # (nothing allocated while the sleep was queued)
    assert table.staging.waits > 0  # the ring came round while its launches were pending
    assert torch.equal(table.expected_tokens.cpu(), ref[0])
    assert torch.equal(table.valid_lens_by_row.cpu(), ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_refuses_a_staging_that_is_not_pinned() -> None:
    args = op_args()
    args["expected_tokens"] = args["expected_tokens"].cuda()
    args["valid_lens_by_row"] = args["valid_lens_by_row"].cuda()
    with pytest.raises(ValueError, match=arg_error("staging", "expected pinned host memory")):
        canary_token_update(**args)
    with pytest.raises(ValueError, match=arg_error("staging", "expected host memory")):
        canary_token_update(**{**args, "staging": args["staging"].cuda()})
    pinned = args["staging"].pin_memory()  # kept until the launch has run (tolist synchronises)
    canary_token_update(**{**args, "staging": pinned})
    assert args["valid_lens_by_row"].tolist() == [0, 5, 0, 6]
    assert args["expected_tokens"][1].tolist() == [-1, -1, 10, 11, 12, -1, -1, -1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_append_refuses_a_staging_that_is_not_pinned() -> None:
    args = append_args()
    args["expected_tokens"] = args["expected_tokens"].cuda()
    args["valid_lens_by_row"] = args["valid_lens_by_row"].cuda()
    with pytest.raises(ValueError, match=append_error("staging", "expected pinned host memory")):
        canary_token_append(**args)
    pinned = args["staging"].pin_memory()  # kept until the launch has run (tolist synchronises)
    canary_token_append(**{**args, "staging": pinned})
    assert args["valid_lens_by_row"].tolist() == [0, 3, 0, 1]
    assert args["expected_tokens"][1].tolist() == [-1, -1, 10, -1, -1, -1, -1, -1]


def test_the_ring_allocates_its_stagings_before_serving(monkeypatch) -> None:
    """Every staging is allocated when the ring is built: on CUDA a page-locked allocation synchronises with the
    device, so one made on a staging's first use would stall the serving loop (only a larger batch allocates)."""
    ring = StagingRing(3, pinned=False, event_factory=None)
    monkeypatch.setattr(ring, "_new", lambda *a: pytest.fail("a staging allocated after the ring was built"))
    for _ in range(2 * ring.size):
        staging = ring.acquire(MIN_STAGING_VALUES)
        assert staging.capacity == MIN_STAGING_VALUES
        ring.launched(staging)
    assert ring.grows == 0


# ---------------------------------------------------------------------------------------------- the token mail


class _Steps:
    steps = 6


def _open_mail(capacity: int, rows: int = 8, width: int = 16) -> tuple[TokenMail, list[int]]:
    mail = TokenMail(capacity, pinned=False)
    header = [0] * layout.STATE_HEADER_FIELDS  # the status mirror's values: the read cursor at 0
    mail.open(header, _Steps, rows, width)
    return mail, header


def test_mail_posts_records_tagged_with_the_next_forward_and_publishes_their_count() -> None:
    mail, _ = _open_mail(8)
    assert mail.post([1, 5], [3, 0], [42, 1 << 40])
    assert mail.records[:, :2].t().tolist() == [[1, 3, 42, 7], [5, 0, 1 << 40, 7]]  # (a column per field)
    assert mail.published.tolist() == [2] and mail.written == 2 and mail.posted == 1


def test_mail_is_written_again_only_past_the_read_cursor_and_wraps() -> None:
    mail, header = _open_mail(4)
    assert mail.post([1, 2, 3], [0, 0, 0], [10, 20, 30])
    assert not mail.post([4, 5], [0, 0], [40, 50]) and mail.full == 1  # 3 unread + 2 > 4: the caller launches them
    assert mail.published.tolist() == [3]
    header[layout.STATE_TOKEN_MAIL_READ] = 2  # the device read two
    assert mail.post([4, 5], [1, 1], [40, 50])
    assert mail.records.t().tolist() == [[5, 1, 50, 7], [2, 0, 20, 7], [3, 0, 30, 7], [4, 1, 40, 7]]  # 4 at 3, 5 at 0
    assert mail.published.tolist() == [5]


@pytest.mark.parametrize(("rows", "starts"), [([8], [0]), ([-1], [0]), ([1], [16]), ([1], [-1])])
def test_mail_refuses_a_record_outside_the_table(rows: list[int], starts: list[int]) -> None:
    mail, _ = _open_mail(8)
    assert not mail.post(rows, starts, [1]) and mail.written == 0 and mail.published.tolist() == [0]


def test_a_refused_post_leaves_nothing_the_next_post_does_not_rewrite() -> None:
    # rows and starts are packed unsigned: a negative start is refused by its pack after the rows' column was written;
    # nothing was published, and the next post writes the same ring slots again
    mail, _ = _open_mail(8)
    assert not mail.post([3, 4], [2, -1], [10, 20]) and mail.written == 0 and mail.published.tolist() == [0]
    assert not mail.post([3], [2], [1 << 63]) and mail.written == 0  # a token outside int64: refused, not raised
    assert mail.post([5], [1], [30])
    assert mail.records[:, :1].t().tolist() == [[5, 1, 30, 7]] and mail.published.tolist() == [1]


def test_a_closed_mail_takes_nothing() -> None:
    mail = TokenMail(8, pinned=False)
    assert not mail.is_open and not mail.post([1], [0], [1]) and mail.written == 0
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        TokenMail(0, pinned=False)
