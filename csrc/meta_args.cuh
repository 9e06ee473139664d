/*!
 * \file meta_args.cuh
 * \brief Host-side validation and packing of the kvcanary+ metadata arguments shared by write and verify:
 *        violation_meta, forward_step and slot_attribution (each optional).
 *
 * Checks (each failure names the function and the argument): violation_meta is a contiguous int64
 * [ring_capacity, kViolationMetaFields] (the ring's capacity), forward_step an int64 [1], slot_attribution
 * a contiguous int64 [num_slots, kSlotAttributionFields] (the canary buffer's slots), all on the call's
 * device. Absent arguments leave the sink without metadata, the step unknown, or attribution off.
 */
#pragma once

#include <tvm/ffi/optional.h>

#include <cstdint>

#include "kvcanary/layout.h"
#include "kvcanary/tensor_check.h"
#include "kvcanary/violation.h"

namespace kvcanary {
namespace host {

/*! \brief Data pointer of an optional tensor (nullptr when absent). */
template <typename T>
inline T* optional_data_of(const tvm::ffi::Optional<TensorView>& t) {
  return t.has_value() ? data_of<T>(t.value()) : nullptr;
}

/*!
 * \brief Validate the metadata arguments; fill the sink's metadata fields.
 * \return the slot attribution table (nullptr when absent).
 */
KVCANARY_COLD inline int64_t* pack_violation_meta(const char* fn, SymbolicDevice& device, SymbolicSize& ring_capacity,
                                                  SymbolicSize& num_slots,
                                                  const tvm::ffi::Optional<TensorView>& violation_meta,
                                                  const tvm::ffi::Optional<TensorView>& forward_step,
                                                  const tvm::ffi::Optional<TensorView>& slot_attribution,
                                                  ViolationSink& sink) {
  if (violation_meta.has_value()) {
    TensorMatcher(fn, {ring_capacity, kViolationMetaFields})
        .dtype<int64_t>()
        .device(device)
        .verify(violation_meta.value(), "violation_meta");
  }
  if (forward_step.has_value()) {
    TensorMatcher(fn, {1}).dtype<int64_t>().device(device).verify(forward_step.value(), "forward_step");
  }
  if (slot_attribution.has_value()) {
    TensorMatcher(fn, {num_slots, kSlotAttributionFields})
        .dtype<int64_t>()
        .device(device)
        .verify(slot_attribution.value(), "slot_attribution");
  }
  sink.meta = optional_data_of<int64_t>(violation_meta);
  sink.forward_step = optional_data_of<const int64_t>(forward_step);
  return optional_data_of<int64_t>(slot_attribution);
}

}  // namespace host
}  // namespace kvcanary
