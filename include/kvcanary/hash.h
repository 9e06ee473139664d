/*!
 * \file kvcanary/hash.h
 * \brief splitmix64, mix3 and the chain hash of a record (SPEC §2). All arithmetic is mod 2^64.
 */
#ifndef KVCANARY_HASH_H_
#define KVCANARY_HASH_H_

#include <cstdint>

#include "kvcanary/layout.h"
#include "kvcanary/macros.h"

namespace kvcanary {

/*! \brief The splitmix64 finaliser (no golden-ratio increment). */
KVCANARY_HD uint64_t splitmix64(uint64_t x) {
  x ^= x >> kSplitmixShift1;
  x *= kSplitmixMul1;
  x ^= x >> kSplitmixShift2;
  x *= kSplitmixMul2;
  x ^= x >> kSplitmixShift3;
  return x;
}

/*! \brief mix3(a, b, c) = splitmix64(splitmix64(splitmix64(a) ^ b) ^ c). */
KVCANARY_HD uint64_t mix3(uint64_t a, uint64_t b, uint64_t c) {
  uint64_t h = splitmix64(a);
  h = splitmix64(h ^ b);
  return splitmix64(h ^ c);
}

/*! \brief prev_hash that a chain head (logical position 0) must store. */
KVCANARY_HD uint64_t chain_head_hash() { return splitmix64(kChainAnchor); }

/*! \brief One chain step: the hash a successor of (prev_hash, token, position) must store. */
KVCANARY_HD uint64_t chain_step(uint64_t prev_hash, int64_t token, int64_t position) {
  return mix3(prev_hash, static_cast<uint64_t>(token), static_cast<uint64_t>(position));
}

}  // namespace kvcanary

#endif  // KVCANARY_HASH_H_
