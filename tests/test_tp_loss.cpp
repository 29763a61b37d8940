// ranks: 2 4
// 04's vocabulary-parallel cross-entropy over a real tp group (tp = the world size) against the
// fused kernel on the whole logits: every rank holds V/tp columns, gets every token's loss, and
// its block of dlogits. Logits of ±80 (a naive exp overflows) and targets that some ranks never own.
#include <catch2/catch.hpp>

#include "../04_tensor_parallel.cu"
#include "kernels/kernels.h"

using namespace ts;

TEST_CASE("vocabulary-parallel cross-entropy equals the fused kernel on the gathered logits", "[04][loss]") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MeshConfig mc;
  mc.tp = world;
  Mesh mesh = make_mesh(mc, Device::CPU);
  const int tp = mesh.tp().size(), r = mesh.tp_rank;
  const int64_t N = 24, V = 64 * tp, Vl = V / tp;
  // The same logits on every rank (a pure function of the index); rows 0 and 1 carry ±80.
  std::vector<float> x(size_t(N * V));
  for (int64_t i = 0; i < N * V; i++) x[size_t(i)] = float(std::sin(0.37 * double(i)) * 6.0);
  for (int64_t j = 0; j < V; j++) {
    x[size_t(j)] = (j % 7 == 0) ? 80.f : -80.f;
    x[size_t(V + j)] = j == V - 1 ? 80.f : -3.f;
  }
  // Targets only in the first and last quarter of the vocabulary: at tp 4 the middle ranks own none.
  std::vector<float> tg(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; n++) tg[size_t(n)] = float(n % 2 ? V - 1 - (n * 5) % (V / 4) : (n * 3) % (V / 4));
  tg[0] = 1;  // a −80 logit against the row's +80s: a loss of about 160
  auto tensor = [](std::vector<int64_t> shape, DType dt, const float* v) {
    Tensor t = Tensor::empty(shape, dt, Device::CPU, Tag::Workspace);
    from_host_f32(t, v);
    return t;
  };
  const float scale = 1.f / 96;
  Tensor full = tensor({N, V}, DType::F32, x.data()), targets = tensor({N}, DType::I32, tg.data());
  Tensor want_loss = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Workspace);
  cross_entropy_forward_backward(want_loss, full, full, targets, scale);
  std::vector<float> mine(size_t(N * Vl));
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < Vl; j++) mine[size_t(n * Vl + j)] = x[size_t(n * V + r * Vl + j)];
  Tensor logits = tensor({N, Vl}, DType::F32, mine.data());
  Tensor loss = Tensor::empty({N}, DType::F32, Device::CPU, Tag::Workspace);
  tp::VocabParallelCrossEntropy ce(mesh.tp());
  ce.forward_backward(loss, logits, logits, targets, r * Vl, scale);
  const std::vector<float> got = to_host_f32(loss), want = to_host_f32(want_loss);
  const std::vector<float> dl = to_host_f32(logits), dfull = to_host_f32(full);
  double loss_err = 0, grad_err = 0;
  for (int64_t n = 0; n < N; n++) {
    loss_err = std::max(loss_err, std::abs(double(got[size_t(n)]) - want[size_t(n)]) / std::abs(double(want[size_t(n)])));
    for (int64_t j = 0; j < Vl; j++)
      grad_err = std::max(grad_err, std::abs(double(dl[size_t(n * Vl + j)]) - dfull[size_t(n * V + r * Vl + j)]) / scale);
  }
  INFO("tp " << tp << " rank " << r << ": loss rel err " << loss_err << ", dlogits err/scale " << grad_err);
  CHECK(std::isfinite(got[0]));
  CHECK(want[0] > 100);  // row 0: the target's −80 against +80s
  CHECK(loss_err <= 1e-6);
  CHECK(grad_err <= 2e-7);
  // Every rank holds the same losses: the reduction made them whole.
  std::vector<float> r0 = got;
  MPI_Bcast(r0.data(), int(N), MPI_FLOAT, 0, MPI_COMM_WORLD);
  CHECK(r0 == got);
  // Bytes: one MAX all-reduce of N floats and one SUM all-reduce of 2N.
  CHECK(mesh.tp().stats().at("all_reduce").calls == 2);
  CHECK(mesh.tp().stats().at("all_reduce").payload_bytes == 3.0 * N * 4);
}
