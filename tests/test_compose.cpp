// ranks: 2
// Technique files are modules: 02's gradient reducer and 03's ZeRO sharder are included into one
// translation unit (their main()s compile only in their own programs) and built on models of the
// same mesh; hooks take several subscribers.
#include <catch2/catch.hpp>

#include "../02_data_parallel.cu"
#include "formats/data_sources.h"
#include "../03_zero.cu"
#include "../lab/02_data_parallel.h"
#include "../lab/03_zero.h"
#include "test_util.h"

using namespace ts;

namespace {

const ModelConfig kCfg{64, 2, 4, 2, 160, 256, 32};

// The two sequences of a batch of 4 that dp rank r reads at step 0.
MicroBatch my_batch(const Mesh& mesh) {
  static TokenData data = load_data("", kCfg.vocab, 1337, kCfg.seq + 2);
  return make_microbatch(data, 0, 4, kCfg.seq, 2 * mesh.dp_rank, 2, Device::CPU);
}

void init(Model& m) { Model::init_range(m.table, 1337, 0, m.table.total, m.params); }

}  // namespace

TEST_CASE("a hook with two subscribers calls both, in order, for every unit", "[compose]") {
  Model m(kCfg, Device::CPU, DType::F32, Recompute::None);
  init(m);
  std::vector<std::pair<int, int>> calls;  // (subscriber, unit)
  m.unit_grads_ready.add([&](int u) { calls.push_back({1, u}); });
  m.unit_grads_ready.add([&](int u) { calls.push_back({2, u}); });
  Mesh mesh = make_mesh(MeshConfig{2}, Device::CPU);
  MicroBatch b = my_batch(mesh);
  m.forward_backward(b.inputs, b.targets, 2, 1.f / 64);
  const int U = m.table.num_units();
  REQUIRE(calls.size() == size_t(2 * U));
  for (int i = 0; i < U; i++) {
    const int unit = U - 1 - i;  // the head finishes first, the embedding last
    CHECK(calls[size_t(2 * i)] == std::pair<int, int>{1, unit});
    CHECK(calls[size_t(2 * i + 1)] == std::pair<int, int>{2, unit});
  }
}

TEST_CASE("02's bucketed reducer and 03's ZeRO-1 sharder, built side by side, agree on the mean gradient",
          "[compose]") {
  Mesh mesh = make_mesh(MeshConfig{2}, Device::CPU);
  RunConfig rc;
  rc.model = kCfg;
  MicroBatch b = my_batch(mesh);
  const float scale = 1.f / (4 * kCfg.seq);

  Model replica(kCfg, Device::CPU, DType::F32, Recompute::None);
  init(replica);
  dp::GradReducer reducer(replica, mesh.dp(), /*bucketed=*/true, /*bucket_mb=*/0.05);
  int ready = 0;
  replica.unit_grads_ready.add([&](int) { ready++; });  // a second subscriber next to the reducer's
  replica.forward_backward(b.inputs, b.targets, 2, scale);
  const double loss_a = replica.take_loss();
  reducer.finish();
  CHECK(ready == replica.table.num_units());
  CHECK(reducer.num_buckets() > 1);
  const double norm_a = global_grad_norm(replica.table, {{0, replica.grads}}, {});

  ModelLayout layout;
  layout.align = 2;
  Model sharded(kCfg, Device::CPU, DType::F32, Recompute::None, layout);
  init(sharded);
  zero::Zero z(sharded, mesh.dp(), /*stage=*/1, /*prefetch=*/false, rc);
  z.begin_step();
  z.begin_microbatch();
  sharded.forward_backward(b.inputs, b.targets, 2, scale);
  const double loss_b = sharded.take_loss();
  z.end_microbatch(true);
  const double norm_b = z.grad_norm();

  CHECK(loss_a == loss_b);  // the same weights and tokens
  REQUIRE(norm_a > 0.1);
  // Both sum the two ranks' gradients elementwise (exact for two terms); the norms differ only
  // in how the squares are grouped (whole buffer vs. per-unit chunks).
  CHECK(std::abs(norm_a - norm_b) <= 1e-12 * norm_a);
  // Rank r's ZeRO chunk of each unit equals that range of the all-reduced replica gradients.
  const std::vector<float> full = to_host_f32(replica.grads);
  for (int u = 0; u < z.units(); u++) {
    const std::vector<float> chunk = to_host_f32(z.grads(u));
    const int64_t begin = z.opt(u).begin;
    int64_t bad = 0;
    for (size_t i = 0; i < chunk.size(); i++) bad += chunk[i] != full[size_t(begin) + i];
    INFO("unit " << u);
    CHECK(bad == 0);
  }
}

TEST_CASE("unit by unit with the weight gradients deferred (B then W) gives forward_backward's gradients", "[compose]") {
  Mesh mesh = make_mesh(MeshConfig{2}, Device::CPU);
  MicroBatch b = my_batch(mesh);
  Model whole(kCfg, Device::CPU, DType::F32, Recompute::None), split(kCfg, Device::CPU, DType::F32, Recompute::None);
  init(whole);
  init(split);
  whole.forward_backward(b.inputs, b.targets, 2, 1.f / 64);
  std::vector<int> ready;
  split.unit_grads_ready.add([&](int u) { ready.push_back(u); });
  ForwardState st = split.begin_microbatch(b.inputs, b.targets, 2);
  Tensor x;
  const int L = kCfg.layers;
  for (int u = 0; u <= L + 1; u++) split.unit_forward(u, st, x, 1.f / 64);
  for (int u = L; u >= 1; u--) split.unit_backward(u, st, x, /*defer_weights=*/true);  // B of every layer
  split.unit_backward(0, st, x);
  CHECK(ready == std::vector<int>{L + 1, 0});  // the layers' W has not run yet
  for (int u = 1; u <= L; u++) split.unit_backward_weights(u, st);  // W, later, in another order
  CHECK(st.deferred.empty());
  CHECK(ready.size() == size_t(L + 2));
  CHECK(to_host_f32(split.grads) == to_host_f32(whole.grads));
}

TEST_CASE("the labs' predictions are the chapters' formulas plus what a run adds: ZeRO's units in flight",
          "[compose]") {
  RunConfig rc;
  rc.model = kCfg;
  rc.micro_batch = 2;
  const ParamTable t = Model::make_table(kCfg, 2);
  // notes/03: the tiny model's layers are 43136 elements each, the largest units; both layers are
  // the largest pair of consecutive units.
  const double S = double(t.total) / 2, P2 = 2 * 43136.0, U = 43136.0;
  CHECK(zero::largest_unit(t) == U);
  CHECK(zero::largest_consecutive_pair(t) == P2);
  for (int stage : {1, 2, 3}) {
    for (bool prefetch : {false, true}) {
      const zero::ZeroPlan p{stage, 2, 1, prefetch, t};
      const MemoryPrediction m = zero::predict_memory(rc, p, P2);
      CHECK(m.optimizer == 8 * S);  // fp32: Adam's m and v, no master copy
      CHECK(m.grads == (stage == 1 ? 4.0 * double(t.total) : 4 * (S + P2)));
      CHECK(m.params == (stage < 3 ? 4.0 * double(t.total) : 4 * (S + (prefetch ? P2 : U))));
      CHECK(m.staging == 12 * S);
      CHECK(m.activations == predict_activations(kCfg, 2, DType::F32, Recompute::None));
    }
  }
  // 02's ring all-reduce, 2(N−1)/N · 4Ψ: at N = 2 exactly the 4Ψ bytes of the fp32 gradients.
  CHECK(dp::predict_allreduce_bytes(rc, 2) == 4.0 * double(param_count(kCfg)));
}
