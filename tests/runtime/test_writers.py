"""WriterTable (serials per new request, the ring of request ids) and RowSerialUpload (the device upload)."""

from __future__ import annotations

import re

import pytest
import torch

from kvcanary.runtime import writers
from kvcanary.runtime.serial_upload import RowSerialUpload
from kvcanary.runtime.staging import MIN_STAGING_VALUES
from kvcanary.runtime.writers import WriterTable


def test_writer_ids_wrap_around_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serials index a ring of MAX_WRITER_IDS ids: the last MAX_WRITER_IDS are kept across the wrap, older say None."""
    monkeypatch.setattr(writers, "MAX_WRITER_IDS", 4)
    table = WriterTable(rows=8)
    assert table.assign(range(3), [f"a{r}" for r in range(3)]) == ([0, 1, 2], [1, 2, 3])
    assert table.assign(range(3), [f"b{r}" for r in range(3)]) == ([0, 1, 2], [4, 5, 6])  # wraps: serial 4 at index 0
    assert [table.writer_id(s) for s in range(1, 8)] == [None, None, "a2", "b0", "b1", "b2", None]
    # one call bringing more requests than the ring holds: the last four are kept
    rows, serials = table.assign(range(7), [f"c{r}" for r in range(7)])
    assert rows == list(range(7)) and serials == list(range(7, 14))
    assert [table.writer_id(s) for s in range(6, 14)] == [None, None, None, None, "c3", "c4", "c5", "c6"]


def test_a_bad_row_or_mismatched_columns_assign_nothing() -> None:
    table = WriterTable(rows=4)
    with pytest.raises(ValueError, match=r"row -1 outside \[0, 4\)"):
        table.assign([1, -1], ["a", "b"])  # a negative row is not an index from the end
    with pytest.raises(ValueError, match=r"row 4 outside \[0, 4\)"):
        table.assign([1, 4, 2], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"2 rows but 1 request ids"):
        table.assign([1, 2], ["a"])
    assert table.writer_id(1) is None  # no serial was handed out
    assert table.assign([1], ["a"]) == ([1], [1])  # row 1 was not assigned by the refused calls


def test_row_serial_upload_scatters_and_grows_its_staging() -> None:
    row_serials = torch.full((3 * MIN_STAGING_VALUES,), -1, dtype=torch.int64)
    upload = RowSerialUpload(row_serials)
    upload([2, 0], [7, 8])
    assert row_serials[:3].tolist() == [8, -1, 7]
    upload([], [])  # nothing to do
    rows = list(range(MIN_STAGING_VALUES))  # 2 * rows values: more than a first staging holds
    upload(rows, [r + 100 for r in rows])
    assert torch.equal(row_serials[: len(rows)], torch.arange(100, 100 + len(rows)))
    assert upload.staging.grows == 1
    upload([5, 5], [1, 2])  # a row twice: the later serial (csrc/canary_row_serials.cuh, on CUDA too)
    assert int(row_serials[5]) == 2
    with pytest.raises(ValueError, match="2 rows but 1 serials"):
        upload([1, 2], [3])


def test_row_serial_upload_refuses_a_bad_row_and_writes_nothing() -> None:
    """The rows are checked on the host before the launch (index_put_ raised an IndexError on the CPU, and on CUDA
    failed on the device, after the call)."""
    row_serials = torch.full((4,), -1, dtype=torch.int64)
    upload = RowSerialUpload(row_serials)
    with pytest.raises(ValueError, match=re.escape("canary_row_serial_update: staging: update 1 (row 4): row outside "
                                                   "[0, 4)")):
        upload([0, 4], [7, 8])
    assert row_serials.tolist() == [-1] * 4  # update 0 is not applied either
    upload([3], [9])  # the next upload goes through
    assert row_serials.tolist() == [-1, -1, -1, 9]


def test_row_serial_upload_records_an_event_after_each_copy() -> None:
    recorded: list[int] = []

    class Event:
        def record(self) -> None:
            recorded.append(1)

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    row_serials = torch.zeros(4, dtype=torch.int64)
    upload = RowSerialUpload(row_serials, event_factory=Event)
    for i in range(6):
        upload([i % 4], [i])
    assert len(recorded) == 6 and upload.staging.size > 1 and row_serials.tolist() == [4, 5, 2, 3]
