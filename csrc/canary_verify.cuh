/*!
 * \file canary_verify.cuh
 * \brief canary_verify_step: check the shadow records of every request's prefix (SPEC §4.2).
 *
 * Computes, for each entry e < min(verify_num_valid, capacity) when verify_enable != 0:
 *   slot == 0 → skipped (counted); else load the slot's record and compare
 *   - chain:    prev == -1 → expected prev_hash = anchor hash; prev == 0 → not checked;
 *               else expected = mix3(prev.prev_hash, prev.token, prev.position) from the stored record;
 *   - token:    only with check_tokens and an expected token != -1;
 *   - position: always;
 *   - real-KV:  stored real_kv_hash vs the fingerprint of the slot's current bytes (0 in mode NONE).
 *   One row per failing entry: (slot, stored position, stored token, expected token — -1 unless
 *   check_tokens, stored prev_hash, expected prev_hash — or the stored one when the chain was not
 *   checked, failure bits).
 * Grid:  CUDA: min(ceil(capacity / kVerifyThreadsPerBlock), SMs * kVerifyBlocksPerSm) blocks, at least
 *        1, grid-stride over entries. CPU: one loop.
 * Block: kVerifyThreadsPerBlock threads, one entry per thread per step; the slot's and the
 *        predecessor's records are loaded up front (16-byte loads when aligned) so they overlap.
 * Reads:  plan arrays, records (never written: canary_buf is read-only here), real-KV bytes.
 * Writes: violation rows; kernel_run_counter +1 and slot_run_counter += active entries, both by
 *         thread 0 of block 0 (no per-entry atomics; the active count is known up front).
 * Bounds (kvcanary+, reason kReasonSlotOutOfRange):
 *   - slot < 0 or slot >= num_slots: row (slot, expected position, -1, expected token*, 0, slot) with
 *     only that bit; nothing is dereferenced.
 *   - prev < -1 or prev >= num_slots: the chain is not checked; the row carries the other failures
 *     plus that bit, with expected_aux = prev.
 * kvcanary+ (canary_verify_step_attributed: the arguments above, then four optional ones; absent = off):
 *   violation_meta [ring_capacity, kViolationMetaFields] and forward_step [1]: each row also gets a
 *   metadata row: forward_step's value, verify_request_rows[e] ([capacity], the entry's req_to_token row)
 *   and, for an in-range slot, its slot_attribution row ([num_slots, kSlotAttributionFields]: the forward
 *   and writer serial of its last write). Read for failing entries only; rows, counters unchanged.
 */
#pragma once

#include <cstdint>

#include "kvcanary/atomics.h"
#include "kvcanary/hash.h"
#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/memory.h"
#include "kvcanary/real_kv.h"
#include "kvcanary/tensor_check.h"
#include "kvcanary/violation.h"
#include "meta_args.cuh"
#include "verify_plan_args.cuh"
#include "real_kv_args.cuh"

namespace kvcanary {

constexpr uint32_t kVerifyThreadsPerBlock = 256;
constexpr uint32_t kVerifyBlocksPerSm = 8;

/*! \brief What checking one entry against its record needs (shared by verify and canary_check_step). */
struct RecordCheck {
  const uint8_t* canary_buf;
  int64_t slot_stride_bytes;
  int64_t num_slots;
  bool records_aligned16;
  bool check_tokens;
  RealKvSources sources;
  const int64_t* slot_attribution;  // [num_slots, kSlotAttributionFields], nullptr: off (kvcanary+)
};

/*! \brief One planned entry: the slot, its predecessor, and what its record must hold. */
struct VerifyEntry {
  int64_t slot;
  int64_t prev;
  int64_t expected_token;
  int64_t expected_position;
};

struct VerifyParams {
  RecordCheck check;

  const int64_t* slot_indices;
  const int64_t* expected_tokens;
  const int64_t* expected_positions;
  const int64_t* prev_slot_indices;
  const int32_t* num_valid;
  const int32_t* enable;
  int64_t capacity;

  ViolationSink sink;
  int64_t* slot_run_counter;
  int64_t* kernel_run_counter;

  // kvcanary+ (nullptr: off)
  const int64_t* request_rows;  // [capacity] req_to_token row of each entry
};

/*! \brief Entries this launch visits: min(num_valid, capacity), or 0 when disabled. */
KVCANARY_HD int64_t active_verify_entries(const VerifyParams& p) {
  if (*p.enable == 0) return 0;
  const int64_t n = *p.num_valid;
  if (n < 0) return 0;
  return n < p.capacity ? n : p.capacity;
}

/*! \brief The per-launch counter updates (done once per launch by one thread). */
KVCANARY_HD void verify_bump_counters(const VerifyParams& p) {
  atomic_add_i64(p.kernel_run_counter, 1);
  const int64_t active = active_verify_entries(p);
  if (active > 0) atomic_add_i64(p.slot_run_counter, active);
}

KVCANARY_HD const uint8_t* verify_record_row(const RecordCheck& c, int64_t slot) {
  return c.canary_buf + slot * c.slot_stride_bytes;
}

/*! \brief The req_to_token row of plan entry e, read on the failure path only. */
struct PlannedRequestRow {
  const int64_t* rows;  // nullptr: unknown
  int64_t e;
  KVCANARY_HD int64_t operator()() const { return rows != nullptr ? rows[e] : kMetaUnknown; }
};

/*! \brief A request row the caller already holds. */
struct KnownRequestRow {
  int64_t row;
  KVCANARY_HD int64_t operator()() const { return row; }
};

/*!
 * \brief Check one entry against its record; appends at most one violation row to `sink`.
 * `request_row()` is evaluated for a failing entry only.
 */
template <typename RequestRow>
KVCANARY_HD void verify_record(const RecordCheck& c, const ViolationSink& sink, const VerifyEntry& entry,
                               const RequestRow& request_row) {
  const int64_t slot = entry.slot;
  if (slot == kPaddingSlot) {
    return;
  }
  // Rows show the expected token only when it was checked (as SGLang's built-in verify does).
  const int64_t reported_token = c.check_tokens ? entry.expected_token : kNoExpectedToken;
  if (slot < 0 || slot >= c.num_slots) {
    record_violation(sink,
                     ViolationRow{slot, entry.expected_position, -1, reported_token, 0, slot, kReasonSlotOutOfRange},
                     ViolationMeta{request_row(), kMetaUnknown, kMetaUnknown});
    return;
  }
  const int64_t prev = entry.prev;
  const bool prev_in_range = prev > kUnknownPrevSlot && prev < c.num_slots;
  // Issue both record loads before any use so their latencies overlap.
  const CanaryRecord record = load_record_readonly(verify_record_row(c, slot), c.records_aligned16);
  CanaryRecord prev_record{};
  if (prev_in_range) {
    prev_record = load_record_readonly(verify_record_row(c, prev), c.records_aligned16);
  }

  int64_t bits = 0;
  int64_t expected_aux = record.prev_hash;
  if (prev == kChainHeadSlot) {
    expected_aux = static_cast<int64_t>(chain_head_hash());
    if (record.prev_hash != expected_aux) bits |= kReasonVerifyChainHash;
  } else if (prev_in_range) {
    expected_aux = static_cast<int64_t>(
        chain_step(static_cast<uint64_t>(prev_record.prev_hash), prev_record.token, prev_record.position));
    if (record.prev_hash != expected_aux) bits |= kReasonVerifyChainHash;
  } else if (prev != kUnknownPrevSlot) {
    bits |= kReasonSlotOutOfRange;
    expected_aux = prev;
  }
  if (c.check_tokens && entry.expected_token != kNoExpectedToken && record.token != entry.expected_token) {
    bits |= kReasonVerifyToken;
  }
  if (record.position != entry.expected_position) {
    bits |= kReasonVerifyPosition;
  }
  if (record.real_kv_hash != static_cast<int64_t>(real_kv_fingerprint(c.sources, slot))) {
    bits |= kReasonVerifyRealKvHash;
  }
  if (bits != 0) {
    record_violation(sink,
                     ViolationRow{slot, record.position, record.token, reported_token, record.prev_hash, expected_aux,
                                  bits},
                     attributed_violation_meta(c.slot_attribution, slot, request_row()));
  }
}

/*! \brief Verify plan entry e; appends at most one violation row. */
KVCANARY_HD void verify_entry(const VerifyParams& p, int64_t e) {
  const int64_t slot = p.slot_indices[e];
  if (slot == kPaddingSlot) {
    return;
  }
  const VerifyEntry entry{slot, p.prev_slot_indices[e], p.expected_tokens[e], p.expected_positions[e]};
  verify_record(p.check, p.sink, entry, PlannedRequestRow{p.request_rows, e});
}

#if KVCANARY_DEVICE_BUILD

KVCANARY_KERNEL void __launch_bounds__(kVerifyThreadsPerBlock) canary_verify_kernel(const __grid_constant__ VerifyParams p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    verify_bump_counters(p);
  }
  const int64_t active = active_verify_entries(p);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < active; e += stride) {
    verify_entry(p, e);
  }
}

#else

inline void canary_verify_cpu(const VerifyParams& p) {
  verify_bump_counters(p);
  const int64_t active = active_verify_entries(p);
  for (int64_t e = 0; e < active; ++e) {
    verify_entry(p, e);
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*! \brief The arguments of canary_verify_step, then the kvcanary+ metadata arguments (see the file comment). */
inline void canary_verify_step_attributed(
    TensorView canary_buf, TensorView verify_slot_indices, TensorView verify_expected_tokens,
    TensorView verify_expected_positions, TensorView verify_prev_slot_indices, TensorView verify_num_valid,
    TensorView verify_enable, int64_t kernel_kind, TensorView violation_ring, TensorView violation_write_index,
    TensorView slot_run_counter, TensorView kernel_run_counter, TensorView real_kv_buf_0, TensorView real_kv_buf_1,
    TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params, int64_t num_sources,
    int64_t real_kv_hash_mode, int64_t check_tokens, tvm::ffi::Optional<TensorView> violation_meta,
    tvm::ffi::Optional<TensorView> forward_step, tvm::ffi::Optional<TensorView> verify_request_rows,
    tvm::ffi::Optional<TensorView> slot_attribution) {
  constexpr const char* kFn = "canary_verify_step";
  // 1. validate
  SymbolicSize num_slots("num_slots");
  SymbolicSize slot_stride("slot_stride_bytes");
  SymbolicSize capacity("verify_capacity");
  SymbolicSize ring_capacity("ring_capacity");
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);

  TensorMatcher(kFn, {num_slots, slot_stride}).dtype<uint8_t>().device(device).verify(canary_buf, "canary_buf");
  check_verify_plan_buffers(kFn, device, capacity, verify_slot_indices, verify_expected_tokens,
                            verify_expected_positions, verify_prev_slot_indices, verify_num_valid, verify_enable);
  TensorMatcher(kFn, {ring_capacity, kViolationFields})
      .dtype<int64_t>()
      .device(device)
      .verify(violation_ring, "violation_ring");
  TensorMatcher(kFn, {1}).dtype<int32_t>().device(device).verify(violation_write_index, "violation_write_index");
  TensorMatcher(kFn, {1}).dtype<int64_t>().device(device).verify(slot_run_counter, "slot_run_counter");
  TensorMatcher(kFn, {1}).dtype<int64_t>().device(device).verify(kernel_run_counter, "kernel_run_counter");
  KVCANARY_CHECK_ARG(slot_stride.value() >= kMinSlotStrideBytes, ValueError, kFn, "canary_buf")
      << "slot_stride_bytes (shape[1]) must be >= " << kMinSlotStrideBytes << ", got " << slot_stride.value();
  KVCANARY_CHECK_ARG(ring_capacity.value() <= INT32_MAX, ValueError, kFn, "violation_ring")
      << "ring_capacity must be <= 2^31-1, got " << ring_capacity.value();
  KVCANARY_CHECK_ARG(check_tokens == 0 || check_tokens == 1, ValueError, kFn, "check_tokens")
      << "must be 0 or 1, got " << check_tokens;
  const RealKvSources sources =
      pack_real_kv_sources(kFn, device, num_slots.value(), real_kv_buf_0, real_kv_buf_1, real_kv_buf_2,
                           real_kv_buf_3, real_kv_source_params, num_sources, real_kv_hash_mode);
  VerifyParams p{};
  p.check.slot_attribution = pack_violation_meta(kFn, device, ring_capacity, num_slots, violation_meta, forward_step,
                                                 slot_attribution, p.sink);
  if (verify_request_rows.has_value()) {
    TensorMatcher(kFn, {capacity})
        .dtype<int64_t>()
        .device(device)
        .verify(verify_request_rows.value(), "verify_request_rows");
  }

  // 2. extract parameters
  p.check.canary_buf = data_of<const uint8_t>(canary_buf);
  p.check.slot_stride_bytes = slot_stride.value();
  p.check.num_slots = num_slots.value();
  p.check.records_aligned16 = reinterpret_cast<uintptr_t>(p.check.canary_buf) % kRealKvAlignBytes == 0 &&
                              p.check.slot_stride_bytes % kRealKvAlignBytes == 0;
  p.slot_indices = data_of<const int64_t>(verify_slot_indices);
  p.expected_tokens = data_of<const int64_t>(verify_expected_tokens);
  p.expected_positions = data_of<const int64_t>(verify_expected_positions);
  p.prev_slot_indices = data_of<const int64_t>(verify_prev_slot_indices);
  p.num_valid = data_of<const int32_t>(verify_num_valid);
  p.enable = data_of<const int32_t>(verify_enable);
  p.capacity = capacity.value();
  p.check.check_tokens = check_tokens == 1;
  p.sink.ring = data_of<int64_t>(violation_ring);
  p.sink.write_index = data_of<int32_t>(violation_write_index);
  p.sink.capacity = static_cast<int32_t>(ring_capacity.value());
  p.sink.kernel_kind = kernel_kind;
  p.slot_run_counter = data_of<int64_t>(slot_run_counter);
  p.kernel_run_counter = data_of<int64_t>(kernel_run_counter);
  p.check.sources = sources;
  p.request_rows = optional_data_of<const int64_t>(verify_request_rows);

#if KVCANARY_DEVICE_BUILD
  // 3. device guard + stream
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = current_stream(dev);
  // 4. launch: a persistent grid sized from the SM count and the capacity (never from num_valid).
  const int64_t wanted = ceil_div(capacity.value(), kVerifyThreadsPerBlock);
  const int64_t resident = static_cast<int64_t>(sm_count(dev.device_id)) * kVerifyBlocksPerSm;
  const int64_t blocks = wanted < resident ? wanted : resident;
  launch_kernel(canary_verify_kernel, static_cast<uint32_t>(blocks > 0 ? blocks : 1), kVerifyThreadsPerBlock,
                stream, p);
#else
  // 3-4. CPU: run the same per-entry semantics in a loop.
  canary_verify_cpu(p);
#endif
}

/*! \brief SPEC §4.2: no metadata, no attribution. */
inline void canary_verify_step(TensorView canary_buf, TensorView verify_slot_indices,
                               TensorView verify_expected_tokens, TensorView verify_expected_positions,
                               TensorView verify_prev_slot_indices, TensorView verify_num_valid,
                               TensorView verify_enable, int64_t kernel_kind, TensorView violation_ring,
                               TensorView violation_write_index, TensorView slot_run_counter,
                               TensorView kernel_run_counter, TensorView real_kv_buf_0, TensorView real_kv_buf_1,
                               TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params,
                               int64_t num_sources, int64_t real_kv_hash_mode, int64_t check_tokens) {
  canary_verify_step_attributed(canary_buf, verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                                verify_prev_slot_indices, verify_num_valid, verify_enable, kernel_kind,
                                violation_ring, violation_write_index, slot_run_counter, kernel_run_counter,
                                real_kv_buf_0, real_kv_buf_1, real_kv_buf_2, real_kv_buf_3, real_kv_source_params,
                                num_sources, real_kv_hash_mode, check_tokens, std::nullopt, std::nullopt,
                                std::nullopt, std::nullopt);
}

}  // namespace host
}  // namespace kvcanary
