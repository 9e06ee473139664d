"""RowSerialUpload on CUDA: pinned stagings reused only after the launch that read them in place has run.

The device is kept busy first, so every upload's launch is still queued when the host packs the next ones: a staging
rewritten before its launch ran would hand that launch another upload's rows and serials, and a row would be missing.
Rows repeated in one upload get their later serial (deterministically: the index_put_ this replaced left it undefined).
"""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.serial_upload import RING_SIZE, RowSerialUpload

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uploads_queued_behind_a_busy_device_each_land() -> None:
    uploads = 8 * RING_SIZE
    row_serials = torch.full((uploads,), -1, dtype=torch.int64, device="cuda")
    upload = RowSerialUpload(row_serials)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of every launch below
    for i in range(uploads):
        upload([i], [1000 + i])  # a different row each time: no later upload can mask a lost one
    torch.cuda.synchronize()
    assert row_serials.tolist() == [1000 + i for i in range(uploads)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_repeated_rows_get_their_later_serial_behind_a_busy_device() -> None:
    uploads, rows = 3 * RING_SIZE, 64  # 3 * 64 updates per upload: two chunks of the ordered block
    row_serials = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    upload = RowSerialUpload(row_serials)
    expected = [-1] * rows
    torch.cuda._sleep(200_000_000)  # every upload below is queued, its staging still to be read
    for i in range(uploads):
        batch_rows = [(i + k) % rows for k in range(3 * rows)]  # each row three times, inside and across chunks
        serials = [1000 * i + k for k in range(3 * rows)]
        upload(batch_rows, serials)
        for row, serial in zip(batch_rows, serials, strict=True):
            expected[row] = serial
    torch.cuda.synchronize()
    assert row_serials.tolist() == expected
