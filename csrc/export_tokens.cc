// tvm-ffi exports of the token check's uploads read in place from pinned host memory: any forward, and a decode
// forward's one token per row, and that append bound to one staging (issue 25).
// One translation unit per kernel: csrc/export_shims.h says why and how they are built.
#include "canary_tokens.cuh"
#include "export_shims.h"  // last

TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_token_update, kvcanary::host::canary_token_update);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_token_append, kvcanary::host::canary_token_append);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(canary_token_append_bind, kvcanary::host::canary_token_append_bind);
