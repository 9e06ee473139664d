/*!
 * \file kvcanary/violation.h
 * \brief The violation ring: rows of 8 int64 columns appended through an int32 write index (SPEC §3),
 *        and (kvcanary+) the metadata row beside each ring row.
 *
 * Append = atomic increment of the index; the row is stored only when the old index lies in
 * [0, capacity), so the first `capacity` rows are kept, the index counts every violation, and an
 * index that ever wrapped past INT32_MAX can never address outside the ring.
 *
 * Metadata (optional, kvcanary+): when the sink has a `meta` table ([capacity, kViolationMetaFields]),
 * the same index also stores the launch's forward counter (read from `forward_step` at append time, so
 * a CUDA-graph replay records the replay's value), the request row and the slot's writer attribution.
 * Everything here runs on the failure path only: a clean launch never touches the metadata.
 */
#ifndef KVCANARY_VIOLATION_H_
#define KVCANARY_VIOLATION_H_

#include <cstdint>

#include "kvcanary/atomics.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"

namespace kvcanary {

/*! \brief Where a launch appends its violations, and the launch tag stamped on each row. */
struct ViolationSink {
  int64_t* ring;         // [capacity, kViolationFields]
  int32_t* write_index;  // [1]
  int32_t capacity;
  int64_t kernel_kind;
  int64_t* meta;                // [capacity, kViolationMetaFields], or nullptr (no metadata)
  const int64_t* forward_step;  // [1] the forward counter, or nullptr (step unknown)
};

/*! \brief Columns 1..7 of a row (column 0 comes from the sink). */
struct ViolationRow {
  int64_t slot;
  int64_t position;
  int64_t stored_token;
  int64_t expected_token;
  int64_t stored_chain_hash;
  int64_t expected_aux;
  int64_t fail_reason_bits;
};

/*! \brief What a launch knows about a failing entry beyond the ring columns (the step comes from the sink). */
struct ViolationMeta {
  int64_t request_row;
  int64_t written_step;
  int64_t writer_serial;
};

KVCANARY_HD ViolationMeta unknown_violation_meta() { return ViolationMeta{kMetaUnknown, kMetaUnknown, kMetaUnknown}; }

/*! \brief The attribution of `slot` ([written_step, writer_serial]) as metadata of a row about request_row. */
KVCANARY_HD ViolationMeta attributed_violation_meta(const int64_t* slot_attribution, int64_t slot,
                                                    int64_t request_row) {
  ViolationMeta meta{request_row, kMetaUnknown, kMetaUnknown};
  if (slot_attribution != nullptr) {
    const int64_t* a = slot_attribution + slot * kSlotAttributionFields;
    meta.written_step = a[kSlotAttributionColWrittenStep];
    meta.writer_serial = a[kSlotAttributionColWriterSerial];
  }
  return meta;
}

/*! \brief Append one row (and its metadata when the sink keeps metadata). */
KVCANARY_HD void record_violation(const ViolationSink& sink, const ViolationRow& row,
                                  const ViolationMeta& meta = unknown_violation_meta()) {
  const int32_t index = atomic_add_i32(sink.write_index, 1);
  if (index < 0 || index >= sink.capacity) {
    return;
  }
  int64_t* out = sink.ring + static_cast<int64_t>(index) * kViolationFields;
  out[kViolationColKernelKind] = sink.kernel_kind;
  out[kViolationColSlot] = row.slot;
  out[kViolationColPosition] = row.position;
  out[kViolationColStoredToken] = row.stored_token;
  out[kViolationColExpectedToken] = row.expected_token;
  out[kViolationColStoredChainHash] = row.stored_chain_hash;
  out[kViolationColExpectedAux] = row.expected_aux;
  out[kViolationColFailReasonBits] = row.fail_reason_bits;
  if (sink.meta != nullptr) {
    int64_t* m = sink.meta + static_cast<int64_t>(index) * kViolationMetaFields;
    m[kViolationMetaColStep] = sink.forward_step != nullptr ? *sink.forward_step : kMetaUnknown;
    m[kViolationMetaColRequestRow] = meta.request_row;
    m[kViolationMetaColWrittenStep] = meta.written_step;
    m[kViolationMetaColWriterSerial] = meta.writer_serial;
  }
  publish_fence();
}

}  // namespace kvcanary

#endif  // KVCANARY_VIOLATION_H_
