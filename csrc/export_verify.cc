// tvm-ffi exports of the verify kernel: the seed ABI and the kvcanary+ form with violation metadata appended.
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_verify.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_verify_step, kvcanary::host::canary_verify_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_verify_step_attributed, kvcanary::host::canary_verify_step_attributed);
