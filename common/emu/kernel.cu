// kernel.cu — kernels on the emulated GPU: each block's threads as fibers, with the hardware's rules.
//
// A grid runs block after block on its stream's host thread. Within a block every CUDA thread is a
// fiber (Boost.Context: a switch is a few register saves, 5–10× cheaper than ucontext's, which
// also asks the kernel for the signal mask each time). A fiber runs until it must wait for others —
// at __syncthreads, __syncwarp or a shuffle — and the scheduler then runs the next one. When every
// thread waits, the barrier either completes (all live threads at the same barrier) or the kernel
// is wrong, and the emulator names the kernel, the block, the source lines and the threads.
//
// Stricter than the hardware: threads of a block run in an order that TS_EMU_ORDER=reverse turns
// around (a result that changes is a missing barrier), shared memory starts as poison (emu.h),
// a barrier must be the same source line for every thread, and a shuffle must name only live lanes
// that reach the same shuffle (with PTX's segments; a lane outside the mask gives poison). A
// kernel's pointer arguments must be device or pinned memory, and a fault while it runs is named
// with its thread. Shared memory is held to sm_90's limits per kernel: its static
// __shared__ arrays (found in the program's symbol table) and the launch's dynamic bytes against
// 48 KiB, or against what that kernel opted in to. Not checked: __launch_bounds__ (g++ cannot see
// it), timing, occupancy, and anything about registers.
#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/fiber.hpp>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tensor/device.h"  // bf16 as the project decodes it
#include "emu.h"
#include "tsan.h"  // SANITIZE=thread: fibers, barriers and grids as happens-before
#include "shadow.h"  // the memcheck build's initcheck and memcheck (shadow.cu)

extern "C" char __start_ts_emu_shared[] __attribute__((weak));
extern "C" char __stop_ts_emu_shared[] __attribute__((weak));

namespace emu {

void set_last_error(cudaError_t e);  // runtime.cu

namespace bc = boost::context;

// ----- stacks --------------------------------------------------------------------------------------
// Fibers need stacks; mapping one per CUDA thread per block would cost more than the kernel, so
// each host thread keeps a pool, each stack with a guard page below it (an overflow faults).
constexpr size_t kStack = 128 * 1024;

struct StackPool {
  std::vector<void*> free_;
  bc::stack_context allocate() {
    void* base;
    if (!free_.empty()) {
      base = free_.back();
      free_.pop_back();
    } else {
      base = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      mprotect(base, size_t(sysconf(_SC_PAGESIZE)), PROT_NONE);
    }
    bc::stack_context sc;
    sc.size = kStack;
    sc.sp = static_cast<char*>(base) + kStack;
    return sc;
  }
  void deallocate(bc::stack_context& sc) { free_.push_back(static_cast<char*>(sc.sp) - kStack); }
};
static thread_local StackPool t_stacks;
struct PoolRef {  // Boost.Context's StackAllocator, by reference to this thread's pool
  bc::stack_context allocate() { return t_stacks.allocate(); }
  void deallocate(bc::stack_context& sc) { t_stacks.deallocate(sc); }
};

// ----- one block -----------------------------------------------------------------------------------

enum class Wait { None, Block, Warp, Done };
enum class WarpKind { Sync, Shuffle, Mma, Ldmatrix, LdmatrixTrans };
static const char* kind_name(WarpKind k) {
  switch (k) {
    case WarpKind::Sync: return "__syncwarp";
    case WarpKind::Shuffle: return "__shfl_xor_sync";
    case WarpKind::Mma: return "mma.sync.m16n8k16";
    case WarpKind::Ldmatrix: return "ldmatrix.x4";
    case WarpKind::LdmatrixTrans: return "ldmatrix.x4.trans";
  }
  return "?";
}

struct Thread {
  ThreadCtx c;
  bc::fiber fiber;
  Wait wait = Wait::None;
  const char* file = "";
  int line = 0;
  // a warp operation: its kind and mask, what the lane gives and what it gets back (a shuffle's
  // value; a matrix fragment's registers; ldmatrix's row address)
  WarpKind kind = WarpKind::Sync;
  unsigned mask = 0;
  int lane_mask = 0, width = 32;
  uint64_t give = 0, got = 0;
  uint32_t frag_in[10] = {}, frag_out[4] = {};
  void* tsan = nullptr;       // its TSan fiber (SANITIZE=thread), and that fiber's stack
  char* stack_top = nullptr;
};

struct Block {
  const char* kernel;
  const char* site;
  std::vector<Thread> threads;
  std::vector<char> dyn_smem;
  bc::fiber scheduler;  // where a waiting thread returns to
  Thread* current = nullptr;
  std::string error;  // a broken rule, found by a thread or by the scheduler
  void* host = nullptr;                                    // SANITIZE=thread: the stream thread's context,
  const char* launched = nullptr, *ended = nullptr;        // and the grid's start and end (tsan.h)
};

static thread_local Block* t_block = nullptr;
static ThreadCtx g_host_ctx{};  // threadIdx read outside a kernel: zeros

ThreadCtx& ctx() { return t_block && t_block->current ? t_block->current->c : g_host_ctx; }

static std::string where(const Block& b, const Thread& t) {
  char buf[256];
  snprintf(buf, sizeof buf, "kernel %s (launched at %s), block (%u,%u,%u), thread (%u,%u,%u)", b.kernel, b.site,
           t.c.block_idx.x, t.c.block_idx.y, t.c.block_idx.z, t.c.thread_idx.x, t.c.thread_idx.y, t.c.thread_idx.z);
  return buf;
}

// A thread stops here until the scheduler resumes it.
static void suspend() {
  Block* b = t_block;
  tsan::switch_to(b->host);
  b->scheduler = std::move(b->scheduler).resume();
  t_block = b;
}

// A broken rule stops the whole block: the thread records it and leaves its fiber by unwinding.
struct Abandon {};
[[noreturn]] static void fail_here(const std::string& msg) {
  if (t_block->error.empty()) t_block->error = msg;
  throw Abandon{};
}

// A defect the memcheck build's shadow found in the running thread (shadow.cu): the block keeps the
// first and stops at its next barrier; the instrumented access itself returns (gcc assumes it cannot
// throw). `now`: the access is about to fault, so the report cannot wait for the block's end.
void kernel_defect(const std::string& what, bool now) {
  if (!t_block || !t_block->current || !t_block->error.empty()) return;
  t_block->error = where(*t_block, *t_block->current) + ": " + what;
  if (now) report("%s", t_block->error.c_str());
}

void* dynamic_shared() {
  if (!t_block || !t_block->current) fail_here("dynamic shared memory used outside a kernel");
  return t_block->dyn_smem.data();
}

void syncthreads(const char* file, int line) {
  Thread* t = t_block->current;
  t->wait = Wait::Block;
  t->file = file;
  t->line = line;
  suspend();
}

static int lane_of(const Block& b, const Thread& t) {
  (void)b;
  return int((t.c.thread_idx.x + t.c.thread_idx.y * t.c.block_dim.x + t.c.thread_idx.z * t.c.block_dim.x * t.c.block_dim.y) % 32);
}

// The warp's threads (by lane) in b, starting at this thread's warp.
static std::vector<Thread*> warp_of(Block& b, Thread* t) {
  size_t idx = size_t(t - b.threads.data());
  size_t first = idx / 32 * 32;
  std::vector<Thread*> w(32, nullptr);
  for (size_t i = first; i < first + 32 && i < b.threads.size(); i++) w[i - first] = &b.threads[i];
  return w;
}

// ----- tensor cores ------------------------------------------------------------------------------
// The fragments are where the PTX ISA puts them ("Matrix Fragments for mma.m16n8k16 with floating
// point type"; "ldmatrix"): lane l, with group g = l / 4 and t = l % 4 in its group, holds
//   A (16 × 16 bf16, row-major) in 4 registers of 2: register r has row g + 8·(r % 2), columns
//     2t + 8·(r / 2) and the next one (the lower half the lower column);
//   B (16 × 8 bf16, column-major) in 2 registers: register r has rows 2t + 8·r and the next, column g;
//   C and D (16 × 8 fp32) in 4 floats: value i has row g + 8·(i / 2), column 2t + i % 2.
// A lane that reads a wrong register therefore multiplies the wrong numbers here, as on the GPU.
static float bf16_lo(uint32_t r) { return ts::bf16_to_float(ts::bf16{uint16_t(r)}); }
static float bf16_hi(uint32_t r) { return ts::bf16_to_float(ts::bf16{uint16_t(r >> 16)}); }

static void mma_m16n8k16(std::vector<Thread*>& w) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; l++) {
    const uint32_t* in = w[size_t(l)]->frag_in;
    const int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; r++) {
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2)] = bf16_lo(in[r]);
      A[g + 8 * (r % 2)][2 * t + 8 * (r / 2) + 1] = bf16_hi(in[r]);
    }
    for (int r = 0; r < 2; r++) {
      B[2 * t + 8 * r][g] = bf16_lo(in[4 + r]);
      B[2 * t + 8 * r + 1][g] = bf16_hi(in[4 + r]);
    }
    for (int i = 0; i < 4; i++) C[g + 8 * (i / 2)][2 * t + i % 2] = __uint_as_float(in[6 + i]);
  }
  // Products of bf16 values are exact in fp32; the sum runs k ascending with one rounding per
  // term (the tensor core's own order and width are not documented; see notes/emulated_gpu.md).
  for (int l = 0; l < 32; l++) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; i++) {
      const int m = g + 8 * (i / 2), n = 2 * t + i % 2;
      float acc = C[m][n];
      for (int k = 0; k < 16; k++) acc = fmaf(A[m][k], B[k][n], acc);
      w[size_t(l)]->frag_out[i] = __float_as_uint(acc);
    }
  }
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lanes 8j..8j+7 give the rows of matrix j (16-byte
// aligned, in shared memory). Without .trans lane l gets, in register j, row l / 4 of matrix j at
// columns 2·(l % 4) and the next; with .trans it gets column l / 4 at rows 2·(l % 4) and the next
// (matrix j transposed), which is how a row-major tile becomes mma's column-major B operand.
static bool in_shared(const Block& b, const char* p) {
  const char* d = b.dyn_smem.data();
  if (p >= d && p + 16 <= d + b.dyn_smem.size()) return true;
  return __start_ts_emu_shared && p >= __start_ts_emu_shared && p + 16 <= __stop_ts_emu_shared;
}
static void ldmatrix_x4(std::vector<Thread*>& w, bool trans) {
  Block& b = *t_block;
  for (int l = 0; l < 32; l++) {
    const char* row = reinterpret_cast<const char*>(uintptr_t(w[size_t(l)]->give));
    if (uintptr_t(row) % 16 || !in_shared(b, row))
      fail_here(where(b, *w[size_t(l)]) + ": ldmatrix row address " + std::to_string(uintptr_t(row)) +
                (uintptr_t(row) % 16 ? " is not 16-byte aligned" : " is not in the block's shared memory"));
    if (const char* why = shadow::unreadable(row, 16))  // the memcheck build: its 16 bytes were written
      fail_here(where(b, *w[size_t(l)]) + ": " + why + ": the row of " + kind_name(w[size_t(l)]->kind) + " at " +
                w[size_t(l)]->file + ":" + std::to_string(w[size_t(l)]->line));
  }
  auto element = [&](int j, int r, int c) {  // matrix j's element (r, c), 16 bits
    uint16_t e;
    memcpy(&e, reinterpret_cast<const char*>(uintptr_t(w[size_t(j * 8 + r)]->give)) + 2 * c, 2);
    return uint32_t(e);
  };
  for (int l = 0; l < 32; l++)
    for (int j = 0; j < 4; j++) {
      const int a = l / 4, c = 2 * (l % 4);  // without .trans: row a, columns c and c + 1
      w[size_t(l)]->frag_out[j] = trans ? element(j, c, a) | element(j, c + 1, a) << 16
                                        : element(j, a, c) | element(j, a, c + 1) << 16;
    }
}

// What lane l gets from shfl.sync.bfly.b32 (PTX ISA, "shfl.sync"), with the c operand CUDA's
// __shfl_xor_sync(mask, v, lane_mask, width) passes: segment mask (32 - width) << 8, clamp 31. Then
//   max_lane = (l & seg) | (31 & ~seg);  j = l ^ lane_mask;  j <= max_lane ? lane j : its own value,
// so a lane of an upper segment may read the segment below (width 16: lane 20 ^ 16 reads lane 4),
// while a lane of a lower segment whose partner lies above keeps its own value. A source lane
// outside the mask gives an undefined value (PTX): poison bytes, never a plausible number.
static uint64_t shuffle_source(const std::vector<Thread*>& w, unsigned mask, int l, int lane_mask, int width) {
  const int seg = 32 - width, max_lane = (l & seg) | (31 & ~seg), j = (l ^ lane_mask) & 31;
  const int src = j <= max_lane ? j : l;
  if (mask >> src & 1u) return w[size_t(src)]->give;
  uint64_t poison;
  memset(&poison, uninit_byte(), sizeof poison);
  return poison;
}

// Completes a warp operation when every lane in the mask has arrived at the same one.
static void try_complete_warp(Block& b, Thread* t) {
  std::vector<Thread*> w = warp_of(b, t);
  for (int l = 0; l < 32; l++) {
    if (!(t->mask >> l & 1u)) continue;
    Thread* o = w[size_t(l)];
    char buf[512];
    if (!o || o->wait == Wait::Done) {
      snprintf(buf, sizeof buf, "%s: %s at %s:%d names lane %d in mask 0x%08x, but that lane %s", where(b, *t).c_str(),
               kind_name(t->kind), t->file, t->line, l, t->mask,
               o ? "has exited" : "does not exist (the block is smaller)");
      fail_here(buf);
    }
    if (o->wait != Wait::Warp) return;  // not there yet
    if (o->mask != t->mask || o->kind != t->kind || o->line != t->line || o->file != t->file ||
        o->lane_mask != t->lane_mask || o->width != t->width) {
      snprintf(buf, sizeof buf,
               "%s: lane %d waits at %s:%d (mask 0x%08x) while lane %d waits at %s:%d (mask 0x%08x): a warp operation "
               "must be the same one, with the same mask, in every lane it names",
               where(b, *t).c_str(), lane_of(b, *t), t->file, t->line, t->mask, l, o->file, o->line, o->mask);
      fail_here(buf);
    }
  }
  if (tsan::kOn && t->kind == WarpKind::Sync) {  // only __syncwarp orders the lanes' memory (PTX)
    std::vector<void*> f;
    for (int l = 0; l < 32; l++)
      if (t->mask >> l & 1u) f.push_back(w[size_t(l)]->tsan);
    tsan::sync_among(f.data(), f.size(), t->tsan);
  }
  if (t->kind == WarpKind::Mma) mma_m16n8k16(w);
  if (t->kind == WarpKind::Ldmatrix || t->kind == WarpKind::LdmatrixTrans) ldmatrix_x4(w, t->kind == WarpKind::LdmatrixTrans);
  for (int l = 0; l < 32; l++) {
    if (!(t->mask >> l & 1u)) continue;
    Thread* o = w[size_t(l)];
    if (o->kind == WarpKind::Shuffle) o->got = shuffle_source(w, t->mask, l, o->lane_mask, o->width);
    o->wait = Wait::None;
  }
}

static void warp_op(const char* file, int line, unsigned mask, WarpKind kind, uint64_t bits, int lane_mask, int width) {
  Block& b = *t_block;
  Thread* t = b.current;
  t->file = file;
  t->line = line;
  t->mask = mask;
  t->kind = kind;
  t->give = bits;
  t->lane_mask = lane_mask;
  t->width = width;
  if (!(mask >> lane_of(b, *t) & 1u)) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s: %s at %s:%d with mask 0x%08x, which does not name the calling lane %d", where(b, *t).c_str(),
             kind_name(kind), file, line, mask, lane_of(b, *t));
    fail_here(buf);
  }
  if (width < 1 || width > 32 || (width & (width - 1))) fail_here(where(b, *t) + ": shuffle width must be a power of two up to 32");
  t->wait = Wait::Warp;
  try_complete_warp(b, t);
  if (t->wait == Wait::Warp) suspend();
}

void syncwarp(const char* file, int line, unsigned mask) { warp_op(file, line, mask, WarpKind::Sync, 0, 0, 32); }
uint64_t shfl_xor(const char* file, int line, unsigned mask, uint64_t bits, int lane_mask, int width) {
  warp_op(file, line, mask, WarpKind::Shuffle, bits, lane_mask, width);
  return t_block->current->got;
}

// The .aligned tensor-core instructions: every lane of the warp executes the same one.
void mma_m16n8k16_bf16(const char* file, int line, float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  Thread* t = t_block->current;
  memcpy(t->frag_in, a, 16);
  memcpy(t->frag_in + 4, b, 8);
  memcpy(t->frag_in + 6, c, 16);
  warp_op(file, line, 0xffffffffu, WarpKind::Mma, 0, 0, 32);
  memcpy(d, t_block->current->frag_out, 16);
}
void ldmatrix_x4(const char* file, int line, uint32_t r[4], const void* row, bool trans) {
  if (in_shared(*t_block, static_cast<const char*>(row))) tsan::read(row, 16);  // each lane reads the row it names
  warp_op(file, line, 0xffffffffu, trans ? WarpKind::LdmatrixTrans : WarpKind::Ldmatrix, uint64_t(uintptr_t(row)), 0, 32);
  memcpy(r, t_block->current->frag_out, 16);
}

// ----- the scheduler -----------------------------------------------------------------------------

struct SlotStack {  // SANITIZE=thread: the stack of the thread's TSan fiber (tsan::slot_fiber)
  char* top;
  bc::stack_context allocate() {
    bc::stack_context sc;
    sc.size = kStack;
    sc.sp = top;
    return sc;
  }
  void deallocate(bc::stack_context&) {}
};

static bc::fiber start(Block& b, Thread& t, const std::function<void()>& body) {
  auto run = [&b, &t, &body](bc::fiber&& sched) {
    b.scheduler = std::move(sched);
    t_block = &b;
    tsan::acquire(b.launched);
    try {
      body();
    } catch (const Abandon&) {
    }
    t.wait = Wait::Done;
    tsan::release(b.ended);
    tsan::switch_to(b.host);
    return std::move(b.scheduler);
  };
  if (tsan::kOn) return bc::fiber(std::allocator_arg, SlotStack{t.stack_top}, run);
  return bc::fiber(std::allocator_arg, PoolRef{}, run);
}

// Why a warp operation can no longer complete: a lane it names has exited, or waits elsewhere.
static std::string stuck_warp(Block& b, const Thread& t) {
  std::vector<Thread*> w = warp_of(b, const_cast<Thread*>(&t));
  const char* op = kind_name(t.kind);
  char buf[768];
  for (int l = 0; l < 32; l++) {
    const Thread* o = w[size_t(l)];
    if (!(t.mask >> l & 1u) || (o && o->wait == Wait::Warp)) continue;
    if (!o || o->wait == Wait::Done)
      snprintf(buf, sizeof buf, "%s: %s at %s:%d names lane %d in mask 0x%08x, but that lane %s", where(b, t).c_str(), op,
               t.file, t.line, l, t.mask, o ? "has exited" : "does not exist (the block is smaller)");
    else
      snprintf(buf, sizeof buf, "%s: %s at %s:%d (mask 0x%08x) waits for lane %d, which waits at the __syncthreads at %s:%d",
               where(b, t).c_str(), op, t.file, t.line, t.mask, l, o->file, o->line);
    return buf;
  }
  snprintf(buf, sizeof buf, "%s waits at %s at %s:%d (mask 0x%08x) for lanes that never arrive", where(b, t).c_str(), op,
           t.file, t.line, t.mask);
  return buf;
}

// Every thread is waiting (or done): complete the block's barrier, or name why it cannot complete.
static bool release_barrier(Block& b) {
  const Thread* first = nullptr;
  for (const Thread& t : b.threads) {
    if (t.wait == Wait::Done) continue;
    char buf[768];
    if (t.wait == Wait::Warp) {
      b.error = stuck_warp(b, t);
      return false;
    }
    if (!first) {
      first = &t;
    } else if (t.line != first->line || t.file != first->file) {
      snprintf(buf, sizeof buf,
               "kernel %s (launched at %s), block (%u,%u,%u): divergent __syncthreads: thread (%u,%u,%u) waits at %s:%d, "
               "thread (%u,%u,%u) at %s:%d; every live thread of a block must reach the same barrier",
               b.kernel, b.site, t.c.block_idx.x, t.c.block_idx.y, t.c.block_idx.z, first->c.thread_idx.x,
               first->c.thread_idx.y, first->c.thread_idx.z, first->file, first->line, t.c.thread_idx.x,
               t.c.thread_idx.y, t.c.thread_idx.z, t.file, t.line);
      b.error = buf;
      return false;
    }
  }
  if (!first) return false;  // all done
  std::vector<void*> f;  // SANITIZE=thread only: the default build allocates nothing per barrier
  for (Thread& t : b.threads)
    if (t.wait == Wait::Block) {
      t.wait = Wait::None;
      if (tsan::kOn) f.push_back(t.tsan);
    }
  if (tsan::kOn) tsan::sync_among(f.data(), f.size(), b.host);  // __syncthreads: every live thread releases, then acquires
  return true;
}

// Runs every ready thread (in the chosen order) until all wait, then releases the barrier; repeats.
static void run_block(Block& b, const std::function<void()>& body, bool reverse) {
  const size_t n = b.threads.size();
  for (size_t k = 0; k < n; k++) b.threads[k].fiber = start(b, b.threads[k], body);
  for (;;) {
    bool ran = true;
    while (ran && b.error.empty()) {
      ran = false;
      for (size_t k = 0; k < n && b.error.empty(); k++) {
        Thread& t = b.threads[reverse ? n - 1 - k : k];
        if (t.wait != Wait::None) continue;
        b.current = &t;
        t_block = &b;
        tsan::switch_to(t.tsan);
        t.fiber = std::move(t.fiber).resume();
        b.current = nullptr;
        ran = true;
      }
    }
    if (!b.error.empty() || !release_barrier(b)) break;
  }
  t_block = nullptr;
  for (Thread& t : b.threads) {  // unwinds any fiber left waiting, as that thread
    if (!t.fiber) continue;
    tsan::switch_to(t.tsan);
    t.fiber = bc::fiber();
    tsan::switch_to(b.host);
  }
}

// ----- static shared memory, per kernel -----------------------------------------------------------
// The program's own symbol table says which static __shared__ arrays belong to which kernel: a
// function-local static of the function mangled _Z<encoding> is mangled _ZZ<encoding>E<name>, so
// the kernel at address fn owns the writable objects with that prefix (device code has no other
// function-local statics), as ptxas counts them. The project's kernels declare __shared__ in the
// kernel itself, not in the __device__ helpers they call. The arrays of a template kernel are not
// in the ts_emu_shared section (g++ ignores a section attribute on a template's local statics), so
// each block's start poisons the launched kernel's arrays by their symbols' addresses as well.

struct Local {  // a writable function-local static: its mangled name, size and symbol value
  std::string name;
  size_t bytes;
  uintptr_t value;
};
// A kernel's static __shared__ memory: the bytes ptxas would count, and where its arrays lie (poisoned
// at every block's start; those of a template kernel are outside the ts_emu_shared section).
struct KernelShared {
  size_t bytes = 0;
  std::vector<std::pair<char*, size_t>> arrays;
};
struct SharedSymbols {
  bool pie = true;                             // ET_DYN: values are offsets from the load base
  uintptr_t base = 0;                          // the load base (pie)
  std::map<uintptr_t, std::string> functions;  // value -> mangled name
  std::vector<Local> locals;
  std::map<const void*, KernelShared> by_address;  // answers so far
  std::map<std::string, KernelShared> by_name;
};

static SharedSymbols read_symbols(const char* path) {
  SharedSymbols out;
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::string elf(size_t(std::max<std::streamoff>(0, f.tellg())), '\0');
  {
    tsan::Quiet quiet;  // SANITIZE=thread: the emulator reading its own binary is not the program's access
    f.seekg(0);
    f.read(&elf[0], std::streamsize(elf.size()));
  }
  if (elf.size() < sizeof(Elf64_Ehdr) || memcmp(elf.data(), ELFMAG, SELFMAG)) return out;
  const auto* eh = reinterpret_cast<const Elf64_Ehdr*>(elf.data());
  out.pie = eh->e_type == ET_DYN;
  const auto* sh = reinterpret_cast<const Elf64_Shdr*>(elf.data() + eh->e_shoff);
  for (size_t i = 0; i < eh->e_shnum; i++) {
    if (sh[i].sh_type != SHT_SYMTAB) continue;
    const auto* sym = reinterpret_cast<const Elf64_Sym*>(elf.data() + sh[i].sh_offset);
    const char* str = elf.data() + sh[sh[i].sh_link].sh_offset;
    for (size_t k = 0; k < sh[i].sh_size / sizeof(Elf64_Sym); k++) {
      const Elf64_Sym& y = sym[k];
      const char* name = str + y.st_name;
      if (ELF64_ST_TYPE(y.st_info) == STT_FUNC && y.st_value) out.functions[y.st_value] = name;
      else if (ELF64_ST_TYPE(y.st_info) == STT_OBJECT && !strncmp(name, "_ZZ", 3) && y.st_shndx < eh->e_shnum &&
               (sh[y.st_shndx].sh_flags & SHF_WRITE))
        out.locals.push_back(Local{name, size_t(y.st_size), uintptr_t(y.st_value)});
    }
  }
  return out;
}

// A demangled function's own name, without scope and template arguments ("void ts::k<float>(float*)" -> "k").
static std::string base_name(const std::string& fn) {
  size_t end = fn.size(), depth = 0;
  while (end > 0) {  // back over the parameter list
    const char c = fn[--end];
    depth += c == ')';
    depth -= c == '(';
    if (!depth) break;
  }
  if (end > 0 && fn[end - 1] == '>')
    for (depth = 0; end > 0;) {  // back over the template arguments
      const char c = fn[--end];
      depth += c == '>';
      depth -= c == '<';
      if (!depth) break;
    }
  const size_t from = end ? fn.find_last_of(": ", end - 1) : std::string::npos;
  const size_t begin = from == std::string::npos ? 0 : from + 1;
  return fn.substr(begin, end - begin);
}

// The most static shared memory any function called `wanted` declares (every specialization of a
// template whose arguments the launch deduced).
static KernelShared shared_by_name(const SharedSymbols& s, const std::string& wanted) {
  std::map<std::string, size_t> per_function;
  KernelShared out;
  for (const Local& l : s.locals) {
    int st = 0;
    char* d = abi::__cxa_demangle(l.name.c_str(), nullptr, nullptr, &st);
    std::string owner = d && !st ? std::string(d) : "";
    free(d);
    owner = owner.substr(0, owner.rfind("::"));
    if (owner.empty() || base_name(owner) != wanted) continue;
    per_function[owner] += l.bytes;
    out.arrays.push_back({reinterpret_cast<char*>(l.value + s.base), l.bytes});
  }
  for (const auto& [f, bytes] : per_function) out.bytes = std::max(out.bytes, bytes);
  return out;
}

// The static __shared__ memory of the kernel at fn, or (fn null) of the kernel named `name`.
static const KernelShared& static_shared(const void* fn, const char* name) {
  static const KernelShared none;
  static std::mutex mu;
  static std::map<std::string, SharedSymbols> files;
  Dl_info info{};
  if (!dladdr(fn ? fn : reinterpret_cast<const void*>(&static_shared), &info) || !info.dli_fname) return none;
  std::lock_guard<std::mutex> lk(mu);
  auto it = files.find(info.dli_fname);
  if (it == files.end()) it = files.emplace(info.dli_fname, read_symbols(info.dli_fname)).first;
  SharedSymbols& s = it->second;
  s.base = s.pie ? uintptr_t(info.dli_fbase) : 0;
  if (!fn) {
    std::string wanted(name);
    wanted = wanted.substr(0, wanted.find('<'));
    wanted = wanted.substr(wanted.rfind(':') == std::string::npos ? 0 : wanted.rfind(':') + 1);
    auto n = s.by_name.find(wanted);
    return n != s.by_name.end() ? n->second : s.by_name[wanted] = shared_by_name(s, wanted);
  }
  auto a = s.by_address.find(fn);
  if (a != s.by_address.end()) return a->second;
  KernelShared k;
  auto f = s.functions.find(uintptr_t(fn) - s.base);
  if (f != s.functions.end() && !f->second.compare(0, 2, "_Z")) {
    const std::string prefix = "_ZZ" + f->second.substr(2) + "E";
    for (const Local& l : s.locals)
      if (!l.name.compare(0, prefix.size(), prefix)) {
        k.bytes += l.bytes;
        k.arrays.push_back({reinterpret_cast<char*>(l.value + s.base), l.bytes});
      }
  }
  return s.by_address[fn] = k;
}
static size_t static_shared_bytes(const void* fn, const char* name) { return static_shared(fn, name).bytes; }

// ----- the launch ---------------------------------------------------------------------------------

constexpr size_t kSharedDefault = 48 * 1024;  // per block without the opt-in (sm_90)
constexpr size_t kSharedOptIn = 232448;       // 227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin

static std::mutex g_attr_mu;
static std::map<const void*, int> g_max_dyn;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel

cudaError_t set_max_dynamic_shared(const void* fn, int bytes) {
  const size_t stat = static_shared_bytes(fn, "");
  if (bytes < 0 || stat + size_t(bytes) > kSharedOptIn) {
    report("cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize, %d) refused: with the kernel's %zu "
           "bytes of static __shared__ memory it must lie in [0, %zu] (227 KiB on sm_90)", bytes, stat, kSharedOptIn);
    set_last_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lk(g_attr_mu);
  g_max_dyn[fn] = bytes;
  return cudaSuccess;
}

// The block's shared memory (CUDA Programming Guide, "Compute Capabilities", sm_90): static arrays
// up to 48 KiB (ptxas refuses more); static + dynamic up to 48 KiB, or, after the kernel's own
// opt-in, dynamic up to what it opted in to (static + opt-in at most 227 KiB).
static std::string check_shared(const char* name, const void* fn, size_t dyn) {
  const size_t stat = static_shared_bytes(fn, name);
  char buf[512];
  if (stat > kSharedDefault) {
    snprintf(buf, sizeof buf, "%zu bytes of static __shared__ memory, over the %zu that ptxas allows a kernel on sm_90",
             stat, kSharedDefault);
    return buf;
  }
  int opt_in = -1;
  {
    std::lock_guard<std::mutex> lk(g_attr_mu);
    auto it = g_max_dyn.find(fn);
    if (fn && it != g_max_dyn.end()) opt_in = it->second;
  }
  if (opt_in >= 0 && dyn > size_t(opt_in))
    snprintf(buf, sizeof buf, "%zu bytes of dynamic shared memory, over the %d this kernel opted in to with "
             "cudaFuncSetAttribute(..., cudaFuncAttributeMaxDynamicSharedMemorySize, ...)", dyn, opt_in);
  else if (opt_in < 0 && stat + dyn > kSharedDefault)
    snprintf(buf, sizeof buf, "%zu bytes of static and %zu of dynamic shared memory, over the %zu a block may have "
             "without the opt-in (above 48 KiB the kernel must call cudaFuncSetAttribute(kernel, "
             "cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)%s)", stat, dyn, kSharedDefault,
             fn ? "" : "; this launch names a template kernel whose arguments the call deduces, so spell them out");
  else return "";
  return buf;
}

// What the hardware refuses at launch (CUDA Programming Guide, "Compute Capabilities", sm_90 column).
static cudaError_t check_launch(const char* name, const char* site, const void* fn, dim3 g, dim3 bl, size_t smem) {
  const unsigned long long threads = 1ull * bl.x * bl.y * bl.z;
  std::string why;
  char buf[256];
  if (!g.x || !g.y || !g.z || !bl.x || !bl.y || !bl.z) why = "a grid or block dimension is zero";
  else if (threads > 1024) snprintf(buf, sizeof buf, "%llu threads per block, over the limit of 1024", threads), why = buf;
  else if (bl.x > 1024 || bl.y > 1024 || bl.z > 64) why = "a block dimension over its limit (1024, 1024, 64)";
  else if (g.y > 65535 || g.z > 65535) snprintf(buf, sizeof buf, "grid (%u,%u,%u): y and z may be at most 65535", g.x, g.y, g.z), why = buf;
  else if (g.x > 0x7fffffffu) why = "grid x over 2^31 - 1";
  if (!why.empty()) {
    report("launch of kernel %s at %s refused: %s", name, site, why.c_str());
    return cudaErrorInvalidConfiguration;
  }
  why = check_shared(name, fn, smem);
  if (!why.empty()) {
    report("launch of kernel %s at %s refused: %s", name, site, why.c_str());
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// ----- memory faults inside a kernel ----------------------------------------------------------------
// A kernel that touches unmapped memory, or makes an aligned vector access (a 16-byte Chunk, which
// g++ loads with movdqa as nvcc does with ld.v4) at a misaligned address, faults on the CPU as it
// would on the GPU; the handler names the kernel, launch site, block and thread that were running
// before the process dies of the signal (compute-sanitizer's memcheck report, not a bare SIGSEGV).
// x86 reports a misaligned aligned-vector access as a general-protection fault (si_code SI_KERNEL,
// no address). Under AddressSanitizer (SANITIZE=address) its own handler reports instead.
static void on_fault(int sig, siginfo_t* si, void*) {
  const Block* b = t_block;
  char buf[1024];
  int n = 0;
  if (b && b->current) {
    const Thread& t = *b->current;
    char what[256];
    if (si->si_code == SI_KERNEL)
      snprintf(what, sizeof what, "with no address: a vector load or store misaligned for its size (a 16-byte access "
               "must be 16-byte aligned)");
    else
      snprintf(what, sizeof what, "at address %p, which no allocation holds", si->si_addr);
    n = snprintf(buf, sizeof buf, "emulated GPU: kernel %s (launched at %s), block (%u,%u,%u), thread (%u,%u,%u): "
                 "memory fault (%s) %s\n", b->kernel, b->site, t.c.block_idx.x, t.c.block_idx.y, t.c.block_idx.z,
                 t.c.thread_idx.x, t.c.thread_idx.y, t.c.thread_idx.z, sig == SIGBUS ? "SIGBUS" : "SIGSEGV", what);
    if (n > 0 && write(2, buf, size_t(std::min<int>(n, sizeof buf - 1)))) {}
  }
  signal(sig, SIG_DFL);
  raise(sig);
}
static void catch_faults() {
#ifndef __SANITIZE_ADDRESS__
  static thread_local bool installed = false;  // the alternate stack is per thread (a fiber's may have overflowed)
  if (installed) return;
  installed = true;
  stack_t alt{};
  alt.ss_size = 64 * 1024;
  alt.ss_sp = malloc(alt.ss_size);
  sigaltstack(&alt, nullptr);
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
  });
#endif
}

// SANITIZE=thread: thread i of the grid's k-th block runs as TSan fiber (k % 2)·n + i of this host
// thread's pool: two sets of a block's threads, used in turn, so consecutive blocks never share a
// fiber (a shared fiber's program order, and the barriers it passed, would order the two blocks).
// Blocks an even distance apart do share them, so a race only between such blocks is missed. More
// sets would miss less, but TSan's fibers are threads (at most 8,128 in a process, never recycled)
// and every barrier costs each fiber a vector clock as long as the fibers there are.
static void tsan_fiber(Block& b, Thread& t, size_t k, size_t i) {
  t.tsan = tsan::slot_fiber(k % 2 * b.threads.size() + i, kStack, &t.stack_top);
  char label[160];
  snprintf(label, sizeof label, "%s block (%u,%u,%u) thread (%u,%u,%u)", b.kernel, t.c.block_idx.x, t.c.block_idx.y,
           t.c.block_idx.z, t.c.thread_idx.x, t.c.thread_idx.y, t.c.thread_idx.z);  // TSan keeps 63 characters
  tsan::name(t.tsan, label);
}

// Kernels run one at a time in the process: static __shared__ arrays are one copy in one section.
static std::mutex g_kernel_mu;

static void run_grid(const char* name, const char* site, const void* fn, dim3 g, dim3 bl, size_t smem,
                     const std::function<void()>& body) {
  std::lock_guard<std::mutex> lk(g_kernel_mu);
  catch_faults();
  const bool reverse = reverse_order();
  const size_t nblocks = size_t(g.x) * g.y * g.z, nthreads = size_t(bl.x) * bl.y * bl.z;
  Block b;
  b.kernel = name;
  b.site = site;
  b.threads.resize(nthreads);
  b.dyn_smem.resize(smem + shadow::redzone());  // exactly the launch's bytes: past them is a redzone (ASan's, or the shadow's)
  shadow::Grid checked(name, b.dyn_smem.data(), smem);
  const std::vector<std::pair<char*, size_t>> arrays = static_shared(fn, name).arrays;
  const std::unique_ptr<char[]> grid_sync(new char[2]);  // SANITIZE=thread: the grid's start and end
  b.launched = &grid_sync[0], b.ended = &grid_sync[1], b.host = tsan::current();
  tsan::release(b.launched);  // the grid sees what its stream did before it
  for (size_t k = 0; k < nblocks && sticky_error() == cudaSuccess; k++) {
    const size_t id = reverse ? nblocks - 1 - k : k;
    const uint3 bi{unsigned(id % g.x), unsigned(id / g.x % g.y), unsigned(id / g.x / g.y)};
    for (size_t i = 0; i < nthreads; i++) {
      Thread& t = b.threads[i];
      t = Thread{};
      t.c = ThreadCtx{uint3{unsigned(i % bl.x), unsigned(i / bl.x % bl.y), unsigned(i / bl.x / bl.y)}, bi, bl, g};
      if (tsan::kOn) tsan_fiber(b, t, k, i);
    }
    {
      tsan::Quiet quiet;  // the poison is the emulator's, not a write the program made
      std::fill(b.dyn_smem.begin(), b.dyn_smem.end(), char(uninit_byte()));
      if (__start_ts_emu_shared) memset(__start_ts_emu_shared, uninit_byte(), size_t(__stop_ts_emu_shared - __start_ts_emu_shared));
      for (const auto& [p, bytes] : arrays) memset(p, uninit_byte(), bytes);  // a template kernel's too
    }
    if (tsan::kOn) {  // a block's shared memory is its own: the previous block's accesses do not race with it
      tsan::forget(b.dyn_smem.data(), b.dyn_smem.size());
      if (__start_ts_emu_shared) tsan::forget(__start_ts_emu_shared, size_t(__stop_ts_emu_shared - __start_ts_emu_shared));
      for (const auto& [p, bytes] : arrays) tsan::forget(p, bytes);
    }
    shadow::block_start(arrays, b.dyn_smem.data(), smem);
    b.error.clear();
    run_block(b, body, reverse);
    if (!b.error.empty()) device_fault(cudaErrorLaunchFailure, "%s", b.error.c_str());
  }
  tsan::acquire(b.ended);  // the stream's later work sees the grid's
}

bool pointer_arguments_ok(const char* name, const char* site, const void* const* p, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (!p[i] || is_device(p[i], 0) || is_pinned(p[i], 0)) continue;
    device_fault(cudaErrorIllegalAddress,
                 "kernel %s (launched at %s): argument %zu is %p, which is neither device memory (cudaMalloc) nor "
                 "page-locked host memory (cudaMallocHost): a host pointer, which the GPU cannot dereference",
                 name, site, i, p[i]);
    set_last_error(cudaErrorIllegalAddress);
    return false;
  }
  return true;
}

cudaError_t launch(const char* name, const char* site, const void* fn, dim3 grid, dim3 block, size_t smem,
                   cudaStream_t s, std::function<void()> body) {
  if (sticky_error() != cudaSuccess) {
    set_last_error(sticky_error());
    return sticky_error();
  }
  if (cudaError_t e = check_launch(name, site, fn, grid, block, smem)) {
    set_last_error(e);
    return e;
  }
  enqueue(s, name, [=, body = std::move(body)] {
    if (covering()) cover(std::string("kernel ") + name + " " + site);
    run_grid(name, site, fn, grid, block, smem, body);
  });
  return cudaSuccess;
}

}  // namespace emu
