"""Python mirror of ``include/kvcanary/layout.h`` (SPEC §1, §3).

Every value here must equal the C++ constant of the same name; ``tests/kernels/test_layout.py``
compares this module with ``canary_layout_constants()`` exported by the compiled kernels.
"""

from __future__ import annotations

import enum
import functools

# canary record (one per KV slot)
RECORD_FIELD_TOKEN = 0
RECORD_FIELD_POSITION = 1
RECORD_FIELD_PREV_HASH = 2
RECORD_FIELD_REAL_KV_HASH = 3
RECORD_FIELDS = 4
RECORD_FIELD_BYTES = 8
RECORD_BYTES = RECORD_FIELDS * RECORD_FIELD_BYTES
MIN_SLOT_STRIDE_BYTES = RECORD_BYTES

# chain hash (unsigned values; the export carries them as signed int64)
CHAIN_ANCHOR = 0xC0FFEE1234567890
SPLITMIX_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX_MUL2 = 0x94D049BB133111EB
SPLITMIX_SHIFT1 = 30
SPLITMIX_SHIFT2 = 27
SPLITMIX_SHIFT3 = 31

# sentinels
PADDING_SLOT = 0
PADDING_REQ_POOL_ROW = 0
CHAIN_HEAD_SLOT = -1
UNKNOWN_PREV_SLOT = 0
SKIP_WRITE_SLOT = -1
NO_EXPECTED_TOKEN = -1
NO_EXPECTED_POSITION = -1

# A plan entry standing for an index the plan could not follow: flag | (value & mask); verify reports it
# as SLOT_OUT_OF_RANGE. ``decode_plan_index_error`` recovers the offending value.
PLAN_INDEX_ERROR_FLAG = 1 << 62
PLAN_INDEX_VALUE_MASK = PLAN_INDEX_ERROR_FLAG - 1

# real-KV sources
MAX_REAL_KV_SOURCES = 4
REAL_KV_PARAM_FIELDS = 3
REAL_KV_PARAM_PAGE_SIZE = 0
REAL_KV_PARAM_BYTES_PER_TOKEN = 1
REAL_KV_PARAM_READ_BYTES = 2
REAL_KV_ALIGN_BYTES = 16
REAL_KV_PARTIAL_BYTES = 16


class RealKvHashMode(enum.IntEnum):
    """How much of each real-KV source a fingerprint reads."""

    NONE = 0
    PARTIAL = 1
    ALL = 2


REAL_KV_HASH_MODE_NONE = int(RealKvHashMode.NONE)
REAL_KV_HASH_MODE_PARTIAL = int(RealKvHashMode.PARTIAL)
REAL_KV_HASH_MODE_ALL = int(RealKvHashMode.ALL)

# violation rows
VIOLATION_COL_KERNEL_KIND = 0
VIOLATION_COL_SLOT = 1
VIOLATION_COL_POSITION = 2
VIOLATION_COL_STORED_TOKEN = 3
VIOLATION_COL_EXPECTED_TOKEN = 4
VIOLATION_COL_STORED_CHAIN_HASH = 5
VIOLATION_COL_EXPECTED_AUX = 6
VIOLATION_COL_FAIL_REASON_BITS = 7
VIOLATION_FIELDS = 8

# violation metadata (kvcanary+): an int64 [ring_capacity, VIOLATION_META_FIELDS] table beside the ring,
# row i describing ring row i (the ring's 8 columns stay the seed's)
VIOLATION_META_COL_STEP = 0  # forward counter value read by the launch that found it
VIOLATION_META_COL_REQUEST_ROW = 1  # req_to_token row of the entry's request
VIOLATION_META_COL_WRITTEN_STEP = 2  # forward that last wrote the slot (slot attribution)
VIOLATION_META_COL_WRITER_SERIAL = 3  # request serial of that writer (slot attribution)
VIOLATION_META_FIELDS = 4

# writer attribution (kvcanary+): an int64 [num_slots, SLOT_ATTRIBUTION_FIELDS] table beside the canary buffer
SLOT_ATTRIBUTION_COL_WRITTEN_STEP = 0
SLOT_ATTRIBUTION_COL_WRITER_SERIAL = 1
SLOT_ATTRIBUTION_FIELDS = 2
META_UNKNOWN = -1  # a metadata or attribution value nobody knows

# launch tags (violation column 0; index of the per-tag counters; kvcanary.kernels.tags names them)
LAUNCH_TAG_VERIFY = 0
LAUNCH_TAG_WRITE = 1
LAUNCH_TAG_SWEEP = 2
NUM_LAUNCH_TAGS = 3

# The manager's flat int64 state buffer: a header of STATE_HEADER_FIELDS elements, then the violation ring
# [ring_capacity, VIOLATION_FIELDS]. Offsets in int64 elements; canary_check_step takes the whole buffer.
STATE_WRITE_INDEX = 0  # the ring's int32 write index, in the low half
# rows dropped by ring resets after an overflow (cumulative; the host counts them lost: canary_check.cuh)
STATE_RING_LOST_AT_RESET = 1
STATE_KERNEL_RUNS = 2  # [NUM_LAUNCH_TAGS] launches per tag
STATE_SLOT_RUNS = STATE_KERNEL_RUNS + NUM_LAUNCH_TAGS  # [NUM_LAUNCH_TAGS] entries per tag
STATE_RING_EPOCH = STATE_SLOT_RUNS + NUM_LAUNCH_TAGS  # times the drained ring was emptied
STATE_FORWARD = STATE_RING_EPOCH + 1  # the device forward counter
# the host's acknowledgement: (ring epoch << DRAINED_TO_EPOCH_SHIFT) | the index it has read every row below (<= 0:
# none); one of an older epoch is ignored
STATE_DRAINED_TO = STATE_FORWARD + 1
STATE_DONE_BLOCKS = STATE_DRAINED_TO + 1  # scratch of canary_check_step: blocks finished (int32, low half)
# scratch of canary_check_step's start (int32, low half; 0 at rest): arrival tickets, and the gate the reusing block
# opens once the drained-ring reuse is done (no block appends before it)
STATE_ARRIVALS = STATE_DONE_BLOCKS + 1
STATE_REUSE_GATE = STATE_ARRIVALS + 1
# the acknowledged index the last drained-ring reuse applied (where the emptied epoch ended for the host)
STATE_RING_REUSED_AT = STATE_REUSE_GATE + 1
# the token mail's read cursor: mailbox records below it are applied (in the header: the status mirror carries it)
STATE_TOKEN_MAIL_READ = STATE_RING_REUSED_AT + 1
STATE_HEADER_FIELDS = 16
DRAINED_TO_EPOCH_SHIFT = 32

# token-table staging (canary_token_update): int64, a field-major header (field f of update u at f * num_updates + u)
# of TOKEN_UPDATE_FIELDS runs, then the updates' tokens packed; the offset is an absolute staging index
TOKEN_UPDATE_FIELD_ROW = 0  # expected_tokens row
TOKEN_UPDATE_FIELD_START = 1  # first position written
TOKEN_UPDATE_FIELD_COUNT = 2  # tokens written, already clipped at the table width
TOKEN_UPDATE_FIELD_VALID_LEN = 3  # the row's new valid length
TOKEN_UPDATE_FIELD_OFFSET = 4  # staging index of the update's first token
TOKEN_UPDATE_FIELDS = 5
# canary_token_append (one token appended to each row: a decode forward's upload): int64, TOKEN_APPEND_FIELDS runs of
# num_updates values, field-major; the row's new valid length is start + 1
TOKEN_APPEND_FIELD_ROW = 0  # expected_tokens row
TOKEN_APPEND_FIELD_START = 1  # the position written (the row's valid length so far)
TOKEN_APPEND_FIELD_TOKEN = 2  # the token
TOKEN_APPEND_FIELDS = 3
# the token check's mailbox (runtime/token_table.py TokenMail): int64 [TOKEN_MAIL_FIELDS, capacity] host memory (a
# column per field), a ring of a decode batch's appends the next check launch applies before it verifies; a record
# applies from its forward on
TOKEN_MAIL_FIELD_ROW = 0  # expected_tokens row
TOKEN_MAIL_FIELD_START = 1  # the position written
TOKEN_MAIL_FIELD_TOKEN = 2  # the token
TOKEN_MAIL_FIELD_STEP = 3  # the forward the record is for
TOKEN_MAIL_FIELDS = 4

# canary_sweep_plan_update (a sweep-plan commit: runtime/sweep_index.py): int64, a header of
# SWEEP_PLAN_META_HEADER_FIELDS values, then the spans (SWEEP_PLAN_SPAN_FIELDS values each, record-major), then the
# tombstone ranges (SWEEP_PLAN_TOMBSTONE_FIELDS each); at most SWEEP_PLAN_MAX_SPANS spans and SWEEP_PLAN_MAX_TOMBSTONES
# ranges a launch
SWEEP_PLAN_META_NUM_SPANS = 0
SWEEP_PLAN_META_NUM_TOMBSTONES = 1
SWEEP_PLAN_META_SLOTS_BASE = 2  # the plan index of new_slots[0]
SWEEP_PLAN_META_NUM_VALID = 3  # written to verify_num_valid
SWEEP_PLAN_META_HEADER_FIELDS = 4
SWEEP_PLAN_SPAN_FIELD_START = 0
SWEEP_PLAN_SPAN_FIELD_LENGTH = 1
SWEEP_PLAN_SPAN_FIELD_FIRST_POSITION = 2
SWEEP_PLAN_SPAN_FIELD_BEFORE = 3  # plan index of the first entry's predecessor, -1 for a chain head
SWEEP_PLAN_SPAN_FIELDS = 4
SWEEP_PLAN_TOMBSTONE_FIELD_START = 0
SWEEP_PLAN_TOMBSTONE_FIELD_LENGTH = 1
SWEEP_PLAN_TOMBSTONE_FIELDS = 2
SWEEP_PLAN_MAX_SPANS = 128
SWEEP_PLAN_MAX_TOMBSTONES = 128
SWEEP_PLAN_META_VALUES = (SWEEP_PLAN_META_HEADER_FIELDS + SWEEP_PLAN_MAX_SPANS * SWEEP_PLAN_SPAN_FIELDS
                          + SWEEP_PLAN_MAX_TOMBSTONES * SWEEP_PLAN_TOMBSTONE_FIELDS)


class FailReason(enum.IntFlag):
    """Bits of a violation row's fail_reason_bits column."""

    VERIFY_CHAIN_HASH = 1 << 0
    VERIFY_POSITION = 1 << 1
    VERIFY_REAL_KV_HASH = 1 << 2
    WRITE_TOKEN = 1 << 3
    WRITE_POSITION = 1 << 4
    VERIFY_TOKEN = 1 << 5
    SLOT_OUT_OF_RANGE = 1 << 6


REASON_VERIFY_CHAIN_HASH = int(FailReason.VERIFY_CHAIN_HASH)
REASON_VERIFY_POSITION = int(FailReason.VERIFY_POSITION)
REASON_VERIFY_REAL_KV_HASH = int(FailReason.VERIFY_REAL_KV_HASH)
REASON_WRITE_TOKEN = int(FailReason.WRITE_TOKEN)
REASON_WRITE_POSITION = int(FailReason.WRITE_POSITION)
REASON_VERIFY_TOKEN = int(FailReason.VERIFY_TOKEN)
REASON_SLOT_OUT_OF_RANGE = int(FailReason.SLOT_OUT_OF_RANGE)


_REASON_NAME_BY_BIT = {int(member): member.name.lower() for member in FailReason if member.name}


def reason_names(bits: int) -> list[str]:
    """Decode fail_reason_bits into lower-case names, lowest bit first (unknown bits as ``bit<N>``)."""
    return list(_reason_names(bits))


@functools.lru_cache(maxsize=256)
def _reason_names(bits: int) -> tuple[str, ...]:  # a violation burst repeats a handful of masks
    return tuple(_REASON_NAME_BY_BIT.get(1 << bit, f"bit{bit}") for bit in range(64) if (bits >> bit) & 1)


def encode_plan_index_error(value: int) -> int:
    return PLAN_INDEX_ERROR_FLAG | (value & PLAN_INDEX_VALUE_MASK)


def decode_plan_index_error(slot: int) -> int | None:
    """The offending value of a plan index-error entry, or None if `slot` is not one."""
    if slot < 0 or not slot & PLAN_INDEX_ERROR_FLAG:
        return None
    value = slot & PLAN_INDEX_VALUE_MASK
    return value - PLAN_INDEX_ERROR_FLAG if value >= PLAN_INDEX_ERROR_FLAG >> 1 else value


def _to_signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def exported_names() -> dict[str, int]:
    """Every constant the C++ layout table exports, as signed int64 like the export."""
    names = [n for n in globals() if n.isupper() and isinstance(globals()[n], int)]
    return {n: _to_signed64(int(globals()[n])) for n in names}
