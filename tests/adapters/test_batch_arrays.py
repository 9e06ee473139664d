"""The sglang adapter's eager hot path arrays (``kvcanary.sglang.batches.batch_arrays_of``): the check launch's
arrays of a ForwardBatch as sglang holds them, the same the general path's BatchView gives the launch; None for every
batch the general path must take."""

from __future__ import annotations

import enum
import types

import torch

from kvcanary.kernels.batch import ForwardKind
from kvcanary.runtime.installation import GroupSpec
from kvcanary.sglang import base
from kvcanary.sglang.batches import BatchConverter, batch_arrays_of


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5


def _fb(mode: ForwardMode, **fields) -> types.SimpleNamespace:
    return types.SimpleNamespace(forward_mode=mode, **fields)


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_arrays_are_what_the_general_path_launches() -> None:
    ones = torch.ones(8, dtype=torch.int64)
    arrays = batch_arrays_of(base.FORWARD_MODES, ones)
    view = base.batch_view_of("test")
    empty = torch.zeros(0, dtype=torch.int64)
    decode = _fb(ForwardMode.DECODE, req_pool_indices=_i64([3, 5]), out_cache_loc=_i64([40, 41]))
    extend = _fb(ForwardMode.EXTEND, req_pool_indices=_i64([3]), out_cache_loc=_i64([7, 8, 9]),
                 extend_prefix_lens=torch.tensor([4], dtype=torch.int32),
                 extend_seq_lens=torch.tensor([3], dtype=torch.int32))
    mixed = _fb(ForwardMode.MIXED, **{k: v for k, v in vars(extend).items() if k != "forward_mode"})
    for fb, ids, pos in ((decode, _i64([1, 2]), _i64([10, 11])), (extend, _i64([1, 2, 3]), _i64([4, 5, 6])),
                         (mixed, _i64([1, 2, 3]), _i64([4, 5, 6]))):
        assert arrays(fb, pos) is None  # a mode met for the first time: the general path (it names an unknown one)
        got = arrays(fb, pos)
        want = view(fb, ids, pos, ones, empty)
        assert got is not None
        for a, b in zip(got, (want.req_pool_indices, want.prefix_lens, want.extend_lens, want.out_cache_loc),
                        strict=True):
            assert torch.equal(a, b) and a.dtype == b.dtype
    rows, prefix, extend_lens, loc = arrays(decode, _i64([10, 11]))
    assert rows is decode.req_pool_indices and loc is decode.out_cache_loc  # as sglang holds them: no copy
    assert extend_lens is arrays(decode, _i64([10, 11]))[2]  # ones[:bs], one view per batch size


def test_every_other_batch_takes_the_general_path() -> None:
    arrays = batch_arrays_of(base.FORWARD_MODES, torch.ones(2, dtype=torch.int64))
    idle = _fb(ForwardMode.IDLE, req_pool_indices=_i64([]), out_cache_loc=_i64([]))
    verify = _fb(ForwardMode.TARGET_VERIFY, req_pool_indices=_i64([1]), out_cache_loc=_i64([4]))
    wide = _fb(ForwardMode.DECODE, req_pool_indices=_i64([1, 2, 3]), out_cache_loc=_i64([4, 5, 6]))
    not_enum = _fb(types.SimpleNamespace(name="DECODE"), req_pool_indices=_i64([1]), out_cache_loc=_i64([4]))
    for fb in (idle, verify, wide, not_enum):
        for _ in range(2):  # (the second call: the mode is known)
            assert arrays(fb, _i64([1, 2, 3])) is None


def test_only_one_full_group_of_a_plain_pool_gets_the_hot_path() -> None:
    full, swa = GroupSpec("full", 8, ()), GroupSpec("swa", 8, (), loc="swa")
    view = base.batch_view_of("test")
    assert BatchConverter([full], 4, torch.device("cpu"), view, forward_modes=base.FORWARD_MODES).arrays is not None
    assert BatchConverter([full], 4, torch.device("cpu"), view).arrays is None  # an EAGLE pool: none
    assert BatchConverter([full, swa], 4, torch.device("cpu"), view, forward_modes=base.FORWARD_MODES).arrays is None
    assert ForwardKind.DECODE in base.FORWARD_MODES.values()
