"""Writer serials (kvcanary+): which request a ``req_to_token`` row holds, and serial → request id.

The write kernel stamps every record's slot with the writer serial of the row it writes for (``row_serials[row]``
on the device, see :mod:`kvcanary.device_state`); a violation on that slot later reads the serial back. This
module is the host side: a row gets a new serial whenever it gets a new request, and the table remembers serial →
``str(request_id)`` for the last :data:`MAX_WRITER_IDS` requests, so a violation names the request that last wrote
its slot (``writer_rid``). Pure host logic: the caller uploads the changed serials.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

MAX_WRITER_IDS = 1 << 16  # request ids kept for writer attribution (serial -> rid), oldest dropped first


class WriterTable:
    """Writer serials of the ``rows`` rows of one ``req_to_token`` table (serials start at 1; 0 and below: none)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._row_requests: dict[int, str] = {}  # the request id each row holds
        self._writer_ids: OrderedDict[int, str] = OrderedDict()  # serial -> request id, oldest first
        self._next_serial = 1

    def assign(self, requests: Iterable[tuple[int, object]]) -> tuple[list[int], list[int]]:
        """For each ``(row, request_id)``: the row now holds that request. Returns the rows whose request changed and
        their new serials (empty lists when none did: a row that keeps its request costs one dict lookup).

        Raises ``ValueError`` for a row outside ``[0, rows)``; the rows before it in ``requests`` are assigned.
        """
        rows: list[int] = []
        serials: list[int] = []
        row_requests, writer_ids, limit = self._row_requests, self._writer_ids, self.rows
        try:
            for row, request_id in requests:  # (a prefill batch's new requests: the batch hook's per-row cost)
                rid = request_id if type(request_id) is str else str(request_id)
                if row_requests.get(row) == rid:
                    continue
                if not 0 <= row < limit:
                    raise ValueError(f"CanaryManager.assign_requests: row {row} outside [0, {limit})")
                serial = self._next_serial
                self._next_serial = serial + 1
                row_requests[row] = rid
                writer_ids[serial] = rid
                rows.append(row)
                serials.append(serial)
        finally:  # the oldest ids go once per call, also when a bad row stopped it
            while len(writer_ids) > MAX_WRITER_IDS:
                writer_ids.popitem(last=False)
        return rows, serials

    def writer_id(self, serial: int) -> str | None:
        """The request id of a writer serial (None: unknown, or older than the last MAX_WRITER_IDS requests)."""
        return self._writer_ids.get(serial) if serial > 0 else None
