/*!
 * \file kvcanary/violation.h
 * \brief The violation ring: rows of 8 int64 columns appended through an int32 write index (SPEC §3).
 *
 * Append = atomic increment of the index; the row is stored only when the old index lies in
 * [0, capacity), so the first `capacity` rows are kept, the index counts every violation, and an
 * index that ever wrapped past INT32_MAX can never address outside the ring.
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

/*! \brief Append one row. */
KVCANARY_HD void record_violation(const ViolationSink& sink, const ViolationRow& row) {
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
  publish_fence();
}

}  // namespace kvcanary

#endif  // KVCANARY_VIOLATION_H_
