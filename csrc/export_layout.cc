// tvm-ffi exports of the layout table (kvcanary.kernels.layout checks its mirror against it) and the backend name.
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_layout.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_layout_constants, kvcanary::host::canary_layout_constants);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_backend_name, kvcanary::host::canary_backend_name);
