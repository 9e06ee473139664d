"""Inject fault classes into a running :class:`~kvcanary.sim.engine.Simulator` and score what the canary reports.

A :class:`FaultDriver` is the simulator's hook. Protocol:

* Nothing is injected before :meth:`FaultDriver.arm` (or the ``warmup`` step): violations reported before that
  are false positives.
* At most one injection is open at a time; the classes take turns (round robin) until each has ``per_class``
  injections. An injection is open until a violation with one of its class's expected reasons
  (``kvcanary.runtime.faults.EXPECTED_REASONS``) names one of the slots it touched ("detected"), or until ``deadline``
  forwards pass ("missed").
* Closing repairs the fault so that the next injection starts clean: a redirected or out-of-range
  ``req_to_token`` entry is restored, a flipped byte is flipped back, and requests whose own records went bad
  (stale reuse, token swap, position skew, an out-of-range ``out_cache_loc``) are aborted (their slots are freed,
  not cached; a freed slot is rewritten before anything verifies it again). Victims get extra decode budget
  (``extend_life``) so they cannot finish, and carry their bad records into the prefix cache, before detection.
* With a host tier, bad K/V must not travel either: a flipped live slot's request is kept running and a flipped
  cached page is pinned (``Simulator.pin``) until the detection, so neither is backed up and loaded back into a
  slot the injection does not name; closing still rewrites any cached copy, device or host, that differs from what
  the model wrote (``Simulator.repair_kv``). The host-tier classes are injected into a load-back (the
  ``pre_load`` hook: its request is the victim, kept running): a host copy's byte is flipped (flipped back on
  close), the K/V copy is sent to the load's slots rolled by one, or the host copies read are stale (the backed-up
  bytes return at ``post_load``, once the copy has read them); closing rewrites the loaded pages' device copies.
* Protect mode (:class:`kvcanary.sim.protect.SimProtect` acts before the driver scores): the victims are
  recomputed rather than aborted (closing aborts only a request still running), and a request protect recomputed
  is never chosen again (it would be aborted after ``kvcanary.runtime.protect.MAX_RECOMPUTES``, and each injection's
  actions are its own). :meth:`FaultDriver.note_action` attributes each ``kvcanary.action/1`` record to the
  injection it answers (the open one, else the last closed).
* Precision: every violation must name a slot of the open injection (one it touched, or one of a victim request
  whose chain it corrupted: that request's next writes build on the bad record), or of one closed fewer than
  ``grace`` forwards ago (the same fault still draining); anything else is a false positive.

* Deferred writes (``build_sim(defer_writes=True)``): the last forward's write may still be pending when the driver
  injects or repairs, and it fingerprints the K/V of that forward's slots when it runs. The driver launches it first
  (``mgr.flush_pending_write()``) before every injection attempt and every repair, so a flip of a slot the last
  forward wrote is not taken into its record, and a repair does not rewrite bytes a pending write has yet to read.

Each injector uses only :mod:`kvcanary.runtime.faults` and the simulator's own state; which row or slot is hit is drawn
from a seeded ``random.Random``, so a run is reproducible.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcanary.report.record import VIA_HOST_TIER, Violation
from kvcanary.runtime import faults
from kvcanary.runtime.faults import EXPECTED_REASONS, Injection
from kvcanary.sim.engine import LoadBack, Node, Request, Simulator


@dataclass
class OpenInjection:
    """One injection and what the canary reported about it."""

    injection: Injection
    step: int  # the simulator forward it was injected in (before or during that forward)
    repair: Callable[[], object]
    # Requests whose own chain the fault corrupted: their later writes build on a bad record and are reported too.
    victims: tuple[Request, ...] = ()
    detected_step: int | None = None
    first_detection: Violation | None = None
    tags: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # "+"-joined reasons of the matching violations
    actions: Counter[str] = field(default_factory=Counter)  # protect mode: recompute / abort / missed / evict
    nodes_evicted: int = 0
    acted_rids: set[str] = field(default_factory=set)  # requests protect recomputed, aborted or missed for it

    @property
    def latency(self) -> int | None:
        """Forwards from the injection to the report (0: reported right after the forward that ran with it)."""
        return None if self.detected_step is None else self.detected_step - self.step


@dataclass
class ClassResult:
    """What happened to one fault class."""

    fault: str
    injected: int = 0
    detected: int = 0
    latencies: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)
    tags: Counter[str] = field(default_factory=Counter)
    false_positives: int = 0  # violations on untouched slots while this class had an injection open
    via_host_tier: int = 0  # detections whose first violation said via=host_tier (the slot came back from the host)
    acted_on: int = 0  # protect mode: injections with at least one action
    actions: Counter[str] = field(default_factory=Counter)  # protect mode: recompute / abort / missed / evict records
    nodes_evicted: int = 0
    acted_rids: set[str] = field(default_factory=set)

    @property
    def all_detected(self) -> bool:
        return self.injected > 0 and self.detected == self.injected


class FaultDriver:
    """The simulator hook that injects ``classes`` in turn and scores the canary's reports (module docstring).

    Args:
        classes: fault class names (``kvcanary.runtime.faults.FAULT_CLASSES``), injected round robin.
        seed: seeds the choice of rows, slots, bytes and masks.
        per_class: injections per class before the driver is done.
        warmup: the first forward that may inject (or call :meth:`arm` later).
        gap: forwards to wait after a close before the next injection.
        deadline: forwards after which an undetected injection counts as missed.
        grace: forwards after a close during which the same injection's slots still explain violations.
        sweep_every: the manager's ``sweep_interval``. Cached-but-idle corruption is injected only right before a
            forward whose ``step()`` sweeps (the manager sweeps on every ``sweep_every``-th ``step()``, and the
            simulator calls it once per forward), so that eviction cannot recycle the slot before the sweep.
    """

    def __init__(self, classes: Sequence[str], *, seed: int = 0, per_class: int = 1, warmup: int = 40, gap: int = 3,
                 deadline: int = 30, grace: int = 2, sweep_every: int = 1) -> None:
        unknown = [c for c in classes if c not in faults.FAULT_CLASSES]
        if unknown or not classes:
            raise ValueError(f"FaultDriver: classes: expected some of {', '.join(faults.FAULT_CLASSES)}; got {classes}")
        self.classes = tuple(dict.fromkeys(classes))
        self.rng = random.Random(seed)
        self.per_class, self.gap, self.deadline, self.grace = per_class, gap, deadline, grace
        self.sweep_every = max(1, sweep_every)
        self.open: OpenInjection | None = None
        self.closed: list[OpenInjection] = []
        self.recent: list[tuple[int, OpenInjection]] = []  # (closed at step, injection) within the grace window
        self.false_positives: list[tuple[int, Violation]] = []
        self.seen = 0
        self.next_ok = warmup
        self._turn = 0
        self._counts: Counter[str] = Counter()
        self._fp_by_class: Counter[str] = Counter()
        self._after_load: list[Callable[[], None]] = []  # run at the load-back's post_load hook
        self._inject: dict[str, tuple[str, Callable[[Simulator], None]]] = {
            faults.REQ_TO_TOKEN_REDIRECT: ("pre_forward", self.redirect),
            faults.REAL_KV_FLIP: ("pre_forward", self.real_kv_flip),
            faults.STALE_SLOT_REUSE: ("pre_schedule", self.stale_reuse),
            faults.CACHED_IDLE_CORRUPTION: ("pre_step", self.cached_idle),
            faults.TOKEN_SWAP: ("pre_forward", self.token_swap),
            faults.POSITION_SKEW: ("pre_forward", self.position_skew),
            faults.OUT_OF_RANGE_INDEX: ("pre_forward", self.out_of_range),
            faults.HOST_TIER_FLIP: ("pre_load", self.host_tier_flip),
            faults.LOAD_WRONG_SLOTS: ("pre_load", self.load_wrong_slots),
            faults.LOAD_BEFORE_BACKUP: ("pre_load", self.load_before_backup),
        }

    # ------------------------------------------------------------------ state
    def arm(self, step: int) -> None:
        """Allow injections from forward ``step`` on."""
        self.next_ok = step

    @property
    def current(self) -> str | None:
        """The class whose turn it is (None when every class has its injections)."""
        n = len(self.classes)
        for k in range(n):
            fault = self.classes[(self._turn + k) % n]
            if self._counts[fault] < self.per_class:
                self._turn = (self._turn + k) % n
                return fault
        return None

    @property
    def done(self) -> bool:
        return self.open is None and self.current is None

    def results(self) -> dict[str, ClassResult]:
        """Per class, in the order given: injections closed, detections, latencies, reasons, false positives."""
        out = {c: ClassResult(c, false_positives=self._fp_by_class[c]) for c in self.classes}
        for o in self.closed:
            r = out[o.injection.fault]
            r.injected += 1
            r.reasons.update(o.reasons)
            r.tags.update(o.tags)
            r.actions.update(o.actions)
            r.nodes_evicted += o.nodes_evicted
            r.acted_rids |= o.acted_rids
            r.acted_on += bool(o.actions)
            if o.detected_step is not None:
                r.detected += 1
                r.latencies.append(o.detected_step - o.step)
                r.via_host_tier += o.first_detection.via == VIA_HOST_TIER
        return out

    # ------------------------------------------------------------------ hook entry point
    def __call__(self, point: str, sim: Simulator) -> None:
        if point == "post_step":
            self.score(sim)
            return
        if point == "post_load":
            if self._after_load:
                self._settle(sim)
            for undo in self._after_load:
                undo()
            self._after_load.clear()
            return
        fault = None if self.open is not None or sim.step_no < self.next_ok else self.current
        if fault is None:
            return
        if fault in faults.HOST_TIER_CLASSES and not sim.host_tier:  # it would wait for a load-back forever
            raise ValueError(f"FaultDriver: {fault} needs a simulator with a host tier (SimConfig.host_pages > 0)")
        at, inject = self._inject[fault]
        if point == at:
            self._settle(sim)
            inject(sim)

    @staticmethod
    def _settle(sim: Simulator) -> None:
        """Launch the manager's pending deferred write (module docstring) before the driver changes engine state."""
        if sim.mgr is not None:
            sim.mgr.flush_pending_write()

    def note_action(self, record: dict) -> None:
        """A protect-mode ``kvcanary.action/1`` record: counted for the open injection, else the last closed."""
        o = self.open if self.open is not None else (self.closed[-1] if self.closed else None)
        if o is None:
            return
        o.actions[record["action"]] += 1
        o.nodes_evicted += int(record.get("nodes_evicted", 0))
        if record.get("request_id") is not None:
            o.acted_rids.add(str(record["request_id"]))

    def start(self, sim: Simulator, inj: Injection, repair: Callable[[], object],
              victims: tuple[Request, ...] = ()) -> None:
        self.open = OpenInjection(inj, sim.step_no, repair, victims)

    @staticmethod
    def _explains(o: OpenInjection, slot: int) -> bool:
        return slot in o.injection.slots or any(slot in r.slots for r in o.victims)

    def score(self, sim: Simulator) -> None:
        """After each forward: attribute the newly reported violations, close the open injection when due."""
        reported = sim.mgr.violations
        new = reported[self.seen:]
        self.seen = len(reported)
        self.recent = [(t, o) for t, o in self.recent if sim.step_no - t < self.grace]
        for v in new:
            owners = ([self.open] if self.open else []) + [o for _, o in self.recent]
            owner = next((o for o in owners if self._explains(o, v.slot)), None)
            if owner is None:
                self.false_positives.append((sim.step_no, v))
                if self.open is not None:
                    self._fp_by_class[self.open.injection.fault] += 1
                continue
            if set(v.reasons) & set(EXPECTED_REASONS[owner.injection.fault]):
                owner.tags[v.tag_name] += 1
                owner.reasons["+".join(v.reasons)] += 1
                if owner.detected_step is None:
                    owner.detected_step = sim.step_no
                    owner.first_detection = v
        o = self.open
        if o is not None and (o.detected_step is not None or sim.step_no - o.step >= self.deadline):
            self._settle(sim)
            o.repair()
            self.closed.append(o)
            self._counts[o.injection.fault] += 1
            self._turn += 1
            self.recent.append((sim.step_no, o))
            self.open = None
            self.next_ok = sim.step_no + self.gap

    # ------------------------------------------------------------------ helpers
    def outlives(self, sim: Simulator, req: Request) -> bool:
        """Whether ``req`` can be kept running until its injection is repaired (``deadline`` forwards and a margin).

        A victim whose repair retires it or restores its mapping must still be running then: one that finished first
        was cached with the fault in it (its stale or redirected slot, its bad K/V), where no repair reaches, and every
        later sweep of the prefix cache reported it again, past the injection's window (the demo once counted 330
        false positives so: a stale_slot_reuse victim 6 tokens short of its context limit)."""
        return sim.can_extend(req, self.deadline + 5)

    def batch_rows(self, sim: Simulator, *, decode_only: bool = False,
                   min_prefix: int = 0) -> list[tuple[int, Request]]:
        """(batch row index, request) of live rows in the current batch that can outlive an injection
        (:meth:`outlives`)."""
        b = sim.batch
        out = []
        prefix_lens, extend_lens = b.prefix_lens.tolist(), b.extend_lens.tolist()
        for i, req in enumerate(sim.batch_reqs):
            if prefix_lens[i] < min_prefix or req.recomputes or not self.outlives(sim, req):
                continue
            if decode_only and (extend_lens[i] != 1 or req.kv_len < len(req.prompt)):
                continue
            out.append((i, req))
        return out

    @staticmethod
    def token_index(sim: Simulator, row: int) -> int:
        return int(sim.batch.extend_lens[:row].sum())

    @staticmethod
    def _restore_entry(sim: Simulator, req: Request, pos: int) -> Callable[[], None]:
        """The repair of a bad ``req_to_token[req.row, pos]``: the request's own slot again, if it still holds the
        row (a finished request's row is zeroed and may belong to another request by now)."""
        row, slot = req.row, req.slots[pos]

        def repair() -> None:
            if req.row == row and req in sim.running:
                sim.req_to_token[row, pos] = slot
        return repair

    @staticmethod
    def _holding(sim: Simulator, content: int) -> list[Node]:
        """The cached nodes with a page of K/V ``content`` (a prefix hash): where a flipped slot's bytes may have
        been backed up or loaded to since."""
        return [n for n in sim.nodes() if content in n.hashes]

    # ------------------------------------------------------------------ one injector per class
    def redirect(self, sim: Simulator) -> None:
        rows = self.batch_rows(sim, min_prefix=3)
        if not rows:
            return
        _, a = self.rng.choice(rows)
        prefix = a.kv_len
        pos = self.rng.randrange(0, prefix - 1)  # never the write seed (prefix - 1)
        cands = [(b, q) for b in sim.running if b is not a for q in range(b.kv_len)
                 if b.prefix_hash(q) != a.prefix_hash(pos) and b.slots[q] != a.slots[pos]]
        if not cands:
            return
        b, q = self.rng.choice(cands)
        sim.extend_life(a, self.deadline + 5)
        inj = faults.redirect_req_to_token(sim.req_to_token, a.row, pos, b.slots[q], step=sim.step_no)
        self.start(sim, inj, self._restore_entry(sim, a, pos))

    def real_kv_flip(self, sim: Simulator) -> None:
        rows = self.batch_rows(sim, min_prefix=1)
        if not rows:
            return
        _, a = self.rng.choice(rows)
        slot = a.slots[self.rng.randrange(a.kv_len)]
        src = sim.sources[self.rng.randrange(len(sim.sources))]
        byte, mask = self.rng.randrange(16), self.rng.randrange(1, 256)  # inside the PARTIAL window
        writer = sim.slot_writers.get(slot)
        content = a.prefix_hash(a.slots.index(slot))  # what the flipped slot holds (the model's K/V of it)
        if sim.host_tier:  # a finished request's page could be backed up, bad, and loaded into another slot
            sim.extend_life(a, self.deadline + 5)
        inj = faults.flip_real_kv(src, slot, byte, mask, step=sim.step_no)

        def repair() -> None:
            if sim.slot_writers.get(slot) == writer:  # not rewritten by another request since (flipping would corrupt)
                faults.flip_real_kv(src, slot, byte, mask, step=sim.step_no, undo=True)
            if sim.host_tier:
                sim.repair_kv(self._holding(sim, content))
        self.start(sim, inj, repair)

    def stale_reuse(self, sim: Simulator) -> None:
        cands = [(a, p) for a in sim.running if a.kv_len >= len(a.prompt) and a.kv_len >= 3 and not a.recomputes
                 and self.outlives(sim, a) for p in range(a.kv_len - 1) if a.slots[p] in a.owned]
        if not cands:
            return
        a, pos = self.rng.choice(cands)
        sim.extend_life(a, self.deadline + 5)
        slot = sim.free_slot_early(a, pos)  # the bug: freed while still mapped; the next allocation reuses it
        inj = faults.keep_stale_mapping(sim.req_to_token, a.row, pos, slot, step=sim.step_no)
        inj = Injection(inj.fault, inj.step, inj.slots + (a.slots[pos + 1],), inj.detail)  # + the successor
        self.start(sim, inj, lambda: sim.abort(a), (a,))

    def cached_idle(self, sim: Simulator) -> None:
        if sim.step_no % self.sweep_every:
            return
        running = {s for r in sim.running for s in r.slots}
        nodes, stack = [], list(sim.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.on_device and n.lock == 0 and sim.slot_of(n.page) not in running:
                nodes.append(n)
        if not nodes:
            return
        node = self.rng.choice(nodes)
        slot = sim.slot_of(node.page, self.rng.randrange(sim.cfg.page_size))
        src = sim.sources[self.rng.randrange(len(sim.sources))]
        byte, mask = self.rng.randrange(16), self.rng.randrange(1, 256)
        if sim.host_tier:  # not backed up (bad) and loaded into another slot before the sweep's report arrives
            sim.pin(node)
        inj = faults.flip_cached_idle(src, slot, byte, mask, step=sim.step_no)

        def repair() -> None:
            if sim.cached(node):  # still cached, not reused
                faults.flip_cached_idle(src, slot, byte, mask, step=sim.step_no, undo=True)
            if sim.host_tier:
                sim.unpin(node)
                sim.repair_kv(self._holding(sim, node.hashes[slot % sim.cfg.page_size]))
        self.start(sim, inj, repair)

    def token_swap(self, sim: Simulator) -> None:
        rows = self.batch_rows(sim, decode_only=True)
        ids = sim.batch.input_ids.tolist()
        token = {i: ids[self.token_index(sim, i)] for i, _ in rows}
        pairs = [(x, y) for x in rows for y in rows if x[0] < y[0] and token[x[0]] != token[y[0]]]
        if not pairs:
            return
        (i, a), (j, b) = self.rng.choice(pairs)
        for r in (a, b):
            sim.extend_life(r, self.deadline + 5)
        batch = sim.batch
        inj = faults.swap_tokens(batch.input_ids, self.token_index(sim, i), self.token_index(sim, j),
                                 out_cache_loc=batch.out_cache_loc, step=sim.step_no)
        self.start(sim, inj, lambda: (sim.abort(a), sim.abort(b)), (a, b))

    def position_skew(self, sim: Simulator) -> None:
        rows = self.batch_rows(sim, decode_only=True, min_prefix=2)
        if not rows:
            return
        i, a = self.rng.choice(rows)
        sim.extend_life(a, self.deadline + 5)
        delta = self.rng.choice([-1, 1, 2, 7])
        inj = faults.skew_position(sim.batch.positions, self.token_index(sim, i), delta,
                                   out_cache_loc=sim.batch.out_cache_loc, step=sim.step_no)
        self.start(sim, inj, lambda: sim.abort(a), (a,))

    def out_of_range(self, sim: Simulator) -> None:
        offset = self.rng.randrange(0, 1000)
        if self._counts[faults.OUT_OF_RANGE_INDEX] % 2 == 0:  # out_cache_loc of a decode token: the write reports it
            rows = self.batch_rows(sim, decode_only=True)
            if not rows:
                return
            i, a = self.rng.choice(rows)
            sim.extend_life(a, self.deadline + 5)
            inj = faults.out_of_range_slot(sim.batch.out_cache_loc, self.token_index(sim, i), sim.num_slots,
                                           offset=offset, step=sim.step_no)
            self.start(sim, inj, lambda: sim.abort(a), (a,))  # its real slot never got a record: retire it
        else:  # a req_to_token entry of a prefix (not the write seed): the plan/verify report it
            rows = self.batch_rows(sim, min_prefix=3)
            if not rows:
                return
            _, a = self.rng.choice(rows)
            pos = self.rng.randrange(0, a.kv_len - 1)
            sim.extend_life(a, self.deadline + 5)
            inj = faults.out_of_range_slot(sim.req_to_token, (a.row, pos), sim.num_slots, offset=offset,
                                           step=sim.step_no)
            inj = Injection(inj.fault, inj.step, inj.slots + (a.slots[pos + 1],), inj.detail)  # + the successor
            self.start(sim, inj, self._restore_entry(sim, a, pos))

    # ------------------------------------------------------------------ host KV tier (pre_load: sim.load is set)
    def _loaded(self, sim: Simulator, load: LoadBack) -> Callable[[], None]:
        """The repair of a bad load-back: the loaded pages' copies as the model wrote them again (those still
        cached; a page evicted and reused since was rewritten by its new owner)."""
        nodes = list(load.nodes)
        return lambda: sim.repair_kv(nodes)

    def host_tier_flip(self, sim: Simulator) -> None:
        load = sim.load
        if load.request.recomputes:
            return
        i = self.rng.randrange(len(load.host_slots))
        host_slot, device_slot = load.host_slots[i], load.device_slots[i]
        node = load.nodes[i // sim.cfg.page_size]
        host_page = node.host_page
        src = sim.host_sources[self.rng.randrange(len(sim.host_sources))]
        byte, mask = self.rng.randrange(16), self.rng.randrange(1, 256)  # inside the PARTIAL window
        sim.extend_life(load.request, self.deadline + 5)  # its lock keeps the loaded pages on the device
        inj = faults.flip_host_copy(src, host_slot, device_slot, byte, mask, step=sim.step_no)
        reload = self._loaded(sim, load)

        def repair() -> None:
            if sim.cached(node) and node.host_page == host_page:  # the host page was not dropped and reused
                faults.flip_host_copy(src, host_slot, device_slot, byte, mask, step=sim.step_no, undo=True)
            reload()
        self.start(sim, inj, repair)

    def load_wrong_slots(self, sim: Simulator) -> None:
        load = sim.load
        if len(set(load.device_slots)) < 2 or load.request.recomputes:  # (one slot cannot be mixed up: wait for a
            return  # longer load-back)
        sim.extend_life(load.request, self.deadline + 5)
        inj, load.kv_device_slots = faults.misdirect_load(load.kv_device_slots, step=sim.step_no)
        self.start(sim, inj, self._loaded(sim, load))

    def load_before_backup(self, sim: Simulator) -> None:
        load = sim.load
        if load.request.recomputes:
            return
        sim.extend_life(load.request, self.deadline + 5)
        inj, undo = faults.stale_host_read(sim.host_sources, load.host_slots, load.device_slots, step=sim.step_no)
        self._after_load.append(undo)  # the backup lands once the load has read the stale bytes
        self.start(sim, inj, self._loaded(sim, load))
