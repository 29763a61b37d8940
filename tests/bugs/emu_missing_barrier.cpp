// emu_missing_barrier, in 01_single_gpu --device cuda under the emulated GPU's ThreadSanitizer build
// (make CUDA=emu SANITIZE=thread): the first __syncthreads of block_sum (common/kernels/kernels_cuda.cu)
// is removed, so warp 0 reads the per-warp partial sums from shared memory while the other warps'
// lane 0 writes them, with nothing ordering the two. Wraps the emulator's barrier (emu::syncthreads)
// and skips exactly that source line, which it finds in the kernel's source. ThreadSanitizer reports
// the data race with the kernel, its fiber (block and thread) and both source lines
// (tests/test_emu_races.cpp).
#include <atomic>
#include <cstring>
#include <fstream>
#include <string>

#include "bug.h"

void real_syncthreads(const char* file, int line) __asm__("__real__ZN3emu11syncthreadsEPKci");
void skip_syncthreads(const char* file, int line) __asm__("__wrap__ZN3emu11syncthreadsEPKci");

// The line of the first __syncthreads() after `function` begins in `path` (-1 if not found).
static int first_barrier_after(const char* path, const char* function) {
  std::ifstream f(path);
  std::string s;
  bool inside = false;
  for (int line = 1; std::getline(f, s); line++) {
    inside = inside || s.find(function) != std::string::npos;
    if (inside && s.find("__syncthreads()") != std::string::npos) return line;
  }
  return -1;
}

void skip_syncthreads(const char* file, int line) {
  static const char* kFile = "common/kernels/kernels_cuda.cu";
  static const int skipped = first_barrier_after(kFile, "__device__ R block_sum(");
  if (line == skipped && !strcmp(file, kFile)) {
    static std::atomic<bool> said{false};  // the kernel's threads may announce only once
    if (!said.exchange(true)) bug::announce("emu_missing_barrier");
    return;
  }
  real_syncthreads(file, line);
}
