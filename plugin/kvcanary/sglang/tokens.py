"""The token check's uploads (``KVCANARY_VERIFY_TOKENS``): what each request's req_to_token row gained since its
last upload, from sglang's ``Req`` (``req_pool_idx``, ``origin_input_ids``, ``output_ids``)."""

from __future__ import annotations


def expected_token_updates(mirror: dict, reqs) -> list[tuple[int, int, list[int]]]:
    """``(row, start, tokens)`` for what each request's row gained since its last upload (``mirror`` is updated).

    A row's expected tokens are the request's ``origin_input_ids + output_ids``; a decode row gains one token
    per forward, a chunked prefill none. The whole row is sent again when the row holds another request, or
    when the last token sent no longer matches (the request's tokens were rewritten, e.g. by a retraction).

    Runs once per batch for every request in it (host time of every forward): one slice per row, no other copy
    (``tokens`` are new lists, never the request's own).
    """
    updates = []
    for req in reqs:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        row = int(row)
        origin, output = req.origin_input_ids, req.output_ids
        if origin.__class__ is not list:  # sglang keeps lists; anything else is copied once
            origin = list(origin)
        if output.__class__ is not list:
            output = list(output)
        n_origin = len(origin)
        total = n_origin + len(output)
        start = 0
        prev = mirror.get(row)
        if prev is not None and prev[0] is req:
            sent = prev[1]
            if 0 < sent <= total:
                last = sent - 1
                if (origin[last] if last < n_origin else output[last - n_origin]) == prev[2]:
                    start = sent
        if start == total and prev is not None:
            continue  # nothing new (a chunked prefill, a row whose output lags)
        if start >= n_origin:
            new = output[start - n_origin :]
        else:
            new = origin[start:] + output if output else origin[start:]
        updates.append((row, start, new))
        last_token = (output[-1] if output else origin[-1]) if total else None
        mirror[row] = (req, total, last_token)
    return updates
