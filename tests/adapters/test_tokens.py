"""expected_token_updates: the mirror of what each row was sent holds no request alive; the updates come as
columns (a decode row: one token appended to each column); the whole row again after a retraction rewrote what was
sent; every batch equals the per-row rule it replaced (kept below as the reference); the table the columns build
holds each row's request tokens."""

from __future__ import annotations

import gc
import random
import weakref

import torch

from kvcanary.runtime.token_table import TokenColumns, TokenTable
from kvcanary.sglang.tokens import expected_token_updates


class Req:
    """sglang's Req: the fields the token check reads (a plain class, so weak references work as on sglang's)."""

    def __init__(self, row: int | None, origin: list[int], output: list[int]) -> None:
        self.req_pool_idx, self.origin_input_ids, self.output_ids = row, origin, output


def test_the_mirror_does_not_keep_a_finished_request_alive() -> None:
    mirror: dict = {}
    req = Req(1, [5, 6, 7], [])
    (update,) = expected_token_updates(mirror, [req])
    assert update == (1, 0, [5, 6, 7])
    req.output_ids.append(8)
    assert expected_token_updates(mirror, [req]) == [(1, 3, [8])]  # the same request: only what it gained
    finished = weakref.ref(req)
    del req, update
    gc.collect()
    assert finished() is None  # the old mirror held the request until row 1 got another one
    # row 1's next request, whatever its tokens: the whole row again
    assert expected_token_updates(mirror, [Req(1, [5, 6, 7, 8], [])]) == [(1, 0, [5, 6, 7, 8])]


def test_rows_of_new_and_empty_requests() -> None:
    mirror: dict = {}
    assert expected_token_updates(mirror, [Req(2, [], [])]) == [(2, 0, [])]  # a row seen first: its length, 0
    assert expected_token_updates(mirror, [Req(2, [4], [5])]) == [(2, 0, [4, 5])]
    assert expected_token_updates(mirror, [Req(2, [], [])]) == []  # an empty request on a used row: nothing to send
    req = Req(3, [1, 2], [])
    assert expected_token_updates(mirror, [req, req]) == [(3, 0, [1, 2])]  # twice in a batch: sent once


def test_updates_come_as_columns() -> None:
    """A prefill row sends its prompt, decode rows one token each, a chunked prefill and a row-less request
    nothing: rows, starts, counts and the tokens back to back, in batch order."""
    mirror: dict = {}
    a, b, chunked = Req(1, [10, 11], [12]), Req(2, [20], [21, 22]), Req(4, [40, 41, 42], [])
    expected_token_updates(mirror, [a, b, chunked])
    a.output_ids.append(13)
    b.output_ids.append(23)
    new = Req(3, [30, 31, 32], [])
    columns = expected_token_updates(mirror, [a, new, b, chunked, Req(None, [1], [])])
    assert isinstance(columns, TokenColumns)
    assert (columns.rows, columns.starts, columns.counts) == ([1, 3, 2], [3, 0, 3], [1, 3, 1])
    assert columns.token_runs == [[13, 30, 31, 32, 23]]  # short updates: one run
    assert mirror[1][1:] == [4, 13] and mirror[2][1:] == [4, 23] and mirror[3][1:] == [3, 32]


def test_a_retracted_row_is_sent_whole_again() -> None:
    """The decode fast path takes a row only while the token before the new one is the last one sent: a
    retraction (output rolled back and decoded again) that leaves the row one token longer than sent, but with
    another token where the last sent one was, re-sends the whole row; so does another request in the row with
    the same tokens, and a row that got shorter."""
    mirror: dict = {}
    req = Req(5, [1, 2, 3], [4, 5])
    expected_token_updates(mirror, [req])
    req.output_ids.append(6)
    assert expected_token_updates(mirror, [req]) == [(5, 5, [6])]  # decode: one token
    del req.output_ids[-2:]  # retracted back to [4], then decoded again: [4, 7, 8] (6 tokens, one more than sent)
    req.output_ids += [7, 8]
    assert expected_token_updates(mirror, [req]) == [(5, 0, [1, 2, 3, 4, 7, 8])]
    req.output_ids.append(9)
    assert expected_token_updates(mirror, [req]) == [(5, 6, [9])]  # and decodes one token per forward again
    twin = Req(5, [1, 2, 3], [4, 7, 8, 9, 10])  # another request in the row, the same tokens and one more
    assert expected_token_updates(mirror, [twin]) == [(5, 0, [1, 2, 3, 4, 7, 8, 9, 10])]
    del twin.output_ids[-3:]
    assert expected_token_updates(mirror, [twin]) == [(5, 0, [1, 2, 3, 4, 7])]  # shorter than sent


def test_rows_that_are_not_ints() -> None:
    """A row index that is a tensor (no dict hit: the general path converts it) sends the same as an int."""
    mirror: dict = {}
    req = Req(torch.tensor(2), [1, 2], [3])
    assert expected_token_updates(mirror, [req]) == [(2, 0, [1, 2, 3])]
    req.output_ids.append(4)
    assert expected_token_updates(mirror, [req]) == [(2, 3, [4])]
    assert list(mirror) == [2] and type(list(mirror)[0]) is int


# ---------------------------------------------------------------------------------------------- the old code

def reference_updates(mirror: dict, reqs) -> list[tuple[int, int, list[int]]]:
    """expected_token_updates before the columns (one tuple per row, one rule for every row)."""
    updates = []
    for req in reqs:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        row = int(row)
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        total = len(tokens)
        start = 0
        entry = mirror.get(row)
        same_request = entry is not None and entry[0]() is req
        if same_request and 0 < entry[1] <= total and tokens[entry[1] - 1] == entry[2]:
            start = entry[1]
        if start == total and entry is not None:
            continue
        updates.append((row, start, tokens[start:]))
        mirror[row] = [weakref.ref(req), total, tokens[-1] if total else None]
    return updates


def test_batches_equal_the_per_row_rule() -> None:
    """Random serving: decode steps, retractions (rolled back and decoded again), finished requests replaced by new
    ones (sometimes with the same tokens), chunked prefills, rows repeated in a batch; every batch's updates equal
    the old per-row code's, and a table fed the columns holds the tokens of every request in the batch."""
    rng = random.Random(3)
    rows, width = 12, 400
    reqs = {r: Req(r, [rng.randrange(50) for _ in range(rng.randint(1, 40))], []) for r in range(rows)}
    mirror: dict = {}
    ref_mirror: dict = {}
    table = TokenTable(rows, width, torch.device("cpu"))
    for _ in range(300):
        for r, req in reqs.items():
            roll = rng.random()
            if roll < 0.6:
                req.output_ids.append(rng.randrange(50))  # decode
            elif roll < 0.7 and req.output_ids:
                del req.output_ids[rng.randrange(len(req.output_ids)):]  # retraction, then decoded again
                req.output_ids += [rng.randrange(50) for _ in range(rng.randint(0, 3))]
            elif roll < 0.78:  # finished: a new request in the row (now and then the same tokens)
                tokens = req.origin_input_ids + req.output_ids if rng.random() < 0.3 else [
                    rng.randrange(50) for _ in range(rng.randint(1, 40))]
                reqs[r] = Req(r, tokens, [])
            # else: a chunked prefill or a lagging row, nothing new
        batch = rng.sample(list(reqs.values()), rng.randint(1, rows))
        batch += rng.sample(batch, min(len(batch), rng.randint(0, 2)))  # a request twice in a batch
        columns = expected_token_updates(mirror, batch)
        assert columns == reference_updates(ref_mirror, batch)
        table.update(columns)
        for req in batch:  # every request of the batch: its tokens, as far as its length
            tokens = req.origin_input_ids + req.output_ids
            assert int(table.valid_lens_by_row[req.req_pool_idx]) == len(tokens)
            assert table.expected_tokens[req.req_pool_idx, : len(tokens)].tolist() == tokens
