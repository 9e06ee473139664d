// tvm-ffi exports of the writer serials' per-prefill upload, read in place from pinned host memory.
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_row_serials.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_row_serial_update, kvcanary::host::canary_row_serial_update);
