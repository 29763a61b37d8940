// shadow.cu — the memcheck build's shadow memory (shadow.h): one byte of state for every byte of
// device memory, pinned host memory and shared memory, and the callbacks that g++'s
// -fsanitize=kernel-address instrumentation makes before every load and store of the code that
// holds kernels (--param asan-instrumentation-with-call-threshold=0: a call, never inline checks).
//
// Why by hand: AddressSanitizer sees heap blocks, not which bytes a kernel wrote, and neither it nor
// MSan (clang only; the project builds with g++) knows a kernel from host code or shared memory
// from a global. The compiler's instrumentation is the well-kept part: which accesses there are,
// their sizes, and redzones around the static __shared__ arrays (--param asan-globals=1 with
// -fsanitize-sections=ts_emu_shared; gcc registers them through __asan_register_globals). What the
// shadow keeps is the emulator's: allocation, recycling, copies, cuBLAS's and NCCL's outputs.
//
// A shadow byte is 0 (not tracked: the host's memory, a fiber's stack), 1 (a redzone: outside any
// allocation or array), 2 (addressable, nothing wrote it) or 3 (written). The shadow of a 4 KiB page
// lives in a two-level table (47-bit addresses: 17 bits, 18 bits, 12 bits), made on first use.
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "shadow.h"

namespace emu::shadow {

enum : uint8_t { kUntracked = 0, kRedzone = 1, kUnwritten = 2, kWritten = 3 };
constexpr size_t kRedzoneBytes = 256;  // as cudaMalloc's alignment, so the allocation stays 256-aligned

static std::atomic<bool> g_on{false};
bool on() { return g_on.load(std::memory_order_relaxed); }
size_t redzone() { return on() ? kRedzoneBytes : 0; }

// ----- the table -----------------------------------------------------------------------------------

using Page = uint8_t;  // 4096 shadow bytes
static std::atomic<std::atomic<Page*>*> g_dir[1u << 17];

static inline Page* page(uintptr_t a) {
  std::atomic<Page*>* l2 = g_dir[(a >> 30) & 0x1ffff].load(std::memory_order_acquire);
  return l2 ? l2[(a >> 12) & 0x3ffff].load(std::memory_order_acquire) : nullptr;
}
static Page* make_page(uintptr_t a) {
  auto& d = g_dir[(a >> 30) & 0x1ffff];
  std::atomic<Page*>* l2 = d.load(std::memory_order_acquire);
  if (!l2) {
    auto* fresh = static_cast<std::atomic<Page*>*>(calloc(1u << 18, sizeof(std::atomic<Page*>)));
    if (!d.compare_exchange_strong(l2, fresh)) free(fresh);
    else l2 = fresh;
  }
  auto& e = l2[(a >> 12) & 0x3ffff];
  Page* p = e.load(std::memory_order_acquire);
  if (!p) {
    Page* fresh = static_cast<Page*>(calloc(4096, 1));
    if (!e.compare_exchange_strong(p, fresh)) free(fresh);
    else p = fresh;
  }
  return p;
}
// Sets the state of [a, a + n); kUntracked never makes a page.
static void set(uintptr_t a, size_t n, uint8_t state) {
  for (size_t i = 0; i < n;) {
    const uintptr_t x = a + i;
    const size_t in_page = std::min<size_t>(n - i, 4096 - (x & 4095));
    Page* p = state == kUntracked ? page(x) : make_page(x);
    if (p) memset(p + (x & 4095), state, in_page);
    i += in_page;
  }
}
static uint8_t state_at(uintptr_t a) {
  Page* p = page(a);
  return p ? p[a & 4095] : kUntracked;
}

// ----- what each tracked range is, for the reports -----------------------------------------------

struct Range {
  size_t bytes, total;  // addressable bytes; with the rounding (redzones lie outside total)
  std::string what;     // "device allocation", "shared array sh", ...
};
// Made on first use: instrumented objects register their shared arrays from their constructors,
// which may run before this file's.
static std::mutex& ranges_mu() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
static std::map<uintptr_t, Range>& ranges() {
  static auto* r = new std::map<uintptr_t, Range>;
  return *r;
}

static void add_range(uintptr_t a, size_t bytes, size_t total, std::string what) {
  std::lock_guard<std::mutex> lk(ranges_mu());
  ranges()[a] = Range{bytes, total, std::move(what)};
}
static void drop_range(uintptr_t a) {
  std::lock_guard<std::mutex> lk(ranges_mu());
  ranges().erase(a);
}

// Where a bad address lies: "byte 12 of the 1024-byte device allocation at 0x…", or past its end.
static std::string locate(uintptr_t a) {
  std::lock_guard<std::mutex> lk(ranges_mu());
  char buf[256];
  const std::map<uintptr_t, Range>& all = ranges();
  auto it = all.upper_bound(a);
  const auto after = it;
  if (it != all.begin()) {
    --it;
    const Range& r = it->second;
    if (a < it->first + r.bytes) {
      snprintf(buf, sizeof buf, "byte %zu of the %zu-byte %s at 0x%" PRIxPTR, size_t(a - it->first), r.bytes,
               r.what.c_str(), it->first);
      return buf;
    }
    if (a < it->first + r.total + kRedzoneBytes) {
      snprintf(buf, sizeof buf, "%zu bytes past the end of the %zu-byte %s at 0x%" PRIxPTR, size_t(a - it->first - r.bytes),
               r.bytes, r.what.c_str(), it->first);
      return buf;
    }
  }
  if (after != all.end() && after->first - a <= kRedzoneBytes) {
    snprintf(buf, sizeof buf, "%zu bytes before the %zu-byte %s at 0x%" PRIxPTR, size_t(after->first - a),
             after->second.bytes, after->second.what.c_str(), after->first);
    return buf;
  }
  return "outside every allocation and shared array";
}

// ----- the hooks -----------------------------------------------------------------------------------

void allocated(void* p, size_t bytes, size_t total, Kind k) {
  if (!on()) return;
  const uintptr_t a = uintptr_t(p);
  set(a - kRedzoneBytes, kRedzoneBytes, kRedzone);
  // Pinned memory is the host's, whose stores (plain code, libc's memcpy) the instrumentation does
  // not see: it counts as written, and only its bounds are checked (compute-sanitizer's initcheck
  // covers cudaMalloc memory only, too).
  set(a, bytes, k == Kind::Device ? kUnwritten : kWritten);
  set(a + bytes, total - bytes + kRedzoneBytes, kRedzone);  // cudaMalloc's rounding is outside too
  add_range(a, bytes, total, k == Kind::Device ? "device allocation" : "pinned host allocation (cudaMallocHost)");
}
void released(void* p, size_t total) {
  if (!on()) return;
  set(uintptr_t(p) - kRedzoneBytes, total + 2 * kRedzoneBytes, kUntracked);
  drop_range(uintptr_t(p));
}
// Only addressable bytes change: a write or recycle never turns a redzone into memory.
static void mark(const void* p, size_t n, uint8_t state) {
  if (!on()) return;
  const uintptr_t a = uintptr_t(p);
  for (size_t i = 0; i < n;) {
    const uintptr_t x = a + i;
    const size_t in_page = std::min<size_t>(n - i, 4096 - (x & 4095));
    if (Page* pg = page(x))
      for (size_t k = 0; k < in_page; k++) {
        uint8_t& s = pg[(x & 4095) + k];
        if (s >= kUnwritten) s = state;
      }
    i += in_page;
  }
}
void written(const void* p, size_t bytes) { mark(p, bytes, kWritten); }
void unwritten(const void* p, size_t bytes) { mark(p, bytes, kUnwritten); }
void copied(void* dst, const void* src, size_t bytes) {
  if (!on()) return;
  const uintptr_t d = uintptr_t(dst), s = uintptr_t(src);
  for (size_t i = 0; i < bytes; i++) {
    Page* pg = page(d + i);
    if (!pg) {
      i |= 4095 - ((d + i) & 4095);  // to the page's last byte
      continue;
    }
    uint8_t& to = pg[(d + i) & 4095];
    if (to < kUnwritten) continue;
    const uint8_t from = state_at(s + i);
    to = from == kUnwritten ? kUnwritten : kWritten;  // host memory (untracked) counts as written
  }
}

const char* unreadable(const void* p, size_t n) {
  if (!on()) return nullptr;
  const char* why = nullptr;
  for (size_t i = 0; i < n; i++) {
    const uint8_t st = state_at(uintptr_t(p) + i);
    if (st == kRedzone) return "memcheck: a read outside its shared array";
    if (st == kUnwritten) why = "initcheck: a read of shared memory that nothing wrote";
  }
  return why;
}

// ----- the running grid ----------------------------------------------------------------------------

static thread_local bool t_grid = false;      // a kernel's threads run on this host thread
static thread_local bool t_reported = false;  // this grid has reported: one report per grid
static thread_local void* t_dyn_named = nullptr;  // the dynamic shared memory the ranges name

Grid::Grid(const char*, void* d, size_t n) : dyn(d), bytes(n) {
  t_grid = on();
  t_reported = false;
}
Grid::~Grid() {
  t_grid = false;
  if (!on() || !dyn) return;
  set(uintptr_t(dyn), bytes + kRedzoneBytes, kUntracked);  // the vector's memory is the heap's again
  if (t_dyn_named == dyn) drop_range(uintptr_t(dyn)), t_dyn_named = nullptr;
}

// Static arrays in the ts_emu_shared section (registered by the instrumented objects, with gcc's
// redzones between them) and a template kernel's arrays (outside it, without redzones), and the
// dynamic bytes: unwritten at every block's start, as kernel.cu poisons them.
struct Global {
  uintptr_t beg;
  size_t bytes, with_redzone;
};
static std::vector<Global>* g_shared = nullptr;  // registered before main (constructors); read-only after

void block_start(const std::vector<std::pair<char*, size_t>>& arrays, void* dyn, size_t bytes) {
  if (!on()) return;
  if (g_shared)
    for (const Global& g : *g_shared) set(g.beg, g.bytes, kUnwritten);
  for (const auto& [p, n] : arrays)
    if (state_at(uintptr_t(p)) == kUntracked || state_at(uintptr_t(p)) >= kUnwritten) {
      if (state_at(uintptr_t(p)) == kUntracked) add_range(uintptr_t(p), n, n, "shared array (a template kernel's)");
      set(uintptr_t(p), n, kUnwritten);
    }
  if (dyn) {
    set(uintptr_t(dyn), bytes, kUnwritten);
    set(uintptr_t(dyn) + bytes, kRedzoneBytes, kRedzone);
    if (t_dyn_named != dyn) add_range(uintptr_t(dyn), bytes, bytes, "dynamic shared memory"), t_dyn_named = dyn;
  }
}

// ----- the report ----------------------------------------------------------------------------------

// The source line of the instrumented access at return address pc, with the functions it was
// inlined into: addr2line on the program's own debug information (the memcheck build compiles the
// kernels' code with -g).
static std::string source_of(void* pc) {
  Dl_info info{};
  if (!dladdr(pc, &info) || !info.dli_fname) return "an unknown address";
  char cmd[1024];
  const uintptr_t off = uintptr_t(pc) - 1 - uintptr_t(info.dli_fbase);
  snprintf(cmd, sizeof cmd, "addr2line -C -f -i -e '%s' 0x%" PRIxPTR " 2>/dev/null", info.dli_fname, off);
  std::string out, fn, line;
  char here[4096];
  const std::string cwd = getcwd(here, sizeof here) ? std::string(here) + "/" : "";
  if (FILE* f = popen(cmd, "r")) {
    char buf[1024];
    for (int k = 0; fgets(buf, sizeof buf, f); k++) {
      std::string s(buf);
      while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
      if (k % 2 == 0) {
        for (size_t a; (a = s.find("(anonymous namespace)::")) != std::string::npos;) s.erase(a, 23);
        fn = s.substr(0, s.find('('));
        continue;
      }
      line = s.substr(0, s.find(" (discriminator"));
      if (line.compare(0, cwd.size(), cwd) == 0) line = line.substr(cwd.size());
      // The frames the emulator's launch wraps around the kernel (std::apply, kernel.h) are not the kernel's.
      if (line.compare(0, 5, "/usr/") == 0 || line.find("common/emu/") != std::string::npos) break;
      out += out.empty() ? line + " (" + fn + ")" : ", inlined into " + fn + " at " + line;
    }
    pclose(f);
  }
  if (out.empty() || out[0] == '?') {
    snprintf(cmd, sizeof cmd, "%s+0x%" PRIxPTR, info.dli_fname, off);
    return cmd;
  }
  return out;
}

static void defect(const char* what, uintptr_t a, size_t n, bool store, void* pc, bool now = false) {
  if (t_reported) return;
  t_reported = true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s of %zu byte%s at 0x%" PRIxPTR, store ? "write" : "read", n, n == 1 ? "" : "s", a);
  emu::kernel_defect(std::string(what) + ": " + buf + ", " + locate(a) + ", at " + source_of(pc), now);
}

// Every load and store of the instrumented code: checked while a grid runs on this thread (host code
// in the same files returns at once); a store marks its bytes written.
static inline void access(uintptr_t a, size_t n, bool store, bool sized, void* pc) {
  if (!t_grid) return;
  Page* first = page(a);
  if (!first && (n <= 1 || !page(a + n - 1)) && n <= 4096) return;  // host memory, a stack
  uintptr_t bad = 0;
  uint8_t bad_state = kWritten;
  for (size_t i = 0; i < n;) {
    const uintptr_t x = a + i;
    const size_t in_page = std::min<size_t>(n - i, 4096 - (x & 4095));
    if (Page* pg = i == 0 ? first : page(x))
      for (size_t k = 0; k < in_page; k++) {
        uint8_t& s = pg[(x & 4095) + k];
        if (s == kRedzone && bad_state != kRedzone) bad = x + k, bad_state = kRedzone;
        else if (s == kUnwritten && !store && bad_state == kWritten) bad = x + k, bad_state = kUnwritten;
        else if (s == kUnwritten && store) s = kWritten;
      }
    i += in_page;
  }
  if (bad_state == kRedzone) defect("memcheck: an access outside its allocation or shared array", bad, n, store, pc);
  else if (bad_state == kUnwritten) defect("initcheck: a read of memory that nothing wrote", bad, n, store, pc);
  else if (sized && n > 1 && a % n)
    defect("memcheck: a misaligned access (a 2-, 4-, 8- or 16-byte access must be aligned to its size)", a, n, store, pc,
           n == 16);  // x86's aligned 16-byte moves fault on it next
}

}  // namespace emu::shadow

// ----- what g++ calls ------------------------------------------------------------------------------
// -fsanitize=kernel-address's ABI (gcc's sanitizer.def); __asan_register_globals gets gcc's
// struct __asan_global (asan.cc, asan_global_struct) for each instrumented object's globals.
#ifndef __SANITIZE_ADDRESS__  // AddressSanitizer's own runtime (SANITIZE=address) defines these
extern "C" char __start_ts_emu_shared[] __attribute__((weak));
extern "C" char __stop_ts_emu_shared[] __attribute__((weak));

extern "C" {
struct ts_asan_global {
  const void* beg;
  size_t size, size_with_redzone;
  const char* name;
  const char* module_name;
  size_t has_dynamic_init;
  void* location;
  size_t odr_indicator;
};
void __asan_register_globals(ts_asan_global* g, size_t n) {
  using namespace emu::shadow;
  g_on = true;
  if (!g_shared) g_shared = new std::vector<Global>;
  for (size_t i = 0; i < n; i++) {
    const char* p = static_cast<const char*>(g[i].beg);
    if (!__start_ts_emu_shared || p < __start_ts_emu_shared || p >= __stop_ts_emu_shared) continue;
    g_shared->push_back(Global{uintptr_t(p), g[i].size, g[i].size_with_redzone});
    set(uintptr_t(p), g[i].size, kUnwritten);
    set(uintptr_t(p) + g[i].size, g[i].size_with_redzone - g[i].size, kRedzone);
    add_range(uintptr_t(p), g[i].size, g[i].size, std::string("shared array ") + g[i].name);
  }
}
void __asan_unregister_globals(ts_asan_global*, size_t) {}
void __asan_handle_no_return() {}
void __asan_before_dynamic_init(const char*) {}
void __asan_after_dynamic_init() {}

#define TS_SIZED(n)                                                                                                \
  void __asan_load##n##_noabort(uintptr_t a) { emu::shadow::access(a, n, false, true, __builtin_return_address(0)); } \
  void __asan_store##n##_noabort(uintptr_t a) { emu::shadow::access(a, n, true, true, __builtin_return_address(0)); }
TS_SIZED(1)
TS_SIZED(2)
TS_SIZED(4)
TS_SIZED(8)
TS_SIZED(16)
#undef TS_SIZED
void __asan_loadN_noabort(uintptr_t a, size_t n) { emu::shadow::access(a, n, false, false, __builtin_return_address(0)); }
void __asan_storeN_noabort(uintptr_t a, size_t n) { emu::shadow::access(a, n, true, false, __builtin_return_address(0)); }
}
#endif
