/*!
 * \file kvcanary/layout.h
 * \brief The one source of every number in the canary's data layout (SPEC §1, §3).
 *
 * Records, violation rows, reason bits, real-KV parameter tables and sentinels. The Python mirror is
 * `kvcanary.layout`; the exported `canary_layout_constants()` returns these values and a test keeps
 * the two equal. Add a constant here, then to `kLayoutConstantTable` below, then to layout.py.
 */
#ifndef KVCANARY_LAYOUT_H_
#define KVCANARY_LAYOUT_H_

#include <cstdint>

namespace kvcanary {

// ---------------------------------------------------------------- canary record (one per KV slot)
constexpr int32_t kRecordFieldToken = 0;
constexpr int32_t kRecordFieldPosition = 1;
constexpr int32_t kRecordFieldPrevHash = 2;
constexpr int32_t kRecordFieldRealKvHash = 3;
constexpr int32_t kRecordFields = 4;
constexpr int32_t kRecordFieldBytes = 8;
constexpr int32_t kRecordBytes = kRecordFields * kRecordFieldBytes;  // 32
constexpr int32_t kMinSlotStrideBytes = kRecordBytes;

// ---------------------------------------------------------------- chain hash
constexpr uint64_t kChainAnchor = 0xC0FFEE1234567890ULL;
constexpr uint64_t kSplitmixMul1 = 0xBF58476D1CE4E5B9ULL;
constexpr uint64_t kSplitmixMul2 = 0x94D049BB133111EBULL;
constexpr int32_t kSplitmixShift1 = 30;
constexpr int32_t kSplitmixShift2 = 27;
constexpr int32_t kSplitmixShift3 = 31;

// ---------------------------------------------------------------- sentinels
constexpr int64_t kPaddingSlot = 0;        // pool slot that padded tokens write; also "no slot"
constexpr int64_t kPaddingReqPoolRow = 0;  // req_to_token row of CUDA-graph padding rows
constexpr int64_t kChainHeadSlot = -1;     // seed / predecessor meaning "start of the chain"
constexpr int64_t kUnknownPrevSlot = 0;    // predecessor meaning "not known: skip the chain check"
constexpr int64_t kSkipWriteSlot = -1;     // out_cache_loc entries < 0 are skipped by write
constexpr int64_t kNoExpectedToken = -1;   // verify: no token expectation for this entry
constexpr int64_t kNoExpectedPosition = -1;  // verify: entry planned for an index error, no position

// A plan entry standing for an index the plan could not follow (a req_pool_index outside
// req_to_token, a prefix beyond max_context_len, a negative extend, a slot outside the SWA LUT):
// slot = kPlanIndexErrorFlag | (offending value & kPlanIndexValueMask). It lies outside every canary
// buffer, so verify reports it with kReasonSlotOutOfRange and never dereferences it.
constexpr int64_t kPlanIndexErrorFlag = int64_t{1} << 62;
constexpr int64_t kPlanIndexValueMask = kPlanIndexErrorFlag - 1;

// ---------------------------------------------------------------- real-KV sources
constexpr int32_t kMaxRealKvSources = 4;
constexpr int32_t kRealKvParamFields = 3;
constexpr int32_t kRealKvParamPageSize = 0;
constexpr int32_t kRealKvParamBytesPerToken = 1;
constexpr int32_t kRealKvParamReadBytes = 2;
constexpr int32_t kRealKvAlignBytes = 16;    // fold step, vector load width, alignment of all offsets
constexpr int32_t kRealKvPartialBytes = 16;  // bytes per source read in PARTIAL mode

enum class RealKvHashMode : int32_t { kNone = 0, kPartial = 1, kAll = 2 };
constexpr int32_t kRealKvHashModeCount = 3;

// ---------------------------------------------------------------- violation rows
constexpr int32_t kViolationColKernelKind = 0;
constexpr int32_t kViolationColSlot = 1;
constexpr int32_t kViolationColPosition = 2;
constexpr int32_t kViolationColStoredToken = 3;
constexpr int32_t kViolationColExpectedToken = 4;
constexpr int32_t kViolationColStoredChainHash = 5;
constexpr int32_t kViolationColExpectedAux = 6;
constexpr int32_t kViolationColFailReasonBits = 7;
constexpr int32_t kViolationFields = 8;

// ---------------------------------------------------------------- violation metadata (kvcanary+)
// An int64 [ring_capacity, kViolationMetaFields] table beside the ring: row i describes ring row i (the
// ring's 8 columns stay the seed's). Filled by the launch that appends the ring row, when it is given one.
constexpr int32_t kViolationMetaColStep = 0;          // forward counter value read by the launch
constexpr int32_t kViolationMetaColRequestRow = 1;    // req_to_token row of the entry's request
constexpr int32_t kViolationMetaColWrittenStep = 2;   // slot attribution: forward that last wrote the slot
constexpr int32_t kViolationMetaColWriterSerial = 3;  // slot attribution: request serial of that writer
constexpr int32_t kViolationMetaFields = 4;

// Writer attribution (kvcanary+): an int64 [num_slots, kSlotAttributionFields] table beside the canary
// buffer (the 32-byte record stays the seed's). Write stores (forward counter, writer serial) for every
// record it stores; verify reads it for failing entries only.
constexpr int32_t kSlotAttributionColWrittenStep = 0;
constexpr int32_t kSlotAttributionColWriterSerial = 1;
constexpr int32_t kSlotAttributionFields = 2;
constexpr int64_t kMetaUnknown = -1;  // a metadata or attribution value nobody knows

// ---------------------------------------------------------------- launch tags and the state buffer (kvcanary+)
// Launch tags (violation column 0; index of the per-tag counters). The Python names live in kvcanary.tags.
constexpr int32_t kLaunchTagVerify = 0;
constexpr int32_t kLaunchTagWrite = 1;
constexpr int32_t kLaunchTagSweep = 2;
constexpr int32_t kNumLaunchTags = 3;

// The manager's flat int64 state buffer: a header of kStateHeaderFields elements, then the violation ring
// ([ring_capacity, kViolationFields]), so that one copy drains the header and the first rows. Offsets are in
// int64 elements. canary_check_step takes the whole buffer as one tensor.
constexpr int32_t kStateWriteIndex = 0;  // the ring's int32 write index, in the low half (little-endian)
// Rows dropped by ring resets after an overflow (cumulative): rows appended past an acknowledgement made when every
// stored row had been read were never stored (canary_check.cuh, the drained-ring reuse); the host counts them lost.
constexpr int32_t kStateRingLostAtReset = 1;
constexpr int32_t kStateKernelRuns = 2;  // [kNumLaunchTags] launches per tag
constexpr int32_t kStateSlotRuns = kStateKernelRuns + kNumLaunchTags;  // [kNumLaunchTags] entries per tag
constexpr int32_t kStateRingEpoch = kStateSlotRuns + kNumLaunchTags;   // times the drained ring was emptied
constexpr int32_t kStateForward = kStateRingEpoch + 1;    // the device forward counter
// The host's acknowledgement: (ring epoch << kDrainedToEpochShift) | the ring index it has read every row below
// (<= 0: none). An acknowledgement of an older epoch is ignored (the ring was emptied since).
constexpr int32_t kStateDrainedTo = kStateForward + 1;
constexpr int32_t kStateDoneBlocks = kStateDrainedTo + 1;  // scratch: blocks finished (int32, low half; 0 at rest)
// Scratch of canary_check_step's start (int32, low half; 0 at rest): blocks arrived (arrival tickets), and the gate
// the reusing block opens (1) once the drained-ring reuse is done, before any block of the launch appends.
constexpr int32_t kStateArrivals = kStateDoneBlocks + 1;
constexpr int32_t kStateReuseGate = kStateArrivals + 1;
// The acknowledged index the last drained-ring reuse applied: where the emptied epoch ended for the host (which may
// have acknowledged a later index since, in that epoch, too late for the reuse).
constexpr int32_t kStateRingReusedAt = kStateReuseGate + 1;
// The token mail's read cursor: records [0, this) of the token check's mailbox are applied (canary_check.cuh). In the
// header, so the status mirror tells the host which mailbox records it may write again.
constexpr int32_t kStateTokenMailRead = kStateRingReusedAt + 1;
constexpr int32_t kStateHeaderFields = 16;
static_assert(kStateTokenMailRead < kStateHeaderFields, "state header too small");
constexpr int32_t kDrainedToEpochShift = 32;

// Fail-reason bits (column 7). Bit 6 is kvcanary's own: an index the engine handed the canary lies
// outside the buffer it indexes; the row's expected_aux column carries the offending index.
constexpr int64_t kReasonVerifyChainHash = int64_t{1} << 0;
constexpr int64_t kReasonVerifyPosition = int64_t{1} << 1;
constexpr int64_t kReasonVerifyRealKvHash = int64_t{1} << 2;
constexpr int64_t kReasonWriteToken = int64_t{1} << 3;
constexpr int64_t kReasonWritePosition = int64_t{1} << 4;
constexpr int64_t kReasonVerifyToken = int64_t{1} << 5;
constexpr int64_t kReasonSlotOutOfRange = int64_t{1} << 6;

// ---------------------------------------------------------------- token-table staging (kvcanary+)
// canary_token_update reads one int64 staging buffer per batch of expected-token updates (pinned host memory on
// CUDA, read by the kernel in place): a header of kTokenUpdateFields runs of num_updates values, field-major (field
// f of update u at f * num_updates + u, so the host writes each field as one run), then the updates' tokens packed
// one after the other. The offset is absolute: a staging index >= kTokenUpdateFields * num_updates.
constexpr int32_t kTokenUpdateFieldRow = 0;       // expected_tokens row
constexpr int32_t kTokenUpdateFieldStart = 1;     // first position written
constexpr int32_t kTokenUpdateFieldCount = 2;     // tokens written, already clipped at the table width
constexpr int32_t kTokenUpdateFieldValidLen = 3;  // the row's new valid length
constexpr int32_t kTokenUpdateFieldOffset = 4;    // staging index of the update's first token
constexpr int32_t kTokenUpdateFields = 5;
// canary_token_append (one token appended to each row: a decode forward's upload) reads kTokenAppendFields runs of
// num_updates values, field-major like the header above: the row, the position written (its valid length so far),
// the token. The row's new valid length is start + 1.
constexpr int32_t kTokenAppendFieldRow = 0;    // expected_tokens row
constexpr int32_t kTokenAppendFieldStart = 1;  // the position written
constexpr int32_t kTokenAppendFieldToken = 2;  // the token
constexpr int32_t kTokenAppendFields = 3;

// The token check's mailbox (issue 25): a decode batch's appends as records the next check launch applies before it
// verifies, instead of a launch of their own. int64 [kTokenMailFields, capacity] host memory (pinned on CUDA), a column
// per field: a ring the host fills in order, then publishes the count of records written (the mailbox's int64 [1]
// cursor). A record is applied by the first check launch whose forward step is at least the record's.
constexpr int32_t kTokenMailFieldRow = 0;    // expected_tokens row
constexpr int32_t kTokenMailFieldStart = 1;  // the position written
constexpr int32_t kTokenMailFieldToken = 2;  // the token
constexpr int32_t kTokenMailFieldStep = 3;   // the forward the record is for
constexpr int32_t kTokenMailFields = 4;

// ---------------------------------------------------------------- sweep-plan commit metadata (kvcanary+)
// canary_sweep_plan_update reads one int64 metadata block per launch (pinned host memory on CUDA, read by the kernel
// in place): a header of kSweepPlanMetaHeaderFields values, then num_spans spans of kSweepPlanSpanFields values each
// (record-major: span k's field f at header + k * kSweepPlanSpanFields + f), then num_tombstones ranges of
// kSweepPlanTombstoneFields values right after the spans. A launch holds at most kSweepPlanMaxSpans spans and
// kSweepPlanMaxTombstones ranges (every block copies them into shared memory and each entry scans the ranges), so a
// block is at most kSweepPlanMetaValues values; a larger commit is split into several launches (runtime/sweep_index).
constexpr int32_t kSweepPlanMetaNumSpans = 0;       // spans in this launch
constexpr int32_t kSweepPlanMetaNumTombstones = 1;  // tombstone ranges in this launch
constexpr int32_t kSweepPlanMetaSlotsBase = 2;      // the plan index of new_slots[0]
constexpr int32_t kSweepPlanMetaNumValid = 3;       // the entry count written to verify_num_valid
constexpr int32_t kSweepPlanMetaHeaderFields = 4;
constexpr int32_t kSweepPlanSpanFieldStart = 0;          // plan index of the span's first entry
constexpr int32_t kSweepPlanSpanFieldLength = 1;         // entries (>= 1)
constexpr int32_t kSweepPlanSpanFieldFirstPosition = 2;  // expected position of the first entry
constexpr int32_t kSweepPlanSpanFieldBefore = 3;  // plan index of the first entry's predecessor; -1: a chain head
constexpr int32_t kSweepPlanSpanFields = 4;
constexpr int32_t kSweepPlanTombstoneFieldStart = 0;
constexpr int32_t kSweepPlanTombstoneFieldLength = 1;
constexpr int32_t kSweepPlanTombstoneFields = 2;
constexpr int32_t kSweepPlanMaxSpans = 128;
constexpr int32_t kSweepPlanMaxTombstones = 128;
constexpr int32_t kSweepPlanMetaValues = kSweepPlanMetaHeaderFields + kSweepPlanMaxSpans * kSweepPlanSpanFields +
                                         kSweepPlanMaxTombstones * kSweepPlanTombstoneFields;

/*! \brief (name, value) pairs exported to Python by canary_layout_constants(). */
struct LayoutConstant {
  const char* name;
  int64_t value;
};

constexpr LayoutConstant kLayoutConstantTable[] = {
    {"RECORD_FIELD_TOKEN", kRecordFieldToken},
    {"RECORD_FIELD_POSITION", kRecordFieldPosition},
    {"RECORD_FIELD_PREV_HASH", kRecordFieldPrevHash},
    {"RECORD_FIELD_REAL_KV_HASH", kRecordFieldRealKvHash},
    {"RECORD_FIELDS", kRecordFields},
    {"RECORD_FIELD_BYTES", kRecordFieldBytes},
    {"RECORD_BYTES", kRecordBytes},
    {"MIN_SLOT_STRIDE_BYTES", kMinSlotStrideBytes},
    {"CHAIN_ANCHOR", static_cast<int64_t>(kChainAnchor)},
    {"SPLITMIX_MUL1", static_cast<int64_t>(kSplitmixMul1)},
    {"SPLITMIX_MUL2", static_cast<int64_t>(kSplitmixMul2)},
    {"SPLITMIX_SHIFT1", kSplitmixShift1},
    {"SPLITMIX_SHIFT2", kSplitmixShift2},
    {"SPLITMIX_SHIFT3", kSplitmixShift3},
    {"PADDING_SLOT", kPaddingSlot},
    {"PADDING_REQ_POOL_ROW", kPaddingReqPoolRow},
    {"CHAIN_HEAD_SLOT", kChainHeadSlot},
    {"UNKNOWN_PREV_SLOT", kUnknownPrevSlot},
    {"SKIP_WRITE_SLOT", kSkipWriteSlot},
    {"NO_EXPECTED_TOKEN", kNoExpectedToken},
    {"NO_EXPECTED_POSITION", kNoExpectedPosition},
    {"PLAN_INDEX_ERROR_FLAG", kPlanIndexErrorFlag},
    {"PLAN_INDEX_VALUE_MASK", kPlanIndexValueMask},
    {"MAX_REAL_KV_SOURCES", kMaxRealKvSources},
    {"REAL_KV_PARAM_FIELDS", kRealKvParamFields},
    {"REAL_KV_PARAM_PAGE_SIZE", kRealKvParamPageSize},
    {"REAL_KV_PARAM_BYTES_PER_TOKEN", kRealKvParamBytesPerToken},
    {"REAL_KV_PARAM_READ_BYTES", kRealKvParamReadBytes},
    {"REAL_KV_ALIGN_BYTES", kRealKvAlignBytes},
    {"REAL_KV_PARTIAL_BYTES", kRealKvPartialBytes},
    {"REAL_KV_HASH_MODE_NONE", static_cast<int64_t>(RealKvHashMode::kNone)},
    {"REAL_KV_HASH_MODE_PARTIAL", static_cast<int64_t>(RealKvHashMode::kPartial)},
    {"REAL_KV_HASH_MODE_ALL", static_cast<int64_t>(RealKvHashMode::kAll)},
    {"VIOLATION_COL_KERNEL_KIND", kViolationColKernelKind},
    {"VIOLATION_COL_SLOT", kViolationColSlot},
    {"VIOLATION_COL_POSITION", kViolationColPosition},
    {"VIOLATION_COL_STORED_TOKEN", kViolationColStoredToken},
    {"VIOLATION_COL_EXPECTED_TOKEN", kViolationColExpectedToken},
    {"VIOLATION_COL_STORED_CHAIN_HASH", kViolationColStoredChainHash},
    {"VIOLATION_COL_EXPECTED_AUX", kViolationColExpectedAux},
    {"VIOLATION_COL_FAIL_REASON_BITS", kViolationColFailReasonBits},
    {"VIOLATION_FIELDS", kViolationFields},
    {"VIOLATION_META_COL_STEP", kViolationMetaColStep},
    {"VIOLATION_META_COL_REQUEST_ROW", kViolationMetaColRequestRow},
    {"VIOLATION_META_COL_WRITTEN_STEP", kViolationMetaColWrittenStep},
    {"VIOLATION_META_COL_WRITER_SERIAL", kViolationMetaColWriterSerial},
    {"VIOLATION_META_FIELDS", kViolationMetaFields},
    {"SLOT_ATTRIBUTION_COL_WRITTEN_STEP", kSlotAttributionColWrittenStep},
    {"SLOT_ATTRIBUTION_COL_WRITER_SERIAL", kSlotAttributionColWriterSerial},
    {"SLOT_ATTRIBUTION_FIELDS", kSlotAttributionFields},
    {"META_UNKNOWN", kMetaUnknown},
    {"LAUNCH_TAG_VERIFY", kLaunchTagVerify},
    {"LAUNCH_TAG_WRITE", kLaunchTagWrite},
    {"LAUNCH_TAG_SWEEP", kLaunchTagSweep},
    {"NUM_LAUNCH_TAGS", kNumLaunchTags},
    {"STATE_WRITE_INDEX", kStateWriteIndex},
    {"STATE_RING_LOST_AT_RESET", kStateRingLostAtReset},
    {"STATE_KERNEL_RUNS", kStateKernelRuns},
    {"STATE_SLOT_RUNS", kStateSlotRuns},
    {"STATE_RING_EPOCH", kStateRingEpoch},
    {"STATE_FORWARD", kStateForward},
    {"STATE_DRAINED_TO", kStateDrainedTo},
    {"STATE_DONE_BLOCKS", kStateDoneBlocks},
    {"STATE_ARRIVALS", kStateArrivals},
    {"STATE_REUSE_GATE", kStateReuseGate},
    {"STATE_RING_REUSED_AT", kStateRingReusedAt},
    {"STATE_TOKEN_MAIL_READ", kStateTokenMailRead},
    {"STATE_HEADER_FIELDS", kStateHeaderFields},
    {"DRAINED_TO_EPOCH_SHIFT", kDrainedToEpochShift},
    {"REASON_VERIFY_CHAIN_HASH", kReasonVerifyChainHash},
    {"REASON_VERIFY_POSITION", kReasonVerifyPosition},
    {"REASON_VERIFY_REAL_KV_HASH", kReasonVerifyRealKvHash},
    {"REASON_WRITE_TOKEN", kReasonWriteToken},
    {"REASON_WRITE_POSITION", kReasonWritePosition},
    {"REASON_VERIFY_TOKEN", kReasonVerifyToken},
    {"REASON_SLOT_OUT_OF_RANGE", kReasonSlotOutOfRange},
    {"TOKEN_UPDATE_FIELD_ROW", kTokenUpdateFieldRow},
    {"TOKEN_UPDATE_FIELD_START", kTokenUpdateFieldStart},
    {"TOKEN_UPDATE_FIELD_COUNT", kTokenUpdateFieldCount},
    {"TOKEN_UPDATE_FIELD_VALID_LEN", kTokenUpdateFieldValidLen},
    {"TOKEN_UPDATE_FIELD_OFFSET", kTokenUpdateFieldOffset},
    {"TOKEN_UPDATE_FIELDS", kTokenUpdateFields},
    {"TOKEN_APPEND_FIELD_ROW", kTokenAppendFieldRow},
    {"TOKEN_APPEND_FIELD_START", kTokenAppendFieldStart},
    {"TOKEN_APPEND_FIELD_TOKEN", kTokenAppendFieldToken},
    {"TOKEN_APPEND_FIELDS", kTokenAppendFields},
    {"TOKEN_MAIL_FIELD_ROW", kTokenMailFieldRow},
    {"TOKEN_MAIL_FIELD_START", kTokenMailFieldStart},
    {"TOKEN_MAIL_FIELD_TOKEN", kTokenMailFieldToken},
    {"TOKEN_MAIL_FIELD_STEP", kTokenMailFieldStep},
    {"TOKEN_MAIL_FIELDS", kTokenMailFields},
    {"SWEEP_PLAN_META_NUM_SPANS", kSweepPlanMetaNumSpans},
    {"SWEEP_PLAN_META_NUM_TOMBSTONES", kSweepPlanMetaNumTombstones},
    {"SWEEP_PLAN_META_SLOTS_BASE", kSweepPlanMetaSlotsBase},
    {"SWEEP_PLAN_META_NUM_VALID", kSweepPlanMetaNumValid},
    {"SWEEP_PLAN_META_HEADER_FIELDS", kSweepPlanMetaHeaderFields},
    {"SWEEP_PLAN_SPAN_FIELD_START", kSweepPlanSpanFieldStart},
    {"SWEEP_PLAN_SPAN_FIELD_LENGTH", kSweepPlanSpanFieldLength},
    {"SWEEP_PLAN_SPAN_FIELD_FIRST_POSITION", kSweepPlanSpanFieldFirstPosition},
    {"SWEEP_PLAN_SPAN_FIELD_BEFORE", kSweepPlanSpanFieldBefore},
    {"SWEEP_PLAN_SPAN_FIELDS", kSweepPlanSpanFields},
    {"SWEEP_PLAN_TOMBSTONE_FIELD_START", kSweepPlanTombstoneFieldStart},
    {"SWEEP_PLAN_TOMBSTONE_FIELD_LENGTH", kSweepPlanTombstoneFieldLength},
    {"SWEEP_PLAN_TOMBSTONE_FIELDS", kSweepPlanTombstoneFields},
    {"SWEEP_PLAN_MAX_SPANS", kSweepPlanMaxSpans},
    {"SWEEP_PLAN_MAX_TOMBSTONES", kSweepPlanMaxTombstones},
    {"SWEEP_PLAN_META_VALUES", kSweepPlanMetaValues},
};

}  // namespace kvcanary

#endif  // KVCANARY_LAYOUT_H_
