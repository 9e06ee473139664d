"""KVCANARY_FAULT in a real sglang engine (tests only): the :class:`~kvcanary.runtime.faults.FaultPlan` of this rank,
:class:`SglangFaultInjection` (a runner's injection state and the engine facts its injector reads),
:func:`inject_fault` (one fault class into live engine state before a forward, undone after it) and
:func:`repair_token_swaps` (rewrite a token swap's records once a later forward has verified them).

The engine-agnostic injectors are :mod:`kvcanary.runtime.faults`; the manager is driven through its public API only
(``sweeps_on_next_step``, ``chain_position_assert_on``, ``rewrite_last_forward``, ``before_forward``/``after_forward``).
"""

from __future__ import annotations

import logging
import random
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcanary.runtime.faults import FaultInjectionState
from kvcanary.runtime.installation import Installation
from kvcanary.sglang.batches import i64, mode_name
from kvcanary.sglang.radix import idle_cached_slots

if TYPE_CHECKING:
    from kvcanary.runtime.faults import FaultPlan, Injection
    from kvcanary.sglang.contract import VersionModule
    from kvcanary.sglang.installed import RunnerState

logger = logging.getLogger(__name__)

# How many tokens a row's request must still decode for a token swap to be re-verified by a later forward
# (one token of margin for the overlap scheduler's lagging output_ids, one for the forward itself).
SWAP_MIN_REMAINING = 3
# Forwards a fault can be injected before (EAGLE's TARGET_VERIFY: the target pool's faults under speculation).
INJECTABLE_MODES = ("EXTEND", "DECODE", "MIXED", "TARGET_VERIFY")
# A request still being prefilled in chunks (Req.is_chunked > 0) has this many forwards ahead, for the injector.
CHUNKED_REMAINING = 1 << 30


def fault_plan_from_env() -> FaultPlan | None:
    try:
        from kvcanary.runtime.faults import FaultPlan
    except ImportError:  # pragma: no cover - faults ships with kvcanary
        return None
    return FaultPlan.from_env()


def fault_plan_for_rank(rank: int) -> FaultPlan | None:
    """The fault plan this rank runs: none when KVCANARY_FAULT_RANK names another rank."""
    plan = fault_plan_from_env()
    if plan is not None and not plan.applies_to(rank):
        logger.info("kvcanary: fault injection is for rank %d; rank %d injects nothing", plan.rank, rank)
        return None
    return plan


def rows_remaining(reqs) -> dict[int, int]:
    """req_to_token row -> how many tokens its request still decodes (sglang ``Req``: ``req_pool_idx``,
    ``is_chunked``, ``sampling_params.max_new_tokens``, ``output_ids``), so the injector can pick rows whose next
    forward re-verifies what it corrupts. Under the overlap scheduler output_ids may lag one step behind; the
    injector keeps a margin (SWAP_MIN_REMAINING)."""
    return {
        int(req.req_pool_idx): (CHUNKED_REMAINING if getattr(req, "is_chunked", 0) > 0 else
                                int(req.sampling_params.max_new_tokens or 0) - len(req.output_ids))
        for req in reqs if getattr(req, "req_pool_idx", None) is not None
    }


@dataclass
class SwapRepair:
    """A token swap's row, to be rewritten with its true tokens once its next forward has verified it."""

    row: int
    position: int  # the swapped token's position (its slot holds the swapped record)
    req: object  # the engine's Req in that row
    step: int  # the injection's forward


@dataclass(eq=False)
class SglangFaultInjection(FaultInjectionState):
    """Fault injection on one sglang ModelRunner: the engine-agnostic state (plan, injections, pending class, undo
    actions) and the engine facts the injector reads, which the batch hook records (:meth:`note_batch`)."""

    # req_to_token row -> tokens its request still decodes, and the engine's request objects of this forward's rows,
    # in order
    row_remaining: dict[int, int] = field(default_factory=dict)
    batch_reqs: list = field(default_factory=list)
    pending_repairs: list[SwapRepair] = field(default_factory=list)  # swaps whose records are rewritten later

    def note_batch(self, reqs) -> None:
        """The requests of the batch the next forward runs (sglang ``Req``s, in row order)."""
        self.batch_reqs = list(reqs)
        self.row_remaining = rows_remaining(reqs)


def repair_token_swaps(inst: Installation, faults: SglangFaultInjection, fb) -> None:
    """After a forward: rewrite the records of each swapped row that this forward verified.

    A token swap leaves the canary records of its rows (the swapped token, and every later record, whose chain
    hash descends from it) disagreeing with the tokens the engine keeps. The row's next forward reports it
    (verify_token); after that the records must agree with the engine again, or the disagreement outlives the
    injection: when the finished request enters the RadixCache after another request's identical prefix, the
    tree links the first slot after the shared part to that request's record, and the sweep reports it. So,
    once the row's next decode forward has run, its records from the swapped position through this forward's
    token are written again with the true tokens (plan + verify + write of a one-row extend, stream-ordered
    after the forward's own canary kernels).
    """
    if getattr(fb.forward_mode, "name", "") != "DECODE" or fb.seq_lens_cpu is None:
        return
    keep = []
    for rep in faults.pending_repairs:
        if rep.step >= inst.steps:  # the injecting forward itself (steps counts finished forwards)
            keep.append(rep)
            continue
        if getattr(rep.req, "req_pool_idx", None) != rep.row:
            logger.warning("kvcanary: token swap of step %d: row %d left before its repair; its records stay swapped",
                           rep.step, rep.row)
            continue
        k = next((i for i, r in enumerate(faults.batch_reqs) if r is rep.req), None)
        if k is None:
            keep.append(rep)
            continue
        last = int(fb.seq_lens_cpu[k]) - 1  # the position this forward wrote for the row
        known = (list(rep.req.origin_input_ids) + list(rep.req.output_ids))[rep.position : last]
        if len(known) != last - rep.position:  # output_ids lag further than one token: retry next forward
            keep.append(rep)
            continue
        device = inst.req_to_token.device
        ids = torch.cat([torch.tensor(known, dtype=torch.int64, device=device), i64(fb.input_ids[k : k + 1])])
        n = last + 1 - rep.position
        one_row = types.SimpleNamespace(
            forward_mode=types.SimpleNamespace(name="EXTEND"), out_cache_loc_swa=None,
            req_pool_indices=torch.tensor([rep.row], dtype=torch.int64, device=device),
            extend_prefix_lens=torch.tensor([rep.position], dtype=torch.int64, device=device),
            extend_seq_lens=torch.tensor([n], dtype=torch.int64, device=device),
            out_cache_loc=i64(inst.req_to_token[rep.row, rep.position : last + 1]),
        )
        positions = torch.arange(rep.position, last + 1, dtype=torch.int64, device=device)
        for group, view in zip(inst.groups, inst.to_views(one_row, ids, positions), strict=False):
            group.manager.before_forward(view)
            group.manager.after_forward(view)
    faults.pending_repairs = keep


def verified_slots(inst: Installation, fb) -> set[int]:
    """The slots this forward's verify reads: every batch row's cached prefix (reads slots on the host)."""
    if fb.req_pool_indices is None or mode_name(fb) not in INJECTABLE_MODES:
        return set()
    _, rows, prefixes, _ = batch_rows(fb)
    out: set[int] = set()
    for row, prefix in zip(rows, prefixes, strict=False):
        if row > 0 and prefix > 0:
            out.update(inst.req_to_token[row, :prefix].tolist())
    return out


def batch_rows(fb) -> tuple[str, list[int], list[int], list[int]]:
    """(mode name, req_to_token rows, cached prefix length per row, extend length per row) of a ForwardBatch."""
    mode = getattr(fb.forward_mode, "name", "")
    rows = fb.req_pool_indices.tolist()
    if mode == "DECODE":
        return mode, rows, fb.positions.tolist()[: len(rows)], [1] * len(rows)
    if mode == "TARGET_VERIFY":  # EAGLE: each row writes draft_token_num tokens after its seq_lens
        n = int(fb.input_ids.shape[0]) // max(len(rows), 1)
        return mode, rows, fb.seq_lens.tolist(), [n] * len(rows)
    return mode, rows, fb.extend_prefix_lens.tolist(), fb.extend_seq_lens.tolist()


def inject_fault(state: RunnerState, step: int, fb, cls: str | None, version: VersionModule) -> Injection | None:
    """KVCANARY_FAULT in a real engine: inject ``cls`` (default: the plan's pick) into live state of ``state``'s
    runner (its ``faults`` set) before this forward; returns the Injection, or None when this batch cannot take it
    (the class then stays pending). ``version`` is the sglang version module (its ``radix_cache`` finds the
    RadixCache behind the prefix cache).

    Every class is chosen so the canary must see it, and undone so it corrupts nothing beyond the slots it
    names (a later violation on any other slot is a false positive):

    * req_to_token_redirect: ``req_to_token[row, p]`` of a batch row with a cached prefix of >= 3 tokens
      (1 <= p <= prefix-2) -> the row's position-0 slot; this forward's verify sees the redirected entry
      and its successor (chain hash); restored after the forward (the write seeds from prefix-1, untouched).
    * real_kv_flip: byte 0 of the first real-KV source of the last cached slot of a batch row (inside the
      PARTIAL window); this forward's verify sees it; flipped back after the forward.
    * cached_idle_corruption: only before a forward whose step runs the sweep; a RadixCache slot no request
      locks and this forward does not verify; the sweep sees it; flipped back after the sweep.
    * token_swap: decode only; the input tokens of two rows whose requests decode >= SWAP_MIN_REMAINING more
      tokens (needs KVCANARY_VERIFY_TOKENS): their next forward's verify sees the stored tokens (verify_token);
      after that forward the rows' records are rewritten with the true tokens (``repair_token_swaps``).
    * position_skew: extend/mixed only (never graph-replayed); +1 on the last token of a row with a cached
      prefix (the chain-position assert is armed there): this forward's write reports it (write_position);
      after the forward the position and the canary records of the forward are rewritten as the engine
      meant them, so the successor written next is not reported too.
    * host_tier_flip, load_wrong_slots, load_before_backup (HiCache only): armed here, done to the next
      load-back's copies inside ``start_loading`` and handed over on the forward that consumes that load (its
      verify reads the loaded slots); after that forward the host bytes are restored and the slots loaded again
      (:class:`kvcanary.sglang.hicache.LoadFaults`).
    """
    from kvcanary.runtime import faults

    inst, injector = state.inst, state.faults
    assert injector is not None, "inject_fault: the runner injects no faults"
    if cls is None:
        cls = injector.plan.pick(step)
    if cls in faults.HOST_TIER_CLASSES:  # (HiCache: done inside the next load-back, kvcanary.sglang.hicache)
        follower = state.host_tier
        if follower is not None and follower.faults is not None:
            return follower.faults.injection_for(injector, cls, step, verified_slots(inst, fb))
        logger.warning("kvcanary: fault %s needs HiCache (--enable-hierarchical-cache); skipped", cls)
        injector.skip_pending()
        return None
    mode = mode_name(fb)
    if mode not in INJECTABLE_MODES or fb.req_pool_indices is None or fb.input_ids is None:
        return None
    mode, rows, prefixes, extends = batch_rows(fb)
    r2t = inst.req_to_token
    sources = inst.groups[0].spec.sources
    rng = random.Random(step)

    if cls == faults.REQ_TO_TOKEN_REDIRECT:
        live = [(r, p) for r, p in zip(rows, prefixes, strict=False) if r > 0 and p >= 3]
        if not live:
            return None
        row, prefix = rng.choice(live)
        pos = rng.randrange(1, prefix - 1)
        old = int(r2t[row, pos])
        inj = faults.redirect_req_to_token(r2t, row, pos, int(r2t[row, 0]), step=step)

        def undo_redirect(row=row, pos=pos, old=old):
            r2t[row, pos] = old

        injector.undo_after_forward(undo_redirect)
        return inj

    if cls == faults.REAL_KV_FLIP:
        live = [(r, p) for r, p in zip(rows, prefixes, strict=False) if r > 0 and p >= 1]
        if not live or not sources:
            return None
        row, prefix = rng.choice(live)
        slot = int(r2t[row, prefix - 1])
        inj = faults.flip_real_kv(sources[0], slot, byte=0, step=step)
        injector.undo_after_forward(lambda slot=slot: _flip_back(sources[0], slot))
        return inj

    if cls == faults.CACHED_IDLE_CORRUPTION:
        tree = version.swept_tree(state.prefix_cache) if state.prefix_cache is not None else None
        if not sources or tree is None or not inst.manager.sweeps_on_next_step():
            return None  # (or wait for the forward whose step sweeps)
        verified = set()
        for r, p in zip(rows, prefixes, strict=False):
            if r > 0 and p > 0:
                verified.update(r2t[r, :p].tolist())
        idle = [s for s in idle_cached_slots(tree) if s > 0 and s not in verified]
        if not idle:
            return None
        slot = rng.choice(idle)
        inj = faults.flip_cached_idle(sources[0], slot, byte=0, step=step)
        injector.undo_after_forward(lambda slot=slot: _flip_back(sources[0], slot), after_step=True)
        return inj

    if cls == faults.TOKEN_SWAP:
        if mode != "DECODE" or not inst.verify_tokens:
            return None
        ids = fb.input_ids.tolist()
        ok = [i for i, r in enumerate(rows) if r > 0 and injector.row_remaining.get(r, 0) >= SWAP_MIN_REMAINING]
        rng.shuffle(ok)
        pair = next(((i, j) for i in ok for j in ok if i < j and ids[i] != ids[j]), None)
        if pair is None:
            return None
        i, j = pair
        inj = faults.swap_tokens(fb.input_ids, i, j, out_cache_loc=fb.out_cache_loc, step=step)
        for b in (i, j):
            req = injector.batch_reqs[b] if b < len(injector.batch_reqs) else None
            if req is not None and getattr(req, "req_pool_idx", None) == rows[b]:
                injector.pending_repairs.append(SwapRepair(rows[b], prefixes[b], req, step))

        def undo_swap(i=i, j=j, a=ids[i], b=ids[j]):
            fb.input_ids[i], fb.input_ids[j] = a, b  # the canary records keep the swapped tokens

        injector.undo_after_forward(undo_swap)
        return inj

    if cls == faults.POSITION_SKEW:
        if mode in ("DECODE", "TARGET_VERIFY"):  # (a verify graph's positions were copied before this hook)
            return None
        starts = [0]
        for e in extends:
            starts.append(starts[-1] + e)
        locs = fb.out_cache_loc.tolist()
        cand = [starts[k + 1] - 1 for k, (r, p, e) in enumerate(zip(rows, prefixes, extends, strict=False))
                if r > 0 and p >= 1 and e >= 1 and locs[starts[k + 1] - 1] > 0]
        if not cand or not inst.manager.chain_position_assert_on():
            return None
        i = rng.choice(cand)
        old = int(fb.positions[i])
        inj = faults.skew_position(fb.positions, i, 1, out_cache_loc=fb.out_cache_loc, step=step)

        def undo_skew(i=i, old=old):
            fb.positions[i] = old
            views = inst.to_views(fb, fb.input_ids, fb.positions)
            for group, view in zip(inst.groups, views, strict=False):
                group.manager.rewrite_last_forward(view, {i: old})  # this forward's records, true position

        injector.undo_after_forward(undo_skew)
        return inj

    logger.warning("kvcanary: fault %s cannot be injected by the sglang %s adapter; skipped", cls,
                   version.SGLANG_VERSION)
    injector.skip_pending()
    return None


def _flip_back(source, slot: int) -> None:
    row, col = divmod(slot, source.page_size)
    col = col * source.num_bytes_per_token
    kv = source.kv_bytes
    kv[row, col] = kv[row, col] ^ 0xFF  # byte 0 back (device op, no sync)
