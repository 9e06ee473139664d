"""The writer serials' upload kernel's wrapper: ``canary_row_serial_update`` (csrc/canary_row_serials.cuh). The
runtime's serial upload calls the export directly and this wrapper only to name a failure."""

from __future__ import annotations

import logging

import torch

from kvcanary.kernels.call import INDEX, Arg, KernelSpec

logger = logging.getLogger(__name__)

SPEC = KernelSpec(fn="canary_row_serial_update", device="row_serials",
                  args=(Arg("row_serials"), Arg("staging"), Arg("num_updates", INDEX)))


def canary_row_serial_update(*, row_serials: torch.Tensor, staging: torch.Tensor, num_updates: int) -> None:
    """``row_serials[rows[u]] = serials[u]`` for the ``num_updates`` updates staged in ``staging`` (see
    csrc/canary_row_serials.cuh): the rows ``staging[:num_updates]``, then the serials
    ``staging[num_updates:2 * num_updates]``, int64.

    ``staging`` is host memory: on CUDA it must be pinned, and the kernel reads it in place, so the caller must not
    rewrite it before the launch has completed (record an event after this call). ``row_serials`` int64 [rows] is
    updated in batch order (a row repeated in one call gets its later serial, on CUDA too). Every row is checked on
    the host first: a row outside ``row_serials`` raises a ``ValueError`` naming the update, and nothing is written.
    One launch, no copy, no allocation; never synchronises.
    """
    SPEC.run(locals())
