"""Exact steps, request rows and writer attribution on CUDA with decode forwards replayed from a CUDA graph
(the CPU twin is tests/runtime/test_manager_attribution.py; same manager code paths, plus the graph).

The rig prefills 16 requests in one eager forward (step 1), captures one decode forward (two warm-up runs that
call before_forward without a step(), then the capture), and calls ``mark_init_finished`` after the capture, as
sglang does. Replays count forwards on the device: a K byte flipped before replay k is reported with step=k,
k+1, k+2 (the forwards that verified it) although the host reads violations only every 8 steps, and no replay
synchronises.
"""

from __future__ import annotations

import pytest
import torch

from kvcanary.runtime.config import Config
from kvcanary.settings import Mode
from kvcanary.sim.workload import DecodeRig, RigShape

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BATCH, CONTEXT = 16, 200
VICTIM_ROW = 3  # req_to_token row (request index VICTIM_ROW - 1 in the rig's tables)


def _rig(**config: object) -> DecodeRig:
    cfg = Config(mode=Mode.LOG, stats_every=0, **{"drain_every": 8, **config})  # type: ignore[arg-type]
    rig = DecodeRig(RigShape(BATCH, CONTEXT, 120), cfg, "cuda")
    mgr = rig.manager
    assert mgr is not None
    mgr.assign_requests(range(1, BATCH + 1), [f"req-{row}" for row in range(1, BATCH + 1)])
    rig.prefill()  # one eager EXTEND forward: step 1
    assert mgr.steps == 1
    rig.prepare_decode()  # capture's warm-up runs write the first decode slots; the first replay rewrites them
    rig.step_index -= 1
    rig.capture()
    mgr.mark_init_finished()  # warm-up and capture are over: replays count from the host's step
    return rig


def _slot(rig: DecodeRig, position: int) -> torch.Tensor:
    return rig.slot_table[position, VICTIM_ROW - 1 : VICTIM_ROW].to(torch.int64)


@pytest.mark.parametrize("position", [10, CONTEXT - 1])
def test_replayed_forwards_report_the_step_that_found_it_and_who_wrote_the_slot(position: int) -> None:
    """Position 10 was written by the prefill (step 1); position CONTEXT-1 by the first replay (step 2)."""
    rig = _rig(sweep_interval=4)
    mgr = rig.manager
    assert mgr is not None
    slots = rig.slot_table[:20, VICTIM_ROW - 1].to(torch.int64).contiguous()
    prevs = torch.cat([torch.full((1,), -1, dtype=torch.int64, device="cuda"), slots[:-1]])
    positions = torch.arange(20, dtype=torch.int64, device="cuda")
    mgr.set_sweep_source(lambda: (slots, prevs, positions))
    for _ in range(6):
        rig.decode_step()  # steps 2..7
    mgr.flush()
    assert mgr.violations == []
    slot = _slot(rig, position)
    first = mgr.steps + 1
    torch.cuda.set_sync_debug_mode("error")
    try:
        rig.kv[slot, 0:1] ^= 0xFF  # device op, before forward `first`
        for _ in range(3):
            rig.decode_step()  # forwards first .. first + 2 verify the flipped slot
        rig.kv[slot, 0:1] ^= 0xFF
        for _ in range(9):
            rig.decode_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mgr.flush()
    victim = int(slot[0])
    written = 1 if position < CONTEXT - 1 else 2
    verify = [v for v in mgr.violations if v.tag_name == "verify"]
    assert [(v.step, v.slot, v.reasons) for v in verify] == [
        (k, victim, ("verify_real_kv_hash",)) for k in range(first, first + 3)
    ]
    attributed = {(v.request_row, v.written_step, v.writer_rid) for v in verify}
    assert attributed == {(VICTIM_ROW, written, f"req-{VICTIM_ROW}")}
    swept = [v for v in mgr.violations if v.tag_name == "sweep"]
    if position < 20:  # the sweep source covers positions 0..19: sweeps at steps that are multiples of 4
        assert [(v.step, v.request_row, v.written_step) for v in swept] == [
            (k, None, written) for k in range(first, first + 3) if k % 4 == 0
        ]
    else:
        assert swept == []


def test_attribution_table_after_replays() -> None:
    """Each replayed forward stores its step and the writer serial of every slot it writes."""
    rig = _rig()
    mgr = rig.manager
    assert mgr is not None
    for _ in range(5):
        rig.decode_step()  # steps 2..6 write positions CONTEXT-1 .. CONTEXT+3
    torch.cuda.synchronize()
    serials = mgr.row_serials.cpu()
    for k in range(5):
        written = rig.slot_table[CONTEXT - 1 + k].to(torch.int64)
        table = mgr.slot_attribution[written].cpu()
        assert table[:, 0].tolist() == [2 + k] * BATCH
        assert table[:, 1].tolist() == serials[1 : BATCH + 1].tolist()
