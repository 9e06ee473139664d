/*!
 * \file kvcanary/memory.h
 * \brief Loads and stores of canary records and 16-byte KV words, for both backends.
 *
 * Host code goes through memcpy (no alignment or aliasing assumptions). Device code uses 16-byte
 * vector loads where the host wrapper proved 16-byte alignment, and bytewise copies otherwise.
 */
#ifndef KVCANARY_MEMORY_H_
#define KVCANARY_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvcanary/layout.h"
#include "kvcanary/macros.h"

namespace kvcanary {

/*! \brief The four int64 fields of one canary record, in layout order. */
struct CanaryRecord {
  int64_t token;
  int64_t position;
  int64_t prev_hash;
  int64_t real_kv_hash;
};
static_assert(sizeof(CanaryRecord) == kRecordBytes, "record layout");
static_assert(offsetof(CanaryRecord, token) == kRecordFieldToken * kRecordFieldBytes, "token offset");
static_assert(offsetof(CanaryRecord, position) == kRecordFieldPosition * kRecordFieldBytes, "position offset");
static_assert(offsetof(CanaryRecord, prev_hash) == kRecordFieldPrevHash * kRecordFieldBytes, "prev offset");
static_assert(offsetof(CanaryRecord, real_kv_hash) == kRecordFieldRealKvHash * kRecordFieldBytes, "kv offset");

/*! \brief Two little-endian u64 words of one 16-byte KV step. */
struct Word128 {
  uint64_t lo;
  uint64_t hi;
};

/*!
 * \brief Load the record at `row` (a pointer to the slot's first byte).
 * \param row[in] slot base; `aligned16` says the host proved 16-byte alignment of every record, which
 *        lets device code use two 16-byte loads; otherwise (odd strides) it falls back to bytewise copies.
 */
KVCANARY_HD CanaryRecord load_record(const uint8_t* row, bool aligned16) {
  CanaryRecord r;
#if KVCANARY_DEVICE_CODE
  if (aligned16) {
    const longlong2 a = *reinterpret_cast<const longlong2*>(row);
    const longlong2 b = *reinterpret_cast<const longlong2*>(row + 2 * kRecordFieldBytes);
    r.token = a.x;
    r.position = a.y;
    r.prev_hash = b.x;
    r.real_kv_hash = b.y;
    return r;
  }
#endif
  (void)aligned16;
  std::memcpy(&r, row, sizeof(r));
  return r;
}

/*! \brief Store a full record at `row` (same alignment contract as load_record). */
KVCANARY_HD void store_record(uint8_t* row, const CanaryRecord& r, bool aligned16) {
#if KVCANARY_DEVICE_CODE
  if (aligned16) {
    *reinterpret_cast<longlong2*>(row) = make_longlong2(r.token, r.position);
    *reinterpret_cast<longlong2*>(row + 2 * kRecordFieldBytes) = make_longlong2(r.prev_hash, r.real_kv_hash);
    return;
  }
#endif
  (void)aligned16;
  std::memcpy(row, &r, sizeof(r));
}

/*! \brief Store the payload fields (token, position, real_kv_hash) of a record; prev_hash untouched. */
KVCANARY_HD void store_record_payload(uint8_t* row, int64_t token, int64_t position, int64_t real_kv_hash,
                                      bool aligned16) {
#if KVCANARY_DEVICE_CODE
  if (aligned16) {
    *reinterpret_cast<longlong2*>(row) = make_longlong2(token, position);
    *reinterpret_cast<int64_t*>(row + kRecordFieldRealKvHash * kRecordFieldBytes) = real_kv_hash;
    return;
  }
#endif
  (void)aligned16;
  std::memcpy(row + kRecordFieldToken * kRecordFieldBytes, &token, sizeof(token));
  std::memcpy(row + kRecordFieldPosition * kRecordFieldBytes, &position, sizeof(position));
  std::memcpy(row + kRecordFieldRealKvHash * kRecordFieldBytes, &real_kv_hash, sizeof(real_kv_hash));
}

/*! \brief Store the prev_hash field of a record; the other fields untouched. */
KVCANARY_HD void store_record_prev_hash(uint8_t* row, int64_t prev_hash, bool aligned16) {
#if KVCANARY_DEVICE_CODE
  if (aligned16) {
    *reinterpret_cast<int64_t*>(row + kRecordFieldPrevHash * kRecordFieldBytes) = prev_hash;
    return;
  }
#endif
  (void)aligned16;
  std::memcpy(row + kRecordFieldPrevHash * kRecordFieldBytes, &prev_hash, sizeof(prev_hash));
}

/*! \brief Load a record that no thread of the running kernel writes (read-only data path on device). */
KVCANARY_HD CanaryRecord load_record_readonly(const uint8_t* row, bool aligned16) {
#if KVCANARY_DEVICE_CODE
  if (aligned16) {
    const longlong2 a = __ldg(reinterpret_cast<const longlong2*>(row));
    const longlong2 b = __ldg(reinterpret_cast<const longlong2*>(row + 2 * kRecordFieldBytes));
    CanaryRecord r;
    r.token = a.x;
    r.position = a.y;
    r.prev_hash = b.x;
    r.real_kv_hash = b.y;
    return r;
  }
#endif
  return load_record(row, aligned16);
}

/*! \brief Load 16 KV bytes; `p` is 16-byte aligned (checked by the host wrapper). */
KVCANARY_HD Word128 load_word128(const uint8_t* p) {
  Word128 w;
#if KVCANARY_DEVICE_CODE
  const ulonglong2 v = __ldg(reinterpret_cast<const ulonglong2*>(p));
  w.lo = v.x;
  w.hi = v.y;
#else
  std::memcpy(&w, p, sizeof(w));
#endif
  return w;
}

}  // namespace kvcanary

#endif  // KVCANARY_MEMORY_H_
