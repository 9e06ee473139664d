"""TokenTable.update's staging packing: long updates (a prompt) get a pack call each, runs of short ones share one;
the table ends as the updates applied one by one say, whatever the mix and order."""

from __future__ import annotations

import random

import torch

from kvcanary.token_table import LONG_UPDATE_TOKENS, TokenTable

ROWS, WIDTH = 6, 200
NO_TOKEN = int(torch.iinfo(torch.int32).min)


def applied(updates: list[tuple[int, int, list[int]]], table: list[list[int]], valid: list[int]) -> None:
    for row, start, tokens in updates:
        count = max(0, min(len(tokens), WIDTH - start))
        table[row][start : start + count] = tokens[:count]
        valid[row] = min(start + len(tokens), WIDTH)


def test_runs_of_short_updates_between_long_ones() -> None:
    long, short = LONG_UPDATE_TOKENS, LONG_UPDATE_TOKENS - 1
    table = TokenTable(ROWS, WIDTH, torch.device("cpu"))
    ref_tokens = table.expected_tokens.tolist()
    ref_valid = [0] * ROWS
    rng = random.Random(5)
    for pattern in ([short, long, 1, 1, long, 0, 2], [long, long], [1, long], [long, 1, 1, 3], [0, long, 0]):
        batch = [(rng.randrange(ROWS), rng.randrange(WIDTH - 10), [rng.randrange(1 << 31) for _ in range(n)])
                 for n in pattern]
        table.update(batch)
        applied(batch, ref_tokens, ref_valid)
        assert table.expected_tokens.tolist() == ref_tokens and table.valid_lens_by_row.tolist() == ref_valid
