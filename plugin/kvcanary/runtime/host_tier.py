"""Records of a host KV tier: the canary follows KV that an engine moves off the device and back.

An engine with a host-memory KV tier (sglang's HiCache) copies a slot's K/V to a host slot (backup) and later
copies it back into a *new* device slot (load-back), outside any forward. The canary's records must follow, or
the loaded-back slot keeps the record of its previous occupant and every verify of it fails (position, chain,
real-KV) although the KV is right.

:class:`HostTierRecords` keeps one record row and one attribution row per host slot, on the canary's device
(host slots × 48 bytes: 9.4 MB for 196,608 host slots): a backup copies the device slots' rows there, a load-back
copies them into the new device slots. Both take a batch of copies in one call (an adapter may gather the copies
made between two forwards), are a handful of gathers and scatters on the device, enqueued on the caller's current
stream (ordered with the forwards' record writes on that stream), and never wait for the device.

What that buys:

* the real-KV fingerprint travels with the record: it was taken when the forward first wrote the KV, so a byte
  that changed in host memory, a load-back that put K/V into other device slots than the ones it recorded, or a
  load that read a host copy before its backup had landed, all fail ``verify_real_kv_hash`` on the next verify
  of the loaded slots;
* token, position and chain are checked like any other prefix (the records are the ones first written);
* a loaded-back slot's writer serial carries :data:`kvcanary.runtime.writers.LOADED_FROM_HOST_TIER`, so a violation on
  it says ``via=host_tier`` (the slot's content came through the host tier) beside the request that first wrote it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvcanary.kernels import layout
from kvcanary.runtime.writers import LOADED_FROM_HOST_TIER

logger = logging.getLogger(__name__)

__all__ = ["HostTierRecords"]


def _host_index(slots: torch.Tensor | Sequence[int], limit: int, device: torch.device,
                scratch: int | None = None) -> torch.Tensor:
    """Host slot indices (the engine keeps them on the host) as an int64 index tensor on ``device``, every entry
    checked to lie in ``[0, limit)`` first (one ``aminmax``; a ValueError naming the first bad one). ``scratch``:
    they are destinations, and a repeated one keeps only its last entry (the others go to row ``scratch``)."""
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(slots, dtype=torch.int64)
    _check_1d(slots, "host_slots")
    if slots.numel():
        if slots.device.type != "cpu":
            raise ValueError(f"HostTierRecords: host_slots: expected a host (CPU) tensor, got {slots.device}")
        low, high = torch.aminmax(slots)
        if int(low) < 0 or int(high) >= limit:
            bad = next(int(x) for x in slots.tolist() if not 0 <= x < limit)
            raise ValueError(f"HostTierRecords: host_slots: index {bad} outside [0, {limit})")
    slots = slots.to(torch.int64)
    if scratch is not None and slots.numel() > 1 and torch.unique(slots).numel() != slots.numel():
        slots = _last_wins(slots, scratch)
    if device.type == "cpu":
        return slots
    # through pinned memory: a copy from pageable memory makes the host wait for the stream (under sglang's overlap
    # scheduler, for the forward in flight: 340 us per forward on the H200); the caching host allocator keeps the
    # pinned block until the copy has run
    return slots.pin_memory().to(device, non_blocking=True)


def _device_index(slots: torch.Tensor | Sequence[int], limit: int, device: torch.device) -> torch.Tensor:
    """Device slot indices as an int64 index tensor on ``device``. Checked on the host when they are there; indices
    the engine already holds on the GPU are taken as they are: reading them would cost a sync, and the engine's
    own K/V copy with the same indices touches the same rows (an index it cannot use fails there first)."""
    if not isinstance(slots, torch.Tensor):
        slots = torch.tensor(slots, dtype=torch.int64)
    _check_1d(slots, "device_slots")
    if slots.device.type == "cpu" and slots.numel():
        low, high = torch.aminmax(slots)
        if int(low) < 0 or int(high) >= limit:
            bad = next(int(x) for x in slots.tolist() if not 0 <= x < limit)
            raise ValueError(f"HostTierRecords: device_slots: index {bad} outside [0, {limit})")
    if slots.dtype is not torch.int64:
        slots = slots.to(torch.int64)
    return slots.to(device, non_blocking=True) if slots.device != device else slots


def _check_1d(slots: torch.Tensor, what: str) -> None:
    if slots.dim() != 1:
        raise ValueError(f"HostTierRecords: {what}: expected a 1-D index tensor, got shape {list(slots.shape)}")
    if slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"HostTierRecords: {what}: expected int32 or int64, got {slots.dtype}")


def _last_wins(dest: torch.Tensor, scratch: int) -> torch.Tensor:
    """``dest`` (host indices, on the host) with every entry but the last of each repeated index replaced by
    ``scratch`` (a row nobody reads): of two copies to one destination in a batch the later one stands
    (``index_copy_`` with repeated indices leaves the winner undefined on a GPU). Host ops only."""
    order = torch.arange(dest.shape[0], dtype=torch.int64)
    last = torch.full((scratch + 1,), -1, dtype=torch.int64)
    last.scatter_reduce_(0, dest, order, reduce="amax")
    return torch.where(last.index_select(0, dest) == order, dest, scratch)


class HostTierRecords:
    """Record and attribution rows of ``num_host_slots`` host slots, beside one canary buffer.

    Driven through :meth:`CanaryManager.backup_to_host <kvcanary.runtime.manager.CanaryManager.backup_to_host>` /
    ``load_from_host``, which launch a pending deferred write first (issue 25): a backup must copy the records the
    last forward wrote, and that write must not land on slots a load-back has just filled.

    Args:
        canary_buf: the device pool's canary buffer (``[num_slots, RECORD_BYTES]`` uint8).
        slot_attribution: its writer-attribution table (``[num_slots, SLOT_ATTRIBUTION_FIELDS]`` int64).
        num_host_slots: slots of the host tier (host indices are ``0 .. num_host_slots - 1``).
    """

    def __init__(self, canary_buf: torch.Tensor, slot_attribution: torch.Tensor, num_host_slots: int) -> None:
        if isinstance(num_host_slots, bool) or not isinstance(num_host_slots, int) or num_host_slots < 1:
            raise ValueError(f"HostTierRecords: num_host_slots: expected an int >= 1, got {num_host_slots!r}")
        self.device = canary_buf.device
        self._device_records = canary_buf
        self._device_attribution = slot_attribution
        self.num_host_slots = num_host_slots
        # zero records (never written: a load of a host slot nobody backed up verifies as a slot nobody wrote)
        # (one row more than the tier has: the scratch row a repeated destination's earlier copies go to)
        self.records = torch.zeros((num_host_slots + 1, canary_buf.shape[1]), dtype=torch.uint8, device=self.device)
        self.attribution = torch.full((num_host_slots + 1, slot_attribution.shape[1]), layout.META_UNKNOWN,
                                      dtype=torch.int64, device=self.device)
        # host-side counts (slots handed off), for the stats line and the end-to-end driver
        self.slots_backed_up = 0
        self.slots_loaded = 0

    def backup(self, device_slots: torch.Tensor | Sequence[int], host_slots: torch.Tensor | Sequence[int]) -> None:
        """The engine copies device slot ``device_slots[i]`` to host slot ``host_slots[i]``: copy its rows (a batch
        of copies in their order: a host slot named twice, freed and backed up again in between, ends with the later
        one's rows; the earlier go to a scratch row)."""
        dev = _device_index(device_slots, self._device_records.shape[0], self.device)
        host = _host_index(host_slots, self.num_host_slots, self.device, scratch=self.num_host_slots)
        self._check_pair(dev, host)
        self.records.index_copy_(0, host, self._device_records.index_select(0, dev))
        self.attribution.index_copy_(0, host, self._device_attribution.index_select(0, dev))
        self.slots_backed_up += int(host.shape[0])

    def load(self, host_slots: torch.Tensor | Sequence[int], device_slots: torch.Tensor | Sequence[int]) -> None:
        """The engine copies host slot ``host_slots[i]`` into device slot ``device_slots[i]``: copy its rows, marking
        the device slots as loaded from the host tier (their writer serial carries ``LOADED_FROM_HOST_TIER``). A
        batch must name each device slot once: the engine hands a device slot to a load only when it is free, and
        the slots a load takes stay taken until it has landed (reading device indices to check would be a sync)."""
        host = _host_index(host_slots, self.num_host_slots, self.device)
        dev = _device_index(device_slots, self._device_records.shape[0], self.device)
        self._check_pair(dev, host)
        self._device_records.index_copy_(0, dev, self.records.index_select(0, host))
        attribution = self.attribution.index_select(0, host)
        serial = attribution[:, layout.SLOT_ATTRIBUTION_COL_WRITER_SERIAL]
        # (META_UNKNOWN, -1, stays unknown: its bit 62 is already set, and writer_id reads it as no request)
        serial.bitwise_or_(LOADED_FROM_HOST_TIER)
        self._device_attribution.index_copy_(0, dev, attribution)
        self.slots_loaded += int(dev.shape[0])

    @staticmethod
    def _check_pair(dev: torch.Tensor, host: torch.Tensor) -> None:
        if dev.shape[0] != host.shape[0]:
            raise ValueError(f"HostTierRecords: {dev.shape[0]} device slots but {host.shape[0]} host slots")
