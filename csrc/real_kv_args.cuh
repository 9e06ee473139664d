/*!
 * \file real_kv_args.cuh
 * \brief Host-side validation and packing of the real-KV arguments shared by write and verify:
 *        real_kv_buf_0..3, real_kv_source_params, num_sources, real_kv_hash_mode.
 *
 * Checks (each failure names the function and the argument): every buffer is a 2-D uint8 tensor on
 * the call's device with a unit inner stride; the params table is a contiguous CPU int32
 * [kMaxRealKvSources, kRealKvParamFields]; 0 <= num_sources <= kMaxRealKvSources; the mode is one of
 * NONE/PARTIAL/ALL. For each used source with read_bytes > 0: page_size >= 1, num_bytes_per_token a
 * positive multiple of 16, read_bytes a multiple of 16 <= num_bytes_per_token, row stride and data
 * pointer 16-byte aligned, row width >= page_size * num_bytes_per_token, and rows * page_size >=
 * num_slots so that any in-range canary slot is also in range for the source.
 */
#pragma once

#include <cstdint>

#include "kvcanary/layout.h"
#include "kvcanary/real_kv.h"
#include "kvcanary/tensor_check.h"

namespace kvcanary {
namespace host {

inline RealKvSources pack_real_kv_sources(const char* fn, SymbolicDevice& device, int64_t num_canary_slots,
                                          const TensorView& buf0, const TensorView& buf1, const TensorView& buf2,
                                          const TensorView& buf3, const TensorView& params_table,
                                          int64_t num_sources, int64_t hash_mode) {
  static const char* const kBufNames[kMaxRealKvSources] = {"real_kv_buf_0", "real_kv_buf_1", "real_kv_buf_2",
                                                           "real_kv_buf_3"};
  const TensorView* bufs[kMaxRealKvSources] = {&buf0, &buf1, &buf2, &buf3};

  KVCANARY_CHECK_ARG(num_sources >= 0 && num_sources <= kMaxRealKvSources, ValueError, fn, "num_sources")
      << "must be in [0, " << kMaxRealKvSources << "], got " << num_sources;
  KVCANARY_CHECK_ARG(hash_mode >= 0 && hash_mode < kRealKvHashModeCount, ValueError, fn, "real_kv_hash_mode")
      << "must be 0 (NONE), 1 (PARTIAL) or 2 (ALL), got " << hash_mode;
  TensorMatcher(fn, {kMaxRealKvSources, kRealKvParamFields})
      .dtype<int32_t>()
      .on_cpu()
      .verify(params_table, "real_kv_source_params");

  RealKvSources out{};
  out.num_sources = static_cast<int32_t>(num_sources);
  out.mode = static_cast<RealKvHashMode>(hash_mode);
  const int32_t* params = data_of<const int32_t>(params_table);
  for (int32_t s = 0; s < kMaxRealKvSources; ++s) {
    const char* arg = kBufNames[s];
    SymbolicSize rows("rows");
    SymbolicSize row_bytes("row_bytes");
    TensorMatcher(fn, {rows, row_bytes}).dtype<uint8_t>().device(device).inner_contiguous().verify(*bufs[s], arg);
    RealKvSource& src = out.source[s];
    src.data = data_of<const uint8_t>(*bufs[s]);
    src.row_stride_bytes = stride_of(*bufs[s], 0);
    src.page_size = params[s * kRealKvParamFields + kRealKvParamPageSize];
    src.num_bytes_per_token = params[s * kRealKvParamFields + kRealKvParamBytesPerToken];
    src.read_bytes = params[s * kRealKvParamFields + kRealKvParamReadBytes];
    if (s >= num_sources || src.read_bytes == 0) {
      src.read_bytes = 0;  // unused slot of the fixed ABI: never dereferenced
      continue;
    }
    KVCANARY_CHECK_ARG(src.page_size >= 1, ValueError, fn, "real_kv_source_params")
        << "source " << s << ": page_size must be >= 1, got " << src.page_size;
    KVCANARY_CHECK_ARG(src.num_bytes_per_token > 0 && src.num_bytes_per_token % kRealKvAlignBytes == 0, ValueError,
                       fn, "real_kv_source_params")
        << "source " << s << ": num_bytes_per_token must be a positive multiple of " << kRealKvAlignBytes
        << ", got " << src.num_bytes_per_token;
    KVCANARY_CHECK_ARG(src.read_bytes > 0 && src.read_bytes % kRealKvAlignBytes == 0 &&
                           src.read_bytes <= src.num_bytes_per_token,
                       ValueError, fn, "real_kv_source_params")
        << "source " << s << ": read_bytes must be a multiple of " << kRealKvAlignBytes
        << " in [0, num_bytes_per_token=" << src.num_bytes_per_token << "], got " << src.read_bytes;
    KVCANARY_CHECK_ARG(src.row_stride_bytes % kRealKvAlignBytes == 0 && src.row_stride_bytes > 0, ValueError, fn, arg)
        << "row stride must be a positive multiple of " << kRealKvAlignBytes << " bytes, got "
        << src.row_stride_bytes;
    KVCANARY_CHECK_ARG(reinterpret_cast<uintptr_t>(src.data) % kRealKvAlignBytes == 0, ValueError, fn, arg)
        << "data pointer must be " << kRealKvAlignBytes << "-byte aligned";
    const int64_t row_width_needed = static_cast<int64_t>(src.page_size) * src.num_bytes_per_token;
    KVCANARY_CHECK_ARG(row_bytes.value() >= row_width_needed, ValueError, fn, arg)
        << "row width " << row_bytes.value() << " bytes is less than page_size * num_bytes_per_token = "
        << row_width_needed;
    KVCANARY_CHECK_ARG(rows.value() * src.page_size >= num_canary_slots, ValueError, fn, arg)
        << "covers " << rows.value() * src.page_size << " slots (rows=" << rows.value()
        << " x page_size=" << src.page_size << "), fewer than num_canary_slots=" << num_canary_slots;
  }
  return out;
}

}  // namespace host
}  // namespace kvcanary
