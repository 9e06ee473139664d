"""kvcanary.kernels.layout mirrors include/kvcanary/layout.h: compared with the compiled export."""

from __future__ import annotations

from kvcanary.kernels import layout
from kvcanary.kernels.jit import load_module


def test_python_layout_equals_exported_constants() -> None:
    exported = {str(k): int(v) for k, v in load_module("cpu").canary_layout_constants().items()}
    mirrored = layout.exported_names()
    assert exported == mirrored


def test_reason_names_decode_every_bit() -> None:
    assert layout.reason_names(layout.REASON_VERIFY_CHAIN_HASH | layout.REASON_VERIFY_REAL_KV_HASH) == [
        "verify_chain_hash",
        "verify_real_kv_hash",
    ]
    assert layout.reason_names(layout.REASON_SLOT_OUT_OF_RANGE) == ["slot_out_of_range"]
    assert layout.reason_names(1 << 9) == ["bit9"]
    assert layout.reason_names(0) == []


def test_launch_tags_and_state_header_agree_with_the_python_names() -> None:
    """The kernels stamp and count by these values; kvcanary.kernels.tags names them for the host."""
    from kvcanary.kernels.tags import NUM_LAUNCH_TAGS, LaunchTag

    assert (LaunchTag.VERIFY, LaunchTag.WRITE, LaunchTag.SWEEP) == (
        layout.LAUNCH_TAG_VERIFY, layout.LAUNCH_TAG_WRITE, layout.LAUNCH_TAG_SWEEP)
    assert NUM_LAUNCH_TAGS == layout.NUM_LAUNCH_TAGS
    header = [layout.STATE_WRITE_INDEX, layout.STATE_RING_LOST_AT_RESET,
              *range(layout.STATE_KERNEL_RUNS, layout.STATE_KERNEL_RUNS + layout.NUM_LAUNCH_TAGS),
              *range(layout.STATE_SLOT_RUNS, layout.STATE_SLOT_RUNS + layout.NUM_LAUNCH_TAGS),
              layout.STATE_RING_EPOCH, layout.STATE_FORWARD, layout.STATE_DRAINED_TO, layout.STATE_DONE_BLOCKS,
              layout.STATE_ARRIVALS, layout.STATE_REUSE_GATE, layout.STATE_RING_REUSED_AT]
    assert len(set(header)) == len(header) and max(header) < layout.STATE_HEADER_FIELDS  # disjoint, in the header
