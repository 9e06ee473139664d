"""What one forward hands the canary: ``BatchView``, built by engine adapters (SPEC §4.3, §5)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ForwardKind(enum.Enum):
    """The forward modes the canary understands. Adapters refuse anything else."""

    EXTEND = "extend"  # prefill / chunked prefill: prefix_lens = tokens already cached, extend_lens = new
    DECODE = "decode"  # one new token per row: prefix_lens = positions, extend_lens = 1
    MIXED = "mixed"  # chunked prefill rows and decode rows in one batch (same (prefix, extend) form)
    IDLE = "idle"  # no tokens (e.g. a DP rank with nothing to do): plan, verify and write still launch


@dataclass(frozen=True)
class BatchView:
    """Tensors of one forward, all on the canary's device.

    Rows are batch rows (``bs`` of them, CUDA-graph padding rows included, with
    ``req_pool_indices == 0``); tokens are the forward's flattened token axis (``num_tokens``,
    padding included: padded tokens write slot 0 or a skipped slot < 0).

    Attributes:
        kind: the forward mode.
        input_ids: int64 [num_tokens] token ids written into the KV cache by this forward.
        positions: int64 [num_tokens] their sequence positions.
        out_cache_loc: int64 [num_tokens] the KV slot each token is written to (< 0: skipped).
        req_pool_indices: int64 [bs] the req_to_token row of each batch row (0: padding row).
        prefix_lens: int64 [bs] tokens of the row already in the KV cache before this forward.
        extend_lens: int64 [bs] tokens this forward writes for the row (its slice of the token axis,
            rows laid out in order).
    """

    kind: ForwardKind
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def validate(self) -> None:
        """Shape/dtype/device checks with errors naming the field (cheap: no device reads)."""
        device = self.input_ids.device
        for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens", "extend_lens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BatchView: {name}: expected torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int64:
                raise TypeError(f"BatchView: {name}: expected dtype int64, got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"BatchView: {name}: expected a 1-d tensor, got shape {list(t.shape)}")
            if t.device != device:
                raise ValueError(f"BatchView: {name}: expected device {device} (of input_ids), got {t.device}")
        for name in ("positions", "out_cache_loc"):
            if getattr(self, name).shape[0] != self.num_tokens:
                raise ValueError(
                    f"BatchView: {name}: expected {self.num_tokens} entries (num_tokens of input_ids), "
                    f"got {getattr(self, name).shape[0]}"
                )
        for name in ("prefix_lens", "extend_lens"):
            if getattr(self, name).shape[0] != self.batch_size:
                raise ValueError(
                    f"BatchView: {name}: expected {self.batch_size} rows (of req_pool_indices), "
                    f"got {getattr(self, name).shape[0]}"
                )
        if not isinstance(self.kind, ForwardKind):
            raise TypeError(f"BatchView: kind: expected ForwardKind, got {type(self.kind).__name__}")
