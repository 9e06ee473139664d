/*!
 * \file canary_tokens.cuh
 * \brief canary_token_update: apply one batch of expected-token updates (the token check's uploads, SPEC §4.3).
 *
 * Reads one int64 staging buffer laid out as kvcanary/layout.h's token-table staging: for update u of
 *   num_updates, field f at staging[f * num_updates + u] (row, start, count, valid length, offset), its
 *   tokens at staging[offset .. offset + count). For each update, in order:
 *   expected_tokens[row, start + i] = int32(staging[offset + i]) for i < count (the low 32 bits, as a
 *   conversion of the int64 value to int32 gives), valid_lens_by_row[row] = valid length. Positions the
 *   update does not cover keep what they hold. Later updates win: updates of one row are applied in
 *   batch order (see Grid).
 * Staging memory: CUDA: PINNED host memory (cudaHostAlloc / torch pin_memory), read by the kernel in place
 *   through its device address (zero-copy, no H2D copy, no second launch); the host wrapper refuses
 *   anything else (pageable or device memory) with a ValueError naming `staging`. The caller must not
 *   rewrite the staging before the launch has completed (an event recorded after it). CPU: a CPU tensor.
 * Validation (host wrapper, before any write): dtypes, shapes, devices; num_updates >= 0 and
 *   kTokenUpdateFields * num_updates <= staged_len <= staging length; then each header, read on the
 *   host: 0 <= row < rows, start >= 0, count >= 0, start + count <= width, 0 <= valid length <= width,
 *   the tokens inside [kTokenUpdateFields * num_updates, staged_len). A bad header raises a ValueError
 *   naming `staging` and the update; nothing is written.
 * Grid:  CUDA: one launch. No row repeats: min(num_updates, kTokenUpdateMaxBlocks) blocks, grid-stride
 *        over updates, one update per block at a time; a row repeated in the batch (checked on the host):
 *        one block applying the updates in order, so the later update wins. Sized by the batch, never by
 *        the table. num_updates == 0: no launch. CPU: one loop in batch order.
 * Block: kTokenUpdateThreads threads: threads 0..kTokenUpdateFields-1 load the update's header into
 *        shared memory, then all stride over its tokens (coalesced reads of the staging).
 * Reads:  the staging (headers and tokens).
 * Writes: expected_tokens (the updated positions), valid_lens_by_row (the updated rows).
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/tensor_check.h"

namespace kvcanary {

constexpr uint32_t kTokenUpdateThreads = 128;
constexpr int64_t kTokenUpdateMaxBlocks = 1024;

struct TokenUpdateParams {
  int32_t* expected_tokens;  // [rows, width], row stride table_row_stride
  int64_t table_row_stride;
  int64_t* valid_lens_by_row;  // [rows]
  const int64_t* staging;      // the device's address of the staging (CUDA: of the pinned host memory)
  int64_t num_updates;
};

/*! \brief Field `field` of update `u` in the field-major header. */
KVCANARY_HD int64_t token_update_field(const TokenUpdateParams& p, int64_t u, int32_t field) {
  return p.staging[static_cast<int64_t>(field) * p.num_updates + u];
}

KVCANARY_HD void token_update_store(const TokenUpdateParams& p, int64_t row, int64_t start, int64_t offset,
                                    int64_t i) {
  p.expected_tokens[row * p.table_row_stride + start + i] = static_cast<int32_t>(p.staging[offset + i]);
}

#if KVCANARY_DEVICE_BUILD

__global__ void __launch_bounds__(kTokenUpdateThreads) canary_token_update_kernel(TokenUpdateParams p) {
  __shared__ int64_t header[kTokenUpdateFields];
  for (int64_t u = blockIdx.x; u < p.num_updates; u += gridDim.x) {
    if (threadIdx.x < static_cast<uint32_t>(kTokenUpdateFields)) {
      header[threadIdx.x] = token_update_field(p, u, static_cast<int32_t>(threadIdx.x));
    }
    __syncthreads();
    const int64_t row = header[kTokenUpdateFieldRow];
    const int64_t start = header[kTokenUpdateFieldStart];
    const int64_t count = header[kTokenUpdateFieldCount];
    const int64_t offset = header[kTokenUpdateFieldOffset];
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
      token_update_store(p, row, start, offset, i);
    }
    if (threadIdx.x == 0) {
      p.valid_lens_by_row[row] = header[kTokenUpdateFieldValidLen];
    }
    // The header is reloaded for the next update; in a one-block launch this also orders one update's writes
    // before the next one's (a repeated row: the later update wins).
    __syncthreads();
  }
}

#else

inline void canary_token_update_cpu(const TokenUpdateParams& p) {
  for (int64_t u = 0; u < p.num_updates; ++u) {
    const int64_t row = token_update_field(p, u, kTokenUpdateFieldRow);
    const int64_t start = token_update_field(p, u, kTokenUpdateFieldStart);
    const int64_t count = token_update_field(p, u, kTokenUpdateFieldCount);
    const int64_t offset = token_update_field(p, u, kTokenUpdateFieldOffset);
    for (int64_t i = 0; i < count; ++i) {
      token_update_store(p, row, start, offset, i);
    }
    p.valid_lens_by_row[row] = token_update_field(p, u, kTokenUpdateFieldValidLen);
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*! \brief The ValueError of a bad header: "<fn>: staging: update <u> (row <row>): <what>". */
KVCANARY_COLD inline void token_update_header_error(const char* fn, int64_t u, int64_t row, const std::string& what) {
  TVM_FFI_THROW(ValueError) << fn << ": staging: update " << u << " (row " << row << "): " << what;
}

/*!
 * \brief Check every header of a staging the host can read (see the file comment); throws for the first bad one.
 * Returns true when a row appears in more than one update.
 */
inline bool token_update_check_headers(const char* fn, const int64_t* host_staging, int64_t num_updates,
                                       int64_t staged_len, int64_t rows, int64_t width) {
  const int64_t tokens_begin = static_cast<int64_t>(kTokenUpdateFields) * num_updates;
  std::vector<int64_t> seen_rows;
  seen_rows.reserve(static_cast<size_t>(num_updates));
  for (int64_t u = 0; u < num_updates; ++u) {
    const int64_t row = host_staging[kTokenUpdateFieldRow * num_updates + u];
    const int64_t start = host_staging[kTokenUpdateFieldStart * num_updates + u];
    const int64_t count = host_staging[kTokenUpdateFieldCount * num_updates + u];
    const int64_t valid_len = host_staging[kTokenUpdateFieldValidLen * num_updates + u];
    const int64_t offset = host_staging[kTokenUpdateFieldOffset * num_updates + u];
    if (row < 0 || row >= rows) {
      token_update_header_error(fn, u, row, "row outside [0, " + std::to_string(rows) + ")");
    }
    if (start < 0) token_update_header_error(fn, u, row, "start " + std::to_string(start) + " < 0");
    const int64_t room = start < width ? width - start : 0;  // a start at or past the width writes nothing
    if (count < 0 || count > room) {
      token_update_header_error(fn, u, row,
                                "count " + std::to_string(count) + " outside [0, " + std::to_string(room) +
                                    "] (tokens past the width " + std::to_string(width) + " must be clipped)");
    }
    if (valid_len < 0 || valid_len > width) {
      token_update_header_error(fn, u, row,
                                "valid length " + std::to_string(valid_len) + " outside [0, " +
                                    std::to_string(width) + "]");
    }
    if (offset < tokens_begin || offset > staged_len - count) {
      token_update_header_error(fn, u, row,
                                "tokens [" + std::to_string(offset) + ", " + std::to_string(offset + count) +
                                    ") outside the staged tokens [" + std::to_string(tokens_begin) + ", " +
                                    std::to_string(staged_len) + ")");
    }
    seen_rows.push_back(row);
  }
  return has_repeated_rows(std::move(seen_rows));
}

/*!
 * \brief Apply `num_updates` updates staged in `staging[0, staged_len)` (see the file comment).
 *   expected_tokens int32 [rows, width] (unit stride in the last dimension), valid_lens_by_row int64 [rows], on
 *   the build's device; staging int64 [staging_len] contiguous: CUDA: pinned host memory; CPU: a CPU tensor.
 */
inline void canary_token_update(TensorView expected_tokens, TensorView valid_lens_by_row, TensorView staging,
                                int64_t num_updates, int64_t staged_len) {
  constexpr const char* kFn = "canary_token_update";
  // 1. validate the tensors and sizes
  SymbolicSize rows("rows");
  SymbolicSize width("width");
  SymbolicSize staging_len("staging_len");
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);
  TensorMatcher(kFn, {rows, width})
      .dtype<int32_t>()
      .device(device)
      .inner_contiguous()
      .verify(expected_tokens, "expected_tokens");
  TensorMatcher(kFn, {rows}).dtype<int64_t>().device(device).verify(valid_lens_by_row, "valid_lens_by_row");
  TensorMatcher(kFn, {staging_len}).dtype<int64_t>().verify(staging, "staging");
  check_host_memory(kFn, "staging", staging);
  KVCANARY_CHECK_ARG(num_updates >= 0 && num_updates <= INT32_MAX, ValueError, kFn, "num_updates")
      << "must be in [0, 2^31), got " << num_updates;
  const int64_t headers = static_cast<int64_t>(kTokenUpdateFields) * num_updates;
  KVCANARY_CHECK_ARG(headers <= staged_len && staged_len <= staging_len.value(), ValueError, kFn, "staged_len")
      << "expected " << kTokenUpdateFields << " * num_updates = " << headers << " <= staged_len <= staging length "
      << staging_len.value() << ", got " << staged_len;
  const int64_t* host_staging = data_of<const int64_t>(staging);
#if KVCANARY_DEVICE_BUILD
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t* device_staging = pinned_device_address(kFn, "staging", host_staging);
#endif
  if (num_updates == 0) {
    return;
  }
  // 2. validate the headers (on the host: the staging is host memory) and look for a repeated row
  const bool repeated_rows =
      token_update_check_headers(kFn, host_staging, num_updates, staged_len, rows.value(), width.value());

  // 3. extract parameters
  TokenUpdateParams p{};
  p.expected_tokens = data_of<int32_t>(expected_tokens);
  p.table_row_stride = rows.value() > 1 ? stride_of(expected_tokens, 0) : width.value();
  p.valid_lens_by_row = data_of<int64_t>(valid_lens_by_row);
  p.num_updates = num_updates;

#if KVCANARY_DEVICE_BUILD
  // 4. launch on the caller's stream: a block per update (grid-stride past kTokenUpdateMaxBlocks); one block, in
  //    batch order, when a row repeats.
  p.staging = device_staging;
  const int64_t blocks = repeated_rows ? 1 : std::min(num_updates, kTokenUpdateMaxBlocks);
  launch_kernel(canary_token_update_kernel, static_cast<uint32_t>(blocks), kTokenUpdateThreads,
                current_stream(dev), p);
#else
  // 4. CPU: the updates in batch order.
  (void)repeated_rows;
  p.staging = host_staging;
  canary_token_update_cpu(p);
#endif
}

}  // namespace host
}  // namespace kvcanary
