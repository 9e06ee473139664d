/*!
 * \file kvcanary_ops.cc
 * \brief The export table: every tvm-ffi function kvcanary ships, declared once.
 *
 * g++ compiles this file for the CPU backend and nvcc (through a one-line .cu wrapper that includes
 * it) for the CUDA backend; both modules export the same names.
 */
#include <tvm/ffi/function.h>

#include "kvcanary/macros.h"
#include "canary_check.cuh"
#include "canary_layout.cuh"
#include "canary_plan.cuh"
#include "canary_row_serials.cuh"
#include "canary_tokens.cuh"
#include "canary_verify.cuh"
#include "canary_write.cuh"

// The export shims only unpack arguments; optimising tvm-ffi's 23-argument unpacking templates at
// -O2/-O3 costs g++ ~10 s per build for no runtime gain, so the shims are built at -O1.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC optimize("O1")
#endif

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_step, kvcanary::host::canary_write_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_verify_step, kvcanary::host::canary_verify_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_plan_step, kvcanary::host::canary_plan_step);
// kvcanary+: the same kernels with the optional violation metadata / writer attribution arguments appended.
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_step_attributed, kvcanary::host::canary_write_step_attributed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_verify_step_attributed, kvcanary::host::canary_verify_step_attributed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_plan_step_attributed, kvcanary::host::canary_plan_step_attributed);
// kvcanary+ (issue 15): plan + verify + the per-forward small ops in one launch.
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_check_step, kvcanary::host::canary_check_step);
// kvcanary+ (issue 15): the per-forward check and write with their fixed arguments bound once; each returns a
// function of the forward's own arguments only (tvm-ffi converts each tensor argument on every call).
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_check_bind, kvcanary::host::canary_check_bind);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_bind, kvcanary::host::canary_write_bind);
// kvcanary+ (issue 15): the token check's per-forward upload, read in place from pinned host memory.
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_token_update, kvcanary::host::canary_token_update);
// kvcanary+ (issue 15): the same for a decode forward, one token per row: a third of the staging.
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_token_append, kvcanary::host::canary_token_append);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_layout_constants, kvcanary::host::canary_layout_constants);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_backend_name, kvcanary::host::canary_backend_name);
// kvcanary+ (issue 15): the writer serials' per-prefill upload, read in place from pinned host memory.
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_row_serial_update, kvcanary::host::canary_row_serial_update);
