// ranks: 1 2 4 8
// shared GPU: 2 4
// Every collective on every group of several meshes per world size, fp32 and bf16, in place and
// out of place, blocking and async, against values each rank computes locally; and the byte
// accounting against the ring formulas.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>

#include "comm/algorithms.h"
#include "comm/comm.h"
#include "tensor/device.h"
#include "comm/watchdog.h"
#include "comm/mesh.h"

using namespace ts;

static int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Meshes whose degrees multiply to the world size, together using every axis that fits.
static std::vector<MeshConfig> meshes_for(int w) {
  //       dp pp cp tp ep
  if (w == 1) return {{1, 1, 1, 1, 1}};
  if (w == 2) return {{2, 1, 1, 1, 2}, {1, 2, 1, 1, 1}, {1, 1, 2, 1, 2}, {1, 1, 1, 2, 1}};
  if (w == 4) return {{1, 2, 1, 2, 1}, {2, 1, 2, 1, 2}, {4, 1, 1, 1, 4}, {1, 1, 2, 2, 1}};
  if (w == 8) return {{2, 1, 2, 2, 2}, {2, 2, 1, 2, 2}, {1, 2, 2, 2, 2}, {8, 1, 1, 1, 4}};
  FAIL("no meshes written for world size " << w);
  return {};
}

// Element i of group rank r: small integers, so sums of up to 8 ranks and their averages over a
// power of two are exact in fp32 and bf16 and the expected values do not depend on the order.
static float f(int r, int64_t i) { return float((r * 5 + i * 3) % 13 - 6); }
// Chunk element k that rank src sends to rank dst in an all-to-all.
static float g(int src, int dst, int64_t k) { return float((src * 7 + dst * 3 + k) % 11 - 5); }
// The device the collective checks put their tensors on (the CUDA run repeats them on the GPU).
static Device g_dev = Device::CPU;

static float round_to(DType dt, float x) { return dt == DType::BF16 ? bf16_to_float(float_to_bf16(x)) : x; }

static Tensor filled(DType dt, int64_t n, const std::function<float(int64_t)>& v) {
  std::vector<float> h(n);
  for (int64_t i = 0; i < n; i++) h[i] = v(i);
  Tensor t = Tensor::empty({n}, dt, g_dev, Tag::Workspace);
  from_host_f32(t, h.data());
  return t;
}
static std::vector<float> expect(int64_t n, const std::function<float(int64_t)>& v) {
  std::vector<float> h(n);
  for (int64_t i = 0; i < n; i++) h[i] = v(i);
  return h;
}

static float reduce_expected(int N, DType dt, ReduceOp op, const std::function<float(int)>& x) {
  float s = 0, m = -INFINITY;
  for (int q = 0; q < N; q++) s += x(q), m = std::max(m, x(q));
  if (op == ReduceOp::Max) return m;
  return op == ReduceOp::Sum ? s : round_to(dt, s * (1.f / N));
}

static void check_all_reduce(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  for (int64_t n : {1, 7, 1001})
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      INFO("all_reduce n=" << n << " op=" << int(op));
      auto want = expect(n, [&](int64_t i) { return reduce_expected(N, dt, op, [&](int q) { return f(q, i); }); });
      Tensor t = filled(dt, n, [&](int64_t i) { return f(r, i); });
      c.all_reduce(t, op);
      CHECK(to_host_f32(t) == want);
      Tensor in = filled(dt, n, [&](int64_t i) { return f(r, i); });
      Tensor out = Tensor::zeros({n}, dt, g_dev, Tag::Workspace);
      c.all_reduce(out, in, op);
      CHECK(to_host_f32(out) == want);
      CHECK(to_host_f32(in) == expect(n, [&](int64_t i) { return f(r, i); }));
    }
}

static void check_reduce_scatter(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  for (int64_t m : {1, 5})
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      INFO("reduce_scatter m=" << m << " op=" << int(op));
      auto want = expect(m, [&](int64_t k) { return reduce_expected(N, dt, op, [&](int q) { return f(q, r * m + k); }); });
      Tensor in = filled(dt, N * m, [&](int64_t i) { return f(r, i); });
      Tensor out = Tensor::zeros({m}, dt, g_dev, Tag::Workspace);
      c.reduce_scatter(out, in, op);
      CHECK(to_host_f32(out) == want);
      Tensor chunk = in.view(r * m, {m});  // in place: the result lands in this rank's own chunk
      c.reduce_scatter(chunk, in, op);
      CHECK(to_host_f32(chunk) == want);
    }
}

static void check_all_gather(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  for (int64_t m : {1, 5}) {
    INFO("all_gather m=" << m);
    auto want = expect(N * m, [&](int64_t i) { return f(int(i / m), i % m); });
    Tensor in = filled(dt, m, [&](int64_t k) { return f(r, k); });
    Tensor out = Tensor::zeros({N * m}, dt, g_dev, Tag::Workspace);
    c.all_gather(out, in);
    CHECK(to_host_f32(out) == want);
    Tensor whole = Tensor::zeros({N * m}, dt, g_dev, Tag::Workspace);
    Tensor mine = whole.view(r * m, {m});  // in place: this rank's chunk already sits in out
    copy(mine, in);
    c.all_gather(whole, mine);
    CHECK(to_host_f32(whole) == want);
  }
}

static void check_broadcast_and_p2p(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  const int64_t n = 9;
  for (int root : {0, N - 1}) {
    INFO("broadcast root=" << root);
    Tensor t = filled(dt, n, [&](int64_t i) { return f(r, i); });
    c.broadcast(t, root);
    CHECK(to_host_f32(t) == expect(n, [&](int64_t i) { return f(root, i); }));
  }
  {
    INFO("send_recv ring");
    int next = (r + 1) % N, prev = (r - 1 + N) % N;
    Tensor s = filled(dt, n, [&](int64_t i) { return f(r, i); });
    Tensor got = Tensor::zeros({n}, dt, g_dev, Tag::Workspace);
    c.send_recv(s, next, got, prev, 5);
    CHECK(to_host_f32(got) == expect(n, [&](int64_t i) { return f(prev, i); }));
  }
  if (N >= 2 && !(N % 2 == 1 && r == N - 1)) {
    INFO("send / recv pairs");
    Tensor t = filled(dt, n, [&](int64_t i) { return f(r, i); });
    if (r % 2 == 0) {
      c.send(t, r + 1, 3);
    } else {
      c.recv(t, r - 1, 3);
      CHECK(to_host_f32(t) == expect(n, [&](int64_t i) { return f(r - 1, i); }));
    }
  }
}

static void check_all_to_all(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  {
    INFO("all_to_all");
    const int64_t m = 3;
    Tensor in = filled(dt, N * m, [&](int64_t i) { return g(r, int(i / m), i % m); });
    Tensor out = Tensor::zeros({N * m}, dt, g_dev, Tag::Workspace);
    c.all_to_all(out, in);
    CHECK(to_host_f32(out) == expect(N * m, [&](int64_t i) { return g(int(i / m), r, i % m); }));
  }
  {
    INFO("all_to_all_v with uneven and zero counts");
    auto count = [&](int src, int dst) { return int64_t((src + 2 * dst) % 3); };  // 0, 1 or 2
    std::vector<int64_t> sc(N), rc(N);
    std::vector<float> in_h, want;
    for (int p = 0; p < N; p++) {
      sc[p] = count(r, p), rc[p] = count(p, r);
      for (int64_t k = 0; k < sc[p]; k++) in_h.push_back(g(r, p, k));
      for (int64_t k = 0; k < rc[p]; k++) want.push_back(g(p, r, k));
    }
    const int64_t spare = 2;  // buffers sized for capacity, as MoE dispatch allocates them
    Tensor in = filled(dt, int64_t(in_h.size()) + spare, [&](int64_t i) { return i < int64_t(in_h.size()) ? in_h[i] : 99.f; });
    Tensor out = filled(dt, int64_t(want.size()) + spare, [](int64_t) { return -1.f; });
    c.all_to_all_v(out, rc, in, sc);
    std::vector<float> got = to_host_f32(out);
    CHECK(std::vector<float>(got.begin(), got.begin() + want.size()) == want);
    CHECK(got.back() == -1.f);
  }
}

// Several async ops in flight at once on one group, completed in reverse order and by polling.
static void check_async(Comm& c, DType dt) {
  const int r = c.rank(), N = c.size();
  const int64_t n = 7, m = 3;
  int next = (r + 1) % N, prev = (r - 1 + N) % N;
  Tensor ar = filled(dt, n, [&](int64_t i) { return f(r, i); });
  Tensor ag_in = filled(dt, m, [&](int64_t k) { return f(r, k); });
  Tensor ag_out = Tensor::zeros({N * m}, dt, g_dev, Tag::Workspace);
  Tensor rs_in = filled(dt, N * m, [&](int64_t i) { return f(r, i); });
  Tensor rs_out = Tensor::zeros({m}, dt, g_dev, Tag::Workspace);
  Tensor bc = filled(dt, n, [&](int64_t i) { return f(r, i); });
  Tensor s = filled(dt, n, [&](int64_t i) { return f(r, i); });
  Tensor got = Tensor::zeros({n}, dt, g_dev, Tag::Workspace);
  Tensor a2a_in = filled(dt, N * m, [&](int64_t i) { return g(r, int(i / m), i % m); });
  Tensor a2a_out = Tensor::zeros({N * m}, dt, g_dev, Tag::Workspace);

  Work w1 = c.all_reduce_async(ar, ReduceOp::Sum);
  Work w2 = c.all_gather_async(ag_out, ag_in);
  Work w3 = c.reduce_scatter_async(rs_out, rs_in, ReduceOp::Avg);
  Work w4 = c.broadcast_async(bc, N - 1);
  Work w5 = c.send_recv_async(s, next, got, prev, 11);
  Work w6 = c.all_to_all_async(a2a_out, a2a_in);
  w6.wait();
  w5.wait();
  Work moved = std::move(w4);
  moved.wait();
  w4.wait();  // moved-from: nothing to wait for
  w3.wait();
  w2.wait();
  while (!w1.done()) {
  }
  w1.wait();  // waiting twice is fine

  CHECK(to_host_f32(ar) == expect(n, [&](int64_t i) { return reduce_expected(N, dt, ReduceOp::Sum, [&](int q) { return f(q, i); }); }));
  CHECK(to_host_f32(ag_out) == expect(N * m, [&](int64_t i) { return f(int(i / m), i % m); }));
  CHECK(to_host_f32(rs_out) ==
        expect(m, [&](int64_t k) { return reduce_expected(N, dt, ReduceOp::Avg, [&](int q) { return f(q, r * m + k); }); }));
  CHECK(to_host_f32(bc) == expect(n, [&](int64_t i) { return f(N - 1, i); }));
  CHECK(to_host_f32(got) == expect(n, [&](int64_t i) { return f(prev, i); }));
  CHECK(to_host_f32(a2a_out) == expect(N * m, [&](int64_t i) { return g(int(i / m), r, i % m); }));

  Tensor t = filled(dt, n, [&](int64_t i) { return f(r, i); });
  { Work w = c.all_reduce_async(t, ReduceOp::Max); }  // the destructor waits
  CHECK(to_host_f32(t) == expect(n, [&](int64_t i) { return reduce_expected(N, dt, ReduceOp::Max, [&](int q) { return f(q, i); }); }));
  c.barrier();
}

static void run_every_collective(Device dev, size_t max_meshes = 8) {
  g_dev = dev;
  const std::vector<MeshConfig> meshes = meshes_for(world_size());
  for (size_t m = 0; m < std::min(meshes.size(), max_meshes); m++) {
    const MeshConfig& cfg = meshes[m];
    Mesh mesh = make_mesh(cfg, dev);
    for (int a = 0; a < kNumAxes; a++) {
      Comm& c = mesh.group(Axis(a));
      for (DType dt : {DType::F32, DType::BF16}) {
        INFO("mesh dp" << cfg.dp << " pp" << cfg.pp << " cp" << cfg.cp << " tp" << cfg.tp << " ep" << cfg.ep
                       << ", group " << c.name() << " (" << c.size() << " ranks, " << c.transport(dev) << "), "
                       << dtype_name(dt));
        check_all_reduce(c, dt);
        check_reduce_scatter(c, dt);
        check_all_gather(c, dt);
        check_broadcast_and_p2p(c, dt);
        check_all_to_all(c, dt);
        check_async(c, dt);
      }
    }
  }
  g_dev = Device::CPU;
}

TEST_CASE("every collective on every group of every mesh, fp32 and bf16") { run_every_collective(Device::CPU); }

// With a GPU: NCCL when every rank owns one, else MPI staged through host memory (TS_NCCL=0
// forces the staged path).
TEST_CASE("every collective on CUDA tensors", "[cuda]") {
  if (!cuda_available()) {
    WARN("no GPU visible: the CUDA transports were not exercised");
    return;
  }
  run_every_collective(Device::CUDA);
}

// The same checks with each collective written out (--collectives; test_collectives.cpp checks their
// orders): on these small integers every order sums exactly, so each equals the library bit for bit,
// in place and out of place, blocking and async, on every group of the first mesh (the others take
// minutes more on two cores; the first holds the world group and smaller ones).
TEST_CASE("every collective written out (ring, tree, halving-doubling, two-level) on every group") {
  for (const char* a : {"ring", "tree", "halving-doubling", "two-level"}) {
    INFO("--collectives " << a);
    set_collectives(a);
    run_every_collective(Device::CPU, 1);  // the GPU's: test_collectives.cpp, against the CPU's bits
  }
  set_collectives("library");
}

TEST_CASE("int32 reductions and gathers on the world group") {
  Mesh mesh = make_mesh({world_size(), 1, 1, 1, 1}, Device::CPU);
  Comm& c = mesh.world_comm();
  const int r = c.rank(), N = c.size();
  Tensor t = filled(DType::I32, 5, [&](int64_t i) { return float(r * 100 + i); });
  c.all_reduce(t, ReduceOp::Sum);
  CHECK(to_host_f32(t) == expect(5, [&](int64_t i) { return float(100 * N * (N - 1) / 2 + N * i); }));
  Tensor mx = filled(DType::I32, 5, [&](int64_t i) { return float(r * 100 + i); });
  c.all_reduce(mx, ReduceOp::Max);
  CHECK(to_host_f32(mx) == expect(5, [&](int64_t i) { return float((N - 1) * 100 + i); }));
  Tensor one = filled(DType::I32, 1, [&](int64_t) { return float(r); });
  Tensor all = Tensor::zeros({N}, DType::I32, Device::CPU, Tag::Workspace);
  c.all_gather(all, one);
  CHECK(to_host_f32(all) == expect(N, [](int64_t i) { return float(i); }));
}

TEST_CASE("bf16 sums in fp32 and rounds each result to nearest even") {
  const float tiny = 3.f / 256;  // 1.5 bf16 ulps of 1.0: 1 + 1.5 ulp is a tie, rounded to even 1 + 2 ulp
  bf16 a[2] = {float_to_bf16(1.f), float_to_bf16(1.f)};
  bf16 b[2] = {float_to_bf16(tiny), float_to_bf16(1.f / 256)};
  bf16_sum_into(a, b, 2);
  CHECK(bf16_to_float(a[0]) == 1.f + 1.f / 64);
  CHECK(bf16_to_float(a[1]) == 1.f);  // 1 + 0.5 ulp: the tie goes to the even 1.0
  Mesh mesh = make_mesh({world_size(), 1, 1, 1, 1}, Device::CPU);
  Comm& c = mesh.world_comm();
  if (c.size() >= 2) {
    Tensor t = filled(DType::BF16, 1, [&](int64_t) { return c.rank() == 0 ? 1.f : c.rank() == 1 ? tiny : 0.f; });
    c.all_reduce(t);
    CHECK(to_host_f32(t)[0] == 1.f + 1.f / 64);
  }
}

// Per op: calls, payload (what the caller passed) and wire bytes (what this rank sends under the
// ring algorithms): all-reduce 2(N-1)/N K, reduce-scatter and all-gather (N-1)/N K, broadcast K
// except for the last rank of the pipeline, send K, recv 0, all-to-all (N-1)/N K.
TEST_CASE("byte accounting equals the ring formulas for each op and group size") {
  for (const MeshConfig& cfg : meshes_for(world_size())) {
    Mesh mesh = make_mesh(cfg, Device::CPU);
    for (int a = 0; a < kNumAxes; a++) {
      Comm& c = mesh.group(Axis(a));
      const int r = c.rank(), N = c.size();
      const int64_t n = 6 * N;
      const double K = 4.0 * n;  // fp32
      INFO("group " << c.name() << " of " << N);
      Tensor x = Tensor::zeros({n}, DType::F32, Device::CPU, Tag::Workspace);
      Tensor y = Tensor::zeros({n}, DType::F32, Device::CPU, Tag::Workspace);
      Tensor part = Tensor::zeros({n / N}, DType::F32, Device::CPU, Tag::Workspace);
      c.reset_stats();
      c.all_reduce(x);
      c.all_reduce_async(x).wait();
      c.reduce_scatter(part, x);
      c.all_gather(x, part);
      c.broadcast(x, 0);
      c.send_recv(x, (r + 1) % N, y, (r + N - 1) % N);
      c.all_to_all(y, x);
      c.barrier();
      auto& s = c.stats();
      auto is = [&](const char* op, long calls, double payload, double wire) {
        INFO(op);
        REQUIRE(s.count(op) == 1);
        CHECK(s.at(op).calls == calls);
        CHECK(s.at(op).payload_bytes == Approx(payload));
        CHECK(s.at(op).wire_bytes == Approx(wire).margin(1e-9));
      };
      double ring = double(N - 1) / N;
      is("all_reduce", 2, 2 * K, 2 * 2 * ring * K);
      is("reduce_scatter", 1, K, ring * K);
      is("all_gather", 1, K, ring * K);
      is("broadcast", 1, K, r == N - 1 ? 0 : K);
      is("send", 1, K, N == 1 ? 0 : K);
      is("recv", 1, K, 0);
      is("all_to_all", 1, K, ring * K);
      is("barrier", 1, 0, 0);
      CHECK(s.size() == 8);
      c.reset_stats();
      CHECK(c.stats().empty());
    }
  }
}
