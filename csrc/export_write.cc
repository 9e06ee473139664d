// tvm-ffi exports of the write kernel: the seed ABI, the kvcanary+ attributed form, and the per-forward write with its
// fixed arguments bound once (issue 15).
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_write.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_step, kvcanary::host::canary_write_step);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_step_attributed, kvcanary::host::canary_write_step_attributed);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_write_bind, kvcanary::host::canary_write_bind);
