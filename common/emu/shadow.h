// shadow.h — initcheck and memcheck as reports: a shadow byte for every byte of device memory,
// pinned host memory and shared memory, which the memcheck build's instrumented kernels consult on
// every load and store (shadow.cu; notes/emulated_gpu.md, "initcheck and memcheck").
//
// `make CUDA=emu SANITIZE=memory` compiles the code that holds kernels with g++'s
// -fsanitize=kernel-address at call threshold 0: every load and store becomes a call
// __asan_{load,store}{1,2,4,8,16,N}_noabort(addr) first, which shadow.cu implements. While an emulated
// kernel runs, a load of a byte nothing wrote since its allocation (or since the caching allocator
// recycled it), an access outside its allocation or shared array (into a redzone), and a 2-, 4-, 8-
// or 16-byte access not aligned to its size are each reported with the kernel, block, thread and
// source line, and the run fails. Elsewhere these calls do nothing: the shadow is off in a build
// without an instrumented object, and every hook below then returns at once.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace emu::shadow {

// Whether an instrumented object is linked (its constructor registered its globals).
bool on();
// Bytes of redzone on each side of a device or pinned allocation, and after a block's dynamic
// shared memory: an access there is outside its allocation. 0 when the shadow is off.
size_t redzone();

enum class Kind { Device, Pinned };
// [p, p + bytes) is a new allocation (unwritten); [p - redzone, p) and [p + bytes, p + total +
// redzone) are its redzones (cudaMalloc rounds `bytes` up to `total`).
void allocated(void* p, size_t bytes, size_t total, Kind k);
// The allocation at p (of `total` bytes, as allocated) is gone: its bytes and redzones are host memory again.
void released(void* p, size_t total);
// Stores that the instrumented code does not make: a memset, cuBLAS's and NCCL's outputs.
void written(const void* p, size_t bytes);
// A block the caching allocator hands out again: unwritten, as a fresh cudaMalloc.
void unwritten(const void* p, size_t bytes);
// A copy: each destination byte is written where the source byte was (host memory counts as written).
void copied(void* dst, const void* src, size_t bytes);

// What the emulator itself reads for a kernel (ldmatrix's rows, kernel.cu): null when [p, p + n)
// may be read, else why not (initcheck's or memcheck's words). Always null when the shadow is off.
const char* unreadable(const void* p, size_t n);

// A grid runs on this host thread (kernel.cu's run_grid): the kernel's loads are checked while it
// lives; `dyn` is the block's dynamic shared memory, `bytes` long with a redzone after it.
struct Grid {
  Grid(const char* kernel, void* dyn, size_t bytes);
  ~Grid();
  void* dyn;
  size_t bytes;
};
// A block starts: its shared memory (the static arrays, the dynamic bytes) is unwritten again.
void block_start(const std::vector<std::pair<char*, size_t>>& arrays, void* dyn, size_t bytes);

}  // namespace emu::shadow

namespace emu {
// kernel.cu: a defect found in the running kernel thread (the first one of the block is kept, and
// the block stops at its next barrier, as after any broken rule); prefixed with kernel, launch
// site, block and thread. `now`: reported at once (the access that follows will fault).
void kernel_defect(const std::string& what, bool now);
}  // namespace emu
