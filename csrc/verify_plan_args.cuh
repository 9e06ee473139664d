/*!
 * \file verify_plan_args.cuh
 * \brief Host-side validation of a verify plan's buffers, shared by canary_plan_step (which fills them) and
 *        canary_verify_step (which reads them).
 *
 * Checks (each failure names the function and the argument): verify_slot_indices, verify_expected_tokens,
 * verify_expected_positions and verify_prev_slot_indices are int64 [verify_capacity] (one capacity), and
 * verify_num_valid and verify_enable int32 [1], all on the call's device. The order of the checks is the order of
 * the arguments: it decides the error a call with several bad arguments gets.
 */
#pragma once

#include <cstdint>

#include "kvcanary/tensor_check.h"

namespace kvcanary {
namespace host {

inline void check_verify_plan_buffers(const char* fn, SymbolicDevice& device, SymbolicSize& capacity,
                                      const TensorView& slot_indices, const TensorView& expected_tokens,
                                      const TensorView& expected_positions, const TensorView& prev_slot_indices,
                                      const TensorView& num_valid, const TensorView& enable) {
  TensorMatcher(fn, {capacity})
      .dtype<int64_t>()
      .device(device)
      .verify(slot_indices, "verify_slot_indices")
      .verify(expected_tokens, "verify_expected_tokens")
      .verify(expected_positions, "verify_expected_positions")
      .verify(prev_slot_indices, "verify_prev_slot_indices");
  TensorMatcher(fn, {1}).dtype<int32_t>().device(device).verify(num_valid, "verify_num_valid");
  TensorMatcher(fn, {1}).dtype<int32_t>().device(device).verify(enable, "verify_enable");
}

}  // namespace host
}  // namespace kvcanary
