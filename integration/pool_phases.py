"""Issues 29 and 30 on the real Engine: greedy outputs with kvcanary on and off, sglang PR 35401's stale page tails
and PR 26380's SWA mapping race (phases 24-28), and the test-only switches they need.

Everything here that runs inside sglang is test-only and reaches it through a plugin written into the phase folder
(``pool-plugin/``, gated by ``E2E_POOL``: a comma list), never through kvcanary:

* ``page-tail`` (sglang PR 35401, open): with ``page_size`` > 1 the allocator hands out whole pages but the
  req_to_token row is written only up to ``seq_len``, so ``req_to_token[row, seq_len:ceil(seq_len/page)*page]``
  keeps the previous occupant's indices. Before every forward the observer counts the batch's rows whose last page
  has such a stale tail (a non-zero entry that is not page start + offset; a 0, the padding slot, is a tail entry
  never written, counted apart as ``unwritten_entries``) and prints ``[e2e-pool] page-tail:`` lines
  (rate-limited; one host sync per forward, hunt phases only). kvcanary must stay clean: it verifies positions
  below ``seq_len`` only, so a stale tail nobody reads is no violation.
* ``swa-race`` / ``swa-race-fix`` (sglang PR 26380, fixed in 0.5.13): under the overlap scheduler
  ``schedule_stream`` writes ``full_to_swa_index_mapping`` (``free_swa`` from retraction and window eviction) and
  req_to_token while the previous forward may still read them. The observer counts ``free_swa`` calls made while
  the forward stream is still busy (``[e2e-pool] swa-race:`` lines); ``swa-race-fix`` also patches in the PR's
  barrier, ``schedule_stream.wait_stream(forward_stream)`` at the top of every overlap loop iteration (before
  ``recv_requests``). kvcanary reads the mapping inside the forward, on the forward stream, so its reads race
  exactly like the attention kernels': a violation in the observed phase and none with the fix is the race.
* ``swa-lock`` / ``swa-lock-fix`` (caught by kvcanary on the H200, 2026-12-02, unprompted; the legacy
  ``SWARadixCache`` of 0.5.12, fixed upstream later by PR 29352, "skip swa recovery on locked full kv", which adds
  ``_recover_tombstone_keeping_locked_full``; 0.5.23 no longer ships this cache): when an insert overlaps an SWA
  tombstone whose full KV a running request still holds (``full_lock_ref`` > 0: a request past its window releases its
  swa lock, so the node can be tombstoned while the full lock stays), ``_insert_helper``'s recovery branches free
  ``node.value`` (the full slots) and put the inserting request's slots in the node. The running request's
  req_to_token row still holds the freed slots; the next allocation hands them to another request, whose prefill
  overwrites its full-attention KV. The observer counts, during every insert, frees of slots held by a full-locked
  tombstone and writes them to ``swa-lock-<pid>.jsonl`` in the phase folder (``E2E_POOL_DIR``), so the driver can
  match kvcanary's violations against them; ``swa-lock-fix`` also patches in the fix in PR 29352's shape for both
  branches: the free of a locked node's slots (Branch 1: its whole value; Branch 2: the tail it splits off) is left
  undone, and after the insert that node gets its own full slots back with the incoming slots' SWA part
  (``full_to_swa_index_mapping``), and only the incoming full slots are freed. (A first stand-in that only left the
  slots allocated leaked them: sglang's idle check stopped the Engine, H200 2026-12-02.) The driver's
  ``--test-pool-switch swa-lock-fix`` puts the fix into any phase (clean, faults, identical outputs, the PR 26380
  pair) on the SWA config.
* ``lift-kv-dtype``: drops kvcanary's start-up refusal of a quantised ``--kv-cache-dtype`` (plugin/kvcanary/sglang/
  audit.py) in the scheduler process, and prints that it did; nothing else changes. It let the fp8_e4m3 proof run
  on the H200 (2026-12-02: clean 0, every class found, outputs identical on and off), after which fp8 became
  covered; today only fp4_e2m1 is refused, so a proof run of that store is what it is for.

The driver side (the worker's plugin environment, the trigger counts, the phase rows, the dry run) imports the
driver core (integration/e2e_core.py) and driver_plugin.py inside its functions: sglang's processes load this file
alone.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: sglang's processes load this file alone)
    from collections.abc import Sequence

    from e2e_core import Phase

POOL_ENV = "E2E_POOL"
POOL_DRIVER_ENV = "E2E_POOL_PHASES_FILE"
POOL_DIR_ENV = "E2E_POOL_DIR"  # the phase folder: observers that record slots write there
SWA_LOCK_FILE = "swa-lock-{pid}.jsonl"
POOL_PLUGIN = "kvcanary_e2e_pool"
SWITCHES = ("page-tail", "swa-race", "swa-race-fix", "swa-lock", "swa-lock-fix", "lift-kv-dtype")
PRINT_FIRST, PRINT_EVERY = 10, 200  # observer lines: the first events, then a running total every N forwards

# phase key -> (kind, upstream, what is counted)
HUNTS = {
    "26": ("page-tail", "sglang PR 35401", "rows whose last page keeps a previous occupant's req_to_token tail"),
    "27": ("swa-race", "sglang PR 26380", "free_swa calls while the previous forward still runs (overlap)"),
    "28": ("swa-race-fix", "sglang PR 26380 (fix patched in)", "the same, with the PR's WAR barrier"),
    "29": ("swa-lock", "SWARadixCache frees a locked tombstone's full KV",
           "inserts that freed full slots a running request still holds (full-locked SWA tombstone)"),
    "30": ("swa-lock-fix", "the same (test-only fix patched in)", "the same frees, undone by the fix"),
}
IDENT_OFF, IDENT_ON = "24", "25"
IDENT_PHASES = (IDENT_OFF, IDENT_ON)  # their workers keep the greedy outputs (compared on and off)


# ------------------------------------------------------------------------------------------ in sglang (test-only)
def install(value: str) -> None:
    """Called by the test plugin in every sglang process with ``E2E_POOL``'s value."""
    for item in filter(None, (x.strip() for x in value.split(","))):
        if item == "page-tail":
            _observe_page_tail()
        elif item in ("swa-race", "swa-race-fix"):
            _observe_swa_race(fix=item == "swa-race-fix")
        elif item in ("swa-lock", "swa-lock-fix"):
            _observe_swa_lock(fix=item == "swa-lock-fix")
        elif item == "lift-kv-dtype":
            _lift_kv_dtype_refusal()
        else:
            raise ValueError(f"{POOL_ENV}: unknown switch {item!r}; expected {', '.join(SWITCHES)}")


def _lift_kv_dtype_refusal() -> None:
    import kvcanary.sglang.audit as audit

    if getattr(audit.refused_rows, "_e2e_pool", False):
        return
    orig = audit.refused_rows

    def refused_rows():
        return tuple(r for r in orig() if r.field != "kv_cache_dtype")

    refused_rows._e2e_pool = True  # type: ignore[attr-defined]
    audit.refused_rows = refused_rows
    print("[e2e-pool] lift: field=kv_cache_dtype test_only=1", flush=True)


def _observe_page_tail() -> None:
    import torch
    from sglang.srt.model_executor.model_runner import ModelRunner

    if getattr(ModelRunner.forward, "_e2e_pool", False):
        return
    orig = ModelRunner.forward
    tally = collections.Counter()

    def forward(self, forward_batch, *args, **kwargs):
        ps = int(getattr(self, "page_size", 1) or 1)
        if ps > 1 and getattr(forward_batch, "req_pool_indices", None) is not None and not self.is_draft_worker:
            r2t = self.req_to_token_pool.req_to_token
            rows = forward_batch.req_pool_indices.to(torch.int64)
            seq = forward_batch.seq_lens.to(torch.int64)
            start = torch.div(seq - 1, ps, rounding_mode="floor").clamp_min(0) * ps
            off = torch.arange(ps, device=seq.device)
            pos = start[:, None] + off[None, :]  # the last page's positions
            tail = (pos >= seq[:, None]) & (rows[:, None] > 0) & (seq[:, None] > 0)
            got = r2t[rows[:, None], pos.clamp_max(r2t.shape[1] - 1)]
            want = r2t[rows, start][:, None] + off[None, :]
            # 0 is no slot (the padding slot): a tail entry never written since the row was allocated, which is
            # not PR 35401's case; a non-zero entry other than page start + offset is a previous occupant's index
            unwritten = tail & (got == 0)
            stale = tail & (got != 0) & (got != want)
            n = int(stale.sum())  # (host sync: hunt phases only)
            tally["forwards"] += 1
            tally["unwritten_entries"] += int(unwritten.sum())
            if n:
                tally["stale_forwards"] += 1
                tally["stale_entries"] += n
                tally["stale_rows"] += int(stale.any(dim=1).sum())
                if tally["stale_forwards"] <= PRINT_FIRST:
                    i, j = (int(x) for x in stale.nonzero()[0])
                    print(f"[e2e-pool] page-tail: forward={tally['forwards']} stale_entries={n} row={int(rows[i])} "
                          f"seq_len={int(seq[i])} position={int(pos[i, j])} value={int(got[i, j])} "
                          f"expected={int(want[i, j])} page_size={ps}", flush=True)
            if tally["forwards"] % PRINT_EVERY == 0:
                print("[e2e-pool] page-tail-total: " + " ".join(f"{k}={v}" for k, v in sorted(tally.items())),
                      flush=True)
        return orig(self, forward_batch, *args, **kwargs)

    forward._e2e_pool = True  # type: ignore[attr-defined]
    ModelRunner.forward = forward


def _observe_swa_race(fix: bool) -> None:
    import sglang.srt.managers.scheduler as sm
    from sglang.srt.mem_cache.swa_memory_pool import SWATokenToKVPoolAllocator

    if getattr(SWATokenToKVPoolAllocator.free_swa, "_e2e_pool", False):
        return
    sched: list = []
    tally = collections.Counter()
    orig_recv = sm.Scheduler.recv_requests

    def recv_requests(self, *args, **kwargs):
        if not sched:
            sched.append(self)
        if fix and getattr(self, "enable_overlap", False) and hasattr(self, "schedule_stream"):
            self.schedule_stream.wait_stream(self.forward_stream)  # PR 26380: WAR barrier at the loop top
            tally["barriers"] += 1
        return orig_recv(self, *args, **kwargs)

    orig_free = SWATokenToKVPoolAllocator.free_swa

    def free_swa(self, free_index):
        s = sched[0] if sched else None
        busy = s is not None and getattr(s, "enable_overlap", False) and not s.forward_stream.query()
        tally["free_swa"] += 1
        tally["slots"] += int(free_index.numel())
        if busy:
            tally["in_flight"] += 1
            tally["slots_in_flight"] += int(free_index.numel())
        if tally["free_swa"] <= PRINT_FIRST or tally["free_swa"] % PRINT_EVERY == 0:
            print(f"[e2e-pool] {'swa-race-fix' if fix else 'swa-race'}: " + " ".join(
                f"{k}={v}" for k, v in sorted(tally.items())), flush=True)
        return orig_free(self, free_index)

    recv_requests._e2e_pool = free_swa._e2e_pool = True  # type: ignore[attr-defined]
    sm.Scheduler.recv_requests = recv_requests
    SWATokenToKVPoolAllocator.free_swa = free_swa


def _locked_tombstones(tree) -> list:
    """Every SWA tombstone some request still holds a full lock on."""
    held, stack = [], list(tree.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.swa_tombstone and node.full_lock_ref > 0 and node.value is not None and node.value.numel():
            held.append(node)
    return held


def _is_tail(value, free_index) -> bool:
    """Whether ``free_index`` is ``value``'s tail (Branch 1 frees a node's whole value, Branch 2 a tail of it)."""
    n = free_index.numel()
    return 0 < n <= value.numel() and bool((value[value.numel() - n:] == free_index.to(value.dtype)).all())


def _observe_swa_lock(fix: bool) -> None:
    import json
    import os

    import torch
    from sglang.srt.mem_cache.swa_radix_cache import SWARadixCache

    if getattr(SWARadixCache._insert_helper, "_e2e_pool", False):
        return
    kind = "swa-lock-fix" if fix else "swa-lock"
    tally = collections.Counter()
    folder = os.environ.get(POOL_DIR_ENV)
    path = os.path.join(folder, SWA_LOCK_FILE.format(pid=os.getpid())) if folder else None
    orig_insert = SWARadixCache._insert_helper

    def _insert_helper(self, *args, **kwargs):
        tally["inserts"] += 1
        if not _locked_tombstones(self):
            return orig_insert(self, *args, **kwargs)
        alloc = self.token_to_kv_pool_allocator
        own = vars(alloc).get("free")  # an instance-level wrapper someone else installed, kept underneath ours
        inner = alloc.free
        kept = []  # (node, the held full slots whose free the fix left undone)

        def free(free_index):
            # found at free time, not before the insert: a split earlier in the same walk makes new node objects
            node = next((nd for nd in _locked_tombstones(self) if _is_tail(nd.value, free_index)), None)
            if node is None:
                return inner(free_index)
            n = free_index.numel()
            branch = 1 if n == node.value.numel() else 2  # Branch 1 frees the whole value, Branch 2 its tail
            tally["events"] += 1
            tally["slots"] += n
            tally[f"branch{branch}"] += 1
            if path:
                with open(path, "a") as f:
                    f.write(json.dumps({"event": tally["events"], "branch": branch, "slots": free_index.tolist(),
                                        "deferred": fix}) + "\n")
            if tally["events"] <= PRINT_FIRST or tally["events"] % PRINT_EVERY == 0:
                print(f"[e2e-pool] {kind}: " + " ".join(f"{k}={v}" for k, v in sorted(tally.items())), flush=True)
            if not fix:
                return inner(free_index)
            # Both branches then give ``node`` (Branch 2: the tail part of its split) the incoming slots of the same
            # tokens; the fix undoes that after the insert
            kept.append((node, free_index.clone()))
            return None

        alloc.free = free
        try:
            return orig_insert(self, *args, **kwargs)
        finally:
            if own is None:
                del alloc.free
            else:
                alloc.free = own
            # the fix (PR 29352's shape): the locked node keeps its full slots and takes the SWA part of the
            # incoming ones; only the incoming full slots are freed (their swa slots now belong to the node)
            mapping = getattr(alloc, "full_to_swa_index_mapping", None)
            for node, old in kept:
                incoming = node.value
                if incoming.numel() != old.numel() or bool(torch.equal(incoming, old)) or mapping is None:
                    tally["unfixed"] += 1
                    continue
                mapping[old] = mapping[incoming]
                mapping[incoming] = 0
                alloc.full_attn_allocator.free(incoming)
                node.value = old
                tally["fixed"] += 1
            if kept:  # the tally after the fix (the lines at free time show it before)
                print(f"[e2e-pool] {kind}: " + " ".join(f"{k}={v}" for k, v in sorted(tally.items())), flush=True)

    _insert_helper._e2e_pool = True  # type: ignore[attr-defined]
    SWARadixCache._insert_helper = _insert_helper


# ------------------------------------------------------------------------------------------ driver side
def run_pool_switches(args) -> list[str]:
    """The test-only switches the run asks for in every phase (--test-pool-switch, --test-lift-kv-dtype)."""
    return list(getattr(args, "test_pool_switch", None) or []) + (
        ["lift-kv-dtype"] if getattr(args, "test_lift_kv_dtype", False) else [])


def pool_env(env: dict, phase: Phase, pdir: str, extra: Sequence[str] = ()) -> dict:
    """The test-only pool plugin (``E2E_POOL``) on the worker's path when the phase or the run (``extra``:
    --test-pool-switch, --test-lift-kv-dtype) asks for a switch."""
    import os

    from driver_plugin import with_test_plugin  # (driver side only: sglang's processes load this file alone)

    env = dict(env)
    switches = [x for x in env.get(POOL_ENV, "").split(",") if x]
    switches += [x for x in extra if x not in switches]
    if not switches:
        env.pop(POOL_ENV, None)
        return env
    env[POOL_ENV] = ",".join(switches)
    env[POOL_DIR_ENV] = os.path.abspath(pdir)
    return with_test_plugin(env, os.path.join(pdir, "pool-plugin"), POOL_PLUGIN,
                            about="integration/pool_phases.py, issue 29/30 observers and switches",
                            gate_env=POOL_ENV, file_env=POOL_DRIVER_ENV, module="_kvcanary_e2e_pool",
                            function="install", driver_file=__file__)


def trigger_count(kind: str, log_text: str, retractions: int = 0) -> tuple[int, str]:
    from e2e_core import parse_pool_lines  # (driver side only: sglang's processes load this file alone)

    lines = parse_pool_lines(log_text)
    if kind == "page-tail":
        totals = lines.get("page-tail-total") or [{}]
        last = totals[-1]
        n = max(int(last.get("stale_forwards", 0)), len(lines.get("page-tail", [])))
        return n, (f"{n} of {last.get('forwards', '?')} observed forwards had rows whose last-page tail holds a "
                   f"previous occupant's slot ids ({last.get('stale_entries', 0)} entries; tail entries never "
                   f"written, 0: {last.get('unwritten_entries', 0)}; running totals every {PRINT_EVERY} forwards)")
    mine = lines.get(kind) or [{}]
    last = mine[-1]
    # observed: frees the host issued while the forward stream was busy; fixed: the same path exercised, with the
    # barrier ordering every schedule-stream write after the previous forward on the GPU (the host may still run)
    n = int(last.get("in_flight", 0)) if kind == "swa-race" else min(int(last.get("free_swa", 0)),
                                                                        int(last.get("barriers", 0)))
    return n, (f"{last.get('free_swa', 0)} free_swa calls ({last.get('slots', 0)} slots), {n} while the previous "
               f"forward was still running ({last.get('slots_in_flight', 0)} slots); {retractions} retractions"
               + (f"; {last.get('barriers', 0)} barriers" if kind == "swa-race-fix" else ""))


def swa_lock_files(pdir: str) -> list[str]:
    """The swa-lock observer's files of one phase (one per scheduler process)."""
    import glob
    import os

    return sorted(glob.glob(os.path.join(pdir, SWA_LOCK_FILE.format(pid="*"))))


def swa_lock_evidence(kind: str, events: list[dict], violated_slots: set[int]) -> tuple[int, str]:
    """(trigger count, evidence) of phase 29/30: the frees of full slots a running request still held, and how many
    of kvcanary's violated slots are among them (the match that makes the violations this bug, not noise)."""
    freed: set[int] = set()
    total = 0
    branches: collections.Counter = collections.Counter()
    for e in events:
        freed.update(e["slots"])
        total += len(e["slots"])
        branches[e.get("branch", "?")] += 1
    split = ", ".join(f"{n} Branch {b}" for b, n in sorted(branches.items(), key=str))
    fixed = " (the fix patched in: every such free undone)" if kind == "swa-lock-fix" else ""
    return len(events), (f"{len(events)} inserts ({split}) freed {total} full slots ({len(freed)} distinct) of a "
                         f"full-locked SWA tombstone{fixed}; {len(violated_slots & freed)} of the "
                         f"{len(violated_slots)} distinct violated slots are among them")


def compare_outputs(ref: list | None, got: list | None) -> dict:
    """Greedy outputs of the kvcanary-on phase against the kvcanary-off phase's, request by request."""
    if not ref or not got:
        return {"compared": 0, "differ": None, "first_differ": None}
    differ = [i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b]
    return {"compared": min(len(ref), len(got)), "differ": len(differ) + abs(len(ref) - len(got)),
            "first_differ": differ[:5]}


def summarize_pool(phase: Phase, pdir: str, res: dict, results: dict) -> dict:
    """Phases 24-28: 24 passes when every request completed; 25 as a clean phase and with phase 24's greedy
    outputs; 26-28 as a hunt (CLEAN / CAUGHT / NOT TRIGGERED), the trigger from the observer's lines."""
    import glob
    import os

    from e2e_core import VIOLATION_SCHEMA, WINDOW_GROUP, group_of, read_jsonl, read_text, summarize_phase, verdict_clean
    from hunt_phases import verdict

    log_text = read_text(os.path.join(pdir, "worker.log"))
    rows = read_jsonl(sorted(glob.glob(os.path.join(pdir, "kvc-*.jsonl"))))
    s = summarize_phase(phase, res, log_text, rows)
    if phase.key == IDENT_OFF:
        ok = s["status"] == "OK" and s["requests_ok"] == s["requests_sent"] > 0
        s["evidence"] = f"{len(res.get('outputs') or [])} greedy outputs kept (the reference)"
        s["verdict"], s["why"] = ("PASS" if ok else "FAIL"), ([] if ok else [f"status {s['status']}"])
        return s
    if phase.key == IDENT_ON:
        ok, why = verdict_clean(s)
        cmp = compare_outputs((results.get(IDENT_OFF) or {}).get("outputs"), res.get("outputs"))
        s["outputs"] = cmp
        if not cmp["compared"]:
            why.append("no outputs to compare (run ident-off in the same call)")
        elif cmp["differ"]:
            why.append(f"{cmp['differ']} of {cmp['compared']} greedy outputs differ from those with kvcanary off "
                       f"(first: {cmp['first_differ']})")
        s["evidence"] = f"{cmp['compared']} outputs compared, {cmp['differ']} differ"
        s["verdict"], s["why"] = ("PASS" if not why else "FAIL"), why
        return s
    kind, s["upstream"], _ = HUNTS[phase.key]
    if kind in ("swa-lock", "swa-lock-fix"):
        violated = {int(r["slot"]) for r in rows if r.get("schema") == VIOLATION_SCHEMA and r.get("slot") is not None
                    and group_of(r) != WINDOW_GROUP}  # full slots: the window group numbers its own
        s["triggers"], s["evidence"] = swa_lock_evidence(kind, read_jsonl(swa_lock_files(pdir)), violated)
    else:
        s["triggers"], s["evidence"] = trigger_count(kind, log_text, s["retractions"])
    s["verdict"], s["why"] = verdict(kind, s, s["triggers"])
    return s


def render(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "| issue 29/30 phase | what | evidence | requests ok/sent | entries verified | violations | verdict |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['phase']} | {r.get('upstream', 'outputs kvcanary on vs off')} | {r.get('evidence', '')} | "
                   f"{r['requests_ok']}/{r['requests_sent']} | "
                   f"{r['entries_verified'] if r['entries_verified'] is not None else '-'} | {r['violations']} | "
                   f"{r['verdict']} |")
    return out


def dry_run_pool(phase: Phase, pdir: str, base: dict, n_req: int) -> dict:
    """Phases 24-28's worker output, synthesized: the same outputs on and off, observer lines, no violation."""
    import json
    import os

    lines = {
        "26": "[e2e-pool] page-tail: forward=40 stale_entries=3 row=5 seq_len=37 position=40 value=901 "
              "expected=41 page_size=16\n[e2e-pool] page-tail-total: forwards=800 stale_entries=90 "
              "stale_forwards=31 stale_rows=40\n",
        "27": "[e2e-pool] swa-race: free_swa=400 in_flight=57 slots=9000 slots_in_flight=1200\n",
        "28": "[e2e-pool] swa-race-fix: barriers=900 free_swa=400 in_flight=50 slots=9000 slots_in_flight=1100\n",
    }.get(phase.key, "")
    if phase.key in ("29", "30"):  # the observer's slot file: two inserts that freed a locked tombstone's slots
        with open(os.path.join(pdir, SWA_LOCK_FILE.format(pid=1)), "w") as f:
            for k, slots in enumerate(([101, 102, 103], [207, 208]), 1):
                f.write(json.dumps({"event": k, "slots": slots, "deferred": phase.key == "30"}) + "\n")
    with open(os.path.join(pdir, "worker.log"), "w") as f:
        f.write("[dry-run]\n" + lines)
        if phase.mode != "off":
            f.write("kvcanary stats: step=900 forwards=900 tokens_written=200000 entries_verified=2500000 "
                    "entries_swept=90000 violations=0 lost=0\n")
    open(os.path.join(pdir, "kvc-0.jsonl"), "w").close()
    res = dict(base, retractions=4 if phase.key in ("26", "27", "28") else 0)
    if phase.key in IDENT_PHASES:
        res["outputs"] = [[7, i] for i in range(n_req)]
    return res
