"""End to end in a REAL sglang 0.5.12 ModelRunner on CPU, kvcanary activated through its entry point.

KVCANARY_MODE=raise, CPU kernels, >= 200 forwards through ScheduleBatch -> ForwardBatch -> ModelRunner.forward:
requests sharing a prefix matched through the RadixCache, chunked extend, decode, finished requests whose
req_to_token rows and KV slots later requests reuse, page_size 1 and 16. Then a req_to_token redirect and a
K-byte flip on a live slot are each reported with the expected reason.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import random
import textwrap

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install --no-deps -r requirements-sglang-cpu.txt)",
                allow_module_level=True)
import hooks_state  # noqa: E402
import sgl_engine  # noqa: E402
import sglang  # noqa: E402,F401  (installed but broken must fail, not skip)

from kvcanary.kernels import layout  # noqa: E402
from kvcanary.kernels.tags import LaunchTag  # noqa: E402
from kvcanary.report import CanaryViolationError  # noqa: E402
from kvcanary.runtime import faults  # noqa: E402
from kvcanary.sglang import hooks, radix, radix_index, v0_5_12  # noqa: E402

FORWARDS = 210
SWEEP_INTERVAL = 7



@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def engine(request, tmp_path, monkeypatch):
    import sglang.srt.plugins as plugins

    page_size = request.param
    hooks_state.clear_kvcanary_env(monkeypatch)
    monkeypatch.setenv("KVCANARY_MODE", "raise")
    monkeypatch.setenv("KVCANARY_VERIFY_TOKENS", "1")
    monkeypatch.setenv("KVCANARY_SWEEP_INTERVAL", str(SWEEP_INTERVAL))
    monkeypatch.setenv("SGLANG_PLUGINS", "kvcanary")
    sgl_engine.ensure_entry_point(tmp_path, monkeypatch)
    state = hooks_state.snapshot(hooks_state.all_targets())
    hooks_state.restore(state)
    plugins.load_plugins()  # discovers kvcanary through the entry point, registers and applies its hooks
    try:
        for t in v0_5_12.TARGETS:
            assert hooks_state.is_patched(t.dotted), t.dotted
        sa = sgl_engine.server_args(sgl_engine.write_model_dir(tmp_path / "tiny-llama"), page_size=page_size,
                                    chunked_prefill_size=48)
        mr = sgl_engine.build_runner(sa)
        tree = sgl_engine.build_tree_cache(mr, sa)
        inst = hooks.installation_of(mr)
        assert inst is not None and inst.manager.has_sweep_source()
        yield types_ns(mr=mr, tree=tree, inst=inst, page_size=page_size)
    finally:
        hooks_state.restore(state)
        sgl_engine.destroy_distributed()


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


def _drive(sched, rng, prefix, forwards: int) -> None:
    while len(sched.forwards) < forwards:
        if len(sched.waiting) < 2 and rng.random() < 0.3:
            tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 70))]
            sched.add((prefix if rng.random() < 0.7 else []) + tail, rng.randrange(3, 15))
        if not sched.idle:
            sched.step()


def _live_row(sched, min_prefix: int):
    for req in sched.running.reqs:
        n = len(req.origin_input_ids) + len(req.output_ids) - 1  # tokens already in the KV cache before the next decode
        if req.req_pool_idx and n >= min_prefix:
            return req, n
    raise AssertionError("no running request long enough")


def _steps_until_raise(sched, manager) -> None:
    """The forward that finds a violation plus ``drain_every`` more (the manager reads the device status every
    ``drain_every`` forwards, from a snapshot taken one forward earlier): the violation must be raised by then."""
    for _ in range(manager.config.drain_every + 1):
        sched.step()


def test_real_engine_clean_run_then_detections(engine, capsys, monkeypatch) -> None:
    mr, tree, inst = engine.mr, engine.tree, engine.inst
    rng = random.Random(engine.page_size)
    prefix = [rng.randrange(3, 2000) for _ in range(40)]
    sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=48)
    manager = inst.manager
    # The RadixCache's incremental sweep source was primed when after_init_cache set it: its first walk is start-up
    # work, not a serving forward's (on the H200 the first sweep cost one forward ~16 ms of host time)
    source = manager.sweeper.source
    assert isinstance(source, radix_index.RadixSweepIndex) and source.walk_reasons["first"] == source.walks == 1
    general = collections.Counter()  # forwards the wrapper's general path launched (a BatchView each)
    real_before = manager.before_forward
    monkeypatch.setattr(manager, "before_forward",
                        lambda view, **kw: (general.update([view.kind]), real_before(view, **kw))[1])
    _drive(sched, rng, prefix, FORWARDS)
    # the eager hot path launched every real forward but the first of each forward mode (a mode met for the first
    # time goes through the general path, which names an unsupported one)
    assert inst.to_arrays is not None and sum(general.values()) == len(set(sched.forwards)), general
    manager.flush()
    assert source.walk_reasons["first"] == 1  # (the priming's: no sweep walked for lack of one)
    st = manager.stats
    modes = collections.Counter(sched.forwards)
    n = len(sched.forwards)
    kr, sr = st.kernel_runs, st.slot_runs
    summary = textwrap.dedent(f"""
        page_size={engine.page_size} forwards={n} modes={dict(modes)} prefix_tokens_from_radix={sched.cached_tokens}
        finished={len(sched.finished)} reused_req_rows={len(sched.reused_rows)} violations={st.violations_seen}
        kernel_runs verify={kr[LaunchTag.VERIFY]} write={kr[LaunchTag.WRITE]} sweep={kr[LaunchTag.SWEEP]}
        slot_runs verified={sr[LaunchTag.VERIFY]} written={sr[LaunchTag.WRITE]} swept={sr[LaunchTag.SWEEP]}
        """)
    with capsys.disabled():
        print(summary)
    assert n >= 200 and modes["EXTEND"] > 0 and modes["DECODE"] > 0
    assert sched.cached_tokens > 0  # shared prefixes were matched through the RadixCache
    assert sched.chunked_steps > 0  # chunked extend happened
    assert len(sched.finished) > 10 and sched.reused_rows  # finished requests' rows were reused
    assert st.violations_seen == 0 and manager.violations == []
    # a plain runner's decode batches post their appends to the token mail, which the next check launch applied:
    # the device's read cursor is every record posted (none lost, none refused for want of room)
    table = manager.token_table
    assert table is not None and table.mail is not None and table.mail.posted > 0 and table.mail.full == 0
    assert int(manager.device_state.state[layout.STATE_TOKEN_MAIL_READ]) == table.mail.written
    # --disable-cuda-graph: every forward deferred its write into the next forward's check launch (issue 25)
    assert inst.defer_writes and manager.defer_writes and manager.pending_write == -1  # (flush launched the last)
    assert st.forwards == n == inst.steps
    # every forward planned+verified+written
    assert st.kernel_runs[LaunchTag.VERIFY] == n and st.kernel_runs[LaunchTag.WRITE] == n
    assert st.kernel_runs[LaunchTag.SWEEP] == n // SWEEP_INTERVAL and st.slot_runs[LaunchTag.SWEEP] > 0
    assert st.slot_runs[LaunchTag.VERIFY] > 0 and st.slot_runs[LaunchTag.WRITE] >= sum(
        len(r.origin_input_ids) for r in sched.finished) - sched.cached_tokens

    # 1. req_to_token redirect: point a live (row, position) of a running request at another live slot.
    sched.waiting.clear()
    while sched.chunked_req is not None or not sched.running or sched.running.is_empty():
        sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
        sched.step()
    req, cached = _live_row(sched, 4)
    r2t = mr.req_to_token_pool.req_to_token
    row, pos = req.req_pool_idx, 1
    original = int(r2t[row, pos])
    other = int(r2t[row, 2])
    inj = faults.redirect_req_to_token(r2t, row, pos, other)
    with pytest.raises(CanaryViolationError) as exc:
        _steps_until_raise(sched, manager)
    reasons = {name for v in exc.value.violations for name in v.reasons}
    with capsys.disabled():
        print("redirect:", inj.detail, "->", exc.value.violations[0].log_line())
    assert "verify_chain_hash" in reasons, exc.value
    assert any(v.slot in inj.slots for v in exc.value.violations)
    r2t[row, pos] = original
    sgl_engine.abort_running(sched)

    # 2. K-byte flip on a live slot (layer-0 K, inside the PARTIAL window).
    while sched.chunked_req is not None or not sched.running or sched.running.is_empty():
        sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
        sched.step()
    req, cached = _live_row(sched, 4)
    slot = int(r2t[req.req_pool_idx, 2])
    k_source = inst.groups[0].spec.sources[0]
    assert k_source.tensor.data_ptr() == mr.token_to_kv_pool.k_buffer[0].data_ptr()
    # The last forward (the prefill of position 2) may have deferred its write (--disable-cuda-graph: issue 25), which
    # fingerprints the K/V when it runs: launched first, as the fault layer does before it injects.
    assert manager.defer_writes
    inst.flush_pending_writes()
    inj = faults.flip_real_kv(k_source, slot, byte=3)
    before = manager.stats.slot_runs
    with pytest.raises(CanaryViolationError) as exc:
        _steps_until_raise(sched, manager)
        raise AssertionError(f"{inj} not detected: {manager.config.describe()} real_kv_mode={manager.real_kv_mode} "
                             f"slot_runs {before} -> {manager.stats.slot_runs} violations={manager.violations[-3:]} "
                             f"byte now {int(k_source.kv_bytes[slot, 3]):#x} last forward {sched.forwards[-1]} "
                             f"row={req.req_pool_idx} r2t={r2t[req.req_pool_idx, :6].tolist()}")
    with capsys.disabled():
        print("flip:", inj.detail, "->", exc.value.violations[0].log_line())
    assert {v.slot for v in exc.value.violations} == {slot}
    assert all(v.reasons == ("verify_real_kv_hash",) for v in exc.value.violations)


def test_radix_sweep_source_never_reads_slots_on_the_host(engine, monkeypatch) -> None:
    """The sweep gathers the RadixCache's slots where sglang keeps them (the KV device): reading a node's value on
    the host is a device sync per node on a GPU. Same entries as a host walk of the tree, no host reads."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, 2000) for _ in range(40)]
    sched = sgl_engine.MiniScheduler(engine.mr, engine.tree, chunk_size=48)
    _drive(sched, rng, prefix, 60)
    expected = []  # (slot, prev, position) by a plain host walk
    stack = [(engine.tree.root_node, 0, -1)]
    while stack:
        node, depth, prev = stack.pop()
        for child in list(node.children.values()):
            if child.value is None:
                continue
            values = [int(x) for x in child.value.tolist()]
            for i, slot in enumerate(values):
                expected.append((slot, values[i - 1] if i else prev, depth + i))
            stack.append((child, depth + len(values), values[-1] if values else prev))
    source = radix.radix_sweep_source(engine.tree)

    def no_host_read(*args, **kwargs):
        raise AssertionError("the sweep source read a tensor on the host")

    with monkeypatch.context() as m:
        for name in ("tolist", "item", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, no_host_read)
        slots, prevs, positions = source()
    assert slots.dtype == prevs.dtype == positions.dtype == torch.int64
    got = sorted(zip(slots.tolist(), prevs.tolist(), positions.tolist(), strict=True))
    assert len(expected) > 100 and got == sorted(expected)


def test_sweep_reads_node_values_after_the_scheduler_stream_and_holds_them(engine, monkeypatch) -> None:
    """Regression (issue 11, tp=2 false positives; issue 28, decode TTFT): the RadixCache's node values live on
    sglang's scheduler stream, which frees and reuses them. The sweep's plan update reads them through
    ``update_after_producer`` with the scheduler's ``schedule_stream``: after that stream's queued work, holding every
    node value it gathers until it has run, and without making the scheduler stream wait for the forward stream.
    The races are reproduced on a GPU by tests/gpu/test_sweep_streams.py."""
    rng = random.Random(5)
    sched = sgl_engine.MiniScheduler(engine.mr, engine.tree, chunk_size=48)
    _drive(sched, rng, [rng.randrange(3, 2000) for _ in range(40)], 20)
    seen = []

    def on_producer(producer, update, reads):
        seen.append(producer)
        held = {id(t) for t in reads}
        gathered = []
        real_cat = torch.cat

        def cat(tensors, *args, **kwargs):  # every gather of node values happens inside update()
            gathered.extend(tensors)
            return real_cat(tensors, *args, **kwargs)

        with monkeypatch.context() as m:
            m.setattr(torch, "cat", cat)
            update()
        assert gathered, "the sweep source gathered nothing inside update()"
        # every node value the gather read is one the call holds (sglang's node values are int64: read as they are)
        assert all(id(t) in held for t in gathered)

    stream = object()
    monkeypatch.setattr(radix_index, "update_after_producer", on_producer)
    monkeypatch.setattr(torch.cuda, "Stream", object)  # so the scheduler's (fake) stream counts as a CUDA stream
    class Scheduler:  # the two attributes after_init_cache reads (SimpleNamespace cannot be weakly referenced)
        tree_cache = engine.tree
        req_to_token_pool = engine.mr.req_to_token_pool

    scheduler = Scheduler()
    hooks.hooks_for(v0_5_12).after_init_cache(None, scheduler)
    inst = hooks.installation_of(engine.mr)
    source = inst.manager.sweeper.source
    first = source()
    assert seen == [None]  # the event loop has not started: no scheduler stream yet
    assert source() is first and seen == [None]  # an unchanged tree: the same plan, nothing read
    scheduler.schedule_stream = stream  # created when the event loop starts (after the cache)
    _drive(sched, rng, [rng.randrange(3, 2000) for _ in range(4)], len(sched.forwards) + 30)  # new nodes: read
    source()
    assert seen[0] is None and len(seen) > 1 and all(s is stream for s in seen[1:])
