"""Protect mode (``KVCANARY_MODE=protect``), the engine-agnostic half: which requests and which cached slots a drained
violation condemns, the ``kvcanary.action/1`` record, the ``kvcanary action:`` log line and the mode's counters.
The engine adapter (:mod:`kvcanary.sglang.protect`) finds the requests in its scheduler and acts on them.

What a violation condemns
-------------------------
* **The request of its row.** A verify row at forward step F names the ``req_to_token`` row; the adapter keeps, for
  the last few forwards (:class:`BatchHistory`), which request each row held and how long its sequence was
  (``seq_len``: prefix + the tokens forward F fed in) and its prefix. F's verify ran before F's model, so the tokens
  the request produced before F were computed over KV that the previous verify found clean: the request keeps the
  first ``seq_len(F)`` positions of its sequence (``Verdict.keep_len``) and everything it produced from F on is
  discarded and recomputed. The KV that F and later forwards wrote for it (positions from ``prefix(F)`` on,
  ``Verdict.taint_from``) was computed over the bad KV: where the prefix cache took those slots in (a prefill
  inserts its prompt), those nodes are evicted too. A token record that disagrees with the sequence at a position
  whose mapping is right (``verify_token`` without ``verify_chain_hash``: a token swap) means the forward that
  wrote that position was fed a wrong token, seen only when the row is verified next, after that forward produced
  a token from it: the request then keeps only the positions up to that one (``keep_len`` = position + 1).
  Likewise a slot that was written (``written_step``, by any request: a stale slot reuse) during the request's
  previous forward P, after P's verify: P read it too, so the request keeps only what P was fed
  (``keep_len`` = seq_len(P), ``taint_from`` = prefix(P)).
* **The slot, when its content is bad** (:func:`slot_scoped`: ``verify_real_kv_hash``, or any sweep row): every
  prefix-cache node holding the slot is evicted from that slot on (the positions before it stay cached), with its
  subtree (every later position attended to it). Rows whose mapping is wrong (a redirected or stale
  ``req_to_token`` entry: chain, position or token reasons) condemn only their request: the slot they pointed at
  belongs to someone else and is fine.
* **Every request holding an evicted node** that no violation named (it matched the node after F, or matched KV
  computed over the bad slot) is recomputed from its prompt (``keep_len`` = the depth where the evicted part starts).

The detection window
--------------------
The drain is asynchronous (``KVCANARY_DRAIN_EVERY``, default 8): a violation found by forward F's verify reaches the
host at most ``drain_every`` + 1 forwards later, and the adapter acts at its next scheduling point. Meanwhile a
decoding request produces one token per forward over the bad KV: up to ``drain_every`` + 2 tokens at the default
drain (measured in ``tests/adapters/test_sglang_protect.py``). Tokens the engine has not sent yet are discarded and
recomputed; when some were already sent (streaming), the request cannot be recomputed to a clean output and is
aborted with a finish reason naming kvcanary. ``KVCANARY_PROTECT_HOLD=1`` closes the window: before the scheduler
processes a batch's results it waits for the device and drains, so the request is acted on before any token computed
over the bad KV is appended or sent (the cost: one device sync per batch, the overlap of scheduling with the forward
is lost).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcanary.kernels.tags import LaunchTag
from kvcanary.report.record import Violation, encode_rid

logger = logging.getLogger(__name__)

ACTION_SCHEMA = "kvcanary.action/1"
ACTION_LOG_PREFIX = "kvcanary action:"
SUMMARY_LOG_PREFIX = "kvcanary protect:"
# The finish reason an aborted request carries starts with this (the client sees it and may retry).
ABORT_MESSAGE_PREFIX = "kvcanary: KV cache integrity violation"
ABORT_ERR_TYPE = "KVCanaryViolation"

# What happened to a request (or a node) in a kvcanary.action/1 record.
RECOMPUTE = "recompute"  # released, its discarded outputs dropped, back in the waiting queue: re-prefilled from tokens
ABORT = "abort"  # finished with ABORT_MESSAGE_PREFIX... (the client may retry)
MISSED = "missed"  # it had finished before protect could act (the detection window)
EVICT = "evict"  # prefix-cache nodes evicted (a sweep violation, or nodes whose holders released them)

# A request condemned again after this many recomputes is aborted (its prefix keeps matching a bad node that a
# request on the abort path still holds, or the corruption is persistent).
MAX_RECOMPUTES = 3

_REAL_KV = "verify_real_kv_hash"
_WRONG_TOKEN = "verify_token"
_CHAIN = "verify_chain_hash"


def slot_scoped(violation: Violation) -> bool:
    """Whether the slot's own content is bad (its cached copies must go), not just one row's mapping to it."""
    return violation.kernel_kind == int(LaunchTag.SWEEP) or _REAL_KV in violation.reasons


@dataclass
class BatchRecord:
    """One forward's rows: request object, ``seq_len`` (prefix + tokens fed in) and prefix length per row.

    ``prefix_lens`` None: one token fed per row (a decode forward), so a row's prefix is its ``seq_len`` - 1, worked
    out only when a violation asks (every forward records its batch; a decode batch builds no list for it)."""

    step: int
    rows: list[int]
    seq_lens: list[int]
    prefix_lens: list[int] | None
    requests: list[Any]

    def row(self, i: int) -> tuple[int, int]:
        """(seq_len, prefix_len) of the batch's row ``i``."""
        seq = self.seq_lens[i]
        return seq, (seq - 1 if self.prefix_lens is None else self.prefix_lens[i])


class BatchHistory:
    """The last ``keep`` forwards' :class:`BatchRecord` (a violation reaches the host a drain later: ``keep`` must
    cover ``drain_every`` + a few forwards)."""

    def __init__(self, keep: int) -> None:
        self.keep = max(int(keep), 4)
        self._records: deque[BatchRecord] = deque(maxlen=self.keep)

    def note(self, step: int, rows: list[int], seq_lens: list[int], prefix_lens: list[int] | None,
             requests: list[Any]) -> None:
        """Record forward ``step``'s rows (``prefix_lens`` None: one token fed per row, see :class:`BatchRecord`)."""
        self._records.append(BatchRecord(int(step), rows, seq_lens, prefix_lens, requests))

    def owner(self, step: int, row: int) -> tuple[Any, int, int] | None:
        """(request, seq_len, prefix_len) of ``row`` in forward ``step``; None when no kept forward of that step (or
        the one before or after it) had the row."""
        by_step = {r.step: r for r in self._records}
        for s in (step, step - 1, step + 1):
            record = by_step.get(s)
            if record is None:
                continue
            for i, r in enumerate(record.rows):
                if r == row:
                    return (record.requests[i], *record.row(i))
        return None

    def previous(self, step: int, request: Any) -> tuple[int, int, int] | None:
        """(step, seq_len, prefix_len) of the last kept forward before ``step`` that had ``request``."""
        for record in reversed(self._records):
            if record.step >= step:
                continue
            for i, r in enumerate(record.requests):
                if r is request:
                    return (record.step, *record.row(i))
        return None

    def __len__(self) -> int:
        return len(self._records)


@dataclass
class Verdict:
    """One condemned request: keep its first ``keep_len`` positions; its KV from ``taint_from`` on is bad."""

    request: Any
    row: int
    keep_len: int
    taint_from: int
    first_step: int
    slots: set[int] = field(default_factory=set)
    reasons: set[str] = field(default_factory=set)
    violations: int = 0


@dataclass
class Judgement:
    """What a batch of violations condemns (:func:`judge`)."""

    verdicts: list[Verdict]
    bad_slots: set[int]  # slots whose content is bad (slot_scoped): their cached copies are evicted
    unattributed: list[Violation]  # a row whose request the history does not know (older than it keeps)


def judge(violations: Iterable[Violation], histories: Sequence[BatchHistory]) -> Judgement:
    """The requests and slots ``violations`` condemn (module docstring). ``histories``: where rows are looked up (one
    per KV pool of the runner whose step numbering the violations use; the first that knows the row answers)."""
    by_request: dict[int, Verdict] = {}
    bad: set[int] = set()
    unattributed: list[Violation] = []
    for v in violations:
        if slot_scoped(v) and not v.out_of_range:
            bad.add(int(v.slot))
        if v.request_row is None:
            continue
        found = None
        for history in histories:
            found = history.owner(v.step, v.request_row)
            if found is not None:
                break
        if found is None:
            unattributed.append(v)
            continue
        request, seq_len, prefix_len = found
        keep, taint = int(seq_len), int(prefix_len)
        wrong_input = _WRONG_TOKEN in v.reasons and _CHAIN not in v.reasons and 0 <= v.position < keep
        if wrong_input:  # written from a wrong token: what the request produced after that position goes too
            keep, taint = int(v.position) + 1, min(taint, int(v.position))
        if v.written_step is not None and v.kernel_kind == int(LaunchTag.VERIFY):
            prev = None
            for history in histories:
                prev = history.previous(v.step, request)
                if prev is not None:
                    break
            if prev is not None and v.written_step >= prev[0]:  # rewritten while its previous forward read it
                keep, taint = min(keep, int(prev[1])), min(taint, int(prev[2]))
                wrong_input = True  # (merged below like a wrong input's bound: the lower one wins)
        verdict = by_request.get(id(request))
        if verdict is None:
            verdict = by_request[id(request)] = Verdict(request, int(v.request_row), keep, taint, int(v.step))
        elif v.step < verdict.first_step:
            verdict.keep_len, verdict.taint_from, verdict.first_step = keep, taint, int(v.step)
        elif wrong_input:
            verdict.keep_len, verdict.taint_from = min(verdict.keep_len, keep), min(verdict.taint_from, taint)
        if not v.out_of_range:
            verdict.slots.add(int(v.slot))
        verdict.reasons.update(v.reasons)
        verdict.violations += 1
    return Judgement(list(by_request.values()), bad, unattributed)


@dataclass
class ProtectStats:
    """Protect mode's running counts (the ``kvcanary protect:`` line), and the detection window as measured."""

    recomputed: int = 0
    aborted: int = 0
    missed: int = 0
    nodes_evicted: int = 0
    slots_evicted: int = 0
    nodes_deferred: int = 0  # marked nodes still held by a running request (evicted once released)
    tokens_discarded: int = 0  # outputs computed over bad KV and dropped before anyone saw them
    tokens_sent: int = 0  # outputs computed over bad KV the client already had (aborted or missed requests)
    window_forwards_max: int = 0  # forwards from the verify that found a violation to the action on it
    window_tokens_max: int = 0  # tokens a request produced over bad KV before the action
    window_tokens: list[int] = field(default_factory=list)  # per acted-on request (bounded)

    def observe_window(self, forwards: int, tokens: int) -> None:
        self.window_forwards_max = max(self.window_forwards_max, int(forwards))
        self.window_tokens_max = max(self.window_tokens_max, int(tokens))
        if len(self.window_tokens) < 4096:
            self.window_tokens.append(int(tokens))

    def line(self, step: int) -> str:
        return (
            f"{SUMMARY_LOG_PREFIX} step={step} recomputed={self.recomputed} aborted={self.aborted} "
            f"missed={self.missed} nodes_evicted={self.nodes_evicted} slots_evicted={self.slots_evicted} "
            f"nodes_deferred={self.nodes_deferred} tokens_discarded={self.tokens_discarded} "
            f"tokens_sent={self.tokens_sent} window_forwards_max={self.window_forwards_max} "
            f"window_tokens_max={self.window_tokens_max}"
        )


def abort_message(step: int, detail: str) -> str:
    """The finish-reason message of an aborted request."""
    return (f"{ABORT_MESSAGE_PREFIX} found in this request's KV at forward step {step} ({detail}); "
            "the output cannot be recomputed cleanly, retry the request")


def action_record(action: str, *, step: int, request_id: str | None = None, violation_step: int | None = None,
                  slots: Iterable[int] = (), reasons: Iterable[str] = (), nodes_evicted: int = 0,
                  slots_evicted: int = 0, tokens_discarded: int = 0, tokens_over_bad_kv: int = 0,
                  tokens_sent: int = 0, detail: str = "", rank: dict | None = None,
                  now: float | None = None) -> dict[str, Any]:
    """One ``kvcanary.action/1`` JSON object (docs/configuration.md#jsonl-report)."""
    return {
        "schema": ACTION_SCHEMA,
        "action": action,
        "step": int(step),
        "request_id": None if request_id is None else str(request_id),
        "violation_step": None if violation_step is None else int(violation_step),
        "window_forwards": None if violation_step is None else int(step) - int(violation_step),
        "slots": sorted(int(s) for s in slots),
        "reasons": sorted(set(reasons)),
        "nodes_evicted": int(nodes_evicted),
        "slots_evicted": int(slots_evicted),
        "tokens_discarded": int(tokens_discarded),
        "tokens_over_bad_kv": int(tokens_over_bad_kv),
        "tokens_sent": int(tokens_sent),
        "detail": str(detail),
        "rank": rank,
        "time": time.time() if now is None else now,
    }


def action_line(record: dict[str, Any]) -> str:
    """The WARNING line of an action record (space-separated ``key=value``; no value holds a space)."""
    slots = record["slots"]
    shown = ",".join(str(s) for s in slots[:8]) + (f",+{len(slots) - 8}" if len(slots) > 8 else "")
    rank = record.get("rank") or {}
    return (
        f"{ACTION_LOG_PREFIX} step={record['step']} action={record['action']} "
        f"request={encode_rid(record['request_id'])} violation_step={_dash(record['violation_step'])} "
        f"window_forwards={_dash(record['window_forwards'])} slots={shown or '-'} "
        f"reasons={'+'.join(record['reasons']) or '-'} nodes_evicted={record['nodes_evicted']} "
        f"slots_evicted={record['slots_evicted']} tokens_discarded={record['tokens_discarded']} "
        f"tokens_over_bad_kv={record['tokens_over_bad_kv']} tokens_sent={record['tokens_sent']}"
        + "".join(f" {k}={v}" for k, v in rank.items())
    )


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def is_protect_abort(finish_reason: Any) -> bool:
    """Whether a finish reason (sglang's JSON form, a dict, or its message) is protect mode's abort."""
    if isinstance(finish_reason, dict):
        finish_reason = finish_reason.get("message")
    return isinstance(finish_reason, str) and finish_reason.startswith(ABORT_MESSAGE_PREFIX)
