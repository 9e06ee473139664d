"""The token check's uploads (``KVCANARY_VERIFY_TOKENS``): what each request's req_to_token row gained since its
last upload, from sglang's ``Req`` (``req_pool_idx``, ``origin_input_ids``, ``output_ids``), kept per runner in a
:data:`TokenMirror` (the runner's ``RunnerState.token_mirror``, :mod:`kvcanary.sglang.installed`)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence

from kvcanary.runtime import host_ext
from kvcanary.runtime.host_ext import DecodeFill
from kvcanary.runtime.token_table import TokenColumns, TokenRuns

logger = logging.getLogger(__name__)

# The token check's state of one runner: per req_to_token row, [a weak reference to the request, tokens uploaded, the
# last token uploaded], so a forward uploads only what each row appended since. A plain dict (and a list per row,
# updated in place): the batch hook reads it once per request of every batch.
TokenMirror = dict[int, list]

# What the host extension's fill_decode reads of a request: its req_to_token row, and the two lists whose
# concatenation is the row's expected tokens (a decode row's new token is the last of the second)
DECODE_NAMES = ("req_pool_idx", "origin_input_ids", "output_ids")


def decode_fill() -> DecodeFill | None:
    """The host extension's ``fill_decode`` (:mod:`kvcanary.runtime.host_ext`): a decode batch's rule of
    :func:`expected_token_columns` and its mail post in one C call, with :data:`DECODE_NAMES`. None where it cannot
    be built or loaded (logged, with why): the batch hook then takes the Python path, the same rule at ~2 launch
    units more host time per decode forward."""
    try:
        return host_ext.decode_fill()
    except host_ext.HostExtError as exc:
        logger.warning("kvcanary: the token check's decode batches take the Python path (more host time per "
                       "forward, the same checks): the host extension is not available: %s", exc)
        return None


def _ref_of(req: object) -> Callable[[], object]:
    """A weak reference to ``req`` (a strong one for objects without weak references, e.g. test doubles).

    Why weak: the mirror must not keep a finished request alive until its row is reused. It did, so the batch hook
    that replaced it freed it (its token lists with it): ~1 us per new 1k-token request of host time in the canary.
    """
    try:
        return weakref.ref(req)
    except TypeError:
        return lambda: req


def expected_token_updates(mirror: TokenMirror, reqs) -> TokenColumns:
    """What each request's row gained since its last upload, as :class:`~kvcanary.runtime.token_table.TokenColumns` (its
    updates are ``(row, start, tokens)``; ``mirror`` is updated: row -> [a weak reference to the request, tokens sent,
    the last token sent]): :func:`expected_token_columns`' columns."""
    return TokenColumns(*expected_token_columns(mirror, reqs))


def expected_token_columns(mirror: TokenMirror, reqs) -> tuple[list[int], list[int], list[int], list[Sequence[int]]]:
    """What each request's row gained since its last upload, as the columns of
    :class:`~kvcanary.runtime.token_table.TokenColumns` (rows, starts, counts, token runs: the arguments of
    :meth:`~kvcanary.runtime.token_table.TokenTable.update_columns`, which the batch hook calls with no TokenColumns
    built); ``mirror`` is updated: row -> [a weak reference to the request, tokens sent, the last token sent].

    A row's expected tokens are the request's ``origin_input_ids + output_ids``; a decode row gains one token
    per forward, a chunked prefill none. The whole row is sent again when the row holds another request, or
    when the last token sent no longer matches (the request's tokens were rewritten, e.g. by a retraction).

    Runs once per batch for every request in it (host time of every forward). A decode row (the same request, one
    token more than sent, the token before it the last one sent) takes a few reads and appends to the columns;
    every other row takes :func:`_row_update`, which applies the same rule in full. The tokens always come from the
    request's own lists, never from the batch's input tensors (which the KV records are written from).
    """
    rows: list[int] = []
    starts: list[int] = []
    # The tokens back to back: a decode row's one token goes straight into the current run; a TokenRuns is made at
    # the first update that is not (a decode batch makes none: two calls fewer per forward)
    run: list[int] = []
    runs = None
    not_one = []  # (column index, count) of the updates that are not one token (all are, in a decode batch)
    # (method calls written out, not bound once: CPython 3.11+ specialises a direct list.append / dict.get call, which
    # a bound method stored in a local misses: ~10 % of this loop on 3.12, the H200 engine's Python)
    for req in reqs:
        try:
            row = req.req_pool_idx
            entry = mirror.get(row)  # None for a row seen first, and for a row that is not an int
            if entry is not None:
                sent_by, sent, last = entry
                output = req.output_ids
                total = len(req.origin_input_ids) + len(output)
                # one token more than sent, the one before it (output[-2]) the last one sent, the same request
                if total == sent + 1 and output[-2] == last and sent_by() is req:
                    token = output[-1]
                    rows.append(row)
                    starts.append(sent)
                    run.append(token)
                    entry[1] = total  # updated in place: a decode row allocates no new entry per forward
                    entry[2] = token
                    continue
        except (AttributeError, IndexError):  # no row attribute; an output of one token (output[-2] raised)
            pass
        update = _row_update(mirror, req)
        if update is None:
            continue
        row, start, new = update
        not_one.append((len(rows), len(new)))
        rows.append(row)
        starts.append(start)
        if runs is None:
            runs = TokenRuns(run)
        runs.add(new)  # (a prompt: a run of its own, the request's own list, packed as it is, not copied)
        run = runs.run
    counts = [1] * len(rows)
    for index, count in not_one:
        counts[index] = count
    return rows, starts, counts, [run] if runs is None else runs.done()


def _row_update(mirror: TokenMirror, req) -> tuple[int, int, list[int]] | None:
    """``(row, start, tokens)`` of what ``req``'s row gained since its last upload, None for nothing (the rule of
    :func:`expected_token_updates` for any request; ``mirror`` is updated). Slices at most once; a new prompt (a
    row sent whole from a request without output) is the request's own ``origin_input_ids`` list, not a copy: the
    columns hold it as a run of its own, staged before the request changes, never changed or kept."""
    row = getattr(req, "req_pool_idx", None)
    if row is None:
        return None
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
        return None  # nothing new (a chunked prefill, a row whose output lags)
    if start >= n_origin:
        new = output[start - n_origin :]
    elif output:
        new = origin[start:] + output
    else:
        new = origin if start == 0 else origin[start:]  # a new prompt: no copy of ~1k tokens per row here
    if entry is None:
        entry = mirror[row] = [None, 0, None]
    if not same_request:
        entry[0] = _ref_of(req)
    entry[1] = total
    entry[2] = (output[-1] if output else origin[-1]) if total else None
    return row, start, new
