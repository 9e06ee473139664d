"""Protect mode (``KVCANARY_MODE=protect``) in the serving simulator: what :mod:`kvcanary.sglang.protect` does in
sglang's scheduler, done with the simulator's own calls between forwards, over the same engine-agnostic judge
(:func:`kvcanary.runtime.protect.judge`), action records and counters (:mod:`kvcanary.runtime.protect`).

:class:`SimProtect` is a simulator hook (chain it with a fault driver: :func:`chain`):

* ``pre_forward``: the forward's rows, requests, sequence and prefix lengths
  (:class:`kvcanary.runtime.protect.BatchHistory`);
* ``pre_results`` (``hold``, the ``KVCANARY_PROTECT_HOLD=1`` behaviour): wait for the device and drain
  (``mgr.flush()``), then act, before the forward's tokens are appended to its requests;
* ``post_step`` (the forward's tokens appended; sglang's ``get_next_batch_to_run`` hook, the only place it acts
  without ``hold``) and ``pre_schedule``: act on what the asynchronous drain reported since, and evict marked nodes
  their holders have released since. (Chained before a fault driver, it acts before the driver scores and repairs.)

Acting: every request a violation condemns is recomputed (:meth:`Simulator.retract`: its KV released uncached, its
outputs from ``Verdict.keep_len`` on dropped, requeued with the kept tokens as its prompt), or aborted after
``MAX_RECOMPUTES``; a request that finished before protect acted is ``missed`` (the detection window). The
prefix-cache nodes holding a bad slot (:func:`kvcanary.runtime.protect.slot_scoped` violations, and the slots a
condemned request wrote from ``Verdict.taint_from`` on) are dropped with their subtrees (:meth:`Simulator.discard`, host
copies included) once no running request holds them; the running requests that hold one are recomputed from their
prompt. The simulator has no streaming and no speculative decoding, so nothing here needs sglang's abort path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvcanary.runtime import protect
from kvcanary.sim.engine import Node, Request, Simulator

logger = logging.getLogger(__name__)

Hook = Callable[[str, Simulator], None]


def chain(*hooks: Hook | None) -> Hook:
    """One simulator hook that calls ``hooks`` in order (None entries skipped)."""
    live = [h for h in hooks if h is not None]

    def hook(point: str, sim: Simulator) -> None:
        for h in live:
            h(point, sim)
    return hook


class SimProtect:
    """Protect mode over a :class:`~kvcanary.sim.engine.Simulator` and its manager (module docstring).

    Args:
        hold: drain and act before each forward's tokens are appended (``KVCANARY_PROTECT_HOLD=1``).
        keep: forwards of rows kept for attribution (default: the sglang adapter's, ``2 * drain_every + 16``).
        on_action: called with each ``kvcanary.action/1`` record as it is made (the demo attributes them to faults).
    """

    def __init__(self, *, hold: bool = True, keep: int | None = None, drain_every: int = 8,
                 on_action: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.hold = hold
        self.history = protect.BatchHistory(2 * drain_every + 16 if keep is None else keep)
        self.stats = protect.ProtectStats()
        self.records: list[dict[str, Any]] = []
        self.recomputed: list[tuple[Request, Request]] = []  # (retracted request, the request requeued for it)
        self.pending_bad: set[int] = set()  # slots whose cached copies must go
        self.unattributed = 0
        self.on_action = on_action
        self._cursor = 0

    # ------------------------------------------------------------------------------------------ hook
    def __call__(self, point: str, sim: Simulator) -> None:
        if point == "pre_forward":
            b = sim.batch
            if sim.batch_reqs:
                prefix = b.prefix_lens.tolist()
                seq = [p + n for p, n in zip(prefix, b.extend_lens.tolist(), strict=True)]
                self.history.note(sim.step_no, b.req_pool_indices.tolist(), seq, prefix, list(sim.batch_reqs))
        elif point == "pre_results" and self.hold:
            sim.mgr.flush()
            self.act(sim)
        elif point in ("post_step", "pre_schedule"):
            self.act(sim)

    # ------------------------------------------------------------------------------------------ the pass
    def act(self, sim: Simulator) -> None:
        """Act on every violation the manager reported since the last pass, and on marked nodes still held."""
        found = sim.mgr.violations
        if len(found) < self._cursor:
            self._cursor = 0
        new = found[self._cursor:]
        self._cursor = len(found)
        if not new and not self.pending_bad:
            return
        step = sim.step_no
        judgement = protect.judge(new, [self.history])
        self.pending_bad |= judgement.bad_slots
        self.unattributed += len(judgement.unattributed)
        fresh: list[protect.Verdict] = []
        for verdict in judgement.verdicts:
            req: Request = verdict.request
            if req.fate in ("retracted", "aborted"):
                continue  # acted on already (these violations are what it read before)
            fresh.append(verdict)
            if req.row == verdict.row and req.fate == "":  # the KV it wrote over the bad KV: cached copies go too
                self.pending_bad.update(req.slots[verdict.taint_from:req.kv_len])
        marked = self._mark_nodes(sim)
        condemned = {id(v.request) for v in fresh}
        depth_of = {id(n): d for n, d in marked}
        ps = sim.cfg.page_size
        for req in list(sim.running):  # the holders of a marked node: recomputed from their prompt
            depths = [depth_of[id(n)] for n in req.path if id(n) in depth_of]
            if depths and id(req) not in condemned:
                condemned.add(id(req))
                fresh.append(protect.Verdict(req, req.row, min(depths) * ps, min(depths) * ps, step,
                                             reasons={"holds_evicted_node"}))
        for verdict in fresh:
            self._act_on_request(sim, verdict, step)
        nodes, slots, evicted = self._evict(sim, marked)
        if nodes:
            self._record(protect.action_record(
                protect.EVICT, step=step, slots=evicted, nodes_evicted=nodes, slots_evicted=slots,
                detail="prefix-cache nodes holding bad slots, with their subtrees"))
        if fresh or nodes:
            logger.info("%s", self.stats.line(step))

    def _act_on_request(self, sim: Simulator, verdict: protect.Verdict, step: int) -> None:
        req: Request = verdict.request
        keep_outputs = max(0, verdict.keep_len - req.origin_len)
        over_bad = max(0, len(req.output) - keep_outputs)  # outputs generated over the bad KV
        self.stats.observe_window(step - verdict.first_step, over_bad)
        if req.fate == "finished":
            action, detail = protect.MISSED, "it had finished before protect acted (detection window)"
        elif req.recomputes >= protect.MAX_RECOMPUTES:
            sim.abort(req)
            action, detail = protect.ABORT, f"recomputed {req.recomputes} times already"
        else:
            again = sim.retract(req, verdict.keep_len)
            self.recomputed.append((req, again))
            action, detail = protect.RECOMPUTE, f"re-prefilled from {len(again.prompt)} tokens"
        if action == protect.RECOMPUTE:
            self.stats.recomputed += 1
            self.stats.tokens_discarded += over_bad
        elif action == protect.ABORT:
            self.stats.aborted += 1
        else:
            self.stats.missed += 1
            self.stats.tokens_sent += over_bad
        self._record(protect.action_record(
            action, step=step, request_id=str(req.rid), violation_step=verdict.first_step, slots=verdict.slots,
            reasons=verdict.reasons, tokens_discarded=over_bad if action == protect.RECOMPUTE else 0,
            tokens_over_bad_kv=over_bad, tokens_sent=over_bad if action == protect.MISSED else 0, detail=detail))

    # ------------------------------------------------------------------------------------------ nodes
    def _mark_nodes(self, sim: Simulator) -> list[tuple[Node, int]]:
        """(node, depth) of every cached node on the device holding a pending bad slot, shallowest first; keeps in
        ``pending_bad`` only the slots found (a slot no node holds has nothing to evict, and may be reused)."""
        if not self.pending_bad:
            return []
        ps = sim.cfg.page_size
        marked, found = [], set()
        for n in list(sim.device_nodes):
            hit = [s for s in range(sim.slot_of(n.page), sim.slot_of(n.page) + ps) if s in self.pending_bad]
            if hit:
                marked.append((n, n.depth))
                found.update(hit)
        self.pending_bad &= found
        marked.sort(key=lambda m: m[1])
        return marked

    def _evict(self, sim: Simulator, marked: list[tuple[Node, int]]) -> tuple[int, int, set[int]]:
        """Drop each marked node no running request holds, with its subtree. Returns (nodes, slots, slots freed)."""
        nodes = slots = deferred = 0
        freed: set[int] = set()
        ps = sim.cfg.page_size
        for node, _ in marked:
            if not sim.cached(node):
                continue  # gone with an ancestor dropped above
            subtree, stack = [], [node]
            while stack:
                n = stack.pop()
                subtree.append(n)
                stack.extend(n.children.values())
            if any(n.lock for n in subtree):
                deferred += 1
                continue
            pages = [n.page for n in subtree if n.on_device]
            k, p = sim.discard(node)
            nodes += k
            slots += p * ps
            freed.update(sim.slot_of(page, o) for page in pages for o in range(ps))
        self.pending_bad -= freed
        self.stats.nodes_evicted += nodes
        self.stats.slots_evicted += slots
        self.stats.nodes_deferred = deferred
        return nodes, slots, freed

    # ------------------------------------------------------------------------------------------ records
    def _record(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        logger.warning("%s", protect.action_line(record))
        if self.on_action is not None:
            self.on_action(record)
