// tsan.h — the emulated GPU under ThreadSanitizer (make CUDA=emu SANITIZE=thread BUILD=build-tsan):
// races found by happens-before, in shared and global memory, between the threads of a block, the
// blocks of a grid, streams, and NCCL operations and kernels (notes/emulated_gpu.md, "Races").
//
// The model is CUDA's and PTX's, and no more:
//   * each CUDA thread is a TSan fiber, switched without synchronisation (flag 1), so the threads
//     of a block are concurrent unless a barrier orders them;
//   * __syncthreads and __syncwarp(mask): every thread (lane of the mask) releases, then every one
//     acquires (sync_among); shuffles, mma and ldmatrix order nothing (PTX promises no fence);
//   * a grid's threads acquire what its stream had done when the grid began (the launch) and
//     release into the grid's end, which the stream's thread acquires when the grid is over; blocks
//     are not ordered with one another;
//   * a stream operation acquires what the host had done when it queued it (release at enqueue);
//     its completion is released once per operation, and acquired only by who waits for that
//     operation (an event synchronised, queried complete or waited for; a stream synchronised);
//   * a stream's own thread ignores every other synchronisation (the emulator's locks, MPI's): the
//     queue mutex, the one-kernel-at-a-time lock and the report lock would otherwise order work
//     that CUDA leaves unordered; and it ignores its own memory accesses but those declared here
//     (a copy's, a memset's, a GEMM's, an NCCL operation's buffers).
// The emulator's sources are compiled without instrumentation (its bookkeeping is not the
// program's); what they do to the program's memory is declared here: NCCL's reads and writes
// (read, write), the poison fills (Quiet: not accesses) and a block's shared memory, which starts
// anew for every block (forget). Without TS_EMU_TSAN every call is empty.
#pragma once
#include <cstddef>

namespace emu::tsan {

#ifdef TS_EMU_TSAN
constexpr bool kOn = true;
void stream_thread(const char* name);  // called first on a stream's host thread
void release(const void* sync);
void acquire(const void* sync);
// Every fiber of `fibers` releases into one fresh sync object, then every one acquires it; the
// caller's TSan context is `back` afterwards.
void sync_among(void* const* fibers, size_t n, void* back);
void* current();
// The TSan fiber of a slot of this host thread's pool, with its own stack (top returned in *top):
// a slot's fiber always runs on its slot's stack, so a stack's reuse is that fiber's own program order.
void* slot_fiber(size_t slot, size_t stack_bytes, char** top);
void switch_to(void* fiber);
void name(void* fiber, const char* s);
void forget(void* p, size_t bytes);  // fresh memory: no access before this counts
struct Quiet {                       // the emulator's own writes (poison): not the program's
  Quiet();
  ~Quiet();
};
void read(const void* p, size_t bytes);
void write(void* p, size_t bytes);
void thread_name(const char* s);  // the stream thread's: what it runs now (a report shows the current name)
#else
constexpr bool kOn = false;
inline void stream_thread(const char*) {}
inline void release(const void*) {}
inline void acquire(const void*) {}
inline void sync_among(void* const*, size_t, void*) {}
inline void* current() { return nullptr; }
inline void* slot_fiber(size_t, size_t, char**) { return nullptr; }
inline void switch_to(void*) {}
inline void name(void*, const char*) {}
inline void forget(void*, size_t) {}
struct Quiet {
  Quiet() {}  // user-provided, so a guard that does nothing is not an unused variable
};
inline void read(const void*, size_t) {}
inline void write(void*, size_t) {}
inline void thread_name(const char*) {}
#endif

}  // namespace emu::tsan
