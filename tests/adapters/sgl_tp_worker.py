"""One TP rank of a real sglang 0.5.12 ModelRunner on CPU with ``tp_size`` > 1 (test helper, run as a process).

``python sgl_tp_worker.py RANK TP_SIZE PORT MODEL_DIR OUT_DIR FORWARDS FAULT_RANK``: builds rank RANK of a
tp=TP_SIZE runner (torch.distributed on gloo over loopback, as sglang sets it up on CPU), with kvcanary
installed through its ``sglang.srt.plugins`` entry point (``KVCANARY_*`` come from the parent's environment),
drives FORWARDS forwards with :class:`sgl_engine.MiniScheduler` (every rank runs the same seeded schedule, as
sglang's schedulers do, so their collectives pair up), then a fault phase: on rank FAULT_RANK only, one K byte
of a live slot of this rank's own KV shard is flipped before a decode. Writes ``OUT_DIR/rank-RANK.json``
(counters, violations, the kvcanary log lines, the real-KV sources against the pool's buffers).

sglang on CPU needs ``SGLANG_CPU_OMP_THREADS_BIND`` with one entry per TP rank when tp_size exceeds the NUMA
node count (``ModelRunner.init_threads_binding``); the parent sets it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _drive(sched, rng: random.Random, prefix: list[int], forwards: int) -> None:
    while len(sched.forwards) < forwards:
        if len(sched.waiting) < 2 and rng.random() < 0.3:
            tail = [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 40))]
            sched.add((prefix if rng.random() < 0.7 else []) + tail, rng.randrange(3, 12))
        if not sched.idle:
            sched.step()


def main(argv: list[str]) -> int:
    rank, tp_size, port = int(argv[1]), int(argv[2]), int(argv[3])
    model_dir, out_dir = Path(argv[4]), Path(argv[5])
    forwards, fault_rank = int(argv[6]), int(argv[7])
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, HERE)
    import _sglang_cpu_shims

    _sglang_cpu_shims.apply()
    import torch

    torch.set_num_threads(1)
    import sgl_engine
    import sglang.srt.plugins as plugins
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from kvcanary.kernels.tags import LaunchTag
    from kvcanary.runtime import faults
    from kvcanary.sglang import hooks, ranks

    lines = _Lines()
    logging.getLogger("kvcanary").addHandler(lines)
    logging.getLogger("kvcanary").setLevel(logging.INFO)

    plugins.load_plugins()  # what each sglang scheduler process does: kvcanary registers through its entry point
    sa = sgl_engine.server_args(model_dir, tp_size=tp_size, chunked_prefill_size=48)
    set_global_server_args_for_scheduler(sa)
    t0 = time.time()
    mr = ModelRunner(
        model_config=ModelConfig.from_server_args(sa), mem_fraction_static=0.05, gpu_id=rank, tp_rank=rank,
        tp_size=tp_size, moe_ep_rank=0, moe_ep_size=1, pp_rank=0, pp_size=1, nccl_port=port, server_args=sa,
    )
    tree = sgl_engine.build_tree_cache(mr, sa)
    build_s = time.time() - t0
    inst = hooks.installation_of(mr)
    assert inst is not None, "kvcanary did not install through its entry point"
    manager = inst.manager
    pool = mr.token_to_kv_pool
    sources = [
        {"data_ptr": s.tensor.data_ptr(), "shape": list(s.tensor.shape)} for s in inst.groups[0].spec.sources
    ]
    pool_buffers = {
        "k": [{"data_ptr": b.data_ptr(), "shape": list(b.shape)} for b in pool.k_buffer],
        "v": [{"data_ptr": b.data_ptr(), "shape": list(b.shape)} for b in pool.v_buffer],
        "head_num": int(pool.head_num),
        "total_kv_heads": int(mr.model_config.get_total_num_kv_heads()),
    }

    # Clean phase: the same seeded schedule on every rank.
    rng = random.Random(1234)
    prefix = [rng.randrange(3, 2000) for _ in range(24)]
    sched = sgl_engine.MiniScheduler(mr, tree, chunk_size=48)
    t1 = time.time()
    _drive(sched, rng, prefix, forwards)
    manager.flush()
    st = manager.stats
    clean = {
        "forwards": len(sched.forwards),
        "modes": sorted(set(sched.forwards)),
        "steps": inst.steps,
        "violations": manager.reporter.total_reported,
        "violations_seen": st.violations_seen,
        "verify_runs": st.kernel_runs[LaunchTag.VERIFY],
        "write_runs": st.kernel_runs[LaunchTag.WRITE],
        "sweep_runs": st.kernel_runs[LaunchTag.SWEEP],
        "slots_verified": st.slot_runs[LaunchTag.VERIFY],
        "slots_written": st.slot_runs[LaunchTag.WRITE],
        "cached_tokens": sched.cached_tokens,
        "finished": len(sched.finished),
        "seconds": time.time() - t1,
    }

    # Fault phase: a live decode batch on every rank; the flip only on fault_rank (its own K shard, layer 0).
    sched.waiting.clear()
    while sched.chunked_req is not None or sched.running is None or sched.running.is_empty():
        sched.add([rng.randrange(3, 2000) for _ in range(20)], 30)
        sched.step()
    r2t = mr.req_to_token_pool.req_to_token
    # the running request with the most decodes left, so the next forwards verify its prefix
    req = max((r for r in sched.running.reqs if r.req_pool_idx and len(r.origin_input_ids) + len(r.output_ids) > 4),
              key=lambda r: r.sampling_params.max_new_tokens - len(r.output_ids))
    slot = int(r2t[req.req_pool_idx, 2])
    injected = None
    if rank == fault_rank:
        k_source = inst.groups[0].spec.sources[0]
        assert k_source.tensor.data_ptr() == pool.k_buffer[0].data_ptr()
        injected = faults.flip_real_kv(k_source, slot, byte=3).detail
    for _ in range(3):
        sched.step()
    manager.flush()
    st = manager.stats
    fault = {
        "slot": slot,
        "injected": injected,
        "reported": manager.reporter.total_reported,
        "violations": [
            {"slot": v.slot, "reasons": list(v.reasons), "rank": v.rank, "line": v.log_line()}
            for v in manager.violations
        ],
        "verify_runs": st.kernel_runs[LaunchTag.VERIFY],
        "write_runs": st.kernel_runs[LaunchTag.WRITE],
    }
    result = {
        "rank": rank,
        "manager_rank": manager.rank,
        "runner_ranks": list(ranks.runner_ranks(mr)),
        "runner_attrs": {k: getattr(mr, k) for k in ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank")},
        "report_path": manager.reporter.report_path,
        "build_s": build_s,
        "sources": sources,
        "pool": pool_buffers,
        "clean": clean,
        "fault": fault,
        "log_lines": [ln for ln in lines.lines if ln.startswith("kvcanary")],
    }
    inst.close()
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result, indent=1))
    sgl_engine.destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
