/*!
 * \file canary_sweep_plan.cuh
 * \brief canary_sweep_plan_update: apply one commit of the incremental sweep plan (runtime/sweep_index.py) in one
 *   launch: the appended spans' entries, the tombstones and the entry count.
 *
 * Reads one int64 metadata block laid out as kvcanary/layout.h's sweep-plan commit metadata: the header (num_spans,
 *   num_tombstones, slots_base, num_valid), then per span (start, length, first position, before), then per
 *   tombstone range (start, length). new_slots holds the slots of plan entries [slots_base, slots_base + num_new)
 *   (the commit's appended span slot tensors, concatenated; device memory, never read on the host). Let S be the plan
 *   slots as they are before the launch. For each entry q = start + i of a span:
 *     verify_slot_indices[q] = kPaddingSlot if a tombstone range of this launch covers q, else new_slots[q - base];
 *     verify_expected_positions[q] = first position + i;
 *     verify_prev_slot_indices[q] = new_slots[q - 1 - base] for i > 0; for i == 0: kChainHeadSlot (-1) for
 *       before == -1, new_slots[before - base] for before >= base (an entry appended in this commit: read from the
 *       input, never from the plan another thread is writing), S[before] otherwise.
 *   Every other index a tombstone range covers: verify_slot_indices = kPaddingSlot. verify_num_valid = num_valid.
 * Those are the semantics of the torch commit this kernel replaces (sweep_plan_ref.py; SweepIndex._write until
 *   issue 25): the new slots land, the predecessors are gathered from the plan with the new slots in it, and only
 *   then are the tombstones filled. So a predecessor tombstoned in the same commit (a span removed after a child was
 *   appended to it) is still read as the slot it held, whether it was appended in this commit or held before; and a
 *   tombstoned new entry keeps its position and predecessor (never verified: its slot is the padding slot).
 * Spans of one launch are contiguous and in plan order (each starts where the previous ends), which is how a commit
 *   appends them; tombstone ranges may overlap each other, the spans and the predecessors.
 * Metadata memory: CUDA: PINNED host memory, read by the kernel in place (zero-copy: no H2D copy, no second call);
 *   the caller must not rewrite it before the launch has completed (the runtime's staging ring: an event recorded
 *   after every few launches). CPU: a CPU tensor, read directly.
 * Validation (host wrapper, before any write): dtypes, shapes, devices; then the metadata, read on the host:
 *   0 <= num_spans <= kSweepPlanMaxSpans, 0 <= num_tombstones <= kSweepPlanMaxTombstones, the block long enough;
 *   0 <= num_valid <= capacity; 0 <= slots_base and slots_base + num_new <= capacity; each span: length >= 1, the
 *   first one starting at or after slots_base, each next one where the previous ends, the last one ending at or
 *   before min(slots_base + num_new, num_valid); first position >= 0 (no overflow of first position + length);
 *   -1 <= before < start. Each tombstone range: start >= 0, length >= 1, start + length <= num_valid. A bad value
 *   raises a ValueError naming `meta` (and the span or range); nothing is written.
 * Grid:  CUDA: one launch of min(ceil(items / kSweepPlanThreads), kSweepPlanMaxBlocks) blocks (at least one: block 0
 *        writes the count), grid-stride over the items: the spans' entries, then the tombstones' entries (a
 *        tombstone entry found by a binary search of the ranges' running ends). CPU: one loop over the same items,
 *        after the same first step as block 0's.
 * Block: kSweepPlanThreads threads. Every block copies the spans and ranges into shared memory (one coalesced read
 *        of at most kSweepPlanMetaValues values) and thread 0 sums the ranges' lengths. Block 0 then, before any
 *        item: gathers every span's first predecessor (the launch's only reads of the plan: a thread per span), a
 *        barrier, and only then pads the predecessors < slots_base that a range covers; the items skip exactly those
 *        indices, so no thread writes a plan slot another may still read.
 * Reads:  the metadata, new_slots, verify_slot_indices (the spans' predecessors below slots_base).
 * Writes: verify_slot_indices, verify_expected_positions, verify_prev_slot_indices (the spans' entries),
 *         verify_slot_indices (the tombstoned entries), verify_num_valid.
 */
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "kvcanary/launch.h"
#include "kvcanary/layout.h"
#include "kvcanary/macros.h"
#include "kvcanary/tensor_check.h"

namespace kvcanary {

constexpr uint32_t kSweepPlanThreads = 256;
constexpr int64_t kSweepPlanMaxBlocks = 512;
// The spans and ranges of one launch, as they follow the header (what every block copies to shared memory).
constexpr int32_t kSweepPlanRecordValues =
    kSweepPlanMaxSpans * kSweepPlanSpanFields + kSweepPlanMaxTombstones * kSweepPlanTombstoneFields;
static_assert(kSweepPlanMaxSpans <= static_cast<int32_t>(kSweepPlanThreads),
              "block 0 gathers the spans' first predecessors a thread per span");

struct SweepPlanParams {
  int64_t* slot_indices;        // [capacity] verify_slot_indices
  int64_t* prev_slot_indices;   // [capacity] verify_prev_slot_indices
  int64_t* expected_positions;  // [capacity] verify_expected_positions
  int32_t* num_valid;           // [1] verify_num_valid
  const int64_t* new_slots;     // [num_new]: plan entries [slots_base, slots_base + num_new)
  const int64_t* meta;          // the metadata block (CUDA: the device's address of the pinned host memory)
  int64_t slots_base;
  int64_t span_begin;         // plan index of the first span's first entry (spans are contiguous)
  int64_t span_entries;       // entries of this launch's spans
  int64_t tombstone_entries;  // entries of this launch's ranges, summed (overlaps counted twice)
  int32_t num_spans;
  int32_t num_tombstones;
  int32_t num_valid_value;
};

/*!
 * \brief The spans and ranges one launch applies, wherever they are held (shared memory on CUDA, the host block on
 *   CPU), with the ranges' running ends (range r covers tombstone items [ends[r - 1], ends[r]), ends[-1] = 0).
 */
struct SweepPlanRecords {
  const int64_t* spans;       // [num_spans * kSweepPlanSpanFields]
  const int64_t* tombstones;  // [num_tombstones * kSweepPlanTombstoneFields]
  const int64_t* tombstone_ends;  // [num_tombstones]
};

KVCANARY_HD int64_t sweep_plan_span_field(const SweepPlanRecords& r, int32_t s, int32_t field) {
  return r.spans[s * kSweepPlanSpanFields + field];
}

KVCANARY_HD int64_t sweep_plan_tombstone_field(const SweepPlanRecords& r, int32_t t, int32_t field) {
  return r.tombstones[t * kSweepPlanTombstoneFields + field];
}

/*! \brief Whether a tombstone range of this launch covers plan index `q` (a scan: at most kSweepPlanMaxTombstones). */
KVCANARY_HD bool sweep_plan_tombstoned(const SweepPlanParams& p, const SweepPlanRecords& r, int64_t q) {
  for (int32_t t = 0; t < p.num_tombstones; ++t) {
    const int64_t start = sweep_plan_tombstone_field(r, t, kSweepPlanTombstoneFieldStart);
    if (q >= start && q < start + sweep_plan_tombstone_field(r, t, kSweepPlanTombstoneFieldLength)) {
      return true;
    }
  }
  return false;
}

/*! \brief The predecessor slot of span `s`'s first entry (see the file comment): the launch's only plan reads. */
KVCANARY_HD int64_t sweep_plan_head_prev(const SweepPlanParams& p, const SweepPlanRecords& r, int32_t s) {
  const int64_t before = sweep_plan_span_field(r, s, kSweepPlanSpanFieldBefore);
  if (before < 0) {
    return kChainHeadSlot;
  }
  return before >= p.slots_base ? p.new_slots[before - p.slots_base] : p.slot_indices[before];
}

/*! \brief Whether plan index `q` (< slots_base) is the predecessor some span reads from the plan. */
KVCANARY_HD bool sweep_plan_read_predecessor(const SweepPlanParams& p, const SweepPlanRecords& r, int64_t q) {
  if (q >= p.slots_base) {
    return false;  // (predecessors at or past slots_base are read from new_slots)
  }
  for (int32_t s = 0; s < p.num_spans; ++s) {
    if (sweep_plan_span_field(r, s, kSweepPlanSpanFieldBefore) == q) {
      return true;
    }
  }
  return false;
}

/*!
 * \brief Item `k` of the launch: entry `k` of the spans (k < span_entries; every field but a span's first
 *   predecessor), else an entry of the tombstone ranges, padded unless a span entry of this launch (which pads itself)
 *   or a predecessor read from the plan (padded after the reads: sweep_plan_pad_read_predecessor).
 */
KVCANARY_HD void sweep_plan_apply_item(const SweepPlanParams& p, const SweepPlanRecords& r, int64_t k) {
  if (k < p.span_entries) {
    const int64_t q = p.span_begin + k;
    // the span holding q: the last one starting at or before it (starts are increasing)
    int32_t lo = 0;
    int32_t hi = p.num_spans - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (sweep_plan_span_field(r, mid, kSweepPlanSpanFieldStart) <= q) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64_t i = q - sweep_plan_span_field(r, lo, kSweepPlanSpanFieldStart);
    const int64_t j = q - p.slots_base;  // q's index in new_slots
    p.slot_indices[q] = sweep_plan_tombstoned(p, r, q) ? kPaddingSlot : p.new_slots[j];
    p.expected_positions[q] = sweep_plan_span_field(r, lo, kSweepPlanSpanFieldFirstPosition) + i;
    if (i > 0) {
      p.prev_slot_indices[q] = p.new_slots[j - 1];
    }
    return;
  }
  // the range holding tombstone item t: the first whose running end exceeds it
  const int64_t t = k - p.span_entries;
  int32_t lo = 0;
  int32_t hi = p.num_tombstones - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (r.tombstone_ends[mid] > t) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int64_t range_first = lo > 0 ? r.tombstone_ends[lo - 1] : 0;
  const int64_t q = sweep_plan_tombstone_field(r, lo, kSweepPlanTombstoneFieldStart) + (t - range_first);
  const bool span_entry = q >= p.span_begin && q < p.span_begin + p.span_entries;
  if (!span_entry && !sweep_plan_read_predecessor(p, r, q)) {
    p.slot_indices[q] = kPaddingSlot;
  }
}

/*! \brief Span `s`'s first predecessor, when it lies below slots_base and a range covers it: padded (after every
 *  read of it). Spans sharing a predecessor pad it alike (the same value). */
KVCANARY_HD void sweep_plan_pad_read_predecessor(const SweepPlanParams& p, const SweepPlanRecords& r, int32_t s) {
  const int64_t before = sweep_plan_span_field(r, s, kSweepPlanSpanFieldBefore);
  if (before >= 0 && before < p.slots_base && sweep_plan_tombstoned(p, r, before)) {
    p.slot_indices[before] = kPaddingSlot;
  }
}

#if KVCANARY_DEVICE_BUILD

KVCANARY_KERNEL void __launch_bounds__(kSweepPlanThreads) canary_sweep_plan_update_kernel(SweepPlanParams p) {
  __shared__ int64_t records[kSweepPlanRecordValues];
  __shared__ int64_t tombstone_ends[kSweepPlanMaxTombstones];
  const uint32_t tid = threadIdx.x;
  const int32_t span_values = p.num_spans * kSweepPlanSpanFields;
  const int32_t values = span_values + p.num_tombstones * kSweepPlanTombstoneFields;
  for (int32_t v = static_cast<int32_t>(tid); v < values; v += static_cast<int32_t>(blockDim.x)) {
    records[v] = p.meta[kSweepPlanMetaHeaderFields + v];
  }
  __syncthreads();
  const SweepPlanRecords r{records, records + span_values, tombstone_ends};
  if (tid == 0) {
    int64_t end = 0;
    for (int32_t t = 0; t < p.num_tombstones; ++t) {
      end += sweep_plan_tombstone_field(r, t, kSweepPlanTombstoneFieldLength);
      tombstone_ends[t] = end;
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {  // (uniform in the block: the barrier below is reached by all of its threads or none)
    const int32_t s = static_cast<int32_t>(tid);
    if (s < p.num_spans) {
      p.prev_slot_indices[sweep_plan_span_field(r, s, kSweepPlanSpanFieldStart)] = sweep_plan_head_prev(p, r, s);
    }
    // Every read of the plan's slots is done before any padding of them: the items never pad a predecessor read
    // from the plan (sweep_plan_read_predecessor), so this block's threads are the only writers of those.
    __syncthreads();
    if (s < p.num_spans) {
      sweep_plan_pad_read_predecessor(p, r, s);
    }
    if (tid == 0) {
      p.num_valid[0] = p.num_valid_value;
    }
  }
  const int64_t items = p.span_entries + p.tombstone_entries;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + tid; k < items; k += stride) {
    sweep_plan_apply_item(p, r, k);
  }
}

#else

inline void canary_sweep_plan_update_cpu(const SweepPlanParams& p) {
  const int64_t* spans = p.meta + kSweepPlanMetaHeaderFields;
  std::array<int64_t, kSweepPlanMaxTombstones> tombstone_ends{};
  const SweepPlanRecords r{spans, spans + p.num_spans * kSweepPlanSpanFields, tombstone_ends.data()};
  int64_t end = 0;
  for (int32_t t = 0; t < p.num_tombstones; ++t) {
    end += sweep_plan_tombstone_field(r, t, kSweepPlanTombstoneFieldLength);
    tombstone_ends[static_cast<size_t>(t)] = end;
  }
  // block 0's first step, then the items, as on CUDA (the same functions, in one order that is one of CUDA's)
  for (int32_t s = 0; s < p.num_spans; ++s) {
    p.prev_slot_indices[sweep_plan_span_field(r, s, kSweepPlanSpanFieldStart)] = sweep_plan_head_prev(p, r, s);
  }
  for (int32_t s = 0; s < p.num_spans; ++s) {
    sweep_plan_pad_read_predecessor(p, r, s);
  }
  p.num_valid[0] = p.num_valid_value;
  const int64_t items = p.span_entries + p.tombstone_entries;
  for (int64_t k = 0; k < items; ++k) {
    sweep_plan_apply_item(p, r, k);
  }
}

#endif  // KVCANARY_DEVICE_BUILD

namespace host {

/*! \brief The ValueError of a bad metadata value: "<fn>: meta: <what>". */
KVCANARY_COLD inline void sweep_plan_meta_error(const char* fn, const std::string& what) {
  TVM_FFI_THROW(ValueError) << fn << ": meta: " << what;
}

KVCANARY_COLD inline std::string sweep_plan_span_name(int32_t s, int64_t start, int64_t length) {
  return "span " + std::to_string(s) + " (start " + std::to_string(start) + ", length " + std::to_string(length) +
         "): ";
}

/*!
 * \brief Check the metadata a host can read (see the file comment) and fill the sizes of `p` it gives; throws for the
 *   first bad value.
 */
inline void sweep_plan_check_meta(const char* fn, const int64_t* meta, int64_t meta_len, int64_t capacity,
                                  int64_t num_new, SweepPlanParams& p) {
  if (meta_len < kSweepPlanMetaHeaderFields) {
    sweep_plan_meta_error(fn, "expected at least the " + std::to_string(kSweepPlanMetaHeaderFields) +
                                  " header values, got " + std::to_string(meta_len));
  }
  const int64_t num_spans = meta[kSweepPlanMetaNumSpans];
  const int64_t num_tombstones = meta[kSweepPlanMetaNumTombstones];
  const int64_t base = meta[kSweepPlanMetaSlotsBase];
  const int64_t num_valid = meta[kSweepPlanMetaNumValid];
  if (num_spans < 0 || num_spans > kSweepPlanMaxSpans) {
    sweep_plan_meta_error(fn, "num_spans " + std::to_string(num_spans) + " outside [0, " +
                                  std::to_string(kSweepPlanMaxSpans) + "] (a larger commit takes several launches)");
  }
  if (num_tombstones < 0 || num_tombstones > kSweepPlanMaxTombstones) {
    sweep_plan_meta_error(fn, "num_tombstones " + std::to_string(num_tombstones) + " outside [0, " +
                                  std::to_string(kSweepPlanMaxTombstones) +
                                  "] (a larger commit takes several launches)");
  }
  const int64_t needed = kSweepPlanMetaHeaderFields + num_spans * kSweepPlanSpanFields +
                         num_tombstones * kSweepPlanTombstoneFields;
  if (meta_len < needed) {
    sweep_plan_meta_error(fn, std::to_string(num_spans) + " spans and " + std::to_string(num_tombstones) +
                                  " tombstone ranges need " + std::to_string(needed) + " values, got " +
                                  std::to_string(meta_len));
  }
  if (num_valid < 0 || num_valid > capacity || num_valid > INT32_MAX) {
    sweep_plan_meta_error(fn, "num_valid " + std::to_string(num_valid) + " outside [0, capacity " +
                                  std::to_string(capacity) + "]");
  }
  if (base < 0 || base > capacity - num_new) {
    sweep_plan_meta_error(fn, "slots_base " + std::to_string(base) + ": new_slots' " + std::to_string(num_new) +
                                  " entries from there do not fit the capacity " + std::to_string(capacity));
  }
  const int64_t* spans = meta + kSweepPlanMetaHeaderFields;
  const int64_t spans_end_limit = std::min(base + num_new, num_valid);
  int64_t next = base;  // where the next span may start (the first: anywhere at or after slots_base)
  int64_t entries = 0;
  for (int32_t s = 0; s < static_cast<int32_t>(num_spans); ++s) {
    const int64_t* span = spans + s * kSweepPlanSpanFields;
    const int64_t start = span[kSweepPlanSpanFieldStart];
    const int64_t length = span[kSweepPlanSpanFieldLength];
    const int64_t first_position = span[kSweepPlanSpanFieldFirstPosition];
    const int64_t before = span[kSweepPlanSpanFieldBefore];
    if (s == 0 ? start < base : start != next) {
      sweep_plan_meta_error(fn, sweep_plan_span_name(s, start, length) +
                                    (s == 0 ? "starts before slots_base " + std::to_string(base)
                                            : "does not start where the previous span ends (" +
                                                  std::to_string(next) + ")"));
    }
    if (length < 1 || length > spans_end_limit - start) {
      sweep_plan_meta_error(fn, sweep_plan_span_name(s, start, length) + "length outside [1, " +
                                    std::to_string(std::max<int64_t>(spans_end_limit - start, 0)) +
                                    "] (the entries of new_slots and num_valid)");
    }
    if (first_position < 0 || first_position > INT64_MAX - length) {
      sweep_plan_meta_error(fn, sweep_plan_span_name(s, start, length) + "first position " +
                                    std::to_string(first_position) + " outside [0, 2^63 - length]");
    }
    if (before < -1 || before >= start) {
      sweep_plan_meta_error(fn, sweep_plan_span_name(s, start, length) + "before " + std::to_string(before) +
                                    " outside [-1, " + std::to_string(start) + ")");
    }
    if (s == 0) {
      p.span_begin = start;
    }
    next = start + length;
    entries += length;
  }
  const int64_t* tombstones = spans + num_spans * kSweepPlanSpanFields;
  int64_t dead = 0;
  for (int32_t t = 0; t < static_cast<int32_t>(num_tombstones); ++t) {
    const int64_t start = tombstones[t * kSweepPlanTombstoneFields + kSweepPlanTombstoneFieldStart];
    const int64_t length = tombstones[t * kSweepPlanTombstoneFields + kSweepPlanTombstoneFieldLength];
    if (start < 0 || start > num_valid || length < 1 || length > num_valid - start) {
      sweep_plan_meta_error(fn, "tombstone range " + std::to_string(t) + " (start " + std::to_string(start) +
                                    ", length " + std::to_string(length) + "): outside [0, num_valid " +
                                    std::to_string(num_valid) + ")");
    }
    dead += length;
  }
  p.slots_base = base;
  p.span_entries = entries;
  p.tombstone_entries = dead;
  p.num_spans = static_cast<int32_t>(num_spans);
  p.num_tombstones = static_cast<int32_t>(num_tombstones);
  p.num_valid_value = static_cast<int32_t>(num_valid);
}

/*!
 * \brief Apply one sweep-plan commit (see the file comment). verify_slot_indices, verify_prev_slot_indices,
 *   verify_expected_positions int64 [capacity] and verify_num_valid int32 [1] on the build's device (the plan's
 *   buffers, destinations first); new_slots int64 [num_new] contiguous on that device; meta int64 [meta_len]
 *   contiguous host memory: CUDA: pinned; CPU: a CPU tensor.
 */
inline void canary_sweep_plan_update(TensorView verify_slot_indices, TensorView verify_prev_slot_indices,
                                     TensorView verify_expected_positions, TensorView verify_num_valid,
                                     TensorView new_slots, TensorView meta) {
  constexpr const char* kFn = "canary_sweep_plan_update";
  // 1. validate the tensors and sizes
  SymbolicSize capacity("capacity");
  SymbolicSize num_new("num_new");
  SymbolicSize meta_len("meta_len");
  SymbolicDevice device(KVCANARY_DEVICE_BUILD ? kDLCUDA : kDLCPU);
  TensorMatcher(kFn, {capacity})
      .dtype<int64_t>()
      .device(device)
      .verify(verify_slot_indices, "verify_slot_indices")
      .verify(verify_prev_slot_indices, "verify_prev_slot_indices")
      .verify(verify_expected_positions, "verify_expected_positions");
  TensorMatcher(kFn, {1}).dtype<int32_t>().device(device).verify(verify_num_valid, "verify_num_valid");
  TensorMatcher(kFn, {num_new}).dtype<int64_t>().device(device).verify(new_slots, "new_slots");
  TensorMatcher(kFn, {meta_len}).dtype<int64_t>().verify(meta, "meta");
  check_host_memory(kFn, "meta", meta);
  const int64_t* host_meta = data_of<const int64_t>(meta);
#if KVCANARY_DEVICE_BUILD
  const DLDevice dev = device.value();
  tvm::ffi::CUDADeviceGuard guard(dev.device_id);
  const int64_t* device_meta = pinned_device_address(kFn, "meta", host_meta);
#endif

  // 2. validate the metadata (on the host: the block is host memory) and extract the parameters
  SweepPlanParams p{};
  sweep_plan_check_meta(kFn, host_meta, meta_len.value(), capacity.value(), num_new.value(), p);
  p.slot_indices = data_of<int64_t>(verify_slot_indices);
  p.prev_slot_indices = data_of<int64_t>(verify_prev_slot_indices);
  p.expected_positions = data_of<int64_t>(verify_expected_positions);
  p.num_valid = data_of<int32_t>(verify_num_valid);
  p.new_slots = data_of<const int64_t>(new_slots);

#if KVCANARY_DEVICE_BUILD
  // 3. launch on the caller's stream: a thread per item, grid-stride past kSweepPlanMaxBlocks blocks; one block at
  //    least (block 0 writes the count: a commit of tombstones or of nothing still sets it).
  p.meta = device_meta;
  const int64_t items = p.span_entries + p.tombstone_entries;
  const int64_t blocks = std::min(std::max<int64_t>(ceil_div(items, kSweepPlanThreads), 1), kSweepPlanMaxBlocks);
  launch_kernel(canary_sweep_plan_update_kernel, static_cast<uint32_t>(blocks), kSweepPlanThreads,
                current_stream(dev), p);
#else
  // 3. CPU: block 0's step, then the items in order.
  p.meta = host_meta;
  canary_sweep_plan_update_cpu(p);
#endif
}

}  // namespace host
}  // namespace kvcanary
