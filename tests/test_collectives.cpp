// ranks: 1 2 3 4 6 8
// shared GPU: 4
// The collectives written out (common/comm/algorithms.h, --collectives) against the library's:
//  * all-gather and broadcast move bits, so every algorithm equals the library bit for bit;
//  * all-reduce and reduce-scatter sum in another order than MPI's or NCCL's, so they agree by the
//    fp32 criterion for a reordered sum of N terms, |a − b| ≤ 2(N−1)·u·Σ_q|x_q| (each order is
//    within (N−1)·u·Σ|x| of the exact sum; u = 2^-24, bf16 2^-8), and bit for bit with the order
//    each algorithm states: the ring's ((x_{c+1} + x_{c+2}) + …) + x_c for part c, halving-doubling's
//    tree of pairs at distance N/2, N/4, …, 1 (computed here independently);
//  * every rank of an all-reduce holds the same bits (each part is summed on one rank);
//  * the fall-backs: halving-doubling on 3 and 6 ranks, and the tree's reduce-scatter, equal the
//    ring bit for bit;
//  * on the emulated GPU (NCCL send/recv on the group's stream), each algorithm equals itself on the
//    CPU bit for bit (the same sums in the same order).
// The same in-process checks on two simulated nodes (MPICH's MPIR_CVAR_NUM_CLIQUES=2), where
// two-level runs its hierarchy; and 02 and 08 with each algorithm reproduce 01 (test_util.h's
// criterion), on the CPU and on the emulated GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>

#include "comm/algorithms.h"
#include "comm/mesh.h"
#include "tensor/device.h"
#include "test_util.h"

using namespace ts;

namespace {

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

const char* const kAlgorithms[] = {"ring", "tree", "halving-doubling", "two-level"};

// Rank q's element i: fractions whose sums round (unlike test_comm's small integers), so the order
// of every sum shows in its bits.
float x(int q, int64_t i, DType dt) {
  uint32_t h = uint32_t(q + 1) * 2654435761u ^ uint32_t(i + 7) * 40503u;
  h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
  const float v = float(int(h % 20001) - 10000) / 3001.f;
  return dt == DType::BF16 ? bf16_to_float(float_to_bf16(v)) : v;
}

Tensor filled(DType dt, Device dev, int64_t n, const std::function<float(int64_t)>& v) {
  std::vector<float> h(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i++) h[size_t(i)] = v(i);
  Tensor t = Tensor::empty({n}, dt, dev, Tag::Workspace);
  from_host_f32(t, h.data());
  return t;
}

struct Call {
  CollectiveOp op;
  int64_t n;  // all-reduce and broadcast: the tensor; reduce-scatter and all-gather: one chunk
  ReduceOp r = ReduceOp::Sum;
  int root = 0;
};

// This rank's result of `call` under `algo`: element i of the result is element i of the whole
// (all-reduce, all-gather, broadcast) or of chunk rank (reduce-scatter).
std::vector<float> run(Comm& c, const char* algo, const Call& k, DType dt, Device dev) {
  set_collectives(algo);
  const int N = c.size(), r = c.rank();
  std::vector<float> got;
  if (k.op == CollectiveOp::AllReduce || k.op == CollectiveOp::Broadcast) {
    Tensor t = filled(dt, dev, k.n, [&](int64_t i) { return x(r, i, dt); });
    if (k.op == CollectiveOp::AllReduce) c.all_reduce(t, k.r);
    else c.broadcast(t, k.root);
    got = to_host_f32(t);
  } else if (k.op == CollectiveOp::ReduceScatter) {
    Tensor in = filled(dt, dev, k.n * N, [&](int64_t i) { return x(r, i, dt); });
    Tensor out = Tensor::empty({k.n}, dt, dev, Tag::Workspace);
    c.reduce_scatter(out, in, k.r);
    got = to_host_f32(out);
  } else {
    Tensor in = filled(dt, dev, k.n, [&](int64_t i) { return x(r, i, dt); });
    Tensor out = Tensor::empty({k.n * N}, dt, dev, Tag::Workspace);
    c.all_gather(out, in);
    got = to_host_f32(out);
  }
  set_collectives("library");
  return got;
}

// The ring's order for element i of part p (of P = N parts): starting at rank p+1.
float ring_sum(int N, int p, int64_t i) {
  float s = x((p + 1) % N, i, DType::F32);
  for (int k = 2; k <= N; k++) s = s + x((p + k) % N, i, DType::F32);
  return s;
}
// Halving-doubling's order for part p: w_d(q) = w_2d(q) + w_2d(q XOR d), w_N(q) = x_q, result w_1(p).
float halving_sum(int N, int d, int q, int64_t i) {
  if (d == N) return x(q, i, DType::F32);
  return halving_sum(N, 2 * d, q, i) + halving_sum(N, 2 * d, q ^ d, i);
}
int part_of(int64_t n, int P, int64_t i) {
  int p = 0;
  while (n * (p + 1) / P <= i) p++;
  return p;
}

// Rank 0's result, on every rank.
std::vector<float> rank0s(Comm& c, std::vector<float> v) {
  MPI_Bcast(v.data(), int(v.size()), MPI_FLOAT, 0, c.mpi());
  return v;
}

void check_against_library(Comm& c, const char* algo, const Call& k, DType dt) {
  const int N = c.size(), r = c.rank();
  const bool reduces = k.op == CollectiveOp::AllReduce || k.op == CollectiveOp::ReduceScatter;
  const std::vector<float> lib = run(c, "library", k, dt, Device::CPU), got = run(c, algo, k, dt, Device::CPU);
  REQUIRE(got.size() == lib.size());
  if (!reduces) {
    CHECK(got == lib);
    return;
  }
  const double u = dt == DType::BF16 ? 1.0 / 256 : 5.9604644775390625e-8, scale = k.r == ReduceOp::Avg ? 1.0 / N : 1.0;
  int bad = 0;
  for (size_t e = 0; e < got.size(); e++) {
    const int64_t i = k.op == CollectiveOp::ReduceScatter ? int64_t(r) * k.n + int64_t(e) : int64_t(e);
    double abs_sum = 0;
    for (int q = 0; q < N; q++) abs_sum += std::fabs(x(q, i, dt));
    if (std::fabs(double(got[e]) - lib[e]) > 2 * (N - 1) * u * abs_sum * scale * 1.0001) bad++;
  }
  CHECK(bad == 0);
  if (k.op == CollectiveOp::AllReduce) CHECK(rank0s(c, got) == got);
  // The stated order, bit for bit (fp32 sums; the all-reduce's parts, the reduce-scatter's chunk r).
  const std::string a = algo;
  const bool hd = a == "halving-doubling" && (N & (N - 1)) == 0;
  if (dt != DType::F32 || k.r != ReduceOp::Sum || !(a == "ring" || hd || (a == "tree" && k.op == CollectiveOp::ReduceScatter)))
    return;
  int off = 0;
  for (size_t e = 0; e < got.size(); e++) {
    const bool rs = k.op == CollectiveOp::ReduceScatter;
    const int64_t i = rs ? int64_t(r) * k.n + int64_t(e) : int64_t(e);
    const int p = rs ? r : part_of(k.n, N, i);
    if (got[e] != (hd ? halving_sum(N, 1, p, i) : ring_sum(N, p, i))) off++;
  }
  CHECK(off == 0);
}

std::vector<Call> calls(int N) {
  using O = CollectiveOp;
  // Sizes below N (empty parts), not divisible by N, and a few hundred elements.
  return {{O::AllReduce, 1}, {O::AllReduce, 37}, {O::AllReduce, 600}, {O::AllReduce, 37, ReduceOp::Avg},
          {O::ReduceScatter, 3}, {O::ReduceScatter, 50}, {O::ReduceScatter, 50, ReduceOp::Avg},
          {O::AllGather, 1}, {O::AllGather, 50}, {O::Broadcast, 37, ReduceOp::Sum, 0}, {O::Broadcast, 600, ReduceOp::Sum, N - 1}};
}

}  // namespace

TEST_CASE("each written-out collective reproduces the library's: bits where no sum, fp32 criterion and stated order where sums",
          "[collectives]") {
  Mesh mesh = make_mesh({world_size(), 1, 1, 1, 1}, Device::CPU);
  Comm& c = mesh.world_comm();
  if (c.size() == 1) return;
  // Two simulated nodes (the case below starts this one so): world rank q on node q mod 2, and two-level
  // runs its hierarchy rather than falling back.
  const char* cliques = getenv("MPIR_CVAR_NUM_CLIQUES");
  for (int q = 0; q < c.size(); q++) CHECK(nodes_of(c)[size_t(q)] == (cliques && std::string(cliques) == "2" ? q % 2 : 0));
  // Two-level needs as many ranks on each node: 3 ranks on two nodes (2 + 1) fall back to the ring.
  const bool uneven = cliques && std::string(cliques) == "2" && c.size() % 2;
  CHECK(algorithm_for(c, CollectiveOp::AllReduce, Collectives::TwoLevel) == (uneven ? Collectives::Ring : Collectives::TwoLevel));
  for (const char* algo : kAlgorithms)
    for (DType dt : {DType::F32, DType::BF16})
      for (const Call& k : calls(c.size())) {
        INFO(algo << " " << dtype_name(dt) << " op " << int(k.op) << " n " << k.n << " avg " << (k.r == ReduceOp::Avg));
        check_against_library(c, algo, k, dt);
      }
  // Fall-backs run the ring: halving-doubling off a power of two, the tree's reduce-scatter and
  // all-gather, two-level's reduce-scatter.
  for (const Call& k : calls(c.size())) {
    const std::vector<float> ring = run(c, "ring", k, DType::F32, Device::CPU);
    if (k.op != CollectiveOp::AllReduce && k.op != CollectiveOp::Broadcast) CHECK(run(c, "tree", k, DType::F32, Device::CPU) == ring);
    if (k.op == CollectiveOp::ReduceScatter) CHECK(run(c, "two-level", k, DType::F32, Device::CPU) == ring);
    if ((c.size() & (c.size() - 1)) != 0) CHECK(run(c, "halving-doubling", k, DType::F32, Device::CPU) == ring);
  }
}

TEST_CASE("on the GPU (NCCL send/recv, or staged MPI) each written-out collective equals itself on the CPU, bit for bit",
          "[collectives][cuda]") {
  if (!cuda_available()) {
    WARN("no GPU visible: the written-out collectives on CUDA tensors were not exercised");
    return;
  }
  Mesh cpu_mesh = make_mesh({world_size(), 1, 1, 1, 1}, Device::CPU), gpu_mesh = make_mesh({world_size(), 1, 1, 1, 1}, Device::CUDA);
  Comm &cc = cpu_mesh.world_comm(), &gc = gpu_mesh.world_comm();
  if (cc.size() == 1) return;
  INFO("transport " << gc.transport(Device::CUDA));
  for (const char* algo : kAlgorithms)
    for (DType dt : {DType::F32, DType::BF16})
      for (const Call& k : calls(cc.size())) {
        INFO(algo << " " << dtype_name(dt) << " op " << int(k.op) << " n " << k.n);
        CHECK(run(gc, algo, k, dt, Device::CUDA) == run(cc, algo, k, dt, Device::CPU));
      }
}

// ----- two simulated nodes, and the chapters ----------------------------------------------------------------

namespace {
const std::string kTwoNodes = "MPIR_CVAR_NUM_CLIQUES=2 TS_EMU_GPUS=8";
const std::string kTiny = "--preset tiny --kv-heads 4 --quiet --lr-schedule constant --steps 3 --batch 8 --micro-batch 2 ";
}  // namespace

// The checks above again on 3, 4 and 6 ranks on two simulated nodes (world rank r on node r mod 2):
// at 4, two-level's rings are {0,2}, {1,3} inside the nodes and {0,1}, {2,3} across them; at 3 (two
// ranks on node 0, one on node 1) it falls back to the ring.
TEST_CASE("two simulated nodes: the same checks, two-level over its hierarchy", "[collectives][nodes]") {
  if (world_size() != 1) return;
  for (int np : {3, 4, 6}) {
    const tst::Result r = tst::run(tst::bin_command("tests/test_collectives", "'[collectives]~[nodes]~[chapters]'", np, kTwoNodes), 300);
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(r.output.find("All tests passed") != std::string::npos);
  }
}

TEST_CASE("02 and 08 with each written-out algorithm reproduce 01, on one node and two, CPU and emulated GPU",
          "[collectives][chapters]") {
  if (world_size() != 1) return;
  const tst::CachedRun& ref = tst::cached_run("01_single_gpu", 1, kTiny);
  for (const char* algo : kAlgorithms) {
    const std::string with = std::string(" --collectives ") + algo;
    for (const char* mesh : {"--dp 4", "--dp 2 --tp 2 --zero 3 --prefetch 1"}) {
      const std::string bin = std::string(mesh) == "--dp 4" ? "02_data_parallel" : "08_5d_mesh";
      INFO(bin << " " << mesh << with);
      tst::check_equivalent(tst::cached_run(bin, 4, kTiny + mesh + with), ref);
      tst::check_equivalent(tst::cached_run(bin, 4, kTiny + mesh + with, 180, kTwoNodes), ref);
    }
#ifdef TS_CUDA_EMU
    const tst::CachedRun& gpu = tst::cached_run("02_data_parallel", 4, kTiny + "--dp 4 --device cuda" + with, 300, kTwoNodes);
    INFO("02 on the emulated GPU" << with << "\n" << gpu.output);
    tst::check_equivalent(gpu, ref);
#endif
  }
  tst::check_errors("02_data_parallel", kTiny, {{2, "--dp 2 --collectives rings", "--collectives must be library|ring|tree|"
                                                                                    "halving-doubling|two-level (got 'rings')"}});
}

// bench_comm --algorithms (notes/collectives.md, "The algorithms measured"): a row per algorithm the
// group can run (at 3 ranks halving-doubling falls back to the ring and is left out; two-level on
// one node is timed), α and β split by the formula, and the crossovers of every pair.
TEST_CASE("bench_comm --algorithms times each algorithm, fits its line and prints the crossovers", "[collectives][chapters]") {
  if (world_size() != 1) return;
  const tst::Result r = tst::run_bin("bench/bench_comm", "--device cpu --algorithms --min-bytes 4096 --max-bytes 65536", 3, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(r.output.find("# all_reduce by algorithm: 3 ranks, node of each rank: 0 0 0;") != std::string::npos);
  CHECK(r.output.find("size(B):                4092      16380      65532") != std::string::npos);
  for (const char* row : {"\nlibrary ", "\nring ", "\ntree ", "\ntwo-level "}) CHECK(r.output.find(row) != std::string::npos);
  CHECK(r.output.find("\nhalving-doubling ") == std::string::npos);
  CHECK(r.output.find("collectives: all_reduce on group 'world' (3 ranks) runs as ring: halving-doubling needs a power-of-two group") ==
        std::string::npos);  // never run: nothing to fall back
  size_t pairs = 0;
  for (size_t at = r.output.find(" vs "); at != std::string::npos; at = r.output.find(" vs ", at + 1)) pairs++;
  CHECK(pairs == 6);  // 4 algorithms, every pair once
}
