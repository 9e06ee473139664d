"""RowSerialUpload on CUDA: pinned stagings reused only after the copy that read them has run.

The device is kept busy first, so every upload's copy is still queued when the host packs the next ones: a staging
rewritten before its copy ran would hand that copy another upload's rows and serials, and a row would be missing.
"""

from __future__ import annotations

import pytest
import torch

from kvcanary.serial_upload import RING_SIZE, RowSerialUpload

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uploads_queued_behind_a_busy_device_each_land() -> None:
    uploads = 8 * RING_SIZE
    row_serials = torch.full((uploads,), -1, dtype=torch.int64, device="cuda")
    upload = RowSerialUpload(row_serials)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of every copy below
    for i in range(uploads):
        upload([i], [1000 + i])  # a different row each time: no later upload can mask a lost one
    torch.cuda.synchronize()
    assert row_serials.tolist() == [1000 + i for i in range(uploads)]
