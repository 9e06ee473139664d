"""TokenTable.update_columns (the serving loop's columnar uploads) and TokenColumns: columns stage the same table as
the same updates given one tuple at a time, whatever the mix of lengths, clipping and repeated rows; bad columns
raise errors naming the column, with nothing written and no launch; TokenColumns is the sequence of its updates."""

from __future__ import annotations

import random
import re
import struct

import pytest
import torch

from kvcanary.kernels import layout
from kvcanary.runtime.token_table import LONG_UPDATE_TOKENS, TokenColumns, TokenTable

ROWS, WIDTH = 6, 200
CPU = torch.device("cpu")


def applied(updates: list[tuple[int, int, list[int]]], table: list[list[int]], valid: list[int]) -> None:
    for row, start, tokens in updates:
        count = max(0, min(len(tokens), WIDTH - start))
        table[row][start : start + count] = tokens[:count]
        valid[row] = min(start + len(tokens), WIDTH)


def random_batch(rng: random.Random) -> list[tuple[int, int, list[int]]]:
    """Decode-like single tokens, prompts, empty updates, updates past the width, rows repeated."""
    return [(rng.randrange(ROWS), rng.randrange(WIDTH + 5),
             [rng.randrange(-(1 << 40), 1 << 40) for _ in range(rng.choice([0, 1, 1, 1, 2, 31, 32, 90]))])
            for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize("seed", range(4))
def test_columns_stage_what_the_updates_one_by_one_say(seed: int) -> None:
    rng = random.Random(seed)
    by_columns, by_tuples = TokenTable(ROWS, WIDTH, CPU), TokenTable(ROWS, WIDTH, CPU)
    ref_tokens, ref_valid = by_columns.expected_tokens.tolist(), [0] * ROWS
    for _ in range(30):
        batch = random_batch(rng)
        columns = TokenColumns.of(batch)
        by_columns.update_columns(list(columns.rows), list(columns.starts), list(columns.counts),
                                  columns.token_runs)
        by_tuples.update(batch)
        applied(batch, ref_tokens, ref_valid)
        # the int64 -> int32 conversion of the kernel: the low 32 bits
        ref32 = [[(v + (1 << 31)) % (1 << 32) - (1 << 31) for v in row] for row in ref_tokens]
        for table in (by_columns, by_tuples):
            assert table.expected_tokens.tolist() == ref32 and table.valid_lens_by_row.tolist() == ref_valid


@pytest.mark.parametrize(("columns", "message"), [
    (([1, 4], [0, 0], [1, 1], [[5, 6]]), "row 4 outside [0, 4): rows[1]"),
    (([-1], [0], [1], [[5]]), "row -1 outside [0, 4): rows[0]"),
    (([2, 1], [0, -1], [1, 1], [[5], [6]]), "start -1 < 0 (row 1): starts[1]"),
    (([2, 1, 3], [0, 0, 0], [2, 1, -1], [[5, 6, 7]]), "count -1 < 0 (row 3): counts[2]"),
    (([2, 1], [0, 0], [2, 2], [[5, 6, 7]]), "token_runs hold 3 tokens, counts add up to 4"),
    (([2, 1], [0, 0], [2, 2], [[5, 6], [7]]), "token_runs hold 3 tokens, counts add up to 4"),
    (([2, 1], [0, 0], [1, 1], [[5, 6], [7]]), "token_runs hold 3 tokens, counts add up to 2"),
    (([2, 1], [0, 7], [2, 2], [[5, 6, 7]]), "token_runs hold 3 tokens, counts add up to 4"),  # clipped: the same
    (([2, 1], [0], [2, 2], [[5, 6, 7, 8]]), "rows, starts and counts have 2, 1 and 2 values"),
    (([], [], [], [[5]]), "token_runs hold 1 tokens, counts add up to 0"),
])
def test_column_errors_name_the_column_and_write_nothing(columns: tuple, message: str) -> None:
    table = TokenTable(4, 8, CPU, event_factory=RecordedEvent, ring_size=2)
    table.update_columns([1], [0], [2], [[1, 2]])
    before = (table.expected_tokens.clone(), table.valid_lens_by_row.clone())
    with pytest.raises(ValueError, match=re.escape(f"CanaryManager.update_expected_tokens: {message}")):
        table.update_columns(*columns)
    assert torch.equal(table.expected_tokens, before[0]) and torch.equal(table.valid_lens_by_row, before[1])
    # The refused call launched nothing: no staging it was handed is in flight. The ring records one event per group
    # of launches (here min(EVENT_EVERY, ring size) = 2), so the first update's launch is a group of 1, still open,
    # and unrecorded unless the refused call's tries came round to its staging (a one-token-per-row batch refused by
    # the append path is staged again by the general one): that turn records the open group's event. Had a refused
    # staging counted as launched, it would have closed the group of 2 with a record and be in flight.
    first, second = table.staging._slots
    assert not second.in_flight and RecordedEvent.records == (0 if first.in_flight else 1)


class RecordedEvent:
    """An event the device has completed at once; counts the records (one per group of launches that read a
    staging)."""

    records = 0

    def record(self, stream=None) -> None:
        RecordedEvent.records += 1

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_records():
    RecordedEvent.records = 0


def test_token_columns_are_the_sequence_of_their_updates() -> None:
    prompt = list(range(100, 100 + LONG_UPDATE_TOKENS))
    updates = [(3, 10, [7, 8]), (1, 0, []), (3, 12, (9,)), (2, 0, prompt), (0, 5, [1, 2, 3])]
    columns = TokenColumns.of(updates)
    assert (columns.rows, columns.starts, columns.counts) == ((3, 1, 3, 2, 0), (10, 0, 12, 0, 5), (2, 0, 1, 32, 3))
    assert columns.token_runs == [[7, 8, 9], prompt, [1, 2, 3]] and columns.token_runs[1] is prompt  # not copied
    assert columns.tokens == [7, 8, 9, *prompt, 1, 2, 3]
    as_lists = [(r, s, list(t)) for r, s, t in updates]
    assert len(columns) == 5 and list(columns) == as_lists and columns == as_lists and columns != as_lists[:3]
    assert columns[2] == (3, 12, [9]) and columns[-1] == (0, 5, [1, 2, 3]) and columns[1:3] == as_lists[1:3]
    with pytest.raises(IndexError):
        columns[5]
    assert TokenColumns.of(updates[:3]).token_runs == [[7, 8, 9]]  # short updates only: one run
    assert TokenColumns.of([]) == [] and not TokenColumns.of([])
    table, ref = TokenTable(ROWS, WIDTH, CPU), TokenTable(ROWS, WIDTH, CPU)
    table.update(columns)  # staged as they are
    ref.update(as_lists)
    assert torch.equal(table.expected_tokens, ref.expected_tokens)
    assert torch.equal(table.valid_lens_by_row, ref.valid_lens_by_row)


def test_a_refusal_that_is_not_about_the_columns_keeps_its_error() -> None:
    """Columns that are fine but cannot be packed (a token that is not an int): the pack's error, nothing written."""
    table = TokenTable(4, 8, CPU)
    with pytest.raises(struct.error):
        table.update_columns([1], [0], [1], [["x"]])
    assert int(table.valid_lens_by_row[1]) == 0 and int(table.expected_tokens[1, 0]) == layout.NO_EXPECTED_TOKEN
