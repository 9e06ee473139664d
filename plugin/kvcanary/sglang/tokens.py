"""The token check's uploads (``KVCANARY_VERIFY_TOKENS``): what each request's req_to_token row gained since its
last upload, from sglang's ``Req`` (``req_pool_idx``, ``origin_input_ids``, ``output_ids``)."""

from __future__ import annotations


def expected_token_updates(mirror: dict, reqs) -> list[tuple[int, int, list[int]]]:
    """``(row, start, tokens)`` for what each request's row gained since its last upload (``mirror`` is updated).

    A row's expected tokens are the request's ``origin_input_ids + output_ids``; a decode row gains one token
    per forward, a chunked prefill none. The whole row is sent again when the row holds another request, or
    when the last token sent no longer matches (the request's tokens were rewritten, e.g. by a retraction).
    """
    updates = []
    for req in reqs:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        row = int(row)
        origin, output = req.origin_input_ids, req.output_ids
        n_origin = len(origin)
        total = n_origin + len(output)
        start = 0
        prev = mirror.get(row)
        if prev is not None and prev[0] is req and 0 < prev[1] <= total:
            last = prev[1] - 1
            if (origin[last] if last < n_origin else output[last - n_origin]) == prev[2]:
                start = prev[1]
        if start == total and prev is not None:
            continue
        new = list(output[start - n_origin :]) if start >= n_origin else list(origin[start:]) + list(output)
        updates.append((row, start, new))
        mirror[row] = (req, total, (origin[total - 1] if total <= n_origin else output[-1]) if total else None)
    return updates
