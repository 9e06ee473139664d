// tvm-ffi export of the sweep plan's commit (the appended spans, the tombstones and the entry count in one launch).
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_sweep_plan.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_sweep_plan_update, kvcanary::host::canary_sweep_plan_update);
