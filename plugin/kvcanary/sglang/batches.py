"""ForwardBatch → :class:`~kvcanary.kernels.batch.BatchView` (SPEC §4.3 mode table): the forward-mode mapping comes from
the version module (``FORWARD_MODES``), the ForwardBatch fields read here are ``forward_mode``, ``req_pool_indices``,
``out_cache_loc`` (``out_cache_loc_swa`` when present), ``extend_prefix_lens`` and ``extend_seq_lens``."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence

import torch

from kvcanary.kernels.batch import BatchView, ForwardKind
from kvcanary.runtime.identity_cache import IdentityCache
from kvcanary.runtime.installation import BatchArrays, GroupSpec

# (forward_batch, input_ids, positions, ones, empty) -> BatchView: a version module's batch_view.
BatchViewFn = Callable[[object, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], BatchView]


_INT64 = torch.int64
_ONES_PREFIXES = IdentityCache(256)  # (ones, bs) -> ones[:bs]: one per batch size a runner sees
# ForwardMode member -> its name. An enum's ``name`` is a descriptor (~0.3 µs a read) and a forward asks for its mode
# three times (the forward hook, the BatchConverter, the batch hook). IdentityCache's scheme written out (a dict read
# in C instead of a Python method call: ~5 µs from the engine's cold caches): keyed by id(), each entry holding its
# member, so no other object can take that id while the entry exists; it starts over at _MODE_NAMES_LIMIT.
_MODE_NAMES: dict[int, tuple[object, str]] = {}
_MODE_NAMES_LIMIT = 256


def i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is _INT64 else t.to(_INT64)


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy when it is a strided view: the check launch reads its arrays as dense (and says so
    by name when one is not). sglang 0.5.12's EAGLE draft decode hands the forward ``out_cache_loc[i]`` of a permuted
    ``[steps, bs]`` view, stride ``steps``: without the copy the draft runner's first forward (its graph warm-up)
    was refused and the scheduler died (2026-12-01, phase 5 on the H200). Inside a captured graph the copy is a node
    of the graph, so each replay copies the forward's own values."""
    return t if t.is_contiguous() else t.contiguous()


def ones_prefix(ones: torch.Tensor, bs: int) -> torch.Tensor:
    """``ones[:bs]``, the view built once per (tensor, bs): a slice is a torch op (~1.5 µs of host time per forward)."""
    view = _ONES_PREFIXES.get(ones, bs)
    return view if view is not None else _ONES_PREFIXES.put(ones, bs, ones[:bs])


def mode_name(fb) -> str:
    """The name of a ForwardBatch's forward mode (``ForwardMode.DECODE`` -> ``"DECODE"``)."""
    mode = fb.forward_mode
    entry = _MODE_NAMES.get(id(mode))
    return entry[1] if entry is not None else _uncached_mode_name(mode)


def _uncached_mode_name(mode: object) -> str:
    name = mode_name_of(mode)
    if isinstance(mode, enum.Enum):  # (a member's name never changes; another object's might)
        if len(_MODE_NAMES) >= _MODE_NAMES_LIMIT:
            _MODE_NAMES.clear()
        _MODE_NAMES[id(mode)] = (mode, name)
    return name


def mode_name_of(mode: object) -> str:
    """A forward mode's name (``str(mode)`` for an object without one), uncached."""
    name = getattr(mode, "name", None)  # (not getattr(mode, "name", str(mode)): that formats the enum every call)
    return str(mode) if name is None else name


def unsupported_mode(name: str, forward_modes: Mapping[str, ForwardKind], sglang_version: str) -> NotImplementedError:
    return NotImplementedError(
        f"kvcanary: forward mode {name} is not supported by the sglang {sglang_version} adapter "
        f"(supported: {', '.join(forward_modes)})"
    )


def batch_view_of(forward_modes: Mapping[str, ForwardKind], sglang_version: str) -> BatchViewFn:
    """A version's ``batch_view(fb, input_ids, positions, ones, empty)`` over its forward-mode table: one ForwardBatch
    as a BatchView, a mode missing from ``forward_modes`` raising NotImplementedError naming it. Built once per
    version, as one function (no wrapper frame per forward) that remembers each ForwardMode member's kind (a
    member's name never changes)."""
    kinds: dict[int, tuple[object, ForwardKind]] = {}  # id(mode member) -> (the member, its kind)

    def kind_of(mode: object) -> ForwardKind:
        """The kind of a mode the table has not seen before (an unsupported one raises, naming it)."""
        name = mode_name_of(mode)
        kind = forward_modes.get(name)
        if kind is None:
            raise unsupported_mode(name, forward_modes, sglang_version)
        if isinstance(mode, enum.Enum) and len(kinds) < 256:  # (members are few; anything else is asked every time)
            kinds[id(mode)] = (mode, kind)
        return kind

    def batch_view(fb, input_ids: torch.Tensor, positions: torch.Tensor, ones: torch.Tensor,
                   empty: torch.Tensor) -> BatchView:
        mode = fb.forward_mode
        known = kinds.get(id(mode))
        kind = known[1] if known is not None and known[0] is mode else kind_of(mode)
        if kind is ForwardKind.IDLE:
            rows = fb.req_pool_indices if fb.req_pool_indices is not None else empty
            rows = i64(rows)
            zeros = torch.zeros_like(rows)
            return BatchView(kind, empty, empty, empty, rows, zeros, zeros)
        if input_ids is None:
            raise NotImplementedError("kvcanary: forwards without input_ids (input_embeds only) are not supported")
        # (i64 inline: the engine's tensors are int64 already, and a call per field is host time on every forward)
        rows = fb.req_pool_indices
        if rows.dtype is not _INT64:
            rows = rows.to(_INT64)
        if positions.dtype is not _INT64:
            positions = positions.to(_INT64)
        if input_ids.dtype is not _INT64:
            input_ids = input_ids.to(_INT64)
        loc = fb.out_cache_loc
        if loc.dtype is not _INT64:
            loc = loc.to(_INT64)
        loc = dense(loc)
        if kind is ForwardKind.DECODE:
            bs = rows.numel()  # (a 2-d array is refused by the check launch and named by BatchView.validate)
            prefix = positions
            if prefix.numel() != bs:  # (an eager decode has one position per row: no slice, a torch op of host time)
                prefix = prefix[:bs]
            extend = _ONES_PREFIXES.get(ones, bs)
            if extend is None:
                extend = ones_prefix(ones, bs)
        else:
            prefix = fb.extend_prefix_lens  # int32 in sglang: the check launch reads it as it is (no conversion)
            extend = fb.extend_seq_lens
        return BatchView(kind, input_ids, positions, loc, rows, prefix, extend)

    return batch_view


def batch_arrays_of(forward_modes: Mapping[str, ForwardKind], ones: torch.Tensor) -> BatchArrays:
    """``arrays(fb, positions)``: the check launch's ``(req_pool_indices, prefix_lens, extend_lens, out_cache_loc)``
    of an EXTEND, MIXED or DECODE ForwardBatch as sglang holds them, for the installation's eager hot path
    (:meth:`kvcanary.runtime.installation.Installation.wrap_model_forward`); None for any other batch, which takes the
    general path (:func:`batch_view_of`: an idle batch, and a mode met for the first time, which it names if
    unsupported). Nothing is converted or checked here: the check launch takes int32 or int64 and refuses anything
    else before it enqueues work, and the general path then names the field (or makes a strided ``out_cache_loc``
    dense). A decode row's prefix is its position and its extend 1 (``ones[:bs]``, one view per batch size)."""
    kinds: dict[int, tuple[object, ForwardKind | None]] = {}  # id(mode member) -> (the member, its kind)
    ones_by_size: dict[int, torch.Tensor] = {}
    decode, extend, mixed = ForwardKind.DECODE, ForwardKind.EXTEND, ForwardKind.MIXED

    def arrays(fb, positions: torch.Tensor):
        mode = fb.forward_mode
        known = kinds.get(id(mode))
        if known is None or known[0] is not mode:
            if not isinstance(mode, enum.Enum) or len(kinds) >= 256:
                return None
            known = kinds[id(mode)] = (mode, forward_modes.get(mode_name_of(mode)))
            return None  # (this first one through the general path: it names an unsupported mode)
        kind = known[1]
        rows = fb.req_pool_indices
        if kind is decode:
            bs = rows.shape[0]
            ones_bs = ones_by_size.get(bs)
            if ones_bs is None:
                if bs > ones.shape[0]:
                    return None  # (more rows than any batch the canary was sized for: the general path says so)
                ones_bs = ones_by_size[bs] = ones[:bs]
            return rows, positions, ones_bs, fb.out_cache_loc
        if kind is extend or kind is mixed:
            return rows, fb.extend_prefix_lens, fb.extend_seq_lens, fb.out_cache_loc
        return None

    return arrays


class BatchConverter:
    """ForwardBatch → one BatchView per group. Graph-capturable: device ops on static views only.

    ``forward_modes`` (the version's table; None for an EAGLE pool, whose batches have modes and arrays of their
    own): with one group of the full pool, :attr:`arrays` is the eager hot path's :func:`batch_arrays_of`; else
    None."""

    def __init__(self, groups: Sequence[GroupSpec], max_batch_size: int, device: torch.device,
                 view: BatchViewFn, forward_modes: Mapping[str, ForwardKind] | None = None) -> None:
        self.groups = list(groups)
        self.view = view
        self.ones = torch.ones(max_batch_size, dtype=torch.int64, device=device)
        self.empty = torch.zeros(0, dtype=torch.int64, device=device)
        self._all_full = all(g.loc != "swa" for g in self.groups)  # every group takes the batch's own view
        self.arrays: BatchArrays | None = None
        if forward_modes is not None and len(self.groups) == 1 and self._all_full:
            self.arrays = batch_arrays_of(forward_modes, self.ones)

    def __call__(self, fb, input_ids: torch.Tensor, positions: torch.Tensor) -> list[BatchView]:
        base = self.view(fb, input_ids, positions, self.ones, self.empty)
        if self._all_full:
            return [base] * len(self.groups)
        views = []
        for g in self.groups:
            if g.loc == "swa":
                loc = getattr(fb, "out_cache_loc_swa", None)
                if loc is None or loc.shape[0] != base.num_tokens:
                    loc = g.full_to_swa_index_mapping[base.out_cache_loc]
                views.append(BatchView(base.kind, base.input_ids, base.positions, i64(loc),
                                       base.req_pool_indices, base.prefix_lens, base.extend_lens))
            else:
                views.append(base)
        return views
