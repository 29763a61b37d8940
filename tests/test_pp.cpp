// ranks: 1
// 05_pipeline_parallel: the schedules as data (every action once, in dependency order, exact
// bubbles, lists that cannot deadlock), then end to end against 01 at pp 2 and 4 for every
// schedule, per-stage memory and p2p bytes against the formulas, checkpoints crossing between
// pp 4, pp 2 and 01, and bad input.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "../05_pipeline_parallel.cu"
#include "kernels/kernels.h"
#include "../05a_zero_bubble.cu"
#include "../05b_dualpipev.cu"
#include "../lab/05_pipeline_parallel.h"
#include "test_util.h"

using namespace ts;

namespace {

const std::string kTiny = "--preset tiny --quiet --lr-schedule constant ";
const int kSteps = 4;
const pp::Schedule kAll[] = {pp::kAFAB, pp::kOneFOneB, pp::kInterleaved, pp::kZBH1};

using Run = tst::CachedRun;
std::string args(int layers, int batch, const std::string& extra = "") {
  return kTiny + "--layers " + std::to_string(layers) + " --steps " + std::to_string(kSteps) + " --batch " +
         std::to_string(batch) + " --micro-batch 1 " + extra;
}
const Run& single(int layers, int batch, const std::string& extra = "") {
  return tst::cached_run("01_single_gpu", 1, args(layers, batch, extra));
}
const pp::Schedule kDual = pp::kDualPipeV;
const Run& pipe(int p, pp::Schedule s, int layers, int batch, const std::string& extra = "") {
  const std::string v = s == pp::kInterleaved ? " --virtual-stages 2 " : " ";
  return tst::cached_run("05_pipeline_parallel", p,
                         args(layers, batch, "--pp " + std::to_string(p) + " --schedule " + pp::schedule_name(s) + v + extra));
}
std::string model_file(const Run& r) { return r.ckpt + "/model.safetensors"; }
// Layers: pp·V must divide them (V = 2 for interleaved).
int layers_for(int p, pp::Schedule s) { return s == pp::kInterleaved && p == 4 ? 8 : 4; }
const Json& stage(const Run& r, int s) { return r.log.summary.at("pp").at("stages")[size_t(s)]; }

}  // namespace

// ----- the action lists ------------------------------------------------------------------------------

// The registry: the chapter's three schedules and those 05a and 05b register, found by name, listed
// in reading order (the help and the error messages list them so).
TEST_CASE("the schedule registry: a variant's schedule is found by name, the names in reading order", "[05][schedule]") {
  pp::Schedule s = nullptr;
  REQUIRE(pp::parse_schedule("zb-h1", s));
  CHECK(s == pp::kZBH1);
  CHECK(pp::splits_backward(s));
  REQUIRE(pp::parse_schedule("dualpipev", s));
  CHECK(s == pp::kDualPipeV);
  CHECK(s->chunks == 2);
  REQUIRE(pp::parse_schedule("1f1b", s));
  CHECK(s == pp::kOneFOneB);
  CHECK(!pp::splits_backward(s));
  CHECK(!pp::parse_schedule("gpipe", s));
  CHECK(pp::schedule_names(" | ", " | ") == "afab | 1f1b | interleaved | zb-h1 | dualpipev");
  CHECK(pp::schedule_names(", ", " or ") == "afab, 1f1b, interleaved, zb-h1 or dualpipev");
}

// A plan that completes runs one action at a time per rank, each (op, micro-batch, virtual stage)
// exactly once (per: 2 for F and B, 3 with W), and each after the actions it needs.
void check_once_in_order(const pp::SimulatedPlan& pl, int per) {
  REQUIRE(pl.complete);
  std::map<std::tuple<int, int, int>, int> finish;  // (op, mb, virtual stage) -> finish slot
  int count = 0;
  for (int r = 0; r < pl.p; r++) {
    int free = 0;
    for (const pp::TimedAction& t : pl.timeline[r]) {
      CHECK(t.start >= free);  // one action at a time per rank
      free = t.start + t.slots;
      const int k = pl.stage(r, t.action.chunk);
      CHECK(finish.emplace(std::make_tuple(int(t.action.op), t.action.mb, k), free).second);  // exactly once
      count++;
    }
  }
  CHECK(count == per * pl.m * pl.K());
  for (int r = 0; r < pl.p; r++)
    for (const pp::TimedAction& t : pl.timeline[r]) {
      const int k = pl.stage(r, t.action.chunk), K = pl.K();
      auto done_by = [&](pp::Op op, int kk) { return finish.at(std::make_tuple(int(op), t.action.mb, kk)) <= t.start; };
      if (t.action.op == pp::Op::F && k > 0) CHECK(done_by(pp::Op::F, k - 1));
      if (t.action.op == pp::Op::B) CHECK(done_by(pp::Op::F, k));
      if (t.action.op == pp::Op::B && k < K - 1) CHECK(done_by(pp::Op::B, k + 1));
      if (t.action.op == pp::Op::W) CHECK(done_by(pp::Op::B, k));
    }
}

TEST_CASE("every micro-batch gets one F and one B (and one W) per chunk, in dependency order", "[05][schedule]") {
  for (pp::Schedule s : kAll)
    for (int p = 1; p <= 5; p++)
      for (int m = 1; m <= 12; m++) {
        const int V = s == pp::kInterleaved ? 2 : 1;
        if (s == pp::kInterleaved && m % p) continue;
        INFO(pp::schedule_name(s) << " p " << p << " m " << m);
        check_once_in_order(pp::simulated_plan(p, m, V, s), s == pp::kZBH1 ? 3 : 2);
      }
}

// DualPipeV (deepseek-ai/DualPipe's dualpipev.py): rank r holds stages r and 2p − 1 − r; its lists
// complete for every p and m >= 2p, with each B's W (deferred or at once) once per stage.
TEST_CASE("DualPipeV: the V placement; F, B and W once per stage, in dependency order, for p 1..8", "[05][schedule][dualpipev]") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 2 * p; m <= 4 * p + 1; m++) {
      const pp::SimulatedPlan pl = pp::simulated_plan(p, m, 2, kDual);
      INFO("p " << p << " m " << m);
      check_once_in_order(pl, 3);
      for (int r = 0; r < p; r++) {
        CHECK(pl.stage(r, 0) == r);
        CHECK(pl.stage(r, 1) == 2 * p - 1 - r);
        CHECK(pp::stage_rank(pl, r) == r);
        CHECK(pp::stage_rank(pl, 2 * p - 1 - r) == r);
      }
      // Both directions of each link carry two chunks' messages, in orders that differ at its two
      // ends: the executor's buffered sends, as for interleaved (at p 1 nothing travels).
      CHECK(pp::completes_under_rendezvous(pl) == (p == 1));
      CHECK(pp::comm_holds(pl) == (p == 1 ? "" : "copies of the sends still in flight (dualpipev)"));
    }
  // Rank 0 holds the embedding with stage 0 and the head with stage 2p − 1 (units 0 and L + 1).
  const pp::Plan pl = pp::build_plan(4, 8, 2, kDual, std::vector<int>(8, 1));
  CHECK(pp::shard_spec(pl, 0).unit_runs == std::vector<std::pair<int, int>>{{0, 2}, {8, 10}});
  CHECK(pp::shard_spec(pl, 3).unit_runs == std::vector<std::pair<int, int>>{{4, 5}, {5, 6}});
}

// DualPipeV's bubble in slots (one stage's F = its B = its W; a rank busy 2m·(F + B + W) = 6m). Run
// as this executor runs a pair, its F and then its full backward each sending when they end, rank s
// idles s slots before its first activation and p − 1 − s after its last: p − 1, (p − 1)/(6m). Run
// as dualpipev.py runs a pair, one block that waits for both inputs and sends both outputs at its
// end, every hop through a pair costs the whole pair: 2(p − 1), the DualPipe README's
// (PP/2 − 1)(F&B + B − 3W) with PP = 2p, F = W = 1, B = 2, F&B = F + B = 3. Integers throughout.
TEST_CASE("DualPipeV's bubble: p − 1 idle slots per rank, the README's 2(p − 1) with its pairs as blocks",
          "[05][schedule][dualpipev]") {
  for (int p : {1, 2, 3, 4, 5, 6, 8})
    for (int m = 2 * p; m <= 4 * p + 1; m++) {
      const pp::SimulatedPlan pl = pp::simulated_plan(p, m, 2, kDual);
      const pp::SimulatedPlan blocks = pp::pair_block_plan(p, m);
      INFO("p " << p << " m " << m);
      REQUIRE(pl.complete);
      REQUIRE(blocks.complete);
      for (int r = 0; r < p; r++) {
        CHECK(pl.busy(r) == 6 * m);
        CHECK(blocks.busy(r) == 6 * m);
      }
      CHECK(pl.makespan == 6 * m + p - 1);
      CHECK(blocks.makespan == 6 * m + pp::dualpipe_table_idle_slots(p));
      CHECK(pp::dualpipe_table_idle_slots(p) == 2 * (p - 1));
      CHECK(pl.bubble() == Approx(pp::bubble_formula(kDual, p, m, 2)).epsilon(1e-12));
      CHECK(pp::bubble_formula(kDual, p, m, 2) == Approx((p - 1.0) / (6.0 * m)).epsilon(1e-12));
      // The table's value is ZB-H1's bubble at the same p: the blocks cost DualPipeV its half stages.
      CHECK(blocks.bubble() == Approx(pp::bubble_formula(pp::kZBH1, p, m, 1)).epsilon(1e-12));
      CHECK(pp::peak_in_flight(pl, 0) == 2 * p + 1);  // the table's PP + 1, PP = 2p stages
      if (p > 1) CHECK(pl.bubble() < pp::simulated_plan(p, m, 1, pp::kZBH1).bubble());
    }
}

// The pairs marked in the order are dualpipev.py's _forward_backward_chunk calls: two per turn of
// step 4 (m − 2p + s + 1 turns) but the last rank's first F, which the repository leaves unpaired,
// and one per turn of step 5 (p − s − 1); each an F followed by a full backward (its W at once).
// The blocks change when things run, never the order.
TEST_CASE("DualPipeV's F&B pairs: as many as dualpipev.py's, each an F then a full backward", "[05][schedule][dualpipev]") {
  for (int p : {1, 2, 3, 4, 8})
    for (int m = 2 * p; m <= 3 * p + 1; m++)
      for (int s = 0; s < p; s++) {
        INFO("p " << p << " m " << m << " rank " << s);
        const std::vector<pp::Action> o = kDual->order(p, m, 2, s);
        const std::vector<bool> pair = pp::dualpipev_pairs(p, m, s);
        REQUIRE(pair.size() == o.size());
        int pairs = 0;
        for (size_t i = 0; i < o.size(); i++) {
          if (!pair[i]) continue;
          pairs++;
          REQUIRE(i + 2 < o.size());
          CHECK(o[i].op == pp::Op::F);
          CHECK((o[i + 1].op == pp::Op::B && o[i + 1].chunk != o[i].chunk));
          CHECK((o[i + 2].op == pp::Op::W && o[i + 2].mb == o[i + 1].mb && o[i + 2].chunk == o[i + 1].chunk));
        }
        CHECK(pairs == 2 * (m - 2 * p + s + 1) + (p - s - 1) - (s == p - 1 ? 1 : 0));
        const pp::SimulatedPlan pl = pp::simulated_plan(p, m, 2, kDual), blocks = pp::pair_block_plan(p, m);
        REQUIRE(pl.timeline[s].size() == blocks.timeline[s].size());
        for (size_t i = 0; i < pl.timeline[s].size(); i++) CHECK(pl.timeline[s][i].action == blocks.timeline[s][i].action);
      }
}

TEST_CASE("simulated bubbles: (p−1)/m for AFAB and 1F1B, (p−1)/(V·m) interleaved, ZB-H1 below 1F1B", "[05][schedule]") {
  for (int p = 2; p <= 8; p++)
    for (int m = 1; m <= 24; m++) {
      INFO("p " << p << " m " << m);
      const double f = (p - 1.0) / m;
      CHECK(pp::simulated_plan(p, m, 1, pp::kAFAB).bubble() == Approx(f).epsilon(1e-12));
      const double one = pp::simulated_plan(p, m, 1, pp::kOneFOneB).bubble();
      CHECK(one == Approx(f).epsilon(1e-12));
      const double zb = pp::simulated_plan(p, m, 1, pp::kZBH1).bubble();
      CHECK(zb < one);
      if (m >= p) CHECK(zb == Approx((p - 1.0) / (3.0 * m)).epsilon(1e-12));  // Qi et al.'s (p−1)(F+B−W)
      if (m % p == 0)
        for (int V : {2, 4})
          CHECK(pp::simulated_plan(p, m, V, pp::kInterleaved).bubble() == Approx(f / V).epsilon(1e-12));
    }
}

// ZB-H1's lists are FillSimulator's timeline; the lab's plain simulator, playing them, finds that
// timeline again slot for slot (05a's zb_h1_order), on even and uneven stages.
TEST_CASE("ZB-H1: its lists on the plain simulator give FillSimulator's timeline", "[05][schedule]") {
  for (int p = 1; p <= 6; p++)
    for (int m = 1; m <= 12; m++)
      for (bool uneven : {false, true}) {
        std::vector<int> layers(size_t(p), 2);
        if (uneven) layers[0] = 3, layers[size_t(p - 1)] = 1;
        pp::SimulatedPlan fill(pp::build_plan(p, m, 1, pp::kOneFOneB, layers));
        fill.schedule = pp::kZBH1;
        pp::FillSimulator(fill).run();
        const pp::SimulatedPlan zb = pp::simulated_plan(p, m, 1, pp::kZBH1, layers);
        INFO("p " << p << " m " << m << (uneven ? " uneven" : ""));
        REQUIRE(zb.complete);
        CHECK(zb.makespan == fill.makespan);
        for (int r = 0; r < p; r++) {
          REQUIRE(zb.timeline[r].size() == fill.timeline[r].size());
          for (size_t i = 0; i < zb.timeline[r].size(); i++) {
            CHECK(zb.timeline[r][i].action == fill.timeline[r][i].action);
            CHECK(zb.timeline[r][i].start == fill.timeline[r][i].start);
            CHECK(zb.timeline[r][i].slots == fill.timeline[r][i].slots);
          }
        }
      }
}

TEST_CASE("in flight: AFAB holds m micro-batches, 1F1B at most p − s, ZB-H1 at most p until W", "[05][schedule]") {
  const int p = 4, m = 8;
  for (pp::Schedule s : {pp::kAFAB, pp::kOneFOneB, pp::kZBH1}) {
    const pp::SimulatedPlan pl = pp::simulated_plan(p, m, 1, s);
    for (int r = 0; r < p; r++) {
      int held = 0, peak = 0;
      for (const pp::TimedAction& t : pl.timeline[r]) {
        const bool frees = s == pp::kZBH1 ? t.action.op == pp::Op::W : t.action.op == pp::Op::B;
        held += t.action.op == pp::Op::F ? 1 : frees ? -1 : 0;
        peak = std::max(peak, held);
      }
      INFO(pp::schedule_name(s) << " stage " << r);
      CHECK(peak == (s == pp::kAFAB ? m : s == pp::kOneFOneB ? p - r : p));
    }
  }
}

TEST_CASE("p2p lists: rendezvous-safe for AFAB, 1F1B and ZB-H1; message counts equal the formula", "[05][schedule]") {
  for (pp::Schedule s : kAll)
    for (int p = 2; p <= 6; p++)
      for (int m = 1; m <= 10; m++) {
        const int V = s == pp::kInterleaved ? 2 : 1;
        if (s == pp::kInterleaved && m % p) continue;
        const pp::Plan pl = pp::build_plan(p, m, V, s);
        INFO(pp::schedule_name(s) << " p " << p << " m " << m);
        if (s != pp::kInterleaved) CHECK(pp::completes_under_rendezvous(pl));
        std::multiset<std::pair<int, int>> sent, received;  // (dir, mb·K + from)
        for (int r = 0; r < p; r++) {
          int sends = 0;
          for (const pp::Action& a : pl.actions[r]) {
            if (pp::is_compute(a.op)) continue;
            const pp::Message msg = pp::message_of(pl, r, a);
            (pp::is_send(a.op) ? sent : received).insert({msg.dir, msg.mb * pl.K() + msg.from});
            sends += pp::is_send(a.op);
          }
          // One unit of b·s·h·bytes per message.
          const ModelConfig c;
          CHECK(sends * double(c.seq) * c.dim * 4 == pp::predict_send_bytes(c, 1, DType::F32, p, m, V, r));
          CHECK(pp::predict_send_bytes(c, 1, DType::F32, pl, r) == pp::predict_send_bytes(c, 1, DType::F32, p, m, V, r));
        }
        CHECK(sent == received);  // every message sent is received once
      }
}

// DualPipeV: the ranks at the ends send 2m tensors, the others 4m (rank p − 1 turns the V on itself).
TEST_CASE("DualPipeV's p2p: every message sent is received; 2m tensors sent at the ends, 4m between", "[05][schedule][dualpipev]") {
  const ModelConfig c;
  const double tensor = double(c.seq) * c.dim * 4;
  for (int p : {1, 2, 3, 4, 8})
    for (int m : {2 * p, 2 * p + 3}) {
      const pp::Plan pl = pp::build_plan(p, m, 2, kDual);
      INFO("p " << p << " m " << m);
      std::multiset<std::pair<int, int>> sent, received;
      for (int r = 0; r < p; r++) {
        for (const pp::Action& a : pl.actions[r]) {
          if (pp::is_compute(a.op)) continue;
          const pp::Message msg = pp::message_of(pl, r, a);
          CHECK(std::abs(pp::peer_of(pl, r, a) - r) == 1);  // only neighbours talk
          (pp::is_send(a.op) ? sent : received).insert({msg.dir, msg.mb * pl.K() + msg.from});
        }
        const int tensors = p == 1 ? 0 : r == 0 || r == p - 1 ? 2 * m : 4 * m;
        CHECK(pp::predict_send_bytes(c, 1, DType::F32, pl, r) == tensors * tensor);
      }
      CHECK(sent == received);
    }
}

TEST_CASE("--schedule-chart prints the timeline: 1F1B at p 4, m 8", "[05][schedule]") {
  const std::vector<std::string> rows = pp::schedule_chart(pp::simulated_plan(4, 8, 1, pp::kOneFOneB));
  REQUIRE(rows.size() == 8);
  CHECK(rows[0] == "stage 0 |FFFF......BBFBBFBBFBBFBB.BB.BB.BB|");
  CHECK(rows[6] == "stage 3 |...FBBFBBFBBFBBFBBFBBFBBFBB......|");
  tst::Result r = tst::run_bin("05_pipeline_parallel", "--dry-run --pp 4 --layers 4 --schedule zb-h1 --batch 8 --micro-batch 1 --schedule-chart", 1, 60);
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(r.output.find("stage 0 |FFFF...BWFBWFBWFBWFBWBWBWBW|") != std::string::npos);
  CHECK(r.output.find("simulated 0.1250, formula 0.1250") != std::string::npos);
}

TEST_CASE("--schedule-chart draws DualPipeV: pp 2, m 4, with 1F1B and ZB-H1 beside it", "[05][schedule][dualpipev]") {
  tst::Result r = tst::run_bin("05_pipeline_parallel",
                               "--dry-run --pp 2 --layers 4 --schedule dualpipev --batch 4 --micro-batch 1 --schedule-chart", 1, 60);
  CHECK(r.status == 0);
  // Below the chart, the pairs as blocks: rank 0 waits at slots 10 and 16 for rank 1's pairs to end.
  for (const char* line : {"stage 0 |FFFfbwfFbwfBWbwfBWbwBW.BW|", "stage 1 |.FfFfFbwfBWFbwfBWbwBWbBwW|",
                           "each F&B pair one block (dualpipev.py):\nstage 0 |FFFfbwfFbw.fBWbw.fBWbwBWBW|",
                           "stage 1 |.FfFfFbwfBWFbwfBWbwBWbBwW.|",
                           "simulated 0.0417, formula 0.0417",
                           "1f1b simulated 0.2500, formula 0.2500; zb-h1 simulated 0.0833, formula 0.0833",
                           "idle slots per rank: simulated 1 = p - 1; chunks in flight on rank 0: 5, the table's PP + 1 = 5",
                           "(dualpipev.py): simulated 2 idle slots, bubble 0.0833; DualPipe's (PP/2 - 1)(F&B + B - 3W) = 2 "
                           "(F = W = 1, B = 2, F&B = F + B = 3), bubble 0.0833"}) {
    INFO(line << "\n" << r.output);
    CHECK(r.output.find(line) != std::string::npos);
  }
}

// ----- end to end against 01 ---------------------------------------------------------------------------

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent), and more: each stage
// runs exactly 01's kernels on exactly 01's tensors (the same shapes, so the same sgemm blocking
// on any machine), and every gradient accumulates over the micro-batches in 01's order (B and W
// in micro-batch order on every chunk), so losses and weights come out bit-identical (measured
// difference 0 at pp 2 and 4, every schedule). Only the gradient norm's sum of squares is grouped
// by stage, which may move the clip coefficient by an ulp of its double: the losses are held to
// 1e-12 relative and the weights to 1e-6 absolute.
const double kSameKernelsLoss = 1e-12, kSameKernelsWeight = 1e-6;
// Every stage's activations and sends, and rank 0's states, measured equal to predicted.
void check_predicted(const Run& t, int p) {
  for (int st = 0; st < p; st++) {
    INFO("stage " << st);
    CHECK(stage(t, st).at("activations_measured").as_double() == stage(t, st).at("activations_predicted").as_double());
    CHECK(stage(t, st).at("send_bytes").as_double() == stage(t, st).at("send_predicted").as_double());
  }
  for (const char* cat : {"params", "grads", "optimizer"})
    CHECK(t.log.summary.at("memory").at(cat).at("measured").as_double() ==
          t.log.summary.at("memory").at(cat).at("predicted").as_double());
}
void check_same_kernels(const Run& t, const Run& ref) {
  tst::check_equivalent(t, ref);
  CHECK(tst::max_rel_diff(t.log.losses(), ref.log.losses()) <= kSameKernelsLoss);
  CHECK(tst::max_abs_diff_files(model_file(t), model_file(ref)) <= kSameKernelsWeight);
}

TEST_CASE("pp 2 and 4 × every schedule × m ∈ {p, 2p, not a multiple of p} reproduce 01 (fp32, clipped)",
          "[05][e2e][equiv]") {
  for (int p : {2, 4})
    for (pp::Schedule s : kAll)
      for (int m : {p, 2 * p, p + 1}) {
        if (s == pp::kInterleaved && m % p) continue;
        const int L = layers_for(p, s);
        const Run& ref = single(L, m);
        const Run& t = pipe(p, s, L, m);
        INFO(pp::schedule_name(s) << " pp " << p << " m " << m);
        CHECK(ref.log.steps[0].at("grad_norm").as_double() > 1.2);  // clipping at 1.0 is active
        REQUIRE(t.log.steps.size() == size_t(kSteps));
        check_same_kernels(t, ref);
        for (int i = 0; i < kSteps; i++)
          CHECK(t.log.steps[size_t(i)].at("grad_norm").as_double() ==
                Approx(ref.log.steps[size_t(i)].at("grad_norm").as_double()).epsilon(1e-12));
      }
}

// DualPipeV at pp 2 (4 layers: 4 stages of 1) and pp 4 (8 layers: 8 stages of 1), m = 2p and 2p + 1:
// 01's losses and weights (every W of a unit in micro-batch order, as 01 accumulates), each rank's
// activations, sends and states as predicted: rank 0 holds the embedding, the head and two layers.
TEST_CASE("DualPipeV at pp 2 and 4 reproduces 01; activations, sends and states as predicted",
          "[05][e2e][equiv][dualpipev]") {
  for (int p : {2, 4})
    for (int m : {2 * p, 2 * p + 1}) {
      if (p == 4 && m != 2 * p) continue;  // one pp 4 run keeps the test short
      const Run& ref = single(2 * p, m);
      const Run& t = pipe(p, kDual, 2 * p, m);
      INFO("dualpipev pp " << p << " m " << m);
      REQUIRE(t.log.steps.size() == size_t(kSteps));
      check_same_kernels(t, ref);
      check_predicted(t, p);
      // Tiny: dim 64, kv dim 32, ffn 160; the embedding and the head 256 × 64 each, the final norm 64.
      const double layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64 + 2 * 64, head_norm = 64;
      CHECK(t.log.summary.at("memory").at("params").at("measured").as_double() == 4 * (2 * 256 * 64 + 2 * layer + head_norm));
      CHECK(t.log.summary.at("pp").at("bubble_simulated").as_double() == Approx((p - 1.0) / (6.0 * m)).epsilon(1e-12));
    }
}

TEST_CASE("recompute full and selective under 1F1B, interleaved and ZB-H1 reproduce 01", "[05][e2e][equiv]") {
  for (const char* rc : {"--recompute full", "--recompute selective"})
    for (pp::Schedule s : {pp::kOneFOneB, pp::kInterleaved, pp::kZBH1}) {
      const Run& ref = single(4, 4, rc);
      const Run& t = pipe(2, s, 4, 4, rc);
      INFO(rc << " " << pp::schedule_name(s));
      check_same_kernels(t, ref);
    }
}

// bf16 activations and weights with fp32 masters: a stage runs exactly 01's kernels on the same
// tensors, so the curve is 01 bf16's bit for bit (measured: identical); and the memory exact.
TEST_CASE("bf16: 1F1B and ZB-H1 at pp 2 give 01 bf16's losses; activations equal predicted", "[05][e2e][bf16]") {
  for (pp::Schedule s : {pp::kOneFOneB, pp::kZBH1}) {
    const Run& ref = single(4, 4, "--dtype bf16");
    const Run& t = pipe(2, s, 4, 4, "--dtype bf16");
    INFO(pp::schedule_name(s));
    CHECK(tst::max_rel_diff(t.log.losses(), ref.log.losses()) <= kSameKernelsLoss);
    const ts::Json& st = t.log.summary.at("pp").at("stages");
    for (size_t k = 0; k < st.size(); k++)
      CHECK(st.as_array()[k].at("activations_measured").as_double() == st.as_array()[k].at("activations_predicted").as_double());
  }
}

// ----- memory and bytes per stage --------------------------------------------------------------------

TEST_CASE("activations per stage measured equal predicted for every schedule; AFAB > 1F1B on stage 0", "[05][e2e][mem]") {
  for (int p : {2, 4})
    for (pp::Schedule s : kAll)
      for (int m : {p, 2 * p}) {
        const Run& t = pipe(p, s, layers_for(p, s), m);
        for (int st = 0; st < p; st++) {
          INFO(pp::schedule_name(s) << " pp " << p << " m " << m << " stage " << st);
          CHECK(stage(t, st).at("activations_measured").as_double() == stage(t, st).at("activations_predicted").as_double());
          CHECK(stage(t, st).at("send_bytes").as_double() == stage(t, st).at("send_predicted").as_double());
        }
      }
  // Recompute modes change the per-layer term, not the rule.
  for (const char* rc : {"--recompute full", "--recompute selective"})
    for (pp::Schedule s : {pp::kOneFOneB, pp::kZBH1}) {
      const Run& t = pipe(2, s, 4, 4, rc);
      for (int st = 0; st < 2; st++)
        CHECK(stage(t, st).at("activations_measured").as_double() == stage(t, st).at("activations_predicted").as_double());
    }
  // The closed forms for 1F1B and AFAB (tiny, 4 layers, pp 4: n = 1 layer per stage, b·s = 32 tokens):
  // stage 0 holds k micro-batches: (k·n − 1)·saved + complete + the output, k = p − s or m.
  const ModelConfig c{64, 4, 4, 2, 160, 256, 32};
  const double S = layer_activation_bytes(c, DType::F32, Recompute::None), out = 64 * 4;
  const int p = 4, m = 8;
  CHECK(stage(pipe(p, pp::kOneFOneB, 4, m), 0).at("activations_measured").as_double() == 32 * (p * S + out));
  CHECK(stage(pipe(p, pp::kAFAB, 4, m), 0).at("activations_measured").as_double() == 32 * (m * S + out));
  // Params: stage 0 holds the embedding and one layer of the four.
  const Run& t = pipe(p, pp::kOneFOneB, 4, m);
  const double layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64 + 2 * 64;  // q, o; k, v (kv dim 32); the MLP; two norms
  CHECK(t.log.summary.at("memory").at("params").at("measured").as_double() == 4 * (256 * 64 + layer));
  CHECK(t.log.summary.at("comm").at("pp").at("send").at("bytes").as_double() == m * 32 * 64 * 4.0);
}

// ----- uneven stages ----------------------------------------------------------------------------------

TEST_CASE("the default split: even where p·V divides L, else the last stage and then the first one layer lighter",
          "[05][split]") {
  using V = std::vector<int>;
  CHECK(pp::balanced_split(4, 2) == V{2, 2});
  CHECK(pp::balanced_split(5, 2) == V{3, 2});
  CHECK(pp::balanced_split(6, 4) == V{1, 2, 2, 1});
  CHECK(pp::balanced_split(5, 4) == V{1, 2, 1, 1});  // three short: last, first, then the last but one
  V llama(16, 8);
  llama.front() = llama.back() = 7;  // Llama 3 405B: 126 layers on 16 stages
  CHECK(pp::balanced_split(126, 16) == llama);
  for (int L = 1; L <= 40; L++)
    for (int K = 1; K <= L; K++) {
      const V s = pp::balanced_split(L, K);
      CHECK(std::accumulate(s.begin(), s.end(), 0) == L);
      CHECK(*std::max_element(s.begin(), s.end()) - *std::min_element(s.begin(), s.end()) <= 1);
    }
  CHECK(pp::stage_split("1,3", 4, 2) == V{1, 3});
  // Units: stage k runs the layers after stages 0..k-1; the embedding with the first, the head with the last.
  CHECK(pp::stage_units({1, 3}, 0) == std::make_pair(0, 2));
  CHECK(pp::stage_units({1, 3}, 1) == std::make_pair(2, 6));
  CHECK(pp::stage_units({1, 2, 1, 1}, 2) == std::make_pair(4, 5));
}

// Stage 0 of 3 layers and stage 1 of 2: F costs 3 and 2 slots, B 6 and 4. AFAB: stage 0's eight F end
// at 24, stage 1's first B can start only after its last F (24..26), so stage 0's first B waits for
// stage 1's B of micro-batch 0 (26..30): 6 idle slots = stage 1's F and B of one micro-batch, over
// stage 0's 8·9 busy ones. The busiest stage sets the pace: 3 of 5 layers, 1.2× an even stage's.
TEST_CASE("uneven stages in the simulator: costs by layers, the bubble over the busiest stage", "[05][split][schedule]") {
  const pp::SimulatedPlan a = pp::simulated_plan(2, 8, 1, pp::kAFAB, {3, 2});
  CHECK(a.complete);
  CHECK(a.busy(0) == 72);
  CHECK(a.busy(1) == 48);
  CHECK(a.makespan == 78);
  CHECK(a.bubble() == Approx(6.0 / 72).epsilon(1e-12));
  CHECK(a.busiest_share() == Approx(1.2).epsilon(1e-12));
  // Equal layers in every stage: the unit-cost schedule, slot for slot.
  for (pp::Schedule s : kAll) {
    const int V = s == pp::kInterleaved ? 2 : 1;
    const pp::SimulatedPlan even = pp::simulated_plan(4, 8, V, s, std::vector<int>(size_t(4 * V), 3));
    const pp::SimulatedPlan unit = pp::simulated_plan(4, 8, V, s);
    CHECK(even.makespan == unit.makespan);
    CHECK(even.bubble() == unit.bubble());
  }
  for (pp::Schedule s : kAll)
    for (int m : {2, 4, 6}) {
      const int V = s == pp::kInterleaved ? 2 : 1;
      const std::vector<int> split = V == 2 ? std::vector<int>{1, 3, 2, 1} : std::vector<int>{1, 4};
      const pp::SimulatedPlan pl = pp::simulated_plan(2, m, V, s, split);
      INFO(pp::schedule_name(s) << " m " << m);
      CHECK(pl.complete);
      if (s != pp::kInterleaved) CHECK(pp::completes_under_rendezvous(pl));
    }
}

// Every schedule on uneven stages: 5 layers on pp 2 (3, 2 by default, or 1, 4 as given), on pp 2 × V 2
// (1, 2, 1, 1), and 6 layers on pp 4 (1, 2, 2, 1): 01's losses and weights, each stage's memory and
// sends as predicted.
TEST_CASE("uneven stages under every schedule reproduce 01; each stage's memory as predicted", "[05][e2e][equiv][split]") {
  struct Uneven {
    int p;
    pp::Schedule s;
    int layers;
    std::string split;
  };
  const Uneven cases[] = {{2, pp::kAFAB, 5, ""},        {2, pp::kOneFOneB, 5, ""},
                          {2, pp::kZBH1, 5, "1,4"},     {2, pp::kInterleaved, 5, ""},
                          {4, pp::kOneFOneB, 6, ""},    {4, pp::kZBH1, 6, ""},
                          {2, pp::kInterleaved, 6, "2,1,1,2"}};
  for (const Uneven& c : cases) {
    const std::string flag = c.split.empty() ? "" : "--stage-layers " + c.split;
    const Run& ref = single(c.layers, 8);
    const Run& t = pipe(c.p, c.s, c.layers, 8, flag);
    INFO(pp::schedule_name(c.s) << " pp " << c.p << " layers " << c.layers << " " << flag);
    REQUIRE(t.log.steps.size() == size_t(kSteps));
    check_same_kernels(t, ref);
    check_predicted(t, c.p);
  }
  // Stage 0 of "1,4" holds the embedding and one layer (params on rank 0, what the table reports).
  const double layer = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 160 * 64 + 2 * 64;
  CHECK(pipe(2, pp::kZBH1, 5, 8, "--stage-layers 1,4").log.summary.at("memory").at("params").at("measured").as_double() ==
        4 * (256 * 64 + layer));
}

// ----- checkpoints -----------------------------------------------------------------------------------

TEST_CASE("a pp 4 checkpoint resumes in 01 and at pp 2 on 01's curve", "[05][e2e][ckpt]") {
  const Run& ref = tst::cached_run("01_single_gpu", 1, kTiny + "--layers 4 --steps 6 --batch 8 --micro-batch 1");
  const Run& from = tst::cached_run("05_pipeline_parallel", 4,
                                    kTiny + "--layers 4 --steps 3 --batch 8 --micro-batch 1 --pp 4 --schedule 1f1b");
  tst::check_resume("01_single_gpu", 1, kTiny + "--layers 4 --steps 6 --batch 8 --micro-batch 1", from.ckpt, ref, 3);
  tst::check_resume("05_pipeline_parallel", 2,
                    kTiny + "--pp 2 --schedule zb-h1 --layers 4 --steps 6 --batch 8 --micro-batch 1", from.ckpt, ref, 3);
}

// ----- bad input ---------------------------------------------------------------------------------------

TEST_CASE("bad input: a one-line message, a non-zero exit on every rank, no hang", "[05][errors]") {
  tst::check_errors("05_pipeline_parallel", kTiny + "--steps 2 --batch 8 --micro-batch 1 ", {
      {2, "--pp 2 --layers 1", "--layers 1 is fewer than --pp 2 × --virtual-stages 1"},
      {2, "--pp 2 --layers 4 --schedule interleaved --virtual-stages 4 --batch 8", "--layers 4 is fewer than --pp 2 × --virtual-stages 4"},
      {2, "--pp 2 --layers 4 --stage-layers 1,2", "--stage-layers '1,2' gives 2 stages of 3 layers in all; this run has pp × virtual stages = 2 stages and --layers 4"},
      {2, "--pp 2 --layers 4 --stage-layers 4,0", "--stage-layers '4,0': '0' is not a layer count from 1 to 4"},
      {2, "--pp 2 --layers 4 --stage-layers 2,,2", "'' is not a layer count"},
      {4, "--pp 4 --layers 8 --schedule interleaved --virtual-stages 2 --batch 6", "to be a multiple of --pp 4"},
      {2, "--pp 2 --layers 4 --schedule gpipe", "unknown --schedule 'gpipe'"},
      {2, "--pp 2 --layers 4 --virtual-stages 2", "--virtual-stages 2 needs --schedule interleaved"},
      {2, "--pp 2 --layers 6 --schedule dualpipev", "--schedule dualpipev needs --layers 6 divisible by 2 × --pp 2 = 4 stages"},
      {2, "--pp 2 --layers 4 --schedule dualpipev --batch 3", "needs at least 2 × --pp 2 = 4 micro-batches per step (got 3 = batch 3 / micro-batch 1)"},
      {2, "--pp 2 --layers 4 --schedule dualpipev --virtual-stages 3", "--schedule dualpipev places two stages on each rank"},
      {2, "--pp 4 --layers 4", "needs 4 ranks but the job has 2"},
  });
}
