// emu_ownership_slip, in 01_single_gpu --device cuda under the emulated GPU's ThreadSanitizer build
// (make CUDA=emu SANITIZE=thread): the embedding's backward (embedding_backward_kernel) gives each
// table row one owner — thread (d, slice) owns column d of its slice's rows — and here the slices
// are miscounted, as `blockIdx.y / 2 * 2` would miscount them: blocks 2k and 2k+1 both take slice
// 2k, so two threads `+=` the same gradient row. Wraps the emulator's launch (emu::launch) for that
// kernel only and evens each thread's blockIdx.y before the kernel body runs. ThreadSanitizer
// reports the data race between the two blocks on dtable, with the kernel's line
// (tests/test_emu_races.cpp).
#include <atomic>
#include <cstring>
#include <functional>

#include "bug.h"
#include <cuda_runtime.h>  // the emulated GPU's (common/emu/), with emu::ctx(): the running thread's coordinates
#include "tsan.h"          // emu::tsan::Quiet: the slip rewrites the emulator's record, not the program's memory

cudaError_t real_launch(const char* name, const char* site, const void* fn, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t s, std::function<void()> body)
    __asm__("__real__ZN3emu6launchEPKcS1_PKv4dim3S4_mP11CUstream_stSt8functionIFvvEE");
cudaError_t slip_launch(const char* name, const char* site, const void* fn, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t s, std::function<void()> body)
    __asm__("__wrap__ZN3emu6launchEPKcS1_PKv4dim3S4_mP11CUstream_stSt8functionIFvvEE");

cudaError_t slip_launch(const char* name, const char* site, const void* fn, dim3 grid, dim3 block, size_t smem,
                        cudaStream_t s, std::function<void()> body) {
  if (strcmp(name, "embedding_backward_kernel") || grid.y < 2)
    return real_launch(name, site, fn, grid, block, smem, s, std::move(body));
  bug::announce("emu_ownership_slip");
  return real_launch(name, site, fn, grid, block, smem, s, [body = std::move(body)] {
    {
      emu::tsan::Quiet quiet;
      emu::ctx().block_idx.y &= ~1u;  // blocks 2k and 2k+1 both own slice 2k's rows
    }
    body();
  });
}
