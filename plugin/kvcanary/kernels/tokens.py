"""The token table's upload kernels' wrappers (csrc/canary_tokens.cuh): ``canary_token_update`` applies staged
expected-token updates, ``canary_token_append`` appends one token to each of a batch's rows. The runtime's token
table calls the exports directly and these wrappers only to name a failure."""

from __future__ import annotations

import logging

import torch

from kvcanary.kernels.call import INDEX, Arg, KernelSpec

logger = logging.getLogger(__name__)

_TABLE_ARGS = (Arg("expected_tokens"), Arg("valid_lens_by_row"), Arg("staging"), Arg("num_updates", INDEX))
UPDATE_SPEC = KernelSpec(fn="canary_token_update", device="expected_tokens",
                         args=(*_TABLE_ARGS, Arg("staged_len", INDEX)))
APPEND_SPEC = KernelSpec(fn="canary_token_append", device="expected_tokens", args=_TABLE_ARGS)


def canary_token_update(
    *,
    expected_tokens: torch.Tensor,
    valid_lens_by_row: torch.Tensor,
    staging: torch.Tensor,
    num_updates: int,
    staged_len: int,
) -> None:
    """Apply ``num_updates`` expected-token updates staged in ``staging[:staged_len]`` (see csrc/canary_tokens.cuh).

    ``staging`` (int64, laid out as :data:`~kvcanary.kernels.layout.TOKEN_UPDATE_FIELDS` field-major header runs,
    then the tokens) is host memory: on CUDA it must be pinned, and the kernel reads it in place, so the caller must
    not rewrite it before the launch has completed (record an event after this call). ``expected_tokens`` int32
    [rows, width] and ``valid_lens_by_row`` int64 [rows] are updated in batch order (a later update of a row wins).
    One launch, no copy, no allocation; never synchronises.
    """
    UPDATE_SPEC.run(locals())


def canary_token_append(
    *,
    expected_tokens: torch.Tensor,
    valid_lens_by_row: torch.Tensor,
    staging: torch.Tensor,
    num_updates: int,
) -> None:
    """Append one token to each of ``num_updates`` rows, staged in ``staging`` (see csrc/canary_tokens.cuh): update
    ``u`` writes its token at position ``start`` of its row and makes the row's valid length ``start + 1``.

    ``staging`` (int64, :data:`~kvcanary.kernels.layout.TOKEN_APPEND_FIELDS` runs of ``num_updates`` values: rows,
    starts, tokens) is host memory as for :func:`canary_token_update` (pinned on CUDA, read in place: record an event
    after this call before rewriting it). A start must lie inside the table (clip through :func:`canary_token_update`).
    Updates apply in batch order (a later update of a row wins). One launch, no copy, no allocation; never
    synchronises.
    """
    APPEND_SPEC.run(locals())
