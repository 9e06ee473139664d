"""canary_row_serial_update (csrc/canary_row_serials.cuh): the writer serials' upload, against a Python reference.

* Random batches (distinct rows, repeated rows) equal the reference applied in batch order: a repeated row ends
  with its later serial.
* No updates writes nothing; a bad row raises a ValueError naming the update and the row, and nothing is written
  (not even the updates before it); argument errors name the argument.
* GPU (skipped without CUDA): the pinned staging read in place, a staging that is not pinned refused, repeated rows
  across the ordered block's chunks, a batch past the grid's block cap (grid-stride).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

import pytest
import torch

from kvcanary.kernels.row_serials import canary_row_serial_update

ROWS = 40
UNSET = -7


def reference(row_serials: list[int], rows: Sequence[int], serials: Sequence[int]) -> list[int]:
    """``row_serials[rows[u]] = serials[u]`` for each update in batch order (the later update of a row wins)."""
    out = list(row_serials)
    for row, serial in zip(rows, serials, strict=True):
        out[row] = serial
    return out


def stage(rows: Sequence[int], serials: Sequence[int], extra: int = 0, pinned: bool = False) -> torch.Tensor:
    """The staging RowSerialUpload packs: the rows, then the serials (``extra`` spare values after them)."""
    staging = torch.tensor([*rows, *serials] + [0] * extra, dtype=torch.int64)
    return staging.pin_memory() if pinned else staging


def random_batch(rng: random.Random, rows: int, repeats: bool) -> tuple[list[int], list[int]]:
    m = rng.randint(1, 3 * rows if repeats else rows)
    batch_rows = [rng.randrange(rows) for _ in range(m)] if repeats else rng.sample(range(rows), m)
    serials = [rng.randrange(-(1 << 62), 1 << 62) if rng.random() < 0.1 else rng.randrange(1 << 20) for _ in range(m)]
    return batch_rows, serials


@pytest.mark.parametrize("repeats", [False, True], ids=["distinct", "repeated"])
@pytest.mark.parametrize("seed", range(4))
def test_random_batches_equal_the_reference(seed: int, repeats: bool) -> None:
    rng = random.Random(seed)
    row_serials = torch.full((ROWS,), UNSET, dtype=torch.int64)
    expected = row_serials.tolist()
    for _ in range(30):
        rows, serials = random_batch(rng, ROWS, repeats)
        canary_row_serial_update(row_serials=row_serials, staging=stage(rows, serials, extra=rng.randint(0, 3)),
                                     num_updates=len(rows))
        expected = reference(expected, rows, serials)
        assert row_serials.tolist() == expected


def test_a_repeated_row_gets_its_later_serial() -> None:
    row_serials = torch.full((4,), UNSET, dtype=torch.int64)
    canary_row_serial_update(row_serials=row_serials, staging=stage([1, 3, 1, 1], [10, 11, 12, 13]),
                                 num_updates=4)
    assert row_serials.tolist() == [UNSET, 13, UNSET, 11]


def test_no_updates_write_nothing() -> None:
    row_serials = torch.full((4,), UNSET, dtype=torch.int64)
    canary_row_serial_update(row_serials=row_serials, staging=torch.zeros(0, dtype=torch.int64), num_updates=0)
    canary_row_serial_update(row_serials=row_serials, staging=stage([1], [5]), num_updates=0)
    assert row_serials.tolist() == [UNSET] * 4


def arg_error(arg: str, text: str) -> str:
    return "^" + re.escape(f"canary_row_serial_update: {arg}: {text}")


@pytest.mark.parametrize(("rows", "text"), [
    ([0, 1, 4], "update 2 (row 4): row outside [0, 4)"),
    ([2, -1, 3], "update 1 (row -1): row outside [0, 4)"),
    ([1 << 40], "update 0 (row 1099511627776): row outside [0, 4)"),
])
def test_a_bad_row_names_the_update_and_writes_nothing(rows: list[int], text: str) -> None:
    row_serials = torch.full((4,), UNSET, dtype=torch.int64)
    with pytest.raises(ValueError, match=arg_error("staging", text)):
        canary_row_serial_update(row_serials=row_serials, staging=stage(rows, [9] * len(rows)),
                                     num_updates=len(rows))
    assert row_serials.tolist() == [UNSET] * 4  # the good updates before the bad one are not applied either


def op_args(**overrides):
    args = dict(row_serials=torch.full((4,), UNSET, dtype=torch.int64), staging=stage([1, 2], [5, 6]), num_updates=2)
    args.update(overrides)
    return args


ARGUMENT_ERRORS = [
    ({"row_serials": torch.zeros(4, dtype=torch.int32)}, TypeError, "row_serials", "expected dtype int64"),
    ({"row_serials": torch.zeros((2, 2), dtype=torch.int64)}, ValueError, "row_serials", "expected a 1-d tensor"),
    ({"row_serials": None}, TypeError, "row_serials", "expected a torch.Tensor, got None"),
    ({"staging": torch.zeros(4, dtype=torch.int32)}, TypeError, "staging", "expected dtype int64"),
    ({"staging": torch.zeros((2, 2), dtype=torch.int64)}, ValueError, "staging", "expected a 1-d tensor"),
    ({"staging": torch.zeros(4, dtype=torch.int64, device="meta")}, ValueError, "staging", "expected a cpu or cuda"),
    ({"staging": [1, 2, 5, 6]}, TypeError, "staging", "expected a torch.Tensor, got list"),
    ({"num_updates": -1}, ValueError, "num_updates", "must be in [0, 2^31), got -1"),
    ({"num_updates": 3}, ValueError, "num_updates", "expected 2 * num_updates = 6 <= staging length 4"),
    ({"num_updates": "2"}, TypeError, "num_updates", "expected an int, got str"),
]


@pytest.mark.parametrize(("override", "kind", "arg", "text"), ARGUMENT_ERRORS,
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(ARGUMENT_ERRORS)])
def test_argument_errors_name_the_argument(override: dict, kind: type, arg: str, text: str) -> None:
    args = op_args(**override)
    before = args["row_serials"].clone() if isinstance(args["row_serials"], torch.Tensor) else None
    with pytest.raises(kind, match=arg_error(arg, text)):
        canary_row_serial_update(**args)
    assert before is None or torch.equal(args["row_serials"], before)


# ---------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_refuses_a_staging_that_is_not_pinned() -> None:
    args = op_args(row_serials=torch.full((4,), UNSET, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=arg_error("staging", "expected pinned host memory")):
        canary_row_serial_update(**args)
    with pytest.raises(ValueError, match=arg_error("staging", "expected host memory")):
        canary_row_serial_update(**{**args, "staging": args["staging"].cuda()})
    assert args["row_serials"].tolist() == [UNSET] * 4
    pinned = args["staging"].pin_memory()  # kept until the launch has run (tolist synchronises)
    canary_row_serial_update(**{**args, "staging": pinned})
    assert args["row_serials"].tolist() == [UNSET, 5, 6, UNSET]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("rows", "m"), [(50, 1000), (3, 129), (4096, 4096)],
                         ids=["repeats-across-chunks", "one-row-past-a-chunk", "distinct"])
def test_cuda_batches_equal_the_reference(rows: int, m: int) -> None:
    """Repeated rows run in the ordered block, kRowSerialThreads updates per chunk: a row repeated inside a chunk and
    across chunks ends with its last serial; distinct rows run a thread per update."""
    rng = random.Random(rows * m)
    batch_rows = [rng.randrange(rows) for _ in range(m)] if m > rows else rng.sample(range(rows), m)
    serials = list(range(1000, 1000 + m))
    row_serials = torch.full((rows,), UNSET, dtype=torch.int64, device="cuda")
    staging = stage(batch_rows, serials, pinned=True)
    for _ in range(3):  # deterministic: every launch leaves the same winner
        canary_row_serial_update(row_serials=row_serials, staging=staging, num_updates=m)
        assert row_serials.tolist() == reference([UNSET] * rows, batch_rows, serials)


@pytest.mark.gpu
@needs_cuda
def test_cuda_batch_past_the_block_cap_is_grid_strided() -> None:
    m = 128 * 1024 + 300  # more updates than kRowSerialMaxBlocks blocks of kRowSerialThreads threads cover at once
    batch_rows = list(range(m))
    random.Random(5).shuffle(batch_rows)
    row_serials = torch.full((m,), UNSET, dtype=torch.int64, device="cuda")
    staging = stage(batch_rows, [r + 7 for r in batch_rows], pinned=True)  # kept until the launch has run
    canary_row_serial_update(row_serials=row_serials, staging=staging, num_updates=m)
    assert torch.equal(row_serials.cpu(), torch.arange(7, m + 7))
