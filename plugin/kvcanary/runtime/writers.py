"""Writer serials (kvcanary+): which request a ``req_to_token`` row holds, and serial → request id.

The write kernel stamps every record's slot with the writer serial of the row it writes for (``row_serials[row]``
on the device, see :mod:`kvcanary.runtime.device_state`); a violation on that slot later reads the serial back. This
module is the host side: a row gets a new serial whenever it gets a new request, and the table remembers serial →
``str(request_id)`` for the last :data:`MAX_WRITER_IDS` requests, so a violation names the request that last wrote
its slot (``writer_rid``). Pure host logic: the caller uploads the changed serials.

Host cost: :meth:`WriterTable.assign` runs in every prefill's batch hook, once per new request, so a row costs a few
list operations and no dict churn: the rows' requests are a list indexed by row, and serials (handed out
consecutively) index a ring of request ids, so dropping the oldest id is free (it is overwritten).
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_WRITER_IDS = 1 << 16  # request ids kept for writer attribution (serial -> rid), oldest dropped first
# A flag in a slot's writer serial (host-side meaning only: the kernels copy serials as they are): the slot was last
# filled by a load-back from a host KV tier (kvcanary.runtime.host_tier), with the record its first writer wrote.
# Serials count from 1 and never reach bit 62.
LOADED_FROM_HOST_TIER = 1 << 62


def loaded_from_host_tier(serial: int) -> bool:
    """Whether a slot's writer serial carries :data:`LOADED_FROM_HOST_TIER` (unknown serials, < 0, never do)."""
    return serial > 0 and bool(serial & LOADED_FROM_HOST_TIER)


class WriterTable:
    """Writer serials of the ``rows`` rows of one ``req_to_token`` table (serials start at 1; 0 and below: none)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._row_requests: list[str | None] = [None] * rows  # the request id each row holds
        # serial s -> its request id at s % len: the last MAX_WRITER_IDS serials (as set now) are kept
        self._writer_ids: list[str | None] = [None] * MAX_WRITER_IDS
        self._next_serial = 1

    def assign(self, rows: Sequence[int], request_ids: Sequence[object]) -> tuple[list[int], list[int]]:
        """Row ``rows[i]`` now holds request ``request_ids[i]`` (``str()`` of it is kept). Returns the rows whose
        request changed and their new serials (empty lists when none did: a row that keeps its request costs one
        list lookup).

        Columns, not pairs: the batch hook takes both from the batch's requests by ``map(attrgetter(...))`` in C,
        with no tuple per row. Raises ``ValueError`` for columns of different lengths or a row outside
        ``[0, rows)``, before anything is assigned: a caller that uploads what changed never leaves the device
        behind the table.
        """
        limit = self.rows
        if len(request_ids) != len(rows):
            raise ValueError(f"CanaryManager.assign_requests: {len(rows)} rows but {len(request_ids)} request ids")
        if rows and not (0 <= min(rows) and max(rows) < limit):  # (two C calls, no per-row compare in the loop)
            bad = next(r for r in rows if not 0 <= r < limit)
            raise ValueError(f"CanaryManager.assign_requests: row {bad} outside [0, {limit})")
        changed: list[int] = []
        rids: list[str] = []
        row_requests = self._row_requests
        for row, request_id in zip(rows, request_ids, strict=True):  # (per new request of a prefill batch)
            rid = request_id if request_id.__class__ is str else str(request_id)
            if row_requests[row] != rid:
                row_requests[row] = rid
                changed.append(row)
                rids.append(rid)
        return changed, self._remember(rids)

    def _remember(self, rids: list[str]) -> list[int]:
        """Hand out the next ``len(rids)`` serials, remembering each one's request id (two slice stores at most)."""
        first = self._next_serial
        self._next_serial = first + len(rids)
        ring = self._writer_ids
        size = len(ring)
        for chunk_begin in range(0, len(rids), size):  # one chunk unless a call brings more than the ring holds
            chunk = rids[chunk_begin : chunk_begin + size]
            begin = (first + chunk_begin) % size
            split = min(len(chunk), size - begin)
            ring[begin : begin + split] = chunk[:split]
            ring[: len(chunk) - split] = chunk[split:]
        return list(range(first, self._next_serial))

    def writer_id(self, serial: int) -> str | None:
        """The request id of a writer serial (None: unknown, or older than the last MAX_WRITER_IDS requests); a serial
        that carries :data:`LOADED_FROM_HOST_TIER` names the request that first wrote the slot."""
        if serial > 0:
            serial &= ~LOADED_FROM_HOST_TIER
        ring = self._writer_ids
        kept = min(MAX_WRITER_IDS, len(ring))
        if not 0 < serial < self._next_serial or serial < self._next_serial - kept:
            return None
        return ring[serial % len(ring)]
