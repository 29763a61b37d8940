// ranks: 1 2 4 8
// Mesh coordinates and group membership against tables written out by hand, the validation
// rules, and (at the matching world size) the live communicators against the same tables.
#include <catch2/catch.hpp>

#include <algorithm>

#include "comm/mesh.h"

using namespace ts;

using Groups = std::vector<std::vector<int>>;  // a partition of the world, each in group-rank order

struct Case {
  const char* name;
  MeshConfig cfg;
  std::vector<std::vector<int>> coords;  // per rank: dp pp cp tp ep
  Groups by_axis[kNumAxes];              // World, DP, PP, CP, TP, EP, DP_CP, EP_DP
};

static Groups singles(int n) {
  Groups g;
  for (int r = 0; r < n; r++) g.push_back({r});
  return g;
}

static std::vector<Case> cases() {
  std::vector<Case> v;
  //  rank:    0          1          2          3          4          5          6          7
  //  dp cp tp 0 0 0      0 0 1      0 1 0      0 1 1      1 0 0      1 0 1      1 1 0      1 1 1
  v.push_back({"8 = dp2 x cp2 x tp2, ep2",
               {2, 1, 2, 2, 2},
               {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 1, 0, 1}, {0, 0, 1, 1, 1},
                {1, 0, 0, 0, 0}, {1, 0, 0, 1, 0}, {1, 0, 1, 0, 1}, {1, 0, 1, 1, 1}},
               {{{0, 1, 2, 3, 4, 5, 6, 7}},
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
                singles(8),
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
                {{0, 2}, {4, 6}, {1, 3}, {5, 7}},
                {{0, 2, 4, 6}, {1, 3, 5, 7}},
                {{0, 4}, {2, 6}, {1, 5}, {3, 7}}}});
  v.push_back({"8 = dp2 x cp2 x tp2, ep4",
               {2, 1, 2, 2, 4},
               {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}, {0, 0, 1, 0, 1}, {0, 0, 1, 1, 1},
                {1, 0, 0, 0, 2}, {1, 0, 0, 1, 2}, {1, 0, 1, 0, 3}, {1, 0, 1, 1, 3}},
               {{{0, 1, 2, 3, 4, 5, 6, 7}},
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
                singles(8),
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
                {{0, 2, 4, 6}, {1, 3, 5, 7}},
                {{0, 2, 4, 6}, {1, 3, 5, 7}},
                singles(8)}});
  v.push_back({"8 = dp2 x pp2 x tp2",
               {2, 2, 1, 2, 1},
               {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}, {0, 1, 0, 0, 0}, {0, 1, 0, 1, 0},
                {1, 0, 0, 0, 0}, {1, 0, 0, 1, 0}, {1, 1, 0, 0, 0}, {1, 1, 0, 1, 0}},
               {{{0, 1, 2, 3, 4, 5, 6, 7}},
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                singles(8),
                {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
                singles(8),
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}}}});
  // pp outermost (--rank-order pp-dp-cp-tp): rank = (pp·dp + dp)·tp + tp, so a stage's dp ranks,
  // and the ep group carved from them, are neighbours where above they sit pp·tp = 4 apart.
  //  rank:    0          1          2          3          4          5          6          7
  //  pp dp tp 0 0 0      0 0 1      0 1 0      0 1 1      1 0 0      1 0 1      1 1 0      1 1 1
  v.push_back({"8 = pp2 x dp2 x tp2, ep2, pp outermost",
               {2, 2, 1, 2, 2, true},
               {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}, {1, 0, 0, 0, 1}, {1, 0, 0, 1, 1},
                {0, 1, 0, 0, 0}, {0, 1, 0, 1, 0}, {1, 1, 0, 0, 1}, {1, 1, 0, 1, 1}},
               {{{0, 1, 2, 3, 4, 5, 6, 7}},
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                {{0, 4}, {1, 5}, {2, 6}, {3, 7}},
                singles(8),
                {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                {{0, 2}, {1, 3}, {4, 6}, {5, 7}},
                singles(8)}});
  v.push_back({"4 = pp2 x tp2",
               {1, 2, 1, 2, 1},
               {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}, {0, 1, 0, 0, 0}, {0, 1, 0, 1, 0}},
               {{{0, 1, 2, 3}}, singles(4), {{0, 2}, {1, 3}}, singles(4), {{0, 1}, {2, 3}}, singles(4), singles(4),
                singles(4)}});
  v.push_back({"4 = dp2 x cp2, ep2",
               {2, 1, 2, 1, 2},
               {{0, 0, 0, 0, 0}, {0, 0, 1, 0, 1}, {1, 0, 0, 0, 0}, {1, 0, 1, 0, 1}},
               {{{0, 1, 2, 3}}, {{0, 2}, {1, 3}}, singles(4), {{0, 1}, {2, 3}}, singles(4), {{0, 1}, {2, 3}},
                {{0, 1, 2, 3}}, {{0, 2}, {1, 3}}}});
  v.push_back({"2 = tp2", {1, 1, 1, 2, 1}, {{0, 0, 0, 0, 0}, {0, 0, 0, 1, 0}},
               {{{0, 1}}, singles(2), singles(2), singles(2), {{0, 1}}, singles(2), singles(2), singles(2)}});
  v.push_back({"1", {1, 1, 1, 1, 1}, {{0, 0, 0, 0, 0}},
               {{{0}}, {{0}}, {{0}}, {{0}}, {{0}}, {{0}}, {{0}}, {{0}}}});
  return v;
}

static const std::vector<int>& group_of(const Groups& gs, int r) {
  for (auto& g : gs)
    if (std::find(g.begin(), g.end(), r) != g.end()) return g;
  FAIL("rank " << r << " is in no group of the table");
  return gs[0];
}

TEST_CASE("rank -> coordinates and groups match the tables") {
  for (const Case& c : cases()) {
    int world = int(c.coords.size());
    for (int r = 0; r < world; r++) {
      INFO(c.name << ", rank " << r);
      MeshCoords m = mesh_coords(c.cfg, r);
      CHECK(std::vector<int>{m.dp, m.pp, m.cp, m.tp, m.ep} == c.coords[r]);
      CHECK(mesh_rank(c.cfg, m.dp, m.pp, m.cp, m.tp) == r);
      for (int a = 0; a < kNumAxes; a++) {
        INFO("axis " << axis_name(Axis(a)));
        CHECK(mesh_group(c.cfg, r, Axis(a)) == group_of(c.by_axis[a], r));
      }
    }
  }
}

TEST_CASE("mesh validation names the problem") {
  CHECK(mesh_config_problem({2, 1, 2, 2, 2}, 8) == "");
  CHECK(mesh_config_problem({2, 1, 1, 1, 1}, 4).find("needs 2 ranks but the job has 4") != std::string::npos);
  CHECK(mesh_config_problem({2, 1, 2, 1, 3}, 4).find("ep=3 must divide dp x cp = 4") != std::string::npos);
  CHECK(mesh_config_problem({0, 1, 1, 1, 1}, 0).find("at least 1") != std::string::npos);
  CHECK(mesh_config_problem({1, 1, 1, 1, -1}, 1).find("at least 1") != std::string::npos);
}

TEST_CASE("live communicators have the members of the tables") {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int tested = 0;
  for (const Case& c : cases()) {
    if (int(c.coords.size()) != world) continue;
    tested++;
    Mesh m = make_mesh(c.cfg, Device::CPU);
    INFO(c.name << ", rank " << m.rank);
    CHECK(std::vector<int>{m.dp_rank, m.pp_rank, m.cp_rank, m.tp_rank, m.ep_rank} == c.coords[m.rank]);
    for (int a = 0; a < kNumAxes; a++) {
      Comm& g = m.group(Axis(a));
      const std::vector<int>& want = group_of(c.by_axis[a], m.rank);
      INFO("group " << g.name());
      CHECK(g.name() == axis_name(Axis(a)));
      CHECK(g.size() == int(want.size()));
      CHECK(want[g.rank()] == m.rank);
      CHECK(std::string(g.transport(Device::CPU)) == "mpi");
      // Each member contributes its world rank: the gathered list is the group in rank order.
      Tensor me = Tensor::empty({1}, DType::I32, Device::CPU, Tag::Workspace);
      me.i32()[0] = m.rank;
      Tensor all = Tensor::empty({g.size()}, DType::I32, Device::CPU, Tag::Workspace);
      g.all_gather(all, me);
      CHECK(std::vector<int>(all.i32(), all.i32() + g.size()) == want);
    }
  }
  CHECK(tested > 0);
}
