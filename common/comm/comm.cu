// comm.cu — collectives over MPI (CPU tensors; CUDA tensors staged through host memory) and NCCL
// (CUDA tensors when every rank owns a GPU), with byte accounting and the watchdog.
#include "comm/comm.h"
#include "comm/algorithms.h"
#include "tensor/hooks.h"
#include "comm/flight_recorder.h"
#include "comm/threads.h"
#include "tensor/device.h"
#include "comm/watchdog.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <functional>
#include <optional>

namespace ts {

// ----- set-up ----------------------------------------------------------------------------------

// Read by the timer thread below as well as by the waiting thread.
static std::atomic<double> g_timeout{300};
void set_comm_timeout(double seconds) {
  TS_CHECK(seconds > 0, "--timeout must be positive (got %g)", seconds);
  g_timeout = seconds;
}
double comm_timeout() { return g_timeout; }

// The watchdog's verdict, the same from a wait loop and from the timer thread.
[[noreturn]] static void watchdog_abort(double waited, const std::string& what) {
  const std::string at = current_step() >= 0 ? " at step " + std::to_string(current_step()) : "";
  fatal("watchdog: rank %d waited %.1f s for %s%s; aborting every rank", world_rank(), waited, what.c_str(), at.c_str());
}

// ----- blocking calls under a timer thread -----------------------------------------------------
// Every collective below is issued non-blocking and waited for in a loop that checks the
// deadline. A few calls have no non-blocking form (MPI_Init, MPI_Comm_split, MPI_Finalize,
// NCCL's rendezvous): while one runs, its label and start time sit here, and a timer thread that
// wakes every 50 ms ends the job once it has run past the timeout. Plain C state, so the thread
// may outlive main's static destructors.
static pthread_mutex_t g_blocking_mu = PTHREAD_MUTEX_INITIALIZER;
static char g_blocking_what[512];  // "" while no blocking call runs
static double g_blocking_since = 0;

static double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static void* blocking_timer(void*) {
  for (;;) {
    usleep(50 * 1000);
    pthread_mutex_lock(&g_blocking_mu);
    const std::string what = g_blocking_what;
    const double waited = what.empty() ? 0 : steady_seconds() - g_blocking_since;
    pthread_mutex_unlock(&g_blocking_mu);
    if (waited > g_timeout) watchdog_abort(waited, what);
  }
  return nullptr;
}

static void set_blocking(const std::string& what) {
  static pthread_once_t started = PTHREAD_ONCE_INIT;
  pthread_once(&started, [] {
    pthread_t t;
    if (pthread_create(&t, nullptr, blocking_timer, nullptr) == 0) pthread_detach(t);
  });
  pthread_mutex_lock(&g_blocking_mu);
  snprintf(g_blocking_what, sizeof g_blocking_what, "%s", what.c_str());
  g_blocking_since = steady_seconds();
  pthread_mutex_unlock(&g_blocking_mu);
}

// Runs `call` with the timer armed for `what`.
static void under_timer(const std::string& what, const std::function<void()>& call) {
  set_blocking(what);
  call();
  set_blocking("");
}

// fatal() on a job of several ranks: every live rank's flight record, then the abort. MPI may be
// used only from the thread that initialised it (the timer thread's watchdog writes its own alone).
static pthread_t g_main_thread;
static void dump_on_fatal(const char* message) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world > 1) flight::dump_everywhere(message, pthread_equal(pthread_self(), g_main_thread) != 0);
}

void comm_init(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return;
  prepare_process_env(*argv);
  // A rank that never arrives leaves the others in MPI_Init's rendezvous.
  under_timer("MPI_Init (the job's start-up)", [&] {
#ifdef TS_CUDA_EMU
    // The emulated GPU's NCCL runs its operations with MPI on its streams' threads, beside this one.
    int provided = 0;
    MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    if (provided < MPI_THREAD_MULTIPLE) fatal("the emulated GPU needs an MPI with MPI_THREAD_MULTIPLE");
#else
    MPI_CHECK(MPI_Init(argc, argv));
#endif
    MPI_Comm channel;
    MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &channel));
    flight::open_channel(channel);
  });
  g_main_thread = pthread_self();
  set_fatal_hook(dump_on_fatal);
  set_finalize_hook(comm_finalize);
}

// Every Comm not yet destroyed, in creation order. Tearing down an NCCL communicator waits for
// its peers, so every rank releases them in the same order: the reverse of creation, which
// make_mesh makes identical on every rank.
static std::vector<Comm*> g_live;

void comm_finalize() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return;
  // NCCL's teardown and MPI_Finalize both wait for the other ranks.
  under_timer("MPI_Finalize (the job's end)", [] {
    for (auto it = g_live.rbegin(); it != g_live.rend(); ++it) (*it)->release();
    flight::shutdown();
    MPI_Finalize();
  });
}

// ----- bf16 on MPI: MPI has no bf16 type, so reductions are user-defined ops on 16-bit words ----

void bf16_sum_into(bf16* inout, const bf16* in, int64_t n) {
  for (int64_t i = 0; i < n; i++) inout[i] = float_to_bf16(bf16_to_float(inout[i]) + bf16_to_float(in[i]));
}
static void bf16_sum_op(void* in, void* inout, int* len, MPI_Datatype*) {
  bf16_sum_into(static_cast<bf16*>(inout), static_cast<const bf16*>(in), *len);
}
static void bf16_max_op(void* in, void* inout, int* len, MPI_Datatype*) {
  bf16* io = static_cast<bf16*>(inout);
  const bf16* x = static_cast<const bf16*>(in);
  for (int i = 0; i < *len; i++)
    if (bf16_to_float(x[i]) > bf16_to_float(io[i])) io[i] = x[i];
}

static MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::BF16: return MPI_UINT16_T;
    case DType::I32: return MPI_INT;
    case DType::F8E4M3:
    case DType::F8E5M2: return MPI_UINT8_T;  // codes travel as bytes (no reduction is defined on them)
  }
  return MPI_BYTE;
}

// Avg is a Sum on the wire, divided by N when the transfer completes.
static MPI_Op mpi_op(DType t, ReduceOp op) {
  if (t == DType::BF16) {
    static MPI_Op sum = MPI_OP_NULL, max = MPI_OP_NULL;
    if (sum == MPI_OP_NULL) {
      MPI_CHECK(MPI_Op_create(bf16_sum_op, 1, &sum));
      MPI_CHECK(MPI_Op_create(bf16_max_op, 1, &max));
    }
    return op == ReduceOp::Max ? max : sum;
  }
  return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
}

static int mpi_count(int64_t n) {
  TS_CHECK(n >= 0 && n <= INT_MAX, "message of %lld elements exceeds MPI's int count", (long long)n);
  return int(n);
}

static void divide_host(const Tensor& h, int n) {
  float s = 1.f / float(n);
  if (h.dtype == DType::F32) {
    for (int64_t i = 0; i < h.numel(); i++) h.f32()[i] *= s;
  } else {
    for (int64_t i = 0; i < h.numel(); i++) h.b16()[i] = float_to_bf16(bf16_to_float(h.b16()[i]) * s);
  }
}

#ifdef TS_CUDA
static ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::F8E4M3:
    case DType::F8E5M2: return ncclUint8;  // codes travel as bytes
  }
  return ncclFloat32;
}
static ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : op == ReduceOp::Avg ? ncclAvg : ncclMax;
}
#endif

// ----- in-flight transfers and the watchdog ----------------------------------------------------

struct Work::Pending {
  std::string what;                         // names the op for the watchdog
  std::vector<Tensor> keep;                 // memory the transfer uses stays alive until it ends
  std::vector<std::function<void()>> then;  // on completion: Avg's division, copies back to the GPU
  std::vector<uint64_t> flight;             // its flight-recorder entries
  virtual ~Pending() = default;
  virtual bool test() = 0;  // progresses the transfer once; true when it has completed
  virtual void abort() {}
  // Completes the wait on the device instead of the host: true when later work on the compute
  // stream is now ordered after the transfer (NCCL), so the host need not block.
  virtual bool hand_to_stream() { return false; }
};

struct MpiPending : Work::Pending {
  std::vector<MPI_Request> reqs;
  std::vector<int> arrays;  // Alltoallv's counts and displacements: MPI reads them until completion
  // A new request, for the MPI_I* call that fills it.
  MPI_Request* request() {
    reqs.push_back(MPI_REQUEST_NULL);
    return &reqs.back();
  }
  bool test() override {
    int flag = 0;
    MPI_CHECK(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE));
    return flag != 0;
  }
};

#ifdef TS_CUDA
struct NcclPending : Work::Pending {
  cudaEvent_t done = nullptr;  // recorded on the group's stream after the NCCL call
  ncclComm_t comm = nullptr;
  ~NcclPending() override {
    if (done) cudaEventDestroy(done);
  }
  bool test() override {
    cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) CUDA_CHECK(e);
    ncclResult_t r = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(comm, &r));
    if (r != ncclSuccess && r != ncclInProgress)
      fatal("NCCL failed in %s: %s", what.c_str(), ncclGetErrorString(r));
    return false;
  }
  // A timed-out NCCL kernel never returns on its own; aborting the communicator releases it.
  void abort() override { ncclCommAbort(comm); }
  bool hand_to_stream() override;
};

// The NCCL operations the compute stream has been told to wait for. The host blocks for the GPU
// only in sync_compute_stream (core.h), and learns there of a stalled peer: the watch below
// checks these operations' errors while it waits and, past the timeout, names the oldest one
// still running and aborts its communicator. Once the stream is idle every one has completed.
struct InFlight {
  cudaEvent_t done;
  ncclComm_t comm;
  std::string what;
  std::vector<uint64_t> flight;  // its flight-recorder entries, completed with the event
};
static std::vector<InFlight> g_in_flight;

static void watch_in_flight(double waited) {
  for (const InFlight& f : g_in_flight) {
    ncclResult_t r = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(f.comm, &r));
    if (r != ncclSuccess && r != ncclInProgress) fatal("NCCL failed in %s: %s", f.what.c_str(), ncclGetErrorString(r));
  }
  if (waited <= g_timeout) return;
  std::string what = "work queued on the GPU";
  for (const InFlight& f : g_in_flight)
    if (cudaEventQuery(f.done) == cudaErrorNotReady) {
      what = f.what;
      break;
    }
  for (const InFlight& f : g_in_flight) ncclCommAbort(f.comm);
  const std::string at = current_step() >= 0 ? " at step " + std::to_string(current_step()) : "";
  fatal("watchdog: rank %d waited %.1f s for the GPU, still in %s%s; aborting every rank", world_rank(), waited,
        what.c_str(), at.c_str());
}

static void forget_in_flight() {
  for (const InFlight& f : g_in_flight) {
    for (uint64_t id : f.flight) flight::completed(id);
    cudaEventDestroy(f.done);
  }
  g_in_flight.clear();
}

// One communicator's operations, when it is released: each has ended once its event has.
static void forget_in_flight(ncclComm_t comm) {
  auto mine = [comm](const InFlight& f) { return f.comm == comm; };
  for (const InFlight& f : g_in_flight)
    if (mine(f)) {
      cudaEventSynchronize(f.done);
      for (uint64_t id : f.flight) flight::completed(id);
      cudaEventDestroy(f.done);
    }
  g_in_flight.erase(std::remove_if(g_in_flight.begin(), g_in_flight.end(), mine), g_in_flight.end());
}

// The compute stream waits for the event; the buffers may go back to the allocator now, because
// whatever reuses them is queued on the compute stream after this wait.
bool NcclPending::hand_to_stream() {
  CUDA_CHECK(cudaStreamWaitEvent(compute_stream(), done, 0));
  for (uint64_t id : flight) flight::started(id);  // on the GPU now; completed when the stream is idle
  g_in_flight.push_back({done, comm, what, flight});
  done = nullptr;
  return true;
}
#endif

static void complete(std::unique_ptr<Work::Pending>& p) {
  std::unique_ptr<Work::Pending> q = std::move(p);
  for (uint64_t id : q->flight) flight::completed(id);
  for (auto& f : q->then) f();
}

Work::Work() = default;
Work::Work(std::unique_ptr<Pending> p) : p_(std::move(p)) {}
Work::Work(Work&& o) noexcept = default;
Work& Work::operator=(Work&& o) noexcept {
  if (this != &o) {
    wait();
    p_ = std::move(o.p_);
  }
  return *this;
}
Work::~Work() { wait(); }

bool Work::done() {
  if (!p_) return true;
  if (!p_->test()) return false;
  complete(p_);
  return true;
}

void Work::wait() {
  if (!p_) return;
  if (p_->then.empty() && p_->hand_to_stream()) {
    p_.reset();
    return;
  }
  for (uint64_t id : p_->flight) flight::started(id);
  // Yield while the wait is short: with more ranks than cores the peer needs this core to
  // progress. Sleep once it is long, so a waiting rank stops competing for the CPU. With more
  // ranks on the node than cores "long" comes sooner: a yielding rank still spins, on the core
  // of a rank that computes (a 4-rank DualPipeV mesh on 2 cores: 3,540 tokens/s yielding for up
  // to 20 ms, 4,333 for up to 1 ms; make bench's 4-rank rows).
  const ThreadChoice& t = thread_choice();
  const double yield_s = t.local_ranks > t.cores ? 0.001 : 0.02;
  auto t0 = std::chrono::steady_clock::now();
  while (!p_->test()) {
    flight::poll();  // another rank's request to dump, or SIGUSR1
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (waited > g_timeout) {
      p_->abort();
      watchdog_abort(waited, p_->what);
    }
    if (waited < yield_s)
      sched_yield();
    else
      usleep(200);
  }
  complete(p_);
}

// ----- host operations under the watchdog ------------------------------------------------------

static std::string group_name(MPI_Comm comm) {
  if (comm == MPI_COMM_WORLD) return "world";
  char name[MPI_MAX_OBJECT_NAME];
  int n = 0;
  MPI_CHECK(MPI_Comm_get_name(comm, name, &n));
  return n > 0 ? std::string(name, size_t(n)) : "unnamed";
}

// "<what> on group 'dp' (2 ranks)": the watchdog's name for an operation on `comm`.
static std::string on_group(MPI_Comm comm, const std::string& what) {
  int n = 1;
  MPI_CHECK(MPI_Comm_size(comm, &n));
  return what + " on group '" + group_name(comm) + "' (" + std::to_string(n) + " ranks)";
}

// `op`, `count` and `type` are what the flight recorder notes of the call.
static void watched(MPI_Comm comm, const std::string& what, const char* op, int64_t count, MPI_Datatype type, int root,
                    const std::function<void(MPI_Request*)>& start) {
  auto p = std::make_unique<MpiPending>();
  p->what = on_group(comm, what);
  p->flight.push_back(flight::collective_raw(comm, op, count, type, root, p->what));
  p->reqs.resize(1);
  start(&p->reqs[0]);
  Work(std::move(p)).wait();
}

void watched_allreduce(const void* in, void* out, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                       const std::string& what) {
  watched(comm, what, "all_reduce", count, type, -1,
          [&](MPI_Request* r) { MPI_CHECK(MPI_Iallreduce(in, out, count, type, op, comm, r)); });
}

void watched_bcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm, const std::string& what) {
  watched(comm, what, "broadcast", count, type, root,
          [&](MPI_Request* r) { MPI_CHECK(MPI_Ibcast(buf, count, type, root, comm, r)); });
}

void watched_barrier(MPI_Comm comm, const std::string& what) {
  watched(comm, what, "barrier", 0, MPI_DATATYPE_NULL, -1, [&](MPI_Request* r) { MPI_CHECK(MPI_Ibarrier(comm, r)); });
}

void watched_allgather(const void* in, int count, MPI_Datatype type, void* out, MPI_Comm comm, const std::string& what) {
  watched(comm, what, "all_gather", count, type, -1,
          [&](MPI_Request* r) { MPI_CHECK(MPI_Iallgather(in, count, type, out, count, type, comm, r)); });
}

void watched_gather(const void* in, int count, MPI_Datatype type, void* out, int root, MPI_Comm comm,
                    const std::string& what) {
  watched(comm, what, "gather", count, type, root,
          [&](MPI_Request* r) { MPI_CHECK(MPI_Igather(in, count, type, out, count, type, root, comm, r)); });
}

void watched_gatherv(const void* in, int count, MPI_Datatype type, void* out, const int* counts, const int* displs,
                     int root, MPI_Comm comm, const std::string& what) {
  watched(comm, what, "gatherv", count, type, root, [&](MPI_Request* r) {
    MPI_CHECK(MPI_Igatherv(in, count, type, out, counts, displs, type, root, comm, r));
  });
}

void watched_blocking(MPI_Comm comm, const std::string& what, const std::function<void()>& call) {
  const std::string label = on_group(comm, what);
  const uint64_t id = flight::collective_raw(comm, "blocking", 0, MPI_DATATYPE_NULL, -1, label);
  flight::started(id);
  under_timer(label, call);
  flight::completed(id);
}

MPI_Comm watched_split(MPI_Comm parent, int color, int key, const std::string& what) {
  MPI_Comm c = MPI_COMM_NULL;
  watched_blocking(parent, "MPI_Comm_split (" + what + ")", [&] { MPI_CHECK(MPI_Comm_split(parent, color, key, &c)); });
  return c;
}

MPI_Comm node_comm(const std::string& what) {
  MPI_Comm node = MPI_COMM_NULL;
  watched_blocking(MPI_COMM_WORLD, "MPI_Comm_split_type (" + what + ": the ranks on this node)", [&] {
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  });
  return node;
}

std::string first_error(const std::string& err, MPI_Comm comm, const std::string& what) {
  int rank = 0, n = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &n));
  int mine = err.empty() ? n : rank, first = n;
  watched_allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, "all_reduce (" + what + ": any rank's error)");
  if (first == n) return "";
  std::string msg = err;
  int len = int(msg.size());
  watched_bcast(&len, 1, MPI_INT, first, comm, "broadcast (" + what + ": the error's length)");
  msg.resize(size_t(len));
  watched_bcast(&msg[0], len, MPI_CHAR, first, comm, "broadcast (" + what + ": the error)");
  return "rank " + std::to_string(first) + ": " + msg;
}

// ----- staging: the host memory MPI works on ---------------------------------------------------

// What MPI reads: the tensor itself on the CPU; a host copy of a CUDA tensor.
static Tensor host_in(const Tensor& t, Work::Pending& p) {
  if (t.device() == Device::CPU) return t;
  Tensor h = Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Comm);
  copy(h, t);
  p.keep.push_back(h);
  return h;
}

// What MPI writes: the tensor itself on the CPU (unless `separate`); otherwise a host buffer
// copied into the tensor when the transfer completes (after any division queued before it).
static Tensor host_out(const Tensor& t, Work::Pending& p, bool separate = false) {
  if (t.device() == Device::CPU && !separate) return t;
  Tensor h = Tensor::empty(t.shape, t.dtype, Device::CPU, Tag::Comm);
  p.keep.push_back(h);
  return h;
}
static void copy_back(const Tensor& t, const Tensor& h, Work::Pending& p) {
  if (t.raw() != h.raw()) p.then.push_back([t, h] { copy(t, h); });
}

static bool overlap(const Tensor& a, const Tensor& b) {
  if (a.buf != b.buf) return false;
  const char* a0 = static_cast<const char*>(a.raw());
  const char* b0 = static_cast<const char*>(b.raw());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}
static bool is_chunk(const Tensor& part, const Tensor& whole, int r) {
  return part.buf == whole.buf && part.raw() == static_cast<char*>(whole.raw()) + size_t(r) * part.nbytes();
}

static void check_pair(const char* op, const Tensor& out, const Tensor& in) {
  TS_CHECK(out.dtype == in.dtype && out.device() == in.device(), "%s: out %s and in %s differ in dtype or device",
           op, out.str().c_str(), in.str().c_str());
}

static void check_reduce(const char* op, DType t, ReduceOp r) {
  TS_CHECK(!(t == DType::I32 && r == ReduceOp::Avg), "%s: Avg of an i32 tensor is not defined", op);
}

// ----- Comm ------------------------------------------------------------------------------------

Comm::Comm(std::string name, MPI_Comm comm, void* nccl) : name_(std::move(name)), comm_(comm), nccl_(nccl) {
  MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
  MPI_CHECK(MPI_Comm_size(comm_, &size_));
  // Errors come back to MPI_CHECK (file:line and MPI's message) instead of MPI's silent abort.
  MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
  // The watched host operations name the group from the communicator alone.
  MPI_CHECK(MPI_Comm_set_name(comm_, name_.c_str()));
  flight::register_group(comm_, name_);
#ifdef TS_CUDA
  if (nccl_) {
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    set_stream_watch({watch_in_flight, [] { forget_in_flight(); }});
  }
#endif
  g_live.push_back(this);
}

Comm::~Comm() {
  release();
  g_live.erase(std::find(g_live.begin(), g_live.end(), this));
}

void Comm::release() {
#ifdef TS_CUDA
  if (nccl_) forget_in_flight(static_cast<ncclComm_t>(nccl_));  // the watch must not ask a freed communicator
  if (nccl_) ncclCommDestroy(static_cast<ncclComm_t>(nccl_));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
  nccl_ = stream_ = nullptr;
#endif
  int fin = 0;
  MPI_Finalized(&fin);
  if (comm_ != MPI_COMM_NULL) flight::forget_group(comm_);  // MPI may hand the handle out again
  if (!fin && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);  // leaves comm_ = MPI_COMM_NULL
}

const char* Comm::transport(Device dev) const {
  if (dev == Device::CPU) return "mpi";
  return nccl_ ? "nccl" : "mpi-staged";
}

void Comm::count(const char* op, double payload, double wire) {
  OpStats& s = stats_[op];
  s.calls++;
  s.payload_bytes += payload;
  s.wire_bytes += size_ > 1 ? wire : 0;  // a group of one moves nothing
}

std::string Comm::label(const char* op, int tag, long seq) const {
  char b[256];
  if (tag >= 0)
    snprintf(b, sizeof b, "%s #%ld on group '%s' (%d ranks, tag %d)", op, seq, name_.c_str(), size_, tag);
  else
    snprintf(b, sizeof b, "%s #%ld on group '%s' (%d ranks, collective: no tag)", op, seq, name_.c_str(), size_);
  return b;
}

// ----- the skeleton every collective runs ------------------------------------------------------

#ifdef TS_CUDA
using NcclCall = std::function<void(ncclComm_t, cudaStream_t)>;
// A Call's NCCL part: statements that see the group's communicator c_ and its stream s_.
#define NCCL(...) [&](ncclComm_t c_, cudaStream_t s_) { __VA_ARGS__; }
#else
using NcclCall = std::function<void()>;  // never set: without CUDA every call takes MPI
#define NCCL(...) nullptr
#endif

// One call, described by what makes it itself; Comm::issue does the rest. Its functions run
// before issue() returns, so they may capture the caller's arguments by reference; what must
// outlive the call (a copy back to the GPU, Avg's division) goes into the MpiPending's `then`,
// by value.
struct Comm::Call {
  const char* op;  // the watchdog's name for it, and the flight recorder's
  // What it reads and writes: kept alive until it ends. Their device picks the transport.
  std::vector<Tensor> tensors;
  // Its flight-recorder entries: `count` elements of `dtype` (none: a barrier's nothing); `peer` a
  // collective's root or a message's other end (-1: none); `op` the call's unless set.
  struct Note {
    int64_t count;
    std::optional<DType> dtype;
    int peer = -1;
    const char* op = nullptr;
  };
  std::vector<Note> notes;
  // Point-to-point: numbered per sender, receiver and tag. A collective (unset) is numbered per group.
  struct Message {
    int src, dst, tag;
  };
  std::optional<Message> message = std::nullopt;
  // A group of one moves nothing: the call ends at once, after `alone` (its local copy) where set.
  // A message without one (a send, a recv) is issued all the same: MPI delivers it to oneself.
  std::function<void()> alone = nullptr;
  NcclCall nccl = nullptr;  // NCCL(...); unset: always MPI (a barrier)
  // MPI's part: stages the tensors (host_in, host_out), posts the requests (p.request()) and
  // queues what runs on completion (copy_back).
  std::function<void(MpiPending& p)> mpi = nullptr;
};

#ifdef TS_CUDA
// NCCL runs on the group's own stream: `call` starts after the work queued on the compute stream
// so far, and its completion event is what Work polls.
static Work nccl_issue(cudaStream_t s, ncclComm_t comm, const NcclCall& call, std::string what,
                       std::vector<Tensor> keep, std::vector<uint64_t> ids) {
  cudaEvent_t ready;
  CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(ready, compute_stream()));
  CUDA_CHECK(cudaStreamWaitEvent(s, ready, 0));
  CUDA_CHECK(cudaEventDestroy(ready));
  call(comm, s);
  auto p = std::make_unique<NcclPending>();
  p->flight = std::move(ids);
  p->what = std::move(what);
  p->keep = std::move(keep);
  p->comm = comm;
  CUDA_CHECK(cudaEventCreateWithFlags(&p->done, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(p->done, s));
  return Work(std::move(p));
}
#endif

// MPI: `post` issues the non-blocking calls (on host copies of CUDA tensors), and Work tests
// their requests.
static Work mpi_issue(const std::function<void(MpiPending&)>& post, std::string what, const std::vector<Tensor>& keep,
                      std::vector<uint64_t> ids) {
  auto p = std::make_unique<MpiPending>();
  p->what = std::move(what);
  p->flight = std::move(ids);
  post(*p);
  p->keep.insert(p->keep.end(), keep.begin(), keep.end());
  return Work(std::move(p));
}

// The skeleton. A group of one ends at once; any other call is named (the watchdog's label,
// numbered as the flight recorder numbers it), is noted by the flight recorder, and goes by NCCL
// (CUDA tensors where every rank owns a GPU) or by MPI (CPU tensors, or CUDA tensors staged
// through host memory).
Work Comm::issue(const Call& c) {
  if (size_ == 1 && (c.alone || !c.message)) {
    if (c.alone) c.alone();
    return Work();
  }
  const Call::Message* m = c.message ? &*c.message : nullptr;
  const long seq = m ? flight::next_message(comm_, m->src, m->dst, m->tag) : flight::next_collective(comm_);
  const std::string what = label(c.op, m ? m->tag : -1, seq);
  std::vector<uint64_t> ids;
  for (const Call::Note& n : c.notes) {
    const char* op = n.op ? n.op : c.op;
    ids.push_back(!n.dtype ? flight::collective_raw(comm_, op, n.count, MPI_DATATYPE_NULL, n.peer, what)
                  : m      ? flight::p2p(comm_, op, n.peer, m->tag, n.count, *n.dtype, what)
                           : flight::collective(comm_, op, n.count, *n.dtype, n.peer, what));
  }
#ifdef TS_CUDA
  // CUDA tensors on a group NCCL carries; point-to-point too, unless match_p2p_by_tag() said not.
  const bool cuda = !c.tensors.empty() && c.tensors[0].device() == Device::CUDA;
  if (c.nccl && cuda && nccl_ && !(m && p2p_by_tag_))
    return nccl_issue(static_cast<cudaStream_t>(stream_), static_cast<ncclComm_t>(nccl_), c.nccl, what, c.tensors,
                      ids);
#endif
  return mpi_issue(c.mpi, what, c.tensors, ids);
}

// ----- the collectives: each issued non-blocking; the blocking form waits on it ----------------
// Each checks its arguments, counts its bytes under the ring algorithm (notes/collectives.md), and
// hands issue() its Call: its flight record, its local copy in a group of one, its NCCL call and
// its MPI call. With --collectives other than library, run_written_out (algorithms.h) carries the
// four the playbook draws (all-reduce, reduce-scatter, all-gather, broadcast) over send_recv instead.

Work Comm::all_reduce_async(const Tensor& t, ReduceOp op) { return all_reduce_async(t, t, op); }

Work Comm::all_reduce_async(const Tensor& out, const Tensor& in, ReduceOp op) {
  check_pair("all_reduce", out, in);
  check_reduce("all_reduce", in.dtype, op);
  TS_CHECK(out.numel() == in.numel(), "all_reduce: out %s, in %s", out.str().c_str(), in.str().c_str());
  TS_CHECK(out.raw() == in.raw() || !overlap(out, in), "all_reduce: out and in partly overlap");
  double K = double(in.nbytes()), N = size_;
  count("all_reduce", K, 2 * (N - 1) / N * K);  // ring: reduce-scatter, then all-gather: 2(N-1)/N K
  if (run_written_out(*this, CollectiveOp::AllReduce, out, in, op, -1)) return Work();  // --collectives
  Call c{"all_reduce", {out, in}, {{in.numel(), in.dtype}}};
  c.alone = [&] { if (out.raw() != in.raw()) copy(out, in); };
  c.nccl = NCCL(NCCL_CHECK(ncclAllReduce(in.raw(), out.raw(), size_t(in.numel()), nccl_type(in.dtype), nccl_op(op),
                                         c_, s_)));
  c.mpi = [&](MpiPending& p) {
    Tensor hin = host_in(in, p), hout = host_out(out, p);
    const void* send = hin.raw() == hout.raw() ? MPI_IN_PLACE : hin.raw();
    MPI_CHECK(MPI_Iallreduce(send, hout.raw(), mpi_count(in.numel()), mpi_type(in.dtype), mpi_op(in.dtype, op),
                             comm_, p.request()));
    if (op == ReduceOp::Avg) p.then.push_back([hout, n = size_] { divide_host(hout, n); });
    copy_back(out, hout, p);
  };
  return issue(c);
}

// reduce_scatter's in and all_gather's out (the whole) are n chunks the size of the other tensor
// (the part), which may be chunk r of the whole (in place) and must not overlap it otherwise.
// Returns whether the call is in place.
static bool check_chunks(const char* op, const char* whole_name, const Tensor& whole, const char* part_name,
                         const Tensor& part, int n, int r) {
  TS_CHECK(whole.numel() == n * part.numel(), "%s: %s %s must be %d x %s %s", op, whole_name, whole.str().c_str(), n,
           part_name, part.str().c_str());
  bool in_place = is_chunk(part, whole, r);
  TS_CHECK(in_place || !overlap(part, whole), "%s: %s overlaps %s other than as chunk %d", op, part_name, whole_name,
           r);
  return in_place;
}

Work Comm::reduce_scatter_async(const Tensor& out, const Tensor& in, ReduceOp op) {
  check_pair("reduce_scatter", out, in);
  check_reduce("reduce_scatter", in.dtype, op);
  bool in_place = check_chunks("reduce_scatter", "in", in, "out", out, size_, rank_);
  double K = double(in.nbytes()), N = size_;
  count("reduce_scatter", K, (N - 1) / N * K);  // ring: N-1 steps of one chunk K/N
  if (run_written_out(*this, CollectiveOp::ReduceScatter, out, in, op, -1)) return Work();
  Call c{"reduce_scatter", {out, in}, {{in.numel(), in.dtype}}};
  c.alone = [&] { if (!in_place) copy(out, in); };
  c.nccl = NCCL(NCCL_CHECK(ncclReduceScatter(in.raw(), out.raw(), size_t(out.numel()), nccl_type(in.dtype),
                                             nccl_op(op), c_, s_)));
  c.mpi = [&](MpiPending& p) {
    // MPI's in-place reduce-scatter leaves the result at the start of the buffer, not at chunk r:
    // an in-place call on the CPU receives into a separate buffer instead.
    Tensor hin = host_in(in, p), hout = host_out(out, p, in_place);
    MPI_CHECK(MPI_Ireduce_scatter_block(hin.raw(), hout.raw(), mpi_count(out.numel()), mpi_type(in.dtype),
                                        mpi_op(in.dtype, op), comm_, p.request()));
    if (op == ReduceOp::Avg) p.then.push_back([hout, n = size_] { divide_host(hout, n); });
    copy_back(out, hout, p);
  };
  return issue(c);
}

Work Comm::all_gather_async(const Tensor& out, const Tensor& in) {
  check_pair("all_gather", out, in);
  bool in_place = check_chunks("all_gather", "out", out, "in", in, size_, rank_);
  double K = double(out.nbytes()), N = size_;
  count("all_gather", K, (N - 1) / N * K);  // ring: N-1 steps of one chunk K/N
  if (run_written_out(*this, CollectiveOp::AllGather, out, in, ReduceOp::Sum, -1)) return Work();
  Call c{"all_gather", {out, in}, {{out.numel(), out.dtype}}};
  c.alone = [&] { if (!in_place) copy(out, in); };
  c.nccl = NCCL(NCCL_CHECK(ncclAllGather(in.raw(), out.raw(), size_t(in.numel()), nccl_type(in.dtype), c_, s_)));
  c.mpi = [&](MpiPending& p) {
    Tensor hin = host_in(in, p), hout = host_out(out, p);
    const void* send = is_chunk(hin, hout, rank_) ? MPI_IN_PLACE : hin.raw();
    int n = mpi_count(in.numel());
    MPI_CHECK(MPI_Iallgather(send, n, mpi_type(in.dtype), hout.raw(), n, mpi_type(in.dtype), comm_, p.request()));
    copy_back(out, hout, p);
  };
  return issue(c);
}

Work Comm::broadcast_async(const Tensor& t, int root) {
  TS_CHECK(root >= 0 && root < size_, "broadcast: root %d outside group '%s' of %d", root, name_.c_str(), size_);
  // Pipelined ring from the root: every rank forwards K except the last one in the chain.
  double K = double(t.nbytes());
  bool last = (rank_ - root + size_) % size_ == size_ - 1;
  count("broadcast", K, last ? 0 : K);
  if (run_written_out(*this, CollectiveOp::Broadcast, t, t, ReduceOp::Sum, root)) return Work();
  Call c{"broadcast", {t}, {{t.numel(), t.dtype, root}}};
  c.nccl = NCCL(NCCL_CHECK(ncclBroadcast(t.raw(), t.raw(), size_t(t.numel()), nccl_type(t.dtype), root, c_, s_)));
  c.mpi = [&](MpiPending& p) {
    Tensor h = rank_ == root ? host_in(t, p) : host_out(t, p);
    MPI_CHECK(MPI_Ibcast(h.raw(), mpi_count(t.numel()), mpi_type(t.dtype), root, comm_, p.request()));
    if (rank_ != root) copy_back(t, h, p);
  };
  return issue(c);
}

Work Comm::send_async(const Tensor& t, int peer, int tag) {
  TS_CHECK(peer >= 0 && peer < size_, "send: peer %d outside group '%s' of %d", peer, name_.c_str(), size_);
  count("send", double(t.nbytes()), peer == rank_ ? 0 : double(t.nbytes()));  // one message of K bytes
  Call c{"send", {t}, {{t.numel(), t.dtype, peer}}, Call::Message{rank_, peer, tag}};
  c.nccl = NCCL(NCCL_CHECK(ncclSend(t.raw(), size_t(t.numel()), nccl_type(t.dtype), peer, c_, s_)));
  c.mpi = [&](MpiPending& p) {
    Tensor h = host_in(t, p);
    MPI_CHECK(MPI_Isend(h.raw(), mpi_count(t.numel()), mpi_type(t.dtype), peer, tag, comm_, p.request()));
  };
  return issue(c);
}

Work Comm::recv_async(const Tensor& t, int peer, int tag) {
  TS_CHECK(peer >= 0 && peer < size_, "recv: peer %d outside group '%s' of %d", peer, name_.c_str(), size_);
  count("recv", double(t.nbytes()), 0);  // the sender counts the wire bytes
  Call c{"recv", {t}, {{t.numel(), t.dtype, peer}}, Call::Message{peer, rank_, tag}};
  c.nccl = NCCL(NCCL_CHECK(ncclRecv(t.raw(), size_t(t.numel()), nccl_type(t.dtype), peer, c_, s_)));
  c.mpi = [&](MpiPending& p) {
    Tensor h = host_out(t, p);
    MPI_CHECK(MPI_Irecv(h.raw(), mpi_count(t.numel()), mpi_type(t.dtype), peer, tag, comm_, p.request()));
    copy_back(t, h, p);
  };
  return issue(c);
}

Work Comm::send_recv_async(const Tensor& send, int dst, const Tensor& recv, int src, int tag) {
  TS_CHECK(dst >= 0 && dst < size_ && src >= 0 && src < size_, "send_recv: dst %d / src %d outside group '%s' of %d",
           dst, src, name_.c_str(), size_);
  TS_CHECK(send.dtype == recv.dtype && send.device() == recv.device() && !overlap(send, recv),
           "send_recv: send %s and recv %s must match in dtype and device and not overlap", send.str().c_str(),
           recv.str().c_str());
  count("send", double(send.nbytes()), dst == rank_ ? 0 : double(send.nbytes()));  // counted as a send
  count("recv", double(recv.nbytes()), 0);                                         // and a recv
  Call c{"send_recv", {send, recv}, {{send.numel(), send.dtype, dst, "send"}, {recv.numel(), recv.dtype, src, "recv"}},
         Call::Message{rank_, dst, tag}};
  c.alone = [&] { copy(recv, send); };
  c.nccl = NCCL(NCCL_CHECK(ncclGroupStart());
                NCCL_CHECK(ncclSend(send.raw(), size_t(send.numel()), nccl_type(send.dtype), dst, c_, s_));
                NCCL_CHECK(ncclRecv(recv.raw(), size_t(recv.numel()), nccl_type(recv.dtype), src, c_, s_));
                NCCL_CHECK(ncclGroupEnd()));
  c.mpi = [&](MpiPending& p) {
    Tensor hs = host_in(send, p), hr = host_out(recv, p);
    MPI_CHECK(MPI_Irecv(hr.raw(), mpi_count(recv.numel()), mpi_type(recv.dtype), src, tag, comm_, p.request()));
    MPI_CHECK(MPI_Isend(hs.raw(), mpi_count(send.numel()), mpi_type(send.dtype), dst, tag, comm_, p.request()));
    copy_back(recv, hr, p);
  };
  return issue(c);
}

Work Comm::all_to_all_async(const Tensor& out, const Tensor& in) {
  check_pair("all_to_all", out, in);
  TS_CHECK(out.numel() == in.numel() && in.numel() % size_ == 0 && !overlap(out, in),
           "all_to_all: out %s and in %s must be equal, separate and split into %d chunks", out.str().c_str(),
           in.str().c_str(), size_);
  std::vector<int64_t> counts(size_, in.numel() / size_);
  return all_to_all_v_async(out, counts, in, counts);
}

Work Comm::all_to_all_v_async(const Tensor& out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                              const std::vector<int64_t>& send_counts) {
  check_pair("all_to_all", out, in);
  TS_CHECK(int(recv_counts.size()) == size_ && int(send_counts.size()) == size_,
           "all_to_all_v: need %d send and recv counts", size_);
  TS_CHECK(!overlap(out, in), "all_to_all: out and in overlap");
  std::vector<int64_t> sdispl(size_), rdispl(size_);
  int64_t ssum = 0, rsum = 0;
  for (int p = 0; p < size_; p++) {
    TS_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "all_to_all_v: negative count for peer %d", p);
    sdispl[p] = ssum, ssum += send_counts[p];
    rdispl[p] = rsum, rsum += recv_counts[p];
  }
  TS_CHECK(ssum <= in.numel() && rsum <= out.numel(), "all_to_all_v: counts (send %lld, recv %lld) exceed in %s / out %s",
           (long long)ssum, (long long)rsum, in.str().c_str(), out.str().c_str());
  // Everything this rank holds leaves except its own chunk: (N-1)/N K for equal chunks.
  double es = double(dtype_size(in.dtype));
  count("all_to_all", ssum * es, (ssum - send_counts[rank_]) * es);
  Call c{"all_to_all", {out, in}, {{ssum, in.dtype}}};
  c.alone = [&] { if (ssum) copy(out.view(0, {ssum}), in.view(0, {ssum})); };
  c.nccl = NCCL({  // NCCL has no all-to-all: one grouped send and receive per peer.
    size_t e = dtype_size(in.dtype);
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < size_; p++) {
      if (send_counts[p])
        NCCL_CHECK(ncclSend(static_cast<char*>(in.raw()) + sdispl[p] * e, size_t(send_counts[p]), nccl_type(in.dtype),
                            p, c_, s_));
      if (recv_counts[p])
        NCCL_CHECK(ncclRecv(static_cast<char*>(out.raw()) + rdispl[p] * e, size_t(recv_counts[p]),
                            nccl_type(in.dtype), p, c_, s_));
    }
    NCCL_CHECK(ncclGroupEnd());
  });
  c.mpi = [&](MpiPending& p) {
    Tensor hin = host_in(in, p), hout = host_out(out, p);
    p.arrays.resize(4 * size_);
    int* sc = p.arrays.data();
    int *sd = sc + size_, *rc = sd + size_, *rd = rc + size_;
    for (int q = 0; q < size_; q++) {
      sc[q] = mpi_count(send_counts[q]), sd[q] = mpi_count(sdispl[q]);
      rc[q] = mpi_count(recv_counts[q]), rd[q] = mpi_count(rdispl[q]);
    }
    MPI_CHECK(MPI_Ialltoallv(hin.raw(), sc, sd, mpi_type(in.dtype), hout.raw(), rc, rd, mpi_type(in.dtype), comm_,
                             p.request()));
    // Only what arrived goes back: out's tail past the received counts keeps what it held.
    if (rsum) copy_back(out.view(0, {rsum}), hout.view(0, {rsum}), p);
  };
  return issue(c);
}

Work Comm::barrier_async() {
  count("barrier", 0, 0);
  Call c{"barrier", {}, {{0, std::nullopt}}};  // nothing moves: the recorder notes no dtype
  c.mpi = [&](MpiPending& p) { MPI_CHECK(MPI_Ibarrier(comm_, p.request())); };
  return issue(c);
}

void Comm::all_reduce(const Tensor& t, ReduceOp op) { all_reduce_async(t, t, op).wait(); }
void Comm::all_reduce(const Tensor& out, const Tensor& in, ReduceOp op) { all_reduce_async(out, in, op).wait(); }
void Comm::reduce_scatter(const Tensor& out, const Tensor& in, ReduceOp op) {
  reduce_scatter_async(out, in, op).wait();
}
void Comm::all_gather(const Tensor& out, const Tensor& in) { all_gather_async(out, in).wait(); }
void Comm::broadcast(const Tensor& t, int root) { broadcast_async(t, root).wait(); }
void Comm::send(const Tensor& t, int peer, int tag) { send_async(t, peer, tag).wait(); }
void Comm::recv(const Tensor& t, int peer, int tag) { recv_async(t, peer, tag).wait(); }
void Comm::send_recv(const Tensor& send, int dst, const Tensor& recv, int src, int tag) {
  send_recv_async(send, dst, recv, src, tag).wait();
}
void Comm::all_to_all(const Tensor& out, const Tensor& in) { all_to_all_async(out, in).wait(); }
void Comm::all_to_all_v(const Tensor& out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                        const std::vector<int64_t>& send_counts) {
  all_to_all_v_async(out, recv_counts, in, send_counts).wait();
}
void Comm::barrier() { barrier_async().wait(); }

}  // namespace ts
