// ranks: 2 4
// The emulated NCCL (common/emu/nccl.cu) against host computations on every rank: each collective
// (all-reduce, reduce-scatter, all-gather, broadcast) in fp32, int32 and bf16, sum, max and avg, out
// of place and in NCCL's in-place forms; a bf16 sum rounded at every hop of the ring, as NCCL's
// ring rounds it (and, over more than two ranks, differing from one rounding of the exact sum);
// ncclAvg multiplying floats by 1/n before the sum (so a sum that overflows still averages) and
// dividing integers after it; splits with colours, keys and NCCL_SPLIT_NOCOLOR; messages without
// tags matching in issue order; a grouped ring exchange completing. Then the defects the emulator
// must name, each seeded: a send whose receive is never posted, an ungrouped send/send exchange,
// and two ranks launching two communicators' all-reduces in opposite orders. Each is caught by the
// communicator's asynchronous error and the emulator's report, then aborted, and the job goes on
// with fresh communicators. Only in the emulated build (make CUDA=emu).
#include <catch2/catch.hpp>

#ifdef TS_CUDA_EMU
#include <mpi.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tensor/core.h"
#include "tensor/device.h"
#include "emu.h"
#include "emu_util.h"

namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// A communicator of every rank: rank 0 makes the id and MPI carries it, as make_mesh does.
ncclComm_t world_comm() {
  ncclUniqueId id;
  if (world_rank() == 0) REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t c = nullptr;
  REQUIRE(ncclCommInitRank(&c, world_size(), id, world_rank()) == ncclSuccess);
  REQUIRE(c != nullptr);
  return c;
}

// Non-blocking, as comm.cu's streams are: cudaMemcpy on the legacy stream does not wait for them,
// so a test can read results while a seeded defect holds another stream.
cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  return s;
}

using tst::to_device;
using tst::to_host;

// bf16 on the host as the project rounds it (core.h): the top half of a float, nearest even.
float bf2f(uint16_t b) { return ts::bf16_to_float(ts::bf16{b}); }
uint16_t f2bf(float f) { return ts::float_to_bf16(f).bits; }

// Reproducible values: a hash of (rank, element), small integers and halves, exact in any sum.
float small(int r, size_t i) { return float(int((r * 7919 + i * 104729) % 23) - 11) * 0.5f; }
// Values with a full bf16 mantissa, so sums round.
uint16_t mantissa(int r, size_t i) {
  uint32_t h = uint32_t(r * 2654435761u) ^ uint32_t(i * 40503u + 17);
  h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
  return f2bf(float(int(h % 4001) - 2000) / 256.f);
}

// The reduction order nccl.cu documents for its ring: count is cut into N chunks (the first
// count % N one element longer); the sum of chunk k starts on rank k+1 and travels the ring, each
// hop adding one rank's value and rounding to bf16, until rank k adds the last.
size_t chunk_of(size_t i, size_t count, int N) {
  size_t start = 0;
  for (int k = 0; k < N; k++) {
    const size_t len = count / N + (size_t(k) < count % N);
    if (i < start + len) return k;
    start += len;
  }
  return N - 1;
}
template <class X> uint16_t ring_bf16_sum(int N, int k, X x) {
  uint16_t acc = x((k + 1) % N);
  for (int j = 2; j <= N; j++) acc = f2bf(bf2f(acc) + bf2f(x((k + j) % N)));
  return acc;
}

// Polls ncclCommGetAsyncError as comm.cu's watch does, for at most `seconds`.
ncclResult_t wait_async_error(ncclComm_t c, double seconds) {
  const auto t0 = std::chrono::steady_clock::now();
  ncclResult_t e = ncclSuccess;
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < seconds) {
    REQUIRE(ncclCommGetAsyncError(c, &e) == ncclSuccess);
    if (e != ncclSuccess) return e;
    usleep(10 * 1000);
  }
  return e;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The seeded defects run with a 2 s timeout; every other case with the default.
struct ShortTimeout {
  ShortTimeout() {
    setenv("TS_EMU_NCCL_TIMEOUT", "2", 1);
    emu::clear_report();
  }
  ~ShortTimeout() { unsetenv("TS_EMU_NCCL_TIMEOUT"); }
};

// After a seeded defect: a fresh communicator all-reduces correctly, so the job goes on.
void check_world_still_works() {
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  int* d = to_device(std::vector<int>{world_rank() + 1});
  REQUIRE(ncclAllReduce(d, d, 1, ncclInt32, ncclSum, c, s) == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  const int N = world_size();
  CHECK(to_host(d, 1)[0] == N * (N + 1) / 2);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaFree(d);
  cudaStreamDestroy(s);
}

}  // namespace

TEST_CASE("emulated NCCL: all-reduce of fp32 and int32, sum, max and avg, against the host", "[emu]") {
  const int N = world_size(), me = world_rank();
  const size_t n = 13;  // not a multiple of the ranks: the ring's chunks differ in length
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  std::vector<float> x(n);
  std::vector<int> xi(n);
  for (size_t i = 0; i < n; i++) x[i] = small(me, i), xi[i] = int(small(me, i) * 2) - (me == 0 ? 7 : 0);
  for (ncclRedOp_t op : {ncclSum, ncclMax, ncclAvg}) {
    float* in = to_device(x);
    float* out = to_device(std::vector<float>(n, 0.f));
    int* ii = to_device(xi);  // in place
    REQUIRE(ncclAllReduce(in, out, n, ncclFloat32, op, c, s) == ncclSuccess);
    REQUIRE(ncclAllReduce(ii, ii, n, ncclInt32, op, c, s) == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    std::vector<float> got = to_host(out, n);
    std::vector<int> goti = to_host(ii, n);
    for (size_t i = 0; i < n; i++) {
      float sum = 0, most = -INFINITY;
      long long isum = 0;
      int imost = INT32_MIN;
      for (int r = 0; r < N; r++) {
        sum += small(r, i), most = std::max(most, small(r, i));
        const int v = int(small(r, i) * 2) - (r == 0 ? 7 : 0);
        isum += v, imost = std::max(imost, v);
      }
      const float want = op == ncclSum ? sum : op == ncclMax ? most : sum / N;  // exact: N is a power of two
      const long long wanti = op == ncclSum ? isum : op == ncclMax ? imost : isum / N;  // truncated towards zero
      CHECK(got[i] == want);
      CHECK(goti[i] == wanti);
    }
    CHECK(to_host(in, n) == x);  // out of place leaves the input alone
    cudaFree(in), cudaFree(out), cudaFree(ii);
  }
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: ncclAvg of floats multiplies by 1/n before the sum, as NCCL does", "[emu]") {
  // 3e38 on every rank: summing first overflows to inf, NCCL's PreMulSum does not.
  const int N = world_size();
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  const uint16_t big = f2bf(3e38f);
  float* f = to_device(std::vector<float>{3e38f});
  uint16_t* b = to_device(std::vector<uint16_t>{big});
  REQUIRE(ncclAllReduce(f, f, 1, ncclFloat32, ncclAvg, c, s) == ncclSuccess);
  REQUIRE(ncclAllReduce(b, b, 1, ncclBfloat16, ncclAvg, c, s) == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  float want = 0;
  uint16_t wantb = f2bf(bf2f(big) * (1.f / N));
  for (int r = 0; r < N; r++) want += 3e38f * (1.f / N);
  for (int r = 1; r < N; r++) wantb = f2bf(bf2f(wantb) + bf2f(f2bf(bf2f(big) * (1.f / N))));
  CHECK(std::isfinite(to_host(f, 1)[0]));
  CHECK(to_host(f, 1)[0] == want);
  CHECK(to_host(b, 1)[0] == wantb);
  CHECK(std::isfinite(bf2f(wantb)));
  cudaFree(f), cudaFree(b);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: a bf16 sum rounds at every hop of the ring, to nearest even", "[emu]") {
  const int N = world_size(), me = world_rank();
  const size_t n = 203;
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  // Elements 0 and 1 are ties: 1 + 2^-8 rounds down to 1 (even), 1 + 2^-7 + 2^-8 up to 1 + 2^-6 (a
  // truncating conversion would give 1 + 2^-7). The other ranks add zeros there.
  auto x = [&](int r, size_t i) -> uint16_t {
    if (i == 0) return f2bf(r == 0 ? 1.f : r == 1 ? 1.f / 256 : 0.f);
    if (i == 1) return f2bf(r == 0 ? 1.f + 1.f / 128 : r == 1 ? 1.f / 256 : 0.f);
    return mantissa(r, i);
  };
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; i++) h[i] = x(me, i);
  uint16_t* d = to_device(h);
  REQUIRE(ncclAllReduce(d, d, n, ncclBfloat16, ncclSum, c, s) == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<uint16_t> got = to_host(d, n);
  int differs_from_one_rounding = 0;
  for (size_t i = 0; i < n; i++) {
    const uint16_t want = ring_bf16_sum(N, int(chunk_of(i, n, N)), [&](int r) { return x(r, i); });
    CHECK(got[i] == want);
    double exact = 0;
    for (int r = 0; r < N; r++) exact += bf2f(x(r, i));
    differs_from_one_rounding += want != f2bf(float(exact));
  }
  CHECK(bf2f(got[0]) == 1.f);
  CHECK(bf2f(got[1]) == 1.f + 1.f / 64);
  if (N > 2) CHECK(differs_from_one_rounding > 0);  // the per-hop rounding is visible, not just assumed
  cudaFree(d);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: reduce-scatter, out of place and in place, fp32, bf16 and int32 avg", "[emu]") {
  const int N = world_size(), me = world_rank();
  const size_t rc = 5;  // recvcount: elements per rank
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  std::vector<float> x(N * rc);
  std::vector<uint16_t> xb(N * rc);
  std::vector<int> xi(N * rc);
  for (size_t i = 0; i < N * rc; i++) x[i] = small(me, i), xb[i] = mantissa(me, i), xi[i] = int(i) - 3 * me;
  float* in = to_device(x);
  float* out = to_device(std::vector<float>(rc, 0.f));
  uint16_t* b = to_device(xb);  // in place: the result lands in chunk `me` of the input
  int* ii = to_device(xi);
  REQUIRE(ncclReduceScatter(in, out, rc, ncclFloat32, ncclSum, c, s) == ncclSuccess);
  REQUIRE(ncclReduceScatter(b, b + me * rc, rc, ncclBfloat16, ncclSum, c, s) == ncclSuccess);
  REQUIRE(ncclReduceScatter(ii, ii + me * rc, rc, ncclInt32, ncclAvg, c, s) == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<float> got = to_host(out, rc);
  std::vector<uint16_t> gotb = to_host(b, N * rc);
  std::vector<int> goti = to_host(ii, N * rc);
  for (size_t j = 0; j < rc; j++) {
    const size_t i = me * rc + j;
    float sum = 0;
    long long isum = 0;
    for (int r = 0; r < N; r++) sum += small(r, i), isum += int(i) - 3 * r;
    CHECK(got[j] == sum);
    CHECK(gotb[i] == ring_bf16_sum(N, me, [&](int r) { return mantissa(r, i); }));  // chunk `me` ends here
    CHECK(goti[i] == isum / N);
  }
  cudaFree(in), cudaFree(out), cudaFree(b), cudaFree(ii);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: all-gather and broadcast, out of place and in place", "[emu]") {
  const int N = world_size(), me = world_rank();
  const size_t sc = 7;
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  std::vector<uint8_t> mine(sc);
  for (size_t j = 0; j < sc; j++) mine[j] = uint8_t(me * 31 + j);
  uint8_t* in = to_device(mine);
  uint8_t* out = to_device(std::vector<uint8_t>(N * sc, 0));
  std::vector<float> whole(N * sc, NAN);  // in place: this rank's chunk already in place, the rest NaN
  for (size_t j = 0; j < sc; j++) whole[me * sc + j] = small(me, j);
  float* f = to_device(whole);
  std::vector<float> root_data(9);
  for (size_t j = 0; j < 9; j++) root_data[j] = me == N - 1 ? small(99, j) : NAN;
  float* bsrc = to_device(root_data);
  float* bdst = to_device(std::vector<float>(9, 0.f));
  float* binplace = to_device(root_data);
  REQUIRE(ncclAllGather(in, out, sc, ncclUint8, c, s) == ncclSuccess);
  REQUIRE(ncclAllGather(f + me * sc, f, sc, ncclFloat32, c, s) == ncclSuccess);
  REQUIRE(ncclBroadcast(me == N - 1 ? bsrc : nullptr, bdst, 9, ncclFloat32, N - 1, c, s) == ncclSuccess);
  REQUIRE(ncclBroadcast(binplace, binplace, 9, ncclFloat32, N - 1, c, s) == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  std::vector<uint8_t> got = to_host(out, N * sc);
  std::vector<float> gotf = to_host(f, N * sc);
  for (int r = 0; r < N; r++)
    for (size_t j = 0; j < sc; j++) {
      CHECK(got[r * sc + j] == uint8_t(r * 31 + j));
      CHECK(gotf[r * sc + j] == small(r, j));
    }
  for (size_t j = 0; j < 9; j++) {
    CHECK(to_host(bdst, 9)[j] == small(99, j));
    CHECK(to_host(binplace, 9)[j] == small(99, j));
  }
  cudaFree(in), cudaFree(out), cudaFree(f), cudaFree(bsrc), cudaFree(bdst), cudaFree(binplace);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: host memory and out-of-range ranks are refused and named", "[emu]") {
  emu::clear_report();
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  std::vector<float> host(4, 1.f);
  float* d = to_device(host);
  CHECK(ncclAllReduce(host.data(), d, 4, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument);
  CHECK(has(emu::last_report(), "ncclAllReduce: sendbuff"));
  CHECK(has(emu::last_report(), "is not device memory"));
  CHECK(ncclSend(d, 4, ncclFloat32, world_size(), c, s) == ncclInvalidArgument);
  CHECK(has(emu::last_report(), "ncclSend: peer " + std::to_string(world_size()) + " is not a rank of"));
  CHECK(ncclAllReduce(d, d + 1, 2, ncclFloat32, ncclSum, c, s) == ncclInvalidArgument);  // partial overlap
  CHECK(has(emu::last_report(), "In-place"));
  ncclResult_t e = ncclInternalError;
  CHECK(ncclCommGetAsyncError(c, &e) == ncclSuccess);
  CHECK(e == ncclSuccess);  // refused calls have no effect on the communicator
  cudaFree(d);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: ncclCommSplit with colours, keys and NCCL_SPLIT_NOCOLOR", "[emu]") {
  // Colour: parity of the rank, except the last rank, which takes no part; key: -rank, so the new
  // ranks run in descending world rank.
  const int N = world_size(), me = world_rank();
  ncclComm_t w = world_comm();
  cudaStream_t s = new_stream();
  ncclComm_t sub = reinterpret_cast<ncclComm_t>(&sub);  // must be overwritten, with NULL for NOCOLOR
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  const int colour = me == N - 1 ? NCCL_SPLIT_NOCOLOR : me % 2;
  REQUIRE(ncclCommSplit(w, colour, -me, &sub, me % 2 ? &config : nullptr) == ncclSuccess);
  if (colour == NCCL_SPLIT_NOCOLOR) {
    CHECK(sub == nullptr);
  } else {
    REQUIRE(sub != nullptr);
    std::vector<int> members;
    for (int r = N - 2; r >= 0; r--)
      if (r % 2 == colour) members.push_back(r);
    int* mine = to_device(std::vector<int>{me});
    int* all = to_device(std::vector<int>(members.size(), -1));
    REQUIRE(ncclAllGather(mine, all, 1, ncclInt32, sub, s) == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(to_host(all, members.size()) == members);
    cudaFree(mine), cudaFree(all);
    CHECK(ncclCommDestroy(sub) == ncclSuccess);
  }
  CHECK(ncclCommDestroy(w) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: messages without tags arrive in issue order; a grouped ring completes", "[emu]") {
  const int N = world_size(), me = world_rank();
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  const int partner = me ^ 1;  // pairs 0-1, 2-3
  std::vector<float> a(8, 1.f + me), b(8, 100.f + me);
  float *da = to_device(a), *db = to_device(b);
  float *x = to_device(std::vector<float>(8, 0.f)), *y = to_device(std::vector<float>(8, 0.f));
  for (bool grouped : {false, true}) {
    if (grouped) REQUIRE(ncclGroupStart() == ncclSuccess);
    if (me % 2 == 0) {  // two sends of the same size to one peer ...
      REQUIRE(ncclSend(da, 8, ncclFloat32, partner, c, s) == ncclSuccess);
      REQUIRE(ncclSend(db, 8, ncclFloat32, partner, c, s) == ncclSuccess);
    } else {  // ... received in the order they were issued
      REQUIRE(ncclRecv(x, 8, ncclFloat32, partner, c, s) == ncclSuccess);
      REQUIRE(ncclRecv(y, 8, ncclFloat32, partner, c, s) == ncclSuccess);
    }
    if (grouped) REQUIRE(ncclGroupEnd() == ncclSuccess);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    if (me % 2 == 1) {
      CHECK(to_host(x, 8) == std::vector<float>(8, 1.f + partner));
      CHECK(to_host(y, 8) == std::vector<float>(8, 100.f + partner));
    }
  }
  // Every rank sends to the next and receives from the previous: ungrouped, every rank would wait
  // in its send (the seeded case below); grouped, the operations progress together.
  float* ring = to_device(std::vector<float>(8, -1.f));
  REQUIRE(ncclGroupStart() == ncclSuccess);
  REQUIRE(ncclSend(da, 8, ncclFloat32, (me + 1) % N, c, s) == ncclSuccess);
  REQUIRE(ncclRecv(ring, 8, ncclFloat32, (me + N - 1) % N, c, s) == ncclSuccess);
  REQUIRE(ncclGroupEnd() == ncclSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
  CHECK(to_host(ring, 8) == std::vector<float>(8, 1.f + (me + N - 1) % N));
  cudaFree(da), cudaFree(db), cudaFree(x), cudaFree(y), cudaFree(ring);
  CHECK(ncclCommDestroy(c) == ncclSuccess);
  cudaStreamDestroy(s);
}

TEST_CASE("emulated NCCL: seeded, a send whose receive is never posted is named, and abort releases it", "[emu]") {
  ShortTimeout short_timeout;
  const int N = world_size(), me = world_rank();
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  float* d = to_device(std::vector<float>(4, 1.f));
  if (me == 0) REQUIRE(ncclSend(d, 4, ncclFloat32, 1, c, s) == ncclSuccess);  // rank 1 never receives
  if (me == 0) {
    CHECK(wait_async_error(c, 30) == ncclRemoteError);
    const std::string r = emu::last_report();
    CHECK(has(r, "ncclSend (4 x float32) to peer 1 on communicator"));
    CHECK(has(r, "(" + std::to_string(N) + " ranks, this rank 0) waited 2 s for its receive"));
    CHECK(has(r, "a send whose receive is never posted"));
    CHECK(cudaStreamQuery(s) == cudaErrorNotReady);  // still waiting, as a stuck NCCL kernel does
  } else {
    ncclResult_t e = ncclInternalError;
    CHECK(ncclCommGetAsyncError(c, &e) == ncclSuccess);
    CHECK(e == ncclSuccess);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(ncclCommAbort(c) == ncclSuccess);  // on every rank, as NCCL's user guide asks
  CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  cudaFree(d);
  cudaStreamDestroy(s);
  check_world_still_works();
}

TEST_CASE("emulated NCCL: seeded, a receive of another count than its send is named", "[emu]") {
  // NCCL requires the same count and datatype on both sides; on the hardware the receiver of 8
  // floats waits forever for the 4 it will never get. The emulator names it at once.
  ShortTimeout short_timeout;
  const int me = world_rank();
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  float* d = to_device(std::vector<float>(8, 1.f));
  if (me == 0) REQUIRE(ncclSend(d, 4, ncclFloat32, 1, c, s) == ncclSuccess);
  if (me == 1) REQUIRE(ncclRecv(d, 8, ncclFloat32, 0, c, s) == ncclSuccess);
  if (me == 1) {
    CHECK(wait_async_error(c, 30) == ncclInvalidUsage);
    CHECK(has(emu::last_report(), "ncclRecv (8 x float32) from peer 0 on communicator"));
    CHECK(has(emu::last_report(), "peer 0 sent 16 bytes where 32 were expected"));
    CHECK(cudaStreamQuery(s) == cudaErrorNotReady);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(ncclCommAbort(c) == ncclSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  cudaFree(d);
  cudaStreamDestroy(s);
  check_world_still_works();
}

TEST_CASE("emulated NCCL: seeded, an ungrouped send/send exchange deadlocks as on the hardware", "[emu]") {
  ShortTimeout short_timeout;
  const int me = world_rank(), partner = me ^ 1;
  ncclComm_t c = world_comm();
  cudaStream_t s = new_stream();
  float *out = to_device(std::vector<float>(4, 1.f)), *in = to_device(std::vector<float>(4, 0.f));
  REQUIRE(ncclSend(out, 4, ncclFloat32, partner, c, s) == ncclSuccess);  // both partners send first
  REQUIRE(ncclRecv(in, 4, ncclFloat32, partner, c, s) == ncclSuccess);
  CHECK(wait_async_error(c, 30) == ncclRemoteError);
  const std::string r = emu::last_report();
  CHECK(has(r, "ncclSend (4 x float32) to peer " + std::to_string(partner)));
  CHECK(has(r, "waited 2 s for its receive"));
  CHECK(has(r, "1 later NCCL operation on this GPU waits behind it, the next: ncclRecv (4 x float32) from peer " +
                   std::to_string(partner)));
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(ncclCommAbort(c) == ncclSuccess);
  CHECK(cudaStreamSynchronize(s) == cudaSuccess);
  cudaFree(out), cudaFree(in);
  cudaStreamDestroy(s);
  check_world_still_works();
}

TEST_CASE("emulated NCCL: seeded, two communicators' all-reduces launched in opposite orders deadlock", "[emu]") {
  // Even ranks launch on A then B, odd ranks on B then A, each communicator on its own stream as
  // comm.cu does. NCCL runs a GPU's operations one at a time in launch order, so each rank's first
  // all-reduce waits for ranks that are themselves waiting in the other one.
  ShortTimeout short_timeout;
  const int me = world_rank();
  ncclComm_t A = world_comm(), B = world_comm();
  cudaStream_t sa = new_stream(), sb = new_stream();
  float *da = to_device(std::vector<float>(6, 1.f)), *db = to_device(std::vector<float>(6, 2.f));
  ncclComm_t first = me % 2 == 0 ? A : B;
  for (ncclComm_t c : {first, first == A ? B : A})
    REQUIRE(ncclAllReduce(c == A ? da : db, c == A ? da : db, 6, ncclFloat32, ncclSum, c, c == A ? sa : sb) ==
            ncclSuccess);
  CHECK(wait_async_error(first, 30) == ncclRemoteError);
  const std::string r = emu::last_report();
  CHECK(has(r, "ncclAllReduce (6 x float32, sum) on communicator"));
  CHECK(has(r, "waited 2 s at step 1 of"));
  CHECK(has(r, "ranks issuing NCCL operations on different communicators in different orders"));
  CHECK(has(r, "1 later NCCL operation on this GPU waits behind it, the next: ncclAllReduce (6 x float32, sum)"));
  MPI_Barrier(MPI_COMM_WORLD);
  CHECK(ncclCommAbort(A) == ncclSuccess);
  CHECK(ncclCommAbort(B) == ncclSuccess);
  CHECK(cudaStreamSynchronize(sa) == cudaSuccess);
  CHECK(cudaStreamSynchronize(sb) == cudaSuccess);
  cudaFree(da), cudaFree(db);
  cudaStreamDestroy(sa), cudaStreamDestroy(sb);
  check_world_still_works();
}

#endif  // TS_CUDA_EMU
