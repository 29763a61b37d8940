// tsan.cu — ThreadSanitizer's fiber and annotation interface for the emulated GPU (tsan.h says
// the model). Compiled only with meaning under SANITIZE=thread (TS_EMU_TSAN); empty otherwise.
#include "tsan.h"

#ifdef TS_EMU_TSAN
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <memory>
#include <new>
#include <vector>

extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_set_fiber_name(void* fiber, const char* name);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
void __tsan_read_range_pc(void* addr, unsigned long size, void* pc);
void __tsan_write_range_pc(void* addr, unsigned long size, void* pc);
void AnnotateIgnoreSyncBegin(const char* f, int l);
void AnnotateIgnoreSyncEnd(const char* f, int l);
void AnnotateThreadName(const char* f, int l, const char* name);
// TSan's Java interface is the one public way to say "this range is new memory" (its shadow is
// reset, as for a fresh heap block): a block's shared memory is new memory for every block.
void __tsan_java_init(unsigned long heap_begin, unsigned long heap_size);
void __tsan_java_alloc(unsigned long ptr, unsigned long size);
void __tsan_java_free(unsigned long ptr, unsigned long size);
}

// The build's own settings (TSAN_OPTIONS and a suppressions file still add to them): a report ends
// the run with exit status 66 at once; MPICH is not instrumented, and what its interceptors see
// (its shared-memory transport's copies, its locks) is not the program's (called_from_lib). Never
// a suppression of the project's code. (UCX, MPICH's network layer, hooks madvise, and its hook
// faults under TSan when a thread exits: run with UCX_MEM_EVENTS=no, which its libraries read
// before any of the program's initialisers could set it.)
extern "C" const char* __tsan_default_options() { return "exitcode=66:halt_on_error=1:history_size=3"; }
extern "C" const char* __tsan_default_suppressions() { return "called_from_lib:libmpich.so\n"; }

namespace emu::tsan {

static thread_local void* t_host = nullptr;  // the stream thread's own context, which ignores sync
// Whether the running context is a stream thread's own (not one of its fibers): only it ignores sync.
static bool ignoring() { return t_host && __tsan_get_current_fiber() == t_host; }

void stream_thread(const char* name) {
  t_host = __tsan_get_current_fiber();
  AnnotateThreadName(__FILE__, __LINE__, name);
  AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
  __tsan_ignore_thread_begin();  // its own accesses too: the program's are declared (read, write)
}
void release(const void* sync) {
  const bool lift = ignoring();
  if (lift) AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  __tsan_release(const_cast<void*>(sync));
  if (lift) AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
}
void acquire(const void* sync) {
  const bool lift = ignoring();
  if (lift) AnnotateIgnoreSyncEnd(__FILE__, __LINE__);
  __tsan_acquire(const_cast<void*>(sync));
  if (lift) AnnotateIgnoreSyncBegin(__FILE__, __LINE__);
}
void sync_among(void* const* fibers, size_t n, void* back) {
  std::unique_ptr<char> s(new char);  // fresh: nothing released into it before this barrier
  for (size_t i = 0; i < n; i++) __tsan_switch_to_fiber(fibers[i], 1), __tsan_release(s.get());
  for (size_t i = 0; i < n; i++) __tsan_switch_to_fiber(fibers[i], 1), __tsan_acquire(s.get());
  __tsan_switch_to_fiber(back, 1);
}
void* current() { return __tsan_get_current_fiber(); }

struct Slot {
  void* fiber;
  char* top;
};
static thread_local std::vector<Slot> t_slots;
void* slot_fiber(size_t slot, size_t stack_bytes, char** top) {
  while (t_slots.size() <= slot) {
    void* base = mmap(nullptr, stack_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    mprotect(base, size_t(sysconf(_SC_PAGESIZE)), PROT_NONE);  // a guard page, as the default pool's
    t_slots.push_back(Slot{__tsan_create_fiber(1), static_cast<char*>(base) + stack_bytes});
  }
  *top = t_slots[slot].top;
  return t_slots[slot].fiber;
}
void switch_to(void* fiber) { __tsan_switch_to_fiber(fiber, 1); }
void name(void* fiber, const char* s) { __tsan_set_fiber_name(fiber, s); }

void forget(void* p, size_t bytes) {
  static const bool init = (__tsan_java_init(0x10000, 0x10000), true);  // its checks only guard Java heaps
  (void)init;
  const uintptr_t a = uintptr_t(p) & ~uintptr_t(7), e = (uintptr_t(p) + bytes + 7) & ~uintptr_t(7);
  if (e <= a) return;
  __tsan_java_free(a, e - a);
  __tsan_java_alloc(a, e - a);
}
Quiet::Quiet() { __tsan_ignore_thread_begin(); }
Quiet::~Quiet() { __tsan_ignore_thread_end(); }
// The access is reported at the caller's line (blas.cu's, nccl.cu's, runtime.cu's): noinline keeps
// the return address the caller's.
__attribute__((noinline)) void read(const void* p, size_t bytes) {
  if (!bytes) return;
  const bool lift = ignoring();
  if (lift) __tsan_ignore_thread_end();
  __tsan_read_range_pc(const_cast<void*>(p), bytes, __builtin_return_address(0));
  if (lift) __tsan_ignore_thread_begin();
}
__attribute__((noinline)) void write(void* p, size_t bytes) {
  if (!bytes) return;
  const bool lift = ignoring();
  if (lift) __tsan_ignore_thread_end();
  __tsan_write_range_pc(p, bytes, __builtin_return_address(0));
  if (lift) __tsan_ignore_thread_begin();
}
void thread_name(const char* s) { AnnotateThreadName(__FILE__, __LINE__, s); }

}  // namespace emu::tsan
#endif
