"""Fault injection: engine-agnostic injectors for every SPEC §7 fault class.

Each injector mutates the tensors it is handed (in place), logs one WARNING line saying exactly what it
changed, and returns an :class:`Injection` naming the KV slots it touched, so that a test (or an operator
reading the log) can match the canary's detections to injections. The injectors know nothing about an
engine: which row, slot or batch entry to corrupt is the caller's choice (``tests/sim`` drives them from a
simulator; the SGLang adapter from :class:`FaultPlan`, keeping one runner's injections, pending class and undo actions
in a :class:`FaultInjectionState`).

Classes (``FAULT_CLASSES``), injector, what the canary should report (``EXPECTED_REASONS``):

* ``req_to_token_redirect``: :func:`redirect_req_to_token`; verify_chain_hash.
* ``real_kv_flip``: :func:`flip_real_kv`; verify_real_kv_hash.
* ``stale_slot_reuse``: the engine frees a slot and lets another request write it,
  :func:`keep_stale_mapping` keeps the old mapping; verify chain / token / position.
* ``cached_idle_corruption``: :func:`flip_cached_idle`; verify_real_kv_hash, from the sweep.
* ``token_swap``: :func:`swap_tokens`; write_token (input assert) or verify_token (token check).
* ``position_skew``: :func:`skew_position`; write_position (chain-position assert) / verify_position.
* ``out_of_range_index``: :func:`out_of_range_slot`; slot_out_of_range, and no out-of-bounds access.

Host KV tier (``HOST_TIER_CLASSES``: an engine that backs KV up to host memory and loads it back into new device
slots, like sglang's HiCache; the records follow through :mod:`kvcanary.runtime.host_tier`), each seen as
verify_real_kv_hash on the loaded device slots, with ``via=host_tier``:

* ``host_tier_flip``: :func:`flip_host_copy`, a byte of a host copy changes before it is loaded back.
* ``load_wrong_slots``: :func:`misdirect_load`, a load-back's K/V lands in other device slots than the ones the
  engine recorded for it (the records go to the right ones).
* ``load_before_backup``: :func:`stale_host_read`, a load-back reads the host copy before its backup landed.

Environment (read by :meth:`FaultPlan.from_env`; never set it in production):
``KVCANARY_FAULT=<class>[,<class>...]`` (or ``all``), ``KVCANARY_FAULT_EVERY=<steps>`` (default 100),
``KVCANARY_FAULT_WARMUP=<steps>`` (default 0), ``KVCANARY_FAULT_SEED=<int>`` (default 0),
``KVCANARY_FAULT_RANK=<int>`` (default: every rank; else only the process whose ``{rank}`` value matches).
Integers are ASCII digits only, as for every ``KVCANARY_*`` variable; any other ``KVCANARY_FAULT*`` name (a
typo such as ``KVCANARY_FAULT_EVREY``) draws the unknown-variable warning of ``kvcanary.runtime.config``.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.settings import parse_int_env

if TYPE_CHECKING:
    from kvcanary.report.reporter import Reporter

logger = logging.getLogger(__name__)

REQ_TO_TOKEN_REDIRECT = "req_to_token_redirect"
REAL_KV_FLIP = "real_kv_flip"
STALE_SLOT_REUSE = "stale_slot_reuse"
CACHED_IDLE_CORRUPTION = "cached_idle_corruption"
TOKEN_SWAP = "token_swap"
POSITION_SKEW = "position_skew"
OUT_OF_RANGE_INDEX = "out_of_range_index"
HOST_TIER_FLIP = "host_tier_flip"
LOAD_WRONG_SLOTS = "load_wrong_slots"
LOAD_BEFORE_BACKUP = "load_before_backup"

# Faults of a host KV tier's backup and load-back; only an engine with such a tier can take them.
HOST_TIER_CLASSES: tuple[str, ...] = (HOST_TIER_FLIP, LOAD_WRONG_SLOTS, LOAD_BEFORE_BACKUP)

FAULT_CLASSES: tuple[str, ...] = (
    REQ_TO_TOKEN_REDIRECT,
    REAL_KV_FLIP,
    STALE_SLOT_REUSE,
    CACHED_IDLE_CORRUPTION,
    TOKEN_SWAP,
    POSITION_SKEW,
    OUT_OF_RANGE_INDEX,
    *HOST_TIER_CLASSES,
)

# The reason names (``kvcanary.kernels.layout.reason_names``) each class is expected to produce; any one of them counts.
EXPECTED_REASONS: Mapping[str, tuple[str, ...]] = {
    REQ_TO_TOKEN_REDIRECT: ("verify_chain_hash",),
    REAL_KV_FLIP: ("verify_real_kv_hash",),
    STALE_SLOT_REUSE: ("verify_chain_hash", "verify_token", "verify_position"),
    CACHED_IDLE_CORRUPTION: ("verify_real_kv_hash",),
    TOKEN_SWAP: ("write_token", "verify_token"),
    POSITION_SKEW: ("write_position", "verify_position"),
    OUT_OF_RANGE_INDEX: ("slot_out_of_range",),
    # the loaded slot's record carries the fingerprint taken when the forward first wrote the KV
    HOST_TIER_FLIP: ("verify_real_kv_hash",),
    LOAD_WRONG_SLOTS: ("verify_real_kv_hash",),
    LOAD_BEFORE_BACKUP: ("verify_real_kv_hash",),
}

ENV_FAULT = "KVCANARY_FAULT"
ENV_FAULT_EVERY = "KVCANARY_FAULT_EVERY"
ENV_FAULT_WARMUP = "KVCANARY_FAULT_WARMUP"
ENV_FAULT_SEED = "KVCANARY_FAULT_SEED"
ENV_FAULT_RANK = "KVCANARY_FAULT_RANK"
# kvcanary.settings.FAULT_ENV_VARS lists the same names (a test pins it), so a typo in the family is flagged.


@dataclass(frozen=True)
class Injection:
    """What one injector did: the fault class, the engine step (if the caller gave one), the KV slots it
    touched (slots whose records or bytes no longer agree, or the bad index itself), and a readable detail."""

    fault: str
    step: int | None
    slots: tuple[int, ...]
    detail: str


def _log(inj: Injection, *, undo: bool = False) -> Injection:
    if undo:  # a repair flipping the bytes back: logged as what it is, not as a second injection
        logger.info("kvcanary fault undone: %s step=%s slots=%s %s", inj.fault, inj.step, list(inj.slots), inj.detail)
    else:
        logger.warning("kvcanary fault injected: %s step=%s slots=%s %s", inj.fault, inj.step, list(inj.slots),
                       inj.detail)
    return inj


def _check_index(name: str, value: int, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise IndexError(f"kvcanary.faults: {name}: expected an int in [0, {size}), got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------- injectors
def redirect_req_to_token(
    req_to_token: torch.Tensor, row: int, position: int, new_slot: int, *, step: int | None = None
) -> Injection:
    """Point the live entry ``req_to_token[row, position]`` at ``new_slot`` (another live slot).

    Touched slots: the new slot, the old one and the successor ``req_to_token[row, position + 1]`` when that
    is mapped (its chain check reads the redirected predecessor, so it fails too).
    """
    _check_index("row", row, req_to_token.shape[0])
    _check_index("position", position, req_to_token.shape[1])
    old = int(req_to_token[row, position])
    req_to_token[row, position] = new_slot
    slots = (int(new_slot), old)
    if position + 1 < req_to_token.shape[1] and int(req_to_token[row, position + 1]) != 0:
        slots += (int(req_to_token[row, position + 1]),)
    return _log(Injection(REQ_TO_TOKEN_REDIRECT, step, slots, f"req_to_token[{row}, {position}]: {old} -> {new_slot}"))


def _flip_bytes(source: RealKvSource, slot: int, byte: int, mask: int) -> tuple[int, int]:
    """XOR ``mask`` into byte ``byte`` of ``slot``'s bytes in ``source``; returns (old, new) value."""
    _check_index("slot", slot, source.num_slots)
    _check_index("byte", byte, source.num_bytes_per_token)
    if not 0 < mask <= 0xFF:
        raise ValueError(f"kvcanary.faults: mask: expected an int in [1, 255], got {mask!r}")
    row, col = divmod(slot, source.page_size)
    col = col * source.num_bytes_per_token + byte
    old = int(source.kv_bytes[row, col])
    source.kv_bytes[row, col] = old ^ mask
    return old, old ^ mask


def _flip(fault: str, source: RealKvSource, slot: int, byte: int, mask: int, step: int | None,
          undo: bool) -> Injection:
    old, new = _flip_bytes(source, slot, byte, mask)
    return _log(Injection(fault, step, (int(slot),),
                          f"real KV slot {slot} byte {byte}: 0x{old:02x} -> 0x{new:02x} (mask 0x{mask:02x})"),
                undo=undo)


def flip_real_kv(
    source: RealKvSource, slot: int, byte: int = 0, mask: int = 0xFF, *, step: int | None = None, undo: bool = False
) -> Injection:
    """XOR ``mask`` into byte ``byte`` of a live slot's real KV bytes (byte < 16 is inside the PARTIAL window).

    Calling it again with the same arguments restores the byte (``undo=True`` logs that as an undo).
    """
    return _flip(REAL_KV_FLIP, source, slot, byte, mask, step, undo)


def flip_cached_idle(
    source: RealKvSource, slot: int, byte: int = 0, mask: int = 0xFF, *, step: int | None = None, undo: bool = False
) -> Injection:
    """:func:`flip_real_kv` on a slot that only the prefix cache holds (no running request reads it): only
    the periodic sweep can see it."""
    return _flip(CACHED_IDLE_CORRUPTION, source, slot, byte, mask, step, undo)


def keep_stale_mapping(
    req_to_token: torch.Tensor, row: int, position: int, slot: int, *, step: int | None = None
) -> Injection:
    """Write the freed ``slot`` back into live ``req_to_token[row, position]``: the engine gave the slot away
    (another request is writing it) but this row still maps it."""
    _check_index("row", row, req_to_token.shape[0])
    _check_index("position", position, req_to_token.shape[1])
    old = int(req_to_token[row, position])
    req_to_token[row, position] = slot
    return _log(Injection(STALE_SLOT_REUSE, step, (int(slot),),
                          f"req_to_token[{row}, {position}] keeps freed slot {slot} (was {old})"))


def swap_tokens(
    input_ids: torch.Tensor, i: int, j: int, *, out_cache_loc: torch.Tensor | None = None, step: int | None = None
) -> Injection:
    """Swap the input tokens of batch entries ``i`` and ``j`` (two requests' next tokens).

    Touched slots: ``out_cache_loc[i]`` and ``out_cache_loc[j]`` when ``out_cache_loc`` is given.
    """
    n = input_ids.shape[0]
    _check_index("i", i, n)
    _check_index("j", j, n)
    a, b = int(input_ids[i]), int(input_ids[j])
    input_ids[i], input_ids[j] = b, a
    slots = () if out_cache_loc is None else (int(out_cache_loc[i]), int(out_cache_loc[j]))
    return _log(Injection(TOKEN_SWAP, step, slots, f"input_ids[{i}] {a} <-> input_ids[{j}] {b}"))


def skew_position(
    positions: torch.Tensor, i: int, delta: int, *, out_cache_loc: torch.Tensor | None = None, step: int | None = None
) -> Injection:
    """Add ``delta`` (non-zero) to ``positions[i]``: the token is written at the wrong position.

    Touched slot: ``out_cache_loc[i]`` when given.
    """
    _check_index("i", i, positions.shape[0])
    if delta == 0:
        raise ValueError("kvcanary.faults: delta: must be non-zero")
    old = int(positions[i])
    positions[i] = old + delta
    slots = () if out_cache_loc is None else (int(out_cache_loc[i]),)
    return _log(Injection(POSITION_SKEW, step, slots, f"positions[{i}]: {old} -> {old + delta}"))


def out_of_range_slot(
    index: torch.Tensor, i: int | tuple[int, int], num_slots: int, *, offset: int = 0, step: int | None = None
) -> Injection:
    """Set one slot index to ``num_slots + offset`` (``offset >= 0``: past the end of the pool).

    ``index`` is ``out_cache_loc`` (``i`` an int) or ``req_to_token`` (``i`` a (row, position) pair).
    Touched slots: the bad index and the slot it replaced.
    """
    if offset < 0:
        raise ValueError(f"kvcanary.faults: offset: must be >= 0, got {offset}")
    key = (i,) if isinstance(i, int) else tuple(i)
    if len(key) != index.dim():
        raise ValueError(f"kvcanary.faults: i: expected {index.dim()} indices for a {index.dim()}-d tensor, got {i!r}")
    for d, k in enumerate(key):
        _check_index(f"i[{d}]", k, index.shape[d])
    bad = num_slots + offset
    if index.dtype == torch.int32 and bad >= 1 << 31:
        raise ValueError(f"kvcanary.faults: num_slots + offset = {bad} does not fit int32")
    old = int(index[key])
    index[key] = bad
    where = "[" + ", ".join(map(str, key)) + "]"
    detail = f"index{where}: {old} -> {bad} (num_slots {num_slots})"
    return _log(Injection(OUT_OF_RANGE_INDEX, step, (bad, old), detail))


# ---------------------------------------------------------------------------------------------- host KV tier
def _device_slot(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"kvcanary.faults: {name}: expected a device slot (an int >= 0), got {value!r}")
    return value


def _slot_bytes(source: RealKvSource, slot: int) -> torch.Tensor:
    """The ``num_bytes_per_token`` bytes of ``slot`` in ``source`` (a view: writing it writes the buffer)."""
    row, col = divmod(_check_index("slot", slot, source.num_slots), source.page_size)
    n = source.num_bytes_per_token
    return source.kv_bytes[row, col * n:(col + 1) * n]


def flip_host_copy(
    host_source: RealKvSource, host_slot: int, device_slot: int, byte: int = 0, mask: int = 0xFF, *,
    step: int | None = None, undo: bool = False,
) -> Injection:
    """XOR ``mask`` into byte ``byte`` of host slot ``host_slot``'s copy in ``host_source`` (a host-tier buffer),
    which the engine is about to load back into ``device_slot``.

    Touched slot: ``device_slot``, which will hold the bad K/V (the host slot itself is verified by no one).
    Calling it again with the same arguments restores the byte (``undo=True`` logs that as an undo).
    """
    _device_slot("device_slot", device_slot)
    old, new = _flip_bytes(host_source, host_slot, byte, mask)
    return _log(Injection(HOST_TIER_FLIP, step, (int(device_slot),),
                          f"host slot {host_slot} byte {byte}: 0x{old:02x} -> 0x{new:02x} (mask 0x{mask:02x}), "
                          f"loaded into device slot {device_slot}"), undo=undo)


def misdirect_load(device_slots: torch.Tensor, *, step: int | None = None) -> tuple[Injection, torch.Tensor]:
    """A load-back whose K/V copy writes other device slots than ``device_slots``, the ones the engine (and the
    canary's records) have for it: returns the slots the K/V copy should use instead, ``device_slots`` rolled by
    one (host slot ``i``'s K/V lands in device slot ``i + 1``'s place, the last one's in the first's).

    Touched slots: every slot of ``device_slots`` (each now holds another slot's K/V). Needs at least two distinct
    slots (with one there is nothing to mix up): ``ValueError`` otherwise.
    """
    if not isinstance(device_slots, torch.Tensor) or device_slots.dim() != 1:
        raise ValueError("kvcanary.faults: device_slots: expected a 1-D tensor of device slots")
    slots = tuple(dict.fromkeys(int(s) for s in device_slots.tolist()))
    if len(slots) < 2:
        raise ValueError(f"kvcanary.faults: device_slots: a misdirected load needs >= 2 distinct slots, got {slots}")
    rolled = torch.roll(device_slots, -1)
    detail = f"load-back K/V for device slots {device_slots.tolist()} written to {rolled.tolist()}"
    return _log(Injection(LOAD_WRONG_SLOTS, step, slots, detail)), rolled


def stale_host_read(
    host_sources: Sequence[RealKvSource], host_slots: Sequence[int], device_slots: Sequence[int], *,
    step: int | None = None,
) -> tuple[Injection, Callable[[], None]]:
    """A load-back of ``host_slots`` into ``device_slots`` that reads the host copies before their backup landed:
    in every source, each host slot's ``num_bytes_per_token`` bytes become stale content (the backed-up bytes XOR
    0x5A, so always different).

    Returns the injection (touched: the device slots, which will hold the stale K/V) and the undo, which puts the
    backed-up bytes back (the backup landing): the caller runs it once the load has read the host copies, so that
    the host tier is right afterwards and only the device copy is not. A second call of the undo does nothing.
    """
    host = [int(h) for h in host_slots]
    device = [_device_slot("device_slots[]", int(d)) for d in device_slots]
    if not host or len(host) != len(device):
        raise ValueError(f"kvcanary.faults: stale_host_read: expected as many host slots as device slots (>= 1), "
                         f"got {len(host)} and {len(device)}")
    if not host_sources:
        raise ValueError("kvcanary.faults: stale_host_read: host_sources: expected at least one source")
    views = [_slot_bytes(src, h) for src in host_sources for h in dict.fromkeys(host)]
    saved = [v.clone() for v in views]
    for v in views:
        v.bitwise_xor_(0x5A)
    undone = False

    def undo() -> None:
        nonlocal undone
        if not undone:
            undone = True
            for v, old in zip(views, saved, strict=True):
                v.copy_(old)

    inj = Injection(LOAD_BEFORE_BACKUP, step, tuple(dict.fromkeys(device)),
                    f"load-back of host slots {host} into device slots {device} read them before their backup "
                    f"landed (bytes XOR 0x5a in {len(host_sources)} sources)")
    return _log(inj), undo


# ---------------------------------------------------------------------------------------------- plan
def _env_int(environ: Mapping[str, str], var: str, default: int, minimum: int) -> int:
    """An integer variable by the config module's rules (ASCII digits only; ``ValueError`` naming ``var``)."""
    raw = environ.get(var, "")
    if not raw.strip():
        return default
    return parse_int_env(var, raw, minimum=minimum)


@dataclass(frozen=True)
class FaultPlan:
    """When and what to inject in a running engine: one fault every ``every`` steps after ``warmup``,
    cycling through ``classes`` in a seeded random order."""

    classes: tuple[str, ...]
    every: int = 100
    warmup: int = 0
    seed: int = 0
    rank: int | None = None  # inject only in the process of this global rank (None: every rank)

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("FaultPlan: classes: expected at least one fault class")
        for c in self.classes:
            if c not in FAULT_CLASSES:
                raise ValueError(f"FaultPlan: unknown fault class {c!r}; expected one of {', '.join(FAULT_CLASSES)}")
        if self.rank is not None and self.rank < 0:
            raise ValueError(f"FaultPlan: rank must be >= 0 or None, got {self.rank}")
        if self.every < 1 or self.warmup < 0:
            raise ValueError(f"FaultPlan: every must be >= 1 and warmup >= 0, got {self.every}, {self.warmup}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        """The plan ``KVCANARY_FAULT*`` describes, or None when ``KVCANARY_FAULT`` is unset or empty.

        A bad value raises ``ValueError`` naming the variable and the allowed values.
        """
        env = os.environ if environ is None else environ
        raw = env.get(ENV_FAULT, "").strip()
        if not raw:
            return None
        names = [n.strip().lower() for n in raw.split(",")]
        if names == ["all"]:
            classes = FAULT_CLASSES
        else:
            bad = [n for n in names if n not in FAULT_CLASSES]
            if bad:
                raise ValueError(f"{ENV_FAULT}: expected a comma-separated list of {', '.join(FAULT_CLASSES)} "
                                 f"(or all); got {raw!r}")
            classes = tuple(dict.fromkeys(names))
        return cls(
            classes=classes,
            every=_env_int(env, ENV_FAULT_EVERY, 100, 1),
            warmup=_env_int(env, ENV_FAULT_WARMUP, 0, 0),
            seed=_env_int(env, ENV_FAULT_SEED, 0, 0),
            rank=_env_int(env, ENV_FAULT_RANK, -1, 0) if env.get(ENV_FAULT_RANK, "").strip() else None,
        )

    def applies_to(self, rank: int) -> bool:
        """Whether the process of global rank ``rank`` injects (``KVCANARY_FAULT_RANK`` unset: every rank)."""
        return self.rank is None or self.rank == rank

    def due(self, step: int) -> bool:
        """Whether to inject at ``step``."""
        return step >= self.warmup and (step - self.warmup) % self.every == 0

    def pick(self, step: int) -> str:
        """The class to inject at ``step`` (deterministic in (seed, step))."""
        return random.Random(self.seed * 1_000_003 + step).choice(self.classes)


# ---------------------------------------------------------------------------------------------- one runner's state
@dataclass(eq=False)
class FaultInjectionState:
    """Fault injection on one engine runner (``KVCANARY_FAULT``, tests only), engine-agnostic: the plan, the
    injections done, the class due but not yet injected, and the undo actions of this forward's injection.

    An engine adapter's fault layer owns it (e.g. :class:`kvcanary.sglang.fault_injection.SglangFaultInjection`, which
    adds the engine facts its injector reads): it calls :meth:`before_forward` before each real forward, and gives it
    to the runner's :class:`~kvcanary.runtime.installation.Installation` as ``step_hooks``, so the undo actions run
    in ``host_after`` before (:meth:`before_step`) or after (:meth:`after_step`) the managers' step (drain + sweep).
    """

    plan: FaultPlan
    reporter: Reporter  # where each injection is written (kvcanary.injection/1): the first group's
    injections: list[Injection] = field(default_factory=list)
    # The class due but not yet injected (no fitting batch yet) and the step it fell due; how many were skipped.
    pending: tuple[str, int] | None = None
    skips: int = 0
    # (after_step, action): run before the managers' step (False) or after it (True, e.g. to keep a corruption in
    # place for the sweep that step runs)
    _undo: list[tuple[bool, Callable[[], None]]] = field(default_factory=list)
    # What runs right before an injection attempt and before undo actions (None: nothing): the installation's
    # flush of its managers' deferred writes (Installation.flush_pending_writes). A deferred write fingerprints its
    # forward's K/V when it runs, so it must run before an injector flips those bytes (it would take the flip into
    # the record: the fault unseen, and the undo's bytes then reported) and before an undo changes them back.
    settle: Callable[[], None] | None = None

    def before_forward(self, step: int, inject: Callable[[int, str], Injection | None]) -> None:
        """Outside the graph, before a real forward (``step``: the forwards finished so far).

        When the plan is due, its class becomes pending; ``inject(step, fault_class)`` is tried on this and the
        following forwards until it returns an Injection (a class that needs a particular batch, e.g. a sweep step
        or an extend, waits for one). A class still pending when the plan falls due again is counted in ``skips``
        and replaced.
        """
        if self.plan.due(step):
            if self.pending is not None:
                self.skips += 1
                logger.warning("kvcanary: fault %s (due at step %d) found no fitting batch before step %d; skipped",
                               self.pending[0], self.pending[1], step)
            self.pending = (self.plan.pick(step), step)
        if self.pending is None:
            return
        if self.settle is not None:
            self.settle()
        injection = inject(step, self.pending[0])
        if injection is not None:
            self.pending = None
            self.record(injection)

    def record(self, injection: Injection) -> None:
        """Keep an injection and write it to the report (``kvcanary.injection/1``)."""
        self.injections.append(injection)
        self.reporter.record_injection(injection)

    def skip_pending(self) -> None:
        """The pending class cannot be injected here (the engine or its setup lacks what it needs): drop it, counted
        in ``skips``."""
        self.pending = None
        self.skips += 1

    def undo_after_forward(self, action: Callable[[], None], *, after_step: bool = False) -> None:
        """Run ``action`` in this forward's host_after: before the managers' step, or after it (``after_step``,
        e.g. to keep a corruption in place for the sweep that step runs)."""
        self._undo.append((after_step, action))

    def before_step(self) -> None:
        """Installation step hook: the undo actions due before the managers' step."""
        if self._undo:
            self._run_undo(False)

    def after_step(self) -> None:
        """Installation step hook: the undo actions due after the managers' step."""
        if self._undo:
            self._run_undo(True)

    def _run_undo(self, after_step: bool) -> None:
        if self.settle is not None and any(when == after_step for when, _ in self._undo):
            self.settle()
        keep = []
        for when, action in self._undo:
            if when == after_step:
                action()
            else:
                keep.append((when, action))
        self._undo = keep
