"""The token check's mailbox on CUDA (issue 25): decode batches' appends posted to pinned host memory and applied by
the next check launch's last block, in chunks of kCheckMailChunk records, leave the table the CPU build leaves."""

from __future__ import annotations

import pytest
import torch

from kvcanary.kernels import layout
from kvcanary.sim.engine import SimConfig, build_sim

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(device: str, steps: int) -> tuple:
    # up to 96 requests at once: a decode batch's mail crosses the last block's 64-record chunks
    sim = build_sim(SimConfig(seed=7, num_pages=8192, max_running=96, max_waiting=64, p_arrival=1.0,
                              prompt_len=(2, 40), max_new=(20, 60), token_mail=True), mode="log", sweep_interval=0,
                    device=device)
    sim.run(steps)
    mgr = sim.mgr
    mgr.flush()
    table = mgr.token_table
    assert table is not None
    read = int(mgr.device_state.state[layout.STATE_TOKEN_MAIL_READ])
    return (table.expected_tokens.cpu(), table.valid_lens_by_row.cpu(), table.mail, read, list(mgr.violations),
            sim.stats["forward_decode"])


def test_the_mail_on_cuda_leaves_the_table_the_cpu_build_leaves() -> None:
    cpu = _run("cpu", 150)
    cuda = _run("cuda", 150)
    tokens, lens, mail, read, violations, decodes = cuda
    assert violations == [] and cpu[4] == []
    assert decodes > 0 and mail.posted > 0
    assert max(mail.records[layout.TOKEN_MAIL_FIELD_ROW].tolist()) > 0
    assert mail.written > 64 * 2 and read == mail.written  # every record applied, the last by the last forward
    assert torch.equal(tokens, cpu[0]) and torch.equal(lens, cpu[1])
    assert cpu[2].written == mail.written and cpu[3] == read
