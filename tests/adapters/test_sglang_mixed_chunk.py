"""--enable-mixed-chunk on a REAL sglang 0.5.12 (CPU): MIXED forwards (a chunked prefill and the running decodes in one
batch, ``ScheduleBatch.mix_with_running``) verify and write like any other, with nothing reported in raise mode, and a
corruption in a decoding row's prefix is still caught in a MIXED forward."""

from __future__ import annotations

import collections
import importlib.util
import random

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402

from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import CanaryViolationError  # noqa: E402
from kvcanary.sglang import hooks  # noqa: E402


@pytest.fixture
def engine(tmp_path, monkeypatch):
    state = sgl_engine.activate_kvcanary(tmp_path, monkeypatch, {
        "KVCANARY_MODE": "raise", "KVCANARY_VERIFY_TOKENS": "1", "KVCANARY_SWEEP_INTERVAL": "7",
        "SGLANG_PLUGINS": "kvcanary"})
    try:
        sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), chunked_prefill_size=32,
                                    enable_mixed_chunk=True)
        mr = sgl_engine.build_runner(sa)
        tree = sgl_engine.build_tree_cache(mr, sa)
        yield mr, tree, hooks.installation_of(mr)
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()


def _drive(sched, rng, prefix, forwards: int) -> None:
    while len(sched.forwards) < forwards:
        if len(sched.waiting) < 2 and rng.random() < 0.4:
            tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(10, 90))]
            sched.add((prefix if rng.random() < 0.6 else []) + tail, rng.randrange(4, 20))
        if not sched.idle:
            sched.step()


def test_mixed_forwards_are_verified_clean_and_catch_a_corruption(engine) -> None:
    mr, tree, inst = engine
    rng = random.Random(3)
    prefix = [rng.randrange(3, 2000) for _ in range(40)]
    sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=32, mixed=True)
    _drive(sched, rng, prefix, 160)  # raise mode: any violation raises here
    manager = inst.manager
    manager.flush()
    modes = collections.Counter(sched.forwards)
    assert modes["MIXED"] >= 10 and modes["DECODE"] > 0, modes
    assert manager.stats.violations_seen == 0
    assert manager.stats.kernel_runs[LaunchTag.VERIFY] == len(sched.forwards)
    # a decoding row's cached prefix redirected: the next MIXED forward reports it
    while sched.running is None or sched.running.is_empty():
        sched.step()
    req = next(r for r in sched.running.reqs if len(r.origin_input_ids) >= 4)
    r2t = mr.req_to_token_pool.req_to_token
    r2t[req.req_pool_idx, 1] = r2t[req.req_pool_idx, 2]
    sched.add([rng.randrange(3, 2000) for _ in range(60)], 4)  # a prefill to mix with
    with pytest.raises(CanaryViolationError):
        for _ in range(manager.config.drain_every + 2):
            sched.step()
    assert "MIXED" in sched.forwards[-(manager.config.drain_every + 2):]
