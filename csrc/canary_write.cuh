/*!
 * \file canary_write.cuh
 * \brief canary_write_step: store the shadow record of every KV slot a forward filled (SPEC §4.1).
 *
 * Computes, per request r < min(write_num_valid_reqs, capacity), over entries e in
 * [write_offsets[r], write_offsets[r+1]) in order: slot = out_cache_loc[e] (< 0 → skipped, no state
 * change); record (input_ids[e], positions[e], running, real_kv_hash(slot)) stored at the slot; then
 * running = mix3(running, token, position). running starts at H(seed slot), or at the anchor hash
 * for seed -1. Optional input assert (token/position vs expected arrays) and chain-position assert
 * (position == previous position + 1; active iff seed >= 0 and the device flag is 1).
 *
 * Grid:  CUDA: max(capacity, 1) blocks, one per request. CPU: one loop over requests.
 * Block: kWriteThreadsPerBlock threads. A record splits into the chain field (prev_hash), which
 *        depends on every earlier entry, and the payload (token, position, real_kv_hash), which does
 *        not. Warp 0 is the chain warp: per 32-entry chunk each lane loads its entry (the next chunk
 *        is prefetched), all lanes walk the chunk's chain steps in order (warp-uniform; a chunk
 *        without skips reads its inputs from a shared-memory stage, see ChainWalk) and take the hash
 *        before their own entry, then they run the asserts and store prev_hash. The other warps store
 *        payloads (loads, real-KV folds, stores) for all entries in parallel, so their memory latency
 *        never stalls the serial chain.
 * Reads:  plan arrays, token arrays, the seed record, real-KV bytes of written slots.
 * Writes: records of written slots, violation rows, slot_run_counter (one atomic per request with
 *         work), kernel_run_counter (+1 per launch, by block 0, even with no work).
 * Bounds (kvcanary+, reason kReasonSlotOutOfRange, expected_aux = the offending index):
 *   - slot >= num_slots: row (slot, position, token, token, running, slot); record not stored, not
 *     counted; the chain still advances on the actual token/position.
 *   - seed < -1 or seed >= num_slots: row (seed, -1, -1, -1, anchor hash, seed); the chain starts at
 *     the anchor with the chain-position assert off.
 *   - an entry range outside [0, num_tokens]: row (-1, -1, -1, -1, r, offending offset); the
 *     request is skipped. A range with begin > end is empty, as in the seed.
 * Aliasing: the slots one launch writes must be distinct and must not be a seed of the same launch
 *   (an engine writes each KV slot once per forward); otherwise which record wins is unspecified.
 * ABI: argument for argument the seed kernel's (sglang canary_write.cuh), so its order is fixed:
 *      destination (canary_buf) first, then plan, inputs, sinks, real-KV sources.
 * kvcanary+ (canary_write_step_attributed: the seed's arguments, then five optional ones; absent = off):
 *   - violation_meta [ring_capacity, kViolationMetaFields], forward_step [1]: each violation row also
 *     gets a metadata row (forward_step's value, the request's row, the slot's previous attribution);
 *   - write_request_rows [write_req_capacity]: request r's req_to_token row (the plan writes it);
 *   - slot_attribution [num_slots, kSlotAttributionFields]: every stored record also stores
 *     (forward_step's value, row_serials[request row]) there — by the thread that stores prev_hash, right
 *     after it read the slot's previous attribution for a violation row;
 *   - row_serials [serial_rows]: the writer serial of each req_to_token row (needs write_request_rows).
 *   The 32-byte records, the ring and the counters are bit-exact with the seed call whatever is given.
 */
#pragma once

#include <tvm/ffi/function.h>

#include <cstdint>
#include <utility>

#include "bound_args.cuh"
#include "kvcanary/atomics.h"
#include "kvcanary/hash.h"
#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/memory.h"
#include "kvcanary/real_kv.h"
#include "kvcanary/tensor_check.h"
#include "kvcanary/violation.h"
#include "meta_args.cuh"
#include "real_kv_args.cuh"

namespace kvcanary {

constexpr uint32_t kWarpSize = 32;
constexpr uint32_t kWriteWarpsPerBlock = 4;  // 1 chain warp + 3 payload warps
constexpr uint32_t kWriteThreadsPerBlock = kWarpSize * kWriteWarpsPerBlock;
constexpr uint32_t kWriteChainWarp = 0;

struct WriteParams {
  uint8_t* canary_buf;
  int64_t slot_stride_bytes;
  int64_t num_slots;
  bool records_aligned16;

  const int64_t* write_offsets;
  const int64_t* write_seed_slot_indices;
  const int32_t* write_num_valid_reqs;
  int32_t write_req_capacity;

  const int64_t* input_ids;
  const int64_t* positions;
  const int64_t* out_cache_loc;
  int64_t num_tokens;

  const int64_t* expected_input_tokens;     // nullptr when the input assert is off
  const int64_t* expected_input_positions;  // nullptr when the input assert is off

  ViolationSink sink;
  int64_t* slot_run_counter;
  int64_t* kernel_run_counter;
  const int32_t* enable_chain_position_assert;

  RealKvSources sources;

  // kvcanary+ attribution (nullptr: off)
  const int64_t* write_request_rows;  // [write_req_capacity]
  int64_t* slot_attribution;          // [num_slots, kSlotAttributionFields]
  const int64_t* row_serials;         // [serial_rows]
  int64_t serial_rows;
};

/*! \brief Chain state at the start of one request's entries, and who writes them. */
struct WriteRequestStart {
  int64_t begin;
  int64_t end;  // begin >= end: nothing to do
  uint64_t running;
  int64_t prev_position;
  bool chain_assert;
  int64_t request_row;    // req_to_token row of the request (kMetaUnknown without write_request_rows)
  int64_t writer_serial;  // row_serials[request_row] (kMetaUnknown when not known)
  int64_t step;           // the forward counter, when the records' attribution is stored
};

KVCANARY_HD int32_t active_write_requests(const WriteParams& p) {
  const int32_t n = *p.write_num_valid_reqs;
  if (n < 0) return 0;
  return n < p.write_req_capacity ? n : p.write_req_capacity;
}

KVCANARY_HD uint8_t* record_row(uint8_t* buf, int64_t slot, int64_t stride) { return buf + slot * stride; }

/*!
 * \brief Read request r's range and seed; report (once, when `reporter`) a bad range or seed.
 */
KVCANARY_HD WriteRequestStart begin_write_request(const WriteParams& p, int64_t r, bool reporter) {
  WriteRequestStart st{};
  st.begin = p.write_offsets[r];
  st.end = p.write_offsets[r + 1];
  st.running = chain_head_hash();
  st.prev_position = 0;
  st.chain_assert = false;
  st.request_row = p.write_request_rows != nullptr ? p.write_request_rows[r] : kMetaUnknown;
  st.writer_serial = kMetaUnknown;
  st.step = kMetaUnknown;
  if (st.begin >= st.end) {
    st.end = st.begin;
    return st;
  }
  if (st.begin < 0 || st.end > p.num_tokens) {
    if (reporter) {
      const int64_t offending = st.begin < 0 ? st.begin : st.end;
      record_violation(p.sink,
                       ViolationRow{kSkipWriteSlot, -1, -1, kNoExpectedToken, r, offending, kReasonSlotOutOfRange},
                       ViolationMeta{st.request_row, kMetaUnknown, kMetaUnknown});
    }
    st.end = st.begin;
    return st;
  }
  if (p.slot_attribution != nullptr) {
    st.step = p.sink.forward_step != nullptr ? *p.sink.forward_step : kMetaUnknown;
    if (p.row_serials != nullptr && st.request_row >= 0 && st.request_row < p.serial_rows) {
      st.writer_serial = p.row_serials[st.request_row];
    }
  }
  const int64_t seed = p.write_seed_slot_indices[r];
  if (seed == kChainHeadSlot) {
    return st;
  }
  if (seed < 0 || seed >= p.num_slots) {
    if (reporter) {
      record_violation(p.sink,
                       ViolationRow{seed, -1, -1, kNoExpectedToken, static_cast<int64_t>(st.running), seed,
                                    kReasonSlotOutOfRange},
                       ViolationMeta{st.request_row, kMetaUnknown, kMetaUnknown});
    }
    return st;
  }
  const CanaryRecord seed_record =
      load_record(record_row(p.canary_buf, seed, p.slot_stride_bytes), p.records_aligned16);
  st.running = chain_step(static_cast<uint64_t>(seed_record.prev_hash), seed_record.token, seed_record.position);
  st.chain_assert = *p.enable_chain_position_assert != 0;
  st.prev_position = seed_record.position;
  return st;
}

/*! \brief Whether a non-skipped entry's record is stored (its slot lies inside the buffer). */
KVCANARY_HD bool write_slot_in_range(const WriteParams& p, int64_t slot) { return slot >= 0 && slot < p.num_slots; }

/*! \brief Metadata of a write row about `slot`: the request's row and the slot's attribution before this write. */
KVCANARY_HD ViolationMeta write_row_meta(const WriteParams& p, const WriteRequestStart& st, int64_t slot) {
  if (!write_slot_in_range(p, slot)) {
    return ViolationMeta{st.request_row, kMetaUnknown, kMetaUnknown};
  }
  return attributed_violation_meta(p.slot_attribution, slot, st.request_row);
}

/*!
 * \brief The chain half of one non-skipped entry (slot >= 0): asserts, the out-of-range report and
 *        the prev_hash field (and the slot's attribution), given the chain state before the entry.
 * \return 1 if the slot's record is stored (counted in slot_run_counter), else 0.
 */
KVCANARY_HD int64_t write_entry_chain(const WriteParams& p, const WriteRequestStart& st, int64_t e, int64_t slot,
                                      int64_t token, int64_t position, uint64_t running, int64_t prev_position) {
  const int64_t running_signed = static_cast<int64_t>(running);
  if (p.expected_input_tokens != nullptr) {
    const int64_t expected_token = p.expected_input_tokens[e];
    const int64_t expected_position = p.expected_input_positions[e];
    int64_t bits = 0;
    if (token != expected_token) bits |= kReasonWriteToken;
    if (position != expected_position) bits |= kReasonWritePosition;
    if (bits != 0) {
      record_violation(p.sink,
                       ViolationRow{slot, position, token, expected_token, running_signed, expected_position, bits},
                       write_row_meta(p, st, slot));
    }
  }
  if (st.chain_assert && position != prev_position + 1) {
    record_violation(p.sink,
                     ViolationRow{slot, position, token, token, running_signed, prev_position + 1,
                                  kReasonWritePosition},
                     write_row_meta(p, st, slot));
  }
  if (!write_slot_in_range(p, slot)) {
    record_violation(p.sink, ViolationRow{slot, position, token, token, running_signed, slot, kReasonSlotOutOfRange},
                     write_row_meta(p, st, slot));
    return 0;
  }
  store_record_prev_hash(record_row(p.canary_buf, slot, p.slot_stride_bytes), running_signed, p.records_aligned16);
  if (p.slot_attribution != nullptr) {
    int64_t* a = p.slot_attribution + slot * kSlotAttributionFields;
    a[kSlotAttributionColWrittenStep] = st.step;
    a[kSlotAttributionColWriterSerial] = st.writer_serial;
  }
  return 1;
}

/*! \brief The payload half of entry e: token, position and real-KV fingerprint, if its slot is in range. */
KVCANARY_HD void write_entry_payload(const WriteParams& p, int64_t e) {
  const int64_t slot = p.out_cache_loc[e];
  if (!write_slot_in_range(p, slot)) {
    return;
  }
  store_record_payload(record_row(p.canary_buf, slot, p.slot_stride_bytes), p.input_ids[e], p.positions[e],
                       static_cast<int64_t>(real_kv_fingerprint(p.sources, slot)), p.records_aligned16);
}

/*!
 * \brief Request r's whole write by one thread: each entry's chain half and payload, in order, then the request's
 * stored count added to slot_run_counter (one atomic). The CPU write's loop body, and the deferred write a check
 * launch runs before it verifies (canary_check.cuh): one thread per request, meant for a decode's one entry each.
 */
KVCANARY_HD void write_request_serial(const WriteParams& p, int64_t r) {
  const WriteRequestStart st = begin_write_request(p, r, /*reporter=*/true);
  uint64_t running = st.running;
  int64_t prev_position = st.prev_position;
  int64_t stored = 0;
  for (int64_t e = st.begin; e < st.end; ++e) {
    const int64_t slot = p.out_cache_loc[e];
    if (slot < 0) continue;
    const int64_t token = p.input_ids[e];
    const int64_t position = p.positions[e];
    stored += write_entry_chain(p, st, e, slot, token, position, running, prev_position);
    write_entry_payload(p, e);
    running = chain_step(running, token, position);
    prev_position = position;
  }
  if (stored > 0) atomic_add_i64(p.slot_run_counter, stored);
}

#if KVCANARY_DEVICE_BUILD

constexpr unsigned kFullWarpMask = 0xffffffffu;

/*!
 * \brief How the chain warp walks a chunk of 32 entries without skips (chunks with skips and the short
 *        tail always take the shuffle walk with selects). benchmarks/bench_chain_variants.py times both.
 *
 * kSharedStage: the lanes stage their (token, position) in shared memory, every lane walks all 32 steps
 *   reading the pair with one uniform-address 16-byte load, and lane 0 parks the hash before each step
 *   in shared memory (one store). Per step: the chain's integer work (the one-thread floor's, in vector
 *   registers) plus two memory-pipe instructions, whose latency is hidden because they do not depend on
 *   the chain (the loads) or nothing waits for them (the stores): the integer pipes, the chain's
 *   bottleneck, carry nothing else. The previous position of each lane is one shuffle per chunk.
 * kShuffle (before issue 15): per step four 32-bit shuffles broadcast lane j's token and position, and
 *   four selects (integer pipe) keep the hash and previous position before a lane's own entry.
 * Why not the floor itself: the one-thread floor runs on the uniform datapath (UIMAD/USHF: ptxas proves
 * the hash warp-uniform because its inputs are loop counters); ptxas keeps a hash fed by per-entry data in
 * vector registers whatever the broadcast (shuffle, shared memory, global load, redux), and the vector
 * 64-bit multiply is longer (see benchmarks/bench_chain_variants.py, "floor, vector registers").
 */
enum class ChainWalk : int { kShuffle = 0, kSharedStage = 1 };
#ifndef KVCANARY_WRITE_CHAIN_WALK
#define KVCANARY_WRITE_CHAIN_WALK 1
#endif
constexpr ChainWalk kWriteChainWalk = static_cast<ChainWalk>(KVCANARY_WRITE_CHAIN_WALK);
#ifndef KVCANARY_WRITE_CHAIN_UNROLL
#define KVCANARY_WRITE_CHAIN_UNROLL 8
#endif
constexpr uint32_t kChainStageUnroll = KVCANARY_WRITE_CHAIN_UNROLL;  // steps per iteration of the staged walk
static_assert(kWarpSize % kChainStageUnroll == 0, "KVCANARY_WRITE_CHAIN_UNROLL must divide 32");
static_assert(kWriteChainWalk == ChainWalk::kShuffle || kWriteChainWalk == ChainWalk::kSharedStage,
              "KVCANARY_WRITE_CHAIN_WALK must be 0 (shuffle) or 1 (shared-memory stage)");

/*! \brief Shared memory of the chain warp (kSharedStage): one chunk's inputs and the hash before each entry. */
struct ChainStage {
  longlong2 entry[kWarpSize];  // (token, position) of lane j's entry
  uint64_t before[kWarpSize];  // the running hash before entry j
};

/*! \brief Chain state after the last walked entry, and what lane `lane` needs for its own entry. */
struct ChunkWalk {
  uint64_t running;        // after the chunk
  int64_t prev_position;   // position of the chunk's last walked entry
  uint64_t my_running;     // before this lane's entry
  int64_t my_prev_position;  // position of the walked entry before this lane's
};

/*!
 * \brief Walk a full chunk (32 entries, none skipped) through shared memory (kSharedStage).
 * Every lane computes the same chain (the hash is warp-uniform); only the inputs come from memory.
 */
__device__ __forceinline__ ChunkWalk walk_full_chunk_staged(ChainStage& stage, uint32_t lane, uint64_t running,
                                                            int64_t prev_position, int64_t token, int64_t position) {
  stage.entry[lane] = make_longlong2(token, position);
  __syncwarp();
  // Unrolled by kChainStageUnroll steps: a fully unrolled chunk is ~2000 instructions (~32 KB), more than the
  // L0 instruction cache, while 8 steps fit; the loads take immediate offsets from one base either way.
#pragma unroll 1
  for (uint32_t j0 = 0; j0 < kWarpSize; j0 += kChainStageUnroll) {
#pragma unroll
    for (uint32_t j = j0; j < j0 + kChainStageUnroll; ++j) {
      const longlong2 in = stage.entry[j];
      if (lane == 0) stage.before[j] = running;
      running = chain_step(running, in.x, in.y);
    }
  }
  __syncwarp();
  ChunkWalk w;
  w.running = running;
  w.my_running = stage.before[lane];
  const int64_t previous_lane_position = __shfl_up_sync(kFullWarpMask, position, 1);
  w.my_prev_position = lane == 0 ? prev_position : previous_lane_position;
  w.prev_position = __shfl_sync(kFullWarpMask, position, kWarpSize - 1);
  // No barrier here: the next staged chunk writes `entry` (read only before the barrier above) and, after its
  // own first barrier, which every lane reaches after reading `before` here, `before`.
  return w;
}

/*! \brief Walk a full chunk (32 entries, none skipped) with shuffles and selects (kShuffle). */
__device__ __forceinline__ ChunkWalk walk_full_chunk_shuffled(uint32_t lane, uint64_t running, int64_t prev_position,
                                                              int64_t token, int64_t position) {
  ChunkWalk w;
  w.my_running = running;
  w.my_prev_position = prev_position;
#pragma unroll
  for (uint32_t j = 0; j < kWarpSize; ++j) {
    const int64_t token_j = __shfl_sync(kFullWarpMask, token, j);
    const int64_t position_j = __shfl_sync(kFullWarpMask, position, j);
    w.my_running = lane == j ? running : w.my_running;
    w.my_prev_position = lane == j ? prev_position : w.my_prev_position;
    running = chain_step(running, token_j, position_j);
    prev_position = position_j;
  }
  w.running = running;
  w.prev_position = prev_position;
  return w;
}

/*!
 * \brief Walk a chunk with skipped entries or fewer than 32 entries (`remaining` from `chunk` on):
 *        shuffles and selects; a skipped entry leaves the chain unchanged.
 */
__device__ __forceinline__ ChunkWalk walk_partial_chunk(uint32_t lane, uint64_t running, int64_t prev_position,
                                                        int64_t slot, int64_t token, int64_t position,
                                                        int64_t remaining) {
  ChunkWalk w;
  w.my_running = running;
  w.my_prev_position = prev_position;
  const uint32_t steps = remaining < kWarpSize ? static_cast<uint32_t>(remaining) : kWarpSize;
#pragma unroll 8
  for (uint32_t j = 0; j < steps; ++j) {
    const int64_t slot_j = __shfl_sync(kFullWarpMask, slot, j);
    const int64_t token_j = __shfl_sync(kFullWarpMask, token, j);
    const int64_t position_j = __shfl_sync(kFullWarpMask, position, j);
    w.my_running = lane == j ? running : w.my_running;
    w.my_prev_position = lane == j ? prev_position : w.my_prev_position;
    const uint64_t next = chain_step(running, token_j, position_j);
    running = slot_j >= 0 ? next : running;
    prev_position = slot_j >= 0 ? position_j : prev_position;
  }
  w.running = running;
  w.prev_position = prev_position;
  return w;
}

/*! \brief Chain warp: the serial hash over request r's entries, asserts, prev_hash fields, counter. */
__device__ __forceinline__ void write_request_chain(const WriteParams& p, int64_t r, uint32_t lane,
                                                    ChainStage& stage) {
  const WriteRequestStart st = begin_write_request(p, r, lane == 0);
  uint64_t running = st.running;
  int64_t prev_position = st.prev_position;
  int64_t stored = 0;
  // Software pipeline: the next chunk's loads are in flight while this chunk's chain runs.
  int64_t next_slot = kSkipWriteSlot;
  int64_t next_token = 0;
  int64_t next_position = 0;
  if (st.begin + lane < st.end) {
    next_slot = p.out_cache_loc[st.begin + lane];
    next_token = p.input_ids[st.begin + lane];
    next_position = p.positions[st.begin + lane];
  }
  for (int64_t chunk = st.begin; chunk < st.end; chunk += kWarpSize) {
    const int64_t e = chunk + lane;
    const int64_t slot = next_slot;
    const int64_t token = next_token;
    const int64_t position = next_position;
    const int64_t e_next = e + kWarpSize;
    next_slot = kSkipWriteSlot;
    if (e_next < st.end) {
      next_slot = p.out_cache_loc[e_next];
      next_token = p.input_ids[e_next];
      next_position = p.positions[e_next];
    }
    // A full chunk without skips (the common case) walks 32 steps with no select on the chain.
    ChunkWalk w;
    if (__all_sync(kFullWarpMask, slot >= 0)) {
      if constexpr (kWriteChainWalk == ChainWalk::kSharedStage) {
        w = walk_full_chunk_staged(stage, lane, running, prev_position, token, position);
      } else {
        w = walk_full_chunk_shuffled(lane, running, prev_position, token, position);
      }
    } else {
      w = walk_partial_chunk(lane, running, prev_position, slot, token, position, st.end - chunk);
    }
    running = w.running;
    prev_position = w.prev_position;
    if (slot >= 0) {
      stored += write_entry_chain(p, st, e, slot, token, position, w.my_running, w.my_prev_position);
    }
  }
#pragma unroll
  for (uint32_t offset = kWarpSize / 2; offset > 0; offset /= 2) {
    stored += __shfl_xor_sync(kFullWarpMask, stored, offset);
  }
  if (lane == 0 && stored > 0) {
    atomic_add_i64(p.slot_run_counter, stored);
  }
}

/*! \brief Payload warps: token, position and real-KV fingerprint of every entry, in parallel. */
__device__ __forceinline__ void write_request_payloads(const WriteParams& p, int64_t r, uint32_t thread,
                                                       uint32_t num_threads) {
  const WriteRequestStart st = begin_write_request(p, r, /*reporter=*/false);
  for (int64_t e = st.begin + thread; e < st.end; e += num_threads) {
    write_entry_payload(p, e);
  }
}

KVCANARY_KERNEL void __launch_bounds__(kWriteThreadsPerBlock) canary_write_kernel(const __grid_constant__ WriteParams p) {
  const int64_t r = blockIdx.x;
  const uint32_t warp = threadIdx.x / kWarpSize;
  if (r == 0 && threadIdx.x == 0) {
    atomic_add_i64(p.kernel_run_counter, 1);
  }
  if (r >= active_write_requests(p)) {
    return;  // block-uniform
  }
  __shared__ ChainStage chain_stage;  // used by the chain warp only
  if (warp == kWriteChainWarp) {
    write_request_chain(p, r, threadIdx.x % kWarpSize, chain_stage);
  } else {
    write_request_payloads(p, r, threadIdx.x - kWarpSize, blockDim.x - kWarpSize);
  }
}

#else

inline void canary_write_cpu(const WriteParams& p) {
  atomic_add_i64(p.kernel_run_counter, 1);
  const int32_t active = active_write_requests(p);
  for (int64_t r = 0; r < active; ++r) {
    write_request_serial(p, r);
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*!
 * \brief canary_write_step_attributed's fixed arguments (all but the forward's three token arrays), validated and
 * extracted once: a bound write (canary_write_bind) prepares at binding, so a forward's call checks only its token
 * arrays; the export prepares on every call.
 */
struct WritePrepared {
  WriteParams params;  // every field but the token arrays and num_tokens (write_launch sets those on a copy)
  SymbolicDevice device{KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU};  // bound by canary_buf
  // the input assert's arrays (enable_write_input_assert=1 only): sized by the forward, so checked per call
  tvm::ffi::Optional<TensorView> expected_input_tokens;
  tvm::ffi::Optional<TensorView> expected_input_positions;
};

/*! \brief Validate and extract the write's fixed arguments (this order decides the error a call with several bad
 * arguments gets; the token arrays are checked after them, by write_launch). */
inline WritePrepared write_prepare(
    TensorView canary_buf, TensorView write_offsets, TensorView write_seed_slot_indices,
    TensorView write_num_valid_reqs, int64_t kernel_kind, int64_t enable_write_input_assert,
    tvm::ffi::Optional<TensorView> expected_input_tokens, tvm::ffi::Optional<TensorView> expected_input_positions,
    TensorView violation_ring, TensorView violation_write_index, TensorView slot_run_counter,
    TensorView kernel_run_counter, TensorView enable_chain_position_assert, TensorView real_kv_buf_0,
    TensorView real_kv_buf_1, TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params,
    int64_t num_sources, int64_t real_kv_hash_mode, tvm::ffi::Optional<TensorView> violation_meta,
    tvm::ffi::Optional<TensorView> forward_step, tvm::ffi::Optional<TensorView> write_request_rows,
    tvm::ffi::Optional<TensorView> slot_attribution, tvm::ffi::Optional<TensorView> row_serials) {
  constexpr const char* kFn = "canary_write_step";
  WritePrepared f{};
  SymbolicDevice& device = f.device;
  SymbolicSize num_slots("num_slots");
  SymbolicSize slot_stride("slot_stride_bytes");
  SymbolicSize offsets_len("write_offsets_len");
  SymbolicSize req_capacity("write_req_capacity");
  SymbolicSize ring_capacity("ring_capacity");

  TensorMatcher(kFn, {num_slots, slot_stride}).dtype<uint8_t>().device(device).verify(canary_buf, "canary_buf");
  TensorMatcher(kFn, {offsets_len}).dtype<int64_t>().device(device).verify(write_offsets, "write_offsets");
  TensorMatcher(kFn, {req_capacity})
      .dtype<int64_t>()
      .device(device)
      .verify(write_seed_slot_indices, "write_seed_slot_indices");
  TensorMatcher(kFn, {1}).dtype<int32_t>().device(device).verify(write_num_valid_reqs, "write_num_valid_reqs");
  KVCANARY_CHECK_ARG(enable_write_input_assert == 0 || enable_write_input_assert == 1, ValueError, kFn,
                     "enable_write_input_assert")
      << "must be 0 or 1, got " << enable_write_input_assert;
  const bool input_assert = enable_write_input_assert == 1;
  KVCANARY_CHECK_ARG(expected_input_tokens.has_value() == input_assert, ValueError, kFn, "expected_input_tokens")
      << (input_assert ? "required when enable_write_input_assert=1" : "must be None when enable_write_input_assert=0");
  KVCANARY_CHECK_ARG(expected_input_positions.has_value() == input_assert, ValueError, kFn,
                     "expected_input_positions")
      << (input_assert ? "required when enable_write_input_assert=1" : "must be None when enable_write_input_assert=0");
  f.expected_input_tokens = expected_input_tokens;
  f.expected_input_positions = expected_input_positions;
  TensorMatcher(kFn, {ring_capacity, kViolationFields})
      .dtype<int64_t>()
      .device(device)
      .verify(violation_ring, "violation_ring");
  TensorMatcher(kFn, {1}).dtype<int32_t>().device(device).verify(violation_write_index, "violation_write_index");
  TensorMatcher(kFn, {1}).dtype<int64_t>().device(device).verify(slot_run_counter, "slot_run_counter");
  TensorMatcher(kFn, {1}).dtype<int64_t>().device(device).verify(kernel_run_counter, "kernel_run_counter");
  TensorMatcher(kFn, {1})
      .dtype<int32_t>()
      .device(device)
      .verify(enable_chain_position_assert, "enable_chain_position_assert");

  KVCANARY_CHECK_ARG(slot_stride.value() >= kMinSlotStrideBytes, ValueError, kFn, "canary_buf")
      << "slot_stride_bytes (shape[1]) must be >= " << kMinSlotStrideBytes << ", got " << slot_stride.value();
  KVCANARY_CHECK_ARG(offsets_len.value() == req_capacity.value() + 1, ValueError, kFn, "write_offsets")
      << "expected length write_req_capacity + 1 = " << req_capacity.value() + 1 << " (write_req_capacity="
      << req_capacity.value() << " bound by write_seed_slot_indices), got " << offsets_len.value();
  KVCANARY_CHECK_ARG(req_capacity.value() < INT32_MAX, ValueError, kFn, "write_seed_slot_indices")
      << "write_req_capacity must be < 2^31, got " << req_capacity.value();
  KVCANARY_CHECK_ARG(ring_capacity.value() <= INT32_MAX, ValueError, kFn, "violation_ring")
      << "ring_capacity must be <= 2^31-1, got " << ring_capacity.value();

  const RealKvSources sources =
      pack_real_kv_sources(kFn, device, num_slots.value(), real_kv_buf_0, real_kv_buf_1, real_kv_buf_2,
                           real_kv_buf_3, real_kv_source_params, num_sources, real_kv_hash_mode);
  WriteParams& p = f.params;
  p.slot_attribution =
      pack_violation_meta(kFn, device, ring_capacity, num_slots, violation_meta, forward_step, slot_attribution, p.sink);
  if (write_request_rows.has_value()) {
    TensorMatcher(kFn, {req_capacity})
        .dtype<int64_t>()
        .device(device)
        .verify(write_request_rows.value(), "write_request_rows");
  }
  SymbolicSize serial_rows("serial_rows");
  if (row_serials.has_value()) {
    KVCANARY_CHECK_ARG(write_request_rows.has_value(), ValueError, kFn, "row_serials")
        << "needs write_request_rows (the row of each request)";
    TensorMatcher(kFn, {serial_rows}).dtype<int64_t>().device(device).verify(row_serials.value(), "row_serials");
  }

  p.canary_buf = data_of<uint8_t>(canary_buf);
  p.slot_stride_bytes = slot_stride.value();
  p.num_slots = num_slots.value();
  p.records_aligned16 =
      reinterpret_cast<uintptr_t>(p.canary_buf) % kRealKvAlignBytes == 0 && p.slot_stride_bytes % kRealKvAlignBytes == 0;
  p.write_offsets = data_of<const int64_t>(write_offsets);
  p.write_seed_slot_indices = data_of<const int64_t>(write_seed_slot_indices);
  p.write_num_valid_reqs = data_of<const int32_t>(write_num_valid_reqs);
  p.write_req_capacity = static_cast<int32_t>(req_capacity.value());
  p.sink.ring = data_of<int64_t>(violation_ring);
  p.sink.write_index = data_of<int32_t>(violation_write_index);
  p.sink.capacity = static_cast<int32_t>(ring_capacity.value());
  p.sink.kernel_kind = kernel_kind;
  p.slot_run_counter = data_of<int64_t>(slot_run_counter);
  p.kernel_run_counter = data_of<int64_t>(kernel_run_counter);
  p.enable_chain_position_assert = data_of<const int32_t>(enable_chain_position_assert);
  p.sources = sources;
  p.write_request_rows = optional_data_of<const int64_t>(write_request_rows);
  p.row_serials = optional_data_of<const int64_t>(row_serials);
  p.serial_rows = row_serials.has_value() ? serial_rows.value() : 0;
  return f;
}

/*! \brief One write of a forward's token arrays with prepared fixed arguments: validate them (int64 [num_tokens] on
 * the prepared device; with the input assert, its arrays of the same length), then launch (CUDA) or run (CPU). */
inline void write_launch(const WritePrepared& f, TensorView input_ids, TensorView positions,
                         TensorView out_cache_loc) {
  constexpr const char* kFn = "canary_write_step";
  // 1. validate the token arrays
  SymbolicDevice device = f.device;
  SymbolicSize num_tokens("num_tokens");
  TensorMatcher(kFn, {num_tokens})
      .dtype<int64_t>()
      .device(device)
      .verify(input_ids, "input_ids")
      .verify(positions, "positions")
      .verify(out_cache_loc, "out_cache_loc");
  WriteParams p = f.params;
  if (f.expected_input_tokens.has_value()) {
    TensorMatcher(kFn, {num_tokens})
        .dtype<int64_t>()
        .device(device)
        .verify(f.expected_input_tokens.value(), "expected_input_tokens")
        .verify(f.expected_input_positions.value(), "expected_input_positions");
    p.expected_input_tokens = data_of<const int64_t>(f.expected_input_tokens.value());
    p.expected_input_positions = data_of<const int64_t>(f.expected_input_positions.value());
  }

  // 2. the forward's own parameters
  p.input_ids = data_of<const int64_t>(input_ids);
  p.positions = data_of<const int64_t>(positions);
  p.out_cache_loc = data_of<const int64_t>(out_cache_loc);
  p.num_tokens = num_tokens.value();

#if KVCANARY_DEVICE_BUILD
  // 3. device guard + stream
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = current_stream(dev);
  // 4. launch: grid depends only on the capacity, so the launch is CUDA-graph capturable.
  const int64_t blocks = p.write_req_capacity > 0 ? p.write_req_capacity : 1;
  launch_kernel(canary_write_kernel, static_cast<uint32_t>(blocks), kWriteThreadsPerBlock, stream, p);
#else
  // 3-4. CPU: run the same per-entry semantics in a loop.
  canary_write_cpu(p);
#endif
}

/*! \brief The seed's arguments, then the kvcanary+ attribution arguments (see the file comment). */
inline void canary_write_step_attributed(
    TensorView canary_buf, TensorView write_offsets, TensorView write_seed_slot_indices,
    TensorView write_num_valid_reqs, TensorView input_ids, TensorView positions, TensorView out_cache_loc,
    int64_t kernel_kind, int64_t enable_write_input_assert, tvm::ffi::Optional<TensorView> expected_input_tokens,
    tvm::ffi::Optional<TensorView> expected_input_positions, TensorView violation_ring,
    TensorView violation_write_index, TensorView slot_run_counter, TensorView kernel_run_counter,
    TensorView enable_chain_position_assert, TensorView real_kv_buf_0, TensorView real_kv_buf_1,
    TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params, int64_t num_sources,
    int64_t real_kv_hash_mode, tvm::ffi::Optional<TensorView> violation_meta,
    tvm::ffi::Optional<TensorView> forward_step, tvm::ffi::Optional<TensorView> write_request_rows,
    tvm::ffi::Optional<TensorView> slot_attribution, tvm::ffi::Optional<TensorView> row_serials) {
  const WritePrepared f = write_prepare(
      canary_buf, write_offsets, write_seed_slot_indices, write_num_valid_reqs, kernel_kind, enable_write_input_assert,
      expected_input_tokens, expected_input_positions, violation_ring, violation_write_index, slot_run_counter,
      kernel_run_counter, enable_chain_position_assert, real_kv_buf_0, real_kv_buf_1, real_kv_buf_2, real_kv_buf_3,
      real_kv_source_params, num_sources, real_kv_hash_mode, violation_meta, forward_step, write_request_rows,
      slot_attribution, row_serials);
  write_launch(f, input_ids, positions, out_cache_loc);
}

/*! \brief The seed ABI (SPEC §4.1): no metadata, no attribution. */
inline void canary_write_step(TensorView canary_buf, TensorView write_offsets, TensorView write_seed_slot_indices,
                              TensorView write_num_valid_reqs, TensorView input_ids, TensorView positions,
                              TensorView out_cache_loc, int64_t kernel_kind, int64_t enable_write_input_assert,
                              tvm::ffi::Optional<TensorView> expected_input_tokens,
                              tvm::ffi::Optional<TensorView> expected_input_positions, TensorView violation_ring,
                              TensorView violation_write_index, TensorView slot_run_counter,
                              TensorView kernel_run_counter, TensorView enable_chain_position_assert,
                              TensorView real_kv_buf_0, TensorView real_kv_buf_1, TensorView real_kv_buf_2,
                              TensorView real_kv_buf_3, TensorView real_kv_source_params, int64_t num_sources,
                              int64_t real_kv_hash_mode) {
  canary_write_step_attributed(canary_buf, write_offsets, write_seed_slot_indices, write_num_valid_reqs, input_ids,
                               positions, out_cache_loc, kernel_kind, enable_write_input_assert,
                               expected_input_tokens, expected_input_positions, violation_ring,
                               violation_write_index, slot_run_counter, kernel_run_counter,
                               enable_chain_position_assert, real_kv_buf_0, real_kv_buf_1, real_kv_buf_2,
                               real_kv_buf_3, real_kv_source_params, num_sources, real_kv_hash_mode, std::nullopt,
                               std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

/*! \brief The tensors canary_write_bind's function owns for its whole life (their storage backs WritePrepared's
 * pointers). */
struct WriteFixedArgs {
  BoundTensor canary_buf;
  BoundTensor write_offsets;
  BoundTensor write_seed_slot_indices;
  BoundTensor write_num_valid_reqs;
  BoundOptionalTensor expected_input_tokens;
  BoundOptionalTensor expected_input_positions;
  BoundTensor violation_ring;
  BoundTensor violation_write_index;
  BoundTensor slot_run_counter;
  BoundTensor kernel_run_counter;
  BoundTensor enable_chain_position_assert;
  BoundRealKvSources real_kv;
  BoundOptionalTensor violation_meta;
  BoundOptionalTensor forward_step;
  BoundOptionalTensor write_request_rows;
  BoundOptionalTensor slot_attribution;
  BoundOptionalTensor row_serials;
};

/*!
 * \brief canary_write_step_attributed with every argument but the forward's tokens bound, validated and extracted
 * once: returns a function of (input_ids, positions, out_cache_loc) that checks those and launches with the prepared
 * parameters (write_launch: the export's checks of them, its errors, its launch); absent optional ones are absent on
 * every call, as in the seed ABI. A bad fixed argument raises here, as the export's call would name it; the function
 * owns the bound tensors, so their storage lives as long as it does.
 * Stream: tvm-ffi sets the env stream a launch reads (launch.h current_stream) from the first CUDA torch tensor of a
 * call, and the bound ones are no longer passed. The call's first argument, input_ids, is a CUDA tensor whenever the
 * wrapper launches (it checks the device), so every launch is on torch's current stream (inside graph capture, the
 * capturing stream: a launch on another stream would silently drop out of the graph).
 */
inline tvm::ffi::Function canary_write_bind(
    tvm::ffi::Tensor canary_buf, tvm::ffi::Tensor write_offsets, tvm::ffi::Tensor write_seed_slot_indices,
    tvm::ffi::Tensor write_num_valid_reqs, int64_t kernel_kind, int64_t enable_write_input_assert,
    tvm::ffi::Optional<tvm::ffi::Tensor> expected_input_tokens,
    tvm::ffi::Optional<tvm::ffi::Tensor> expected_input_positions, tvm::ffi::Tensor violation_ring,
    tvm::ffi::Tensor violation_write_index, tvm::ffi::Tensor slot_run_counter, tvm::ffi::Tensor kernel_run_counter,
    tvm::ffi::Tensor enable_chain_position_assert, tvm::ffi::Tensor real_kv_buf_0, tvm::ffi::Tensor real_kv_buf_1,
    tvm::ffi::Tensor real_kv_buf_2, tvm::ffi::Tensor real_kv_buf_3, tvm::ffi::Tensor real_kv_source_params,
    int64_t num_sources, int64_t real_kv_hash_mode, tvm::ffi::Optional<tvm::ffi::Tensor> violation_meta,
    tvm::ffi::Optional<tvm::ffi::Tensor> forward_step, tvm::ffi::Optional<tvm::ffi::Tensor> write_request_rows,
    tvm::ffi::Optional<tvm::ffi::Tensor> slot_attribution, tvm::ffi::Optional<tvm::ffi::Tensor> row_serials) {
  WriteFixedArgs fixed{BoundTensor(std::move(canary_buf)),
                       BoundTensor(std::move(write_offsets)),
                       BoundTensor(std::move(write_seed_slot_indices)),
                       BoundTensor(std::move(write_num_valid_reqs)),
                       BoundOptionalTensor(std::move(expected_input_tokens)),
                       BoundOptionalTensor(std::move(expected_input_positions)),
                       BoundTensor(std::move(violation_ring)),
                       BoundTensor(std::move(violation_write_index)),
                       BoundTensor(std::move(slot_run_counter)),
                       BoundTensor(std::move(kernel_run_counter)),
                       BoundTensor(std::move(enable_chain_position_assert)),
                       BoundRealKvSources(std::move(real_kv_buf_0), std::move(real_kv_buf_1),
                                          std::move(real_kv_buf_2), std::move(real_kv_buf_3),
                                          std::move(real_kv_source_params), num_sources, real_kv_hash_mode),
                       BoundOptionalTensor(std::move(violation_meta)),
                       BoundOptionalTensor(std::move(forward_step)),
                       BoundOptionalTensor(std::move(write_request_rows)),
                       BoundOptionalTensor(std::move(slot_attribution)),
                       BoundOptionalTensor(std::move(row_serials))};
  const WriteFixedArgs& b = fixed;
  // (the prepared input-assert views point into the owners' objects, which the function keeps)
  WritePrepared prepared = write_prepare(
      b.canary_buf.view, b.write_offsets.view, b.write_seed_slot_indices.view, b.write_num_valid_reqs.view,
      kernel_kind, enable_write_input_assert, b.expected_input_tokens.view, b.expected_input_positions.view,
      b.violation_ring.view, b.violation_write_index.view, b.slot_run_counter.view, b.kernel_run_counter.view,
      b.enable_chain_position_assert.view, b.real_kv.buf_0.view, b.real_kv.buf_1.view, b.real_kv.buf_2.view,
      b.real_kv.buf_3.view, b.real_kv.source_params.view, b.real_kv.num_sources, b.real_kv.hash_mode,
      b.violation_meta.view, b.forward_step.view, b.write_request_rows.view, b.slot_attribution.view,
      b.row_serials.view);
  return tvm::ffi::Function::FromTyped(
      [owned = std::move(fixed), f = std::move(prepared)](TensorView input_ids, TensorView positions,
                                                          TensorView out_cache_loc) {
        write_launch(f, input_ids, positions, out_cache_loc);
      },
      "canary_write_bound");
}

}  // namespace host
}  // namespace kvcanary
