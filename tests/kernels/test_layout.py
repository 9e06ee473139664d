"""kvcanary.layout mirrors include/kvcanary/layout.h: compared with the compiled export."""

from __future__ import annotations

from kvcanary import layout
from kvcanary.jit import load_module


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
