"""The pure-torch reference's shared part: the hashes (SPEC §2) and the byte images the kernel references update.

Deliberately simple: Python ints for all hashing, one entry at a time, in the documented order. Pure torch: the
references never import the compiled kernels (``kvcanary.kernels.jit``) or tvm-ffi.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)

U64_MASK = (1 << 64) - 1


def to_u64(x: int) -> int:
    return x & U64_MASK


def to_i64(x: int) -> int:
    x &= U64_MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def splitmix64(x: int) -> int:
    x &= U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT1
    x = (x * layout.SPLITMIX_MUL1) & U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT2
    x = (x * layout.SPLITMIX_MUL2) & U64_MASK
    x ^= x >> layout.SPLITMIX_SHIFT3
    return x


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(a)
    h = splitmix64(h ^ to_u64(b))
    return splitmix64(h ^ to_u64(c))


def chain_head_hash() -> int:
    """Unsigned prev_hash of a chain head."""
    return splitmix64(layout.CHAIN_ANCHOR)


def chain_step(prev_hash: int, token: int, position: int) -> int:
    return mix3(to_u64(prev_hash), token, position)


def fold_bytes(data: bytes) -> int:
    """Per-source accumulator over 16-byte steps of ``data``."""
    acc = 0
    for off in range(0, len(data), layout.REAL_KV_ALIGN_BYTES):
        lo = int.from_bytes(data[off : off + 8], "little")
        hi = int.from_bytes(data[off + 8 : off + 16], "little")
        acc = splitmix64(acc ^ lo)
        acc = splitmix64(acc ^ hi)
    return acc


def slot_bytes(source: RealKvSource, slot: int, num_bytes: int) -> bytes:
    row, col = divmod(slot, source.page_size)
    col *= source.num_bytes_per_token
    return bytes(source.kv_bytes[row, col : col + num_bytes].cpu().tolist())


def real_kv_fingerprint(sources: Sequence[RealKvSource], mode: int, slot: int) -> int:
    """Unsigned real_kv_hash of ``slot``."""
    if mode == layout.REAL_KV_HASH_MODE_NONE:
        return 0
    total = 0
    for src in sources:
        n = src.read_bytes
        if mode == layout.REAL_KV_HASH_MODE_PARTIAL:
            n = min(n, layout.REAL_KV_PARTIAL_BYTES)
        if n <= 0:
            continue
        total = splitmix64(total ^ fold_bytes(slot_bytes(src, slot, n)))
    return total


@dataclass
class Records:
    """A mutable byte image of a canary buffer."""

    buf: torch.Tensor
    data: bytearray = field(init=False)
    stride: int = field(init=False)
    num_slots: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_slots, self.stride = int(self.buf.shape[0]), int(self.buf.shape[1])
        self.data = bytearray(self.buf.cpu().flatten().tolist())

    def load(self, slot: int) -> tuple[int, int, int, int]:
        base = slot * self.stride
        return tuple(  # type: ignore[return-value]
            int.from_bytes(self.data[base + 8 * i : base + 8 * i + 8], "little", signed=True)
            for i in range(layout.RECORD_FIELDS)
        )

    def store(self, slot: int, fields: Sequence[int]) -> None:
        base = slot * self.stride
        for i, value in enumerate(fields):
            self.data[base + 8 * i : base + 8 * i + 8] = to_u64(value).to_bytes(8, "little")

    def commit(self) -> None:
        image = torch.tensor(list(self.data), dtype=torch.uint8).view(self.num_slots, self.stride)
        self.buf.copy_(image)


class Sink:
    """The violation rows (and metadata rows) one launch appends, committed to the ring at the end."""

    def __init__(self, ring: torch.Tensor, write_index: torch.Tensor, kernel_kind: int,
                 meta: torch.Tensor | None = None, step: int = layout.META_UNKNOWN) -> None:
        self.ring = ring
        self.write_index = write_index
        self.capacity = int(ring.shape[0])
        self.index = int(write_index[0])
        self.kernel_kind = kernel_kind
        self.rows: dict[int, list[int]] = {}
        self.meta = meta
        self.step = step
        self.meta_rows: dict[int, list[int]] = {}

    def record(self, *row: int, meta: tuple[int, int, int] | None = None) -> None:
        """Append a row; ``meta``: (request row, written step, writer serial), unknown when None."""
        index = self.index
        self.index = to_i64(index + 1) if index + 1 < 1 << 31 else index + 1 - (1 << 32)
        if 0 <= index < self.capacity:
            self.rows[index] = [self.kernel_kind, *row]
            unknown = layout.META_UNKNOWN
            self.meta_rows[index] = [self.step, *(meta if meta is not None else (unknown, unknown, unknown))]

    def commit(self) -> None:
        for index, row in self.rows.items():
            self.ring[index] = torch.tensor([to_i64(v) for v in row], dtype=torch.int64)
            if self.meta is not None:
                self.meta[index] = torch.tensor(self.meta_rows[index], dtype=torch.int64)
        self.write_index[0] = self.index
