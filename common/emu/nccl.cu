// nccl.cu — NCCL over MPI for the emulated GPU: each MPI rank owns one emulated GPU, and the NCCL
// calls the project makes run with NCCL's semantics, not MPI's.
//
// What it reproduces (each rule cites the NCCL documentation that states it):
//   * Operations are queued on their CUDA stream and run there, after the stream's earlier work.
//   * NCCL has no tags: a pair's messages on a communicator match in the order they were issued.
//   * A send is "blocking for the GPU" (NCCL API, ncclSend): it completes only once its receive has
//     been posted, so two ranks that both send first, ungrouped, deadlock as on the hardware.
//     Operations between ncclGroupStart and ncclGroupEnd progress together and complete together.
//   * All NCCL operations of one GPU run one at a time, in the order the host launched them, across
//     every stream and communicator ("Using multiple NCCL communicators concurrently", NCCL user
//     guide, NCCL_LAUNCH_ORDER_IMPLICIT): two ranks that launch operations on two communicators in
//     different orders deadlock.
//   * Collectives are NCCL's ring algorithms, step by step (rank r sends to r+1, receives from r-1),
//     so a bf16 sum is rounded at every hop exactly as NCCL's ring rounds it, and ncclAvg is
//     NCCL's: floats multiplied by 1/n before the sum, integers summed then divided.
//
// What it checks, beyond the hardware (the emulator is stricter, never looser):
//   * Buffers must be device memory (cudaMalloc), arguments in range, in-place forms exactly the
//     ones NCCL defines; a message of another size than its receive expects is named.
//   * ncclMax and ncclMin keep a NaN, where NCCL's fmaxf/fminf would drop it and hide it.
//   * Nothing waits forever: an operation still waiting after TS_EMU_NCCL_TIMEOUT seconds (240) is
//     reported, naming the call, the communicator and what it waits for, and its communicator gets
//     an asynchronous error (ncclCommGetAsyncError). It then keeps waiting, as a stuck NCCL kernel
//     does, until ncclCommAbort releases it.
//
// What it cannot show: speed, NVLink or network behaviour, or NCCL's own choice of algorithm
// (trees, NVLS): the reduction order is always the ring's, with the ring in rank order.
// Restriction: the rank that calls ncclGetUniqueId must be one of the communicator's members.
#include "nccl.h"

#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "tensor/device.h"  // bf16 as the project rounds it
#include "emu.h"
#include "tsan.h"  // SANITIZE=thread: the operation's reads and writes, declared
#include "shadow.h"  // the memcheck build: an operation's output is written

// ----- communicators -------------------------------------------------------------------------------

// What ncclComm_t points to. Shared with the operations queued on it, so that an aborted
// communicator's queued operations can still see that it was aborted when their stream reaches them.
struct ncclComm {
  MPI_Comm mpi = MPI_COMM_NULL;  // the members, in communicator-rank order
  int rank = 0, size = 1;
  std::string name;  // "0:1" (made by world rank 0, its id #1), "0:1/3" (split colour 3): equal on every member
  std::atomic<int> async_error{ncclSuccess};
  std::atomic<bool> aborted{false};
  std::mutex mu;
  std::condition_variable cv;
  int queued = 0;   // operations launched and not yet finished
  int running = 0;  // ... of which have started

  std::string label() const {
    return "communicator '" + name + "' (" + std::to_string(size) + " ranks, this rank " + std::to_string(rank) + ")";
  }
  // The first error sticks, as NCCL's asynchronous error does.
  void fail(ncclResult_t r) {
    int ok = ncclSuccess;
    async_error.compare_exchange_strong(ok, int(r));
  }
  void count(int ncclComm::*field, int delta) {
    std::lock_guard<std::mutex> lk(mu);
    this->*field += delta;
    cv.notify_all();
  }
};

namespace {

// Never destroyed: stream threads may still reach these while the program's statics are destroyed.
std::mutex& g_comms_mu = *new std::mutex;
std::map<ncclComm*, std::shared_ptr<ncclComm>>& g_comms = *new std::map<ncclComm*, std::shared_ptr<ncclComm>>;

std::shared_ptr<ncclComm> live(ncclComm_t c) {
  std::lock_guard<std::mutex> lk(g_comms_mu);
  auto it = g_comms.find(c);
  return it == g_comms.end() ? nullptr : it->second;
}

void forget(ncclComm* c) {
  std::lock_guard<std::mutex> lk(g_comms_mu);
  g_comms.erase(c);
}

ncclComm_t adopt(MPI_Comm mpi, const std::string& name) {
  auto c = std::make_shared<ncclComm>();
  c->mpi = mpi;
  c->name = name;
  MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN);  // a wrong-sized message is reported, not fatal
  MPI_Comm_rank(mpi, &c->rank);
  MPI_Comm_size(mpi, &c->size);
  std::lock_guard<std::mutex> lk(g_comms_mu);
  g_comms[c.get()] = c;
  return c.get();
}

// ----- settings and names --------------------------------------------------------------------------

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// TS_EMU_NCCL_TIMEOUT: seconds an operation may wait before the emulator calls it stuck (default
// 240: long enough for an emulated peer that is only slow, and under the project's own watchdog
// (--timeout, 300 s), so that the emulator's diagnosis is the one printed).
// Read on the launching thread at every launch, so a test can lower it before seeding a defect.
double timeout_s() { return emu::nccl_timeout_s(); }

bool mpi_usable() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

const char* type_name(ncclDataType_t t) {
  static const char* names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
                                "bfloat16"};
  return unsigned(t) < ncclNumTypes ? names[t] : "unknown type";
}

const char* op_name(ncclRedOp_t op) {
  static const char* names[] = {"sum", "prod", "max", "min", "avg"};
  return unsigned(op) < ncclNumOps ? names[op] : "unknown op";
}

// ----- the arithmetic of one hop -------------------------------------------------------------------
// NCCL reduces in the element type itself: a bf16 sum converts both operands to float, adds, and
// rounds to nearest even before the next hop (reduce_kernel.h's FuncSum on __nv_bfloat16).

using Bf16 = ts::bf16;  // bf16 as the project rounds it everywhere (core.h): nearest, ties to even

template <class T> struct Elem {  // integers, float, double: computed in their own type
  using M = T;
  static M get(T x) { return x; }
  static T put(M m) { return m; }
};
template <> struct Elem<Bf16> {
  using M = float;
  static float get(Bf16 x) { return ts::bf16_to_float(x); }
  static Bf16 put(float f) { return ts::float_to_bf16(f); }
};

// Integers wrap on overflow as the GPU's do (computed unsigned, where wrapping is defined).
template <class M> M add(M a, M b) {
  if constexpr (std::is_integral<M>::value) {
    using U = std::make_unsigned_t<M>;
    return M(U(a) + U(b));
  } else {
    return a + b;
  }
}
template <class M> M mul(M a, M b) {
  if constexpr (std::is_integral<M>::value) {
    using U = std::make_unsigned_t<M>;
    return M(U(a) * U(b));
  } else {
    return a * b;
  }
}

// NCCL's float max and min are fmaxf/fminf, which drop a NaN; the emulator keeps it, so that a NaN
// one rank produced (or read from memory nothing wrote) is seen by every rank instead of hidden.
template <class M> M apply(ncclRedOp_t op, M a, M b) {
  if constexpr (std::is_floating_point<M>::value) {
    if ((op == ncclMax || op == ncclMin) && (std::isnan(a) || std::isnan(b))) return std::isnan(a) ? a : b;
  }
  switch (op) {
    case ncclProd: return mul(a, b);
    case ncclMax: return a < b ? b : a;
    case ncclMin: return b < a ? b : a;
    default: return add(a, b);  // ncclSum, and ncclAvg's sum
  }
}

// dst[i] = acc[i] (op) pre(x[i]), or pre(x[i]) alone when acc is null. ncclAvg follows NCCL's
// enqueue.cc (hostToDevRedOp): floating types are "PreMulSum", each rank's value multiplied by
// 1/nranks (rounded to the type) before the sum, so a sum that would overflow still averages;
// integers are "SumPostDiv", summed and then divided, truncating towards zero, by the rank that
// completes the element (`last`).
template <class T>
void reduce_t(void* dst, const void* acc, const void* x, size_t n, ncclRedOp_t op, int nranks, bool last) {
  using E = Elem<T>;
  using M = typename E::M;
  const T* a = static_cast<const T*>(acc);
  const T* in = static_cast<const T*>(x);
  T* out = static_cast<T*>(dst);
  const bool premul = op == ncclAvg && std::is_floating_point<M>::value;
  const bool postdiv = op == ncclAvg && !premul && last;
  const M scale = premul ? E::get(E::put(M(1.0 / nranks))) : M(1);
  for (size_t i = 0; i < n; i++) {
    M v = E::get(in[i]);
    if (premul) v = E::get(E::put(v * scale));
    if (a) v = apply(op, E::get(a[i]), v);
    if constexpr (std::is_integral<M>::value) {
      if (postdiv && std::is_signed<M>::value) v = M((long long)v / nranks);
      if (postdiv && !std::is_signed<M>::value) v = M((unsigned long long)v / unsigned(nranks));
    }
    out[i] = E::put(v);
  }
}

void reduce(ncclDataType_t t, void* dst, const void* acc, const void* x, size_t n, ncclRedOp_t op, int nranks,
            bool last) {
  switch (t) {
    case ncclInt8: return reduce_t<int8_t>(dst, acc, x, n, op, nranks, last);
    case ncclUint8: return reduce_t<uint8_t>(dst, acc, x, n, op, nranks, last);
    case ncclInt32: return reduce_t<int32_t>(dst, acc, x, n, op, nranks, last);
    case ncclUint32: return reduce_t<uint32_t>(dst, acc, x, n, op, nranks, last);
    case ncclInt64: return reduce_t<int64_t>(dst, acc, x, n, op, nranks, last);
    case ncclUint64: return reduce_t<uint64_t>(dst, acc, x, n, op, nranks, last);
    case ncclFloat32: return reduce_t<float>(dst, acc, x, n, op, nranks, last);
    case ncclFloat64: return reduce_t<double>(dst, acc, x, n, op, nranks, last);
    case ncclBfloat16: return reduce_t<Bf16>(dst, acc, x, n, op, nranks, last);
    default: return;  // refused when the call was made (check_reduction)
  }
}

// ----- operations: each a list of ring steps -------------------------------------------------------

enum class Kind { AllReduce, ReduceScatter, AllGather, Broadcast, Send, Recv };
bool is_p2p(Kind k) { return k == Kind::Send || k == Kind::Recv; }

// Two fixed tags per communicator: the user's sends and receives, and the collectives' ring
// traffic. Within each, a pair's messages match in issue order, which is NCCL's only matching rule;
// keeping them apart lets a group's sends and receives progress beside its collectives.
constexpr int kTagP2P = 0, kTagRing = 1;

// One step: at most one message to a peer and one from a peer, then local work (a hop's reduction).
struct Step {
  int to = -1;
  const void* send = nullptr;
  size_t send_bytes = 0;
  int from = -1;
  void* recv = nullptr;
  size_t recv_bytes = 0;
  std::function<void()> then;
};

struct Op {
  Kind kind;
  const char* call;  // "ncclAllReduce"
  std::shared_ptr<ncclComm> comm;
  cudaStream_t stream;
  const void* sendbuff;
  void* recvbuff;
  size_t count;  // NCCL's count argument: per rank for reduce-scatter and all-gather
  ncclDataType_t type;
  ncclRedOp_t op;
  int peer;  // send/recv's peer, broadcast's root
  std::string what;

  enum State { Waiting, Running, Done, Cancelled } state = Waiting;
  std::vector<Step> steps;  // planned when the operation starts
  size_t next = 0;
  bool posted = false;
  MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};  // this step's receive, send
  std::vector<unsigned char> carry, scratch;                  // the partial sum in flight, and the one arriving
  bool broken = false;  // a message of the wrong size arrived: like a mismatched NCCL kernel, it never completes
};

std::string describe(const Op& o) {
  char b[160];
  const char* t = type_name(o.type);
  switch (o.kind) {
    case Kind::AllReduce: snprintf(b, sizeof b, "%s (%zu x %s, %s)", o.call, o.count, t, op_name(o.op)); break;
    case Kind::ReduceScatter:
      snprintf(b, sizeof b, "%s (%zu x %s per rank, %s)", o.call, o.count, t, op_name(o.op));
      break;
    case Kind::AllGather: snprintf(b, sizeof b, "%s (%zu x %s per rank)", o.call, o.count, t); break;
    case Kind::Broadcast: snprintf(b, sizeof b, "%s (%zu x %s from root %d)", o.call, o.count, t, o.peer); break;
    case Kind::Send: snprintf(b, sizeof b, "%s (%zu x %s) to peer %d", o.call, o.count, t, o.peer); break;
    case Kind::Recv: snprintf(b, sizeof b, "%s (%zu x %s) from peer %d", o.call, o.count, t, o.peer); break;
  }
  return b;
}

Step local(std::function<void()> f) {
  Step s;
  s.then = std::move(f);
  return s;
}

// NCCL's ring reduce-scatter (reduce_scatter.h, runRing): the partial sum of chunk k starts on rank
// k+1 and travels the ring, each rank adding its own contribution, until rank k completes it. So on
// rank r, step s sends the partial of chunk r-1-s and receives that of chunk r-2-s; the last step
// receives chunk r and writes the result to dst.
void plan_ring_reduce_scatter(Op& o, const char* src, const std::vector<size_t>& off, const std::vector<size_t>& cnt,
                              char* dst) {
  const int N = o.comm->size, r = o.comm->rank, next = (r + 1) % N, prev = (r + N - 1) % N;
  const size_t es = type_size(o.type);
  const size_t most = *std::max_element(cnt.begin(), cnt.end());
  o.carry.resize(most * es);
  o.scratch.resize(most * es);
  Op* p = &o;
  const int k0 = (r + N - 1) % N;
  o.steps.push_back(local([=] {  // the first hop sends this rank's own contribution
    reduce(p->type, p->carry.data(), nullptr, src + off[k0] * es, cnt[k0], p->op, N, false);
  }));
  for (int s = 0; s + 1 < N; s++) {
    const int ks = ((r - 1 - s) % N + N) % N, kr = ((r - 2 - s) % N + N) % N;
    const bool last = s + 2 == N;
    Step st;
    st.to = next, st.send = o.carry.data(), st.send_bytes = cnt[ks] * es;
    st.from = prev, st.recv = o.scratch.data(), st.recv_bytes = cnt[kr] * es;
    st.then = [=] {
      void* out = last ? static_cast<void*>(dst) : p->carry.data();
      reduce(p->type, out, p->scratch.data(), src + off[kr] * es, cnt[kr], p->op, N, last);
    };
    o.steps.push_back(std::move(st));
  }
}

// NCCL's ring all-gather: step s forwards chunk r-s to the next rank and receives chunk r-s-1.
void plan_ring_all_gather(Op& o, char* buf, const std::vector<size_t>& off, const std::vector<size_t>& cnt) {
  const int N = o.comm->size, r = o.comm->rank;
  const size_t es = type_size(o.type);
  for (int s = 0; s + 1 < N; s++) {
    const int ks = ((r - s) % N + N) % N, kr = ((r - s - 1) % N + N) % N;
    Step st;
    st.to = (r + 1) % N, st.send = buf + off[ks] * es, st.send_bytes = cnt[ks] * es;
    st.from = (r + N - 1) % N, st.recv = buf + off[kr] * es, st.recv_bytes = cnt[kr] * es;
    o.steps.push_back(std::move(st));
  }
}

// The steps of one collective. NCCL's in-place forms need no special case: the ring reads each
// chunk of the input before anything writes it.
void plan_collective(Op& o) {
  const int N = o.comm->size, r = o.comm->rank;
  const size_t es = type_size(o.type), n = o.count;
  const char* src = static_cast<const char*>(o.sendbuff);
  char* dst = static_cast<char*>(o.recvbuff);
  Op* p = &o;
  std::vector<size_t> off(N), cnt(N);
  if (o.kind == Kind::AllReduce) {  // N nearly equal chunks, the first n % N one element longer
    for (int k = 0; k < N; k++) cnt[k] = n / N + (size_t(k) < n % N), off[k] = k ? off[k - 1] + cnt[k - 1] : 0;
  } else {
    for (int k = 0; k < N; k++) cnt[k] = n, off[k] = k * n;
  }
  if (o.kind == Kind::AllReduce || o.kind == Kind::ReduceScatter) {
    if (N == 1) {
      o.steps.push_back(local([=] { reduce(p->type, dst, nullptr, src, n, p->op, 1, true); }));
      return;
    }
    plan_ring_reduce_scatter(o, src, off, cnt, dst + (o.kind == Kind::AllReduce ? off[r] * es : 0));
    if (o.kind == Kind::AllReduce) plan_ring_all_gather(o, dst, off, cnt);
  } else {  // all-gather: this rank's chunk into place, then the ring
    if (src != dst + r * n * es) o.steps.push_back(local([=] { memcpy(dst + r * n * es, src, n * es); }));
    plan_ring_all_gather(o, dst, off, cnt);
  }
}

// Broadcast down the ring from the root (broadcast.h): each rank receives from r-1 and forwards to
// r+1, except the last rank of the chain.
void plan_broadcast(Op& o) {
  const int N = o.comm->size, r = o.comm->rank, root = o.peer;
  const size_t bytes = o.count * type_size(o.type);
  const int hop = (r - root + N) % N;
  const void* src = o.sendbuff;
  void* dst = o.recvbuff;
  if (hop == 0 && src != dst) o.steps.push_back(local([=] { memcpy(dst, src, bytes); }));
  if (hop > 0) {
    Step st;
    st.from = (r + N - 1) % N, st.recv = dst, st.recv_bytes = bytes;
    o.steps.push_back(std::move(st));
  }
  if (hop < N - 1) {
    Step st;
    st.to = (r + 1) % N, st.send = hop == 0 ? src : dst, st.send_bytes = bytes;
    o.steps.push_back(std::move(st));
  }
}

void plan(Op& o) {
  const size_t bytes = o.count * type_size(o.type);
  Step st;
  switch (o.kind) {
    case Kind::Send:
      st.to = o.peer, st.send = o.sendbuff, st.send_bytes = bytes;
      o.steps.push_back(std::move(st));
      return;
    case Kind::Recv:
      st.from = o.peer, st.recv = o.recvbuff, st.recv_bytes = bytes;
      o.steps.push_back(std::move(st));
      return;
    case Kind::Broadcast: return plan_broadcast(o);
    default: return plan_collective(o);
  }
}

// ----- running one operation's steps ---------------------------------------------------------------

// Synchronous sends (MPI_Issend): complete only once the receive is posted, as NCCL's do.
void post(Op& o, const Step& s) {
  const int tag = is_p2p(o.kind) ? kTagP2P : kTagRing;
  if (s.from >= 0) MPI_Irecv(s.recv, int(s.recv_bytes), MPI_BYTE, s.from, tag, o.comm->mpi, &o.req[0]);
  if (s.to >= 0) MPI_Issend(const_cast<void*>(s.send), int(s.send_bytes), MPI_BYTE, s.to, tag, o.comm->mpi, &o.req[1]);
}

// NCCL requires "the same count and datatype" on both sides of a message (ncclSend, ncclRecv) and
// the same operations in the same order on every rank; a message of another size breaks that.
void mismatch(Op& o, const Step& s, long got) {
  o.broken = true;
  o.comm->fail(ncclInvalidUsage);
  std::string size = got >= 0 ? std::to_string(got) + " bytes" : "more bytes";
  emu::report("%s on %s: peer %d sent %s where %zu were expected: the two sides' counts or datatypes differ, or the "
              "ranks did not issue the same operations on this communicator in the same order",
              o.what.c_str(), o.comm->label().c_str(), s.from, size.c_str(), s.recv_bytes);
}

// Tests the step's messages once; true when both have completed.
bool step_done(Op& o, const Step& s) {
  if (o.broken) return false;
  bool done = true;
  for (int i = 0; i < 2; i++) {
    if (o.req[i] == MPI_REQUEST_NULL) continue;
    int flag = 0, got = -1;
    MPI_Status st;
    const int err = MPI_Test(&o.req[i], &flag, &st);  // a longer message than the receive: MPI_ERR_TRUNCATE
    if (err == MPI_SUCCESS && flag && i == 0) MPI_Get_count(&st, MPI_BYTE, &got);
    if (err != MPI_SUCCESS || (got >= 0 && size_t(got) != s.recv_bytes)) {
      mismatch(o, s, err == MPI_SUCCESS ? got : -1);
      return false;
    }
    done = done && flag;
  }
  return done;
}

// Runs as many steps as have nothing left to wait for; true when the operation has finished.
bool advance(Op& o) {
  while (o.next < o.steps.size()) {
    Step& s = o.steps[o.next];
    if (!o.posted) post(o, s), o.posted = true;
    if (!step_done(o, s)) return false;
    if (s.then) s.then();
    o.next++, o.posted = false;
  }
  return true;
}

// Releases an aborted operation's messages as far as MPI allows: a posted receive can be cancelled;
// a send MPI cannot cancel (already matched) completes on its own shortly, or is left to MPI.
void cancel(Op& o) {
  for (MPI_Request& r : o.req) {
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    int flag = 0;
    for (double t0 = now_s(); !flag && now_s() - t0 < 0.5; usleep(1000)) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
    if (!flag) MPI_Request_free(&r);
  }
  if (o.state == Op::Running) o.comm->count(&ncclComm::running, -1);
  o.state = Op::Cancelled;
}

// ----- the GPU's queue of NCCL launches ------------------------------------------------------------
// A launch is one ungrouped call, or one group. Each takes a ticket when the host launches it and
// starts only when every earlier ticket has finished: NCCL's kernels on one GPU in launch order.

struct Launch {
  uint64_t ticket = 0;
  std::vector<std::shared_ptr<Op>> ops;
  double timeout = 30;
  std::atomic<bool> started{false};
  std::string what() const {
    std::string w = ops[0]->what + " on " + ops[0]->comm->label();
    if (ops.size() > 1) w += " (in a group of " + std::to_string(ops.size()) + " operations)";
    return w;
  }
};

struct Turns {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t issued = 0;                                 // the last ticket handed out
  uint64_t next = 1;                                   // the ticket whose turn it is
  std::set<uint64_t> finished_early;                   // dropped (aborted) before their turn
  std::map<uint64_t, std::shared_ptr<Launch>> queued;  // launched, not finished: named in reports
};
Turns& g_turns = *new Turns;

bool all_aborted(const Launch& L) {
  for (auto& o : L.ops)
    if (!o->comm->aborted) return false;
  return true;
}

// "; 2 later NCCL operations on this GPU wait behind it, the next: ..." (g_turns.mu held).
std::string behind(const Launch& L) {
  auto it = g_turns.queued.upper_bound(L.ticket);
  if (it == g_turns.queued.end()) return "";
  const size_t n = std::distance(it, g_turns.queued.end());
  return "; " + std::to_string(n) + " later NCCL operation" + (n > 1 ? "s on this GPU wait" : " on this GPU waits") +
         " behind it, the next: " + it->second->what();
}

// A launch waiting for its turn reports only when the launch holding the turn has not started (its
// stream is stuck on other work): a running one reports itself when it times out.
bool report_turn(const Launch& L, double waited) {
  auto it = g_turns.queued.find(g_turns.next);
  if (it == g_turns.queued.end() || it->second->started) return false;
  for (auto& o : L.ops) o->comm->fail(ncclInvalidUsage);
  emu::report("%s waited %.0f s for its turn: NCCL operations run one at a time in launch order on a GPU, and the "
              "earlier %s has not started (its stream waits for work that cannot run)",
              L.what().c_str(), waited, it->second->what().c_str());
  return true;
}

// Blocks until every earlier launch has finished; false when all of this launch's communicators
// were aborted meanwhile (its operations are then dropped, as ncclCommAbort drops queued work).
bool wait_turn(const Launch& L) {
  std::unique_lock<std::mutex> lk(g_turns.mu);
  const double t0 = now_s();
  bool told = false;
  while (g_turns.next != L.ticket) {
    if (all_aborted(L)) return false;
    if (!told && now_s() - t0 > L.timeout) told = report_turn(L, now_s() - t0);
    g_turns.cv.wait_for(lk, std::chrono::milliseconds(20));
  }
  return true;
}

void finish_turn(const Launch& L) {
  std::lock_guard<std::mutex> lk(g_turns.mu);
  g_turns.queued.erase(L.ticket);
  if (L.ticket == g_turns.next) {
    g_turns.next++;
    while (g_turns.finished_early.erase(g_turns.next)) g_turns.next++;
  } else {
    g_turns.finished_early.insert(L.ticket);
  }
  g_turns.cv.notify_all();
}

// ----- running a launch on its stream --------------------------------------------------------------

std::string waits_for(const Op& o) {
  const char* orders = "ranks issuing NCCL operations on different communicators in different orders";
  char b[512];
  if (o.kind == Kind::Send)
    snprintf(b, sizeof b, "for its receive: a send whose receive is never posted, or %s", orders);
  else if (o.kind == Kind::Recv)
    snprintf(b, sizeof b, "for its send: a receive whose send is never posted, or %s", orders);
  else {
    const Step& s = o.steps[o.next];
    size_t step = 0, steps = 0;  // counting the steps that exchange messages
    for (size_t i = 0; i < o.steps.size(); i++)
      if (o.steps[i].to >= 0 || o.steps[i].from >= 0) steps++, step += i <= o.next;
    std::string peers;
    if (o.req[0] != MPI_REQUEST_NULL) peers = "its message from rank " + std::to_string(s.from);
    if (o.req[1] != MPI_REQUEST_NULL)
      peers += (peers.empty() ? "" : " and ") + std::string("rank ") + std::to_string(s.to) + " to receive its own";
    snprintf(b, sizeof b, "at step %zu of %zu for %s: a rank of the communicator that does not make this call, or %s",
             step, steps, peers.c_str(), orders);
  }
  return b;
}

// Past the timeout: names the first operation still waiting, and gives every waiting operation's
// communicator an asynchronous error. NCCL has no timeout of its own (2.18): a stuck peer shows as
// a hang, or, once that peer's process is gone, as ncclRemoteError ("a remote process exiting
// prematurely", NCCL's error table). A peer that never answers is that case, so the emulator uses it.
void report_stuck(const Launch& L, double waited) {
  const Op* first = nullptr;
  for (auto& o : L.ops)
    if (o->state == Op::Running && !o->broken && !first) first = o.get();
  if (!first) return;  // every waiting operation was already named as a mismatch
  std::string later;
  {
    std::lock_guard<std::mutex> lk(g_turns.mu);
    later = behind(L);
  }
  std::string group = L.ops.size() > 1 ? " (in a group of " + std::to_string(L.ops.size()) + " operations)" : "";
  emu::report("%s on %s%s waited %.0f s %s%s", first->what.c_str(), first->comm->label().c_str(), group.c_str(),
              waited, waits_for(*first).c_str(), later.c_str());
  // The errors only after the report: a host thread that sees one (ncclCommGetAsyncError) then finds
  // the report written, however the threads are scheduled.
  for (auto& o : L.ops)
    if (o->state == Op::Running && !o->broken) o->comm->fail(ncclRemoteError);
}

void start(Op& o) {
  o.state = Op::Running;
  o.comm->count(&ncclComm::running, 1);
  plan(o);
}

void pause(int idle) {
  if (idle < 16)
    sched_yield();
  else
    usleep(std::min(1000, 10 * idle));
}

// What a finished operation wrote (recvbuff's bytes), for the memcheck build's initcheck (shadow.h).
void mark_output(const Op& o) {
  const size_t bytes = o.count * type_size(o.type);
  if (o.kind == Kind::Send) return;
  emu::shadow::written(o.recvbuff, o.kind == Kind::AllGather ? bytes * size_t(o.comm->size) : bytes);
}

// Progresses every operation of the launch until all have finished or been aborted. Sends and
// receives all progress at once; collectives on one communicator run one after another (NCCL runs
// a group's collectives in order), those on different communicators side by side.
void progress(const Launch& L) {
  const double t0 = now_s();
  bool told = false;
  for (int idle = 0;;) {
    bool all_done = true, moved = false;
    std::set<ncclComm*> busy;  // communicators whose earlier collective in this launch is unfinished
    for (auto& o : L.ops) {
      if (o->state == Op::Done || o->state == Op::Cancelled) continue;
      if (o->comm->aborted) {
        cancel(*o);
        continue;
      }
      all_done = false;
      if (!is_p2p(o->kind) && !busy.insert(o->comm.get()).second) continue;
      if (o->state == Op::Waiting) start(*o);
      const size_t before = o->next;
      if (advance(*o)) {
        o->state = Op::Done;
        mark_output(*o);
        o->comm->count(&ncclComm::running, -1);
        busy.erase(o->comm.get());
      }
      moved = moved || o->next != before || o->state == Op::Done;
    }
    if (all_done) return;
    if (!told && now_s() - t0 > L.timeout) report_stuck(L, now_s() - t0), told = true;
    idle = moved ? 0 : std::min(idle + 1, 1000);
    pause(idle);
  }
}

// SANITIZE=thread: what the operation reads and writes, on its stream's thread, when it starts (MPI
// and the reductions are not instrumented): the whole send buffer, then the whole receive buffer.
void declare_accesses(const Op& o) {
  const size_t bytes = o.count * type_size(o.type), n = size_t(o.comm->size);
  const bool root = o.kind == Kind::Broadcast && o.comm->rank == o.peer;
  const size_t in = o.kind == Kind::ReduceScatter ? bytes * n : o.kind == Kind::Recv ? 0 : bytes;
  const size_t out = o.kind == Kind::AllGather ? bytes * n : o.kind == Kind::Send ? 0 : bytes;
  if (o.kind != Kind::Broadcast || root) emu::tsan::read(o.sendbuff, in);
  if (o.kind != Kind::Broadcast || !root || o.sendbuff != o.recvbuff) emu::tsan::write(o.recvbuff, out);
}

// What the stream runs: the launch, in its turn.
void run(const std::shared_ptr<Launch>& L) {
  if (wait_turn(*L)) {
    L->started = true;
    if (emu::tsan::kOn)
      for (auto& o : L->ops) declare_accesses(*o);
    progress(*L);
  } else {
    for (auto& o : L->ops) o->state = Op::Cancelled;
  }
  finish_turn(*L);
  for (auto& o : L->ops) o->comm->count(&ncclComm::queued, -1);
}

// Makes stream b wait for the work queued on stream a so far.
void join(cudaStream_t a, cudaStream_t b) {
  cudaEvent_t e;
  cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
  cudaEventRecord(e, a);
  cudaStreamWaitEvent(b, e, 0);
  cudaEventDestroy(e);
}

// Queues a launch on its operations' stream. A group over several streams runs on the first, after
// the others' earlier work, and the others' later work waits for it (NCCL joins a group's streams).
ncclResult_t launch(std::vector<std::shared_ptr<Op>> ops) {
  auto L = std::make_shared<Launch>();
  L->ops = std::move(ops);
  L->timeout = timeout_s();
  for (auto& o : L->ops) o->comm->count(&ncclComm::queued, 1);
  {
    std::lock_guard<std::mutex> lk(g_turns.mu);
    L->ticket = ++g_turns.issued;
    g_turns.queued[L->ticket] = L;
  }
  const cudaStream_t s = L->ops[0]->stream;
  std::vector<cudaStream_t> others;
  for (auto& o : L->ops)
    if (o->stream != s && std::find(others.begin(), others.end(), o->stream) == others.end())
      others.push_back(o->stream);
  for (cudaStream_t x : others) join(x, s);
  emu::enqueue(s, L->ops[0]->call, [L] { run(L); }, true);
  for (cudaStream_t x : others) join(s, x);
  return ncclSuccess;
}

// ----- the calls' checks ---------------------------------------------------------------------------
// A call that fails a check has no effect and returns at once, in a group too (NCCL's error table:
// ncclInvalidArgument "applies to that specific NCCL call", the group is unchanged).

struct Group {
  int depth = 0;
  std::vector<std::shared_ptr<Op>> ops;
};
thread_local Group t_group;

ncclResult_t check_comm(const char* call, ncclComm_t comm, std::shared_ptr<ncclComm>* out) {
  *out = live(comm);
  if (!*out) {
    emu::report("%s: %p is not a live communicator (never created, or already destroyed or aborted)", call,
                static_cast<void*>(comm));
    return ncclInvalidArgument;
  }
  const int e = (*out)->async_error;
  if (e != ncclSuccess) {
    emu::report("%s on %s, which has an asynchronous error (%s): NCCL's documentation asks to abort it "
                "(ncclCommAbort) and create a new one",
                call, (*out)->label().c_str(), ncclGetErrorString(ncclResult_t(e)));
    return ncclResult_t(e);
  }
  return ncclSuccess;
}

ncclResult_t check_buffer(const char* call, const char* which, const void* p, size_t bytes) {
  if (bytes == 0 || emu::is_device(p, bytes)) return ncclSuccess;
  emu::report("%s: %s %p (%zu bytes) is not device memory: NCCL's kernels read and write it on the GPU, so it must "
              "come from cudaMalloc",
              call, which, p, bytes);
  return ncclInvalidArgument;
}

ncclResult_t check_type(const char* call, ncclDataType_t t, size_t count, size_t times) {
  if (type_size(t) == 0) {
    emu::report("%s: datatype %d is not an ncclDataType_t", call, int(t));
    return ncclInvalidArgument;
  }
  if (count > size_t(INT32_MAX) / type_size(t) / times) {  // MPI counts are ints
    emu::report("%s: %zu x %s is more than the emulator carries in one message (2 GiB)", call, count, type_name(t));
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t check_reduction(const char* call, ncclDataType_t t, ncclRedOp_t op) {
  if (unsigned(op) >= ncclNumOps) {
    emu::report("%s: reduction %d is not one of NCCL's built-in ncclRedOp_t", call, int(op));
    return ncclInvalidArgument;
  }
  if (t == ncclFloat16) {
    emu::report("%s: reductions of ncclFloat16 are not emulated", call);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t check_rank(const char* call, const char* which, int r, const ncclComm& c) {
  if (r >= 0 && r < c.size) return ncclSuccess;
  emu::report("%s: %s %d is not a rank of %s", call, which, r, c.label().c_str());
  return ncclInvalidArgument;
}

// Buffers either coincide in NCCL's in-place form or are disjoint; a partial overlap is undefined.
ncclResult_t check_overlap(const char* call, const void* a, size_t an, const void* b, size_t bn, const void* same) {
  const char *x = static_cast<const char*>(a), *y = static_cast<const char*>(b);
  if (!an || !bn || a == same || x + an <= y || y + bn <= x) return ncclSuccess;
  emu::report("%s: sendbuff and recvbuff overlap other than in NCCL's in-place form (NCCL user guide, In-place "
              "Operations)",
              call);
  return ncclInvalidArgument;
}

// Queues `o` alone, or adds it to the calling thread's open group.
ncclResult_t submit(std::shared_ptr<Op> o) {
  o->what = describe(*o);
  if (t_group.depth > 0) {
    t_group.ops.push_back(std::move(o));
    return ncclSuccess;
  }
  return launch({std::move(o)});
}

std::shared_ptr<Op> make_op(Kind k, const char* call, std::shared_ptr<ncclComm> c, cudaStream_t s, const void* send,
                            void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, int peer) {
  auto o = std::make_shared<Op>();
  o->kind = k, o->call = call, o->comm = std::move(c), o->stream = s;
  o->sendbuff = send, o->recvbuff = recv, o->count = count, o->type = t, o->op = op, o->peer = peer;
  return o;
}

#define TRY(x)                         \
  do {                                 \
    ncclResult_t r_ = (x);             \
    if (r_ != ncclSuccess) return r_;  \
  } while (0)

// ----- bootstrap: the members find each other over MPI_COMM_WORLD ----------------------------------
// ncclGetUniqueId names its maker. Every other member sends the maker a hello (its rank and nranks)
// on the largest tag MPI allows; the maker answers each with the member list (world ranks in
// communicator-rank order) on the tag below it; the members then build their MPI communicator with
// MPI_Comm_create_group, collective over the members only. The project uses neither tag.

struct IdContents {
  char magic[8];
  int maker;   // world rank of the rank that called ncclGetUniqueId
  int serial;  // its how-manieth id
};
const char kMagic[8] = "tsemuid";
std::atomic<int> g_serial{0};

int tag_ub() {
  int* v = nullptr;
  int flag = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &v, &flag);
  return flag ? *v : 32767;
}

struct Hello {
  int serial, rank, nranks, world;
};
// Hellos for another id of the same maker, received while waiting for this one's.
std::mutex& g_early_mu = *new std::mutex;
std::vector<Hello>& g_early = *new std::vector<Hello>;

// The next hello for id `serial`, or false past the deadline.
bool next_hello(int serial, Hello* h, double deadline) {
  for (int idle = 0; now_s() < deadline; pause(++idle)) {
    {
      std::lock_guard<std::mutex> lk(g_early_mu);
      auto it = std::find_if(g_early.begin(), g_early.end(), [&](const Hello& x) { return x.serial == serial; });
      if (it != g_early.end()) {
        *h = *it;
        g_early.erase(it);
        return true;
      }
    }
    int flag = 0;
    MPI_Message m;
    MPI_Status st;
    MPI_Improbe(MPI_ANY_SOURCE, tag_ub(), MPI_COMM_WORLD, &flag, &m, &st);  // matched probe: thread-safe
    if (!flag) continue;
    int msg[3];
    MPI_Mrecv(msg, 3, MPI_INT, &m, MPI_STATUS_IGNORE);
    Hello got{msg[0], msg[1], msg[2], st.MPI_SOURCE};
    if (got.serial == serial) {
      *h = got;
      return true;
    }
    std::lock_guard<std::mutex> lk(g_early_mu);
    g_early.push_back(got);
  }
  return false;
}

// The maker's side: the other members' hellos, checked, then the list (or -1s) sent to each.
ncclResult_t collect_members(const IdContents& id, int nranks, int rank, double timeout, std::vector<int>* members) {
  members->assign(nranks, -1);
  (*members)[rank] = ts::world_rank();
  std::vector<Hello> got;
  std::string problem;
  const double deadline = now_s() + timeout;
  for (Hello h; int(got.size()) < nranks - 1;) {
    if (!next_hello(id.serial, &h, deadline)) {
      problem = "waited " + std::to_string(int(timeout)) + " s for " + std::to_string(nranks - 1 - int(got.size())) +
                " of the other members: ranks given the id that never call ncclCommInitRank";
      break;
    }
    got.push_back(h);
    if (h.nranks != nranks)
      problem = "world rank " + std::to_string(h.world) + " says nranks " + std::to_string(h.nranks) + ", this rank " +
                std::to_string(nranks);
    else if (h.rank < 0 || h.rank >= nranks || (*members)[h.rank] >= 0)
      problem = "world rank " + std::to_string(h.world) + " claims rank " + std::to_string(h.rank) +
                ", which is out of range or taken";
    else
      (*members)[h.rank] = h.world;
  }
  std::vector<int> reply(nranks + 1, -1);
  reply[0] = id.serial;
  if (problem.empty()) std::copy(members->begin(), members->end(), reply.begin() + 1);
  for (const Hello& h : got) MPI_Send(reply.data(), nranks + 1, MPI_INT, h.world, tag_ub() - 1, MPI_COMM_WORLD);
  if (problem.empty()) return ncclSuccess;
  emu::report("ncclCommInitRank (rank %d of %d, id %d:%d): %s", rank, nranks, id.maker, id.serial, problem.c_str());
  return got.size() + 1 < size_t(nranks) ? ncclRemoteError : ncclInvalidArgument;
}

// A member's side: hello to the maker, then its answer.
ncclResult_t join_members(const IdContents& id, int nranks, int rank, double timeout, std::vector<int>* members) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int hello[3] = {id.serial, rank, nranks};
  std::vector<int> reply(world + 1, -1);
  MPI_Request req[2];
  MPI_Irecv(reply.data(), world + 1, MPI_INT, id.maker, tag_ub() - 1, MPI_COMM_WORLD, &req[0]);
  MPI_Isend(hello, 3, MPI_INT, id.maker, tag_ub(), MPI_COMM_WORLD, &req[1]);
  int flag = 0;
  MPI_Status st[2];
  const double deadline = now_s() + timeout;
  for (int idle = 0; !flag && now_s() < deadline; pause(++idle)) MPI_Testall(2, req, &flag, st);
  if (!flag) {
    for (MPI_Request& r : req)
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r), MPI_Request_free(&r);
    emu::report("ncclCommInitRank (rank %d of %d, id %d:%d) waited %.0f s for the id's maker, world rank %d: it must "
                "call ncclCommInitRank too (the emulator requires the rank that called ncclGetUniqueId to be a member)",
                rank, nranks, id.maker, id.serial, timeout, id.maker);
    return ncclRemoteError;
  }
  int n = 0;
  MPI_Get_count(&st[0], MPI_INT, &n);
  if (n != nranks + 1 || reply[0] != id.serial || reply[1] < 0) return ncclInvalidArgument;  // the maker reported it
  members->assign(reply.begin() + 1, reply.begin() + 1 + nranks);
  return ncclSuccess;
}

ncclResult_t check_init(ncclComm_t* comm, int nranks, const IdContents& id, int rank) {
  int provided = 0, world = 1;
  if (!mpi_usable()) {
    emu::report("ncclCommInitRank: the emulated NCCL runs over MPI, which is not initialised (or already finalised)");
    return ncclInvalidUsage;
  }
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE) {
    emu::report("ncclCommInitRank: MPI was initialised without MPI_THREAD_MULTIPLE; the emulated NCCL calls MPI from "
                "its streams' threads while the host thread makes its own calls");
    return ncclInvalidUsage;
  }
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (!comm || memcmp(id.magic, kMagic, sizeof kMagic) != 0 || id.maker < 0 || id.maker >= world || nranks < 1 ||
      nranks > world || rank < 0 || rank >= nranks) {
    emu::report("ncclCommInitRank: invalid arguments (comm %p, nranks %d, rank %d, or an id ncclGetUniqueId did not "
                "make)",
                static_cast<void*>(comm), nranks, rank);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

}  // namespace

// ----- the API: communicators ----------------------------------------------------------------------

const char* ncclGetErrorString(ncclResult_t r) {
  emu::cover("nccl ncclGetErrorString");
  switch (r) {  // NCCL's own strings
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  emu::cover("nccl ncclGetUniqueId");
  if (!uniqueId) return ncclInvalidArgument;
  if (!mpi_usable()) {
    emu::report("ncclGetUniqueId: the emulated NCCL runs over MPI, which is not initialised (or already finalised)");
    return ncclInvalidUsage;
  }
  IdContents id;
  memcpy(id.magic, kMagic, sizeof kMagic);
  id.maker = ts::world_rank();
  id.serial = ++g_serial;
  memset(uniqueId, 0, sizeof *uniqueId);
  memcpy(uniqueId->internal, &id, sizeof id);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  emu::cover("nccl ncclCommInitRank");
  IdContents id;
  memcpy(&id, commId.internal, sizeof id);
  TRY(check_init(comm, nranks, id, rank));
  std::vector<int> members;
  const double timeout = timeout_s();
  if (ts::world_rank() == id.maker)
    TRY(collect_members(id, nranks, rank, timeout, &members));
  else
    TRY(join_members(id, nranks, rank, timeout, &members));
  MPI_Group world_group, group;
  MPI_Comm mpi = MPI_COMM_NULL;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_incl(world_group, nranks, members.data(), &group);
  MPI_Comm_create_group(MPI_COMM_WORLD, group, tag_ub() - 1, &mpi);
  MPI_Group_free(&group);
  MPI_Group_free(&world_group);
  *comm = adopt(mpi, std::to_string(id.maker) + ":" + std::to_string(id.serial));
  return ncclSuccess;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  emu::cover("nccl ncclCommSplit");
  std::shared_ptr<ncclComm> c;
  TRY(check_comm("ncclCommSplit", comm, &c));
  if (!newcomm || (color < 0 && color != NCCL_SPLIT_NOCOLOR) || (config && config->magic != NCCL_API_MAGIC)) {
    emu::report("ncclCommSplit: invalid arguments (newcomm %p, colour %d, or a config not set up with "
                "NCCL_CONFIG_INITIALIZER)",
                static_cast<void*>(newcomm), color);
    return ncclInvalidArgument;
  }
  // Collective over the parent's members, like NCCL's; it does not wait for the parent's operations.
  MPI_Comm mpi = MPI_COMM_NULL;
  MPI_Comm_split(c->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &mpi);
  *newcomm = mpi == MPI_COMM_NULL ? nullptr : adopt(mpi, c->name + "/" + std::to_string(color));
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  emu::cover("nccl ncclCommGetAsyncError");
  std::shared_ptr<ncclComm> c = live(comm);
  if (!c || !asyncError) return ncclInvalidArgument;
  *asyncError = ncclResult_t(c->async_error.load());  // never ncclInProgress: initialisation is blocking
  return ncclSuccess;
}

namespace {

// Stops the communicator's operations: running ones cancel their messages and finish, queued ones
// are dropped when their turn comes. The MPI communicator is deliberately never freed: a message
// the abort stranded could otherwise match a receive on a later communicator that reuses its
// context id.
void abort_comm(const std::shared_ptr<ncclComm>& c) {
  c->aborted = true;
  {
    std::lock_guard<std::mutex> lk(g_turns.mu);
    g_turns.cv.notify_all();
  }
  std::unique_lock<std::mutex> lk(c->mu);
  c->cv.wait(lk, [&] { return c->running == 0; });
  lk.unlock();
  forget(c.get());
}

// Waits for the communicator's launched operations to finish; false (reported) when one has an
// error or they outlast the timeout.
bool drain(ncclComm& c) {
  const double t0 = now_s(), timeout = timeout_s();
  std::unique_lock<std::mutex> lk(c.mu);
  while (c.queued > 0) {
    const int e = c.async_error;
    if (e != ncclSuccess || now_s() - t0 > timeout) {
      emu::report("ncclCommDestroy on %s with %d operations that %s: aborted instead (NCCL's user guide: after an "
                  "asynchronous error, call ncclCommAbort)",
                  c.label().c_str(), c.queued,
                  e != ncclSuccess ? "cannot complete after an asynchronous error" : "outlasted the timeout");
      return false;
    }
    c.cv.wait_for(lk, std::chrono::milliseconds(20));
  }
  return true;
}

}  // namespace

// Local: frees this rank's side once its operations have finished.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  emu::cover("nccl ncclCommDestroy");
  if (!comm) return ncclSuccess;
  std::shared_ptr<ncclComm> c = live(comm);
  if (!c) {
    emu::report("ncclCommDestroy: %p is not a live communicator (destroyed or aborted twice?)",
                static_cast<void*>(comm));
    return ncclInvalidArgument;
  }
  if (!drain(*c)) {
    abort_comm(c);
    return ncclSuccess;
  }
  forget(c.get());
  if (mpi_usable()) MPI_Comm_free(&c->mpi);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  emu::cover("nccl ncclCommAbort");
  if (!comm) return ncclSuccess;
  std::shared_ptr<ncclComm> c = live(comm);
  if (!c) {
    emu::report("ncclCommAbort: %p is not a live communicator (destroyed or aborted twice?)", static_cast<void*>(comm));
    return ncclInvalidArgument;
  }
  abort_comm(c);
  return ncclSuccess;
}

// ----- the API: groups -----------------------------------------------------------------------------

ncclResult_t ncclGroupStart() {
  emu::cover("nccl ncclGroupStart");
  t_group.depth++;
  return ncclSuccess;
}

// The outermost ncclGroupEnd launches the group's operations as one.
ncclResult_t ncclGroupEnd() {
  emu::cover("nccl ncclGroupEnd");
  if (t_group.depth == 0) {
    emu::report("ncclGroupEnd without a matching ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--t_group.depth > 0 || t_group.ops.empty()) return ncclSuccess;
  std::vector<std::shared_ptr<Op>> ops = std::move(t_group.ops);
  t_group.ops.clear();
  return launch(std::move(ops));
}

// ----- the API: operations -------------------------------------------------------------------------
// Empty collectives are dropped, as NCCL drops them (enqueue.cc, taskAppend); empty sends and
// receives still meet their peer.

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  emu::cover("nccl ncclAllReduce");
  const char* call = "ncclAllReduce";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, count, 1));
  TRY(check_reduction(call, datatype, op));
  const size_t bytes = count * type_size(datatype);
  TRY(check_buffer(call, "sendbuff", sendbuff, bytes));
  TRY(check_buffer(call, "recvbuff", recvbuff, bytes));
  TRY(check_overlap(call, sendbuff, bytes, recvbuff, bytes, recvbuff));
  if (count == 0) return ncclSuccess;
  return submit(make_op(Kind::AllReduce, call, c, stream, sendbuff, recvbuff, count, datatype, op, -1));
}

// recvcount elements per rank: sendbuff holds nranks * recvcount; in place when
// recvbuff == sendbuff + rank * recvcount.
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  emu::cover("nccl ncclReduceScatter");
  const char* call = "ncclReduceScatter";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, recvcount, c->size));
  TRY(check_reduction(call, datatype, op));
  const size_t bytes = recvcount * type_size(datatype);
  TRY(check_buffer(call, "sendbuff", sendbuff, bytes * c->size));
  TRY(check_buffer(call, "recvbuff", recvbuff, bytes));
  const void* in_place = static_cast<const char*>(sendbuff) + c->rank * bytes;
  TRY(check_overlap(call, recvbuff, bytes, sendbuff, bytes * c->size, in_place));
  if (recvcount == 0) return ncclSuccess;
  return submit(make_op(Kind::ReduceScatter, call, c, stream, sendbuff, recvbuff, recvcount, datatype, op, -1));
}

// sendcount elements per rank: recvbuff holds nranks * sendcount; in place when
// sendbuff == recvbuff + rank * sendcount.
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  emu::cover("nccl ncclAllGather");
  const char* call = "ncclAllGather";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, sendcount, c->size));
  const size_t bytes = sendcount * type_size(datatype);
  TRY(check_buffer(call, "sendbuff", sendbuff, bytes));
  TRY(check_buffer(call, "recvbuff", recvbuff, bytes * c->size));
  const void* in_place = static_cast<const char*>(recvbuff) + c->rank * bytes;
  TRY(check_overlap(call, sendbuff, bytes, recvbuff, bytes * c->size, in_place));
  if (sendcount == 0) return ncclSuccess;
  return submit(make_op(Kind::AllGather, call, c, stream, sendbuff, recvbuff, sendcount, datatype, ncclSum, -1));
}

// sendbuff is read on the root only; in place when sendbuff == recvbuff.
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  emu::cover("nccl ncclBroadcast");
  const char* call = "ncclBroadcast";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, count, 1));
  TRY(check_rank(call, "root", root, *c));
  const size_t bytes = count * type_size(datatype);
  if (c->rank == root) {
    TRY(check_buffer(call, "sendbuff", sendbuff, bytes));
    TRY(check_overlap(call, sendbuff, bytes, recvbuff, bytes, recvbuff));
  }
  TRY(check_buffer(call, "recvbuff", recvbuff, bytes));
  if (count == 0) return ncclSuccess;
  return submit(make_op(Kind::Broadcast, call, c, stream, sendbuff, recvbuff, count, datatype, ncclSum, root));
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  emu::cover("nccl ncclSend");
  const char* call = "ncclSend";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, count, 1));
  TRY(check_rank(call, "peer", peer, *c));
  TRY(check_buffer(call, "sendbuff", sendbuff, count * type_size(datatype)));
  return submit(make_op(Kind::Send, call, c, stream, sendbuff, nullptr, count, datatype, ncclSum, peer));
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  emu::cover("nccl ncclRecv");
  const char* call = "ncclRecv";
  std::shared_ptr<ncclComm> c;
  TRY(check_comm(call, comm, &c));
  TRY(check_type(call, datatype, count, 1));
  TRY(check_rank(call, "peer", peer, *c));
  TRY(check_buffer(call, "recvbuff", recvbuff, count * type_size(datatype)));
  return submit(make_op(Kind::Recv, call, c, stream, nullptr, recvbuff, count, datatype, ncclSum, peer));
}
