// tvm-ffi exports of the plan kernel: the seed ABI and the kvcanary+ form with request rows and writer attribution.
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_plan.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_plan_step, kvcanary::host::canary_plan_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_plan_step_attributed, kvcanary::host::canary_plan_step_attributed);
