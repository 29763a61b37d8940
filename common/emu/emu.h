// emu.h — what the emulated GPU's parts share: streams that run work late and in order, the
// registry of device memory, and how the emulator reports an error. The CUDA runtime, cuBLAS,
// cuBLASLt and NCCL stand-ins (runtime.cu, blas.cu, nccl.cu) are built on these; the code under
// test sees only the vendors' own headers (cuda_runtime.h, cublas_v2.h, cublasLt.h, nccl.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "cuda_runtime.h"

namespace emu {

// ----- errors ------------------------------------------------------------------------------------
// An error the hardware would report (or hang on) is printed as "emulated GPU: ..." on stderr and
// kept as the last message, which the tests read to check that a seeded defect was named.
void report(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string last_report();
void clear_report();
// A defect found while the stream ran (a kernel's divergent barrier, a bad cuBLAS call the host
// could not see): the device is left with a sticky error, as after a fault on real hardware. Every
// later runtime call returns it and nothing more runs.
void device_fault(cudaError_t e, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
cudaError_t sticky_error();

// ----- streams -----------------------------------------------------------------------------------
// Work queued on a stream runs on that stream's own host thread, in issue order, and *late*: only
// once something could observe it — the host synchronising, querying an event recorded after it,
// a blocking copy, another stream waiting on such an event, or (for communication, which on the
// hardware progresses by itself) its own enqueueing. A missing wait therefore reads stale or NaN
// data instead of happening to work.
struct Stream;
Stream* stream(cudaStream_t s);  // the null stream (0) is the device's legacy default stream
// Queues `work` on s; `what` names it in reports. `eager`: runs as soon as all earlier work on the
// stream has run, without waiting to be observed (NCCL operations). Returns its sequence number.
uint64_t enqueue(cudaStream_t s, std::string what, std::function<void()> work, bool eager = false);
// Asks s to run everything up to sequence number seq, and waits for it when `wait`.
void demand(Stream* s, uint64_t seq, bool wait);
bool finished(Stream* s, uint64_t seq);
uint64_t last_seq(Stream* s);
// True on a stream's own thread (work may not synchronise with the host from there).
bool on_stream_thread();

// ----- memory ------------------------------------------------------------------------------------
// Device memory is host memory the emulator registered; it starts as poison bytes, so a kernel that
// reads what nothing wrote does not get the zero a fresh page holds. TS_EMU_POISON picks the byte:
// nan (the default, 0xFF: NaN in f32 and bf16, but -1 as an int32 and dropped by fmaxf) or big (0x7F:
// 3.39e38 in f32 and bf16, 2139062143 as an int32, which wins every fmaxf). Shared memory, recycled
// blocks of the project's caching allocator and cudaMallocHost memory get the same byte. A run that
// reads nothing unwritten gives the same bits under both (tests/test_emu_chapters.cpp).
unsigned char uninit_byte();
// Fills [p, p + bytes) of a recycled device block with the poison byte, on `s` (stream-ordered, as
// the caching allocator hands a block to the stream's next work): the allocator's hook.
void poison_recycled(void* p, size_t bytes, cudaStream_t s);
// Whether [p, p + bytes) lies inside one live cudaMalloc allocation.
bool is_device(const void* p, size_t bytes = 1);
// Whether [p, p + bytes) lies inside one live cudaMallocHost allocation (page-locked host memory).
bool is_pinned(const void* p, size_t bytes = 1);
// Device-to-host copies issued so far (cudaMemcpy and cudaMemcpyAsync, any destination): each one
// makes the host wait for the device, so a test can count them across a call that should make none.
uint64_t device_to_host_copies();

// ----- coverage ----------------------------------------------------------------------------------
// What ran: "kernel NAME SITE", "cublas CALL", "nccl CALL". With TS_EMU_COVERAGE=FILE each
// process appends its set to FILE at exit (tests/run_tests.sh sums them over the test suite).
bool covering();  // TS_EMU_COVERAGE is set: callers build their strings only then
void cover(const std::string& what);

// ----- settings (environment) ---------------------------------------------------------------------
// TS_EMU_GPUS: GPUs on this emulated node (default 8); TS_EMU_MEMORY_GB: each one's memory (80);
// TS_EMU_ORDER=reverse: every block's threads, and a grid's blocks, run in reverse order;
// TS_EMU_NCCL_TIMEOUT: seconds an NCCL operation waits (240); TS_EMU_QUIET=1: no report lines;
// TS_EMU_COVERAGE=FILE; TS_EMU_POISON=nan|big (uninit_byte). Each is parsed strictly: a value it cannot use ends the process with one
// line ("emulated GPU: NAME="VALUE" cannot be used: NAME accepts ...") and exit status 2, at
// start-up and wherever it is read.
int gpus();
size_t memory_bytes();
double nccl_timeout_s();
bool quiet();
const char* coverage_path();  // nullptr when unset
bool reverse_order();
void set_reverse_order(bool on);  // for tests that run a kernel both ways
void check_settings();

}  // namespace emu
