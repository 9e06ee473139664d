/*!
 * \file kvcanary/launch.h
 * \brief CUDA launch helpers: the caller's stream, device guard, SM count, launch error checks.
 *
 * Compiled only by nvcc (the CPU backend has no launches). Kernels always run on the stream that
 * tvm-ffi reports for the call (torch's current stream), which is what makes them capturable in
 * CUDA graphs: a launch on another stream during capture would silently be left out of the graph.
 */
#ifndef KVCANARY_LAUNCH_H_
#define KVCANARY_LAUNCH_H_

#include "kvcanary/macros.h"

#if KVCANARY_DEVICE_BUILD
#include <cuda_runtime.h>
#include <dlpack/dlpack.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/extra/cuda/base.h>
#include <tvm/ffi/extra/cuda/device_guard.h>

#include <cstdint>

namespace kvcanary {
namespace host {

/*! \brief torch's current stream for `device`, as tvm-ffi set it up for this call. */
inline cudaStream_t current_stream(DLDevice device) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(device.device_type, device.device_id));
}

/*! \brief Number of SMs of `device_id` (queried once per device). */
inline int32_t sm_count(int32_t device_id) {
  constexpr int32_t kMaxDevices = 64;
  static int32_t cached[kMaxDevices] = {};
  if (device_id >= 0 && device_id < kMaxDevices && cached[device_id] > 0) {
    return cached[device_id];
  }
  int32_t count = 0;
  TVM_FFI_CHECK_CUDA_ERROR(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_id));
  if (device_id >= 0 && device_id < kMaxDevices) {
    cached[device_id] = count;
  }
  return count;
}

/*! \brief ceil(a / b) for positive b. */
inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/*! \brief Launch `kernel<<<grid, block, 0, stream>>>(params)` and turn launch errors into exceptions. */
template <typename Params>
inline void launch_kernel(void (*kernel)(Params), uint32_t grid, uint32_t block, cudaStream_t stream,
                          const Params& params) {
  kernel<<<grid, block, 0, stream>>>(params);
  TVM_FFI_CHECK_CUDA_ERROR(cudaGetLastError());
}

}  // namespace host
}  // namespace kvcanary

#endif  // KVCANARY_DEVICE_BUILD
#endif  // KVCANARY_LAUNCH_H_
