"""The expected-token table of the token check (SPEC §4.3; ``KVCANARY_VERIFY_TOKENS``) and its uploads.

One row per ``req_to_token`` row: the token the request holds at each position (int32, like req_to_token and
sglang's own ``req_to_verify_expected_tokens``: half the memory of int64), and a valid length per row. The plan
(:meth:`kvcanary.device_state.DeviceState.before_forward`) puts the expected token into each verify entry inside
the valid length, and verify compares it with the stored token (``verify_token``).

A serving loop sends each row only what it appended since its last update (one token per decode row), and every
row of a forward in one call: one pinned upload and two scatters, whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcanary import layout

# Updates of at most this many tokens per row go into one batched scatter; longer ones (a request's first upload)
# are copied row by row.
SCATTER_MAX_TOKENS = 32


class TokenTable:
    """``expected_tokens`` (int32 ``[rows, width]``, :data:`~kvcanary.layout.NO_EXPECTED_TOKEN` where unknown) and
    ``valid_lens_by_row`` (int64 ``[rows]``) on ``device``; both keep their addresses (graph capture)."""

    def __init__(self, rows: int, width: int, device: torch.device) -> None:
        self.device = device
        self.expected_tokens = torch.full((rows, width), layout.NO_EXPECTED_TOKEN, dtype=torch.int32, device=device)
        self.valid_lens_by_row = torch.zeros(rows, dtype=torch.int64, device=device)

    def _staged(self, values: list[int]) -> torch.Tensor:
        staged = torch.tensor(values, dtype=torch.int64)
        # pinned on CUDA: the caching host allocator keeps it until the non-blocking copy has run
        return staged.pin_memory() if self.device.type == "cuda" else staged

    def update(self, updates: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """For each ``(row, start, tokens)``: the row's expected tokens at positions ``start..`` become ``tokens``
        (clipped at the table width) and its valid length ``start + len(tokens)`` (earlier positions keep what they
        hold). Non-blocking; call outside graph capture. Raises ``ValueError`` for a row outside the table or a
        negative start."""
        if not updates:
            return
        table = self.expected_tokens
        rows_total, width = table.shape
        tok_rows: list[int] = []
        tok_cols: list[int] = []
        tok_vals: list[int] = []
        len_rows: list[int] = []
        len_vals: list[int] = []
        for row, start, tokens in updates:
            if not 0 <= row < rows_total:
                raise ValueError(f"CanaryManager.update_expected_tokens: row {row} outside [0, {rows_total})")
            if start < 0:
                raise ValueError(f"CanaryManager.update_expected_tokens: start {start} < 0 (row {row})")
            count = max(0, min(len(tokens), width - start))
            if count > SCATTER_MAX_TOKENS:  # a whole request: one contiguous copy beats (row, col) index pairs
                table[row, start : start + count].copy_(self._staged(list(tokens[:count])), non_blocking=True)
            elif count:
                tok_rows += [row] * count
                tok_cols += range(start, start + count)
                tok_vals += tokens[:count]
            len_rows.append(row)
            len_vals.append(min(start + len(tokens), width))
        n, m = len(tok_vals), len(len_rows)
        dev = self._staged(tok_rows + tok_cols + tok_vals + len_rows + len_vals).to(self.device, non_blocking=True)
        if n:  # the staging is int64 (one upload); the table is int32
            table.index_put_((dev[:n], dev[n : 2 * n]), dev[2 * n : 3 * n].to(torch.int32))
        self.valid_lens_by_row.index_put_((dev[3 * n : 3 * n + m],), dev[3 * n + m :])
