// runtime.cu — the emulated CUDA runtime: devices, memory, streams and events.
//
// Streams are where the emulator is strictest. Each stream is a host thread that runs its queue in
// issue order, but *late*: an operation runs only once something could observe it (the host
// synchronising or querying an event recorded after it, a blocking copy, another stream waiting on
// such an event). CUDA promises nothing earlier, so a missing wait or event reads memory that
// nothing has written yet (0xFF bytes: NaN) instead of happening to work. Copies follow CUDA's
// rules for host memory: from pageable memory a host-to-device copy takes its source before
// returning, and into pageable memory a device-to-host copy has finished when it returns; an
// asynchronous copy from or into pinned memory (cudaMallocHost) reads or writes the host buffer
// when it runs on its stream, late, so the host must wait for it (an event) before reusing the
// buffer. cudaMemcpy and cudaMemset, on the legacy default stream, neither wait for streams created
// non-blocking nor are waited for by them, and return as early as CUDA allows (cudaMemcpy, below).
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "emu.h"
#include "tsan.h"  // SANITIZE=thread: what orders stream work, as happens-before
#include "shadow.h"        // the memcheck build's shadow: allocations, copies, recycled blocks
#include "tensor/hooks.h"  // set_recycle_hook: the caching allocator's recycled blocks

namespace emu {

// ----- errors ------------------------------------------------------------------------------------

static std::mutex g_report_mu;
static std::string g_last_report;
static std::atomic<int> g_sticky{cudaSuccess};

static void vreport(const char* fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  std::lock_guard<std::mutex> lk(g_report_mu);
  g_last_report = buf;
  if (!quiet()) fprintf(stderr, "emulated GPU: %s\n", buf);
}
void report(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport(fmt, ap);
  va_end(ap);
}
std::string last_report() {
  std::lock_guard<std::mutex> lk(g_report_mu);
  return g_last_report;
}
void clear_report() {
  std::lock_guard<std::mutex> lk(g_report_mu);
  g_last_report.clear();
  g_sticky = cudaSuccess;  // tests of seeded defects start the next case on a healthy device
}
void device_fault(cudaError_t e, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vreport(fmt, ap);
  va_end(ap);
  int ok = cudaSuccess;
  g_sticky.compare_exchange_strong(ok, int(e));
}
cudaError_t sticky_error() { return cudaError_t(g_sticky.load()); }

// ----- coverage ------------------------------------------------------------------------------------

static std::mutex g_cover_mu;
static std::set<std::string>* g_covered = nullptr;

static void write_coverage() {
  const char* path = coverage_path();
  if (!path || !g_covered) return;
  std::lock_guard<std::mutex> lk(g_cover_mu);
  std::string all;
  for (const std::string& w : *g_covered) all += w + "\n";
  if (FILE* f = fopen(path, "a")) {  // one write per process: appends from other ranks stay whole lines
    fwrite(all.data(), 1, all.size(), f);
    fclose(f);
  }
}
bool covering() {
  static const bool on = coverage_path() != nullptr;
  return on;
}
void cover(const std::string& what) {
  if (!covering()) return;
  std::lock_guard<std::mutex> lk(g_cover_mu);
  if (!g_covered) {
    g_covered = new std::set<std::string>;
    atexit(write_coverage);
  }
  g_covered->insert(what);
}

// ----- settings ------------------------------------------------------------------------------------
// Every TS_EMU_* variable is read strictly: the whole value, finite, in range. A value the emulator
// cannot use stops the process with one line naming the variable, the value and what it accepts
// (exit status 2), at start-up (check_settings, below) and again wherever a setting is read, since
// tests change some of them while they run. Empty is the same as unset.

[[noreturn]] static void bad_setting(const char* name, const char* value, const char* accepts) {
  fprintf(stderr, "emulated GPU: %s=\"%s\" cannot be used: %s accepts %s\n", name, value, name, accepts);
  fflush(stderr);
  _exit(2);
}
static const char* setting(const char* name) {
  const char* v = getenv(name);
  return v && *v ? v : nullptr;
}
// A whole number in [lo, hi], in decimal digits only.
static long setting_count(const char* name, long dflt, long lo, long hi, const char* accepts) {
  const char* v = setting(name);
  if (!v) return dflt;
  errno = 0;
  char* end = nullptr;
  const long x = strtol(v, &end, 10);
  if (strspn(v, "0123456789") != strlen(v) || *end || errno || x < lo || x > hi) bad_setting(name, v, accepts);
  return x;
}
// A finite decimal number in (0, hi].
static double setting_positive(const char* name, double dflt, double hi, const char* accepts) {
  const char* v = setting(name);
  if (!v) return dflt;
  errno = 0;
  char* end = nullptr;
  const double x = strtod(v, &end);
  if (strspn(v, "0123456789.eE+-") != strlen(v) || *end || errno || !std::isfinite(x) || !(x > 0) || x > hi)
    bad_setting(name, v, accepts);
  return x;
}

int gpus() { return int(setting_count("TS_EMU_GPUS", 8, 1, 64, "a whole number of GPUs per node from 1 to 64")); }
size_t memory_bytes() {
  return size_t(setting_positive("TS_EMU_MEMORY_GB", 80.0, 4096, "a number of GiB above 0 and at most 4096 (e.g. 80, 0.5)") *
                double(1ull << 30));
}
double nccl_timeout_s() {
  return setting_positive("TS_EMU_NCCL_TIMEOUT", 240, 86400, "a number of seconds above 0 and at most 86400");
}
bool quiet() {
  const char* v = setting("TS_EMU_QUIET");
  if (v && strcmp(v, "0") && strcmp(v, "1")) bad_setting("TS_EMU_QUIET", v, "1 (no report lines on stderr) or 0");
  return v && !strcmp(v, "1");
}
const char* coverage_path() {
  const char* v = setting("TS_EMU_COVERAGE");
  if (!v) return nullptr;
  const std::string path(v), dir = path.find('/') == std::string::npos ? "." : path.substr(0, path.rfind('/') + 1);
  if (path.back() == '/' || access(dir.c_str(), W_OK))
    bad_setting("TS_EMU_COVERAGE", v, "the path of a file in a directory that exists and can be written to");
  return v;
}
static std::atomic<int> g_reverse{-1};
bool reverse_order() {
  if (g_reverse < 0) {
    const char* v = setting("TS_EMU_ORDER");
    if (v && strcmp(v, "forward") && strcmp(v, "reverse")) bad_setting("TS_EMU_ORDER", v, "forward or reverse");
    g_reverse = v && !strcmp(v, "reverse");
  }
  return g_reverse == 1;
}
void set_reverse_order(bool on) { g_reverse = on; }
unsigned char uninit_byte() {
  static const unsigned char b = [] {
    const char* v = setting("TS_EMU_POISON");
    if (v && strcmp(v, "nan") && strcmp(v, "big"))
      bad_setting("TS_EMU_POISON", v, "nan (0xFF bytes, the default) or big (0x7F bytes: 3.39e38, not -1 as an int)");
    return (unsigned char)(v && !strcmp(v, "big") ? 0x7F : 0xFF);
  }();
  return b;
}

void check_settings() {
  gpus();
  memory_bytes();
  nccl_timeout_s();
  quiet();
  coverage_path();
  reverse_order();
  uninit_byte();
}
// At start-up, before main: a bad setting stops the program before it does anything.
static const bool g_settings_checked = (check_settings(), true);

// ----- streams -----------------------------------------------------------------------------------

struct Op {
  uint64_t seq;
  std::string what;
  std::function<void()> work;
  std::shared_ptr<char> issued;  // SANITIZE=thread: what the host had done when it queued the op
};

// SANITIZE=thread: each op's completion is its own sync object, acquired only by who waits for that
// op (a ring of the last kDoneRing; a wait for an older op takes the newest, a little too much).
constexpr size_t kDoneRing = 1024;
struct DoneRing {
  std::vector<std::unique_ptr<char>> sync = std::vector<std::unique_ptr<char>>(kDoneRing);
  std::vector<uint64_t> seq = std::vector<uint64_t>(kDoneRing, 0);
};

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op> queue;
  uint64_t issued = 0;    // sequence number of the last op queued
  uint64_t done = 0;      // ... of the last op that has run
  uint64_t demanded = 0;  // everything up to here may run now
  bool blocking = true;   // created without cudaStreamNonBlocking (the null stream waits for it)
  int device = 0;         // the device current when it was created: its work may only be queued there
  bool destroyed = false;
  std::unique_ptr<DoneRing> ring = tsan::kOn ? std::make_unique<DoneRing>() : nullptr;
};

// SANITIZE=thread (the caller holds s->mu): op seq has run; and who saw it finish acquires it.
static void tsan_done(Stream* s, uint64_t seq) {
  if (!tsan::kOn) return;
  auto& slot = s->ring->sync[seq % kDoneRing];
  slot.reset(new char);
  s->ring->seq[seq % kDoneRing] = seq;
  tsan::release(slot.get());
}
static void tsan_saw_done(Stream* s, uint64_t seq) {
  if (!tsan::kOn || !seq) return;
  const size_t i = s->ring->seq[seq % kDoneRing] == seq ? seq % kDoneRing : s->done % kDoneRing;
  if (s->ring->sync[i]) tsan::acquire(s->ring->sync[i].get());
}

static thread_local bool t_on_stream = false;
static thread_local int t_device = 0;  // cudaSetDevice's, per host thread as in CUDA
bool on_stream_thread() { return t_on_stream; }

// Work runs one op at a time and never while holding the stream's lock, so a kernel may take as
// long as it likes and other threads may queue behind it.
static void worker(Stream* s) {
  t_on_stream = true;
  tsan::stream_thread(s->blocking ? "emulated stream (blocking)" : "emulated stream (non-blocking)");
  std::unique_lock<std::mutex> lk(s->mu);
  for (;;) {
    s->cv.wait(lk, [&] { return !s->queue.empty() && s->queue.front().seq <= s->demanded; });
    Op op = std::move(s->queue.front());
    s->queue.pop_front();
    lk.unlock();
    if (op.issued) tsan::acquire(op.issued.get()), tsan::thread_name(("emulated stream running " + op.what).c_str());
    if (sticky_error() == cudaSuccess) op.work();  // after a fault nothing more runs, as on hardware
    op.work = nullptr;
    lk.lock();
    tsan_done(s, op.seq);
    s->done = op.seq;
    s->cv.notify_all();
  }
}

// Streams are never freed: a destroyed stream finishes its queue (CUDA's rule) on a thread that
// outlives the program's static destructors.
static Stream* new_stream(bool blocking) {
  Stream* s = new Stream;
  s->blocking = blocking;
  s->device = t_device;
  std::thread(worker, s).detach();
  return s;
}

static std::mutex g_streams_mu;
static std::vector<Stream*> g_streams;  // every stream ever created, the null stream first

Stream* stream(cudaStream_t h) {
  if (h) return reinterpret_cast<Stream*>(h);
  static Stream* null_stream = [] {
    Stream* s = new_stream(true);
    std::lock_guard<std::mutex> lk(g_streams_mu);
    g_streams.insert(g_streams.begin(), s);
    return s;
  }();
  return null_stream;
}

uint64_t last_seq(Stream* s) {
  std::lock_guard<std::mutex> lk(s->mu);
  return s->issued;
}
bool finished(Stream* s, uint64_t seq) {
  std::lock_guard<std::mutex> lk(s->mu);
  if (s->done >= seq) tsan_saw_done(s, seq);  // a query that finds it complete has synchronised
  return s->done >= seq;
}

void demand(Stream* s, uint64_t seq, bool wait) {
  std::unique_lock<std::mutex> lk(s->mu);
  if (seq > s->demanded) {
    s->demanded = seq;
    s->cv.notify_all();
  }
  if (wait) {
    s->cv.wait(lk, [&] { return s->done >= seq; });
    tsan_saw_done(s, seq);
  }
}

uint64_t enqueue(cudaStream_t h, std::string what, std::function<void()> work, bool eager) {
  Stream* s = stream(h);
  if (h && s->device != t_device)
    device_fault(cudaErrorInvalidResourceHandle,
                 "%s queued on a stream of device %d while device %d is current: a stream belongs to the device that "
                 "was current when it was created (create streams and handles after cudaSetDevice)",
                 what.c_str(), s->device, t_device);
  if (h && s->blocking) {
    // A blocking stream's work begins only after the legacy stream's earlier work.
    Stream* legacy = stream(nullptr);
    const uint64_t seq = last_seq(legacy);
    if (seq) work = [legacy, seq, w = std::move(work)] {
      demand(legacy, seq, true);
      w();
    };
  } else if (!h) {
    // The legacy default stream: its work begins only after all earlier work on blocking streams.
    std::vector<std::pair<Stream*, uint64_t>> before;
    {
      std::lock_guard<std::mutex> lk(g_streams_mu);
      for (Stream* o : g_streams)
        if (o != s && o->blocking) before.push_back({o, last_seq(o)});
    }
    if (!before.empty())
      work = [before, w = std::move(work)] {
        for (auto& [o, seq] : before) demand(o, seq, true);
        w();
      };
  }
  std::shared_ptr<char> issued;
  if (tsan::kOn) issued.reset(new char), tsan::release(issued.get());
  std::lock_guard<std::mutex> lk(s->mu);
  uint64_t seq = ++s->issued;
  s->queue.push_back(Op{seq, std::move(what), std::move(work), std::move(issued)});
  if (eager) s->demanded = std::max(s->demanded, seq);
  s->cv.notify_all();
  return seq;
}

static void demand_all(bool wait) {
  std::vector<Stream*> all;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    all = g_streams;
  }
  for (Stream* s : all) demand(s, last_seq(s), false);
  if (wait)
    for (Stream* s : all) demand(s, last_seq(s), true);
}

// ----- memory ------------------------------------------------------------------------------------

static std::mutex g_mem_mu;
static std::map<uintptr_t, size_t> g_device;  // live cudaMalloc blocks: start -> bytes
static std::map<uintptr_t, size_t> g_pinned;  // live cudaMallocHost blocks: start -> bytes
static size_t g_used = 0;
static std::atomic<uint64_t> g_d2h{0};

// Whether [p, p + bytes) lies inside one block of `blocks` (the caller holds g_mem_mu).
static bool inside(const std::map<uintptr_t, size_t>& blocks, const void* p, size_t bytes) {
  uintptr_t a = uintptr_t(p);
  auto it = blocks.upper_bound(a);
  if (it == blocks.begin()) return false;
  --it;
  return a >= it->first && a + bytes <= it->first + it->second;
}
bool is_device(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  return inside(g_device, p, bytes);
}
// A copy from the middle of a pinned buffer (one slot of a staging ring) is a pinned copy too.
bool is_pinned(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  return inside(g_pinned, p, bytes);
}
uint64_t device_to_host_copies() { return g_d2h.load(); }
// A copy as a stream runs it: the bytes, and in the memcheck build what was written of them; under
// SANITIZE=thread, the program's read and write (tsan.h).
static void copy(void* dst, const void* src, size_t bytes) {
  tsan::read(src, bytes);
  tsan::write(dst, bytes);
  memcpy(dst, src, bytes);
  shadow::copied(dst, src, bytes);
}
void poison_recycled(void* p, size_t bytes, cudaStream_t s) {
  const unsigned char b = uninit_byte();
  enqueue(s, "poisoning a recycled block", [=] {
    tsan::Quiet quiet;  // the emulator's poison, not the program's write
    memset(p, b, bytes);
    shadow::unwritten(p, bytes);
  });
}
// The caching allocator (tensor layer, below this one) calls it through its hook.
static const bool kRecycleHooked = (ts::set_recycle_hook([](void* p, size_t n, void* s) {
  poison_recycled(p, n, static_cast<cudaStream_t>(s));
}), true);

}  // namespace emu

// ===== the runtime's calls ==========================================================================

using emu::Stream;

static thread_local cudaError_t t_last = cudaSuccess;  // per host thread, as CUDA keeps it
using emu::t_device;

// Every call first returns a sticky fault, and records any error as the thread's last error.
static cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) t_last = e;
  return e;
}
#define EMU_STICKY()                                          \
  do {                                                        \
    if (emu::sticky_error() != cudaSuccess) return ret(emu::sticky_error()); \
  } while (0)

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidSymbol: return "cudaErrorInvalidSymbol";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorLaunchFailure: return "unspecified launch failure (the emulated GPU printed why)";
    case cudaErrorIllegalInstruction: return "an illegal instruction was encountered";
    default: return cudaGetErrorName(e);
  }
}
cudaError_t cudaGetLastError() {
  cudaError_t e = emu::sticky_error() != cudaSuccess ? emu::sticky_error() : t_last;
  t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return emu::sticky_error() != cudaSuccess ? emu::sticky_error() : t_last; }

// Used by kernel.cu: a refused launch is the thread's last error.
namespace emu {
void set_last_error(cudaError_t e) { ret(e); }
}  // namespace emu

// ----- devices -------------------------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* n) {
  *n = emu::gpus();
  return *n > 0 ? cudaSuccess : ret(cudaErrorNoDevice);
}
cudaError_t cudaSetDevice(int d) {
  if (d < 0 || d >= emu::gpus()) return ret(cudaErrorInvalidDevice);
  t_device = d;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return cudaSuccess;
}
// Distinct bus ids per device index: ranks that pick distinct devices own distinct GPUs (NCCL's
// path); ranks that pick the same index share one (the staged MPI path).
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int d) {
  if (d < 0 || d >= emu::gpus()) return ret(cudaErrorInvalidDevice);
  snprintf(bus_id, size_t(len), "0000:%02x:00.0", 0x18 + d);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int d) {
  if (d < 0 || d >= emu::gpus()) return ret(cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;  // an H100's sm_90: FP8 is native
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; break;
    default: return ret(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  if (d < 0 || d >= emu::gpus()) return ret(cudaErrorInvalidDevice);
  memset(p, 0, sizeof *p);
  snprintf(p->name, sizeof p->name, "Emulated GPU (sm_90, on the CPU)");
  p->totalGlobalMem = emu::memory_bytes();
  p->sharedMemPerBlock = 48 * 1024;
  p->sharedMemPerBlockOptin = 227 * 1024;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024;
  p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 0x7fffffff;
  p->maxGridSize[1] = p->maxGridSize[2] = 65535;
  p->major = 9;
  p->multiProcessorCount = 132;
  p->pciBusID = 0x18 + d;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  emu::demand_all(true);
  EMU_STICKY();
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> lk(emu::g_mem_mu);
  *total_bytes = emu::memory_bytes();
  *free_bytes = *total_bytes - std::min(*total_bytes, emu::g_used);
  return cudaSuccess;
}

// ----- memory --------------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** p, size_t bytes) {
  EMU_STICKY();
  *p = nullptr;
  const size_t n = std::max<size_t>((bytes + 255) / 256 * 256, 256);  // cudaMalloc aligns to 256 bytes
  {
    std::lock_guard<std::mutex> lk(emu::g_mem_mu);
    if (emu::g_used + n > emu::memory_bytes()) return ret(cudaErrorMemoryAllocation);
    emu::g_used += n;
  }
  const size_t rz = emu::shadow::redzone();  // the memcheck build's redzones on both sides
  char* q = static_cast<char*>(aligned_alloc(256, n + 2 * rz));
  if (!q) return ret(cudaErrorMemoryAllocation);
  q += rz;
  {
    emu::tsan::Quiet quiet;  // the poison is the emulator's write, not the program's
    memset(q, emu::uninit_byte(), n);
  }
  emu::shadow::allocated(q, bytes, n, emu::shadow::Kind::Device);
  std::lock_guard<std::mutex> lk(emu::g_mem_mu);
  emu::g_device[uintptr_t(q)] = n;
  *p = q;
  return cudaSuccess;
}
// cudaFree waits for the device first, as CUDA's does, so queued work never reads freed memory.
cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  emu::demand_all(true);
  std::lock_guard<std::mutex> lk(emu::g_mem_mu);
  auto it = emu::g_device.find(uintptr_t(p));
  if (it == emu::g_device.end()) {
    emu::report("cudaFree(%p): not the start of a live cudaMalloc allocation", p);
    return ret(cudaErrorInvalidValue);
  }
  emu::g_used -= it->second;
  emu::shadow::released(p, it->second);
  emu::g_device.erase(it);
  free(static_cast<char*>(p) - emu::shadow::redzone());
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  const size_t n = std::max<size_t>((bytes + 255) / 256 * 256, 256);
  const size_t rz = emu::shadow::redzone();
  char* q = static_cast<char*>(aligned_alloc(256, n + 2 * rz));
  if (!q) return ret(cudaErrorMemoryAllocation);
  *p = q + rz;
  {
    emu::tsan::Quiet quiet;  // the poison is the emulator's write, not the program's
    memset(*p, emu::uninit_byte(), n);  // page-locked memory holds whatever was there: poison
  }
  emu::shadow::allocated(*p, bytes, n, emu::shadow::Kind::Pinned);
  std::lock_guard<std::mutex> lk(emu::g_mem_mu);
  emu::g_pinned[uintptr_t(*p)] = n;
  return cudaSuccess;
}
// Like cudaFree, it waits for the device first: queued copies may still read the buffer.
cudaError_t cudaFreeHost(void* p) {
  emu::demand_all(true);
  std::lock_guard<std::mutex> lk(emu::g_mem_mu);
  auto it = emu::g_pinned.find(uintptr_t(p));
  if (it == emu::g_pinned.end()) return ret(cudaErrorInvalidValue);
  emu::shadow::released(p, it->second);
  emu::g_pinned.erase(it);
  free(static_cast<char*>(p) - emu::shadow::redzone());
  return cudaSuccess;
}

// The kind must say where each side really is: cudaMemcpyDefault infers it, as with unified
// addressing; a wrong kind is an error here (the hardware would fault or copy garbage).
static cudaError_t check_kind(void* dst, const void* src, size_t bytes, cudaMemcpyKind& kind) {
  const bool d_dev = emu::is_device(dst, bytes), s_dev = emu::is_device(src, bytes);
  const cudaMemcpyKind actual = cudaMemcpyKind((d_dev ? 1 : 0) + (s_dev ? 2 : 0) == 0   ? cudaMemcpyHostToHost
                                               : !s_dev                                ? cudaMemcpyHostToDevice
                                               : !d_dev                                ? cudaMemcpyDeviceToHost
                                                                                       : cudaMemcpyDeviceToDevice);
  if (kind == cudaMemcpyDefault) kind = actual;
  if (kind != actual) {
    emu::report("cudaMemcpy of %zu bytes from %p to %p: kind %d, but the source is %s memory and the destination %s",
                bytes, src, dst, int(kind), s_dev ? "device" : "host", d_dev ? "device" : "host");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
  EMU_STICKY();
  if (bytes == 0) return cudaSuccess;
  if (cudaError_t e = check_kind(dst, src, bytes, kind)) return ret(e);
  if (kind == cudaMemcpyDeviceToHost) emu::g_d2h++;
  if (kind == cudaMemcpyHostToDevice && !emu::is_pinned(src, bytes)) {
    // Pageable source: CUDA stages it before returning, so the caller may reuse it at once.
    auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    emu::enqueue(s, "cudaMemcpyAsync host to device", [=] { emu::copy(dst, staged->data(), bytes); });
    return cudaSuccess;
  }
  // Pinned host memory is read or written by the copy itself, when it runs on the stream (late):
  // a pinned source overwritten before then is copied as it is then, as the copy engine would.
  uint64_t seq = emu::enqueue(s, "cudaMemcpyAsync", [=] { emu::copy(dst, src, bytes); });
  // Pageable destination: the call returns once the copy is done.
  if (kind == cudaMemcpyDeviceToHost && !emu::is_pinned(dst, bytes)) emu::demand(emu::stream(s), seq, true);
  EMU_STICKY();
  return cudaSuccess;
}
// cudaMemcpy and cudaMemset on the legacy stream return as early as CUDA's API synchronisation
// behaviour allows ("API synchronization behavior", CUDA Runtime API): a device-to-device copy and a
// memset return at once, a host-to-device copy from pageable memory once its source is staged;
// from pinned memory, and into host memory, the call waits for the copy. Work queued on a
// non-blocking stream is not ordered after them (the legacy stream orders only blocking streams),
// so a kernel there that reads their result without an event or a synchronisation reads poison.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  EMU_STICKY();
  if (bytes == 0) return cudaSuccess;
  if (cudaError_t e = check_kind(dst, src, bytes, kind)) return ret(e);
  if (kind == cudaMemcpyDeviceToHost) emu::g_d2h++;
  if (kind == cudaMemcpyHostToDevice && !emu::is_pinned(src, bytes)) {
    auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + bytes);
    emu::enqueue(nullptr, "cudaMemcpy host to device", [=] { emu::copy(dst, staged->data(), bytes); });
    return cudaSuccess;
  }
  uint64_t seq = emu::enqueue(nullptr, "cudaMemcpy", [=] { emu::copy(dst, src, bytes); });
  if (kind != cudaMemcpyDeviceToDevice) emu::demand(emu::stream(nullptr), seq, true);
  EMU_STICKY();
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  EMU_STICKY();
  if (bytes && !emu::is_device(p, bytes)) {
    emu::report("cudaMemsetAsync(%p, %zu bytes): not inside one device allocation", p, bytes);
    return ret(cudaErrorInvalidValue);
  }
  emu::enqueue(s, "cudaMemsetAsync", [=] {
    emu::tsan::write(p, bytes);
    memset(p, value, bytes);
    emu::shadow::written(p, bytes);
  });
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return cudaMemsetAsync(p, value, bytes, nullptr); }

// ----- streams and events --------------------------------------------------------------------------

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  Stream* st = emu::new_stream(!(flags & cudaStreamNonBlocking));
  {
    std::lock_guard<std::mutex> lk(emu::g_streams_mu);
    emu::g_streams.push_back(st);
  }
  *s = reinterpret_cast<cudaStream_t>(st);
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  if (!s) return ret(cudaErrorInvalidResourceHandle);
  Stream* st = emu::stream(s);
  emu::demand(st, emu::last_seq(st), false);  // its queued work still runs, as CUDA promises
  std::lock_guard<std::mutex> lk(st->mu);
  st->destroyed = true;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Stream* st = emu::stream(s);
  emu::demand(st, emu::last_seq(st), true);
  EMU_STICKY();
  return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
  EMU_STICKY();
  Stream* st = emu::stream(s);
  uint64_t seq = emu::last_seq(st);
  emu::demand(st, seq, false);
  return emu::finished(st, seq) ? cudaSuccess : cudaErrorNotReady;
}

// An event is the position (stream, sequence number) of its latest record.
struct CUevent_st {
  Stream* stream = nullptr;
  uint64_t seq = 0;
  bool destroyed = false;
};

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }
// Work already queued may still refer to the event's position (by value), so it can go now.
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  if (!e || e->destroyed) return ret(cudaErrorInvalidResourceHandle);
  delete e;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  EMU_STICKY();
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  e->stream = emu::stream(s);
  e->seq = emu::enqueue(s, "cudaEventRecord", [] {});
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  EMU_STICKY();
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (!e->stream) return cudaSuccess;  // never recorded: complete, as CUDA says
  emu::demand(e->stream, e->seq, false);
  return emu::finished(e->stream, e->seq) ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (e->stream) emu::demand(e->stream, e->seq, true);
  EMU_STICKY();
  return cudaSuccess;
}
// The stream waits for the event's record as it stood at this call (a later record does not move it).
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  EMU_STICKY();
  if (!e) return ret(cudaErrorInvalidResourceHandle);
  if (!e->stream) return cudaSuccess;
  Stream* other = e->stream;
  uint64_t seq = e->seq;
  emu::enqueue(s, "cudaStreamWaitEvent", [other, seq] { emu::demand(other, seq, true); });
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = 0;  // the emulator keeps no device time
  return ret(cudaErrorInvalidValue);
}
