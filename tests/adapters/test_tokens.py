"""expected_token_updates: the mirror of what each row was sent holds no request alive; a new prompt is sent as is."""

from __future__ import annotations

import gc
import weakref

from kvcanary.sglang.tokens import expected_token_updates


class Req:
    """sglang's Req: the fields the token check reads (a plain class, so weak references work as on sglang's)."""

    def __init__(self, row: int, origin: list[int], output: list[int]) -> None:
        self.req_pool_idx, self.origin_input_ids, self.output_ids = row, origin, output


def test_the_mirror_does_not_keep_a_finished_request_alive() -> None:
    mirror: dict = {}
    req = Req(1, [5, 6, 7], [])
    (update,) = expected_token_updates(mirror, [req])
    assert update == (1, 0, [5, 6, 7]) and update[2] is req.origin_input_ids  # the prompt itself, no copy
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
