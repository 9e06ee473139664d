/*!
 * \file kvcanary/launch.h
 * \brief CUDA launch helpers: the caller's stream, device guard, SM count, launch error checks, the device address
 *   of pinned host memory (for kernels that read a host staging in place).
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

#include "kvcanary/tensor_check.h"

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

/*!
 * \brief The device address of the pinned host memory at `host` (zero-copy: a kernel reads or writes it in place, no
 *   copy);
 *   a ValueError naming `arg` for anything else (pageable, device or managed memory, or memory CUDA does not know).
 */
template <typename T>
inline T* pinned_device_address(const char* fn, const char* arg, T* host) {
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, host);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // a pointer CUDA does not know: reported below, not left as a sticky error
  }
  const bool pinned =
      status == cudaSuccess && attributes.type == cudaMemoryTypeHost && attributes.devicePointer != nullptr;
  KVCANARY_CHECK_ARG(pinned, ValueError, fn, arg)
      << "expected pinned host memory the device can read (torch pin_memory / cudaHostAlloc), got "
      << (status != cudaSuccess                       ? "memory CUDA does not know"
          : attributes.type == cudaMemoryTypeDevice  ? "device memory"
          : attributes.type == cudaMemoryTypeManaged ? "managed memory"
          : attributes.type == cudaMemoryTypeHost    ? "pinned memory without a device mapping"
                                                     : "pageable host memory (not pinned)");
  return static_cast<T*>(attributes.devicePointer);
}

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
