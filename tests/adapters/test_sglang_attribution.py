"""Issue 11 on a REAL sglang 0.5.12 ModelRunner on CPU (default KVCANARY_DRAIN_EVERY=8): every verify violation
names the forward that found it (the injector corrupts live state right before forward ``step + 1`` of its
``kvcanary.injection/1`` record, and that forward's verify reports it), the request row, and who last wrote the
slot (``written_step`` at or before the detection, ``writer_rid`` the id of a request the engine ran: the adapter
hands each row's request id to the managers when the batch is built)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)

import sgl_engine  # noqa: E402
from test_sglang_faults import _run  # noqa: E402


@pytest.mark.parametrize("fault", ["real_kv_flip", "req_to_token_redirect"])
def test_violations_name_the_detecting_forward_the_row_and_the_writer(tmp_path, monkeypatch, fault: str) -> None:
    runner, rows, _ = _run(tmp_path, monkeypatch, fault, sgl_engine.free_port())
    injected_before: dict[int, set[int]] = {}  # slot -> forwards (1-based) the injections preceded
    for r in rows:
        if r["schema"] == "kvcanary.injection/1":
            for slot in r["slots"]:
                injected_before.setdefault(slot, set()).add(r["step"] + 1)
    verify = [r for r in rows if r["schema"] == "kvcanary.violation/1" and r["tag"] == "verify"]
    assert len(verify) >= 8
    assert runner.inst.manager.config.drain_every == 8
    for v in verify:
        assert v["step"] in injected_before[v["slot"]], v  # the forward that found it, not the drain step
        assert isinstance(v["request_row"], int) and v["request_row"] > 0, v
        assert isinstance(v["written_step"], int) and 1 <= v["written_step"] <= v["step"], v
        assert isinstance(v["writer_rid"], str) and v["writer_rid"], v
