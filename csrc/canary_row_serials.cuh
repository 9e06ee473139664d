/*!
 * \file canary_row_serials.cuh
 * \brief canary_row_serial_update: upload one batch of writer serials (kvcanary+ writer attribution).
 *
 * Reads one int64 staging buffer laid out as kvcanary/serial_upload.py's RowSerialUpload packs it: the rows
 *   staging[0 .. num_updates), then the serials staging[num_updates .. 2 * num_updates). For each update u, in
 *   order: row_serials[staging[u]] = staging[num_updates + u]. Rows no update names keep what they hold. Later
 *   updates win: a row repeated in one call ends with the serial of its last update, on both backends (see Grid;
 *   the index_put_ this replaces left the winner among repeated rows undefined on CUDA).
 * Staging memory: CUDA: PINNED host memory (cudaHostAlloc / torch pin_memory), read by the kernel in place
 *   through its device address (zero-copy, no H2D copy, no second launch); the host wrapper refuses
 *   anything else (pageable or device memory) with a ValueError naming `staging`. The caller must not
 *   rewrite the staging before the launch has completed (an event recorded after it). CPU: a CPU tensor.
 * Validation (host wrapper, before any write): dtypes, shapes, devices; 0 <= num_updates < 2^31 and
 *   2 * num_updates <= staging length; then each row, read on the host: 0 <= row < rows. A bad row raises a
 *   ValueError naming `staging`, the update and the row; nothing is written. Serials are not checked (any
 *   int64 is a serial, META_UNKNOWN included).
 * Grid:  CUDA: one launch. No row repeats: min(ceil(num_updates / kRowSerialThreads), kRowSerialMaxBlocks)
 *        blocks, grid-stride, one update per thread; a row repeated in the batch (checked on the host): one
 *        block taking the updates kRowSerialThreads at a time, in order, each chunk's writes ordered before the
 *        next chunk's by a barrier and, inside a chunk, only the last update of a row writing, so the later
 *        update wins. Sized by the batch, never by the table. num_updates == 0: no launch. CPU: one loop in
 *        batch order.
 * Block: kRowSerialThreads threads: consecutive threads take consecutive updates (coalesced reads of the rows
 *        and of the serials); the ordered block stages a chunk's rows in shared memory to find repeats in it.
 * Reads:  the staging.
 * Writes: row_serials (the updated rows).
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvcanary/launch.h"
#include "kvcanary/macros.h"
#include "kvcanary/tensor_check.h"

namespace kvcanary {

constexpr uint32_t kRowSerialThreads = 128;
constexpr int64_t kRowSerialMaxBlocks = 1024;

struct RowSerialParams {
  int64_t* row_serials;    // [rows]
  const int64_t* staging;  // the device's address of the staging (CUDA: of the pinned host memory)
  int64_t num_updates;
};

/*! \brief The row of update `u` (the first run of the staging). */
KVCANARY_HD int64_t row_serial_update_row(const RowSerialParams& p, int64_t u) { return p.staging[u]; }

/*! \brief The serial of update `u` (the second run of the staging). */
KVCANARY_HD int64_t row_serial_update_serial(const RowSerialParams& p, int64_t u) {
  return p.staging[p.num_updates + u];
}

#if KVCANARY_DEVICE_BUILD

/*! \brief Distinct rows: every update is written by its own thread, in any order. */
KVCANARY_KERNEL void __launch_bounds__(kRowSerialThreads) canary_row_serial_update_kernel(RowSerialParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < p.num_updates; u += stride) {
    p.row_serials[row_serial_update_row(p, u)] = row_serial_update_serial(p, u);
  }
}

/*! \brief A row repeats: one block, the updates a chunk at a time in batch order; the later update of a row wins. */
KVCANARY_KERNEL void __launch_bounds__(kRowSerialThreads) canary_row_serial_update_ordered_kernel(RowSerialParams p) {
  __shared__ int64_t chunk_rows[kRowSerialThreads];
  const uint32_t t = threadIdx.x;
  for (int64_t first = 0; first < p.num_updates; first += kRowSerialThreads) {
    const int64_t left = p.num_updates - first;
    const uint32_t in_chunk = left < kRowSerialThreads ? static_cast<uint32_t>(left) : kRowSerialThreads;
    if (t < in_chunk) {
      chunk_rows[t] = row_serial_update_row(p, first + t);
    }
    __syncthreads();
    if (t < in_chunk) {
      const int64_t row = chunk_rows[t];
      bool last_of_its_row = true;  // no later update of the chunk names the row (a later one must win)
      for (uint32_t later = t + 1; later < in_chunk && last_of_its_row; ++later) {
        last_of_its_row = chunk_rows[later] != row;
      }
      if (last_of_its_row) {
        p.row_serials[row] = row_serial_update_serial(p, first + t);
      }
    }
    // Orders this chunk's writes before the next chunk's (a later chunk's repeat overwrites, it is not overwritten)
    // and keeps chunk_rows until every thread has read it.
    __syncthreads();
  }
}

#else

inline void canary_row_serial_update_cpu(const RowSerialParams& p) {
  for (int64_t u = 0; u < p.num_updates; ++u) {
    p.row_serials[row_serial_update_row(p, u)] = row_serial_update_serial(p, u);
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*! \brief The ValueError of a bad row: "<fn>: staging: update <u> (row <row>): outside [0, <rows>)". */
KVCANARY_COLD inline void row_serial_update_row_error(const char* fn, int64_t u, int64_t row, int64_t rows) {
  TVM_FFI_THROW(ValueError) << fn << ": staging: update " << u << " (row " << row << "): row outside [0, " << rows
                            << ")";
}

/*!
 * \brief Check every row of a staging the host can read (see the file comment); throws for the first bad one.
 * Returns true when a row appears in more than one update.
 */
inline bool row_serial_update_check_rows(const char* fn, const int64_t* host_staging, int64_t num_updates,
                                         int64_t rows) {
  std::vector<int64_t> seen_rows(host_staging, host_staging + num_updates);
  for (int64_t u = 0; u < num_updates; ++u) {
    const int64_t row = seen_rows[static_cast<size_t>(u)];
    if (row < 0 || row >= rows) {
      row_serial_update_row_error(fn, u, row, rows);
    }
  }
  return has_repeated_rows(std::move(seen_rows));
}

/*!
 * \brief Apply `num_updates` writer-serial updates staged in `staging[0, 2 * num_updates)` (see the file comment).
 *   row_serials int64 [rows] on the build's device; staging int64 [staging_len] contiguous: CUDA: pinned host
 *   memory; CPU: a CPU tensor.
 */
inline void canary_row_serial_update(TensorView row_serials, TensorView staging, int64_t num_updates) {
  constexpr const char* kFn = "canary_row_serial_update";
  // 1. validate the tensors and sizes
  SymbolicSize rows("rows");
  SymbolicSize staging_len("staging_len");
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);
  TensorMatcher(kFn, {rows}).dtype<int64_t>().device(device).verify(row_serials, "row_serials");
  TensorMatcher(kFn, {staging_len}).dtype<int64_t>().verify(staging, "staging");
  check_host_memory(kFn, "staging", staging);
  KVCANARY_CHECK_ARG(num_updates >= 0 && num_updates <= INT32_MAX, ValueError, kFn, "num_updates")
      << "must be in [0, 2^31), got " << num_updates;
  KVCANARY_CHECK_ARG(2 * num_updates <= staging_len.value(), ValueError, kFn, "num_updates")
      << "expected 2 * num_updates = " << 2 * num_updates << " <= staging length " << staging_len.value();
  const int64_t* host_staging = data_of<const int64_t>(staging);
#if KVCANARY_DEVICE_BUILD
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t* device_staging = pinned_device_address(kFn, "staging", host_staging);
#endif
  if (num_updates == 0) {
    return;
  }
  // 2. validate the rows (on the host: the staging is host memory) and look for a repeated one
  const bool repeated_rows = row_serial_update_check_rows(kFn, host_staging, num_updates, rows.value());

  // 3. extract parameters
  RowSerialParams p{};
  p.row_serials = data_of<int64_t>(row_serials);
  p.num_updates = num_updates;

#if KVCANARY_DEVICE_BUILD
  // 4. launch on the caller's stream: a thread per update (grid-stride past kRowSerialMaxBlocks blocks); one
  //    ordered block when a row repeats.
  p.staging = device_staging;
  if (repeated_rows) {
    launch_kernel(canary_row_serial_update_ordered_kernel, 1U, kRowSerialThreads, current_stream(dev), p);
  } else {
    const int64_t blocks = std::min(ceil_div(num_updates, kRowSerialThreads), kRowSerialMaxBlocks);
    launch_kernel(canary_row_serial_update_kernel, static_cast<uint32_t>(blocks), kRowSerialThreads,
                  current_stream(dev), p);
  }
#else
  // 4. CPU: the updates in batch order.
  (void)repeated_rows;
  p.staging = host_staging;
  canary_row_serial_update_cpu(p);
#endif
}

}  // namespace host
}  // namespace kvcanary
