"""HiCache (sglang's host-memory KV tier): the canary's records follow the KV through backup and load-back.

sglang's ``HiCacheController`` copies K/V outside any forward: ``write(device_indices)`` backs device slots up to
host slots it allocates (write-through on insert or hit count, or write-back on eviction), ``load(host_indices)``
allocates new device slots for a host-resident prefix, and ``start_loading()`` enqueues the host → device copies
on its load stream, one event per layer, which the forward waits for layer by layer. Without this module a
loaded-back slot keeps its previous occupant's record and every verify of it fails although the KV is right
(the false positives of issue 24).

What is hooked (sglang 0.5.12's targets, :mod:`kvcanary.sglang.v0_5_12`):

* ``write`` (after) and ``load`` (after): the copy is noted (device and host slots, in order);
* ``ModelRunner.forward`` (the adapter's forward hook, before the forward, on its stream):
  :meth:`HostTierFollower.before_forward` hands every copy noted since the last forward to the managers, in order,
  consecutive copies of a kind as one batch (``CanaryManager.backup_to_host``: the device slots' records go to the
  host-tier table; ``load_from_host``: the host rows go to the new device slots, marked so a violation there says
  ``via=host_tier``), then makes the forward stream wait for the last layer of a load the forward consumes: its
  verify fingerprints the loaded slots' K/V (first and last layer by default) before the model would have waited
  for them. A forward that consumes no load waits for nothing; one that does gives up the overlap of its load
  with its first layers (the load still overlaps the scheduling work before it);
* ``start_loading`` (around): fault injection only (the three host-tier classes act on a load's copies);
* before a sweep: the sweep also reads slots of nodes whose load is still in flight, so it waits for every load
  not yet acknowledged.

Why at the next forward, on its stream: that is where the canary writes its records, so the hand-off is ordered
after every forward already launched and before the forward that reads the slots; and the copies between two
forwards (a few backups per finished request, a load-back per request whose prefix came from the host) cost one
batch, not one each. The scheduling stream would not do under the overlap scheduler: the round still in flight
for a request that just finished may still write its freed slots, which a load-back then reuses; a record copy
racing that write could lose to it (a false report on a correct restore). Nothing else writes those records in
between: a backed-up slot changes only when a later forward rewrites it, after the hand-off. sglang 0.5.12's own
H2D copy is not fenced behind that round either (fixed upstream by PR 36738, in 0.5.19): when the late write
lands on a restored slot, the K/V is really wrong and the canary reports it there (``verify_real_kv_hash``,
``via=host_tier``).

The sweep does not read host-resident nodes: their K/V lies in host memory (layouts ``layer_first``,
``page_first``, ``page_first_direct``, ``page_head``), which the verify kernel would read across PCIe on every
sweep; a host copy is checked when it is loaded back, against the fingerprint taken when it was first written.
Refused here, at start-up: a HiCache prefix cache that is not exactly ``HiRadixCache`` (the hybrid, mamba and
unified trees move KV in methods of their own), an L3 storage backend (it fills host slots with KV that has no
record) and a draft pool piggybacking on the controller (EAGLE's draft host copies are not followed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvcanary.kernels.real_kv import RealKvSource
from kvcanary.runtime.installation import Installation
from kvcanary.sglang.pools import parse_real_kv_layers, resolve_layers, token_major_source
from kvcanary.sglang.refusal import UnsupportedSetupError

if TYPE_CHECKING:
    from kvcanary.runtime.faults import FaultInjectionState

logger = logging.getLogger(__name__)

HIRADIX_CACHE_CLASS = "HiRadixCache"  # the one HiCache tree whose KV moves go through the hooked methods only
# The attribute of a HiCacheController that holds its follower.
FOLLOWER_ATTR = "_kvcanary_host_tier"


@dataclass
class HostTierFollower:
    """The canary side of one HiCacheController: the installations whose pool it moves KV for."""

    controller: object
    installations: list[Installation]
    faults: LoadFaults | None = None  # fault injection (KVCANARY_FAULT) only
    loads: int = 0
    backups: int = 0
    # hand-offs since the last forward, in order: (is_load, first, second) = (False, device, host) for a backup,
    # (True, host, device) for a load-back; handed to the managers in before_forward
    pending: list[tuple[bool, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------ record hand-off
    def backup(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> None:
        """``HiCacheController.write`` backs ``device_indices`` up to ``host_indices`` (kept for before_forward)."""
        self.backups += 1
        if self._any_running():
            self.pending.append((False, device_indices, host_indices))

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> None:
        """``HiCacheController.load`` loads ``host_indices`` back into ``device_indices`` (kept for before_forward)."""
        self.loads += 1
        if self._any_running():
            self.pending.append((True, host_indices, device_indices))

    def _any_running(self) -> bool:
        # (log mode stopped kvcanary on every runner of this pool: its forward hook no longer flushes, so nothing
        # may pile up here)
        return any(inst.stopped is None for inst in self.installations)

    def before_forward(self) -> None:
        """On the host before each forward, on its stream (the adapter's forward hook): hand every backup and
        load-back since the last forward to the managers, in order, consecutive ones of a kind as one batch, then
        make the stream wait for the last layer of a load this forward consumes."""
        if self.pending:
            self.flush()
        counter = getattr(self.controller, "layer_done_counter", None)
        if counter is not None and counter.consumer_index >= 0:
            counter.wait_until(counter.num_layers - 1)

    def flush(self) -> None:
        ops, self.pending = self.pending, []
        running = [inst for inst in self.installations if inst.stopped is None]
        begin = 0
        while begin < len(ops):
            is_load = ops[begin][0]
            end = begin + 1
            while end < len(ops) and ops[end][0] == is_load:
                end += 1
            first = _joined([op[1] for op in ops[begin:end]])
            second = _joined([op[2] for op in ops[begin:end]])
            for inst in running:
                if is_load:
                    inst.manager.load_from_host(first, second)
                else:
                    inst.manager.backup_to_host(first, second)
            begin = end

    # ------------------------------------------------------------------------------------------ stream order
    def wait_for_pending_loads(self) -> None:
        """Before a sweep: wait for every load whose completion sglang has not acknowledged yet."""
        if not torch.cuda.is_available():
            return
        stream = torch.cuda.current_stream()
        for ack in list(getattr(self.controller, "ack_load_queue", ())):
            stream.wait_event(ack.finish_event)

    def fenced_sweep_source(self, source: Callable[[], tuple]) -> FencedSweepSource:
        return FencedSweepSource(self.wait_for_pending_loads, source)


class FencedSweepSource:
    """A sweep source that first waits for every load sglang has not acknowledged (a node's K/V may still be in
    flight). Whatever else is asked of it (the ``walks``, ``compactions`` and ``event_ns`` the sweeper reports on
    the ``kvcanary host time`` line) is the wrapped source's."""

    def __init__(self, fence: Callable[[], None], source: Callable[[], tuple]) -> None:
        self._fence = fence
        self._source = source

    def __call__(self) -> tuple:
        self._fence()
        return self._source()

    def __getattr__(self, name: str):  # (only for names this object lacks)
        return getattr(self._source, name)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p if p.dtype is torch.int64 else p.to(torch.int64) for p in parts])


def follower_of(controller) -> HostTierFollower | None:
    return getattr(controller, FOLLOWER_ATTR, None)


def follow(tree, installations: Sequence[Installation], *, inject_faults: bool = False) -> HostTierFollower | None:
    """Follow the HiCache controller of ``tree`` (the scheduler's prefix cache) for ``installations`` (those over
    its request pool; ``inject_faults``: one of them injects faults, so the follower takes the host-tier classes);
    None when ``tree`` has no HiCache. Raises UnsupportedSetupError naming the flag for a HiCache setup kvcanary does
    not follow. The caller keeps the follower for each runner it follows (``RunnerState.host_tier``)."""
    controller = getattr(tree, "cache_controller", None)
    if controller is None:
        return None
    name = type(tree).__name__
    if name != HIRADIX_CACHE_CLASS:
        raise UnsupportedSetupError(
            f"--enable-hierarchical-cache builds a {name} here, which kvcanary does not follow (it follows "
            f"{HIRADIX_CACHE_CLASS}'s backups and load-backs only): remove --enable-hierarchical-cache"
        )
    if getattr(controller, "enable_storage", False):
        raise UnsupportedSetupError(
            "--hicache-storage-backend fills host KV slots from storage with no kvcanary record: remove "
            "--hicache-storage-backend (HiCache's host tier alone is followed)"
        )
    if getattr(controller, "has_draft", False):
        raise UnsupportedSetupError(
            "HiCache with a speculative draft pool: the draft pool's host copies are not followed; remove "
            "--enable-hierarchical-cache or --speculative-algorithm"
        )
    host_pool = controller.mem_pool_host
    mine = [inst for inst in installations if inst.stopped is None]
    if not mine:
        return None
    for inst in mine:
        if len(inst.groups) != 1:
            raise UnsupportedSetupError(
                f"--enable-hierarchical-cache with a KV pool of {len(inst.groups)} groups (sliding window): "
                "kvcanary follows HiCache on a single full-attention pool only; remove --enable-hierarchical-cache"
            )
        inst.manager.attach_host_tier(int(host_pool.size))
    follower = HostTierFollower(controller, mine)
    if inject_faults:
        follower.faults = LoadFaults(controller)
    setattr(controller, FOLLOWER_ATTR, follower)
    logger.info("kvcanary: HiCache followed: %s, %d host slots (write policy %s, io backend %s, layout %s)",
                name, host_pool.size, getattr(controller, "write_policy", "?"), getattr(controller, "io_backend", "?"),
                getattr(host_pool, "layout", "?"))
    return follower


# ------------------------------------------------------------------------------------------------ fault injection
# (KVCANARY_FAULT, tests only: the host-tier classes of kvcanary.runtime.faults act on a load-back's copies)
def host_and_device_sources(controller) -> list[tuple[RealKvSource, RealKvSource]] | None:
    """(host copy, device buffer) byte views of the K and V of each real-KV layer (``KVCANARY_REAL_KV_LAYERS``) of
    an MHA HiCache; None for a host layout whose per-token bytes are not one contiguous run (``page_head`` splits
    heads) or another pool kind. The host view addresses host slot ``h`` the way the device one addresses slot
    ``d``, so an injector can corrupt the one a load reads and repair the one it wrote."""
    host, device = controller.mem_pool_host, controller.mem_pool_device
    kv = getattr(host, "kv_buffer", None)
    if type(host).__name__ != "MHATokenToKVPoolHost" or kv is None or not hasattr(device, "k_buffer"):
        return None
    layout_name = getattr(host, "layout", None)
    pairs = []
    for layer in resolve_layers(parse_real_kv_layers(), len(device.k_buffer), 2, type(device).__name__):
        for which, dev_buffer in ((0, device.k_buffer[layer]), (1, device.v_buffer[layer])):
            if layout_name == "layer_first":  # [2, layers, size, heads, dim]
                view, page = kv[which, layer], 1
            elif layout_name == "page_first":  # [2, size, layers, heads, dim]
                view, page = kv[which, :, layer], 1
            elif layout_name == "page_first_direct":  # [2, pages, layers, page, heads, dim]
                view, page = kv[which, :, layer], int(host.page_size)
            else:
                return None
            dev = token_major_source(dev_buffer, int(dev_buffer.shape[0]), int(device.page_size))
            per_token = dev.num_bytes_per_token
            pairs.append((RealKvSource(view.flatten(1), page, per_token, per_token), dev))
    return pairs


FAULT_SLOTS = 4  # slots of one load-back a host-tier fault corrupts (at most)


def _xor_first_byte(source: RealKvSource, slot: int) -> None:
    row, col = divmod(slot, source.page_size)
    col *= source.num_bytes_per_token
    source.kv_bytes[row, col] = source.kv_bytes[row, col] ^ 0xFF


@dataclass
class LoadRepair:
    """How to put a corrupted load-back right after the forward that verified it: the host bytes to restore (or
    None) and the (host, device) slots to load again, correctly, on every layer."""

    restore_host: Callable[[], None] | None
    host_indices: torch.Tensor
    device_indices: torch.Tensor


class LoadFaults:
    """The host-tier fault classes in a real engine: armed by the injector before a forward, done inside the next
    ``start_loading`` (the load's K/V copy is what goes wrong; its records go to the right slots), handed to the
    injector on the forward that consumes the load, and repaired after that forward (host bytes restored, the
    slots loaded again), so nothing stays corrupted beyond the slots the injection names."""

    def __init__(self, controller) -> None:
        self.controller = controller
        self.armed: tuple[str, int] | None = None  # (fault class, step it was asked for)
        self.injected: list = []  # Injections done inside start_loading, not yet handed to the injector
        self.repairs: list[LoadRepair] = []

    def injection_for(self, injector: FaultInjectionState, fault: str, step: int, verified: set[int]):
        """The injector's call for a host-tier class before a forward whose verify reads ``verified`` slots: the
        Injection a load-back took since, when this forward verifies one of its slots (its repair is queued after
        the forward on ``injector``); else the class is armed for the next load-back and None returned (it stays
        pending). A load-back this forward does not read (its request was not scheduled after all) is repaired at once
        and forgotten: nothing would ever report it."""
        if self.injected:
            inj = self.injected.pop(0)
            if set(inj.slots) & verified:
                injector.undo_after_forward(self.repair)
                return inj
            logger.warning("kvcanary: fault %s injected into a load-back this forward does not read; repaired, "
                           "armed again", inj.fault)
            self.repair()
        self.armed = (fault, step)
        return None

    def before_start_loading(self) -> None:
        """Inside ``start_loading``, before its copies are enqueued: apply the armed class to the first load op."""
        from kvcanary.runtime import faults

        if self.armed is None or not self.controller.load_queue:
            return
        fault, step = self.armed
        op = next((o for o in self.controller.load_queue if o.device_indices.numel() >= 2), None)
        if op is None:
            return  # (a later load with two slots or more)
        pairs = host_and_device_sources(self.controller)
        # the first FAULT_SLOTS slots of the load: a load-back brings hundreds, and one violation each for all of
        # them would overflow the violation ring and hide the next injection's
        host_idx, dev_idx = op.host_indices[:FAULT_SLOTS].clone(), op.device_indices[:FAULT_SLOTS].clone()
        restore = None
        if fault == faults.LOAD_WRONG_SLOTS:
            inj, head = faults.misdirect_load(dev_idx, step=step)
            op.device_indices = torch.cat([head.to(op.device_indices.dtype), op.device_indices[FAULT_SLOTS:]])
        elif not pairs:
            logger.warning("kvcanary: fault %s needs the host KV as bytes (MHA, layout layer_first, page_first or "
                           "page_first_direct); not injected", fault)
            self.armed = None
            return
        elif fault == faults.HOST_TIER_FLIP:
            host_source, h, d = pairs[0][0], int(host_idx[0]), int(dev_idx[0])
            inj = faults.flip_host_copy(host_source, h, d, step=step)

            def restore(src=host_source, h=h):
                _xor_first_byte(src, h)
        elif fault == faults.LOAD_BEFORE_BACKUP:
            inj, restore = faults.stale_host_read([h for h, _ in pairs], host_idx.tolist(), dev_idx.tolist(),
                                                  step=step)
        else:
            return
        self.armed = None
        self.injected.append(inj)
        self.repairs.append(LoadRepair(restore, host_idx, dev_idx))

    def repair(self) -> None:
        """After the forward that verified a corrupted load: wait for the device (the load and the verify have run),
        restore the host bytes, and load the slots again with their true K/V on every layer."""
        c = self.controller
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for r in self.repairs:
            if r.restore_host is not None:
                r.restore_host()
            host_idx, dev_idx = c.move_indices(r.host_indices, r.device_indices)
            for layer in range(c.layer_num):
                c.mem_pool_host.load_to_device_per_layer(c.mem_pool_device, host_idx, dev_idx, layer, c.io_backend)
        self.repairs.clear()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
