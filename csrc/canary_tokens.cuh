/*!
 * \file canary_tokens.cuh
 * \brief canary_token_update: apply one batch of expected-token updates (the token check's uploads, SPEC §4.3);
 *   canary_token_append: the same for a batch that appends one token to each row (a decode forward), staged in
 *   a third of the values (see the end of this comment).
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
 *
 * canary_token_append reads kTokenAppendFields runs of num_updates values (layout.h): rows, starts, tokens. For
 *   each update u, in order: expected_tokens[row, start] = int32(token), valid_lens_by_row[row] = start + 1: what
 *   canary_token_update does for an update of count 1 (its valid length start + 1, its one token at the offset),
 *   without the count, valid length and offset runs the host would build for every row. Staging memory as above.
 * Validation (host wrapper, before any write): the tensors as above; 0 <= num_updates < 2^31 and
 *   kTokenAppendFields * num_updates <= staging length; then each update, read on the host: 0 <= row < rows,
 *   0 <= start < width (an append at or past the width writes no token: the caller clips it through
 *   canary_token_update). A bad update raises a ValueError naming `staging` and the update; nothing is written.
 * Grid:  CUDA: one launch. No row repeats: min(ceil(num_updates / kTokenUpdateThreads), kTokenUpdateMaxBlocks)
 *        blocks of kTokenUpdateThreads threads, grid-stride, one update per thread; a row repeated in the batch
 *        (checked on the host): one thread applying the updates in order (a rare batch: the later update wins).
 *        num_updates == 0: no launch. CPU: one loop in batch order.
 *
 * canary_token_append_bind binds the append's three tensors once (one bound function per staging of the runtime's
 *   ring): they are validated and the staging's device address resolved at binding, and a call checks only its count
 *   and the staged updates, then launches as the export does.
 */
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bound_args.cuh"
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

/*! \brief Apply append `u` (the field-major runs of canary_token_append's staging). */
KVCANARY_HD void token_append_apply(const TokenUpdateParams& p, int64_t u) {
  const int64_t row = p.staging[static_cast<int64_t>(kTokenAppendFieldRow) * p.num_updates + u];
  const int64_t start = p.staging[static_cast<int64_t>(kTokenAppendFieldStart) * p.num_updates + u];
  const int64_t token = p.staging[static_cast<int64_t>(kTokenAppendFieldToken) * p.num_updates + u];
  p.expected_tokens[row * p.table_row_stride + start] = static_cast<int32_t>(token);
  p.valid_lens_by_row[row] = start + 1;
}

#if KVCANARY_DEVICE_BUILD

/*! \brief Appends to distinct rows: every update is applied by its own thread, in any order. */
KVCANARY_KERNEL void __launch_bounds__(kTokenUpdateThreads) canary_token_append_kernel(TokenUpdateParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < p.num_updates; u += stride) {
    token_append_apply(p, u);
  }
}

/*! \brief Appends where a row repeats (launched as one thread): in batch order, so the later update wins. */
KVCANARY_KERNEL void canary_token_append_ordered_kernel(TokenUpdateParams p) {
  for (int64_t u = 0; u < p.num_updates; ++u) {
    token_append_apply(p, u);
  }
}

KVCANARY_KERNEL void __launch_bounds__(kTokenUpdateThreads) canary_token_update_kernel(TokenUpdateParams p) {
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

inline void canary_token_append_cpu(const TokenUpdateParams& p) {
  for (int64_t u = 0; u < p.num_updates; ++u) {
    token_append_apply(p, u);
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
 * \brief Check every append of a staging the host can read (see the file comment); throws for the first bad one.
 * Returns true when a row appears in more than one update.
 */
inline bool token_append_check_updates(const char* fn, const int64_t* host_staging, int64_t num_updates, int64_t rows,
                                       int64_t width) {
  const int64_t* staged_rows = host_staging + static_cast<int64_t>(kTokenAppendFieldRow) * num_updates;
  const int64_t* staged_starts = host_staging + static_cast<int64_t>(kTokenAppendFieldStart) * num_updates;
  for (int64_t u = 0; u < num_updates; ++u) {
    const int64_t row = staged_rows[u];
    const int64_t start = staged_starts[u];
    if (row < 0 || row >= rows) {
      token_update_header_error(fn, u, row, "row outside [0, " + std::to_string(rows) + ")");
    }
    if (start < 0 || start >= width) {
      token_update_header_error(fn, u, row,
                                "start " + std::to_string(start) + " outside [0, " + std::to_string(width) +
                                    ") (an append past the width must be clipped: canary_token_update)");
    }
  }
  return has_repeated_rows(std::vector<int64_t>(staged_rows, staged_rows + num_updates));
}

/*! \brief What both exports take from their checked arguments (see token_table_args). */
struct TokenTableArgs {
  int64_t rows;
  int64_t width;
  int64_t staging_len;
  DLDevice device;
  TokenUpdateParams params;  // every field but staging (the caller's: its host or device address)
  const int64_t* host_staging;
};

/*!
 * \brief Check the arguments both exports share and extract them: expected_tokens int32 [rows, width] (unit stride
 *   in the last dimension), valid_lens_by_row int64 [rows], on the build's device; staging int64 [staging_len]
 *   contiguous host memory (CUDA: pinned, checked by the caller's pinned_device_address); 0 <= num_updates < 2^31.
 */
inline TokenTableArgs token_table_args(const char* fn, const TensorView& expected_tokens,
                                       const TensorView& valid_lens_by_row, const TensorView& staging,
                                       int64_t num_updates) {
  SymbolicSize rows("rows");
  SymbolicSize width("width");
  SymbolicSize staging_len("staging_len");
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);
  TensorMatcher(fn, {rows, width})
      .dtype<int32_t>()
      .device(device)
      .inner_contiguous()
      .verify(expected_tokens, "expected_tokens");
  TensorMatcher(fn, {rows}).dtype<int64_t>().device(device).verify(valid_lens_by_row, "valid_lens_by_row");
  TensorMatcher(fn, {staging_len}).dtype<int64_t>().verify(staging, "staging");
  check_host_memory(fn, "staging", staging);
  KVCANARY_CHECK_ARG(num_updates >= 0 && num_updates <= INT32_MAX, ValueError, fn, "num_updates")
      << "must be in [0, 2^31), got " << num_updates;
  TokenTableArgs args{};
  args.rows = rows.value();
  args.width = width.value();
  args.staging_len = staging_len.value();
  args.device = device.value();
  args.params.expected_tokens = data_of<int32_t>(expected_tokens);
  args.params.table_row_stride = args.rows > 1 ? stride_of(expected_tokens, 0) : args.width;
  args.params.valid_lens_by_row = data_of<int64_t>(valid_lens_by_row);
  args.params.num_updates = num_updates;
  args.host_staging = data_of<const int64_t>(staging);
  return args;
}

/*! \brief The staging's address the kernel reads (CUDA: the pinned memory's device address, checked pinned). */
inline const int64_t* token_staging_address(const char* fn, const TokenTableArgs& args) {
#if KVCANARY_DEVICE_BUILD
  tvm::ffi::CUDADeviceGuard guard(args.device.device_id);
  return pinned_device_address(fn, "staging", args.host_staging);
#else
  (void)fn;
  return args.host_staging;
#endif
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
  TokenTableArgs args = token_table_args(kFn, expected_tokens, valid_lens_by_row, staging, num_updates);
  const int64_t headers = static_cast<int64_t>(kTokenUpdateFields) * num_updates;
  KVCANARY_CHECK_ARG(headers <= staged_len && staged_len <= args.staging_len, ValueError, kFn, "staged_len")
      << "expected " << kTokenUpdateFields << " * num_updates = " << headers << " <= staged_len <= staging length "
      << args.staging_len << ", got " << staged_len;
  // 2-4. the headers checked on the host (the staging is host memory), then the launch on the caller's stream: a
  //      block per update (grid-stride past kTokenUpdateMaxBlocks); one block, in batch order, when a row repeats.
  const int64_t* staging_address = token_staging_address(kFn, args);
  if (num_updates == 0) {
    return;
  }
  const bool repeated_rows =
      token_update_check_headers(kFn, args.host_staging, num_updates, staged_len, args.rows, args.width);
  TokenUpdateParams p = args.params;
  p.staging = staging_address;
#if KVCANARY_DEVICE_BUILD
  tvm::ffi::CUDADeviceGuard guard(args.device.device_id);
  const int64_t blocks = repeated_rows ? 1 : std::min(num_updates, kTokenUpdateMaxBlocks);
  launch_kernel(canary_token_update_kernel, static_cast<uint32_t>(blocks), kTokenUpdateThreads,
                current_stream(args.device), p);
#else
  (void)repeated_rows;  // CPU: the updates in batch order
  canary_token_update_cpu(p);
#endif
}

/*!
 * \brief The launch of `num_updates` appends staged at `staging` (its address the kernel reads: CUDA: the pinned
 *   staging's device address), `args` checked (token_table_args) and the staging's length `args.staging_len`: the
 *   count checked against it, the updates on the host, then the launch on the caller's stream: a thread per update
 *   (grid-stride past kTokenUpdateMaxBlocks blocks); one thread, in batch order, when a row repeats. What the export
 *   and the bound append share.
 */
inline void token_append_launch(const char* fn, TokenTableArgs args, const int64_t* staging, int64_t num_updates) {
  KVCANARY_CHECK_ARG(num_updates >= 0 && num_updates <= INT32_MAX, ValueError, fn, "num_updates")
      << "must be in [0, 2^31), got " << num_updates;
  const int64_t staged = static_cast<int64_t>(kTokenAppendFields) * num_updates;
  KVCANARY_CHECK_ARG(staged <= args.staging_len, ValueError, fn, "num_updates")
      << "expected " << kTokenAppendFields << " * num_updates = " << staged << " <= staging length "
      << args.staging_len;
  if (num_updates == 0) {
    return;
  }
  const bool repeated_rows = token_append_check_updates(fn, args.host_staging, num_updates, args.rows, args.width);
  TokenUpdateParams p = args.params;
  p.num_updates = num_updates;
  p.staging = staging;
#if KVCANARY_DEVICE_BUILD
  tvm::ffi::CUDADeviceGuard guard(args.device.device_id);
  const cudaStream_t stream = current_stream(args.device);
  if (repeated_rows) {
    launch_kernel(canary_token_append_ordered_kernel, 1U, 1U, stream, p);
  } else {
    const int64_t blocks = std::min(ceil_div(num_updates, kTokenUpdateThreads), kTokenUpdateMaxBlocks);
    launch_kernel(canary_token_append_kernel, static_cast<uint32_t>(blocks), kTokenUpdateThreads, stream, p);
  }
#else
  (void)repeated_rows;  // CPU: the updates in batch order
  canary_token_append_cpu(p);
#endif
}

/*!
 * \brief Append one token to each of `num_updates` rows, staged as kTokenAppendFields runs (see the file comment).
 *   The tensors as canary_token_update's.
 */
inline void canary_token_append(TensorView expected_tokens, TensorView valid_lens_by_row, TensorView staging,
                                int64_t num_updates) {
  constexpr const char* kFn = "canary_token_append";
  TokenTableArgs args = token_table_args(kFn, expected_tokens, valid_lens_by_row, staging, 0);
  token_append_launch(kFn, args, token_staging_address(kFn, args), num_updates);
}

/*!
 * \brief canary_token_append with its three tensors bound once (issue 25: the token check's upload of every decode
 *   forward): validated, extracted and, on CUDA, the staging's device address resolved at binding (the export asks
 *   the driver for it on every call). Returns a function of (stream_tensor, num_updates) that checks the count and
 *   the staged updates on the host and launches, with the export's errors. The function owns the three tensors.
 *   `stream_tensor`: any tensor on the table's device (the caller passes valid_lens_by_row): tvm-ffi sets the stream
 *   a launch reads (launch.h current_stream) from the first CUDA torch tensor of a call, so a call with none would
 *   launch on whatever stream an earlier call left; the launch is on torch's current stream when the call is made.
 */
inline tvm::ffi::Function canary_token_append_bind(tvm::ffi::Tensor expected_tokens, tvm::ffi::Tensor valid_lens_by_row,
                                                   tvm::ffi::Tensor staging) {
  constexpr const char* kFn = "canary_token_append_bound";
  BoundTensor table(std::move(expected_tokens));
  BoundTensor lens(std::move(valid_lens_by_row));
  BoundTensor staged(std::move(staging));
  const TokenTableArgs args = token_table_args(kFn, table.view, lens.view, staged.view, 0);
  const int64_t* address = token_staging_address(kFn, args);
  return tvm::ffi::Function::FromTyped(
      [owned = std::make_tuple(std::move(table), std::move(lens), std::move(staged)), args, address](
          TensorView stream_tensor, int64_t num_updates) {
        const DLDevice device = stream_tensor.device();
        KVCANARY_CHECK_ARG(device.device_type == args.device.device_type && device.device_id == args.device.device_id,
                           ValueError, kFn, "stream_tensor")
            << "expected a tensor on " << device_name(args.device) << " (the table's device), got one on "
            << device_name(device);
        token_append_launch(kFn, args, address, num_updates);
      },
      kFn);
}

}  // namespace host
}  // namespace kvcanary
