"""The token check's uploads (``KVCANARY_VERIFY_TOKENS``): what each request's req_to_token row gained since its
last upload, from sglang's ``Req`` (``req_pool_idx``, ``origin_input_ids``, ``output_ids``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable


def _ref_of(req: object) -> Callable[[], object]:
    """A weak reference to ``req`` (a strong one for objects without weak references, e.g. test doubles).

    Why weak: the mirror must not keep a finished request alive until its row is reused. It did, so the batch hook
    that replaced it freed it (its token lists with it): ~1 us per new 1k-token request of host time in the canary.
    """
    try:
        return weakref.ref(req)
    except TypeError:
        return lambda: req


def expected_token_updates(mirror: dict, reqs) -> list[tuple[int, int, list[int]]]:
    """``(row, start, tokens)`` for what each request's row gained since its last upload (``mirror`` is updated:
    row -> [a weak reference to the request, tokens sent, the last token sent]).

    A row's expected tokens are the request's ``origin_input_ids + output_ids``; a decode row gains one token
    per forward, a chunked prefill none. The whole row is sent again when the row holds another request, or
    when the last token sent no longer matches (the request's tokens were rewritten, e.g. by a retraction).

    Runs once per batch for every request in it (host time of every forward): per-row work only, at most one
    slice per row. A row sent whole from a request without output (a new request's prefill: its whole prompt) sends
    the request's own ``origin_input_ids`` list, not a copy: the caller reads ``tokens`` and never changes or keeps
    them (:meth:`kvcanary.token_table.TokenTable.update` packs them before it returns).
    """
    updates = []
    append = updates.append
    for req in reqs:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            continue
        if row.__class__ is not int:
            row = int(row)
        origin, output = req.origin_input_ids, req.output_ids
        if origin.__class__ is not list:  # sglang keeps lists; anything else is copied once
            origin = list(origin)
        if output.__class__ is not list:
            output = list(output)
        n_origin = len(origin)
        total = n_origin + len(output)
        start = 0
        entry = mirror.get(row)
        same_request = entry is not None and entry[0]() is req
        if same_request:
            sent = entry[1]
            if 0 < sent <= total:
                last = sent - 1
                if (origin[last] if last < n_origin else output[last - n_origin]) == entry[2]:
                    start = sent
        if start == total and entry is not None:
            continue  # nothing new (a chunked prefill, a row whose output lags)
        if start >= n_origin:
            new = output[start - n_origin :]
        elif output:
            new = origin[start:] + output
        else:
            new = origin if start == 0 else origin[start:]  # a new prompt: no copy of ~1k tokens per row
        append((row, start, new))
        if entry is None:
            entry = mirror[row] = [None, 0, None]
        if not same_request:
            entry[0] = _ref_of(req)
        entry[1] = total  # updated in place: a decode row allocates no new entry per forward
        entry[2] = (output[-1] if output else origin[-1]) if total else None
    return updates
