// shape_only.cu — the shape-only device's reserved range (shape_only.h).
#include "tensor/shape_only.h"
#include "tensor/core.h"

#include <sys/mman.h>
#include <atomic>

namespace ts {

static bool g_shape_only = false;
static char* g_base = nullptr;
static std::atomic<size_t> g_used{0};
// 16 TiB of address space, reserved and never committed (MAP_NORESERVE): a 405B rank's tensors
// are ~0.1 TiB. Untouched pages cost nothing; read, they are the kernel's shared zero page.
static constexpr size_t kRange = size_t(16) << 40;

bool shape_only() { return g_shape_only; }

void enable_shape_only() {
  if (g_shape_only) return;
  void* p = mmap(nullptr, kRange, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) fatal("--device shape: cannot reserve %zu TiB of address space", kRange >> 40);
  g_base = static_cast<char*>(p);
  g_shape_only = true;
}

void* shape_block(size_t bytes) {
  const size_t n = (bytes + 255) / 256 * 256;  // blocks are 256-B multiples (mem_block_size)
  const size_t at = g_used.fetch_add(n);
  TS_CHECK(at + n <= kRange, "--device shape: more than %zu TiB of tensors", kRange >> 40);
  return g_base + at;
}

bool shape_only_block(const void* p) {
  const char* c = static_cast<const char*>(p);
  return g_shape_only && c >= g_base && c < g_base + kRange;
}

}  // namespace ts
