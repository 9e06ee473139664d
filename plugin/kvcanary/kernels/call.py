"""What every kernel wrapper shares: the kernel spec, backend dispatch, real-KV argument prep and named errors.

Argument checks live in C++ (one layer for the CPU build, the CUDA build and direct tvm-ffi calls); a wrapper turns
``real_kv_sources`` into the fixed four-buffer ABI and forwards. What C++ cannot name (``None`` where a tensor is
required, a Python list, a meta tensor, a non-integer flag: tvm-ffi or torch fail before the C++ checks run, with a
positional or C++-stack message) is named here, on the failure path only: a call runs first, and only when it raises
are the arguments inspected, so a valid call pays nothing for the check (the per-forward host cost matters) and an
invalid one gets a ``TypeError`` / ``ValueError`` that starts with ``"<fn>: <argument>: "``, like the C++ errors.

Each kernel declares its arguments once, as a :class:`KernelSpec` (the export's positional order, which are tensors,
optional tensors or ints, which are kvcanary+ and which change every forward); the call path, the bound launch and
the error path all read that one declaration.

The kvcanary+ arguments (violation metadata, request rows, writer attribution, forward counter) are optional:
without them a call goes to the seed-ABI export (``canary_write_step`` …), with any of them to the ``*_attributed``
export, which takes the same arguments followed by the new ones.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import torch

from kvcanary.kernels import layout
from kvcanary.kernels.jit import load_module
from kvcanary.kernels.real_kv import RealKvSource

logger = logging.getLogger(__name__)

_unused_source_cache: dict[torch.device, torch.Tensor] = {}


def backend_of(device: torch.device) -> str:
    """``"cpu"`` or ``"cuda"`` for a tensor's device (the kernels' two builds); anything else raises."""
    if device.type in ("cpu", "cuda"):
        return device.type
    raise ValueError(f"kvcanary: canary_buf: device {device} is not supported (cpu or cuda)")


def module_for(device: torch.device) -> Any:
    """The kernel module of ``device``'s backend. ``load_module`` is looked up here at every call, so a benchmark that
    replaces ``kvcanary.kernels.call.load_module`` reroutes every wrapper and bound launch at once."""
    return load_module(backend_of(device))


def _unused_source(device: torch.device) -> torch.Tensor:
    """A tiny aligned uint8 [1, 16] tensor standing in for unused ABI source slots (never read)."""
    t = _unused_source_cache.get(device)
    if t is None:
        t = torch.zeros((1, layout.REAL_KV_ALIGN_BYTES), dtype=torch.uint8, device=device)
        _unused_source_cache[device] = t
    return t


@dataclass(frozen=True)
class RealKvLaunch:
    """``real_kv_sources`` in the kernels' fixed four-buffer ABI, built once and reused for every launch.

    Building it costs a dozen small tensor writes (~50 us of host time); a manager prepares it once, so a
    forward's launches pay nothing. Holds the sources, so their buffers stay alive as long as it does.
    """

    sources: tuple[RealKvSource, ...]
    buffers: tuple[torch.Tensor, ...]  # MAX_REAL_KV_SOURCES byte tensors (unused slots: a tiny dummy)
    params: torch.Tensor  # CPU int32 [MAX_REAL_KV_SOURCES, REAL_KV_PARAM_FIELDS]
    num_sources: int


def prepare_real_kv(real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device) -> RealKvLaunch:
    """Check ``real_kv_sources`` and lay them out for the kernels (a ``RealKvLaunch`` passes through)."""
    if isinstance(real_kv_sources, RealKvLaunch):
        return real_kv_sources
    sources = tuple(real_kv_sources)
    if len(sources) > layout.MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"kvcanary: real_kv_sources: at most {layout.MAX_REAL_KV_SOURCES} sources, got {len(sources)}"
        )
    for i, src in enumerate(sources):
        if not isinstance(src, RealKvSource):
            raise TypeError(f"kvcanary: real_kv_sources[{i}]: expected RealKvSource, got {type(src).__name__}")
    rows = []
    for i in range(layout.MAX_REAL_KV_SOURCES):
        row = [0] * layout.REAL_KV_PARAM_FIELDS
        if i < len(sources):
            row[layout.REAL_KV_PARAM_PAGE_SIZE] = sources[i].page_size
            row[layout.REAL_KV_PARAM_BYTES_PER_TOKEN] = sources[i].num_bytes_per_token
            row[layout.REAL_KV_PARAM_READ_BYTES] = sources[i].read_bytes
        rows.append(row)
    buffers = tuple(src.kv_bytes for src in sources) + (_unused_source(device),) * (
        layout.MAX_REAL_KV_SOURCES - len(sources))
    return RealKvLaunch(sources, buffers, torch.tensor(rows, dtype=torch.int32), len(sources))


def real_kv_launch_args(
    real_kv_sources: Sequence[RealKvSource] | RealKvLaunch, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """(four byte tensors, CPU int32 [4, 3] param table, num_sources) for the raw ABI."""
    launch = prepare_real_kv(real_kv_sources, device)
    return list(launch.buffers), launch.params, launch.num_sources


# Exceptions a call with an argument tvm-ffi or torch cannot take raises before the C++ checks name it:
# TypeError (tvm-ffi's positional "Mismatched type on argument #5"), RuntimeError / BufferError (torch's DLPack
# export of a meta tensor, with a C++ stack), AttributeError (``.device`` of a non-tensor).
CALL_ERRORS = (TypeError, ValueError, RuntimeError, AttributeError, BufferError)


def named_error(fn: str, tensors: Mapping[str, tuple[Any, bool]], ints: Mapping[str, Any],
                real_kv_sources: Any = ()) -> Exception | None:
    """The first argument Python can name as wrong, as the exception to raise (None: nothing found).

    ``tensors``: name -> (value, optional); ``ints``: name -> value.
    """
    for name, (value, optional) in tensors.items():
        if value is None:
            if optional:
                continue
            return TypeError(f"{fn}: {name}: expected a torch.Tensor, got None")
        if not isinstance(value, torch.Tensor):
            return TypeError(f"{fn}: {name}: expected a torch.Tensor, got {type(value).__name__}")
        if value.device.type not in ("cpu", "cuda"):
            return ValueError(
                f"{fn}: {name}: expected a cpu or cuda tensor, got a tensor on device {value.device}"
                + (" (a meta tensor has no data)" if value.device.type == "meta" else "")
            )
    for name, value in ints.items():
        try:
            operator.index(value)
        except TypeError:
            return TypeError(f"{fn}: {name}: expected an int, got {type(value).__name__}")
    if not isinstance(real_kv_sources, (RealKvLaunch, Sequence)) or isinstance(real_kv_sources, (str, bytes)):
        return TypeError(
            f"{fn}: real_kv_sources: expected a sequence of RealKvSource or a RealKvLaunch, "
            f"got {type(real_kv_sources).__name__}"
        )
    return None


def reraise_named(exc: Exception, fn: str, tensors: Mapping[str, tuple[Any, bool]], ints: Mapping[str, Any],
                  real_kv_sources: Any = ()) -> NoReturn:
    """Raise the named error for a failed call, or ``exc`` itself when no argument is to blame in Python."""
    named = named_error(fn, tensors, ints, real_kv_sources)
    if named is None:
        raise exc
    raise named from None


# The kinds of a spec's arguments: how the call passes one and how a failed call names it.
TENSOR = "tensor"  # a required tensor
OPTIONAL = "optional"  # a tensor or None
INT = "int"  # an int flag or value, passed as ``int(value)``
INDEX = "index"  # an int count, passed as ``operator.index(value)`` (a float is refused, not truncated)
REAL_KV = "real_kv"  # ``real_kv_sources``: the four byte buffers, the param table and the source count


@dataclass(frozen=True)
class Arg:
    """One argument of a kernel export. ``name`` is the wrapper's keyword, or ``<keyword>.<field>`` for a tensor a
    plan argument holds (named so in errors); ``attributed``: passed only to the ``*_attributed`` export;
    ``bound_only``: taken by the bound launch alone (``bind_export`` when fixed, its function when per-forward), after
    every argument of the export, never by the export itself."""

    name: str
    kind: str = TENSOR
    attributed: bool = False
    bound_only: bool = False
    keyword: str = field(init=False, repr=False, compare=False)
    plan_field: str = field(init=False, repr=False, compare=False)  # "" for a plain keyword

    def __post_init__(self) -> None:
        keyword, _, plan_field = self.name.partition(".")
        object.__setattr__(self, "keyword", keyword)
        object.__setattr__(self, "plan_field", plan_field)

    def value(self, args: Mapping[str, Any]) -> Any:
        value = args[self.keyword]
        return getattr(value, self.plan_field) if self.plan_field else value


def plan_args(keyword: str, plan_cls: type, *, skip: Sequence[str] = (), attributed: bool = False) -> tuple[Arg, ...]:
    """The tensors of a plan argument, in the plan's field order (``skip``: fields the export does not take): a
    field whose default is None is optional (a kvcanary+ field), and ``attributed`` makes those attributed."""
    return tuple(
        Arg(f"{keyword}.{f.name}", OPTIONAL if f.default is None else TENSOR, attributed and f.default is None)
        for f in fields(plan_cls) if f.name not in skip
    )


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's arguments, declared once for its call, its bound launch and its named errors.

    ``args`` are in the export's positional order, but for the ``attributed`` ones: the ``*_attributed`` export takes
    them after the seed export's arguments, in their order here (an order that is also the one errors name them in:
    tensors first, then ints, each in ``args`` order); ``per_forward`` are the ones a bound launch
    (``bind_export``) takes per call, so the bind takes every other argument in this order. ``bound_only`` arguments
    come last in ``args``: the export never takes them, the bind (or, per-forward, its function) takes them after
    the others.
    """

    fn: str  # the wrapper's name, which starts its errors
    args: tuple[Arg, ...]
    device: str  # the argument (an ``Arg`` name) whose device picks the backend
    per_forward: tuple[str, ...] = ()
    bind_export: str | None = None
    _device_arg: Arg = field(init=False, repr=False, compare=False)
    _seed_args: tuple[Arg, ...] = field(init=False, repr=False, compare=False)
    _attributed_args: tuple[Arg, ...] = field(init=False, repr=False, compare=False)
    _bound_args: tuple[Arg, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_device_arg", Arg(self.device))
        object.__setattr__(self, "_seed_args", tuple(a for a in self.args if not a.attributed and not a.bound_only))
        object.__setattr__(self, "_attributed_args", tuple(a for a in self.args if a.attributed))
        object.__setattr__(self, "_bound_args", tuple(a for a in self.args if a.bound_only))

    @property
    def attributed_export(self) -> str:
        return f"{self.fn}_attributed"

    def positional(self, args: Mapping[str, Any], device: torch.device, *, skip: Sequence[str] = (),
                   attributed: bool = True, bound: bool = False) -> tuple:
        """The export's positional arguments from the wrapper's keyword ``args`` (``skip``: arguments left out;
        ``attributed``: with the attributed ones; ``bound``: with the bound-only ones, last)."""
        out: list[Any] = []
        for a in self._seed_args + (self._attributed_args if attributed else ()) + (self._bound_args if bound else ()):
            if a.name in skip:
                continue
            value = a.value(args)
            if a.kind == INT:
                out.append(int(value))
            elif a.kind == INDEX:
                out.append(operator.index(value))
            elif a.kind == REAL_KV:
                launch = prepare_real_kv(value, device)
                out.extend((*launch.buffers, launch.params, launch.num_sources))
            else:
                out.append(value)
        return tuple(out)

    def run(self, args: Mapping[str, Any]) -> None:
        """The wrapper's call with its keyword ``args``: the export on the backend of ``device``'s tensor, and the
        named error when it fails."""
        try:
            device = self._device_arg.value(args).device
            self.call(module_for(device), args, device)
        except CALL_ERRORS as exc:
            self.reraise(exc, args)

    def call(self, module: Any, args: Mapping[str, Any], device: torch.device) -> None:
        """One call of the export: the seed one, or the attributed one when any attributed tensor is given."""
        export, positional = self.laid_out(module, args, device)
        export(*positional)

    def laid_out(self, module: Any, args: Mapping[str, Any], device: torch.device) -> tuple[Any, tuple]:
        """The export :meth:`call` calls for the keyword ``args`` (the attributed one when any attributed tensor is
        given) and its positional arguments: a caller that repeats one call keeps them."""
        if any(a.value(args) is not None for a in self._attributed_args if a.kind == OPTIONAL):
            return getattr(module, self.attributed_export), self.positional(args, device)
        return getattr(module, self.fn), self.positional(args, device, attributed=False)

    def bind(self, fixed: Mapping[str, Any]) -> Any:
        """``bind_export`` with every argument but the ``per_forward`` ones (``fixed``); a failure is named as a call
        of the wrapper would name it, less the per-forward arguments (a fixed argument tvm-ffi cannot take at all is
        named here, at binding)."""
        device = self._device_arg.value(fixed).device
        module = module_for(device)
        try:
            return getattr(module, str(self.bind_export))(*self.positional(fixed, device, skip=self.per_forward,
                                                                            bound=True))
        except CALL_ERRORS as exc:
            self.reraise(exc, fixed, skip=self.per_forward)

    def reraise(self, exc: Exception, args: Mapping[str, Any], *, skip: Sequence[str] = ()) -> NoReturn:
        """The named error of a failed call with keyword ``args`` (or ``exc`` when Python cannot name an argument):
        tensors first, then ints, each in the export's order, then ``real_kv_sources`` (bound-only arguments ``args``
        lacks, as an export call's do, are not named)."""
        named = [a for a in self.args if a.name not in skip and (not a.bound_only or a.keyword in args)]
        tensors = {a.name: (a.value(args), a.kind == OPTIONAL) for a in named if a.kind in (TENSOR, OPTIONAL)}
        ints = {a.name: a.value(args) for a in named if a.kind in (INT, INDEX)}
        reraise_named(exc, self.fn, tensors, ints, args.get("real_kv_sources", ()))
