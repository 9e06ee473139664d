/*!
 * \file kvcanary/tensor_check.h
 * \brief Argument validation for host wrappers: TensorMatcher-style checks and runtime checks.
 *
 * Symbolic sizes and the device are bound by the first tensor that uses them and checked against
 * every later one; errors name the function, the argument, the expectation and, for a symbolic
 * size, the argument that bound it. Error kinds are typed so Python can catch them precisely:
 * TypeError for a wrong dtype, ValueError for ndim / shape / device / contiguity / range.
 * This is the only kvcanary header that knows tvm-ffi's tensor types.
 */
#ifndef KVCANARY_TENSOR_CHECK_H_
#define KVCANARY_TENSOR_CHECK_H_

#include <dlpack/dlpack.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/error.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "kvcanary/macros.h"

/*!
 * \brief Throw `Kind` with "<fn>: <arg>: " and whatever is streamed after, unless `cond` holds.
 * Usage: KVCANARY_CHECK_ARG(n >= 0, ValueError, kFn, "num_sources") << "must be >= 0, got " << n;
 */
#define KVCANARY_CHECK_ARG(cond, Kind, fn, arg) \
  if (cond) {                                    \
  } else                                         \
    TVM_FFI_THROW(Kind) << (fn) << ": " << (arg) << ": "

// Validation code is cold: keeping it out of line keeps host wrappers small and builds fast.
#define KVCANARY_COLD __attribute__((noinline, cold))
// Out of line but not cold: what every call runs (a tensor's checks), kept out of the wrappers' bodies only.
#define KVCANARY_OUT_OF_LINE __attribute__((noinline))

namespace kvcanary {
namespace host {

using tvm::ffi::TensorView;

/*! \brief "cpu", "cuda:0", ... */
inline std::string device_name(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
      return device.device_id == 0 ? "cpu" : "cpu:" + std::to_string(device.device_id);
    case kDLCUDA:
      return "cuda:" + std::to_string(device.device_id);
    case kDLCUDAHost:
      return "cuda_host";
    case kDLCUDAManaged:
      return "cuda_managed:" + std::to_string(device.device_id);
    case kDLROCM:
      return "rocm:" + std::to_string(device.device_id);
    default:
      return "device_type_" + std::to_string(static_cast<int>(device.device_type)) + ":" +
             std::to_string(device.device_id);
  }
}

inline const char* device_type_name(int32_t device_type) {
  switch (device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return "cuda";
    default:
      return "other";
  }
}

template <typename T>
DLDataType dtype_of();
template <>
inline DLDataType dtype_of<int64_t>() {
  return DLDataType{kDLInt, 64, 1};
}
template <>
inline DLDataType dtype_of<int32_t>() {
  return DLDataType{kDLInt, 32, 1};
}
template <>
inline DLDataType dtype_of<uint8_t>() {
  return DLDataType{kDLUInt, 8, 1};
}

inline bool same_dtype(DLDataType a, DLDataType b) {
  return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes;
}

/*!
 * \brief Check that `t` is host memory a kernel may read: a CPU tensor, or (CUDA build) pinned host memory, which
 *   the kernel reads in place; a ValueError naming `arg` otherwise. Whether host memory is pinned is checked by
 *   launch.h's pinned_device_address (CUDA build only).
 */
inline void check_host_memory(const char* fn, const char* arg, const TensorView& t) {
  const DLDevice device = t.device();
  KVCANARY_CHECK_ARG(device.device_type == kDLCPU || device.device_type == kDLCUDAHost, ValueError, fn, arg)
      << "expected host memory (" << (KVCANARY_DEVICE_BUILD ? "pinned, read by the kernel in place" : "a CPU tensor")
      << "), got a tensor on " << device_name(device);
}

/*!
 * \brief Whether a row appears more than once in `rows` (sorted here: callers pass a copy they no longer need).
 *   The uploads read from a host staging (canary_row_serials.cuh, canary_tokens.cuh) test it on the host to pick
 *   their launch: a block or thread per update when rows are distinct, an ordered launch (the later update of a row
 *   wins) when one repeats.
 */
inline bool has_repeated_rows(std::vector<int64_t> rows) {
  std::sort(rows.begin(), rows.end());
  return std::adjacent_find(rows.begin(), rows.end()) != rows.end();
}

inline std::string shape_string(const TensorView& t) {
  std::ostringstream os;
  os << "[";
  for (int32_t i = 0; i < t.ndim(); ++i) {
    os << (i ? ", " : "") << t.size(i);
  }
  os << "]";
  return os.str();
}

/*! \brief stride(i) in elements, also for tensors exported without a strides array. */
inline int64_t stride_of(const TensorView& t, int32_t dim) {
  if (!t.IsContiguous()) {
    return t.stride(dim);
  }
  int64_t stride = 1;
  for (int32_t i = t.ndim() - 1; i > dim; --i) {
    stride *= t.size(i);
  }
  return stride;
}

/*! \brief Address of element 0 (data pointer plus DLPack byte offset). */
template <typename T>
inline T* data_of(const TensorView& t) {
  return reinterpret_cast<T*>(static_cast<char*>(t.data_ptr()) + t.byte_offset());
}

/*!
 * \brief A size shared by several tensors; bound on first use. Names are argument names (string literals): the
 *   checks run on every call of an export, so binding copies a pointer, never a string (a heap allocation each).
 */
class SymbolicSize {
 public:
  explicit SymbolicSize(const char* name) : name_(name) {}
  const char* name() const { return name_; }
  bool bound() const { return value_ >= 0; }
  int64_t value() const { return value_; }
  const char* bound_by() const { return bound_by_; }
  void bind(int64_t value, const char* by) {
    value_ = value;
    bound_by_ = by;
  }

 private:
  const char* name_;
  int64_t value_ = -1;
  const char* bound_by_ = "";
};

/*! \brief The device every tensor of one call must share; bound on first use. */
class SymbolicDevice {
 public:
  explicit SymbolicDevice(int32_t required_type) : required_type_(required_type) {}
  int32_t required_type() const { return required_type_; }
  bool bound() const { return bound_; }
  DLDevice value() const { return device_; }
  const char* bound_by() const { return bound_by_; }
  void bind(DLDevice device, const char* by) {  // (an argument name: see SymbolicSize)
    device_ = device;
    bound_ = true;
    bound_by_ = by;
  }

 private:
  int32_t required_type_;
  DLDevice device_{};
  bool bound_ = false;
  const char* bound_by_ = "";
};

/*! \brief One expected dimension: a fixed extent or a symbolic size. */
class Dim {
 public:
  Dim() = default;
  Dim(int64_t fixed) : fixed_(fixed) {}  // NOLINT(google-explicit-constructor)
  Dim(int fixed) : fixed_(fixed) {}      // NOLINT(google-explicit-constructor)
  Dim(SymbolicSize& symbol) : symbol_(&symbol) {}  // NOLINT(google-explicit-constructor)
  SymbolicSize* symbol() const { return symbol_; }
  int64_t fixed() const { return fixed_; }

 private:
  int64_t fixed_ = -1;
  SymbolicSize* symbol_ = nullptr;
};

/*!
 * \brief Declarative checks of dtype, device, rank, extents and layout.
 *
 *   TensorMatcher(kFn, {num_tokens}).dtype<int64_t>().device(dev).verify(input_ids, "input_ids");
 */
class TensorMatcher {
 public:
  // (the dims are held inline, no std::vector: a matcher is built for every tensor of every export call)
  TensorMatcher(const char* fn, std::initializer_list<Dim> dims) : fn_(fn), rank_(dims.size()) {
    if (dims.size() > kMaxRank) {
      TVM_FFI_THROW(InternalError) << fn << ": a TensorMatcher of rank " << dims.size() << " (at most " << kMaxRank
                                   << ")";
    }
    std::copy(dims.begin(), dims.end(), dims_.begin());
  }

  template <typename T>
  TensorMatcher& dtype() {
    dtype_ = dtype_of<T>();
    has_dtype_ = true;
    return *this;
  }
  TensorMatcher& device(SymbolicDevice& device) {
    device_ = &device;
    return *this;
  }
  TensorMatcher& on_cpu() {
    cpu_only_ = true;
    return *this;
  }
  /*! \brief Only the last dimension must be unit-stride (2-D views into larger buffers). */
  TensorMatcher& inner_contiguous() {
    inner_contiguous_only_ = true;
    return *this;
  }

  KVCANARY_OUT_OF_LINE const TensorMatcher& verify(const TensorView& t, const char* arg) const {
    check_dtype(t, arg);
    check_device(t, arg);
    check_shape(t, arg);
    check_layout(t, arg);
    return *this;
  }

 private:
  std::string expected_shape_string() const {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < rank_; ++i) {
      os << (i ? ", " : "");
      const Dim& d = dims_[i];
      if (d.symbol() == nullptr) {
        os << d.fixed();
      } else if (d.symbol()->bound()) {
        os << d.symbol()->name() << "=" << d.symbol()->value();
      } else {
        os << d.symbol()->name();
      }
    }
    os << "]";
    return os.str();
  }

  void check_dtype(const TensorView& t, const char* arg) const {
    if (!has_dtype_) return;
    KVCANARY_CHECK_ARG(same_dtype(t.dtype(), dtype_), TypeError, fn_, arg)
        << "expected dtype " << dtype_ << ", got " << t.dtype();
  }

  void check_device(const TensorView& t, const char* arg) const {
    const DLDevice got = t.device();
    if (cpu_only_) {
      KVCANARY_CHECK_ARG(got.device_type == kDLCPU, ValueError, fn_, arg)
          << "expected device cpu (a host-side table), got " << device_name(got);
      return;
    }
    if (device_ == nullptr) return;
    KVCANARY_CHECK_ARG(got.device_type == device_->required_type(), ValueError, fn_, arg)
        << "expected device " << device_type_name(device_->required_type()) << " (this is the "
        << device_type_name(device_->required_type()) << " build of kvcanary), got " << device_name(got);
    if (!device_->bound()) {
      device_->bind(got, arg);
      return;
    }
    const DLDevice want = device_->value();
    KVCANARY_CHECK_ARG(got.device_id == want.device_id, ValueError, fn_, arg)
        << "expected device " << device_name(want) << " (bound by " << device_->bound_by() << "), got "
        << device_name(got);
  }

  void check_shape(const TensorView& t, const char* arg) const {
    const int64_t rank = static_cast<int64_t>(rank_);
    KVCANARY_CHECK_ARG(t.ndim() == rank, ValueError, fn_, arg)
        << "expected a " << rank << "-d tensor " << expected_shape_string() << ", got shape "
        << shape_string(t);
    for (int32_t i = 0; i < t.ndim(); ++i) {
      const Dim& d = dims_[i];
      const int64_t got = t.size(i);
      if (d.symbol() == nullptr) {
        KVCANARY_CHECK_ARG(got == d.fixed(), ValueError, fn_, arg)
            << "expected shape " << expected_shape_string() << ", got " << shape_string(t);
        continue;
      }
      SymbolicSize& s = *d.symbol();
      if (!s.bound()) {
        s.bind(got, arg);
        continue;
      }
      KVCANARY_CHECK_ARG(got == s.value(), ValueError, fn_, arg)
          << "expected shape " << expected_shape_string() << ", got " << shape_string(t) << " ("
          << s.name() << "=" << s.value() << " bound by " << s.bound_by() << ")";
    }
  }

  void check_layout(const TensorView& t, const char* arg) const {
    if (inner_contiguous_only_) {
      const int32_t last = t.ndim() - 1;
      KVCANARY_CHECK_ARG(t.size(last) <= 1 || stride_of(t, last) == 1, ValueError, fn_, arg)
          << "expected a unit stride in the last dimension, got stride " << stride_of(t, last);
      return;
    }
    int64_t numel = 1;
    for (int32_t i = 0; i < t.ndim(); ++i) numel *= t.size(i);
    if (numel == 0) return;  // no element is ever addressed, whatever the strides say
    KVCANARY_CHECK_ARG(t.IsContiguous(), ValueError, fn_, arg)
        << "expected a contiguous tensor, got shape " << shape_string(t) << " with non-compact strides";
  }

  static constexpr size_t kMaxRank = 4;
  const char* fn_;
  std::array<Dim, kMaxRank> dims_{};
  size_t rank_;
  DLDataType dtype_{};
  bool has_dtype_ = false;
  SymbolicDevice* device_ = nullptr;
  bool cpu_only_ = false;
  bool inner_contiguous_only_ = false;
};

}  // namespace host
}  // namespace kvcanary

#endif  // KVCANARY_TENSOR_CHECK_H_
