/*!
 * \file kvcanary/real_kv.h
 * \brief Fingerprint of a slot's real KV bytes over up to four sources (SPEC §2).
 *
 * Slot s of a source lives at row s / page_size, byte column (s % page_size) * num_bytes_per_token;
 * rows are `row_stride_bytes` apart. For each source with read_bytes > 0, in order: acc = 0; for each
 * 16-byte step (lo, hi): acc = splitmix64(acc ^ lo), acc = splitmix64(acc ^ hi); then
 * total = splitmix64(total ^ acc). NONE → 0, PARTIAL → first 16 bytes, ALL → read_bytes.
 * The host wrapper proves alignment and that every source covers every canary slot, so any slot in
 * [0, num_slots) is in bounds here.
 */
#ifndef KVCANARY_REAL_KV_H_
#define KVCANARY_REAL_KV_H_

#include <cstdint>

#include "kvcanary/hash.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/memory.h"

namespace kvcanary {

/*! \brief One validated source: a 2-D byte view plus its (page_size, bytes/token, read_bytes). */
struct RealKvSource {
  const uint8_t* data;
  int64_t row_stride_bytes;
  int32_t page_size;
  int32_t num_bytes_per_token;
  int32_t read_bytes;
};

/*! \brief The sources of one launch and the hash mode. */
struct RealKvSources {
  RealKvSource source[kMaxRealKvSources];
  int32_t num_sources;
  RealKvHashMode mode;
};

/*! \brief First byte of `slot` in `src`. */
KVCANARY_HD const uint8_t* real_kv_slot_bytes(const RealKvSource& src, int64_t slot) {
  const int64_t row = slot / src.page_size;
  const int64_t col = (slot % src.page_size) * static_cast<int64_t>(src.num_bytes_per_token);
  return src.data + row * src.row_stride_bytes + col;
}

/*! \brief Fold `num_bytes` (a multiple of 16) starting at `p` into a fresh per-source accumulator. */
KVCANARY_HD uint64_t fold_source_bytes(const uint8_t* p, int32_t num_bytes) {
  uint64_t acc = 0;
  for (int32_t off = 0; off < num_bytes; off += kRealKvAlignBytes) {
    const Word128 w = load_word128(p + off);
    acc = splitmix64(acc ^ w.lo);
    acc = splitmix64(acc ^ w.hi);
  }
  return acc;
}

/*! \brief Bytes of one source read per slot in `mode`. */
KVCANARY_HD int32_t real_kv_bytes_to_read(const RealKvSource& src, RealKvHashMode mode) {
  if (mode == RealKvHashMode::kPartial) {
    return src.read_bytes < kRealKvPartialBytes ? src.read_bytes : kRealKvPartialBytes;
  }
  return mode == RealKvHashMode::kAll ? src.read_bytes : 0;
}

/*! \brief The real_kv_hash of `slot` (0 in mode NONE or with no sources). */
KVCANARY_HD uint64_t real_kv_fingerprint(const RealKvSources& sources, int64_t slot) {
  if (sources.mode == RealKvHashMode::kNone) {
    return 0;
  }
  uint64_t total = 0;
  for (int32_t s = 0; s < sources.num_sources; ++s) {
    const RealKvSource& src = sources.source[s];
    const int32_t num_bytes = real_kv_bytes_to_read(src, sources.mode);
    if (num_bytes <= 0) {
      continue;
    }
    total = splitmix64(total ^ fold_source_bytes(real_kv_slot_bytes(src, slot), num_bytes));
  }
  return total;
}

}  // namespace kvcanary

#endif  // KVCANARY_REAL_KV_H_
