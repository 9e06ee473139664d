"""Argument validation of the raw kernels, the typed wrappers and ``RealKvSource`` (SPEC §1-§4.2).

Every argument of ``canary_write_step`` (23) and ``canary_verify_step`` (20) of the raw tvm-ffi module
gets its own test per failure class: wrong dtype -> TypeError; wrong ndim / shape / device / contiguity
-> ValueError; each message starts with "<fn>: <arg>: ". Symbolic sizes shared by several tensors name
both the failing tensor and the one that bound the size.

Device checks without a GPU: a CPU tensor is handed to tvm-ffi through a DLPack capsule whose device
field is relabelled (cuda:0, or cpu:1 for a device-id mismatch). The checks run before any data is
touched, so the relabelled pointer is never dereferenced. Tests marked ``gpu`` repeat this with real
CUDA tensors (CUDA tensor -> CPU build, CPU tensor -> CUDA build) and skip without CUDA.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kvcanary
from kvcanary.kernels import call, layout, verify, write
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.real_kv import RealKvSource

WRITE = "canary_write_step"
VERIFY = "canary_verify_step"

# Positional order of the C++ host wrappers (csrc/canary_write.cuh, csrc/canary_verify.cuh).
WRITE_ARGS = (
    "canary_buf",
    "write_offsets",
    "write_seed_slot_indices",
    "write_num_valid_reqs",
    "input_ids",
    "positions",
    "out_cache_loc",
    "kernel_kind",
    "enable_write_input_assert",
    "expected_input_tokens",
    "expected_input_positions",
    "violation_ring",
    "violation_write_index",
    "slot_run_counter",
    "kernel_run_counter",
    "enable_chain_position_assert",
    "real_kv_buf_0",
    "real_kv_buf_1",
    "real_kv_buf_2",
    "real_kv_buf_3",
    "real_kv_source_params",
    "num_sources",
    "real_kv_hash_mode",
)
VERIFY_ARGS = (
    "canary_buf",
    "verify_slot_indices",
    "verify_expected_tokens",
    "verify_expected_positions",
    "verify_prev_slot_indices",
    "verify_num_valid",
    "verify_enable",
    "kernel_kind",
    "violation_ring",
    "violation_write_index",
    "slot_run_counter",
    "kernel_run_counter",
    "real_kv_buf_0",
    "real_kv_buf_1",
    "real_kv_buf_2",
    "real_kv_buf_3",
    "real_kv_source_params",
    "num_sources",
    "real_kv_hash_mode",
    "check_tokens",
)
ARG_ORDER = {WRITE: WRITE_ARGS, VERIFY: VERIFY_ARGS}

# Sizes of the valid calls.
NUM_SLOTS = 16
SLOT_STRIDE = 32
WRITE_REQ_CAPACITY = 2
NUM_TOKENS = 4
VERIFY_CAPACITY = 4
RING_CAPACITY = 4
NBPT = 32  # num_bytes_per_token of every valid source
# (page_size, read_bytes) of the four sources of a valid call: all four are used.
SOURCE_SHAPES = ((1, 32), (2, 16), (4, 32), (8, 16))
BUF_NAMES = tuple(f"real_kv_buf_{i}" for i in range(layout.MAX_REAL_KV_SOURCES))


# ---------------------------------------------------------------------------------------------- helpers


def i64(*values: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def i32(*values: int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def source_buffers(device: str = "cpu") -> tuple[list[torch.Tensor], torch.Tensor]:
    """Four uint8 [rows, page_size * NBPT] sources covering NUM_SLOTS and their CPU param table."""
    bufs = []
    params = torch.zeros((layout.MAX_REAL_KV_SOURCES, layout.REAL_KV_PARAM_FIELDS), dtype=torch.int32)
    for i, (page, read) in enumerate(SOURCE_SHAPES):
        rows = NUM_SLOTS // page
        g = torch.Generator().manual_seed(i)
        bufs.append(torch.randint(0, 256, (rows, page * NBPT), dtype=torch.uint8, generator=g).to(device))
        params[i] = torch.tensor([page, NBPT, read], dtype=torch.int32)
    return bufs, params


def valid_write_args(device: str = "cpu") -> dict[str, Any]:
    """A valid raw canary_write_step call in which every argument is checked (input assert on, 4 sources)."""
    bufs, params = source_buffers(device)
    args: dict[str, Any] = {
        "canary_buf": torch.zeros((NUM_SLOTS, SLOT_STRIDE), dtype=torch.uint8, device=device),
        "write_offsets": i64(0, 2, 4, device=device),
        "write_seed_slot_indices": i64(-1, -1, device=device),
        "write_num_valid_reqs": i32(2, device=device),
        "input_ids": i64(11, 12, 21, 22, device=device),
        "positions": i64(0, 1, 0, 1, device=device),
        "out_cache_loc": i64(1, 2, 3, 4, device=device),
        "kernel_kind": 7,
        "enable_write_input_assert": 1,
        "expected_input_tokens": i64(11, 12, 21, 22, device=device),
        "expected_input_positions": i64(0, 1, 0, 1, device=device),
        "violation_ring": torch.zeros((RING_CAPACITY, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
        "violation_write_index": i32(0, device=device),
        "slot_run_counter": i64(0, device=device),
        "kernel_run_counter": i64(0, device=device),
        "enable_chain_position_assert": i32(1, device=device),
        "real_kv_source_params": params,
        "num_sources": layout.MAX_REAL_KV_SOURCES,
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_ALL,
    }
    args.update(zip(BUF_NAMES, bufs, strict=True))
    assert set(args) == set(WRITE_ARGS)
    return args


def valid_verify_args(device: str = "cpu") -> dict[str, Any]:
    """A valid raw canary_verify_step call (nothing enabled to check against a zero buffer: no violations)."""
    bufs, params = source_buffers(device)
    args: dict[str, Any] = {
        "canary_buf": torch.zeros((NUM_SLOTS, SLOT_STRIDE), dtype=torch.uint8, device=device),
        "verify_slot_indices": i64(1, 2, 3, 4, device=device),
        "verify_expected_tokens": i64(-1, -1, -1, -1, device=device),
        "verify_expected_positions": i64(0, 1, 2, 3, device=device),
        "verify_prev_slot_indices": i64(-1, 1, 2, 3, device=device),
        "verify_num_valid": i32(0, device=device),
        "verify_enable": i32(1, device=device),
        "kernel_kind": 3,
        "violation_ring": torch.zeros((RING_CAPACITY, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
        "violation_write_index": i32(0, device=device),
        "slot_run_counter": i64(0, device=device),
        "kernel_run_counter": i64(0, device=device),
        "real_kv_source_params": params,
        "num_sources": layout.MAX_REAL_KV_SOURCES,
        "real_kv_hash_mode": layout.REAL_KV_HASH_MODE_ALL,
        "check_tokens": 1,
    }
    args.update(zip(BUF_NAMES, bufs, strict=True))
    assert set(args) == set(VERIFY_ARGS)
    return args


VALID_ARGS: dict[str, Callable[..., dict[str, Any]]] = {WRITE: valid_write_args, VERIFY: valid_verify_args}


def call_raw(fn: str, args: dict[str, Any], backend: str = "cpu") -> None:
    getattr(load_module(backend), fn)(*(args[name] for name in ARG_ORDER[fn]))


def arg_error(fn: str, arg: str, *rest: str) -> str:
    """Regex: the message starts with "<fn>: <arg>: " and then contains each of ``rest`` in order."""
    return "^" + re.escape(f"{fn}: {arg}: ") + "".join(".*" + re.escape(r) for r in rest)


def expect_rejected(fn: str, args: dict[str, Any], exc: type[Exception], pattern: str, backend: str = "cpu") -> None:
    """The call raises ``exc`` matching ``pattern`` and nothing ran (the launch counter did not move)."""
    counter = args["kernel_run_counter"]
    counter_is_plain = isinstance(counter, torch.Tensor) and counter.dtype == torch.int64 and counter.numel() == 1
    with pytest.raises(exc, match=pattern) as info:
        call_raw(fn, args, backend)
    assert type(info.value) is exc  # the exact class, not a subclass or a RuntimeError
    if counter_is_plain:
        assert int(counter.cpu().reshape(-1)[0]) == 0, "validation failed after the kernel ran"


# DLPack device relabelling: a CPU tensor presented to tvm-ffi as another device (never dereferenced).
ctypes.pythonapi.PyCapsule_GetPointer.restype = ctypes.c_void_p
ctypes.pythonapi.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DL_CPU = 1
_DL_CUDA = 2
_DLTENSOR_DEVICE_OFFSET = 8  # DLManagedTensor.dl_tensor.device follows the data pointer


class Relabelled:
    """Exports ``tensor`` through the legacy DLPack protocol with its device field rewritten."""

    def __init__(self, tensor: torch.Tensor, device_type: int, device_id: int) -> None:
        self.tensor = tensor
        self.device = (device_type, device_id)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, **_: Any) -> Any:
        capsule = self.tensor.__dlpack__()
        ptr = ctypes.pythonapi.PyCapsule_GetPointer(capsule, b"dltensor")
        ctypes.c_int32.from_address(ptr + _DLTENSOR_DEVICE_OFFSET).value = self.device[0]
        ctypes.c_int32.from_address(ptr + _DLTENSOR_DEVICE_OFFSET + 4).value = self.device[1]
        return capsule


def tensor_args(fn: str) -> list[str]:
    args = VALID_ARGS[fn]()
    return [name for name in ARG_ORDER[fn] if isinstance(args[name], torch.Tensor)]


def int_args(fn: str) -> list[str]:
    args = VALID_ARGS[fn]()
    return [name for name in ARG_ORDER[fn] if isinstance(args[name], int)]


def cases(fn: str, names: list[str]) -> list[Any]:
    return [pytest.param(fn, name, id=f"{fn}-{name}") for name in names]


WRITE_TENSORS = tensor_args(WRITE)
VERIFY_TENSORS = tensor_args(VERIFY)
ALL_TENSOR_CASES = cases(WRITE, WRITE_TENSORS) + cases(VERIFY, VERIFY_TENSORS)
ALL_INT_CASES = cases(WRITE, int_args(WRITE)) + cases(VERIFY, int_args(VERIFY))

_DTYPE_NAMES = {torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8"}
_WRONG_DTYPE = {torch.int64: torch.int32, torch.int32: torch.int64, torch.uint8: torch.int64}


# ---------------------------------------------------------------------------------------------- valid calls


@pytest.fixture(scope="module", autouse=True)
def _cpu_module() -> None:
    load_module("cpu")  # build once, outside the first test's assertions


def test_arg_lists_match_the_spec() -> None:
    assert len(WRITE_ARGS) == 23 and len(VERIFY_ARGS) == 20
    assert len(WRITE_TENSORS) == 19 and len(VERIFY_TENSORS) == 16
    assert set(int_args(WRITE)) == {"kernel_kind", "enable_write_input_assert", "num_sources", "real_kv_hash_mode"}
    assert set(int_args(VERIFY)) == {"kernel_kind", "num_sources", "real_kv_hash_mode", "check_tokens"}


def test_valid_write_call_runs() -> None:
    args = valid_write_args()
    call_raw(WRITE, args)
    assert args["kernel_run_counter"].tolist() == [1]
    assert args["slot_run_counter"].tolist() == [NUM_TOKENS]
    assert args["violation_write_index"].tolist() == [0]
    records = args["canary_buf"].view(torch.int64)
    assert records[1:5, layout.RECORD_FIELD_TOKEN].tolist() == [11, 12, 21, 22]
    assert records[1:5, layout.RECORD_FIELD_REAL_KV_HASH].ne(0).all()


def test_valid_verify_call_runs() -> None:
    args = valid_verify_args()
    call_raw(VERIFY, args)
    assert args["kernel_run_counter"].tolist() == [1]
    assert args["violation_write_index"].tolist() == [0]


def test_valid_write_call_without_input_assert_and_sources() -> None:
    args = valid_write_args()
    args.update(enable_write_input_assert=0, expected_input_tokens=None, expected_input_positions=None, num_sources=0)
    call_raw(WRITE, args)
    assert args["kernel_run_counter"].tolist() == [1]


def test_unused_source_slots_are_not_validated() -> None:
    """Sources >= num_sources or with read_bytes 0 may carry any params and a [1, 16] placeholder buffer."""
    for fn in (WRITE, VERIFY):
        args = VALID_ARGS[fn]()
        params = args["real_kv_source_params"]
        params[1] = torch.tensor([0, 24, 0], dtype=torch.int32)  # used index, read_bytes 0: unused
        params[2:] = torch.tensor([0, 7, 999], dtype=torch.int32)  # beyond num_sources
        args["num_sources"] = 2
        for name in BUF_NAMES[1:]:
            args[name] = torch.zeros((1, 16), dtype=torch.uint8)
        call_raw(fn, args)
        assert args["kernel_run_counter"].tolist() == [1]


def test_real_kv_buffers_may_be_row_strided_views() -> None:
    """Only the inner stride must be 1: a per-layer view [rows, row_bytes] of a larger buffer is accepted."""
    for fn in (WRITE, VERIFY):
        args = VALID_ARGS[fn]()
        for name in BUF_NAMES:
            rows, width = args[name].shape
            big = torch.zeros((rows, 3, width), dtype=torch.uint8)
            big[:, 1] = args[name]
            args[name] = big[:, 1]
            assert not args[name].is_contiguous()
        call_raw(fn, args)
        assert args["kernel_run_counter"].tolist() == [1]


# ---------------------------------------------------------------------------------------------- every tensor argument


@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_wrong_dtype(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    t = args[arg]
    wrong = _WRONG_DTYPE[t.dtype]
    args[arg] = t.to(wrong)
    expect_rejected(
        fn, args, TypeError, arg_error(fn, arg, f"expected dtype {_DTYPE_NAMES[t.dtype]}", f"got {_DTYPE_NAMES[wrong]}")
    )


@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_wrong_ndim(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    t = args[arg]
    args[arg] = t.unsqueeze(0)
    expect_rejected(fn, args, ValueError, arg_error(fn, arg, f"expected a {t.dim()}-d tensor"))


@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_not_a_tensor(fn: str, arg: str) -> None:
    """tvm-ffi rejects a non-tensor before the wrapper runs; its message names the function and position."""
    args = VALID_ARGS[fn]()
    args[arg] = args[arg].tolist()
    position = ARG_ORDER[fn].index(arg)
    with pytest.raises(TypeError, match=re.escape(f"argument #{position} when calling: `{fn}(")):
        call_raw(fn, args)


# Wrong shape: (fn, arg) -> (mutation, argument named first, further text the message must contain).
def _shorter(t: torch.Tensor) -> torch.Tensor:
    return t[:-1].clone()


def _longer(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t[:1]])


def _narrower(t: torch.Tensor) -> torch.Tensor:
    return t[:, :-1].contiguous()


SHAPE_CASES: dict[tuple[str, str], tuple[Callable[[torch.Tensor], torch.Tensor], str, tuple[str, ...]]] = {
    # canary_buf binds num_slots and slot_stride_bytes; its own shape rule is slot_stride_bytes >= 32.
    (WRITE, "canary_buf"): (_narrower, "canary_buf", ("slot_stride_bytes (shape[1]) must be >= 32", "got 31")),
    (WRITE, "write_offsets"): (
        _shorter,
        "write_offsets",
        ("expected length write_req_capacity + 1 = 3", "bound by write_seed_slot_indices", "got 2"),
    ),
    (WRITE, "write_seed_slot_indices"): (
        _longer,
        "write_offsets",
        ("expected length write_req_capacity + 1 = 4", "bound by write_seed_slot_indices", "got 3"),
    ),
    (WRITE, "write_num_valid_reqs"): (_longer, "write_num_valid_reqs", ("expected shape [1], got [2]",)),
    # input_ids binds num_tokens: a mismatch is reported on the next token array, naming input_ids.
    (WRITE, "input_ids"): (_shorter, "positions", ("expected shape [num_tokens=3], got [4]", "bound by input_ids")),
    (WRITE, "positions"): (_shorter, "positions", ("expected shape [num_tokens=4], got [3]", "bound by input_ids")),
    (WRITE, "out_cache_loc"): (_longer, "out_cache_loc", ("[num_tokens=4], got [5]", "bound by input_ids")),
    (WRITE, "expected_input_tokens"): (_shorter, "expected_input_tokens", ("got [3]", "bound by input_ids")),
    (WRITE, "expected_input_positions"): (_longer, "expected_input_positions", ("got [5]", "bound by input_ids")),
    (WRITE, "violation_ring"): (_narrower, "violation_ring", ("expected shape [ring_capacity=4, 8], got [4, 7]",)),
    (WRITE, "violation_write_index"): (_longer, "violation_write_index", ("expected shape [1], got [2]",)),
    (WRITE, "slot_run_counter"): (_longer, "slot_run_counter", ("expected shape [1], got [2]",)),
    (WRITE, "kernel_run_counter"): (_longer, "kernel_run_counter", ("expected shape [1], got [2]",)),
    (WRITE, "enable_chain_position_assert"): (
        _longer,
        "enable_chain_position_assert",
        ("expected shape [1], got [2]",),
    ),
    (WRITE, "real_kv_source_params"): (_narrower, "real_kv_source_params", ("expected shape [4, 3], got [4, 2]",)),
    (VERIFY, "canary_buf"): (_narrower, "canary_buf", ("slot_stride_bytes (shape[1]) must be >= 32", "got 31")),
    (VERIFY, "verify_slot_indices"): (
        _shorter,
        "verify_expected_tokens",
        ("expected shape [verify_capacity=3], got [4]", "bound by verify_slot_indices"),
    ),
    (VERIFY, "verify_expected_tokens"): (
        _shorter,
        "verify_expected_tokens",
        ("got [3]", "bound by verify_slot_indices"),
    ),
    (VERIFY, "verify_expected_positions"): (
        _longer,
        "verify_expected_positions",
        ("expected shape [verify_capacity=4], got [5]", "bound by verify_slot_indices"),
    ),
    (VERIFY, "verify_prev_slot_indices"): (
        _shorter,
        "verify_prev_slot_indices",
        ("got [3]", "bound by verify_slot_indices"),
    ),
    (VERIFY, "verify_num_valid"): (_longer, "verify_num_valid", ("expected shape [1], got [2]",)),
    (VERIFY, "verify_enable"): (_longer, "verify_enable", ("expected shape [1], got [2]",)),
    (VERIFY, "violation_ring"): (_narrower, "violation_ring", ("expected shape [ring_capacity=4, 8], got [4, 7]",)),
    (VERIFY, "violation_write_index"): (_longer, "violation_write_index", ("expected shape [1], got [2]",)),
    (VERIFY, "slot_run_counter"): (_longer, "slot_run_counter", ("expected shape [1], got [2]",)),
    (VERIFY, "kernel_run_counter"): (_longer, "kernel_run_counter", ("expected shape [1], got [2]",)),
    (VERIFY, "real_kv_source_params"): (_shorter, "real_kv_source_params", ("expected shape [4, 3], got [3, 3]",)),
}
# real_kv_buf_N: rows and row width are per-buffer symbols, checked against num_slots and the params.
for _fn in (WRITE, VERIFY):
    for _i, (_page, _read) in enumerate(SOURCE_SHAPES):
        SHAPE_CASES[(_fn, BUF_NAMES[_i])] = (
            _shorter,
            BUF_NAMES[_i],
            (
                f"covers {NUM_SLOTS - _page} slots (rows={NUM_SLOTS // _page - 1} x page_size={_page})",
                f"fewer than num_canary_slots={NUM_SLOTS}",
            ),
        )


def test_shape_cases_cover_every_tensor_argument() -> None:
    assert {(fn, a) for fn, a in SHAPE_CASES} == {(WRITE, a) for a in WRITE_TENSORS} | {
        (VERIFY, a) for a in VERIFY_TENSORS
    }


@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_wrong_shape(fn: str, arg: str) -> None:
    mutate, named, texts = SHAPE_CASES[(fn, arg)]
    args = VALID_ARGS[fn]()
    args[arg] = mutate(args[arg])
    expect_rejected(fn, args, ValueError, arg_error(fn, named, *texts))


@pytest.mark.parametrize(("fn", "buf"), [pytest.param(f, b, id=f"{f}-{b}") for f in (WRITE, VERIFY) for b in BUF_NAMES])
def test_real_kv_buf_row_too_narrow(fn: str, buf: str) -> None:
    args = VALID_ARGS[fn]()
    page = SOURCE_SHAPES[BUF_NAMES.index(buf)][0]
    args[buf] = args[buf][:, :-16].contiguous()
    expect_rejected(
        fn,
        args,
        ValueError,
        arg_error(
            fn, buf, f"row width {page * NBPT - 16} bytes is less than page_size * num_bytes_per_token = {page * NBPT}"
        ),
    )


def _strided_like(t: torch.Tensor) -> torch.Tensor:
    """Same values, dtype and shape; not contiguous (every other element of the last dim, or transposed)."""
    if t.dim() == 1:
        out = torch.zeros(2 * t.numel(), dtype=t.dtype, device=t.device)[::2]
    else:
        out = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)[..., ::2]
    out.copy_(t)
    assert out.shape == t.shape and not out.is_contiguous()
    return out


def _contiguity_applies(fn: str, arg: str) -> bool:
    """A [1] tensor is contiguous whatever its stride (torch and tvm-ffi agree), so it has no strided form."""
    return VALID_ARGS[fn]()[arg].numel() > 1


CONTIGUITY_CASES = [p for p in ALL_TENSOR_CASES if _contiguity_applies(*p.values)]


@pytest.mark.parametrize(("fn", "arg"), CONTIGUITY_CASES)
def test_non_contiguous(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    args[arg] = _strided_like(args[arg])
    if arg in BUF_NAMES:  # views of larger buffers are fine; only the inner stride must be 1
        pattern = arg_error(fn, arg, "expected a unit stride in the last dimension, got stride 2")
    else:
        pattern = arg_error(fn, arg, "expected a contiguous tensor", "non-compact strides")
    expect_rejected(fn, args, ValueError, pattern)


@pytest.mark.parametrize(("fn", "arg"), [p for p in ALL_TENSOR_CASES if not _contiguity_applies(*p.values)])
def test_single_element_arguments_accept_any_stride(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    t = args[arg]
    strided = torch.zeros(2, dtype=t.dtype)[::2]
    strided.copy_(t)
    assert strided.stride() == (2,)
    args[arg] = strided
    call_raw(fn, args)
    assert int(args["kernel_run_counter"][0]) == 1


@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_wrong_device_type(fn: str, arg: str) -> None:
    """A CUDA tensor given to the CPU build (relabelled DLPack export; never dereferenced)."""
    args = VALID_ARGS[fn]()
    args[arg] = Relabelled(args[arg], _DL_CUDA, 0)
    if arg == "real_kv_source_params":
        pattern = arg_error(fn, arg, "expected device cpu (a host-side table), got cuda:0")
    else:
        pattern = arg_error(fn, arg, "expected device cpu (this is the cpu build of kvcanary), got cuda:0")
    expect_rejected(fn, args, ValueError, pattern)


DEVICE_ID_CASES = [p for p in ALL_TENSOR_CASES if p.values[1] != "real_kv_source_params"]


@pytest.mark.parametrize(("fn", "arg"), DEVICE_ID_CASES)
def test_device_id_mismatch(fn: str, arg: str) -> None:
    """Every tensor must sit on the device canary_buf bound (here cpu:1 vs cpu:0, relabelled)."""
    args = VALID_ARGS[fn]()
    args[arg] = Relabelled(args[arg], _DL_CPU, 1)
    if arg == "canary_buf":  # canary_buf binds cpu:1; the next tensor (cpu:0) is the one that disagrees
        named, message = ARG_ORDER[fn][1], "expected device cpu:1 (bound by canary_buf), got cpu"
    else:
        named, message = arg, "expected device cpu (bound by canary_buf), got cpu:1"
    expect_rejected(fn, args, ValueError, arg_error(fn, named, message))


def test_params_table_device_id_is_not_bound() -> None:
    """The param table only has to be on the host; it is not tied to the call's device id."""
    args = valid_write_args()
    args["real_kv_source_params"] = Relabelled(args["real_kv_source_params"], _DL_CPU, 1)
    call_raw(WRITE, args)
    assert args["kernel_run_counter"].tolist() == [1]


# ---------------------------------------------------------------------------------------------- real CUDA devices

_has_cuda = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda, reason="needs a CUDA device")
@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_cuda_tensor_to_cpu_build(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    args[arg] = args[arg].cuda()
    if arg == "real_kv_source_params":
        pattern = arg_error(fn, arg, "expected device cpu (a host-side table), got cuda:")
    else:
        pattern = arg_error(fn, arg, "expected device cpu (this is the cpu build of kvcanary), got cuda:")
    expect_rejected(fn, args, ValueError, pattern)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda, reason="needs a CUDA device")
@pytest.mark.parametrize(("fn", "arg"), ALL_TENSOR_CASES)
def test_cpu_tensor_to_cuda_build(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]("cuda")
    call_raw(fn, VALID_ARGS[fn]("cuda"), backend="cuda")  # the valid CUDA call runs
    if arg == "real_kv_source_params":  # the table must stay on the host even for the CUDA build
        args[arg] = args[arg].cuda()
        pattern = arg_error(fn, arg, "expected device cpu (a host-side table), got cuda:")
    else:
        args[arg] = args[arg].cpu()
        pattern = arg_error(fn, arg, "expected device cuda (this is the cuda build of kvcanary), got cpu")
    expect_rejected(fn, args, ValueError, pattern, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda, reason="needs a CUDA device")
@pytest.mark.parametrize(("fn", "arg"), DEVICE_ID_CASES)
def test_cuda_device_id_mismatch(fn: str, arg: str) -> None:
    """cuda:1 vs cuda:0 (relabelled, so one GPU suffices; the check runs before any launch)."""
    args = VALID_ARGS[fn]("cuda")
    args[arg] = Relabelled(args[arg], _DL_CUDA, 1)
    named = ARG_ORDER[fn][1] if arg == "canary_buf" else arg
    expect_rejected(fn, args, ValueError, arg_error(fn, named, "(bound by canary_buf)"), backend="cuda")


# ---------------------------------------------------------------------------------------------- int arguments


@pytest.mark.parametrize(("fn", "arg"), ALL_INT_CASES)
def test_int_argument_wrong_python_type(fn: str, arg: str) -> None:
    args = VALID_ARGS[fn]()
    args[arg] = float(args[arg]) + 0.5
    position = ARG_ORDER[fn].index(arg)
    with pytest.raises(TypeError, match=re.escape(f"argument #{position} when calling: `{fn}(") + ".*Expected `int`"):
        call_raw(fn, args)
    assert args["kernel_run_counter"].tolist() == [0]


RANGE_CASES = [
    (WRITE, "enable_write_input_assert", -1, "must be 0 or 1, got -1"),
    (WRITE, "enable_write_input_assert", 2, "must be 0 or 1, got 2"),
    (VERIFY, "check_tokens", -1, "must be 0 or 1, got -1"),
    (VERIFY, "check_tokens", 2, "must be 0 or 1, got 2"),
    (WRITE, "num_sources", -1, "must be in [0, 4], got -1"),
    (WRITE, "num_sources", 5, "must be in [0, 4], got 5"),
    (VERIFY, "num_sources", -1, "must be in [0, 4], got -1"),
    (VERIFY, "num_sources", 5, "must be in [0, 4], got 5"),
    (WRITE, "real_kv_hash_mode", -1, "must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got -1"),
    (WRITE, "real_kv_hash_mode", 3, "must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got 3"),
    (VERIFY, "real_kv_hash_mode", -1, "must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got -1"),
    (VERIFY, "real_kv_hash_mode", 3, "must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got 3"),
]


@pytest.mark.parametrize(
    ("fn", "arg", "value", "text"), [pytest.param(*c, id=f"{c[0]}-{c[1]}={c[2]}") for c in RANGE_CASES]
)
def test_int_argument_out_of_range(fn: str, arg: str, value: int, text: str) -> None:
    args = VALID_ARGS[fn]()
    args[arg] = value
    expect_rejected(fn, args, ValueError, arg_error(fn, arg, text))


@pytest.mark.parametrize("fn", [WRITE, VERIFY])
def test_kernel_kind_is_any_int64(fn: str) -> None:
    """kernel_kind is a free launch tag stored in column 0 of violation rows: no range check."""
    args = VALID_ARGS[fn]()
    args["kernel_kind"] = -(2**63)
    call_raw(fn, args)
    assert args["kernel_run_counter"].tolist() == [1]


@pytest.mark.parametrize("fn", [WRITE, VERIFY])
def test_slot_stride_minimum_is_accepted(fn: str) -> None:
    args = VALID_ARGS[fn]()
    args["canary_buf"] = torch.zeros((NUM_SLOTS, layout.MIN_SLOT_STRIDE_BYTES), dtype=torch.uint8)
    call_raw(fn, args)
    assert args["kernel_run_counter"].tolist() == [1]


@pytest.mark.parametrize("fn", [WRITE, VERIFY])
def test_short_slot_stride_rejected(fn: str) -> None:
    args = VALID_ARGS[fn]()
    args["canary_buf"] = torch.zeros((NUM_SLOTS, 16), dtype=torch.uint8)
    expect_rejected(
        fn, args, ValueError, arg_error(fn, "canary_buf", "slot_stride_bytes (shape[1]) must be >= 32, got 16")
    )


def test_zero_token_write_runs() -> None:
    """An idle batch (no tokens, empty ranges) is a valid call that only bumps the launch counter."""
    args = valid_write_args()
    for name in ("input_ids", "positions", "out_cache_loc", "expected_input_tokens", "expected_input_positions"):
        args[name] = torch.zeros(0, dtype=torch.int64)
    args["write_offsets"] = i64(0, 0, 0)
    call_raw(WRITE, args)
    assert args["kernel_run_counter"].tolist() == [1]
    assert args["slot_run_counter"].tolist() == [0]


def test_zero_capacity_verify_runs() -> None:
    args = valid_verify_args()
    for name in (
        "verify_slot_indices",
        "verify_expected_tokens",
        "verify_expected_positions",
        "verify_prev_slot_indices",
    ):
        args[name] = torch.zeros(0, dtype=torch.int64)
    args["verify_num_valid"] = i32(5)
    call_raw(VERIFY, args)
    assert args["kernel_run_counter"].tolist() == [1]
    assert args["slot_run_counter"].tolist() == [0]


# ---------------------------------------------------------------------------------------------- optional arguments

PRESENCE_CASES = [
    # (enable_write_input_assert, tokens present, positions present, argument named, text)
    (1, False, True, "expected_input_tokens", "required when enable_write_input_assert=1"),
    (1, True, False, "expected_input_positions", "required when enable_write_input_assert=1"),
    (1, False, False, "expected_input_tokens", "required when enable_write_input_assert=1"),
    (0, True, False, "expected_input_tokens", "must be None when enable_write_input_assert=0"),
    (0, False, True, "expected_input_positions", "must be None when enable_write_input_assert=0"),
    (0, True, True, "expected_input_tokens", "must be None when enable_write_input_assert=0"),
]


@pytest.mark.parametrize(
    ("flag", "tokens", "positions", "named", "text"),
    [pytest.param(*c, id=f"assert={c[0]}-tokens={c[1]}-positions={c[2]}") for c in PRESENCE_CASES],
)
def test_expected_inputs_presence_follows_the_flag(
    flag: int, tokens: bool, positions: bool, named: str, text: str
) -> None:
    args = valid_write_args()
    args["enable_write_input_assert"] = flag
    if not tokens:
        args["expected_input_tokens"] = None
    if not positions:
        args["expected_input_positions"] = None
    expect_rejected(WRITE, args, ValueError, arg_error(WRITE, named, text))


# ---------------------------------------------------------------------------------------------- source params / buffers

PARAM_FIELD_CASES = [
    # (field index, value, text)
    (layout.REAL_KV_PARAM_PAGE_SIZE, 0, "page_size must be >= 1, got 0"),
    (layout.REAL_KV_PARAM_PAGE_SIZE, -2, "page_size must be >= 1, got -2"),
    (layout.REAL_KV_PARAM_BYTES_PER_TOKEN, 24, "num_bytes_per_token must be a positive multiple of 16, got 24"),
    (layout.REAL_KV_PARAM_BYTES_PER_TOKEN, 0, "num_bytes_per_token must be a positive multiple of 16, got 0"),
    (layout.REAL_KV_PARAM_BYTES_PER_TOKEN, -32, "num_bytes_per_token must be a positive multiple of 16, got -32"),
    (layout.REAL_KV_PARAM_READ_BYTES, 48, "read_bytes must be a multiple of 16 in [0, num_bytes_per_token=32], got 48"),
    (layout.REAL_KV_PARAM_READ_BYTES, 8, "read_bytes must be a multiple of 16 in [0, num_bytes_per_token=32], got 8"),
    (
        layout.REAL_KV_PARAM_READ_BYTES,
        -16,
        "read_bytes must be a multiple of 16 in [0, num_bytes_per_token=32], got -16",
    ),
]


@pytest.mark.parametrize(
    ("fn", "source", "field", "value", "text"),
    [
        pytest.param(fn, s, f, v, t, id=f"{fn}-source{s}-field{f}={v}")
        for fn in (WRITE, VERIFY)
        for s in range(layout.MAX_REAL_KV_SOURCES)
        for f, v, t in PARAM_FIELD_CASES
    ],
)
def test_bad_source_params(fn: str, source: int, field: int, value: int, text: str) -> None:
    args = VALID_ARGS[fn]()
    args["real_kv_source_params"][source, field] = value
    expect_rejected(fn, args, ValueError, arg_error(fn, "real_kv_source_params", f"source {source}: {text}"))


@pytest.mark.parametrize("fn", [WRITE, VERIFY])
def test_bad_params_are_checked_in_every_hash_mode(fn: str) -> None:
    """A used source is validated even when the mode reads nothing (the ABI does not depend on the mode)."""
    args = VALID_ARGS[fn]()
    args["real_kv_hash_mode"] = layout.REAL_KV_HASH_MODE_NONE
    args["real_kv_source_params"][0, layout.REAL_KV_PARAM_PAGE_SIZE] = 0
    expect_rejected(fn, args, ValueError, arg_error(fn, "real_kv_source_params", "source 0: page_size"))


BUF_CASES = [pytest.param(f, b, id=f"{f}-{b}") for f in (WRITE, VERIFY) for b in BUF_NAMES]


@pytest.mark.parametrize(("fn", "buf"), BUF_CASES)
def test_real_kv_buf_row_stride_not_multiple_of_16(fn: str, buf: str) -> None:
    args = VALID_ARGS[fn]()
    rows, width = args[buf].shape
    wide = torch.zeros((rows, width + 8), dtype=torch.uint8)
    view = wide[:, :width]
    view.copy_(args[buf])
    args[buf] = view
    expect_rejected(
        fn, args, ValueError, arg_error(fn, buf, f"row stride must be a positive multiple of 16 bytes, got {width + 8}")
    )


@pytest.mark.parametrize(("fn", "buf"), BUF_CASES)
def test_real_kv_buf_misaligned_data_pointer(fn: str, buf: str) -> None:
    args = VALID_ARGS[fn]()
    rows, width = args[buf].shape
    flat = torch.zeros(rows * width + 8, dtype=torch.uint8)
    view = flat[8:].view(rows, width)
    assert view.data_ptr() % 16 == 8
    args[buf] = view
    expect_rejected(fn, args, ValueError, arg_error(fn, buf, "data pointer must be 16-byte aligned"))


@pytest.mark.parametrize(("fn", "buf"), BUF_CASES)
def test_real_kv_buf_stride_zero_rows(fn: str, buf: str) -> None:
    """An expanded (row stride 0) buffer would alias every row: rejected."""
    args = VALID_ARGS[fn]()
    rows, width = args[buf].shape
    args[buf] = torch.zeros((1, width), dtype=torch.uint8).expand(rows, width)
    expect_rejected(
        fn, args, ValueError, arg_error(fn, buf, "row stride must be a positive multiple of 16 bytes, got 0")
    )


# ---------------------------------------------------------------------------------------------- Python wrappers


def wrapper_write_kwargs() -> dict[str, Any]:
    args = valid_write_args()
    for name in (*BUF_NAMES, "real_kv_source_params", "num_sources"):
        del args[name]
    args["enable_write_input_assert"] = True
    args["real_kv_sources"] = [RealKvSource(torch.zeros((NUM_SLOTS, 64), dtype=torch.uint8), 1, 64, 64)]
    return args


def wrapper_verify_kwargs() -> dict[str, Any]:
    args = valid_verify_args()
    for name in (*BUF_NAMES, "real_kv_source_params", "num_sources"):
        del args[name]
    args["check_tokens"] = True
    args["real_kv_sources"] = [RealKvSource(torch.zeros((NUM_SLOTS, 64), dtype=torch.uint8), 1, 64, 64)]
    return args


WRAPPERS = [
    pytest.param(write.canary_write_step, wrapper_write_kwargs, WRITE, id=WRITE),
    pytest.param(verify.canary_verify_step, wrapper_verify_kwargs, VERIFY, id=VERIFY),
]


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_valid_call(wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str) -> None:
    kwargs = make()
    wrapper(**kwargs)
    assert kwargs["kernel_run_counter"].tolist() == [1]


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_is_keyword_only(wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str) -> None:
    kwargs = make()
    with pytest.raises(TypeError, match=re.escape(f"{fn}() takes 0 positional arguments")):
        wrapper(*kwargs.values())


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_rejects_non_source(wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str) -> None:
    kwargs = make()
    kwargs["real_kv_sources"] = [kwargs["real_kv_sources"][0], torch.zeros((NUM_SLOTS, 64), dtype=torch.uint8)]
    with pytest.raises(TypeError, match=re.escape("kvcanary: real_kv_sources[1]: expected RealKvSource, got Tensor")):
        wrapper(**kwargs)
    assert kwargs["kernel_run_counter"].tolist() == [0]


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_rejects_too_many_sources(
    wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str
) -> None:
    kwargs = make()
    kwargs["real_kv_sources"] = kwargs["real_kv_sources"] * 5
    with pytest.raises(ValueError, match=re.escape("kvcanary: real_kv_sources: at most 4 sources, got 5")):
        wrapper(**kwargs)
    assert kwargs["kernel_run_counter"].tolist() == [0]


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
@pytest.mark.parametrize("mode", [-1, 3])
def test_wrapper_bad_hash_mode(
    wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str, mode: int
) -> None:
    kwargs = make()
    kwargs["real_kv_hash_mode"] = mode
    with pytest.raises(ValueError, match=arg_error(fn, "real_kv_hash_mode", f"got {mode}")):
        wrapper(**kwargs)
    assert kwargs["kernel_run_counter"].tolist() == [0]


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_source_too_small_for_the_pool(
    wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str
) -> None:
    kwargs = make()
    kwargs["real_kv_sources"] = [RealKvSource(torch.zeros((NUM_SLOTS - 1, 64), dtype=torch.uint8), 1, 64, 64)]
    with pytest.raises(ValueError, match=arg_error(fn, "real_kv_buf_0", f"fewer than num_canary_slots={NUM_SLOTS}")):
        wrapper(**kwargs)


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_unsupported_canary_device(
    wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str
) -> None:
    kwargs = make()
    kwargs["canary_buf"] = torch.empty((NUM_SLOTS, SLOT_STRIDE), dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=arg_error(fn, "canary_buf", "expected a cpu or cuda tensor", "device meta")):
        wrapper(**kwargs)


@pytest.mark.parametrize(("wrapper", "make", "fn"), WRAPPERS)
def test_wrapper_forwards_tensor_checks(
    wrapper: Callable[..., None], make: Callable[[], dict[str, Any]], fn: str
) -> None:
    kwargs = make()
    kwargs["violation_ring"] = kwargs["violation_ring"].to(torch.int32)
    with pytest.raises(TypeError, match=arg_error(fn, "violation_ring", "expected dtype int64")):
        wrapper(**kwargs)


def test_wrapper_write_flag_without_expected_inputs() -> None:
    kwargs = wrapper_write_kwargs()
    kwargs["expected_input_positions"] = None
    with pytest.raises(ValueError, match=arg_error(WRITE, "expected_input_positions", "required")):
        write.canary_write_step(**kwargs)


def test_wrapper_verify_check_tokens_out_of_range() -> None:
    kwargs = wrapper_verify_kwargs()
    kwargs["check_tokens"] = 2
    with pytest.raises(ValueError, match=arg_error(VERIFY, "check_tokens", "must be 0 or 1, got 2")):
        verify.canary_verify_step(**kwargs)


# ---------------------------------------------------------------------------------------------- RealKvSource


def _source(**overrides: Any) -> RealKvSource:
    fields: dict[str, Any] = {
        "tensor": torch.zeros((8, 128), dtype=torch.uint8),
        "page_size": 2,
        "num_bytes_per_token": 64,
        "read_bytes": 32,
    }
    fields.update(overrides)
    return RealKvSource(**fields)


def _misaligned(rows: int, width: int) -> torch.Tensor:
    flat = torch.zeros(rows * width + 8, dtype=torch.uint8)
    view = flat[8:].view(rows, width)
    assert view.data_ptr() % 16 == 8
    return view


SOURCE_ERROR_CASES = [
    # (id, overrides, exception, field, text)
    ("tensor-not-a-tensor", {"tensor": [[0] * 128] * 8}, TypeError, "tensor", "expected torch.Tensor, got list"),
    ("tensor-none", {"tensor": None}, TypeError, "tensor", "expected torch.Tensor, got NoneType"),
    ("tensor-1d", {"tensor": torch.zeros(1024, dtype=torch.uint8)}, ValueError, "tensor", "at least 2 dims"),
    ("tensor-0d", {"tensor": torch.zeros((), dtype=torch.uint8)}, ValueError, "tensor", "at least 2 dims"),
    (
        "tensor-inner-dims-not-contiguous",
        {"tensor": torch.zeros((8, 64, 4), dtype=torch.bfloat16).transpose(1, 2)},
        ValueError,
        "tensor",
        "the dims after the first must be contiguous",
    ),
    (
        "tensor-inner-stride-2",
        {"tensor": torch.zeros((8, 256), dtype=torch.uint8)[:, ::2]},
        ValueError,
        "tensor",
        "the dims after the first must be contiguous",
    ),
    (
        "tensor-row-stride-not-multiple-of-16",
        {"tensor": torch.zeros((8, 136), dtype=torch.uint8)[:, :128]},
        ValueError,
        "tensor",
        "row stride must be a multiple of 16 bytes, got 136",
    ),
    (
        "tensor-misaligned",
        {"tensor": _misaligned(8, 128)},
        ValueError,
        "tensor",
        "data pointer must be 16-byte aligned",
    ),
    (
        "tensor-row-too-narrow",
        {"tensor": torch.zeros((8, 112), dtype=torch.uint8)},
        ValueError,
        "tensor",
        "row width 112 bytes is less than page_size * num_bytes_per_token = 128",
    ),
    ("page_size-0", {"page_size": 0}, ValueError, "page_size", "must be >= 1, got 0"),
    ("page_size-negative", {"page_size": -1}, ValueError, "page_size", "must be >= 1, got -1"),
    ("page_size-float", {"page_size": 2.0}, TypeError, "page_size", "expected int, got float"),
    ("page_size-bool", {"page_size": True}, TypeError, "page_size", "expected int, got bool"),
    ("num_bytes_per_token-0", {"num_bytes_per_token": 0}, ValueError, "num_bytes_per_token", "got 0"),
    (
        "num_bytes_per_token-24",
        {"num_bytes_per_token": 24},
        ValueError,
        "num_bytes_per_token",
        "multiple of 16, got 24",
    ),
    ("num_bytes_per_token-negative", {"num_bytes_per_token": -64}, ValueError, "num_bytes_per_token", "got -64"),
    (
        "num_bytes_per_token-str",
        {"num_bytes_per_token": "64"},
        TypeError,
        "num_bytes_per_token",
        "expected int, got str",
    ),
    ("read_bytes-0", {"read_bytes": 0}, ValueError, "read_bytes", "must be a positive multiple of 16, got 0"),
    ("read_bytes-8", {"read_bytes": 8}, ValueError, "read_bytes", "must be a positive multiple of 16, got 8"),
    ("read_bytes-over-nbpt", {"read_bytes": 80}, ValueError, "read_bytes", "must be <= num_bytes_per_token=64, got 80"),
    ("read_bytes-float", {"read_bytes": 32.0}, TypeError, "read_bytes", "expected int, got float"),
]


@pytest.mark.parametrize(
    ("overrides", "exc", "field", "text"), [pytest.param(*c[1:], id=c[0]) for c in SOURCE_ERROR_CASES]
)
def test_real_kv_source_rejects(overrides: dict[str, Any], exc: type[Exception], field: str, text: str) -> None:
    with pytest.raises(exc, match="^" + re.escape(f"RealKvSource: {field}: ") + ".*" + re.escape(text)):
        _source(**overrides)


def test_real_kv_source_valid_uint8() -> None:
    src = _source()
    assert src.kv_bytes.shape == (8, 128) and src.kv_bytes.dtype == torch.uint8
    assert src.num_slots == 16
    assert src.device == torch.device("cpu")


def test_real_kv_source_from_3d_bf16() -> None:
    t = torch.zeros((10, 4, 8), dtype=torch.bfloat16)  # [rows, heads, dim]: 64 bytes per token
    src = RealKvSource(t, page_size=1, num_bytes_per_token=64, read_bytes=64)
    assert src.kv_bytes.shape == (10, 64)
    assert src.kv_bytes.stride() == (64, 1)
    assert src.kv_bytes.dtype == torch.uint8
    assert src.kv_bytes.data_ptr() == t.data_ptr()
    assert src.num_slots == 10


def test_real_kv_source_from_per_layer_view() -> None:
    big = torch.zeros((6, 3, 4, 8), dtype=torch.bfloat16)  # [rows, layers, heads, dim]
    layer = big[:, 2]
    src = RealKvSource(layer, page_size=2, num_bytes_per_token=32, read_bytes=16)
    assert src.kv_bytes.shape == (6, 64)
    assert src.kv_bytes.stride() == (3 * 64, 1)
    assert src.kv_bytes.data_ptr() == layer.data_ptr()
    assert src.num_slots == 12
    # the view is what the raw kernel gets, and it is accepted there
    bufs, params, n = call.real_kv_launch_args([src], torch.device("cpu"))
    assert bufs[0] is src.kv_bytes
    assert params[0].tolist() == [2, 32, 16] and n == 1
    args = valid_verify_args()
    args["canary_buf"] = torch.zeros((12, SLOT_STRIDE), dtype=torch.uint8)
    args.update(zip(BUF_NAMES, bufs, strict=True), real_kv_source_params=params, num_sources=n)
    call_raw(VERIFY, args)
    assert args["kernel_run_counter"].tolist() == [1]


def test_real_kv_source_is_exported_at_top_level() -> None:
    assert kvcanary.RealKvSource is RealKvSource
