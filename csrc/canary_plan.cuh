/*!
 * \file canary_plan.cuh
 * \brief canary_plan_step: build one forward's write plan and verify plan on the device (SPEC §4.3).
 *
 * Computes, for each batch row r < bs with rp = req_pool_indices[r] != 0 that is not a padding row (below):
 *   verify entries for positions [window_start, prefix) with window_start = max(0, prefix - W) when
 *   an SWA window W > 0 is given, else 0: slot = T(req_to_token[rp, pos]), prev = T(req_to_token[rp,
 *   pos - 1]) or -1 at pos 0, expected token = expected_tokens[rp, pos + offset] when that index lies in
 *   [0, valid_len[r]) (else -1), expected position = pos; rows laid out in batch-row order.
 *   write plan: write_num_valid_reqs = bs; offsets = exclusive prefix sum of extend lens (rows with
 *   rp = 0 and padding rows count 0); seed = T(req_to_token[rp, prefix - 1]) when prefix > 0 and extend > 0,
 *   else -1.
 * Padding rows (kvcanary+, with out_cache_loc): a row with rp != 0 and extend > 0 whose first new token lands on the
 *   padding slot (out_cache_loc[offsets[r]] == kPaddingSlot, offsets[r] < num_tokens) is a padding row: no window
 *   entries, no write (its range is empty), seed -1; its index-error entries (rp, prefix) stay. A CUDA-graph runner
 *   pads the batch at its tail with rows whose tokens all write slot 0 but whose req_pool_indices and positions may
 *   be an earlier fill's (sglang 0.5.12's decode graphs): the plan must not verify or write for them. A padding row's
 *   range is empty, so every later row that writes starts at the same token and is a padding row too: the padding
 *   is the tail from the first such row on. On the device the rows are scanned in parallel by the equivalent rule:
 *   with start_r = the exclusive prefix sum of extend lens by rp alone (rows with rp = 0 count 0) and C = the
 *   smallest start_r of a writing row whose first token is on the padding slot, a writing row is padding iff
 *   start_r >= C. Without out_cache_loc (canary_plan_step) only rp = 0 makes a padding row.
 *   T is the SWA LUT (full_to_swa_index_mapping) when given, else the identity.
 *   If the verify total exceeds the verify capacity: num_valid = capacity, enable = 0 and no entry
 *   is written (the host drains `enable` and warns); else num_valid = total, enable = 1.
 * Index errors (kvcanary+): nothing the engine hands the plan is dereferenced out of range. An rp
 *   outside req_to_token, a prefix outside [0, max_context_len], a negative extend, a req_to_token
 *   value outside the LUT each become one verify entry whose slot is kPlanIndexErrorFlag | value (and
 *   expected position -1, prev 0); verify reports it as kReasonSlotOutOfRange. Such a row keeps its
 *   write range (its tokens are in the batch) with seed -1; a bad prefix clips the window to the table.
 * Grid:  CUDA: two launches, both sized by capacities only. Rows: 1 block of kPlanRowThreads threads
 *        scanning rows in chunks (block-wide prefix sums). Entries: min(ceil(verify_capacity /
 *        kPlanEntryThreads), SMs * kPlanEntryBlocksPerSm) blocks, grid-stride; each entry finds its row
 *        by binary search over verify_row_offsets. CPU: one loop.
 * Block: rows kernel kPlanRowThreads threads; entries kernel kPlanEntryThreads threads.
 * Reads:  batch rows, req_to_token, the LUT, the expected-token table and valid lengths, out_cache_loc at the
 *         rows' first tokens (kvcanary+).
 * Writes: write plan (offsets, seeds, num_valid, verify_row_offsets), verify plan (entries, num_valid,
 *         enable). Entries past num_valid are left untouched.
 * Expected tokens: the table may be int32 (sglang's req_to_verify_expected_tokens, like req_to_token)
 *   or int64; an int32 table gives the same plan as its int64 copy.
 * kvcanary+ (canary_plan_step_attributed: the arguments above, then five more; tensors optional):
 *   write_request_rows [write_capacity]: rp of each write-plan row (0 for rows past bs);
 *   verify_request_rows [verify_capacity]: rp of the batch row each verify entry came from (written with
 *   the entries); forward_counter [1] with forward_step_value: the plan starts a forward, so it sets the
 *   counter (by one thread) that the verify and write launches of the same forward read: to
 *   forward_step_value when that is >= 0 (a launch whose forward number the host knows), else to the
 *   counter + 1 (a launch captured in a CUDA graph: each replay counts one forward); out_cache_loc
 *   [num_tokens] (int32 or int64): the forward's slots, for the padding rows above.
 */
#pragma once

#include <cstdint>

#include "kvcanary/atomics.h"
#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/tensor_check.h"
#include "meta_args.cuh"
#include "verify_plan_args.cuh"

namespace kvcanary {

constexpr uint32_t kPlanRowThreads = 1024;
constexpr uint32_t kPlanEntryThreads = 256;
constexpr uint32_t kPlanEntryBlocksPerSm = 8;

/*! \brief A batch array the engine hands over as int32 or int64 (sglang keeps some lens in int32). */
struct IntArray {
  const void* data;
  bool i32;
  KVCANARY_HD int64_t operator[](int64_t i) const {
    return i32 ? static_cast<int64_t>(static_cast<const int32_t*>(data)[i]) : static_cast<const int64_t*>(data)[i];
  }
};

struct PlanParams {
  // batch rows
  IntArray req_pool_indices;
  IntArray prefix_lens;
  IntArray extend_lens;
  int64_t batch_rows;
  // req_to_token [req_rows, max_context] (row stride in elements)
  const int32_t* req_to_token;
  int64_t req_rows;
  int64_t max_context;
  int64_t req_to_token_row_stride;
  // SWA
  int64_t swa_window;
  const int64_t* lut;  // nullptr: no translation
  int64_t lut_len;
  // expected tokens [exp_rows, exp_cols] (int32 or int64) indexed by rp; valid lengths per batch row, or
  // (valid_lens_rows > 0) per req_to_token row: expected_valid_lens[clamp(rp, 0, valid_lens_rows - 1)]
  const void* expected_tokens;  // nullptr: no token expectations
  bool expected_tokens_i32;
  int64_t exp_rows;
  int64_t exp_cols;
  int64_t exp_row_stride;
  const int64_t* expected_valid_lens;
  int64_t valid_lens_rows;
  int64_t token_offset;
  // write plan
  int64_t* write_offsets;
  int64_t* write_seeds;
  int32_t* write_num_valid;
  int64_t* verify_row_offsets;
  int64_t write_capacity;
  // verify plan
  int64_t* slots;
  int64_t* expected_tok;
  int64_t* expected_pos;
  int64_t* prevs;
  int32_t* verify_num_valid;
  int32_t* verify_enable;
  int64_t verify_capacity;
  // kvcanary+ (nullptr: off)
  int64_t* write_request_rows;   // [write_capacity]
  int64_t* verify_request_rows;  // [verify_capacity]
  int64_t* forward_counter;      // [1]
  int64_t forward_step_value;    // >= 0: the value to set; < 0: add 1
  // the forward's slots [num_tokens] (int32 or int64): rows whose first new token is on the padding slot are
  // padding rows; data nullptr: only rp = 0 makes a padding row
  IntArray out_cache_loc;
  int64_t num_tokens;
};

/*! \brief What one batch row contributes to the plans. */
struct RowPlan {
  int64_t rp;
  bool rp_ok;            // rp indexes req_to_token
  int64_t window_start;  // first verified position
  int64_t window_end;    // one past the last verified position (prefix clipped to the table)
  bool bad_prefix;
  bool bad_extend;
  int64_t verify_count;
  int64_t write_count;
  int64_t seed;
};

KVCANARY_HD int64_t plan_index_error(int64_t value) { return kPlanIndexErrorFlag | (value & kPlanIndexValueMask); }

/*! \brief req_to_token[rp, pos] translated through the LUT; rp and pos must be in range. */
KVCANARY_HD int64_t plan_slot(const PlanParams& p, int64_t rp, int64_t pos) {
  const int64_t full = static_cast<int64_t>(p.req_to_token[rp * p.req_to_token_row_stride + pos]);
  if (p.lut == nullptr || full < 0) {
    return full;  // negatives pass through: verify reports them as out of range
  }
  return full < p.lut_len ? p.lut[full] : plan_index_error(full);
}

/*! \brief Whether batch row r writes tokens (rp != 0, extend > 0): the rows the padding-slot rule applies to. */
KVCANARY_HD bool plan_row_writes(const PlanParams& p, int64_t r) {
  return p.req_pool_indices[r] != kPaddingReqPoolRow && p.extend_lens[r] > 0;
}

/*! \brief Tokens batch row r takes on the token axis by its rp alone (rows with rp 0 take none). */
KVCANARY_HD int64_t plan_row_tokens(const PlanParams& p, int64_t r) {
  const int64_t extend = p.extend_lens[r];
  return p.req_pool_indices[r] == kPaddingReqPoolRow || extend < 0 ? 0 : extend;
}

/*! \brief Whether batch row r writes and its tokens, starting at token `start`, start on the padding slot. */
KVCANARY_HD bool plan_starts_on_padding_slot(const PlanParams& p, int64_t r, int64_t start) {
  return p.out_cache_loc.data != nullptr && start < p.num_tokens && plan_row_writes(p, r) &&
         p.out_cache_loc[start] == kPaddingSlot;
}

/*!
 * \brief Whether batch row r is a padding row by the padding-slot rule, read back from a stored write plan: a row
 * that writes has a non-empty range unless it is one.
 */
KVCANARY_HD bool plan_padding_from_offsets(const PlanParams& p, int64_t r) {
  return p.out_cache_loc.data != nullptr && plan_row_writes(p, r) && p.write_offsets[r + 1] == p.write_offsets[r];
}

/*!
 * \brief What batch row r contributes; `padding`: the row is a padding row by the padding-slot rule (see the file
 * comment): no window entries, no write, no seed; its index-error entries stay.
 */
KVCANARY_HD RowPlan plan_row(const PlanParams& p, int64_t r, bool padding) {
  RowPlan row{};
  row.seed = kChainHeadSlot;
  row.rp = p.req_pool_indices[r];
  if (row.rp == kPaddingReqPoolRow) {
    return row;
  }
  const int64_t prefix = p.prefix_lens[r];
  const int64_t extend = p.extend_lens[r];
  row.bad_extend = extend < 0;
  row.write_count = row.bad_extend || padding ? 0 : extend;
  row.rp_ok = row.rp >= 0 && row.rp < p.req_rows;
  if (!row.rp_ok) {
    row.verify_count = 1;
    return row;
  }
  row.bad_prefix = prefix < 0 || prefix > p.max_context;
  row.window_end = prefix < 0 ? 0 : (prefix > p.max_context ? p.max_context : prefix);
  const int64_t windowed = row.window_end - p.swa_window;
  row.window_start = (p.swa_window > 0 && windowed > 0) ? windowed : 0;
  if (padding) {
    row.window_start = row.window_end;  // no window entries
  }
  row.verify_count = (row.window_end - row.window_start) + (row.bad_prefix ? 1 : 0) + (row.bad_extend ? 1 : 0);
  if (!padding && !row.bad_prefix && prefix > 0 && extend > 0) {
    row.seed = plan_slot(p, row.rp, prefix - 1);
  }
  return row;
}

/*! \brief Valid expected tokens of batch row r (request row rp). */
KVCANARY_HD int64_t plan_valid_len(const PlanParams& p, int64_t r, int64_t rp) {
  if (p.valid_lens_rows <= 0) {
    return p.expected_valid_lens[r];
  }
  const int64_t row = rp < 0 ? 0 : (rp >= p.valid_lens_rows ? p.valid_lens_rows - 1 : rp);
  return p.expected_valid_lens[row];
}

KVCANARY_HD int64_t plan_expected_token(const PlanParams& p, int64_t r, int64_t rp, int64_t pos) {
  if (p.expected_tokens == nullptr || rp < 0 || rp >= p.exp_rows) {
    return kNoExpectedToken;
  }
  const int64_t index = pos + p.token_offset;
  if (index < 0 || index >= plan_valid_len(p, r, rp) || index >= p.exp_cols) {
    return kNoExpectedToken;
  }
  const int64_t at = rp * p.exp_row_stride + index;
  return p.expected_tokens_i32 ? static_cast<int64_t>(static_cast<const int32_t*>(p.expected_tokens)[at])
                               : static_cast<const int64_t*>(p.expected_tokens)[at];
}

/*! \brief One verify entry: what verify checks for a slot. */
struct PlanEntry {
  int64_t slot;
  int64_t prev;
  int64_t token;
  int64_t position;
};

/*! \brief The k-th verify entry of batch row r. */
KVCANARY_HD PlanEntry plan_entry(const PlanParams& p, int64_t r, const RowPlan& row, int64_t k) {
  PlanEntry out{0, kUnknownPrevSlot, kNoExpectedToken, kNoExpectedPosition};
  const int64_t window = row.rp_ok ? row.window_end - row.window_start : 0;
  if (!row.rp_ok) {
    out.slot = plan_index_error(row.rp);
  } else if (k < window) {
    out.position = row.window_start + k;
    out.slot = plan_slot(p, row.rp, out.position);
    out.prev = out.position > 0 ? plan_slot(p, row.rp, out.position - 1) : kChainHeadSlot;
    out.token = plan_expected_token(p, r, row.rp, out.position);
  } else if (k == window && row.bad_prefix) {
    out.slot = plan_index_error(p.prefix_lens[r]);
  } else {
    out.slot = plan_index_error(p.extend_lens[r]);
  }
  return out;
}

/*! \brief Write verify entry `e`, the k-th entry of batch row r. */
KVCANARY_HD void plan_verify_entry(const PlanParams& p, int64_t r, const RowPlan& row, int64_t k, int64_t e) {
  const PlanEntry entry = plan_entry(p, r, row, k);
  p.slots[e] = entry.slot;
  if (p.verify_request_rows != nullptr) p.verify_request_rows[e] = row.rp;
  p.prevs[e] = entry.prev;
  p.expected_tok[e] = entry.token;
  p.expected_pos[e] = entry.position;
}

/*! \brief Totals → verify num_valid / enable; write num_valid. Done once, by one thread. */
KVCANARY_HD void plan_finish(const PlanParams& p, int64_t verify_total) {
  const bool overflow = verify_total > p.verify_capacity;
  *p.verify_num_valid = static_cast<int32_t>(overflow ? p.verify_capacity : verify_total);
  *p.verify_enable = overflow ? 0 : 1;
  *p.write_num_valid = static_cast<int32_t>(p.batch_rows);
  if (p.forward_counter != nullptr) {
    if (p.forward_step_value >= 0) {
      *p.forward_counter = p.forward_step_value;
    } else {
      atomic_add_i64(p.forward_counter, 1);
    }
  }
}

/*! \brief Row r of the write plan (r < write_capacity; rows past bs are empty, with rp 0). */
KVCANARY_HD void plan_store_write_row(const PlanParams& p, int64_t r, int64_t rp, int64_t seed, int64_t write_end) {
  p.write_seeds[r] = seed;
  if (p.write_request_rows != nullptr) p.write_request_rows[r] = rp;
  p.write_offsets[r + 1] = write_end;
}

/*! \brief Row r of both plans. */
KVCANARY_HD void plan_store_row(const PlanParams& p, int64_t r, int64_t rp, int64_t seed, int64_t write_end,
                                int64_t verify_end) {
  plan_store_write_row(p, r, rp, seed, write_end);
  p.verify_row_offsets[r + 1] = verify_end;
}

#if KVCANARY_DEVICE_BUILD

/*! \brief Inclusive block-wide sum of two counters at once over kThreads threads; returns the block totals. */
template <uint32_t kThreads>
__device__ __forceinline__ void block_inclusive_scan2(int64_t& a, int64_t& b, int64_t& total_a, int64_t& total_b) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr uint32_t kWarps = kThreads / 32;
  __shared__ int64_t warp_a[kWarps];
  __shared__ int64_t warp_b[kWarps];
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t warp = threadIdx.x / 32;
#pragma unroll
  for (uint32_t d = 1; d < 32; d *= 2) {
    const int64_t ua = __shfl_up_sync(0xffffffffu, a, d);
    const int64_t ub = __shfl_up_sync(0xffffffffu, b, d);
    if (lane >= d) {
      a += ua;
      b += ub;
    }
  }
  if (lane == 31) {
    warp_a[warp] = a;
    warp_b[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    int64_t wa = lane < kWarps ? warp_a[lane] : 0;
    int64_t wb = lane < kWarps ? warp_b[lane] : 0;
#pragma unroll
    for (uint32_t d = 1; d < 32; d *= 2) {
      const int64_t ua = __shfl_up_sync(0xffffffffu, wa, d);
      const int64_t ub = __shfl_up_sync(0xffffffffu, wb, d);
      if (lane >= d) {
        wa += ua;
        wb += ub;
      }
    }
    if (lane < kWarps) {
      warp_a[lane] = wa;
      warp_b[lane] = wb;
    }
  }
  __syncthreads();
  if (warp > 0) {
    a += warp_a[warp - 1];
    b += warp_b[warp - 1];
  }
  total_a = warp_a[kWarps - 1];
  total_b = warp_b[kWarps - 1];
  __syncthreads();  // warp_a/warp_b are reused by the next chunk
}

/*!
 * \brief Whether row r of the current chunk is a padding row by the padding-slot rule, by the parallel form of the
 * file comment: `carry_tokens` is the tokens the rows before the chunk take by rp alone (advanced past the chunk
 * here), `cut` (shared, INT64_MAX before the first chunk) the smallest start of a writing row on the padding slot
 * so far. Every thread of the block calls it once per chunk (block-wide scans); r >= batch_rows: false.
 */
template <uint32_t kThreads>
__device__ __forceinline__ bool plan_chunk_padding(const PlanParams& p, int64_t r, int64_t& carry_tokens,
                                                   long long* cut) {
  if (p.out_cache_loc.data == nullptr) {
    return false;  // (the same for every thread of the launch: no thread skips the scans below alone)
  }
  const bool in_batch = r < p.batch_rows;
  const int64_t tokens = in_batch ? plan_row_tokens(p, r) : 0;
  int64_t end = tokens;
  int64_t unused = 0;
  int64_t total = 0;
  int64_t total_unused = 0;
  block_inclusive_scan2<kThreads>(end, unused, total, total_unused);
  const int64_t start = carry_tokens + end - tokens;
  if (in_batch && plan_starts_on_padding_slot(p, r, start)) {
    atomicMin(cut, static_cast<long long>(start));
  }
  __syncthreads();
  carry_tokens += total;
  return in_batch && plan_row_writes(p, r) && start >= static_cast<int64_t>(*cut);
}

KVCANARY_KERNEL void __launch_bounds__(kPlanRowThreads) canary_plan_rows_kernel(const __grid_constant__ PlanParams p) {
  __shared__ long long s_cut;
  if (threadIdx.x == 0) {
    s_cut = INT64_MAX;
  }
  __syncthreads();
  int64_t carry_tokens = 0;
  int64_t carry_write = 0;
  int64_t carry_verify = 0;
  for (int64_t base = 0; base < p.write_capacity; base += kPlanRowThreads) {
    const int64_t r = base + threadIdx.x;
    const bool padding = plan_chunk_padding<kPlanRowThreads>(p, r, carry_tokens, &s_cut);
    RowPlan row{};
    row.seed = kChainHeadSlot;
    if (r < p.batch_rows) {
      row = plan_row(p, r, padding);
    }
    int64_t write_end = row.write_count;
    int64_t verify_end = row.verify_count;
    int64_t total_write = 0;
    int64_t total_verify = 0;
    block_inclusive_scan2<kPlanRowThreads>(write_end, verify_end, total_write, total_verify);
    if (r < p.write_capacity) {
      plan_store_row(p, r, row.rp, row.seed, carry_write + write_end, carry_verify + verify_end);
    }
    carry_write += total_write;
    carry_verify += total_verify;
  }
  if (threadIdx.x == 0) {
    p.write_offsets[0] = 0;
    p.verify_row_offsets[0] = 0;
    plan_finish(p, carry_verify);
  }
}

KVCANARY_KERNEL void __launch_bounds__(kPlanEntryThreads) canary_plan_entries_kernel(const __grid_constant__ PlanParams p) {
  if (*p.verify_enable == 0) {
    return;
  }
  const int64_t total = *p.verify_num_valid;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    // Row r: the last row whose start offset is <= e (empty rows share offsets with the next one).
    int64_t lo = 0;
    int64_t hi = p.batch_rows;  // verify_row_offsets[batch_rows] == total > e
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (p.verify_row_offsets[mid] <= e) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const RowPlan row = plan_row(p, lo, plan_padding_from_offsets(p, lo));  // (the rows kernel stored the plan)
    plan_verify_entry(p, lo, row, e - p.verify_row_offsets[lo], e);
  }
}

#else

inline void canary_plan_cpu(const PlanParams& p) {
  int64_t write_end = 0;
  int64_t verify_end = 0;
  p.write_offsets[0] = 0;
  p.verify_row_offsets[0] = 0;
  for (int64_t r = 0; r < p.write_capacity; ++r) {
    RowPlan row{};
    row.seed = kChainHeadSlot;
    if (r < p.batch_rows) {
      row = plan_row(p, r, plan_starts_on_padding_slot(p, r, write_end));  // (write_end: row r's first token)
    }
    write_end += row.write_count;
    verify_end += row.verify_count;
    plan_store_row(p, r, row.rp, row.seed, write_end, verify_end);
  }
  plan_finish(p, verify_end);
  if (*p.verify_enable == 0) {
    return;
  }
  for (int64_t r = 0; r < p.batch_rows; ++r) {
    const RowPlan row = plan_row(p, r, plan_padding_from_offsets(p, r));
    const int64_t start = p.verify_row_offsets[r];
    for (int64_t k = 0; k < row.verify_count; ++k) {
      plan_verify_entry(p, r, row, k, start + k);
    }
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

// Argument validation shared by canary_plan_step_attributed and canary_check_step (both bind a write plan, the batch
// rows and the tables a plan reads). Each helper validates one group and points PlanParams at it; each wrapper calls
// them in its own order, which decides the error a call with several bad arguments gets. Errors name `fn`.

/*! \brief The sizes a write plan's arguments bind (the names the errors print). */
struct WritePlanSizes {
  SymbolicSize offsets_len{"write_offsets_len"};
  SymbolicSize write_capacity{"write_capacity"};
  SymbolicSize batch_rows{"batch_rows"};
};

/*! \brief The dtypes a call accepts for its batch arrays (req_pool_indices, prefix_lens, extend_lens). */
enum class BatchDtypes {
  kInt64,         // canary_plan_step
  kInt32OrInt64,  // canary_check_step (sglang keeps some lens in int32)
};

/*! \brief expected_tokens' valid lengths: the argument's name and which row of it a batch row reads. */
struct ValidLensArg {
  const char* name;
  // false: [batch_rows], batch row r reads row r (canary_plan_step); true: [valid_lens_rows >= 1], one per
  // req_to_token row, batch row r reads row clamp(rp) (canary_check_step)
  bool per_request_row;
};

/*! \brief dtype check of a tensor that may be int32 or int64; returns whether it is int32. */
inline bool int32_or_int64(const char* fn, const TensorView& t, const char* arg) {
  const DLDataType dtype = t.dtype();
  const bool i32 = same_dtype(dtype, dtype_of<int32_t>());
  KVCANARY_CHECK_ARG(i32 || same_dtype(dtype, dtype_of<int64_t>()), TypeError, fn, arg)
      << "expected dtype int32 or int64, got " << dtype;
  return i32;
}

/*! \brief Validate a batch or snapshot array of `size` int32/int64 elements and wrap it. */
inline IntArray int_array(const char* fn, SymbolicSize& size, SymbolicDevice& device, const TensorView& t,
                          const char* arg) {
  const bool i32 = int32_or_int64(fn, t, arg);
  TensorMatcher(fn, {size}).device(device).verify(t, arg);
  return IntArray{data_of<const void>(t), i32};
}

/*!
 * \brief write_offsets [write_offsets_len], then `verify_row_offsets` (given by canary_plan_step only: it shares
 * write_offsets' length), write_seed_slot_indices [write_capacity], write_num_valid_reqs [1]; all on `device`.
 */
inline void bind_write_plan(const char* fn, SymbolicDevice& device, WritePlanSizes& sizes,
                            const TensorView& write_offsets, const tvm::ffi::Optional<TensorView>& verify_row_offsets,
                            const TensorView& write_seed_slot_indices, const TensorView& write_num_valid_reqs,
                            PlanParams& p) {
  TensorMatcher offsets(fn, {sizes.offsets_len});
  offsets.dtype<int64_t>().device(device).verify(write_offsets, "write_offsets");
  if (verify_row_offsets.has_value()) {
    offsets.verify(verify_row_offsets.value(), "verify_row_offsets");
  }
  TensorMatcher(fn, {sizes.write_capacity})
      .dtype<int64_t>()
      .device(device)
      .verify(write_seed_slot_indices, "write_seed_slot_indices");
  TensorMatcher(fn, {1}).dtype<int32_t>().device(device).verify(write_num_valid_reqs, "write_num_valid_reqs");
  p.write_offsets = data_of<int64_t>(write_offsets);
  p.verify_row_offsets = optional_data_of<int64_t>(verify_row_offsets);
  p.write_seeds = data_of<int64_t>(write_seed_slot_indices);
  p.write_num_valid = data_of<int32_t>(write_num_valid_reqs);
  p.write_capacity = sizes.write_capacity.value();
}

/*! \brief write_request_rows [write_capacity] int64 (optional: nullptr leaves the rows unrecorded). */
inline void bind_write_request_rows(const char* fn, SymbolicDevice& device, WritePlanSizes& sizes,
                                    const tvm::ffi::Optional<TensorView>& write_request_rows, PlanParams& p) {
  if (write_request_rows.has_value()) {
    TensorMatcher(fn, {sizes.write_capacity})
        .dtype<int64_t>()
        .device(device)
        .verify(write_request_rows.value(), "write_request_rows");
  }
  p.write_request_rows = optional_data_of<int64_t>(write_request_rows);
}

/*! \brief write_offsets has one element more than the write plan has rows. */
inline void check_write_offsets_len(const char* fn, const WritePlanSizes& sizes) {
  KVCANARY_CHECK_ARG(sizes.offsets_len.value() == sizes.write_capacity.value() + 1, ValueError, fn, "write_offsets")
      << "expected length write_capacity + 1 = " << sizes.write_capacity.value() + 1
      << " (write_capacity bound by write_seed_slot_indices), got " << sizes.offsets_len.value();
}

/*! \brief The write plan's row count fits its int32 num_valid. */
inline void check_write_capacity(const char* fn, const WritePlanSizes& sizes) {
  KVCANARY_CHECK_ARG(sizes.write_capacity.value() < INT32_MAX, ValueError, fn, "write_seed_slot_indices")
      << "write_capacity must be < 2^31, got " << sizes.write_capacity.value();
}

/*! \brief Every batch row has a write-plan row. */
inline void check_batch_fits(const char* fn, const WritePlanSizes& sizes) {
  KVCANARY_CHECK_ARG(sizes.batch_rows.value() <= sizes.write_capacity.value(), ValueError, fn, "req_pool_indices")
      << "batch has " << sizes.batch_rows.value() << " rows, more than the write plan's capacity "
      << sizes.write_capacity.value();
}

/*! \brief req_pool_indices, prefix_lens, extend_lens [batch_rows] of `dtypes`, in that order, on `device`. */
inline void bind_batch_rows(const char* fn, SymbolicDevice& device, WritePlanSizes& sizes, BatchDtypes dtypes,
                            const TensorView& req_pool_indices, const TensorView& prefix_lens,
                            const TensorView& extend_lens, PlanParams& p) {
  if (dtypes == BatchDtypes::kInt32OrInt64) {
    p.req_pool_indices = int_array(fn, sizes.batch_rows, device, req_pool_indices, "req_pool_indices");
    p.prefix_lens = int_array(fn, sizes.batch_rows, device, prefix_lens, "prefix_lens");
    p.extend_lens = int_array(fn, sizes.batch_rows, device, extend_lens, "extend_lens");
  } else {
    TensorMatcher(fn, {sizes.batch_rows})
        .dtype<int64_t>()
        .device(device)
        .verify(req_pool_indices, "req_pool_indices")
        .verify(prefix_lens, "prefix_lens")
        .verify(extend_lens, "extend_lens");
    p.req_pool_indices = IntArray{data_of<const void>(req_pool_indices), false};
    p.prefix_lens = IntArray{data_of<const void>(prefix_lens), false};
    p.extend_lens = IntArray{data_of<const void>(extend_lens), false};
  }
  p.batch_rows = sizes.batch_rows.value();
}

/*! \brief req_to_token [req_rows, max_context_len] int32 on `device`, rows may be strided. */
inline void bind_req_to_token(const char* fn, SymbolicDevice& device, const TensorView& req_to_token, PlanParams& p) {
  SymbolicSize req_rows("req_rows");
  SymbolicSize max_context("max_context_len");
  TensorMatcher(fn, {req_rows, max_context})
      .dtype<int32_t>()
      .device(device)
      .inner_contiguous()
      .verify(req_to_token, "req_to_token");
  p.req_to_token = data_of<const int32_t>(req_to_token);
  p.req_rows = req_rows.value();
  p.max_context = max_context.value();
  p.req_to_token_row_stride = p.req_rows > 1 ? stride_of(req_to_token, 0) : p.max_context;
}

/*! \brief swa_window_size >= 0, then the SWA LUT full_to_swa_index_mapping [lut_len] int64 (optional). */
inline void bind_swa(const char* fn, SymbolicDevice& device, int64_t swa_window_size,
                     const tvm::ffi::Optional<TensorView>& full_to_swa_index_mapping, PlanParams& p) {
  KVCANARY_CHECK_ARG(swa_window_size >= 0, ValueError, fn, "swa_window_size")
      << "must be >= 0 (0: no sliding window), got " << swa_window_size;
  SymbolicSize lut_len("lut_len");
  if (full_to_swa_index_mapping.has_value()) {
    TensorMatcher(fn, {lut_len})
        .dtype<int64_t>()
        .device(device)
        .verify(full_to_swa_index_mapping.value(), "full_to_swa_index_mapping");
  }
  p.swa_window = swa_window_size;
  p.lut = optional_data_of<const int64_t>(full_to_swa_index_mapping);
  p.lut_len = full_to_swa_index_mapping.has_value() ? lut_len.value() : 0;
}

/*!
 * \brief The expected-token pair (both or neither): expected_tokens [expected_rows, expected_cols] int32 or int64,
 * rows may be strided, then its valid lengths as `valid_lens_arg` says (int64; per batch row they share batch_rows).
 */
inline void bind_expected_tokens(const char* fn, SymbolicDevice& device, SymbolicSize& batch_rows,
                                 const tvm::ffi::Optional<TensorView>& expected_tokens,
                                 const tvm::ffi::Optional<TensorView>& valid_lens, ValidLensArg valid_lens_arg,
                                 int64_t kv_token_id_vs_position_offset, PlanParams& p) {
  KVCANARY_CHECK_ARG(expected_tokens.has_value() == valid_lens.has_value(), ValueError, fn,
                     expected_tokens.has_value() ? valid_lens_arg.name : "expected_tokens")
      << "expected_tokens and " << valid_lens_arg.name << " must be given together";
  SymbolicSize exp_rows("expected_rows");
  SymbolicSize exp_cols("expected_cols");
  SymbolicSize valid_rows("valid_lens_rows");
  bool expected_i32 = false;
  if (expected_tokens.has_value()) {
    expected_i32 = int32_or_int64(fn, expected_tokens.value(), "expected_tokens");
    TensorMatcher(fn, {exp_rows, exp_cols})
        .device(device)
        .inner_contiguous()
        .verify(expected_tokens.value(), "expected_tokens");
    TensorMatcher(fn, {valid_lens_arg.per_request_row ? valid_rows : batch_rows})
        .dtype<int64_t>()
        .device(device)
        .verify(valid_lens.value(), valid_lens_arg.name);
    KVCANARY_CHECK_ARG(!valid_lens_arg.per_request_row || valid_rows.value() >= 1, ValueError, fn,
                       valid_lens_arg.name)
        << "needs at least one row (one per req_to_token row), got 0";
  }
  p.expected_tokens = optional_data_of<const void>(expected_tokens);
  p.expected_tokens_i32 = expected_i32;
  p.exp_rows = expected_tokens.has_value() ? exp_rows.value() : 0;
  p.exp_cols = expected_tokens.has_value() ? exp_cols.value() : 0;
  p.exp_row_stride = expected_tokens.has_value() && p.exp_rows > 1 ? stride_of(expected_tokens.value(), 0) : p.exp_cols;
  p.expected_valid_lens = optional_data_of<const int64_t>(valid_lens);
  p.valid_lens_rows = valid_lens.has_value() && valid_lens_arg.per_request_row ? valid_rows.value() : 0;
  p.token_offset = kv_token_id_vs_position_offset;
}

/*! \brief The arguments of canary_plan_step, then the kvcanary+ ones (see the file comment). */
inline void canary_plan_step_attributed(
    TensorView write_offsets, TensorView write_seed_slot_indices, TensorView write_num_valid_reqs,
    TensorView verify_row_offsets, TensorView verify_slot_indices, TensorView verify_expected_tokens,
    TensorView verify_expected_positions, TensorView verify_prev_slot_indices, TensorView verify_num_valid,
    TensorView verify_enable, TensorView req_pool_indices, TensorView prefix_lens, TensorView extend_lens,
    TensorView req_to_token, int64_t swa_window_size, tvm::ffi::Optional<TensorView> full_to_swa_index_mapping,
    tvm::ffi::Optional<TensorView> expected_tokens, tvm::ffi::Optional<TensorView> expected_tokens_valid_lens,
    int64_t kv_token_id_vs_position_offset, tvm::ffi::Optional<TensorView> write_request_rows,
    tvm::ffi::Optional<TensorView> verify_request_rows, tvm::ffi::Optional<TensorView> forward_counter,
    int64_t forward_step_value, tvm::ffi::Optional<TensorView> out_cache_loc) {
  constexpr const char* kFn = "canary_plan_step";
  // 1. validate and extract parameters (this order decides the error a call with several bad arguments gets)
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);
  WritePlanSizes sizes;
  SymbolicSize verify_capacity("verify_capacity");
  PlanParams p{};
  bind_write_plan(kFn, device, sizes, write_offsets, verify_row_offsets, write_seed_slot_indices,
                  write_num_valid_reqs, p);
  check_verify_plan_buffers(kFn, device, verify_capacity, verify_slot_indices, verify_expected_tokens,
                            verify_expected_positions, verify_prev_slot_indices, verify_num_valid, verify_enable);
  bind_batch_rows(kFn, device, sizes, BatchDtypes::kInt64, req_pool_indices, prefix_lens, extend_lens, p);
  bind_req_to_token(kFn, device, req_to_token, p);
  check_write_offsets_len(kFn, sizes);
  check_batch_fits(kFn, sizes);
  check_write_capacity(kFn, sizes);
  KVCANARY_CHECK_ARG(verify_capacity.value() < INT32_MAX, ValueError, kFn, "verify_slot_indices")
      << "verify_capacity must be < 2^31, got " << verify_capacity.value();
  bind_swa(kFn, device, swa_window_size, full_to_swa_index_mapping, p);
  bind_expected_tokens(kFn, device, sizes.batch_rows, expected_tokens, expected_tokens_valid_lens,
                       ValidLensArg{"expected_tokens_valid_lens", false}, kv_token_id_vs_position_offset, p);
  bind_write_request_rows(kFn, device, sizes, write_request_rows, p);
  if (verify_request_rows.has_value()) {
    TensorMatcher(kFn, {verify_capacity})
        .dtype<int64_t>()
        .device(device)
        .verify(verify_request_rows.value(), "verify_request_rows");
  }
  if (forward_counter.has_value()) {
    TensorMatcher(kFn, {1}).dtype<int64_t>().device(device).verify(forward_counter.value(), "forward_counter");
  }
  SymbolicSize num_tokens("num_tokens");
  if (out_cache_loc.has_value()) {
    p.out_cache_loc = int_array(kFn, num_tokens, device, out_cache_loc.value(), "out_cache_loc");
    p.num_tokens = num_tokens.value();
  }
  p.slots = data_of<int64_t>(verify_slot_indices);
  p.expected_tok = data_of<int64_t>(verify_expected_tokens);
  p.expected_pos = data_of<int64_t>(verify_expected_positions);
  p.prevs = data_of<int64_t>(verify_prev_slot_indices);
  p.verify_num_valid = data_of<int32_t>(verify_num_valid);
  p.verify_enable = data_of<int32_t>(verify_enable);
  p.verify_capacity = verify_capacity.value();
  p.verify_request_rows = optional_data_of<int64_t>(verify_request_rows);
  p.forward_counter = optional_data_of<int64_t>(forward_counter);
  p.forward_step_value = forward_step_value;

#if KVCANARY_DEVICE_BUILD
  // 2. device guard + stream
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const cudaStream_t stream = current_stream(dev);
  // 3. launch: rows (one block), then entries (persistent grid); both sized by capacities only.
  launch_kernel(canary_plan_rows_kernel, 1u, kPlanRowThreads, stream, p);
  const int64_t wanted = ceil_div(p.verify_capacity, kPlanEntryThreads);
  const int64_t resident = static_cast<int64_t>(sm_count(dev.device_id)) * kPlanEntryBlocksPerSm;
  const int64_t blocks = wanted < resident ? wanted : resident;
  launch_kernel(canary_plan_entries_kernel, static_cast<uint32_t>(blocks > 0 ? blocks : 1), kPlanEntryThreads,
                stream, p);
#else
  // 2-3. CPU: the same per-row and per-entry semantics in a loop.
  canary_plan_cpu(p);
#endif
}

/*! \brief SPEC §4.3: no request rows, no forward counter. */
inline void canary_plan_step(TensorView write_offsets, TensorView write_seed_slot_indices,
                             TensorView write_num_valid_reqs, TensorView verify_row_offsets,
                             TensorView verify_slot_indices, TensorView verify_expected_tokens,
                             TensorView verify_expected_positions, TensorView verify_prev_slot_indices,
                             TensorView verify_num_valid, TensorView verify_enable, TensorView req_pool_indices,
                             TensorView prefix_lens, TensorView extend_lens, TensorView req_to_token,
                             int64_t swa_window_size, tvm::ffi::Optional<TensorView> full_to_swa_index_mapping,
                             tvm::ffi::Optional<TensorView> expected_tokens,
                             tvm::ffi::Optional<TensorView> expected_tokens_valid_lens,
                             int64_t kv_token_id_vs_position_offset) {
  canary_plan_step_attributed(write_offsets, write_seed_slot_indices, write_num_valid_reqs, verify_row_offsets,
                              verify_slot_indices, verify_expected_tokens, verify_expected_positions,
                              verify_prev_slot_indices, verify_num_valid, verify_enable, req_pool_indices,
                              prefix_lens, extend_lens, req_to_token, swa_window_size, full_to_swa_index_mapping,
                              expected_tokens, expected_tokens_valid_lens, kv_token_id_vs_position_offset,
                              std::nullopt, std::nullopt, std::nullopt, -1, std::nullopt);
}

}  // namespace host
}  // namespace kvcanary
