// tvm-ffi exports of the runtime's per-forward check (plan + verify + the small ops in one launch, issue 15), and its
// bound form.
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_check.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_check_step, kvcanary::host::canary_check_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_check_bind, kvcanary::host::canary_check_bind);
