/*!
 * \file kvcanary/atomics.h
 * \brief Relaxed atomic adds with one spelling for both backends.
 *
 * Device code uses CUDA atomics; host code (the CPU backend, and nvcc's host pass) uses the GCC
 * builtins, so the CPU loop stays correct if it is ever parallelised.
 */
#ifndef KVCANARY_ATOMICS_H_
#define KVCANARY_ATOMICS_H_

#include <cstdint>

#include "kvcanary/macros.h"

namespace kvcanary {

/*! \brief *addr += value; returns the old value. */
KVCANARY_HD int32_t atomic_add_i32(int32_t* addr, int32_t value) {
#if KVCANARY_DEVICE_CODE
  return atomicAdd(addr, value);
#else
  return __atomic_fetch_add(addr, value, __ATOMIC_RELAXED);
#endif
}

/*! \brief *addr += value (two's complement, so int64 counters wrap like the device). */
KVCANARY_HD void atomic_add_i64(int64_t* addr, int64_t value) {
#if KVCANARY_DEVICE_CODE
  atomicAdd(reinterpret_cast<unsigned long long*>(addr), static_cast<unsigned long long>(value));
#else
  __atomic_fetch_add(reinterpret_cast<uint64_t*>(addr), static_cast<uint64_t>(value), __ATOMIC_RELAXED);
#endif
}

/*! \brief Makes row stores visible to a host copy made after the kernel (pinned / mapped drains). */
KVCANARY_HD void publish_fence() {
#if KVCANARY_DEVICE_CODE
  __threadfence_system();
#else
  __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

}  // namespace kvcanary

#endif  // KVCANARY_ATOMICS_H_
