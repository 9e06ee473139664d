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

    Every tensor is int64 or int32 (each on its own: sglang hands its lengths as int32, and the check launch reads
    either, so an adapter converts nothing per forward).

    Attributes:
        kind: the forward mode.
        input_ids: [num_tokens] token ids written into the KV cache by this forward.
        positions: [num_tokens] their sequence positions.
        out_cache_loc: [num_tokens] the KV slot each token is written to (< 0: skipped).
        req_pool_indices: [bs] the req_to_token row of each batch row (0: padding row).
        prefix_lens: [bs] tokens of the row already in the KV cache before this forward.
        extend_lens: [bs] tokens this forward writes for the row (its slice of the token axis,
            rows laid out in order).
    """

    kind: ForwardKind
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor

    def __init__(self, kind: ForwardKind, input_ids: torch.Tensor, positions: torch.Tensor,
                 out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                 extend_lens: torch.Tensor) -> None:
        # The generated frozen __init__ stores each field through object.__setattr__ (~1.3 µs for seven); an adapter
        # builds a view per group per forward, so the fields go straight into the instance dict (~0.4 µs). The
        # class stays frozen: assignment after construction still raises FrozenInstanceError.
        fields = self.__dict__
        fields["kind"] = kind
        fields["input_ids"] = input_ids
        fields["positions"] = positions
        fields["out_cache_loc"] = out_cache_loc
        fields["req_pool_indices"] = req_pool_indices
        fields["prefix_lens"] = prefix_lens
        fields["extend_lens"] = extend_lens

    @property
    def batch_size(self) -> int:
        return int(self.req_pool_indices.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def well_formed(self) -> bool:
        """The fast half of ``validate``: kind, dtypes, ranks and lengths, about a dozen attribute reads (~2 us of
        host time: the manager runs it on a batch the check launch did not take, e.g. one given to after_forward
        alone, and ``validate`` only when it fails; the launch checks the same itself). Devices are
        not compared here: a row array on the wrong device is refused by the plan kernel under the same name,
        and the token arrays are copied into the manager's own buffers."""
        try:
            ids, rows = self.input_ids, self.req_pool_indices
            tokens, batch = ids.shape, rows.shape
            return (
                self.kind.__class__ is ForwardKind and len(tokens) == 1 and len(batch) == 1
                and ids.dtype in _INT and rows.dtype in _INT and self.positions.dtype in _INT
                and self.out_cache_loc.dtype in _INT and self.prefix_lens.dtype in _INT
                and self.extend_lens.dtype in _INT and self.positions.shape == tokens
                and self.out_cache_loc.shape == tokens and self.prefix_lens.shape == batch
                and self.extend_lens.shape == batch
            )
        except AttributeError:  # a field that is not a tensor
            return False

    def validate(self) -> None:
        """Kind, dtype, rank, device and length checks with errors naming the field (``TypeError`` for a wrong type
        or dtype, ``ValueError`` otherwise). No device reads."""
        if not isinstance(self.kind, ForwardKind):
            raise TypeError(f"BatchView: kind: expected ForwardKind, got {type(self.kind).__name__} {self.kind!r}")
        ids = self.input_ids
        device = ids.device if isinstance(ids, torch.Tensor) else None
        for name in _TENSOR_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype not in _INT or t.dim() != 1 or t.device != device:
                _explain_field(name, t, device)
        n, bs = ids.shape[0], self.req_pool_indices.shape[0]
        for name, want, of in (("positions", n, "num_tokens of input_ids"),
                               ("out_cache_loc", n, "num_tokens of input_ids"),
                               ("prefix_lens", bs, "rows of req_pool_indices"),
                               ("extend_lens", bs, "rows of req_pool_indices")):
            got = getattr(self, name).shape[0]
            if got != want:
                raise ValueError(f"BatchView: {name}: expected {want} entries ({of}), got {got}")


_INT = (torch.int64, torch.int32)  # the dtypes a BatchView tensor may have
_TENSOR_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "prefix_lens", "extend_lens")


def _explain_field(name: str, t: object, device: torch.device | None) -> None:
    """Raise the error for a BatchView tensor field that failed the fast check."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"BatchView: {name}: expected torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _INT:
        raise TypeError(f"BatchView: {name}: expected dtype int64 or int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"BatchView: {name}: expected a 1-d tensor, got shape {list(t.shape)}")
    raise ValueError(f"BatchView: {name}: expected device {device} (of input_ids), got {t.device}")
