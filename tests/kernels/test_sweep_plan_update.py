"""canary_sweep_plan_update (csrc/canary_sweep_plan.cuh): a sweep-plan commit in one launch, against the pure-torch
reference (kvcanary.kernels.sweep_plan_ref: the torch commit SweepIndex ran before issue 25).

* Differential: 1000 random commits over random plan buffers (every buffer compared whole, bit for bit): spans
  chained onto spans of the same launch and of earlier launches of the commit (read from new_slots) and onto entries
  held before (read from the plan), chain heads, tombstones over predecessors (held and new), over new entries and
  over nothing new, overlapping ranges, empty commits, tombstones alone, the block's bounds (128 spans, 128 ranges),
  capacity edges (the spans ending at the capacity, num_valid 0 and = capacity).
* Hand cases that say what the kernel does with a tombstoned predecessor.
* Every argument check names the argument (``meta`` for a bad metadata value) and writes nothing.
* SweepIndex: a commit over the block's bounds splits into launches; the index's plans stay equal, buffer for buffer,
  to those of the index as of 0d74766 (the torch commit) under random changes.
* GPU (skipped without CUDA): the same differential cases on the device (grid-stride included), a metadata block that
  is not pinned refused.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from kvcanary.kernels import layout, sweep_plan_ref
from kvcanary.kernels.sweep_plan import canary_sweep_plan_update, sweep_plan_meta
from kvcanary.runtime import sweep_index
from kvcanary.runtime.sweep_index import Span, SweepIndex

ROOT = Path(__file__).resolve().parents[2]
OLD_REV = "0d74766"  # the last revision whose SweepIndex commits by torch operations
BUFFERS = ("verify_slot_indices", "verify_prev_slot_indices", "verify_expected_positions", "verify_num_valid")


# ---------------------------------------------------------------------------------------------- random commits
def random_case(rng: random.Random) -> dict:
    """One valid launch: plan buffers with random contents, new_slots, and metadata (spans, ranges) built to hit the
    hazards: predecessors in every place, tombstones over predecessors and new entries, the bounds."""
    edge = rng.random()
    capacity = rng.choice([1, 2, 3, 17, 64, 300, 1000])
    base = rng.choice([0, capacity]) if edge < 0.1 else rng.randint(0, capacity)
    num_new = capacity - base if edge < 0.2 else rng.randint(0, capacity - base)
    num_valid = rng.randint(base + num_new, capacity) if rng.random() < 0.3 else base + num_new
    if edge < 0.05:
        num_valid = rng.choice([0, capacity]) if base + num_new == 0 else num_valid
    spans = []
    limit = min(base + num_new, num_valid)
    many = rng.random() < 0.1
    if limit > base and rng.random() < 0.85:
        first = base if rng.random() < 0.7 else rng.randint(base, limit - 1)
        end = limit if rng.random() < 0.6 else rng.randint(first + 1, limit)
        count = min(end - first, layout.SWEEP_PLAN_MAX_SPANS if many else rng.randint(1, 8))
        cuts = sorted(rng.sample(range(first + 1, end), count - 1)) if count > 1 else []
        starts = [first, *cuts]
        ends = [*cuts, end]
        for k, (start, stop) in enumerate(zip(starts, ends, strict=True)):
            pick = rng.random()
            if pick < 0.2 or start == 0:
                before = -1
            elif pick < 0.45 and k > 0:
                before = ends[rng.randrange(k)] - 1  # the last entry of an earlier span of this launch
            elif pick < 0.7 and base > 0:
                before = rng.randrange(base)  # an entry held before (read from the plan)
            elif pick < 0.8 and first > base:
                before = rng.randrange(base, first)  # appended by an earlier launch of the commit (new_slots)
            else:
                before = rng.randrange(start)
            spans.append((start, stop - start, rng.choice([0, rng.randrange(1 << 20), (1 << 40) + rng.randrange(99)]),
                          before))
    tombstones = []
    if num_valid and rng.random() < 0.7:
        hot = [before for *_, before in spans if before >= 0] + [start for start, *_ in spans]
        for _ in range(layout.SWEEP_PLAN_MAX_TOMBSTONES if rng.random() < 0.05 else rng.randint(1, 6)):
            if hot and rng.random() < 0.5:
                start = rng.choice(hot)  # a predecessor or a span's first entry
                start = max(0, start - rng.randint(0, 2))
            else:
                start = rng.randrange(num_valid)
            tombstones.append((start, rng.randint(1, min(num_valid - start, rng.choice([1, 3, 40, 1000])))))
    plan = {
        "verify_slot_indices": torch.tensor([rng.randrange(1, 1 << 17) for _ in range(capacity)], dtype=torch.int64),
        "verify_prev_slot_indices": torch.tensor([rng.randrange(-1, 1 << 17) for _ in range(capacity)],
                                                 dtype=torch.int64),
        "verify_expected_positions": torch.tensor([rng.randrange(1 << 30) for _ in range(capacity)], dtype=torch.int64),
        "verify_num_valid": torch.tensor([rng.randrange(capacity + 1)], dtype=torch.int32),
    }
    new_slots = torch.tensor([(1 << 20) + rng.randrange(1 << 20) for _ in range(num_new)], dtype=torch.int64)
    meta = sweep_plan_meta(spans, tombstones, base, num_valid) + [rng.randrange(99) for _ in range(rng.randint(0, 3))]
    return {**plan, "new_slots": new_slots, "meta": torch.tensor(meta, dtype=torch.int64)}


def run_both(case: dict, device: str = "cpu") -> tuple[dict, dict]:
    """The kernel's and the reference's buffers after the launch (each on a copy of the case)."""
    kernel = {k: v.to(device) if k != "meta" else v.clone() for k, v in case.items()}
    if device == "cuda":
        kernel["meta"] = kernel["meta"].pin_memory()
    ref = {k: v.clone() for k, v in case.items()}
    canary_sweep_plan_update(**kernel)
    sweep_plan_ref.canary_sweep_plan_update(**ref)
    return {k: kernel[k].cpu() for k in BUFFERS}, {k: ref[k] for k in BUFFERS}


def assert_equal_buffers(got: dict, want: dict, case: dict) -> None:
    for name in BUFFERS:
        assert torch.equal(got[name], want[name]), (name, sweep_plan_ref.decode_meta(case["meta"]))


@pytest.mark.parametrize("chunk", range(10))
def test_random_commits_equal_the_reference(chunk: int) -> None:
    rng = random.Random(1000 + chunk)
    for _ in range(100):
        case = random_case(rng)
        got, want = run_both(case)
        assert_equal_buffers(got, want, case)


# ---------------------------------------------------------------------------------------------- hand cases
def plan_of(slots: list[int], capacity: int = 12) -> dict:
    return {
        "verify_slot_indices": torch.tensor(slots + [7] * (capacity - len(slots)), dtype=torch.int64),
        "verify_prev_slot_indices": torch.full((capacity,), 99, dtype=torch.int64),
        "verify_expected_positions": torch.full((capacity,), 99, dtype=torch.int64),
        "verify_num_valid": torch.zeros(1, dtype=torch.int32),
    }


def launch(plan: dict, new_slots: list[int], spans, tombstones, base: int, num_valid: int) -> dict:
    canary_sweep_plan_update(**plan, new_slots=torch.tensor(new_slots, dtype=torch.int64),
                             meta=torch.tensor(sweep_plan_meta(spans, tombstones, base, num_valid), dtype=torch.int64))
    return {k: v.tolist() for k, v in plan.items()}


def test_a_tombstoned_predecessor_is_read_as_the_slot_it_held() -> None:
    """Held span [11, 12, 13] at 0..2; the commit appends A = [21, 22] after it (its predecessor the held 13, at 2)
    and B = [31] after A (its predecessor A's 22, appended in this commit), then removes the held span and A. The
    predecessors are the slots those entries held before the commit's tombstones (the torch commit gathered them
    before it filled the tombstones); the tombstoned entries are the padding slot, A keeping its positions."""
    got = launch(plan_of([11, 12, 13]), [21, 22, 31], [(3, 2, 3, 2), (5, 1, 5, 4)], [(0, 3), (3, 2)], 3, 6)
    assert got["verify_slot_indices"][:6] == [0, 0, 0, 0, 0, 31]
    assert got["verify_prev_slot_indices"][3:6] == [13, 21, 22]
    assert got["verify_expected_positions"][3:6] == [3, 4, 5]
    assert got["verify_num_valid"] == [6]
    assert got["verify_slot_indices"][6:] == [7] * 6 and got["verify_prev_slot_indices"][:3] == [99] * 3


def test_spans_sharing_a_tombstoned_predecessor_both_read_it() -> None:
    """Two children of one held entry (a radix node's two children), the entry removed in the same commit."""
    got = launch(plan_of([11, 12]), [21, 31], [(2, 1, 2, 1), (3, 1, 2, 1)], [(1, 1)], 2, 4)
    assert got["verify_slot_indices"][:4] == [11, 0, 21, 31]
    assert got["verify_prev_slot_indices"][2:4] == [12, 12]


def test_chain_heads_tombstones_alone_and_empty_commits() -> None:
    got = launch(plan_of([11, 12, 13]), [21, 22], [(3, 2, 0, -1)], [], 3, 5)
    assert got["verify_prev_slot_indices"][3:5] == [layout.CHAIN_HEAD_SLOT, 21]
    assert got["verify_expected_positions"][3:5] == [0, 1] and got["verify_num_valid"] == [5]
    got = launch(plan_of([11, 12, 13]), [], [], [(1, 2)], 3, 3)  # tombstones alone
    assert got["verify_slot_indices"][:4] == [11, 0, 0, 7] and got["verify_num_valid"] == [3]
    assert got["verify_prev_slot_indices"] == [99] * 12
    got = launch(plan_of([11, 12, 13]), [], [], [], 3, 2)  # nothing but the count (a plan handed out again)
    assert got["verify_slot_indices"][:3] == [11, 12, 13] and got["verify_num_valid"] == [2]


# ---------------------------------------------------------------------------------------------- argument checks
def op_args(**overrides) -> dict:
    args = plan_of([11, 12, 13], capacity=8)
    args["new_slots"] = torch.tensor([21, 22], dtype=torch.int64)
    args["meta"] = torch.tensor(sweep_plan_meta([(3, 2, 3, 2)], [(0, 1)], 3, 5), dtype=torch.int64)
    args.update(overrides)
    return args


def meta_of(spans, tombstones, base: int = 3, num_valid: int = 5) -> dict:
    return {"meta": torch.tensor(sweep_plan_meta(spans, tombstones, base, num_valid), dtype=torch.int64)}


def arg_error(arg: str, text: str) -> str:
    return "^" + re.escape(f"canary_sweep_plan_update: {arg}: {text}")


MAX_S, MAX_T = layout.SWEEP_PLAN_MAX_SPANS, layout.SWEEP_PLAN_MAX_TOMBSTONES
ARGUMENT_ERRORS = [
    ({"verify_slot_indices": torch.zeros(8, dtype=torch.int32)}, TypeError, "verify_slot_indices",
     "expected dtype int64"),
    ({"verify_prev_slot_indices": torch.zeros(7, dtype=torch.int64)}, ValueError, "verify_prev_slot_indices",
     "expected shape [capacity=8], got [7]"),
    ({"verify_expected_positions": torch.zeros((2, 4), dtype=torch.int64)}, ValueError, "verify_expected_positions",
     "expected a 1-d tensor"),
    ({"verify_expected_positions": torch.zeros(16, dtype=torch.int64)[::2]}, ValueError, "verify_expected_positions",
     "expected a contiguous tensor"),
    ({"verify_num_valid": torch.zeros(1, dtype=torch.int64)}, TypeError, "verify_num_valid", "expected dtype int32"),
    ({"verify_num_valid": torch.zeros(2, dtype=torch.int32)}, ValueError, "verify_num_valid", "expected shape [1]"),
    ({"new_slots": torch.tensor([21, 22], dtype=torch.int32)}, TypeError, "new_slots", "expected dtype int64"),
    ({"new_slots": None}, TypeError, "new_slots", "expected a torch.Tensor, got None"),
    ({"new_slots": torch.zeros(2, dtype=torch.int64, device="meta")}, ValueError, "new_slots",
     "expected a cpu or cuda"),
    ({"meta": torch.zeros(8, dtype=torch.int32)}, TypeError, "meta", "expected dtype int64"),
    ({"meta": torch.zeros((2, 4), dtype=torch.int64)}, ValueError, "meta", "expected a 1-d tensor"),
    ({"meta": [1, 0, 3, 5]}, TypeError, "meta", "expected a torch.Tensor, got list"),
    ({"meta": torch.tensor([0, 0, 3], dtype=torch.int64)}, ValueError, "meta", "expected at least the 4 header"),
    (meta_of([(3, 2, 3, 2)] * (MAX_S + 1), []), ValueError, "meta", f"num_spans {MAX_S + 1} outside [0, {MAX_S}]"),
    (meta_of([], [(0, 1)] * (MAX_T + 1)), ValueError, "meta", f"num_tombstones {MAX_T + 1} outside [0, {MAX_T}]"),
    ({"meta": torch.tensor([1, 1, 3, 5, 3, 2, 3], dtype=torch.int64)}, ValueError, "meta",
     "1 spans and 1 tombstone ranges need 10 values, got 7"),
    (meta_of([], [], num_valid=9), ValueError, "meta", "num_valid 9 outside [0, capacity 8]"),
    (meta_of([], [], num_valid=-1), ValueError, "meta", "num_valid -1 outside [0, capacity 8]"),
    (meta_of([], [], base=7), ValueError, "meta", "slots_base 7: new_slots' 2 entries from there do not fit"),
    (meta_of([], [], base=-1), ValueError, "meta", "slots_base -1"),
    (meta_of([(2, 2, 3, 1)], []), ValueError, "meta", "span 0 (start 2, length 2): starts before slots_base 3"),
    (meta_of([(3, 1, 3, 2), (5, 1, 4, 3)], []), ValueError, "meta",
     "span 1 (start 5, length 1): does not start where the previous span ends (4)"),
    (meta_of([(3, 3, 3, 2)], [], num_valid=6), ValueError, "meta", "span 0 (start 3, length 3): length outside [1, 2]"),
    (meta_of([(3, 2, 3, 2)], [], num_valid=4), ValueError, "meta", "span 0 (start 3, length 2): length outside [1, 1]"),
    (meta_of([(3, 0, 3, 2)], []), ValueError, "meta", "span 0 (start 3, length 0): length outside [1, 2]"),
    (meta_of([(3, 2, -1, 2)], []), ValueError, "meta", "span 0 (start 3, length 2): first position -1 outside"),
    (meta_of([(3, 2, (1 << 63) - 1, 2)], []), ValueError, "meta", "span 0 (start 3, length 2): first position"),
    (meta_of([(3, 2, 3, 3)], []), ValueError, "meta", "span 0 (start 3, length 2): before 3 outside [-1, 3)"),
    (meta_of([(3, 2, 3, -2)], []), ValueError, "meta", "span 0 (start 3, length 2): before -2 outside [-1, 3)"),
    (meta_of([(3, 1, 3, 2), (4, 1, 4, 4)], []), ValueError, "meta",
     "span 1 (start 4, length 1): before 4 outside [-1, 4)"),
    (meta_of([(3, 2, 3, 2)], [(4, 2)]), ValueError, "meta", "tombstone range 0 (start 4, length 2): outside [0, "
     "num_valid 5)"),
    (meta_of([(3, 2, 3, 2)], [(0, 1), (-1, 1)]), ValueError, "meta", "tombstone range 1 (start -1, length 1)"),
    (meta_of([(3, 2, 3, 2)], [(1, 0)]), ValueError, "meta", "tombstone range 0 (start 1, length 0)"),
]


@pytest.mark.parametrize(("override", "kind", "arg", "text"), ARGUMENT_ERRORS,
                         ids=[f"{e[2]}-{i}" for i, e in enumerate(ARGUMENT_ERRORS)])
def test_argument_errors_name_the_argument_and_write_nothing(override: dict, kind: type, arg: str, text: str) -> None:
    args = op_args(**override)
    before = {k: args[k].clone() for k in BUFFERS if isinstance(args[k], torch.Tensor)}
    with pytest.raises(kind, match=arg_error(arg, text)):
        canary_sweep_plan_update(**args)
    for name, value in before.items():
        assert torch.equal(args[name], value), name


def test_the_valid_arguments_of_the_error_table_launch() -> None:
    """(The table's base case is valid: every error above comes from its one override.)"""
    args = op_args()
    canary_sweep_plan_update(**args)
    assert args["verify_slot_indices"].tolist() == [0, 12, 13, 21, 22, 7, 7, 7]
    assert args["verify_prev_slot_indices"][3:5].tolist() == [13, 21]


# ---------------------------------------------------------------------------------------------- SweepIndex
def live(planned) -> list[tuple[int, int, int]]:
    plan, n = planned.plan, int(planned.plan.verify_num_valid.item())
    rows = zip(plan.verify_slot_indices[:n].tolist(), plan.verify_prev_slot_indices[:n].tolist(),
               plan.verify_expected_positions[:n].tolist(), strict=True)
    return sorted(r for r in rows if r[0] != layout.PADDING_SLOT)


def test_a_commit_over_the_block_splits_into_launches() -> None:
    """300 spans each continuing the one before (so chunks read predecessors an earlier launch wrote) and 300
    removals of held spans (one of them the first new span's predecessor): 3 launches of spans, 128 ranges with the
    last and two more launches of ranges; the plan is the one a single launch gives (the reference over the whole
    commit), buffer for buffer."""
    count = 300
    index = SweepIndex("cpu")
    index.append([Span(f"h{i}", torch.tensor([1000 + 2 * i, 1001 + 2 * i])) for i in range(count)])
    index.commit()
    before = {k: getattr(index._plan, k).clone() for k in BUFFERS}
    launches = index.launches
    spans = [Span("n0", torch.tensor([5000]), "h7")]
    spans += [Span(f"n{i}", torch.tensor([5000 + i]), f"n{i - 1}") for i in range(1, count)]
    index.append(spans)
    for i in range(count):
        index.remove(f"h{i}")
    base = 2 * count
    meta = sweep_plan_meta([(base + i, 1, 2 + i, 15 if i == 0 else base + i - 1) for i in range(count)],
                           [(2 * i, 2) for i in range(count)], base, base + count)
    want = {k: v.clone() for k, v in before.items()}
    sweep_plan_ref.canary_sweep_plan_update(**want, new_slots=torch.arange(5000, 5000 + count),
                                            meta=torch.tensor(meta, dtype=torch.int64))
    planned = index.commit()
    spans_launches = -(-count // sweep_index.MAX_SPANS)
    ranges_launches = -(-(count - sweep_index.MAX_TOMBSTONES) // sweep_index.MAX_TOMBSTONES)
    # (the last chunk of spans takes the first MAX_TOMBSTONES ranges, the rest follow in launches of their own)
    assert index.launches - launches == spans_launches + ranges_launches == 5
    for name in BUFFERS:
        assert torch.equal(getattr(planned.plan, name), want[name]), name
    assert planned.skipped == 2 * count and live(planned)[0] == (5000, 1015, 2)


def test_a_small_commit_is_one_launch_and_one_staging_turn() -> None:
    index = SweepIndex("cpu")
    index.append([Span("a", torch.tensor([1, 2])), Span("b", torch.tensor([3]), "a")])
    index.commit()
    index.append([Span("c", torch.tensor([4]), "b")])
    index.remove("a")
    index.commit()
    assert index.launches == 2
    index.commit()  # unchanged: no launch
    assert index.launches == 2


def old_sweep_index() -> types.ModuleType:
    """``kvcanary.runtime.sweep_index`` as of OLD_REV (the torch commit), from git."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{OLD_REV}:plugin/kvcanary/runtime/sweep_index.py"],
                          capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("_old_sweep_index")
    sys.modules[module.__name__] = module  # (NamedTuple looks its module up)
    exec(compile(text, f"{OLD_REV}:sweep_index.py", "exec"), module.__dict__)
    return module


def _has_old_rev() -> bool:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return False
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{OLD_REV}^{{commit}}"],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_old_rev(), reason=f"needs git and revision {OLD_REV}")
@pytest.mark.parametrize("seed", range(4))
def test_index_plans_equal_the_torch_commit_buffer_for_buffer(seed: int) -> None:
    """The same random changes (appends chained in one call and across calls, splits, removals of leaves and of
    spans whose children were appended in the same commit, compactions, rebuilds, growth) to this index and to the
    index as of OLD_REV: after each commit, every plan buffer is equal, whole (tombstones, positions and predecessors
    of tombstoned entries, the -1 in the last entry)."""
    old = old_sweep_index()
    rng = random.Random(seed)
    new_index, old_index = SweepIndex("cpu"), old.SweepIndex("cpu")
    slots: dict[str, list[int]] = {}
    after: dict[str, str | None] = {}
    next_slot, names = 1, 0

    def both(method: str, *args) -> None:
        getattr(new_index, method)(*args)
        getattr(old_index, method)(*[[old.Span(*s) for s in a] if method == "append" else a for a in args])

    for _ in range(80):
        op = rng.random()
        if op < 0.45 or not slots:
            batch, keys = [], list(slots)
            for _ in range(rng.choice([1, 2, 5, 40, 150]) if rng.random() < 0.2 else rng.randint(1, 5)):
                parent = rng.choice([None, *keys]) if keys else None
                n = rng.randrange(1, 40)
                key = f"n{names}"
                names += 1
                batch.append(Span(key, torch.arange(next_slot, next_slot + n), parent))
                slots[key], after[key] = list(range(next_slot, next_slot + n)), parent
                next_slot += n
                keys.append(key)
            both("append", batch)
        elif op < 0.6:
            key = rng.choice(list(slots))
            if len(slots[key]) > 1:
                cut = rng.randrange(1, len(slots[key]))
                head = f"n{names}"
                names += 1
                both("split", key, head, cut)
                slots[head], after[head] = slots[key][:cut], after[key]
                slots[key], after[key] = slots[key][cut:], head
        elif op < 0.9:
            # leaves, and now and then a span with children (the tree never does that, but a predecessor
            # tombstoned in the same commit as its child's append is what the kernel must keep exact)
            keys = list(slots) if rng.random() < 0.3 else [k for k in slots if k not in after.values()]
            for key in rng.sample(keys, min(len(keys), rng.choice([1, 3, 200]))):
                both("remove", key)
                del slots[key]
                for child, parent in list(after.items()):
                    if parent == key:  # (its children stay placed: their predecessor index is fixed)
                        after[child] = None
                del after[key]
        elif op < 0.95:
            both("reserve", 0)
            both("compact")
        else:
            order, placed = [], set()
            while len(order) < len(slots):
                for key in slots:
                    if key not in placed and (after[key] is None or after[key] in placed):
                        placed.add(key)
                        order.append(key)
            both("clear")
            both("append", [Span(k, torch.tensor(slots[k]), after[k]) for k in order])
        if rng.random() < 0.7:
            got, want = new_index.commit(), old_index.commit()
            assert got.skipped == want.skipped
            for name in BUFFERS:
                assert torch.equal(getattr(got.plan, name), getattr(want.plan, name)), name


# ---------------------------------------------------------------------------------------------- GPU
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
# (ids as the other kernels' CUDA chunks: integration/gpu_check.sh's memcheck runs 0-cuda and 1-cuda)
@pytest.mark.parametrize("chunk", range(4), ids=lambda c: f"{c}-cuda")
def test_cuda_random_commits_equal_the_reference(chunk: int) -> None:
    rng = random.Random(2000 + chunk)
    for _ in range(100):
        case = random_case(rng)
        got, want = run_both(case, "cuda")
        assert_equal_buffers(got, want, case)


@pytest.mark.gpu
@needs_cuda
def test_cuda_commit_past_the_block_cap_is_grid_strided() -> None:
    """More items than kSweepPlanMaxBlocks blocks of kSweepPlanThreads threads cover at once (grid-stride), spans
    and ranges at the block's bounds."""
    capacity = 512 * 256 * 2 + 1000
    rng = random.Random(9)
    base = 1000
    lengths = [(capacity - base) // layout.SWEEP_PLAN_MAX_SPANS] * layout.SWEEP_PLAN_MAX_SPANS
    starts = [base + sum(lengths[:k]) for k in range(len(lengths))]
    spans = [(s, n, rng.randrange(1 << 20), rng.randrange(-1, s)) for s, n in zip(starts, lengths, strict=True)]
    tombstones = [(rng.randrange(capacity - 2000), rng.randint(1, 2000))
                  for _ in range(layout.SWEEP_PLAN_MAX_TOMBSTONES)]
    num_new = capacity - base
    case = {"verify_slot_indices": torch.arange(1, capacity + 1), "verify_prev_slot_indices": torch.zeros(capacity,
            dtype=torch.int64), "verify_expected_positions": torch.zeros(capacity, dtype=torch.int64),
            "verify_num_valid": torch.zeros(1, dtype=torch.int32),
            "new_slots": torch.arange(1 << 30, (1 << 30) + num_new),
            "meta": torch.tensor(sweep_plan_meta(spans, tombstones, base, starts[-1] + lengths[-1]), dtype=torch.int64)}
    got, want = run_both(case, "cuda")
    assert_equal_buffers(got, want, case)


@pytest.mark.gpu
@needs_cuda
def test_cuda_refuses_a_staging_that_is_not_pinned() -> None:
    """(and tensors on another device than the plan's: a ValueError naming them, nothing written)"""
    args = {k: v.cuda() if k != "meta" else v for k, v in op_args().items()}
    with pytest.raises(ValueError, match=arg_error("meta", "expected pinned host memory")):
        canary_sweep_plan_update(**args)
    with pytest.raises(ValueError, match=arg_error("meta", "expected host memory")):
        canary_sweep_plan_update(**{**args, "meta": args["meta"].cuda()})
    assert args["verify_slot_indices"].tolist() == [11, 12, 13, 7, 7, 7, 7, 7]
    pinned = args["meta"].pin_memory()  # kept until the launch has run (tolist synchronises)
    with pytest.raises(ValueError, match=arg_error("new_slots", "expected device cuda")):
        canary_sweep_plan_update(**{**args, "meta": pinned, "new_slots": args["new_slots"].cpu()})
    with pytest.raises(ValueError, match=arg_error("verify_num_valid", "expected device cuda")):
        canary_sweep_plan_update(**{**args, "meta": pinned, "verify_num_valid": args["verify_num_valid"].cpu()})
    assert args["verify_slot_indices"].tolist() == [11, 12, 13, 7, 7, 7, 7, 7]
    canary_sweep_plan_update(**{**args, "meta": pinned})
    assert args["verify_slot_indices"].tolist() == [0, 12, 13, 21, 22, 7, 7, 7]


@pytest.mark.gpu
@needs_cuda
def test_cuda_index_plans_equal_the_cpu_index() -> None:
    """SweepIndex on CUDA (pinned stagings, the ring's events) against SweepIndex on the CPU, over 200 commits."""
    rng = random.Random(4)
    gpu, cpu = SweepIndex("cuda"), SweepIndex("cpu")
    keys: list[str] = []
    for step in range(200):
        batch = []
        for i in range(rng.randint(1, 6)):
            key = f"s{step}.{i}"
            n = rng.randint(1, 30)
            slots = [rng.randrange(1, 1 << 20) for _ in range(n)]
            batch.append((key, slots, rng.choice([None, *(k for k in keys[-20:] if k in cpu)])))
        gpu.append([Span(k, torch.tensor(s, device="cuda"), a) for k, s, a in batch])
        cpu.append([Span(k, torch.tensor(s), a) for k, s, a in batch])
        keys += [k for k, _, _ in batch]
        for key in rng.sample(keys, min(len(keys), rng.randint(0, 3))):
            if key in cpu:
                gpu.remove(key)
                cpu.remove(key)
        got, want = gpu.commit(), cpu.commit()
        for name in BUFFERS:
            assert torch.equal(getattr(got.plan, name).cpu(), getattr(want.plan, name)), (step, name)
