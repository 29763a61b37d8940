// ranks: 2 4
// The sharded parameter table: what a tensor-parallel rank holds is exactly its block of the full
// model (initialisation, bit for bit, checked against global indices computed here), and the
// blocks written by tp ranks as a checkpoint give the very bytes one rank writes for the whole
// model. Run at 2 and 4 ranks: the checkpoint cases use tp = the world size.
#include <catch2/catch.hpp>
#include <mpi.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>

#include "../04_tensor_parallel.cu"  // tp::shard_spec, tp::split_of
#include "training/checkpoint_files.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "test_util.h"

using namespace ts;

namespace {

// Heads 8 / kv heads 4 so that tp 4 still gives every rank whole kv heads.
const ModelConfig kCfg{64, 2, 8, 4, 160, 256, 32};

std::vector<float> init_all(const ParamTable& t, uint64_t seed) {
  Tensor w = Tensor::empty({t.total}, DType::F32, Device::CPU, Tag::Workspace);
  Model::init_range(t, seed, 0, t.total, w);
  return to_host_f32(w);
}

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// A scratch path every rank agrees on (tst::scratch is per process).
std::string shared_scratch(const std::string& name) {
  char buf[256] = {0};
  if (world_rank() == 0) snprintf(buf, sizeof buf, "%s", tst::scratch(name).c_str());
  MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
  return buf;
}

int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

}  // namespace

TEST_CASE("tp 2 and 4: every rank's block of every tensor is that block of the full init, bit for bit", "[shard]") {
  const ParamTable full = Model::make_table(kCfg);
  const std::vector<float> f = init_all(full, 11);
  for (int tp : {2, 4})
    for (int r = 0; r < tp; r++) {
      const ParamTable t = Model::make_table(kCfg, 1, tp::shard_spec(tp, r));
      const std::vector<float> mine = init_all(t, 11);
      int64_t held = 0;
      for (const ParamEntry& e : t.entries) {
        const ParamEntry& g = full.find(e.name);
        INFO("tp " << tp << " rank " << r << " " << e.name);
        REQUIRE(e.shape == g.shape);
        const bool matrix = e.shape.size() == 2;
        const int64_t rows = matrix ? e.local_shape[0] : 1, cols = matrix ? e.local_shape[1] : e.numel;
        const int64_t gcols = matrix ? e.shape[1] : e.numel;
        // The expected corner of the block, from the split rule alone.
        const int64_t r0 = e.split == Split::Rows ? r * (e.shape[0] / tp) : 0;
        const int64_t c0 = e.split == Split::Cols ? r * (e.shape[1] / tp) : 0;
        CHECK(rows * cols == e.numel);
        if (e.split == Split::Whole) CHECK(e.numel == g.numel);
        else CHECK(e.numel * tp == g.numel);
        int64_t bad = 0;
        for (int64_t i = 0; i < rows; i++)
          for (int64_t j = 0; j < cols; j++)
            bad += mine[size_t(e.offset + i * cols + j)] != f[size_t(g.offset + (r0 + i) * gcols + c0 + j)];
        CHECK(bad == 0);
        held += e.numel;
      }
      CHECK(held == t.total);
    }
}

TEST_CASE("the split rule: column-parallel rows, row-parallel columns, norms replicated and counted once", "[shard]") {
  const ParamTable t = Model::make_table(kCfg, 1, tp::shard_spec(4, 1));
  CHECK(t.find("model.layers.0.self_attn.q_proj.weight").split == Split::Rows);
  CHECK(t.find("model.layers.0.self_attn.k_proj.weight").local_shape == std::vector<int64_t>{8, 64});  // 1 kv head
  CHECK(t.find("model.layers.0.self_attn.o_proj.weight").split == Split::Cols);
  CHECK(t.find("model.layers.1.mlp.down_proj.weight").local_shape == std::vector<int64_t>{64, 40});
  CHECK(t.find("model.embed_tokens.weight").local_shape == std::vector<int64_t>{64, 64});
  CHECK(t.find("lm_head.weight").split == Split::Rows);
  const ParamEntry& n = t.find("model.norm.weight");
  CHECK(n.split == Split::Whole);
  CHECK(n.replicated_over == "tp");
  CHECK_FALSE(n.counts);  // rank 1's copy
  CHECK(Model::make_table(kCfg, 1, tp::shard_spec(4, 0)).find("model.norm.weight").counts);
  // A pipeline stage holding units 1..2 keeps every entry, with nothing held for the others.
  const ParamTable s = Model::make_table(kCfg, 1, ShardSpec{1, 0, {{1, 3}}});
  CHECK(s.entries.size() == Model::make_table(kCfg).entries.size());
  CHECK_FALSE(s.find("model.embed_tokens.weight").held());
  CHECK(s.find("model.embed_tokens.weight").numel == 0);
  CHECK(s.total == Model::make_table(kCfg).unit_begin[3] - Model::make_table(kCfg).unit_begin[1]);
  CHECK(s.unit_begin[1] == 0);
}

// Experts under tp × ep (08): the router and each held expert whole on every tp rank; every copy
// counted exactly once over the tp × ep ranks (what the gradient norm and checkpoints rely on).
TEST_CASE("tp 2 × ep 2 with experts: router and experts whole over tp, each tensor counted once", "[shard][ep]") {
  ModelConfig c = kCfg;
  c.experts = 4;
  c.top_k = 2;
  std::map<std::string, int> counted;
  std::map<std::string, int64_t> held;
  for (int tp_rank = 0; tp_rank < 2; tp_rank++)
    for (int ep_rank = 0; ep_rank < 2; ep_rank++) {
      ShardSpec sh = tp::shard_spec(2, tp_rank);
      sh.ep = 2;
      sh.ep_rank = ep_rank;
      const ParamTable t = Model::make_table(c, 1, sh);
      const ParamEntry& gate = t.find("model.layers.0.block_sparse_moe.gate.weight");
      CHECK(gate.split == Split::Whole);
      CHECK(gate.numel == 4 * 64);
      const ParamEntry& mine = t.find("model.layers.0.block_sparse_moe.experts." + std::to_string(2 * ep_rank) + ".w1.weight");
      CHECK(mine.split == Split::Whole);
      CHECK(mine.numel == 160 * 64);  // ffn not split over tp
      CHECK(t.find("model.layers.0.block_sparse_moe.experts." + std::to_string(2 - 2 * ep_rank) + ".w1.weight").numel == 0);
      for (const ParamEntry& e : t.entries) {
        counted[e.name] += e.counts && e.held();
        if (e.counts && e.held()) held[e.name] += e.numel;
      }
    }
  for (const auto& [name, n] : counted) {
    INFO(name);
    CHECK(n == (Model::make_table(c, 1, tp::shard_spec(2, 0)).find(name).split == Split::Whole ? 1 : 2));  // whole: once; a tp block: once per tp rank
  }
  int64_t total = 0;
  for (const auto& [name, n] : held) total += n;
  CHECK(total == Model::make_table(c).total);  // the counted copies are the whole model, once
}

TEST_CASE("a column block maps to one run per row, a row block to one run", "[shard]") {
  const ParamTable t = Model::make_table(kCfg, 1, tp::shard_spec(2, 1));
  const ParamEntry& o = t.find("model.layers.0.self_attn.o_proj.weight");  // [64, 64], columns 32..63
  std::vector<std::array<int64_t, 3>> runs;
  o.for_each_run(0, o.numel, [&](int64_t l, int64_t g, int64_t n) { runs.push_back({l, g, n}); });
  REQUIRE(runs.size() == 64);
  CHECK(runs[0] == std::array<int64_t, 3>{0, 32, 32});
  CHECK(runs[5] == std::array<int64_t, 3>{5 * 32, 5 * 64 + 32, 32});
  runs.clear();
  o.for_each_run(40, 100, [&](int64_t l, int64_t g, int64_t n) { runs.push_back({l, g, n}); });  // a ZeRO-like cut
  REQUIRE(runs.size() == 3);
  CHECK(runs[0] == std::array<int64_t, 3>{40, 64 + 32 + 8, 24});
  CHECK(runs[2] == std::array<int64_t, 3>{96, 3 * 64 + 32, 4});
  const ParamEntry& q = t.find("model.layers.0.self_attn.q_proj.weight");
  runs.clear();
  q.for_each_run(0, q.numel, [&](int64_t l, int64_t g, int64_t n) { runs.push_back({l, g, n}); });
  REQUIRE(runs.size() == 1);
  CHECK(runs[0] == std::array<int64_t, 3>{0, 32 * 64, 32 * 64});
}

TEST_CASE("tp blocks saved by every rank give the same model and optimizer bytes as one rank's whole model",
          "[shard][ckpt]") {
  const int tp = world_size(), rank = world_rank();
  RunConfig rc;
  rc.model = kCfg;
  Json mesh = Json::object();
  // The reference: the whole model from rank 0 alone (the others contribute nothing).
  const std::string ref = shared_scratch("shard_ref"), sharded = shared_scratch("shard_tp");
  {
    Model m(kCfg, Device::CPU, DType::F32, Recompute::None);
    AdamW opt(m, 0, m.table.total, false);
    opt.ensure_state();
    Model::init_range(m.table, 5, 0, m.table.total, m.params);
    Model::init_range(m.table, 6, 0, m.table.total, opt.m1);
    Model::init_range(m.table, 7, 0, m.table.total, opt.m2);
    std::vector<CheckpointSlice> mine;
    if (rank == 0) mine.push_back({0, m.table.total, m.params, &opt});
    save_checkpoint(ref, rc, m.table, mine, 3, mesh);
  }
  ModelLayout layout;
  layout.shard = tp::shard_spec(tp, rank);
  Model m(kCfg, Device::CPU, DType::F32, Recompute::None, layout);
  AdamW opt(m, 0, m.table.total, false);
  opt.ensure_state();
  Model::init_range(m.table, 5, 0, m.table.total, m.params);
  Model::init_range(m.table, 6, 0, m.table.total, opt.m1);
  Model::init_range(m.table, 7, 0, m.table.total, opt.m2);
  save_checkpoint(sharded, rc, m.table, {{0, m.table.total, m.params, &opt}}, 3, mesh);
  if (rank == 0) {
    for (const char* f : {"/model.safetensors", "/optimizer.safetensors"}) {
      INFO(f);
      const std::string a = file_bytes(ref + f), b = file_bytes(sharded + f);
      REQUIRE(a.size() > 100000);
      CHECK(a == b);
    }
  }
  // And back: a rank reads exactly its blocks of the whole-model checkpoint.
  Tensor back = Tensor::empty({m.table.total}, DType::F32, Device::CPU, Tag::Workspace);
  AdamW opt2(m, 0, m.table.total, false);
  opt2.ensure_state();
  load_checkpoint(ref, kCfg, m.table, 0, m.table.total, back, &opt2);
  CHECK(to_host_f32(back) == to_host_f32(m.params));
  CHECK(to_host_f32(opt2.m2) == to_host_f32(opt.m2));
  MPI_Barrier(MPI_COMM_WORLD);
}
