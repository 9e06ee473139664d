"""Plan buffers: fixed-capacity device tensors that ``canary_plan_step`` fills every forward.

Capacities are fixed at allocation, so every launch that reads or writes a plan has a grid that depends
only on them and the buffers keep stable addresses: both are what CUDA-graph capture needs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


def _check_capacity(name: str, capacity: int) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"{name}.allocate: capacity: expected int, got {type(capacity).__name__}")
    if capacity < 0 or capacity >= 1 << 31:
        raise ValueError(f"{name}.allocate: capacity: must be in [0, 2^31), got {capacity}")
    return capacity


@dataclass(frozen=True)
class WritePlan:
    """Per-request ranges of one forward's token axis, and the slot each request's chain continues from.

    Attributes:
        write_offsets: int64 [capacity + 1] exclusive prefix sums of the rows' write lengths.
        write_seed_slot_indices: int64 [capacity] slot holding the token before each row's first new
            token, or -1 for a chain head / empty row.
        write_num_valid_reqs: int32 [1] rows in use (the batch size).
        verify_row_offsets: int64 [capacity + 1] where each row's entries start in the verify plan.
        write_request_rows: int64 [capacity] the req_to_token row of each batch row (0 past the batch), for
            the writer attribution and the request row of write violations (kvcanary+; None: not planned).
    """

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor
    verify_row_offsets: torch.Tensor
    write_request_rows: torch.Tensor | None = None

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str) -> WritePlan:
        """A zeroed plan for batches of at most ``capacity`` rows."""
        cap = _check_capacity("WritePlan", capacity)
        i64 = {"dtype": torch.int64, "device": device}
        return cls(
            write_offsets=torch.zeros(cap + 1, **i64),
            write_seed_slot_indices=torch.full((cap,), -1, **i64),
            write_num_valid_reqs=torch.zeros(1, dtype=torch.int32, device=device),
            verify_row_offsets=torch.zeros(cap + 1, **i64),
            write_request_rows=torch.zeros(cap, **i64),
        )

    @property
    def capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])

    def kernel_args(self) -> dict[str, torch.Tensor]:
        """The write-plan keyword arguments of ``write.canary_write_step`` (built once: a forward calls this)."""
        args = self.__dict__.get("_kernel_args")
        if args is None:
            args = {
                "write_offsets": self.write_offsets,
                "write_seed_slot_indices": self.write_seed_slot_indices,
                "write_num_valid_reqs": self.write_num_valid_reqs,
                "write_request_rows": self.write_request_rows,
            }
            object.__setattr__(self, "_kernel_args", args)
        return args


@dataclass(frozen=True)
class VerifyPlan:
    """The prefix entries one forward verifies.

    Attributes:
        verify_slot_indices: int64 [capacity] slot of each entry (0: skipped).
        verify_expected_tokens: int64 [capacity] expected token, -1 for none.
        verify_expected_positions: int64 [capacity] expected position.
        verify_prev_slot_indices: int64 [capacity] slot of the previous position (-1 chain head, 0 unknown).
        verify_num_valid: int32 [1] entries in use.
        verify_enable: int32 [1] 0 when the plan overflowed its capacity (verify skipped for the step).
        verify_request_rows: int64 [capacity] the req_to_token row each entry came from (kvcanary+: the
            request row of its violations; -1 where no row is known, e.g. a sweep; None: not planned).
    """

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    verify_enable: torch.Tensor
    verify_request_rows: torch.Tensor | None = None

    @classmethod
    def allocate(cls, capacity: int, device: torch.device | str) -> VerifyPlan:
        """A zeroed plan for at most ``capacity`` entries."""
        cap = _check_capacity("VerifyPlan", capacity)
        i64 = {"dtype": torch.int64, "device": device}
        return cls(
            verify_slot_indices=torch.zeros(cap, **i64),
            verify_expected_tokens=torch.full((cap,), -1, **i64),
            verify_expected_positions=torch.zeros(cap, **i64),
            verify_prev_slot_indices=torch.zeros(cap, **i64),
            verify_num_valid=torch.zeros(1, dtype=torch.int32, device=device),
            verify_enable=torch.zeros(1, dtype=torch.int32, device=device),
            verify_request_rows=torch.full((cap,), -1, **i64),
        )

    @property
    def capacity(self) -> int:
        return int(self.verify_slot_indices.shape[0])

    def kernel_args(self) -> dict[str, torch.Tensor]:
        """The verify-plan keyword arguments of ``verify.canary_verify_step`` (built once: a forward calls this)."""
        args = self.__dict__.get("_kernel_args")
        if args is None:
            args = {f.name: getattr(self, f.name) for f in fields(self)}
            object.__setattr__(self, "_kernel_args", args)
        return args
