"""Real-KV sources: which bytes of the engine's KV pool a fingerprint reads (SPEC §2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcanary.kernels import layout


def _check_positive_multiple(name: str, value: object, multiple: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"RealKvSource: {name}: expected int, got {type(value).__name__}")
    if value <= 0 or value % multiple != 0:
        raise ValueError(f"RealKvSource: {name}: must be a positive multiple of {multiple}, got {value}")
    return value


@dataclass(frozen=True)
class RealKvSource:
    """One source of real KV bytes for the fingerprint.

    Slot ``s`` lives at row ``s // page_size``, byte column ``(s % page_size) * num_bytes_per_token``
    of ``tensor`` viewed as 2-D bytes ``[rows, row_bytes]`` (dims after the first are flattened;
    rows are stepped by the row stride, so a per-layer view into a larger buffer is fine, and
    trailing bytes of a row are ignored). ``read_bytes`` bytes of each slot are folded in mode ALL,
    the first 16 in PARTIAL.

    Args:
        tensor: the KV buffer (any dtype; at least 2-D; the dims after the first must be contiguous).
        page_size: tokens per row, >= 1.
        num_bytes_per_token: bytes between consecutive tokens of a row; a positive multiple of 16.
        read_bytes: bytes of a slot fingerprinted in mode ALL; a positive multiple of 16,
            at most ``num_bytes_per_token``.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    kv_bytes: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t = self.tensor
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"RealKvSource: tensor: expected torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"RealKvSource: tensor: expected at least 2 dims [rows, ...], got shape {list(t.shape)}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int):
            raise TypeError(f"RealKvSource: page_size: expected int, got {type(self.page_size).__name__}")
        if self.page_size < 1:
            raise ValueError(f"RealKvSource: page_size: must be >= 1, got {self.page_size}")
        align = layout.REAL_KV_ALIGN_BYTES
        _check_positive_multiple("num_bytes_per_token", self.num_bytes_per_token, align)
        _check_positive_multiple("read_bytes", self.read_bytes, align)
        if self.read_bytes > self.num_bytes_per_token:
            raise ValueError(
                f"RealKvSource: read_bytes: must be <= num_bytes_per_token={self.num_bytes_per_token}, "
                f"got {self.read_bytes}"
            )
        inner = t[0] if t.shape[0] > 0 else t.new_empty(t.shape[1:])
        if not inner.is_contiguous():
            raise ValueError(
                f"RealKvSource: tensor: the dims after the first must be contiguous, got strides {list(t.stride())}"
            )
        kv_bytes = t.flatten(1)
        if kv_bytes.dtype != torch.uint8:
            kv_bytes = kv_bytes.view(torch.uint8)
        row_stride = kv_bytes.stride(0)
        if row_stride % align != 0:
            raise ValueError(f"RealKvSource: tensor: row stride must be a multiple of {align} bytes, got {row_stride}")
        if kv_bytes.data_ptr() % align != 0:
            raise ValueError(f"RealKvSource: tensor: data pointer must be {align}-byte aligned")
        needed = self.page_size * self.num_bytes_per_token
        if kv_bytes.shape[1] < needed:
            raise ValueError(
                f"RealKvSource: tensor: row width {kv_bytes.shape[1]} bytes is less than "
                f"page_size * num_bytes_per_token = {needed}"
            )
        object.__setattr__(self, "kv_bytes", kv_bytes)

    @property
    def num_slots(self) -> int:
        """Number of KV slots this source covers."""
        return int(self.kv_bytes.shape[0]) * self.page_size

    @property
    def device(self) -> torch.device:
        return self.tensor.device
