"""Protect mode on sglang 0.5.12 (``KVCANARY_MODE=protect``): the actions :mod:`kvcanary.runtime.protect` decides, done
with sglang's own scheduler calls between forwards.

Hooks (registered only in protect mode, ``PROTECT_HOOK_TARGETS`` of the version module):

* ``Scheduler.init_cache_with_memory_pool`` (after): one :class:`SchedulerProtect` per scheduler over its
  installations and its prefix cache; setups it cannot protect are refused here, at start-up;
* ``ForwardBatch.init_new`` (after): the forward's rows, requests, sequence and prefix lengths
  (:class:`kvcanary.runtime.protect.BatchHistory`);
* ``Scheduler.get_next_batch_to_run`` (before): act on every violation drained since the last call, where sglang
  itself retracts requests (``update_running_batch``), before the next batch is built;
* ``Scheduler.process_batch_result`` (before, only with ``KVCANARY_PROTECT_HOLD=1``): wait for the device, drain,
  and act before the batch's tokens are appended to any request or sent.

Recompute (the default for a condemned request) is sglang's retraction of one request, done the way
``ScheduleBatch.retract_decode`` / ``release_req`` do it: ``release_kv_cache(req, tree_cache, is_insert=False)`` (its
KV never enters the radix cache), ``req.reset_for_retract()``, the request filtered out of the batches that hold it
(``filter_batch(keep_indices=...)``), and back into the waiting queue through ``Scheduler._add_request_to_queue(req,
is_retracted=True)`` once no result batch still in flight holds it (sglang skips a retracted request's results only
while it stays retracted); the outputs it produced over bad KV are dropped first, so it is re-prefilled from
``origin_input_ids + output_ids`` into fresh slots and decodes them again. A result of it still in flight (overlap
scheduler) is skipped by sglang (``req.is_retracted``).

Abort (sglang's "abort method 3": ``req.to_finish = FINISH_ABORT(message, 500, "KVCanaryViolation")`` and
``req.skip_radix_cache_insert = True``, so its KV is never cached; mid chunked prefill its chunks are cached, and the
nodes holding its bad slots evicted once it releases them: ``_abort``) where a recompute cannot give a clean output:

* speculative decoding (EAGLE): under speculation 0.5.12's ``filter_batch`` can only drop requests from the back of
  the batch (``retract_decode`` says so), so one request in the middle cannot be retracted;
* the request is mid chunked prefill (``Scheduler.chunked_req``): sglang never retracts it, its chunks are cached;
* outputs computed over bad KV were already sent to the client (a streaming request within the detection window):
  they cannot be taken back;
* outputs must be dropped and the request keeps per-token state beside ``output_ids`` that sglang cannot roll back
  (a grammar, logprobs, hidden states) or was built from ``input_embeds`` (sglang drops its outputs on retraction);
* the request was recomputed ``MAX_RECOMPUTES`` times already.

Eviction: the radix-cache nodes that hold a condemned slot are split at that slot (the positions before it stay
cached) and the part from it on is evicted with its subtree (slots freed to the allocator), but only when no running
request holds them (``lock_ref == 0``); a node still held is evicted at a later scheduling point, once released.
"""

from __future__ import annotations

import bisect
import logging
import operator
import pkgutil
import time
import weakref
from http import HTTPStatus
from types import ModuleType

import torch

from kvcanary.report.metrics import metrics_for
from kvcanary.runtime import protect
from kvcanary.runtime.config import Config
from kvcanary.runtime.installation import Installation
from kvcanary.settings import Mode
from kvcanary.sglang.installed import runner_state_of, runner_states
from kvcanary.sglang.radix import cached_nodes

logger = logging.getLogger(__name__)

_ROW_OF = operator.attrgetter("req_pool_idx")
STATE_ATTR = "_kvcanary_protect"  # on the Scheduler: its SchedulerProtect
REQ_ATTR = "_kvcanary_protect"  # on a Req: [step protect last acted on it, recomputes so far, aborted]


class ProtectRefused(RuntimeError):
    """A setup protect mode cannot act in; the message names what to change."""


class Protector:
    """One installation's part: its forwards' rows (history) and the violations of its managers not yet acted on.
    The runner's ``RunnerState.protect`` (:mod:`kvcanary.sglang.installed`)."""

    def __init__(self, inst: Installation) -> None:
        self.inst = inst
        self.history = protect.BatchHistory(2 * inst.config.drain_every + 16)
        self._cursors = [0] * len(inst.groups)

    def note_batch(self, batch, reqs) -> None:
        """``batch`` (a ModelWorkerBatch) is the next forward's (step ``inst.steps + 1``)."""
        seq = getattr(batch, "seq_lens_cpu", None)
        if seq is None or not reqs:
            return
        seq_lens = seq.tolist()
        prefix = getattr(batch, "extend_prefix_lens", None)
        if prefix is not None and len(prefix) == len(seq_lens):
            prefix = list(prefix)
        else:  # decode (and verify): one token fed per row, the prefix is seq_len - 1 (BatchRecord works it out)
            prefix = None
        try:  # (the rows read in C: every request of a built batch has its row)
            rows = list(map(_ROW_OF, reqs))
        except AttributeError:
            rows = [getattr(r, "req_pool_idx", None) for r in reqs]
        self.history.note(self.inst.steps + 1, rows, seq_lens, prefix, list(reqs))

    def take_new(self) -> list:
        """The violations the managers reported since the last call."""
        out = []
        for i, group in enumerate(self.inst.groups):
            found = group.manager.violations
            if len(found) < self._cursors[i]:
                self._cursors[i] = 0
            if len(found) > self._cursors[i]:
                out.extend(found[self._cursors[i]:])
                self._cursors[i] = len(found)
        return out


class SchedulerProtect:
    """Protect mode on one Scheduler: judges what its installations drained and acts (module docstring)."""

    def __init__(self, scheduler, protectors: list[Protector], tree, radix_cls: type | None) -> None:
        self.scheduler_ref = weakref.ref(scheduler)
        self.protectors = protectors
        insts = [p.inst for p in protectors]
        self.config: Config = insts[0].config
        self.tree = tree if radix_cls is not None and type(tree) is radix_cls else None
        self.pending_bad: set[int] = set()  # slots whose cached copies must go (still held by a running request)
        self.stats = protect.ProtectStats()
        self.records: list[dict] = []  # every action record (tests; bounded)
        self.stopped = False
        self._insts = insts
        # Retracted requests waiting for their in-flight results to be processed (sglang skips a retracted request's
        # results only while it is retracted: re-prefilled earlier, it would take a stale token from them).
        self.requeue: list = []

    # ------------------------------------------------------------------------------------------ entry points
    def before_results(self, scheduler) -> None:
        """``KVCANARY_PROTECT_HOLD``: wait for the device, drain every manager, act (before results are processed)."""
        for p in self.protectors:
            for group in p.inst.groups:
                group.manager.flush()
        self.act(scheduler)

    def act(self, scheduler) -> None:
        """Act on what was drained since the last call (and on held nodes still to evict)."""
        if self.stopped:
            return
        new = [(p, p.take_new()) for p in self.protectors]
        if not self.pending_bad and not self.requeue and not any(vs for _, vs in new):
            return
        try:
            if self.requeue:
                self._requeue(scheduler)
            self._act(scheduler, new)
        except Exception as exc:  # (nothing kvcanary does may stop serving: it stops on these runners instead)
            self.stopped = True
            for inst in self._insts:
                if not inst.keeps_serving(exc, "in protect mode's action"):
                    raise

    def _requeue(self, scheduler) -> None:
        """Back into the waiting queue: each retracted request no unprocessed result batch (``result_queue``, the
        overlap scheduler's) still holds."""
        pending = [b for b, _ in getattr(scheduler, "result_queue", ())]
        keep = []
        for req in self.requeue:
            if any(r is req for b in pending for r in b.reqs):
                keep.append(req)
            else:
                scheduler._add_request_to_queue(req, is_retracted=True)
        self.requeue = keep

    # ------------------------------------------------------------------------------------------ the pass
    def _act(self, scheduler, new) -> None:
        step = self._insts[0].steps
        verdicts: list[protect.Verdict] = []
        unattributed = []
        for p, vs in new:
            if not vs:
                continue
            judgement = protect.judge(vs, [p.history])
            self.pending_bad |= judgement.bad_slots
            verdicts += judgement.verdicts
            unattributed += judgement.unattributed
        batches = self._batches(scheduler)
        r2t = self._insts[0].req_to_token
        fresh: list[protect.Verdict] = []
        for verdict in verdicts:
            req = verdict.request
            mark = getattr(req, REQ_ATTR, None)
            if mark is not None and (mark[0] >= verdict.first_step or mark[2]):
                continue  # acted on since that forward (these rows are what it read before), or aborted
            fresh.append(verdict)
            row = getattr(req, "req_pool_idx", None)
            if row == verdict.row and not req.finished():  # its KV from taint_from on: cached copies go too
                end = int(getattr(req, "kv_committed_len", 0) or 0)
                if end > verdict.taint_from:
                    self.pending_bad.update(int(s) for s in r2t[row, verdict.taint_from:end].tolist())
        marked = self._mark_nodes()
        condemned = {id(v.request) for v in fresh}
        for req, depth in self._holders(scheduler, batches, marked):
            mark = getattr(req, REQ_ATTR, None)
            if mark is not None and mark[2]:
                continue  # aborted already: it releases the node when it finishes (not aborted again each pass)
            if id(req) not in condemned:
                condemned.add(id(req))
                row = getattr(req, "req_pool_idx", None)
                fresh.append(protect.Verdict(req, -1 if row is None else row, depth, depth, step,
                                             reasons={"holds_evicted_node"}))
        acted = [self._act_on_request(scheduler, batches, v, step) for v in fresh]
        nodes, slots = self._evict(marked)
        if nodes:
            self._record(protect.action_record(protect.EVICT, step=step, slots=sorted(self._last_evicted),
                                               nodes_evicted=nodes, slots_evicted=slots,
                                               detail="prefix-cache nodes holding bad slots, from the bad slot on "
                                                      "with their subtrees", rank=self._rank()))
        for v in unattributed:
            logger.warning("kvcanary protect: violation at step %d on row %s: its request is no longer known "
                           "(older than the %d forwards kept); not acted on", v.step, v.request_row,
                           self.protectors[0].history.keep)
        if fresh or nodes:
            logger.info("%s", self.stats.line(step))
        recomputed = sum(1 for a in acted if a == protect.RECOMPUTE)
        aborted = sum(1 for a in acted if a == protect.ABORT)
        if recomputed or aborted:
            inst = self._insts[0]
            (inst.metrics or metrics_for(inst.manager.rank, inst.model_name)).add_actions(recomputed=recomputed,
                                                                                          aborted=aborted)

    # ------------------------------------------------------------------------------------------ requests
    @staticmethod
    def _batches(scheduler) -> list:
        out = []
        for name in ("running_batch", "last_batch", "cur_batch"):
            b = getattr(scheduler, name, None)
            if b is not None and getattr(b, "reqs", None) is not None and not any(b is o for o in out):
                out.append(b)
        return out

    def _holders(self, scheduler, batches, marked) -> list[tuple[object, int]]:
        """Requests (running, or mid chunked prefill) whose matched prefix passes a marked node, with the depth
        where its bad part starts."""
        if not marked:
            return []
        depth_of = {id(node): depth for node, _, depth in marked}
        reqs = [r for b in batches for r in b.reqs]
        chunked = getattr(scheduler, "chunked_req", None)
        if chunked is not None:
            reqs.append(chunked)
        out, seen = [], set()
        for req in reqs:
            if id(req) in seen or req.finished():
                continue
            seen.add(id(req))
            node, best = getattr(req, "last_node", None), None
            while node is not None:
                d = depth_of.get(id(node))
                if d is not None:
                    best = d if best is None else min(best, d)
                node = node.parent
            if best is not None:
                out.append((req, best))
        return out

    def _act_on_request(self, scheduler, batches, verdict: protect.Verdict, step: int) -> str:
        req = verdict.request
        prompt = len(req.origin_input_ids)
        keep_outputs = max(0, verdict.keep_len - prompt)
        over_bad = max(0, len(req.output_ids) - keep_outputs)  # outputs computed over the bad KV (appended)
        sent = int(getattr(req, "send_token_offset", 0) or 0)
        sent_bad = max(0, min(sent, len(req.output_ids)) - keep_outputs)
        self.stats.observe_window(step - verdict.first_step, over_bad)
        mark = getattr(req, REQ_ATTR, None) or [0, 0, False]
        holding = [b for b in batches if any(r is req for r in b.reqs)]
        chunked = getattr(scheduler, "chunked_req", None) is req
        waiting = any(r is req for r in getattr(scheduler, "waiting_queue", ()))
        if req.finished():
            action, detail = protect.MISSED, "it had finished before protect acted (detection window)"
        elif not holding and not chunked and not waiting:
            action, detail = protect.MISSED, "not found in the scheduler's batches or queues"
        else:
            why_not = self._why_not_recompute(scheduler, req, chunked, keep_outputs, sent, mark)
            if why_not is None:
                self._recompute(scheduler, req, holding, keep_outputs, waiting)
                action, detail = protect.RECOMPUTE, f"re-prefilled from {prompt + keep_outputs} tokens"
            else:
                self._abort(req, protect.abort_message(verdict.first_step, why_not), chunked=chunked)
                action, detail = protect.ABORT, why_not
        if action == protect.RECOMPUTE:
            self.stats.recomputed += 1
            self.stats.tokens_discarded += over_bad
            setattr(req, REQ_ATTR, [step, mark[1] + 1, False])
        else:
            if action == protect.ABORT:
                self.stats.aborted += 1
            else:
                self.stats.missed += 1
            self.stats.tokens_sent += over_bad if action == protect.MISSED else sent_bad
            setattr(req, REQ_ATTR, [step, mark[1], action == protect.ABORT])
        self._record(protect.action_record(
            action, step=step, request_id=getattr(req, "rid", None), violation_step=verdict.first_step,
            slots=verdict.slots, reasons=verdict.reasons, tokens_discarded=over_bad if action == protect.RECOMPUTE
            else 0, tokens_over_bad_kv=over_bad, tokens_sent=over_bad if action == protect.MISSED else sent_bad,
            detail=detail, rank=self._rank()))
        return action

    @staticmethod
    def _why_not_recompute(scheduler, req, chunked: bool, keep_outputs: int, sent: int, mark) -> str | None:
        spec = getattr(scheduler, "spec_algorithm", None)
        if spec is not None and not spec.is_none():
            return "speculative decoding: sglang 0.5.12 retracts only from the back of the batch"
        if chunked:
            return "mid chunked prefill"
        if mark[1] >= protect.MAX_RECOMPUTES:
            return f"recomputed {mark[1]} times already"
        if getattr(req, "input_embeds", None) is not None:
            return "built from input_embeds (sglang drops its outputs on retraction)"
        drops = len(req.output_ids) > keep_outputs
        if drops and sent > keep_outputs:
            return f"{sent - keep_outputs} token(s) computed over the bad KV were already sent"
        if drops and (getattr(req, "grammar", None) is not None or getattr(req, "return_logprob", False)
                      or getattr(req, "return_hidden_states", False)):
            return "its grammar, logprob or hidden-state outputs cannot be rolled back"
        if getattr(req, "to_finish", None) is not None:
            return "already finishing"
        return None

    def _recompute(self, scheduler, req, holding, keep_outputs: int, waiting: bool) -> None:
        """sglang's retraction of ``req`` (ScheduleBatch.release_req without its eviction), outputs past
        ``keep_outputs`` dropped, back into the waiting queue."""
        from sglang.srt.mem_cache.common import release_kv_cache

        if not waiting:
            if getattr(req, "req_pool_idx", None) is not None:
                self._free_uncovered_kv(scheduler, req)
                release_kv_cache(req, scheduler.tree_cache, is_insert=False)
            req.reset_for_retract()
        del req.output_ids[keep_outputs:]
        for b in holding:
            b.filter_batch(keep_indices=[i for i, r in enumerate(b.reqs) if r is not req])
            if hasattr(b, "batch_is_full"):
                b.batch_is_full = False
        if not waiting:
            self.requeue.append(req)  # queued once no in-flight result holds it (_requeue)

    @staticmethod
    def _free_uncovered_kv(scheduler, req) -> None:
        """Free the request's committed KV slots past its tokens (``origin_input_ids + output_ids``).

        sglang's release (``cache_finished_req``) frees the slots of the request's tokens only. Where sglang itself
        retracts (and protect acts without hold: before the next batch is built) every committed slot has its token.
        With ``KVCANARY_PROTECT_HOLD`` protect acts inside ``process_batch_result``, after the overlap scheduler
        launched the next batch: that batch committed one more slot per decoding request (its input is this batch's
        sampled token, not yet appended), which the release would leak (H200 phase 23, 2026-12-02: sglang's idle
        check found the pool short). The slot's KV is written by the batch in flight; a later allocation of it is
        written by a later forward on the same stream.

        Paged KV: the allocator frees whole pages, and the release frees the page of the request's last token with
        it; only the slots on later pages are freed here (as sglang's own release aligns its over-allocated tail:
        ``ceil_align(start, page_size)``), else a shared page would be freed twice."""
        covered = len(req.origin_input_ids) + len(req.output_ids)
        committed = int(getattr(req, "kv_committed_len", 0) or 0)
        if committed <= covered:
            return
        allocator = scheduler.token_to_kv_pool_allocator
        page = max(int(getattr(allocator, "page_size", 1) or 1), 1)
        first = -(-covered // page) * page  # the first slot on a page no token of the request is on
        if first < committed:
            allocator.free(scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, first:committed])
        req.kv_committed_len = covered
        req.kv_allocated_len = max(int(req.kv_allocated_len) - (committed - covered), covered)

    @staticmethod
    def _abort(req, message: str, chunked: bool = False) -> None:
        """sglang's abort method 3 (``to_finish``: the request finishes at its next result, its KV released by
        sglang's own code). Its KV is kept out of the radix cache (``skip_radix_cache_insert``), except mid chunked
        prefill: there sglang advances the request's prefix between chunks only by caching what it computed
        (``maybe_cache_unfinished_req``, which that flag turns off), so with it each later chunk would be computed
        again into newly allocated slots while the earlier ones leak, until the pool runs out (H200 phases 22/23,
        2026-12-02). Its cached chunks are condemned instead: the nodes holding the bad slots (and, as their
        subtree, every chunk after them) are evicted once the request releases them."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if getattr(req, "to_finish", None) is None:
            req.to_finish = FINISH_ABORT(message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
                                         err_type=protect.ABORT_ERR_TYPE)
        if not chunked:
            req.skip_radix_cache_insert = True

    # ------------------------------------------------------------------------------------------ nodes
    def _mark_nodes(self) -> list[tuple[object, int, int]]:
        """(node, index of its first pending bad slot, depth of that slot) of every radix node holding one; keeps in
        ``pending_bad`` only the slots found (a slot no node holds has nothing to evict, and may be reused)."""
        tree = self.tree
        if tree is None or not self.pending_bad:
            self.pending_bad.clear()
            return []
        nodes = [(node, depth) for node, depth, _ in cached_nodes(tree)]
        if not nodes:
            self.pending_bad.clear()
            return []
        values = [node.value for node, _ in nodes]
        flat = torch.cat([v.to(torch.int64) for v in values])
        bad = torch.tensor(sorted(self.pending_bad), dtype=torch.int64, device=flat.device)
        hits = torch.isin(flat, bad).nonzero().flatten().tolist()  # (one device read)
        starts, total = [], 0
        for v in values:
            starts.append(total)
            total += int(v.shape[0])
        found_slots = set(flat[hits].tolist()) if hits else set()
        marked, seen = [], set()
        for h in hits:
            k = bisect.bisect_right(starts, h) - 1
            if k in seen:
                continue
            seen.add(k)
            node, depth = nodes[k]
            index = h - starts[k]
            marked.append((node, index, depth + index))
        self.pending_bad &= found_slots
        marked.sort(key=lambda m: m[2])
        return marked

    def _evict(self, marked) -> tuple[int, int]:
        """Evict each marked node no request holds, from its bad slot on with its subtree. Returns (nodes, slots)."""
        tree = self.tree
        self._last_evicted: set[int] = set()
        nodes = slots = 0
        deferred = 0
        for node, index, _ in marked:
            parent = node.parent
            if parent is None or node.value is None or not any(c is node for c in parent.children.values()):
                continue  # gone with an ancestor evicted above, or evicted by sglang
            if node.lock_ref > 0:
                deferred += 1
                continue
            n, s = self._evict_from(tree, node, index)
            nodes += n
            slots += s
        if nodes:  # (the sweep follows these splits and deletions through the tree's own methods: radix_index)
            self.pending_bad -= self._last_evicted
        self.stats.nodes_evicted += nodes
        self.stats.slots_evicted += slots
        self.stats.nodes_deferred = deferred
        return nodes, slots

    def _evict_from(self, tree, node, index: int) -> tuple[int, int]:
        page = max(int(getattr(tree, "page_size", 1) or 1), 1)
        index -= index % page
        if index > 0:
            tree._split_node(node.key, node, index)  # the head keeps [0, index); ``node`` is now the bad tail
        order, stack = [], [node]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        nodes = slots = 0
        allocator = tree.token_to_kv_pool_allocator
        for n in reversed(order):  # leaves first
            value = n.value
            if value is not None and value.numel():
                self._last_evicted.update(int(s) for s in value.tolist())
                allocator.free(value)
                slots += int(value.numel())
            tree._delete_leaf(n)
            record_remove = getattr(tree, "_record_remove_event", None)
            if record_remove is not None:
                record_remove(n)
            nodes += 1
        return nodes, slots

    # ------------------------------------------------------------------------------------------ records
    def _rank(self) -> dict | None:
        return self._insts[0].manager.rank

    def _record(self, record: dict) -> None:
        if len(self.records) < 65536:
            self.records.append(record)
        logger.warning("%s", protect.action_line(record))
        self._insts[0].manager.reporter.record(record)


# ---------------------------------------------------------------------------------------------- attach, hooks
def state_of(scheduler) -> SchedulerProtect | None:
    return getattr(scheduler, STATE_ATTR, None)


def check_evictable(version: ModuleType, tree, radix, radix_cls: type) -> None:
    """Refuse (:class:`ProtectRefused`) a prefix cache whose cached slots kvcanary checks but protect cannot evict
    from: protect evicts bad nodes from sglang's exact RadixCache only, and a cache it could not evict from would
    hand the bad slots to the next request that matches them (an SWARadixCache: its full slots are swept since
    2026-12-02). No prefix cache (``--disable-radix-cache``) needs no eviction."""
    cached = version.swept_tree(tree) if tree is not None else None
    if cached is not None and type(radix) is not radix_cls:
        raise ProtectRefused(f"KVCANARY_MODE=protect with the prefix cache {type(cached).__name__}: evicting its nodes "
                             f"is not taught yet (protect evicts from sglang's {radix_cls.__name__} only); use "
                             "KVCANARY_MODE=log, or --disable-radix-cache")


def check_single_group(insts) -> None:
    """Refuse (:class:`ProtectRefused`) a pool of several groups (a sliding-window pool: a full and a window group):
    the window group numbers its slots apart from the full group's and the prefix cache's, so protect's slot-scoped
    actions would read a window slot as a full one, and protect has not been run on such a pool."""
    for inst in insts:
        if len(inst.groups) > 1:
            raise ProtectRefused(f"KVCANARY_MODE=protect with a KV pool of {len(inst.groups)} groups "
                                 f"({', '.join(g.spec.name for g in inst.groups)}: a sliding-window model): protect "
                                 "acts on one slot numbering and has not been run there; use KVCANARY_MODE=log")


def attach(scheduler, version: ModuleType) -> SchedulerProtect | None:
    """After ``Scheduler.init_cache_with_memory_pool``: protect the scheduler's installations (refusing setups it
    cannot act in, by name)."""
    tree, r2t = version.scheduler_cache(scheduler)
    mine = [s for s in runner_states()
            if (r2t is None or s.inst.req_to_token is r2t) and s.inst.config.mode is Mode.PROTECT]
    if not mine:
        return None
    server_args = getattr(scheduler, "server_args", None)
    if getattr(server_args, "enable_hierarchical_cache", False):
        raise ProtectRefused("KVCANARY_MODE=protect with --enable-hierarchical-cache: evicting HiCache's host copies "
                             "of bad nodes is not taught yet; use KVCANARY_MODE=log or drop the flag")
    if mine[0].inst.config.protect_hold and getattr(server_args, "disable_overlap_schedule", False):
        raise ProtectRefused("KVCANARY_PROTECT_HOLD=1 with --disable-overlap-schedule: without the overlap scheduler "
                             "sglang processes a batch's results in the batch being processed, where a request "
                             "cannot be retracted; drop the flag or KVCANARY_PROTECT_HOLD")
    check_single_group([s.inst for s in mine])
    radix_cls = pkgutil.resolve_name(version.RADIX_CACHE_CLASS)
    radix = version.radix_cache(tree) if tree is not None else None
    check_evictable(version, tree, radix, radix_cls)
    protectors = []
    for runner_state in mine:
        if runner_state.protect is None:
            runner_state.protect = Protector(runner_state.inst)
        protectors.append(runner_state.protect)
    state = SchedulerProtect(scheduler, protectors, radix, radix_cls)
    setattr(scheduler, STATE_ATTR, state)
    logger.info("kvcanary: protect mode on (%d pool(s), prefix cache %s, hold=%s): a violation's request is "
                "recomputed or aborted, the radix nodes holding bad slots evicted", len(mine),
                type(tree).__name__ if tree is not None else "-", str(mine[0].inst.config.protect_hold).lower())
    return state


class ProtectHooks:
    """The protect-mode hooks of one version module (``PROTECT_HOOK_TARGETS``), bound once."""

    def __init__(self, version: ModuleType) -> None:
        self.version = version
        self.table = tuple((target, getattr(self, name)) for name, target in version.PROTECT_HOOK_TARGETS.items())

    def protect_after_init_cache(self, result, scheduler, *args, **kwargs):
        attach(scheduler, self.version)
        return result

    def protect_after_forward_batch_init(self, result, cls, batch, model_runner, *args, **kwargs):
        runner_state = runner_state_of(model_runner)
        protector = runner_state.protect if runner_state is not None else None
        if protector is not None and protector.inst.stopped is None:
            inst = protector.inst
            t0 = time.perf_counter_ns()
            try:
                protector.note_batch(batch, self.version.batch_requests(batch))
            except Exception as exc:
                if not inst.keeps_serving(exc, "in protect mode's batch hook"):
                    raise
            inst.account_batch_init(time.perf_counter_ns() - t0)
        return result

    def protect_before_schedule(self, scheduler, *args, **kwargs):
        state = state_of(scheduler)
        if state is not None:
            state.act(scheduler)
        return None

    def protect_before_results(self, scheduler, *args, **kwargs):
        state = state_of(scheduler)
        if state is not None and state.config.protect_hold:
            state.before_results(scheduler)
        return None


_HOOKS: dict[str, ProtectHooks] = {}


def hooks_for(version: ModuleType) -> ProtectHooks:
    """The one ProtectHooks of ``version`` in this process; ProtectRefused when the version has no protect targets."""
    if not version.PROTECT_HOOK_TARGETS:
        raise ProtectRefused(f"KVCANARY_MODE=protect is supported on sglang 0.5.12 only (installed: "
                             f"{version.SGLANG_VERSION}); use KVCANARY_MODE=log")
    found = _HOOKS.get(version.__name__)
    if found is None or found.version is not version:
        found = _HOOKS[version.__name__] = ProtectHooks(version)
    return found
