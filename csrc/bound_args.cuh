/*!
 * \file bound_args.cuh
 * \brief Tensors a bound launch function (canary_check_bind, canary_write_bind) holds for its whole life.
 *
 * A bind takes the arguments of a per-forward export that never change for a runtime's life once, as owning
 * tvm::ffi::Tensor references, so their storage stays alive as long as the returned function does; each call then
 * hands the existing host wrapper a TensorView of each, made once here, instead of converting the Python tensor
 * again (tvm-ffi's per-tensor DLPack exchange is most of a wide export's call cost). The bind validates and extracts
 * them once (check_prepare, write_prepare: the export's own checks, in its order, so a bad one raises at binding
 * with the export's error); a call validates only the forward's own arguments against what was prepared.
 */
#pragma once

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "kvcanary/tensor_check.h"

namespace kvcanary {
namespace host {

/*!
 * \brief An owned tensor and its view. The view copies the DLTensor, whose shape and strides point into the owner's
 * object (never into this struct), so a copied or moved BoundTensor's view stays valid while any copy owns it.
 */
struct BoundTensor {
  explicit BoundTensor(tvm::ffi::Tensor tensor) : owner(std::move(tensor)), view(owner) {}

  tvm::ffi::Tensor owner;
  TensorView view;
};

/*! \brief An owned optional tensor and its view (absent: both empty). */
struct BoundOptionalTensor {
  explicit BoundOptionalTensor(tvm::ffi::Optional<tvm::ffi::Tensor> tensor)
      : owner(std::move(tensor)), view(view_of(owner)) {}

  tvm::ffi::Optional<tvm::ffi::Tensor> owner;
  tvm::ffi::Optional<TensorView> view;

 private:
  static tvm::ffi::Optional<TensorView> view_of(const tvm::ffi::Optional<tvm::ffi::Tensor>& owner) {
    if (!owner.has_value()) {
      return std::nullopt;
    }
    // value() is a second reference to the owner's object: the view's shape and strides outlive it with the owner.
    const tvm::ffi::Tensor tensor = owner.value();
    return TensorView(tensor);
  }
};

/*!
 * \brief The real-KV arguments of a bound launch (real_kv_buf_0..3, real_kv_source_params, num_sources,
 * real_kv_hash_mode), held once for both binds; validated and packed once, at binding (real_kv_args.cuh
 * pack_real_kv_sources).
 */
struct BoundRealKvSources {
  BoundRealKvSources(tvm::ffi::Tensor real_kv_buf_0, tvm::ffi::Tensor real_kv_buf_1, tvm::ffi::Tensor real_kv_buf_2,
                     tvm::ffi::Tensor real_kv_buf_3, tvm::ffi::Tensor real_kv_source_params, int64_t num_real_kv_sources,
                     int64_t real_kv_hash_mode)
      : buf_0(std::move(real_kv_buf_0)),
        buf_1(std::move(real_kv_buf_1)),
        buf_2(std::move(real_kv_buf_2)),
        buf_3(std::move(real_kv_buf_3)),
        source_params(std::move(real_kv_source_params)),
        num_sources(num_real_kv_sources),
        hash_mode(real_kv_hash_mode) {}

  BoundTensor buf_0;
  BoundTensor buf_1;
  BoundTensor buf_2;
  BoundTensor buf_3;
  BoundTensor source_params;
  int64_t num_sources;
  int64_t hash_mode;
};

}  // namespace host
}  // namespace kvcanary
