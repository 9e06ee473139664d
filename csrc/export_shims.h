/*!
 * \file export_shims.h
 * \brief Included last by every export translation unit (csrc/export_*.cc), after its kernel header.
 *
 * The exports are split one translation unit per kernel so a build compiles them in parallel (ninja, one job per
 * core; `MAX_JOBS` caps it): the CUDA module builds in the time of its slowest unit (the write kernel) instead of
 * the sum. g++ builds each unit for the CPU module, nvcc (through a one-line .cu wrapper kvcanary.kernels.jit
 * writes) for the CUDA module; both modules export the same names. A kernel header that several units include
 * (canary_check.cuh includes the plan and verify headers) defines its kernels with internal linkage
 * (`KVCANARY_KERNEL`), so each unit keeps its own copy.
 *
 * The export shims only unpack arguments; optimising tvm-ffi's 23-argument unpacking templates at -O2/-O3 costs
 * g++ ~10 s per build for no runtime gain, so g++ builds what follows this header at -O1. The kernel headers come
 * before it and keep -O3. nvcc's host pass keeps -O3 throughout: the CUDA module's per-call host cost is measured
 * (benchmarks/bench_host.py) at that level.
 */
#ifndef KVCANARY_EXPORT_SHIMS_H_
#define KVCANARY_EXPORT_SHIMS_H_

#include <tvm/ffi/function.h>

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC optimize("O1")
#endif

#endif  // KVCANARY_EXPORT_SHIMS_H_
