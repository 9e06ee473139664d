"""Per-rank behaviour without sglang: what every TP rank's CanaryManager carries and where it reports.

* the adapter's rank rule (``kvcanary.sglang.v0_5_12.runner_ranks``): rank keys and the ``{rank}`` index for
  TP, PP, DP replicas and DP attention, unique across every scheduler process;
* two ranks in one process (the same batches, each rank's own req_to_token and KV head shard): buffers and
  counters are per rank, a fault in rank 1's shard is reported by rank 1 only, with ``tp_rank=1`` in the log
  line, the JSONL row and the ``{rank}`` file name;
* two rank processes appending to ONE report file (no ``{rank}``): every line intact, each with its rank.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing as mp
import types
from pathlib import Path

import pytest
import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.kernels.tags import LaunchTag
from kvcanary.report import Reporter, parse_log_line
from kvcanary.runtime.config import Config
from kvcanary.runtime.manager import CanaryManager
from kvcanary.settings import Mode
from kvcanary.sglang.v0_5_12 import runner_ranks

NUM_SLOTS = 96
HEAD_BYTES = 32  # one KV head shard per rank: [slots, HEAD_BYTES] bytes


# --------------------------------------------------------------------------------------- the rank rule
def _runner(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dp_rank=None, dp_size=1, dp_attention=False):
    """The ModelRunner attributes runner_ranks reads (sglang 0.5.12 names)."""
    sa = types.SimpleNamespace(dp_size=dp_size, enable_dp_attention=dp_attention)
    return types.SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                                 dp_rank=dp_rank, server_args=sa)


def test_rank_rule_tp_only_is_tp_rank() -> None:
    assert runner_ranks(_runner()) == ({"tp_rank": 0}, 0)
    assert [runner_ranks(_runner(tp_rank=r, tp_size=4)) for r in range(4)] == [({"tp_rank": r}, r) for r in range(4)]
    # a lone replica's dp_rank 0 (sglang passes dp_rank=0 or None with --dp-size 1) adds nothing
    assert runner_ranks(_runner(tp_rank=1, tp_size=2, dp_rank=0)) == ({"tp_rank": 1}, 1)


def test_rank_rule_pipeline_stages() -> None:
    rank, index = runner_ranks(_runner(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    assert rank == {"tp_rank": 1, "pp_rank": 1} and index == 3  # sglang's world rank tp_size * pp_rank + tp_rank


def test_rank_rule_dp_replicas_and_sglang_dp_rank() -> None:
    assert runner_ranks(_runner(tp_rank=1, tp_size=2, dp_rank=1, dp_size=2)) == ({"tp_rank": 1, "dp_rank": 1}, 3)
    # --dp-size 1 but SGLANG_DP_RANK=3 (one server per replica behind a router): still its own files
    assert runner_ranks(_runner(tp_rank=0, tp_size=2, dp_rank=3)) == ({"tp_rank": 0, "dp_rank": 3}, 6)


def test_rank_rule_dp_attention_tp_rank_is_global() -> None:
    # --tp 4 --dp 2 --enable-dp-attention: attention TP size 2, dp_rank = tp_rank // 2
    got = [runner_ranks(_runner(tp_rank=r, tp_size=4, dp_rank=r // 2, dp_size=2, dp_attention=True)) for r in range(4)]
    assert got == [({"tp_rank": r, "attn_dp_rank": r // 2}, r) for r in range(4)]


@pytest.mark.parametrize("tp_size,pp_size,dp_size", [(2, 1, 1), (2, 2, 1), (2, 1, 3), (4, 2, 2), (1, 3, 2)])
def test_rank_rule_report_index_unique_across_all_processes(tp_size: int, pp_size: int, dp_size: int) -> None:
    procs = itertools.product(range(dp_size), range(pp_size), range(tp_size))
    keys, indices = [], []
    for dp, pp, tp in procs:
        rank, index = runner_ranks(_runner(tp, tp_size, pp, pp_size, dp if dp_size > 1 else None, dp_size))
        keys.append(tuple(sorted(rank.items())))
        indices.append(index)
    assert sorted(indices) == list(range(tp_size * pp_size * dp_size))
    assert len(set(keys)) == len(keys)  # the rank keys tell every process apart too


# --------------------------------------------------------------------------------------- two ranks
class Rank:
    """One TP rank: its own req_to_token (same content on every rank) and its own shard of the KV heads."""

    def __init__(self, tp_rank: int, config: Config) -> None:
        self.tp_rank = tp_rank
        self.req_to_token = torch.zeros((4, 48), dtype=torch.int32)
        self.kv = torch.zeros((NUM_SLOTS, HEAD_BYTES), dtype=torch.uint8)  # this rank's heads only
        self.source = RealKvSource(self.kv, 1, HEAD_BYTES, HEAD_BYTES)
        self.mgr = CanaryManager(
            config, num_slots=NUM_SLOTS, req_to_token=self.req_to_token, device="cpu", max_batch_size=4,
            max_tokens_per_forward=64, real_kv_sources=[self.source], rank={"tp_rank": tp_rank},
        )
        self.mgr.mark_init_finished()

    def forward(self, batch: BatchView, writes: list[tuple[int, int, int, int]]) -> None:
        for row, p, slot, _ in writes:
            self.req_to_token[row, p] = slot
        self.mgr.before_forward(batch)
        for _, p, slot, token in writes:  # the model writes this rank's heads: differ per rank
            self.kv[slot] = torch.full((HEAD_BYTES,), (token * 7 + p + 31 * self.tp_rank) % 251, dtype=torch.uint8)
        self.mgr.after_forward(batch)
        self.mgr.step()


class Scheduler:
    """The same batches for every rank, as sglang's TP schedulers run them (rows 1 and 2, slots in order)."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.lengths = {1: 0, 2: 0}
        self.next_slot = 1

    def forward(self, rows: list[int], counts: list[int]) -> None:
        ids, pos, locs, prefixes, writes = [], [], [], [], []
        for row, count in zip(rows, counts, strict=True):
            prefixes.append(self.lengths[row])
            for _ in range(count):
                p, slot = self.lengths[row], self.next_slot
                token = 100 * row + p
                self.next_slot += 1
                self.lengths[row] += 1
                ids.append(token)
                pos.append(p)
                locs.append(slot)
                writes.append((row, p, slot, token))
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        batch = BatchView(ForwardKind.EXTEND if max(counts) > 1 else ForwardKind.DECODE, t(ids), t(pos), t(locs),
                          t(rows), t(prefixes), t(counts))
        for rank in self.ranks:
            rank.forward(batch, writes)


def test_two_ranks_per_rank_state_and_fault_reported_by_its_rank_only(tmp_path: Path, caplog) -> None:
    config = Config(mode=Mode.LOG, report_path=str(tmp_path / "kv-{rank}.jsonl"))
    ranks = [Rank(0, config), Rank(1, config)]
    sched = Scheduler(ranks)
    m0, m1 = ranks[0].mgr, ranks[1].mgr
    assert m0.reporter.report_path == str(tmp_path / "kv-0.jsonl")
    assert m1.reporter.report_path == str(tmp_path / "kv-1.jsonl")
    # every device buffer is the rank's own; the fingerprints read the rank's own shard
    assert m0.canary_buf.data_ptr() != m1.canary_buf.data_ptr()
    assert m0.violation_ring.data_ptr() != m1.violation_ring.data_ptr()
    assert [s.tensor.data_ptr() for s in m1.real_kv_sources] == [ranks[1].kv.data_ptr()]

    sched.forward([1, 2], [6, 4])
    for _ in range(5):
        sched.forward([1, 2], [1, 1])
    for m in (m0, m1):
        m.flush()
        assert m.violations == [] and m.reporter.total_reported == 0
        assert m.stats.kernel_runs[LaunchTag.VERIFY] == m.stats.kernel_runs[LaunchTag.WRITE] == 6
    assert m0.stats.slot_runs == m1.stats.slot_runs  # same batches: per-rank counters advance alike
    # the canary records are the same (tokens, positions, chain), the real-KV fingerprints are not (other heads)
    assert not torch.equal(m0.canary_buf, m1.canary_buf)

    victim = int(ranks[1].req_to_token[1, 2])
    ranks[1].kv[victim, 3] ^= 0x5A  # rank 1's shard only
    with caplog.at_level(logging.WARNING, logger="kvcanary"):
        sched.forward([1, 2], [1, 1])
        for m in (m0, m1):
            m.flush()
    assert m0.violations == [] and m0.reporter.total_reported == 0
    assert [v.slot for v in m1.violations] == [victim]
    v = m1.violations[0]
    assert v.reasons == ("verify_real_kv_hash",) and v.rank == {"tp_rank": 1}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvcanary violation:")]
    assert lines == [v.log_line()] and lines[0].endswith(" tp_rank=1")
    assert parse_log_line(lines[0])["tp_rank"] == "1"
    assert (tmp_path / "kv-0.jsonl").read_text() == ""
    rows = [json.loads(x) for x in (tmp_path / "kv-1.jsonl").read_text().splitlines()]
    assert [(r["slot"], r["rank"], r["reasons"]) for r in rows] == [(victim, {"tp_rank": 1}, ["verify_real_kv_hash"])]
    for m in (m0, m1):
        m.close()


def test_reporter_rank_fills_rows_and_names_the_file(tmp_path: Path) -> None:
    """What the adapter builds per runner: Reporter(mode, config.report_path_for(index), rank=keys)."""
    config = Config(mode=Mode.LOG, report_path=str(tmp_path / "r{rank}" / "kv.jsonl"))
    rank, index = runner_ranks(_runner(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2))
    with Reporter(config.mode, config.report_path_for(index), rank=rank,
                  logger=logging.getLogger("test.quiet")) as reporter:
        reporter.health_error("stalled", step=7, tags=[LaunchTag.VERIFY])
    (line,) = (tmp_path / "r3" / "kv.jsonl").read_text().splitlines()
    assert json.loads(line)["rank"] == {"tp_rank": 1, "pp_rank": 1}


# --------------------------------------------------------------------------------------- one shared file
FAULTS_PER_RANK = 12


def _rank_process(tp_rank: int, report: str, barrier) -> None:
    logging.getLogger("kvcanary").setLevel(logging.ERROR)
    rank = Rank(tp_rank, Config(mode=Mode.LOG, report_path=report))
    sched = Scheduler([rank])
    sched.forward([1, 2], [FAULTS_PER_RANK, FAULTS_PER_RANK])
    barrier.wait()
    for i in range(FAULTS_PER_RANK):  # one violation per forward, written as they are found
        rank.kv[int(rank.req_to_token[1 + tp_rank, i]), 0] ^= 0x01
        sched.forward([1, 2], [1, 1])
        rank.kv[int(rank.req_to_token[1 + tp_rank, i]), 0] ^= 0x01
    rank.mgr.flush()
    assert rank.mgr.reporter.total_reported == FAULTS_PER_RANK
    rank.mgr.close()


def test_two_rank_processes_append_to_one_report_file(tmp_path: Path) -> None:
    report = str(tmp_path / "kv.jsonl")  # no {rank}: every rank appends to the same file
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_rank_process, args=(r, report, barrier)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    rows = [json.loads(line) for line in Path(report).read_text().splitlines()]  # every line whole
    assert len(rows) == 2 * FAULTS_PER_RANK
    for r in (0, 1):
        mine = [row for row in rows if row["rank"] == {"tp_rank": r}]
        assert len(mine) == FAULTS_PER_RANK
        assert all(row["reasons"] == ["verify_real_kv_hash"] for row in mine)
