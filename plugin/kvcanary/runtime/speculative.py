"""Speculative decoding (EAGLE with one draft per step, a linear chain) for the canary, engine-agnostic.

An EAGLE engine runs two models over two KV pools that share one slot space and one ``req_to_token`` table:
the **target** pool and the **draft** pool, each shadowed by its own :class:`~kvcanary.runtime.manager.CanaryManager`.
Per decode step of a row whose KV holds positions ``[0, L)`` and whose next token (the *bonus*, position ``L``)
is known but not yet in the KV:

* draft decode (``num_steps - 1`` forwards): the draft writes position ``L + i`` with its i-th guess;
  ``(prefix, extend) = (L + i, 1)``, a plain decode;
* target verify: the target writes ``n = draft_token_num`` positions ``L .. L + n - 1`` (the bonus, then the
  drafts) into the row's pre-allocated slots ``req_to_token[row, L .. L + n - 1]``;
  ``(prefix, extend) = (seq_lens, n)`` (SPEC §4.3);
* the engine accepts ``a`` of them (``1 <= a <= n``: the bonus and ``a - 1`` drafts); the row's committed
  length becomes ``L + a``;
* draft extend: the draft writes positions ``L .. L + n - 1`` again; ``(prefix, extend) =
  (seq_lens - extend_seq_lens, extend_seq_lens)`` (its ``seq_lens`` already counts the ``n`` new tokens).

**Rejected drafts need no rollback.** The records of positions ``L + a .. L + n - 1`` stay in their slots, but
every later forward of the row verifies only its committed prefix ``[0, L + a)``, and the row's next write
starts at position ``L + a`` in the same slot (with topk 1 a position keeps its slot), so each rejected
record is overwritten before any verify can reach it. A finished or retracted row frees those slots, and
whoever gets them next writes before it verifies. Accepted tokens are the first ``a`` entries of one chain
the verify wrote from the record at ``L - 1``, so their records are exactly those a one-by-one decode of the
same tokens writes. Nothing has to be snapshotted or restored, so there is no extra device work per step and
nothing to keep consistent inside CUDA graphs; ``rolled_back`` counts the records this truncation drops.

**The draft pool's token shift.** EAGLE feeds the draft at position ``p`` the target's hidden state at ``p``
and the embedding of token ``p + 1``: the draft slot at position ``p`` holds the KV of token ``p + 1``. The
draft manager plans with ``kv_token_id_vs_position_offset = 1`` (:data:`DRAFT_TOKEN_OFFSET`), so the token
check (``KVCANARY_VERIFY_TOKENS``) compares a draft record at ``p`` with token ``p + 1`` of the request, and
only where that token is known.

A draft tree (topk > 1) is not covered: its verify writes sibling branches whose accepted path is moved to
other slots afterwards, which breaks the one-position-one-slot argument above; adapters refuse it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind

# kv_token_id_vs_position_offset of the EAGLE draft pool: its slot at position p holds the KV of token p + 1.
DRAFT_TOKEN_OFFSET = 1

TARGET = "target"
DRAFT = "draft"
SPEC_SCHEMA = "kvcanary.spec/1"
SPEC_LOG_PREFIX = "kvcanary spec stats:"


@dataclass(frozen=True)
class PoolRole:
    """What a KV pool is in a speculative engine.

    Attributes:
        pool: ``"target"`` or ``"draft"``; added to the rank keys of every line and record (``pool=draft``).
        token_offset: the pool's ``kv_token_id_vs_position_offset`` (0 target, 1 draft).
        inject_faults: whether ``KVCANARY_FAULT`` injects into this pool (the target only: the draft pool is the
            one the engine bug hurts, and a fault there would be indistinguishable from it).
    """

    pool: str
    token_offset: int
    inject_faults: bool

    def rank(self, rank: dict[str, Any]) -> dict[str, Any]:
        """``rank`` with this pool's key added (a new dict)."""
        return {**rank, "pool": self.pool}


TARGET_ROLE = PoolRole(TARGET, 0, True)
DRAFT_ROLE = PoolRole(DRAFT, DRAFT_TOKEN_OFFSET, False)


class SpecLens:
    """``(prefix_lens, extend_lens)`` of the speculative forwards (SPEC §4.3), as int64 device tensors.

    The per-row draft count of a target verify comes from a buffer kept per count (stable addresses: a view
    built while a CUDA graph is captured stays valid on every replay); the rest are device ops on the engine's
    own tensors, so both are graph-capturable and never synchronise.
    """

    def __init__(self, max_batch_size: int, device: torch.device | str) -> None:
        self.max_batch_size = int(max_batch_size)
        self.device = torch.device(device)
        self._counts: dict[int, torch.Tensor] = {}

    def _count(self, n: int, rows: int) -> torch.Tensor:
        buf = self._counts.get(n)
        if buf is None:
            buf = self._counts[n] = torch.full((self.max_batch_size,), n, dtype=torch.int64, device=self.device)
        return buf[:rows]

    def target_verify(self, seq_lens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Target verify: every row writes ``num_tokens // rows`` tokens after its ``seq_lens`` committed ones."""
        rows = int(seq_lens.shape[0])
        if rows == 0:
            return _i64(seq_lens), self._count(0, 0)
        n, rest = divmod(int(num_tokens), rows)
        if rest or n < 1:
            raise ValueError(f"kvcanary: target verify with {num_tokens} tokens over {rows} rows: expected the same "
                             "number of draft tokens per row")
        if rows > self.max_batch_size:
            raise ValueError(
                f"kvcanary: target verify with {rows} rows, more than max_batch_size={self.max_batch_size}")
        return _i64(seq_lens), self._count(n, rows)

    @staticmethod
    def draft_extend(seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft extend after a verify: ``seq_lens`` already counts the ``extend_seq_lens`` tokens written now."""
        extend = _i64(extend_seq_lens)
        return _i64(seq_lens) - extend, extend


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def target_verify_view(lens: SpecLens, *, input_ids: torch.Tensor, positions: torch.Tensor,
                       out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor) -> BatchView:
    """The BatchView of a target verify forward (``seq_lens``: each row's committed length before it)."""
    prefix, extend = lens.target_verify(seq_lens, int(input_ids.shape[0]))
    return BatchView(ForwardKind.EXTEND, _i64(input_ids), _i64(positions), _i64(out_cache_loc),
                     _i64(req_pool_indices), prefix, extend)


def draft_extend_view(*, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                      req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      extend_seq_lens: torch.Tensor) -> BatchView:
    """The BatchView of a draft extend after a verify (``seq_lens`` includes the tokens written now)."""
    prefix, extend = SpecLens.draft_extend(seq_lens, extend_seq_lens)
    return BatchView(ForwardKind.EXTEND, _i64(input_ids), _i64(positions), _i64(out_cache_loc),
                     _i64(req_pool_indices), prefix, extend)


@dataclass
class SpecCounters:
    """Host counters of one pool's speculative work (no device reads: the engine's host facts only).

    Attributes:
        verify_forwards: target verify forwards.
        draft_decode_forwards: draft decode forwards (a CUDA-graph replay of ``k`` draft steps counts ``k``).
        draft_extend_forwards: draft extends (after a prefill chunk or after a verify).
        drafts_written: records written at a position past the row's committed length at the time, i.e. for a
            draft token (target verify: ``n - 1`` per row; draft decode: 1 per row and step; draft extend after
            a verify: ``n - 1`` per row).
        drafts_accepted / drafts_rejected: the engine's verdicts on the draft tokens (from its host copy of the
            accept lengths, which arrives one step late under an overlap scheduler).
        rolled_back: draft records that were never committed, so no verify reads them and the row's next write
            overwrites them: the rejected drafts' records (as the verdicts arrive) plus, in the draft pool, the
            draft-decode records the same step's draft extend rewrites (``superseded``). Once every verdict is in it
            equals ``drafts_written - drafts_accepted``; it only grows. Nothing is restored on the device.
        superseded: draft-decode records (always rewritten by the draft extend of the same step).
    """

    verify_forwards: int = 0
    draft_decode_forwards: int = 0
    draft_extend_forwards: int = 0
    drafts_written: int = 0
    drafts_accepted: int = 0
    drafts_rejected: int = 0
    superseded: int = 0
    _logged_at: int = field(default=-1, repr=False)

    @property
    def rolled_back(self) -> int:
        return self.drafts_rejected + self.superseded

    def add_verify(self, rows: int, draft_token_num: int) -> None:
        self.verify_forwards += 1
        self.drafts_written += rows * max(draft_token_num - 1, 0)

    def add_draft_decode(self, rows: int, steps: int = 1) -> None:
        self.draft_decode_forwards += steps
        self.drafts_written += rows * steps
        self.superseded += rows * steps

    def add_draft_extend(self, rows: int, draft_tokens_per_row: int = 0) -> None:
        self.draft_extend_forwards += 1
        self.drafts_written += rows * draft_tokens_per_row

    def add_verdicts(self, correct_drafts_per_row: list[int], drafts_per_row: int) -> None:
        """One verify's outcome: ``correct_drafts_per_row[i]`` of the row's ``drafts_per_row`` drafts accepted."""
        accepted = sum(int(c) for c in correct_drafts_per_row)
        self.drafts_accepted += accepted
        self.drafts_rejected += len(correct_drafts_per_row) * drafts_per_row - accepted

    def as_dict(self) -> dict[str, int]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out["rolled_back"] = self.rolled_back
        return out

    def line(self, step: int, pool: str, extra: dict[str, int] | None = None) -> str:
        """``kvcanary spec stats: step=… pool=… verify_forwards=… … rolled_back=…`` (+ ``extra`` keys)."""
        items = {**self.as_dict(), **(extra or {})}
        return f"{SPEC_LOG_PREFIX} step={step} pool={pool} " + " ".join(f"{k}={v}" for k, v in items.items())

    def record(self, step: int, pool: str, rank: dict[str, Any] | None,
               extra: dict[str, int] | None = None) -> dict[str, Any]:
        """The ``kvcanary.spec/1`` JSON object of the current counts."""
        return {"schema": SPEC_SCHEMA, "step": step, "pool": pool, "counters": {**self.as_dict(), **(extra or {})},
                "rank": rank, "time": time.time()}

    def due(self, step: int, every: int) -> bool:
        """Whether the stats line is due at ``step`` (every ``every`` steps, once per step; 0: never)."""
        if every <= 0 or step % every or step == self._logged_at:
            return False
        self._logged_at = step
        return True


def parse_spec_line(line: str) -> dict[str, int | str]:
    """The fields of a ``kvcanary spec stats:`` line (ValueError if it is not one); numbers as ints."""
    at = line.find(SPEC_LOG_PREFIX)
    if at < 0:
        raise ValueError("not a kvcanary spec stats line")
    out: dict[str, int | str] = {}
    for pair in line[at + len(SPEC_LOG_PREFIX):].split():
        key, _, value = pair.partition("=")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


__all__ = [
    "DRAFT", "DRAFT_ROLE", "DRAFT_TOKEN_OFFSET", "PoolRole", "SPEC_LOG_PREFIX", "SPEC_SCHEMA", "SpecCounters",
    "SpecLens", "TARGET", "TARGET_ROLE", "draft_extend_view", "parse_spec_line", "target_verify_view",
]
