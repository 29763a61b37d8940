// allocator.h — the tagging allocator's figures and calls (core.h tags every allocation): the
// bytes in use per category and in total, their peaks, what the cache reserves, per device.
// What the memory tables read; Tensor::empty allocates through it.
#pragma once
#include <cstddef>

#include "tensor/core.h"

namespace ts {

// The per-category and total figures are bytes in use by tensors (as requested, unrounded).
// `reserved` is what the allocator holds from the system: the blocks in use, rounded up, plus
// the freed blocks it caches for reuse.
struct MemStats {
  size_t current[kNumTags] = {};
  size_t peak[kNumTags] = {};      // each category's own peak
  size_t at_peak[kNumTags] = {};   // each category's bytes at the moment of the total peak
  size_t total_current = 0;
  size_t total_peak = 0;
  size_t reserved = 0;
  size_t reserved_peak = 0;
};

void* mem_alloc(size_t bytes, Device dev, Tag tag);
void mem_free(void* p, size_t bytes, Device dev, Tag tag);
// The block an allocation of `bytes` takes (and a freed one returns to the cache): 256-B multiples
// to 64 KiB, then eight sizes per power of two.
size_t mem_block_size(size_t bytes);
const MemStats& mem_stats(Device dev);
void mem_reset_peaks(Device dev);  // peaks := current (used between measured phases)
// Called after every allocation and free (under the allocator's lock; it must not allocate
// tensors), with the figures after it: --memory-timeline's recorder (training/memory_timeline.h).
using AllocObserver = void (*)(Device dev, Tag tag, long long delta, const MemStats& after);
void set_alloc_observer(AllocObserver observer);  // nullptr: none

}  // namespace ts
