/*!
 * \file canary_layout.cuh
 * \brief canary_layout_constants: the layout table of kvcanary/layout.h, for the Python mirror's test.
 *
 * Grid/Block: none (host only). Writes: nothing. Returns a fresh name → value map per call.
 */
#pragma once

#include <tvm/ffi/container/map.h>
#include <tvm/ffi/string.h>

#include <cstdint>

#include "kvcanary/layout.h"
#include "kvcanary/macros.h"

namespace kvcanary {
namespace host {

inline tvm::ffi::Map<tvm::ffi::String, int64_t> canary_layout_constants() {
  tvm::ffi::Map<tvm::ffi::String, int64_t> out;
  for (const LayoutConstant& c : kLayoutConstantTable) {
    out.Set(c.name, c.value);
  }
  return out;
}

/*! \brief "cpu" or "cuda": which backend this module was compiled as. */
inline tvm::ffi::String canary_backend_name() { return KVCANARY_DEVICE_BUILD ? "cuda" : "cpu"; }

}  // namespace host
}  // namespace kvcanary
