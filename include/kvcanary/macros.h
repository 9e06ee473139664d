/*!
 * \file kvcanary/macros.h
 * \brief Host/device portability macros shared by every kvcanary header.
 *
 * The same kernel sources compile twice: with nvcc for the CUDA backend and with g++ for the CPU
 * backend. `KVCANARY_HD` marks functions that both backends call per item; `KVCANARY_DEVICE_BUILD`
 * selects the scheduling code (a CUDA grid or a CPU loop); `KVCANARY_DEVICE_CODE` is set only in
 * nvcc's device pass, where CUDA intrinsics may be used.
 */
#ifndef KVCANARY_MACROS_H_
#define KVCANARY_MACROS_H_

#if defined(__CUDACC__)
#define KVCANARY_HD __host__ __device__ __forceinline__
#define KVCANARY_DEVICE_BUILD 1
#else
#define KVCANARY_HD inline
#define KVCANARY_DEVICE_BUILD 0
#endif

// Every __global__ kernel is declared KVCANARY_KERNEL: internal linkage, because a kernel header may be included by
// more than one export translation unit (csrc/export_shims.h), and each keeps its own copy.
#define KVCANARY_KERNEL static __global__

#if defined(__CUDA_ARCH__)
#define KVCANARY_DEVICE_CODE 1
#else
#define KVCANARY_DEVICE_CODE 0
#endif

// Records and KV bytes are read as little-endian words; every supported host and device is LE.
#if defined(__BYTE_ORDER__) && (__BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__)
#error "kvcanary assumes a little-endian host"
#endif

#endif  // KVCANARY_MACROS_H_
