/*!
 * \file canary_check.cuh
 * \brief canary_check_step: everything the canary does before a forward, in one launch (issue 15).
 *
 * Computes what canary_plan_step_attributed (with an unbounded verify plan) + canary_verify_step_attributed
 * (tag VERIFY) + the manager's small per-forward ops did:
 *   - plan + verify: every verify entry of every batch row r < bs (the entries, in the order, canary_plan.cuh
 *     plans with out_cache_loc: SWA window, LUT, index-error entries, kv_token_id offset, padding rows: a row
 *     whose first new token is on the padding slot plans nothing but its index errors) is checked exactly as canary_verify.cuh
 *     checks a plan entry (chain, token, position, real-KV, out-of-range; with violation_meta a metadata row:
 *     the step below, the row's rp, the slot's attribution). No verify plan, no capacity: nothing is skipped.
 *     kernel_runs[VERIFY] += 1, slot_runs[VERIFY] += entries; the overflow counter is not touched.
 *   - the write plan (offsets, seeds, num_valid, request rows) as canary_plan_step stores it (not
 *     verify_row_offsets: nobody reads it); snapshot: input_ids / positions / out_cache_loc [n] (int32 or
 *     int64) -> the int64 *_out buffers [>= n]; batch arrays may each be int32 or int64.
 *   - token check: batch row r's valid length is expected_valid_lens_by_row[clamp(rp, 0, rows - 1)].
 *   - forward counter (state[kStateForward]): with new_forward it becomes forward_step_value (>= 0) or the
 *     counter + 1 (< 0: each CUDA-graph replay counts one forward), and every metadata row of this launch
 *     carries the NEW value; without new_forward it is only read.
 *   - drained-ring reuse BEFORE any append (see check_ring_reuse_plan): drained_to = (E << 32) | D, the host read
 *     every row below D in epoch E (<= 0 or another epoch: nothing). Write index I: D <= I <= capacity, I-D <= D:
 *     rows [D, I) and their metadata move to [0, I-D), index = I-D; D >= capacity <= I: the I-D rows never stored
 *     are counted in kStateRingLostAtReset, index = 0; then epoch += 1, drained_to = -1, kStateRingReusedAt = D.
 *     Else nothing. This launch's rows follow the kept ones.
 * State: the manager's flat int64 buffer as ONE argument: the kState* header of kvcanary/layout.h, then the
 *   ring [ring_capacity, kViolationFields], ring_capacity = (length - kStateHeaderFields) / kViolationFields.
 * Grid:  CUDA: min(SMs x min(occupancy, kCheckMaxBlocksPerSm), ceil(batch_rows x (max_context + 2) /
 *        kCheckThreads)) blocks, at least 1: from the SM count, the batch's row count (a shape, fixed in a
 *        captured graph) and max_context, never from data (capturable): a small decode runs a few blocks, not a
 *        wave sized by the write capacity (every block scans the rows and counts itself done).
 *        Every block scans the rows in chunks of kCheckThreads (block-wide prefix sums in shared memory; any
 *        bs up to the write capacity), then the grid strides over the chunk's entries (entry e -> thread e mod
 *        grid size), each finding its row by binary search over the chunk's row starts in shared memory. Block
 *        0 stores the write plan and bumps the counters; the snapshot is grid-strided. Reuse gate: after its
 *        snapshot each block takes an arrival ticket (state[kStateArrivals]); the ticket holder that is first
 *        (ticket mod grid == 0) reuses the ring and opens state[kStateReuseGate], every other block waits for
 *        the gate before its first append (the first block never waits: no deadlock whatever the residency).
 *        The last block to finish (atomic count in state[kStateDoneBlocks]) stores the counter and resets the
 *        three scratch fields to 0; every block took the step from the counter it read at its start, before
 *        any block could store it. CPU: one loop (reuse first), the same per-row and per-entry semantics, rows
 *        in entry order.
 * Block: kCheckThreads threads (launch bounds: kCheckMinBlocksPerSm per SM); one entry per thread per step.
 * Reads:  batch arrays, req_to_token, LUT, expected tokens and valid lengths, records, real-KV bytes, the
 *         snapshot sources, the state header (forward counter, write index, drained_to, mail cursor), the mail.
 * Writes: write plan, snapshots, violation (+ metadata) rows, the header (counters, forward counter, write
 *         index / epoch / drained_to on reuse, the done / arrival / gate scratch, the mail cursor), the expected
 *         tokens and valid lengths the mail's records append; optionally the status mirror
 *         (the last block copies the finished header to pinned host memory in place: CheckParams). Never records.
 * Token mail (token_mail, token_mail_published; optional, issue 25): before any verify (by the reuse gate's opener)
 *   the records published since state[kStateTokenMailRead] with step <= this launch's are appended in order to the
 *   int32 expected tokens and valid lengths (check_token_mail_block), the cursor moved past them; a record for a
 *   later forward waits for it. CPU: first, after the ring reuse.
 * Deferred write (has_deferred_write; issue 25): the write of the forward the previous check planned, run by this
 *   launch instead of a launch of its own, so an eager forward pays one launch: WriteParams over the previous check's
 *   write plan and the first pending_write_tokens elements of the snapshot buffers (what canary_write_step would get
 *   from the runtime: tag WRITE, its counters in the header, attribution and rows labelled with the forward counter
 *   before this launch sets it). The reuse gate's opener runs it first (before the ring reuse, as a launch of its own
 *   before this one would have), one thread per request (write_request_serial: meant for a decode's one entry per request); every other block waits for the
 *   gate before its snapshot (the write reads the snapshot and the plan this launch overwrites) and its verify (which
 *   checks the slots it writes). Records, attribution, counters and rows equal a canary_write_step launch before
 *   this one (rows in unspecified order). CPU: first.
 */
#pragma once

#include <tvm/ffi/function.h>

#include <cstdint>
#include <utility>

#include "bound_args.cuh"
#include "canary_plan.cuh"
#include "canary_verify.cuh"
#include "canary_write.cuh"
#include "kvcanary/atomics.h"
#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/real_kv.h"
#include "kvcanary/tensor_check.h"
#include "kvcanary/violation.h"
#include "meta_args.cuh"
#include "real_kv_args.cuh"

namespace kvcanary {

constexpr uint32_t kCheckThreads = 256;
// Register budget: 5 resident blocks of 256 threads per SM (48 registers on sm_90a, no spills; 6 spills). The
// grid is one wave of at most kCheckMaxBlocksPerSm blocks per SM: the knob between a cheap small decode (every
// block scans the rows and counts itself done) and latency hiding on a large verify.
constexpr uint32_t kCheckMinBlocksPerSm = 5;
constexpr int32_t kCheckMaxBlocksPerSm = 5;
// Token-mail records the reuse gate's opener loads from host memory at once (check_token_mail_block): 2 KiB of shared
// memory.
constexpr int64_t kCheckMailChunk = 64;

struct CheckParams {
  PlanParams plan;    // batch rows, tables and the write plan (the verify-plan pointers stay nullptr)
  RecordCheck check;  // records, real-KV sources, check_tokens, slot attribution
  int64_t* state;     // [kStateHeaderFields + ring_capacity * kViolationFields]
  // [kStateHeaderFields] host memory the last block copies the finished header to (CUDA: the device's address of
  // pinned memory), nullptr: none. The host reads it with no copy and no event (runtime/drain.py).
  int64_t* status_mirror;
  int32_t ring_capacity;
  int64_t* violation_meta;  // [ring_capacity, kViolationMetaFields], nullptr: no metadata
  IntArray input_ids;
  IntArray positions;
  IntArray out_cache_loc;
  int64_t* input_ids_out;
  int64_t* positions_out;
  int64_t* out_cache_loc_out;
  int64_t num_tokens;
  bool new_forward;
  int64_t forward_step_value;
  // The token check's mailbox (layout.h kTokenMailField*; nullptr: none): host memory (CUDA: the device's addresses
  // of pinned memory) the host fills with a decode batch's appends and publishes the count of (token_mail_published);
  // the reuse gate's opener applies the records due by this launch's step to the expected-token table (int32,
  // plan's) before any block verifies.
  const int64_t* token_mail;
  const int64_t* token_mail_published;
  int64_t token_mail_capacity;
  // The deferred write (see the file comment; bound by canary_check_bind, num_tokens set per call).
  WriteParams deferred_write;
  bool has_deferred_write;
};

KVCANARY_HD int32_t* check_write_index(const CheckParams& p) {
  return reinterpret_cast<int32_t*>(p.state + kStateWriteIndex);  // the low half (little-endian)
}

/*! \brief The forward number this launch's rows carry, from the counter value read at the launch's start. */
KVCANARY_HD int64_t check_step_value(const CheckParams& p, int64_t counter) {
  if (!p.new_forward) {
    return counter;
  }
  return p.forward_step_value >= 0 ? p.forward_step_value : counter + 1;
}

/*! \brief The VERIFY sink of this launch; `step` holds the step value (per block on the device). */
KVCANARY_HD ViolationSink check_sink(const CheckParams& p, const int64_t* step) {
  return ViolationSink{p.state + kStateHeaderFields, check_write_index(p), p.ring_capacity, kLaunchTagVerify,
                       p.violation_meta, step};
}

KVCANARY_HD void check_snapshot(const CheckParams& p, int64_t i) {
  p.input_ids_out[i] = p.input_ids[i];
  p.positions_out[i] = p.positions[i];
  p.out_cache_loc_out[i] = p.out_cache_loc[i];
}

/*! \brief kernel_runs[VERIFY] += 1, slot_runs[VERIFY] += entries (once per launch, by one thread). */
KVCANARY_HD void check_bump_counters(const CheckParams& p, int64_t entries) {
  atomic_add_i64(p.state + kStateKernelRuns + kLaunchTagVerify, 1);
  if (entries > 0) atomic_add_i64(p.state + kStateSlotRuns + kLaunchTagVerify, entries);
}

/*! \brief A load that bypasses the (non-coherent) L1 on the device: values other blocks updated. */
template <typename T>
KVCANARY_HD T check_load_fresh(const T* addr) {
#if KVCANARY_DEVICE_CODE
  return *reinterpret_cast<const volatile T*>(addr);
#else
  return *addr;
#endif
}

/*! \brief What the drained-ring reuse at the start of a launch does (see the file comment). */
struct RingReuse {  // (no member initializers: a __shared__ copy must be trivially constructible)
  bool reset;
  int64_t acked;  // the acknowledged index applied (kStateRingReusedAt)
  int64_t from;   // the first row kept: rows [from, from + count) move to [0, count)
  int64_t count;  // rows kept (the new write index)
  int64_t lost;   // rows past the acknowledgement that were never stored (kStateRingLostAtReset)
};

/*!
 * \brief Decide the reuse from the header (read once, by the one thread that applies it). Rows appended after the
 * host's acknowledgement are kept (moved to the front) rather than blocking the reuse: before 2026-12-02 only
 * I == D emptied the ring, so a violation found again on every forward (a corrupted slot a running request reads
 * each step) kept it from ever emptying (the H200's EAGLE phase 15 lost 1,643 rows). The move must not overlap
 * (I - D <= D: a later acknowledgement catches up); after an overflow only once every stored row was read (D >=
 * capacity). kStateRingReusedAt tells the host which acknowledgement was applied: it may have acknowledged a later
 * index of the old epoch since, too late for this launch.
 */
KVCANARY_HD RingReuse check_ring_reuse_plan(const CheckParams& p) {
  RingReuse r{false, 0, 0, 0, 0};
  const int64_t drained_to = check_load_fresh(p.state + kStateDrainedTo);
  if (drained_to <= 0) {
    return r;
  }
  const int64_t acked = drained_to & ((int64_t{1} << kDrainedToEpochShift) - 1);
  if (acked <= 0 || (drained_to >> kDrainedToEpochShift) != check_load_fresh(p.state + kStateRingEpoch)) {
    return r;  // nothing read, or read in an epoch already emptied
  }
  const int64_t index = check_load_fresh(check_write_index(p));
  const int64_t capacity = p.ring_capacity;
  if (index < acked) {
    return r;  // a wrapped (negative) index: the count of rows is unknown
  }
  r.acked = acked;
  if (index <= capacity) {
    if (index - acked <= acked) {  // the rows to keep lie past the ones they replace: an in-order move is safe
      r.reset = true;
      r.from = acked;
      r.count = index - acked;
    }
    return r;
  }
  if (acked >= capacity) {
    r.reset = true;
    r.lost = index - acked;
  }
  return r;
}

/*! \brief Row `from + i` of the ring (and of the metadata) to row i. Rows [from, from + count) never overlap
 *  [0, count) (count <= from), so threads may move rows in any order. */
KVCANARY_HD void check_ring_move_row(const CheckParams& p, int64_t from, int64_t i) {
  int64_t* ring = p.state + kStateHeaderFields;
  for (int32_t f = 0; f < kViolationFields; ++f) {
    ring[i * kViolationFields + f] = ring[(from + i) * kViolationFields + f];
  }
  if (p.violation_meta != nullptr) {
    for (int32_t f = 0; f < kViolationMetaFields; ++f) {
      p.violation_meta[i * kViolationMetaFields + f] = p.violation_meta[(from + i) * kViolationMetaFields + f];
    }
  }
}

/*! \brief The header after a reuse (by one thread, once every row moved). */
KVCANARY_HD void check_ring_reuse_finish(const CheckParams& p, const RingReuse& r) {
  *check_write_index(p) = static_cast<int32_t>(r.count);
  p.state[kStateRingEpoch] += 1;
  p.state[kStateDrainedTo] = -1;
  p.state[kStateRingLostAtReset] += r.lost;
  p.state[kStateRingReusedAt] = r.acked;
}

/*!
 * \brief Start of the launch, before any append: the drained-ring reuse (see the file comment), by one thread while
 * no thread of the launch can append yet (the CPU loop's start; on the device the gate's opener block moves the rows
 * with all its threads, check_reuse_gate).
 */
KVCANARY_HD void check_reuse_drained_ring(const CheckParams& p) {
  const RingReuse r = check_ring_reuse_plan(p);
  if (!r.reset) {
    return;
  }
  for (int64_t i = 0; i < r.count; ++i) {
    check_ring_move_row(p, r.from, i);
  }
  check_ring_reuse_finish(p, r);
}

/*!
 * \brief End of the launch, after every append: store the forward counter.
 * Run by one thread once every block has read the counter (the CPU loop's end; the last block).
 */
KVCANARY_HD void check_finish(const CheckParams& p, int64_t step) {
  if (p.new_forward) {
    p.state[kStateForward] = step;
  }
}

/*! \brief A volatile load: host memory the host rewrites between launches, read as it is now (never a cached copy). */
KVCANARY_HD int64_t check_load_volatile(const int64_t* addr) { return *static_cast<const volatile int64_t*>(addr); }

/*! \brief Mailbox record `at`'s field `field` (field-major: a column per field; the ring index modulo the capacity). */
KVCANARY_HD const int64_t* check_mail_field(const CheckParams& p, int64_t at, int32_t field) {
  return p.token_mail + static_cast<int64_t>(field) * p.token_mail_capacity + at % p.token_mail_capacity;
}

/*!
 * \brief One mailbox record applied to the expected-token table: the token at (row, start), the row's valid length
 * start + 1. A record outside the table is skipped (the host checks every record before it publishes; this only
 * keeps a bad one from writing out of bounds).
 */
KVCANARY_HD void check_apply_mail_record(const PlanParams& q, int64_t row, int64_t start, int64_t token) {
  if (row >= 0 && row < q.exp_rows && start >= 0 && start < q.exp_cols) {
    const_cast<int32_t*>(static_cast<const int32_t*>(q.expected_tokens))[row * q.exp_row_stride + start] =
        static_cast<int32_t>(token);
    const_cast<int64_t*>(q.expected_valid_lens)[row] = start + 1;
  }
}

/*!
 * \brief The records the token mail holds for this launch: [begin, end) from the read cursor
 * (state[kStateTokenMailRead]) to the published count, the count's load ordered before the records'. Empty when the
 * launch has no mailbox, or the count is behind the cursor or more than a ring ahead of it (a host that lost count).
 * Records are published in step order; the caller applies them in order while their step is <= its own.
 */
KVCANARY_HD void check_mail_range(const CheckParams& p, int64_t* begin, int64_t* end) {
  *begin = *end = 0;
  if (p.token_mail == nullptr) {
    return;
  }
  const int64_t read = p.state[kStateTokenMailRead];
  const int64_t published = check_load_volatile(p.token_mail_published);
#ifdef __CUDA_ARCH__
  __threadfence_system();  // the records' loads after the count's (the host writes them before it publishes)
#endif
  *begin = *end = read;
  if (published > read && published - read <= p.token_mail_capacity) {
    *end = published;
  }
}

/*! \brief Verify the k-th entry of batch row r. */
KVCANARY_HD void check_entry(const CheckParams& p, const ViolationSink& sink, int64_t r, const RowPlan& row,
                             int64_t k) {
  const PlanEntry e = plan_entry(p.plan, r, row, k);
  verify_record(p.check, sink, VerifyEntry{e.slot, e.prev, e.token, e.position}, KnownRequestRow{row.rp});
}

#if KVCANARY_DEVICE_BUILD

/*!
 * \brief The token mail of a launch that has one, by every thread of the reuse gate's opener before it opens the
 * gate (block-uniform call), so before any block of the launch verifies: the block loads the due records from host
 * memory kCheckMailChunk at a time, in parallel (one round trip over the bus per chunk, not one per record), then
 * thread 0 applies them in order from shared memory (a row repeated in the mail: the later record wins) and moves
 * the read cursor past them. This launch's verify checks the appended tokens, as it checked those of a launch of
 * their own before it.
 * Not inlined: it runs once per launch, and inlined its registers spilled in the verify loop (ptxas, sm_90a).
 */
__device__ __noinline__ void check_token_mail_block(const CheckParams& p, int64_t step) {
  __shared__ int64_t s_mail[kCheckMailChunk][kTokenMailFields];
  __shared__ int64_t s_at;
  __shared__ int64_t s_end;
  __shared__ bool s_stop;
  if (threadIdx.x == 0) {
    int64_t begin = 0;
    int64_t end = 0;
    check_mail_range(p, &begin, &end);
    s_at = begin;
    s_end = end;
    s_stop = false;
  }
  __syncthreads();
  for (int64_t chunk = s_at; chunk < s_end && !s_stop; chunk += kCheckMailChunk) {  // (shared: block-uniform)
    const int64_t n = s_end - chunk < kCheckMailChunk ? s_end - chunk : kCheckMailChunk;
    for (int64_t i = threadIdx.x; i < n * kTokenMailFields; i += blockDim.x) {  // (neighbours read one column)
      const int64_t k = i % n;
      const int32_t field = static_cast<int32_t>(i / n);
      s_mail[k][field] = check_load_volatile(check_mail_field(p, chunk + k, field));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t k = 0;
      for (; k < n && s_mail[k][kTokenMailFieldStep] <= step; ++k) {
        check_apply_mail_record(p.plan, s_mail[k][kTokenMailFieldRow], s_mail[k][kTokenMailFieldStart],
                                s_mail[k][kTokenMailFieldToken]);
      }
      s_at = chunk + k;
      s_stop = k < n;  // a record for a later forward: the rest wait for it
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.state[kStateTokenMailRead] = s_at;
  }
}

/*!
 * \brief The deferred write of a launch that has one, by every thread of the reuse gate's opener before the ring
 * reuse (block-uniform call): thread t writes requests t, t + blockDim, ... (write_request_serial), thread 0 counts
 * the launch as canary_write_kernel's block 0 does. Its records and attribution are fenced before the gate opens.
 * Not inlined, as check_token_mail_block.
 */
__device__ __noinline__ void check_deferred_write_block(const CheckParams& p) {
  const WriteParams& w = p.deferred_write;
  if (threadIdx.x == 0) {
    atomic_add_i64(w.kernel_run_counter, 1);
  }
  const int32_t active = active_write_requests(w);
  for (int64_t r = threadIdx.x; r < active; r += blockDim.x) {
    write_request_serial(w, r);
  }
  __syncthreads();
}

/*!
 * \brief The reuse gate, by every thread of each block before the block's first append and first verify: one block
 * reuses the ring (its threads move the kept rows), applies the token mail, and opens the gate, every other block
 * waits until it is open. The opener is the
 * block whose arrival ticket is a multiple of the grid size: ticket 0 (the first to arrive) at rest, and still
 * exactly one block if a dead launch left the ticket count non-zero, so no launch can wait on a gate nobody opens.
 * Capturable: no host sync. Called block-uniformly (every thread of the block, no divergent branch around it).
 */
__device__ __forceinline__ void check_reuse_gate(const CheckParams& p, int64_t step) {
  __shared__ bool s_opener;
  __shared__ RingReuse s_reuse;
  int32_t* arrivals = reinterpret_cast<int32_t*>(p.state + kStateArrivals);
  int32_t* gate = reinterpret_cast<int32_t*>(p.state + kStateReuseGate);
  if (threadIdx.x == 0) {
    const uint32_t ticket = static_cast<uint32_t>(atomicAdd(arrivals, 1));
    s_opener = ticket % gridDim.x == 0;
    if (s_opener && !p.has_deferred_write) {
      s_reuse = check_ring_reuse_plan(p);
    }
  }
  __syncthreads();
  if (s_opener) {  // (block-uniform: shared)
    if (p.has_deferred_write) {  // (a launch parameter: block-uniform) first, as a write launch before this one
      check_deferred_write_block(p);  // (ends with a barrier: its rows and index, before the reuse reads them)
      if (threadIdx.x == 0) {
        s_reuse = check_ring_reuse_plan(p);
      }
      __syncthreads();
    }
    if (s_reuse.reset) {
      for (int64_t i = threadIdx.x; i < s_reuse.count; i += blockDim.x) {
        check_ring_move_row(p, s_reuse.from, i);
      }
      __threadfence();  // each thread's moved rows, device-wide, before the header says they are there
      __syncthreads();
      if (threadIdx.x == 0) {
        check_ring_reuse_finish(p, s_reuse);
      }
    }
    if (p.token_mail != nullptr) {  // (a launch parameter: block-uniform; a launch without a mailbox adds no barrier)
      check_token_mail_block(p, step);  // (before any block's verify: the appends are checked by this launch)
    }
    if (threadIdx.x == 0) {
      // the reset index, epoch and drained_to, the mail's appends and cursor, before the open gate, device-wide
      __threadfence();
      atomicExch(gate, 1);
    }
    return;
  }
  if (threadIdx.x == 0) {
    while (check_load_fresh(gate) == 0) {
      __nanosleep(64);
    }
    __threadfence();  // nothing of this block's below is ordered before the gate it saw open
  }
}

KVCANARY_KERNEL void __launch_bounds__(kCheckThreads, kCheckMinBlocksPerSm)
    canary_check_kernel(const __grid_constant__ CheckParams p) {
  // The current chunk's rows: where each row's entries start, and what plan_entry needs of its RowPlan.
  __shared__ int64_t s_start[kCheckThreads];
  __shared__ int64_t s_rp[kCheckThreads];
  __shared__ int64_t s_window_start[kCheckThreads];
  __shared__ int64_t s_window_end[kCheckThreads];
  __shared__ uint8_t s_flags[kCheckThreads];  // bit 0: rp_ok, bit 1: bad_prefix
  __shared__ int64_t s_step;
  __shared__ long long s_cut;  // the padding rows' first token (plan_chunk_padding)
  __shared__ bool s_last;
  const PlanParams& q = p.plan;
  if (threadIdx.x == 0) {
    // Nobody stores the counter before every block has counted itself done (below), so all blocks read the
    // value from before the launch.
    s_step = check_step_value(p, p.state[kStateForward]);
    s_cut = INT64_MAX;
  }
  __syncthreads();
  const ViolationSink sink = check_sink(p, &s_step);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!p.has_deferred_write) {  // (a launch parameter: block-uniform)
    for (int64_t i = g; i < p.num_tokens; i += stride) {
      check_snapshot(p, i);
    }
  }
  check_reuse_gate(p, s_step);  // after the snapshot (no appends there): the opener has usually done the reuse by now
  __syncthreads();
  if (p.has_deferred_write) {  // the opener's deferred write has read the previous snapshot
    for (int64_t i = g; i < p.num_tokens; i += stride) {
      check_snapshot(p, i);
    }
  }

  const bool stores_write_plan = blockIdx.x == 0;
  const int64_t rows = stores_write_plan ? q.write_capacity : q.batch_rows;
  int64_t carry_tokens = 0;
  int64_t carry_write = 0;
  int64_t carry_verify = 0;
  for (int64_t base = 0; base < rows; base += kCheckThreads) {
    const int64_t r = base + threadIdx.x;
    const bool padding = plan_chunk_padding<kCheckThreads>(q, r, carry_tokens, &s_cut);
    RowPlan row{};
    row.seed = kChainHeadSlot;
    if (r < q.batch_rows) {
      row = plan_row(q, r, padding);
    }
    int64_t write_end = row.write_count;
    int64_t verify_end = row.verify_count;
    int64_t total_write = 0;
    int64_t total_verify = 0;
    block_inclusive_scan2<kCheckThreads>(write_end, verify_end, total_write, total_verify);
    if (stores_write_plan && r < q.write_capacity) {
      plan_store_write_row(q, r, row.rp, row.seed, carry_write + write_end);
    }
    s_start[threadIdx.x] = carry_verify + verify_end - row.verify_count;
    s_rp[threadIdx.x] = row.rp;
    s_window_start[threadIdx.x] = row.window_start;
    s_window_end[threadIdx.x] = row.window_end;
    s_flags[threadIdx.x] = static_cast<uint8_t>((row.rp_ok ? 1 : 0) | (row.bad_prefix ? 2 : 0));
    __syncthreads();

    const int64_t chunk_begin = carry_verify;
    const int64_t chunk_end = carry_verify + total_verify;
    const int64_t chunk_rows = q.batch_rows - base < kCheckThreads ? q.batch_rows - base : kCheckThreads;
    // Entry e goes to thread e mod stride: the first such e at or after chunk_begin.
    int64_t e = g >= chunk_begin ? g : g + ((chunk_begin - g + stride - 1) / stride) * stride;
    for (; e < chunk_end; e += stride) {
      // Row: the last one whose start is <= e (an empty row shares its start with the next one).
      int64_t lo = 0;
      int64_t hi = chunk_rows;
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (s_start[mid] <= e) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      RowPlan entry_row{};
      entry_row.rp = s_rp[lo];
      entry_row.window_start = s_window_start[lo];
      entry_row.window_end = s_window_end[lo];
      entry_row.rp_ok = (s_flags[lo] & 1) != 0;
      entry_row.bad_prefix = (s_flags[lo] & 2) != 0;
      check_entry(p, sink, base + lo, entry_row, e - s_start[lo]);
    }
    carry_write += total_write;
    carry_verify += total_verify;
    __syncthreads();  // the shared row arrays are rewritten by the next chunk
  }
  if (stores_write_plan && threadIdx.x == 0) {
    q.write_offsets[0] = 0;
    *q.write_num_valid = static_cast<int32_t>(q.batch_rows);
    check_bump_counters(p, carry_verify);
  }

  // Count this block done once all its appends are visible device-wide; the last block finishes the launch.
  __threadfence();
  __syncthreads();
  int32_t* done = reinterpret_cast<int32_t*>(p.state + kStateDoneBlocks);
  if (threadIdx.x == 0) {
    s_last = atomicAdd(done, 1) == static_cast<int32_t>(gridDim.x) - 1;
  }
  __syncthreads();
  if (s_last) {  // (block-uniform: shared)
    if (threadIdx.x == 0) {
      check_finish(p, s_step);
      // Ready for the next launch (and for a graph replay): every block has passed the gate and counted itself done.
      *reinterpret_cast<int32_t*>(p.state + kStateArrivals) = 0;
      *reinterpret_cast<int32_t*>(p.state + kStateReuseGate) = 0;
      *done = 0;
    }
    __syncthreads();  // thread 0's stores, before the block reads the header back
    if (p.status_mirror != nullptr && threadIdx.x < static_cast<uint32_t>(kStateHeaderFields)) {
      // One coalesced write of the finished header to pinned host memory. No system fence: the host reads the
      // mirror only to learn whether anything moved, and a read torn between two launches' headers is a mix of
      // older values that the next read corrects (runtime/drain.py); a fence would lengthen every launch.
      p.status_mirror[threadIdx.x] = check_load_fresh(p.state + threadIdx.x);
    }
  }
}

/*! \brief Blocks of canary_check_kernel one wave can hold on `device_id` (queried once per device). */
inline int64_t check_resident_blocks(int32_t device_id) {
  constexpr int32_t kMaxDevices = 64;
  static int32_t cached[kMaxDevices] = {};
  if (device_id >= 0 && device_id < kMaxDevices && cached[device_id] > 0) {
    return cached[device_id];
  }
  int32_t per_sm = 0;
  TVM_FFI_CHECK_CUDA_ERROR(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, canary_check_kernel, kCheckThreads, 0));
  per_sm = per_sm < kCheckMaxBlocksPerSm ? per_sm : kCheckMaxBlocksPerSm;
  const int32_t blocks = (per_sm > 0 ? per_sm : 1) * host::sm_count(device_id);
  if (device_id >= 0 && device_id < kMaxDevices) {
    cached[device_id] = blocks;
  }
  return blocks;
}

#else

inline void canary_check_cpu(const CheckParams& p) {
  const PlanParams& q = p.plan;
  if (p.has_deferred_write) {  // the previous forward's write, as a launch before this one (the device's opener)
    canary_write_cpu(p.deferred_write);
  }
  check_reuse_drained_ring(p);  // before any of this launch's appends, as the device's gate orders it
  const int64_t step = check_step_value(p, p.state[kStateForward]);
  int64_t at = 0;
  int64_t end = 0;
  check_mail_range(p, &at, &end);  // the token mail before any verify (the device's check_token_mail_block)
  for (; at < end && check_load_volatile(check_mail_field(p, at, kTokenMailFieldStep)) <= step; ++at) {
    check_apply_mail_record(p.plan, *check_mail_field(p, at, kTokenMailFieldRow),
                            *check_mail_field(p, at, kTokenMailFieldStart),
                            *check_mail_field(p, at, kTokenMailFieldToken));
  }
  if (p.token_mail != nullptr) {
    p.state[kStateTokenMailRead] = at;
  }
  const ViolationSink sink = check_sink(p, &step);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    check_snapshot(p, i);
  }
  int64_t write_end = 0;
  int64_t entries = 0;
  q.write_offsets[0] = 0;
  for (int64_t r = 0; r < q.write_capacity; ++r) {
    RowPlan row{};
    row.seed = kChainHeadSlot;
    if (r < q.batch_rows) {
      row = plan_row(q, r, plan_starts_on_padding_slot(q, r, write_end));  // (write_end: row r's first token)
    }
    write_end += row.write_count;
    plan_store_write_row(q, r, row.rp, row.seed, write_end);
    for (int64_t k = 0; k < row.verify_count; ++k) {
      check_entry(p, sink, r, row, k);
    }
    entries += row.verify_count;
  }
  *q.write_num_valid = static_cast<int32_t>(q.batch_rows);
  check_bump_counters(p, entries);
  check_finish(p, step);
  if (p.status_mirror != nullptr) {
    for (int32_t f = 0; f < kStateHeaderFields; ++f) {
      p.status_mirror[f] = p.state[f];
    }
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*! \brief An int64 snapshot destination (input_ids_out, positions_out, out_cache_loc_out), checked once. */
struct SnapshotOut {
  int64_t* data;
  int64_t len;
  const char* arg;
};

/*! \brief Validate an int64 snapshot destination on `device` (its length is checked per call: snapshot_fits). */
inline SnapshotOut snapshot_out(const char* fn, SymbolicDevice& device, const TensorView& t, const char* arg) {
  SymbolicSize len("len");
  TensorMatcher(fn, {len}).dtype<int64_t>().device(device).verify(t, arg);
  return SnapshotOut{data_of<int64_t>(t), len.value(), arg};
}

/*! \brief A snapshot destination holds at least num_tokens elements. */
inline void snapshot_fits(const char* fn, const SymbolicSize& num_tokens, const SnapshotOut& out) {
  KVCANARY_CHECK_ARG(out.len >= num_tokens.value(), ValueError, fn, out.arg)
      << "holds " << out.len << " elements, fewer than num_tokens=" << num_tokens.value() << " (bound by "
      << num_tokens.bound_by() << ")";
}

/*!
 * \brief canary_check_step's fixed arguments (all but the forward's six arrays and two ints), validated and
 * extracted once: a bound check (canary_check_bind) prepares at binding, so a forward's call checks only its own
 * arrays; the export prepares on every call.
 */
struct CheckPrepared {
  CheckParams params;  // every field but the forward's own (check_launch sets those on a copy)
  SymbolicDevice device{KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU};  // bound by state
  WritePlanSizes sizes;  // write_offsets_len and write_capacity bound; batch_rows bound per call
  SnapshotOut snapshots[3];  // input_ids_out, positions_out, out_cache_loc_out
  bool defers_writes = false;  // params.deferred_write is bound (bind_deferred_write): a call may pass a pending one
};

/*!
 * \brief The deferred write's parameters (canary_check_bind, issue 25): the write canary_write_step would run for the
 * runtime, from the check's own arguments (records, write plan, request rows, snapshots, real-KV sources, slot
 * attribution, the ring and metadata) and its header (the WRITE counters, the forward counter), plus the two the check
 * lacks: enable_chain_position_assert (int32 [1]) and row_serials (int64 [serial_rows], needs write_request_rows).
 */
inline void bind_deferred_write(const char* fn, CheckPrepared& f, const TensorView& canary_buf,
                                bool has_write_request_rows, const TensorView& enable_chain_position_assert,
                                const tvm::ffi::Optional<TensorView>& row_serials) {
  SymbolicDevice& device = f.device;
  TensorMatcher(fn, {1})
      .dtype<int32_t>()
      .device(device)
      .verify(enable_chain_position_assert, "deferred_write_chain_assert");
  const CheckParams& c = f.params;
  WriteParams& w = f.params.deferred_write;
  w = WriteParams{};
  SymbolicSize serial_rows("serial_rows");
  if (row_serials.has_value()) {
    KVCANARY_CHECK_ARG(has_write_request_rows, ValueError, fn, "deferred_write_row_serials")
        << "needs write_request_rows (the row of each request)";
    TensorMatcher(fn, {serial_rows}).dtype<int64_t>().device(device).verify(row_serials.value(),
                                                                           "deferred_write_row_serials");
    w.row_serials = data_of<const int64_t>(row_serials.value());
    w.serial_rows = serial_rows.value();
  }
  w.canary_buf = data_of<uint8_t>(canary_buf);
  w.slot_stride_bytes = c.check.slot_stride_bytes;
  w.num_slots = c.check.num_slots;
  w.records_aligned16 = c.check.records_aligned16;
  w.write_offsets = c.plan.write_offsets;
  w.write_seed_slot_indices = c.plan.write_seeds;
  w.write_num_valid_reqs = c.plan.write_num_valid;
  w.write_req_capacity = static_cast<int32_t>(c.plan.write_capacity);
  w.input_ids = c.input_ids_out;
  w.positions = c.positions_out;
  w.out_cache_loc = c.out_cache_loc_out;
  w.sink = ViolationSink{c.state + kStateHeaderFields, reinterpret_cast<int32_t*>(c.state + kStateWriteIndex),
                         c.ring_capacity, kLaunchTagWrite, c.violation_meta, c.state + kStateForward};
  w.slot_run_counter = c.state + kStateSlotRuns + kLaunchTagWrite;
  w.kernel_run_counter = c.state + kStateKernelRuns + kLaunchTagWrite;
  w.enable_chain_position_assert = data_of<const int32_t>(enable_chain_position_assert);
  w.sources = c.check.sources;
  w.write_request_rows = c.plan.write_request_rows;
  w.slot_attribution = const_cast<int64_t*>(c.check.slot_attribution);
  f.defers_writes = true;
}

/*!
 * \brief The token check's mailbox (both or neither, after the expected tokens are bound): token_mail int64
 * [kTokenMailFields, capacity] (a column per field), token_mail_published int64 [1], host memory (CUDA: pinned, the
 * kernel reads it through the device's addresses); the expected tokens must be int32 (the table the mail appends to).
 */
inline void bind_token_mail(const char* fn, const tvm::ffi::Optional<TensorView>& token_mail,
                            const tvm::ffi::Optional<TensorView>& token_mail_published, CheckParams& p) {
  KVCANARY_CHECK_ARG(token_mail.has_value() == token_mail_published.has_value(), ValueError, fn,
                     token_mail.has_value() ? "token_mail_published" : "token_mail")
      << "token_mail and token_mail_published must be given together";
  if (!token_mail.has_value()) {
    return;
  }
  KVCANARY_CHECK_ARG(p.plan.expected_tokens != nullptr && p.plan.expected_tokens_i32, ValueError, fn, "token_mail")
      << "needs int32 expected_tokens (the table its records are appended to)";
  SymbolicSize capacity("mail_capacity");
  TensorMatcher(fn, {kTokenMailFields, capacity}).dtype<int64_t>().verify(token_mail.value(), "token_mail");
  KVCANARY_CHECK_ARG(capacity.value() > 0, ValueError, fn, "token_mail") << "expected at least one record";
  TensorMatcher(fn, {1}).dtype<int64_t>().verify(token_mail_published.value(), "token_mail_published");
  check_host_memory(fn, "token_mail", token_mail.value());
  check_host_memory(fn, "token_mail_published", token_mail_published.value());
  const int64_t* mail = data_of<const int64_t>(token_mail.value());
  const int64_t* published = data_of<const int64_t>(token_mail_published.value());
#if KVCANARY_DEVICE_BUILD
  mail = pinned_device_address(fn, "token_mail", mail);  // (the kernel reads through the device's addresses)
  published = pinned_device_address(fn, "token_mail_published", published);
#endif
  p.token_mail = mail;
  p.token_mail_published = published;
  p.token_mail_capacity = capacity.value();
}

/*! \brief Validate and extract canary_check_step's fixed arguments (this order decides the error a call with several
 * bad arguments gets; the forward's own arrays are checked after them, by check_launch). */
inline CheckPrepared check_prepare(
    TensorView state, tvm::ffi::Optional<TensorView> status_mirror, tvm::ffi::Optional<TensorView> violation_meta,
    tvm::ffi::Optional<TensorView> slot_attribution, TensorView canary_buf, TensorView write_offsets,
    TensorView write_seed_slot_indices, TensorView write_num_valid_reqs,
    tvm::ffi::Optional<TensorView> write_request_rows, TensorView req_to_token, int64_t swa_window_size,
    tvm::ffi::Optional<TensorView> full_to_swa_index_mapping, tvm::ffi::Optional<TensorView> expected_tokens,
    tvm::ffi::Optional<TensorView> expected_valid_lens_by_row, tvm::ffi::Optional<TensorView> token_mail,
    tvm::ffi::Optional<TensorView> token_mail_published, int64_t kv_token_id_vs_position_offset,
    TensorView input_ids_out, TensorView positions_out, TensorView out_cache_loc_out, TensorView real_kv_buf_0,
    TensorView real_kv_buf_1, TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params,
    int64_t num_sources, int64_t real_kv_hash_mode, int64_t check_tokens) {
  constexpr const char* kFn = "canary_check_step";
  CheckPrepared f{};
  SymbolicDevice& device = f.device;
  SymbolicSize state_len("state_len");
  TensorMatcher(kFn, {state_len}).dtype<int64_t>().device(device).verify(state, "state");
  const int64_t ring_numel = state_len.value() - kStateHeaderFields;
  KVCANARY_CHECK_ARG(ring_numel >= 0 && ring_numel % kViolationFields == 0, ValueError, kFn, "state")
      << "expected " << kStateHeaderFields << " header elements then ring_capacity x " << kViolationFields
      << " ring elements, got length " << state_len.value();
  KVCANARY_CHECK_ARG(ring_numel / kViolationFields <= INT32_MAX, ValueError, kFn, "state")
      << "ring_capacity must be <= 2^31-1, got " << ring_numel / kViolationFields;
  SymbolicSize ring_capacity("ring_capacity");
  ring_capacity.bind(ring_numel / kViolationFields, "state");
  int64_t* mirror = nullptr;
  if (status_mirror.has_value()) {
    TensorMatcher(kFn, {kStateHeaderFields}).dtype<int64_t>().verify(status_mirror.value(), "status_mirror");
    check_host_memory(kFn, "status_mirror", status_mirror.value());
    mirror = data_of<int64_t>(status_mirror.value());
#if KVCANARY_DEVICE_BUILD
    mirror = pinned_device_address(kFn, "status_mirror", mirror);  // (the kernel stores through the device's address)
#endif
  }

  SymbolicSize num_slots("num_slots");
  SymbolicSize slot_stride("slot_stride_bytes");
  TensorMatcher(kFn, {num_slots, slot_stride}).dtype<uint8_t>().device(device).verify(canary_buf, "canary_buf");
  KVCANARY_CHECK_ARG(slot_stride.value() >= kMinSlotStrideBytes, ValueError, kFn, "canary_buf")
      << "slot_stride_bytes (shape[1]) must be >= " << kMinSlotStrideBytes << ", got " << slot_stride.value();
  ViolationSink meta_sink{};
  const int64_t* attribution = pack_violation_meta(kFn, device, ring_capacity, num_slots, violation_meta,
                                                   std::nullopt, slot_attribution, meta_sink);

  CheckParams& p = f.params;
  PlanParams& q = p.plan;  // the write plan and the tables, as canary_plan_step binds them (canary_plan.cuh)
  WritePlanSizes& sizes = f.sizes;
  bind_write_plan(kFn, device, sizes, write_offsets, std::nullopt, write_seed_slot_indices, write_num_valid_reqs, q);
  bind_write_request_rows(kFn, device, sizes, write_request_rows, q);
  check_write_offsets_len(kFn, sizes);
  check_write_capacity(kFn, sizes);
  bind_req_to_token(kFn, device, req_to_token, q);
  bind_swa(kFn, device, swa_window_size, full_to_swa_index_mapping, q);
  // (per req_to_token row: the valid lengths do not bind batch_rows)
  bind_expected_tokens(kFn, device, sizes.batch_rows, expected_tokens, expected_valid_lens_by_row,
                       ValidLensArg{"expected_valid_lens_by_row", true}, kv_token_id_vs_position_offset, q);
  bind_token_mail(kFn, token_mail, token_mail_published, f.params);
  f.snapshots[0] = snapshot_out(kFn, device, input_ids_out, "input_ids_out");
  f.snapshots[1] = snapshot_out(kFn, device, positions_out, "positions_out");
  f.snapshots[2] = snapshot_out(kFn, device, out_cache_loc_out, "out_cache_loc_out");
  const RealKvSources sources =
      pack_real_kv_sources(kFn, device, num_slots.value(), real_kv_buf_0, real_kv_buf_1, real_kv_buf_2,
                           real_kv_buf_3, real_kv_source_params, num_sources, real_kv_hash_mode);
  KVCANARY_CHECK_ARG(check_tokens == 0 || check_tokens == 1, ValueError, kFn, "check_tokens")
      << "must be 0 or 1, got " << check_tokens;

  p.check.canary_buf = data_of<const uint8_t>(canary_buf);
  p.check.slot_stride_bytes = slot_stride.value();
  p.check.num_slots = num_slots.value();
  p.check.records_aligned16 = reinterpret_cast<uintptr_t>(p.check.canary_buf) % kRealKvAlignBytes == 0 &&
                              p.check.slot_stride_bytes % kRealKvAlignBytes == 0;
  p.check.check_tokens = check_tokens == 1;
  p.check.sources = sources;
  p.check.slot_attribution = attribution;
  p.state = data_of<int64_t>(state);
  p.status_mirror = mirror;
  p.ring_capacity = static_cast<int32_t>(ring_capacity.value());
  p.violation_meta = meta_sink.meta;
  p.input_ids_out = f.snapshots[0].data;
  p.positions_out = f.snapshots[1].data;
  p.out_cache_loc_out = f.snapshots[2].data;
  return f;
}

/*! \brief One check of a forward's arrays with prepared fixed arguments: validate the forward's own (they must be on
 * the prepared device, fit the write plan and the snapshots), then launch (CUDA) or run (CPU). */
inline void check_launch(const CheckPrepared& f, TensorView req_pool_indices, TensorView prefix_lens,
                         TensorView extend_lens, TensorView input_ids, TensorView positions, TensorView out_cache_loc,
                         int64_t new_forward, int64_t forward_step_value, int64_t pending_write_tokens) {
  constexpr const char* kFn = "canary_check_step";
  // 1. validate the forward's arrays (a batch refused here enqueues nothing: a pending write stays pending)
  SymbolicDevice device = f.device;
  WritePlanSizes sizes = f.sizes;
  CheckParams p = f.params;
  PlanParams& q = p.plan;
  bind_batch_rows(kFn, device, sizes, BatchDtypes::kInt32OrInt64, req_pool_indices, prefix_lens, extend_lens, q);
  check_batch_fits(kFn, sizes);
  SymbolicSize num_tokens("num_tokens");
  p.input_ids = int_array(kFn, num_tokens, device, input_ids, "input_ids");
  p.positions = int_array(kFn, num_tokens, device, positions, "positions");
  p.out_cache_loc = int_array(kFn, num_tokens, device, out_cache_loc, "out_cache_loc");
  for (const SnapshotOut& out : f.snapshots) {
    snapshot_fits(kFn, num_tokens, out);
  }
  KVCANARY_CHECK_ARG(new_forward == 0 || new_forward == 1, ValueError, kFn, "new_forward")
      << "must be 0 or 1, got " << new_forward;
  if (pending_write_tokens >= 0) {
    KVCANARY_CHECK_ARG(f.defers_writes, ValueError, kFn, "pending_write_tokens")
        << "is " << pending_write_tokens
        << " but the check was bound without deferred_write_chain_assert (-1: no pending write)";
    for (const SnapshotOut& out : f.snapshots) {
      KVCANARY_CHECK_ARG(pending_write_tokens <= out.len, ValueError, kFn, "pending_write_tokens")
          << "is " << pending_write_tokens << ", more than " << out.arg << " holds (" << out.len << ")";
    }
    p.deferred_write.num_tokens = pending_write_tokens;
    p.has_deferred_write = true;
  }

  // 2. the forward's own parameters
  q.out_cache_loc = p.out_cache_loc;  // the padding rows (canary_plan.cuh)
  q.num_tokens = num_tokens.value();
  p.num_tokens = num_tokens.value();
  p.new_forward = new_forward == 1;
  p.forward_step_value = forward_step_value;

#if KVCANARY_DEVICE_BUILD
  // 3. device guard + stream
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = current_stream(dev);
  // 4. launch: one wave at most, fewer blocks when the batch's rows bound the entries (a shape, never data: a
  // graph captured at batch size bs replays with the grid of bs).
  const int64_t most_entries = q.batch_rows * (q.max_context + 2);
  const int64_t wanted = ceil_div(most_entries > 0 ? most_entries : 1, kCheckThreads);
  const int64_t resident = check_resident_blocks(dev.device_id);
  const int64_t blocks = wanted < resident ? wanted : resident;
  launch_kernel(canary_check_kernel, static_cast<uint32_t>(blocks > 0 ? blocks : 1), kCheckThreads, stream, p);
#else
  // 3-4. CPU: the same per-row and per-entry semantics in one loop.
  canary_check_cpu(p);
#endif
}

/*! \brief See the file comment. */
inline void canary_check_step(
    TensorView state, tvm::ffi::Optional<TensorView> status_mirror, tvm::ffi::Optional<TensorView> violation_meta, tvm::ffi::Optional<TensorView> slot_attribution,
    TensorView canary_buf, TensorView write_offsets, TensorView write_seed_slot_indices,
    TensorView write_num_valid_reqs, tvm::ffi::Optional<TensorView> write_request_rows, TensorView req_pool_indices,
    TensorView prefix_lens, TensorView extend_lens, TensorView req_to_token, int64_t swa_window_size,
    tvm::ffi::Optional<TensorView> full_to_swa_index_mapping, tvm::ffi::Optional<TensorView> expected_tokens,
    tvm::ffi::Optional<TensorView> expected_valid_lens_by_row, tvm::ffi::Optional<TensorView> token_mail,
    tvm::ffi::Optional<TensorView> token_mail_published, int64_t kv_token_id_vs_position_offset,
    TensorView input_ids, TensorView positions, TensorView out_cache_loc, TensorView input_ids_out,
    TensorView positions_out, TensorView out_cache_loc_out, TensorView real_kv_buf_0, TensorView real_kv_buf_1,
    TensorView real_kv_buf_2, TensorView real_kv_buf_3, TensorView real_kv_source_params, int64_t num_sources,
    int64_t real_kv_hash_mode, int64_t check_tokens, int64_t new_forward, int64_t forward_step_value) {
  const CheckPrepared f = check_prepare(state, status_mirror, violation_meta, slot_attribution, canary_buf,
                                        write_offsets, write_seed_slot_indices, write_num_valid_reqs,
                                        write_request_rows, req_to_token, swa_window_size, full_to_swa_index_mapping,
                                        expected_tokens, expected_valid_lens_by_row, token_mail,
                                        token_mail_published, kv_token_id_vs_position_offset,
                                        input_ids_out, positions_out, out_cache_loc_out, real_kv_buf_0,
                                        real_kv_buf_1, real_kv_buf_2, real_kv_buf_3, real_kv_source_params,
                                        num_sources, real_kv_hash_mode, check_tokens);
  check_launch(f, req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, new_forward,
               forward_step_value, /*pending_write_tokens=*/-1);
}

/*! \brief The tensors canary_check_bind's function owns for its whole life (their storage backs CheckPrepared's
 * pointers). */
struct CheckFixedArgs {
  BoundTensor state;
  BoundOptionalTensor status_mirror;
  BoundOptionalTensor violation_meta;
  BoundOptionalTensor slot_attribution;
  BoundTensor canary_buf;
  BoundTensor write_offsets;
  BoundTensor write_seed_slot_indices;
  BoundTensor write_num_valid_reqs;
  BoundOptionalTensor write_request_rows;
  BoundTensor req_to_token;
  BoundOptionalTensor full_to_swa_index_mapping;
  BoundOptionalTensor expected_tokens;
  BoundOptionalTensor expected_valid_lens_by_row;
  BoundOptionalTensor token_mail;
  BoundOptionalTensor token_mail_published;
  BoundTensor input_ids_out;
  BoundTensor positions_out;
  BoundTensor out_cache_loc_out;
  BoundRealKvSources real_kv;
  BoundOptionalTensor deferred_write_chain_assert;
  BoundOptionalTensor deferred_write_row_serials;
};

/*!
 * \brief canary_check_step with every argument but the forward's own bound, validated and extracted once: returns a
 * function of (req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, new_forward,
 * forward_step_value, pending_write_tokens) that checks those and launches with the prepared parameters (check_launch:
 * the export's checks of them, its errors, its launch).
 * Deferred write (issue 25; the file comment): with deferred_write_chain_assert (the write's enable_chain_position_assert)
 * and optionally deferred_write_row_serials (its row_serials) bound, a call with pending_write_tokens = n >= 0 runs the
 * write of the previous check's forward over the snapshot's first n tokens inside this launch; -1: none. Stream order
 * keeps its meaning: it reads the plan and snapshot the previous check stored, before this launch overwrites them. A bad fixed argument raises here, as the export's call would name it;
 * the function owns the bound tensors, so their storage lives as long as it does. The pinned status mirror's device
 * address is resolved here too (a driver query the export makes per call).
 * Stream: tvm-ffi sets the env stream a launch reads (launch.h current_stream) from the first CUDA torch tensor of a
 * call, and the bound ones are no longer passed. The call's first argument, req_pool_indices, is the forward's own
 * CUDA tensor, and a CUDA launch only runs once check_launch has checked that it and the other batch arrays are
 * on the device, so every launch is on torch's current stream (inside graph capture, the capturing stream: a launch
 * on another stream would silently drop out of the graph).
 */
inline tvm::ffi::Function canary_check_bind(
    tvm::ffi::Tensor state, tvm::ffi::Optional<tvm::ffi::Tensor> status_mirror,
    tvm::ffi::Optional<tvm::ffi::Tensor> violation_meta,
    tvm::ffi::Optional<tvm::ffi::Tensor> slot_attribution, tvm::ffi::Tensor canary_buf, tvm::ffi::Tensor write_offsets,
    tvm::ffi::Tensor write_seed_slot_indices, tvm::ffi::Tensor write_num_valid_reqs,
    tvm::ffi::Optional<tvm::ffi::Tensor> write_request_rows, tvm::ffi::Tensor req_to_token, int64_t swa_window_size,
    tvm::ffi::Optional<tvm::ffi::Tensor> full_to_swa_index_mapping, tvm::ffi::Optional<tvm::ffi::Tensor> expected_tokens,
    tvm::ffi::Optional<tvm::ffi::Tensor> expected_valid_lens_by_row, tvm::ffi::Optional<tvm::ffi::Tensor> token_mail,
    tvm::ffi::Optional<tvm::ffi::Tensor> token_mail_published, int64_t kv_token_id_vs_position_offset,
    tvm::ffi::Tensor input_ids_out, tvm::ffi::Tensor positions_out, tvm::ffi::Tensor out_cache_loc_out,
    tvm::ffi::Tensor real_kv_buf_0, tvm::ffi::Tensor real_kv_buf_1, tvm::ffi::Tensor real_kv_buf_2,
    tvm::ffi::Tensor real_kv_buf_3, tvm::ffi::Tensor real_kv_source_params, int64_t num_sources,
    int64_t real_kv_hash_mode, int64_t check_tokens, tvm::ffi::Optional<tvm::ffi::Tensor> deferred_write_chain_assert,
    tvm::ffi::Optional<tvm::ffi::Tensor> deferred_write_row_serials) {
  constexpr const char* kFn = "canary_check_step";
  KVCANARY_CHECK_ARG(deferred_write_chain_assert.has_value() || !deferred_write_row_serials.has_value(), ValueError,
                     kFn, "deferred_write_row_serials")
      << "needs deferred_write_chain_assert (the deferred write's other argument)";
  CheckFixedArgs fixed{BoundTensor(std::move(state)),
                       BoundOptionalTensor(std::move(status_mirror)),
                       BoundOptionalTensor(std::move(violation_meta)),
                       BoundOptionalTensor(std::move(slot_attribution)),
                       BoundTensor(std::move(canary_buf)),
                       BoundTensor(std::move(write_offsets)),
                       BoundTensor(std::move(write_seed_slot_indices)),
                       BoundTensor(std::move(write_num_valid_reqs)),
                       BoundOptionalTensor(std::move(write_request_rows)),
                       BoundTensor(std::move(req_to_token)),
                       BoundOptionalTensor(std::move(full_to_swa_index_mapping)),
                       BoundOptionalTensor(std::move(expected_tokens)),
                       BoundOptionalTensor(std::move(expected_valid_lens_by_row)),
                       BoundOptionalTensor(std::move(token_mail)),
                       BoundOptionalTensor(std::move(token_mail_published)),
                       BoundTensor(std::move(input_ids_out)),
                       BoundTensor(std::move(positions_out)),
                       BoundTensor(std::move(out_cache_loc_out)),
                       BoundRealKvSources(std::move(real_kv_buf_0), std::move(real_kv_buf_1),
                                          std::move(real_kv_buf_2), std::move(real_kv_buf_3),
                                          std::move(real_kv_source_params), num_sources, real_kv_hash_mode),
                       BoundOptionalTensor(std::move(deferred_write_chain_assert)),
                       BoundOptionalTensor(std::move(deferred_write_row_serials))};
  const CheckFixedArgs& b = fixed;
  CheckPrepared prepared = check_prepare(
      b.state.view, b.status_mirror.view, b.violation_meta.view, b.slot_attribution.view, b.canary_buf.view,
      b.write_offsets.view, b.write_seed_slot_indices.view, b.write_num_valid_reqs.view, b.write_request_rows.view,
      b.req_to_token.view, swa_window_size, b.full_to_swa_index_mapping.view, b.expected_tokens.view,
      b.expected_valid_lens_by_row.view, b.token_mail.view, b.token_mail_published.view, kv_token_id_vs_position_offset,
      b.input_ids_out.view, b.positions_out.view,
      b.out_cache_loc_out.view, b.real_kv.buf_0.view, b.real_kv.buf_1.view, b.real_kv.buf_2.view,
      b.real_kv.buf_3.view, b.real_kv.source_params.view, b.real_kv.num_sources, b.real_kv.hash_mode, check_tokens);
  if (b.deferred_write_chain_assert.view.has_value()) {
    bind_deferred_write(kFn, prepared, b.canary_buf.view, b.write_request_rows.view.has_value(),
                        b.deferred_write_chain_assert.view.value(),
                        b.deferred_write_row_serials.view);
  }
  return tvm::ffi::Function::FromTyped(
      [owned = std::move(fixed), f = std::move(prepared)](
          TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens, TensorView input_ids,
          TensorView positions, TensorView out_cache_loc, int64_t new_forward, int64_t forward_step_value,
          int64_t pending_write_tokens) {
        check_launch(f, req_pool_indices, prefix_lens, extend_lens, input_ids, positions, out_cache_loc, new_forward,
                     forward_step_value, pending_write_tokens);
      },
      "canary_check_bound");
}

}  // namespace host
}  // namespace kvcanary
