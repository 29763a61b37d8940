// ranks: 1
// 08_5d_mesh: the pieces of 02, 03, 04, 05, 06 and 07 composed on one mesh reproduce 01 end to end
// (fp32, clipping active, accumulation), at up to 8 ranks; memory and bytes per rank per group
// equal the predictions; checkpoints cross between meshes and 01; bad input.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>

#include "test_util.h"

namespace {

// kv heads 4: tp 4 gives every rank a whole kv head.
const std::string kTiny = "--preset tiny --kv-heads 4 --quiet --lr-schedule constant ";
const int kSteps = 6;
using Run = tst::CachedRun;

const Run& run(const std::string& bin, int np, const std::string& args) { return tst::cached_run(bin, np, kTiny + args, 240); }
const Run& single(const std::string& args) { return run("01_single_gpu", 1, args); }
const Run& mesh(int dp, int tp, const std::string& args, int cp = 1, int pp = 1) {
  return run("08_5d_mesh", dp * tp * cp * pp, "--dp " + std::to_string(dp) + " --tp " + std::to_string(tp) + " " + args);
}
std::string steps(int batch, int micro) { return tst::steps_args(kSteps, batch, micro); }
double mem(const Run& r, const char* cat, const char* which) {
  return r.log.summary.at("memory").at(cat).at(which).as_double();
}

// Stage by stage: each stage's dp group reduces its own units, so rank 0's bytes are stage 0's.
void check_stage_comm(const Run& r) {
  for (const char* op : {"all_reduce", "all_gather", "reduce_scatter"}) {
    if (!r.log.summary.at("comm").contains("dp") || !r.log.summary.at("comm").at("dp").contains(op)) continue;
    const ts::Json& g = r.log.summary.at("comm").at("dp").at(op);
    CHECK(g.at("bytes").as_double() == Approx(g.at("predicted").as_double()).epsilon(1e-12));
  }
}

struct Case {
  int dp, tp;
  std::string flags;
  int micro;
  int cp = 1, pp = 1;
};
// Each composition at the same global batch of 8 sequences.
const Case kCases[] = {
    {2, 2, "--sequence-parallel", 2},            // plain DP (bucketed) × TP + SP, accumulation 2
    {4, 2, "--zero 1", 2},                       // ZeRO-1 over dp 4 × TP 2
    {4, 2, "--zero 2 --sequence-parallel", 1},   // ZeRO-2 × TP + SP, accumulation 2
    {2, 4, "--zero 3 --sequence-parallel", 4},   // ZeRO-3 × TP 4 + SP
    {2, 2, "--cp 2 --sequence-parallel", 4, 2},  // DP × CP ring (zigzag) × TP + SP
    {2, 2, "--cp 2 --cp-mode ulysses", 4, 2},    // DP × CP Ulysses × TP
    {2, 2, "--cp 2 --zero 3 --sequence-parallel", 2, 2},  // ZeRO-3 over dp × cp, ring, TP + SP
};
// With a pipeline: 4 layers so that pp 2 × V 2 has a layer per virtual stage (01 runs the same).
const std::string kPipe = "--layers 4 ";
const Case kPipeCases[] = {
    {2, 2, "--pp 2 --micro-batch 2", 2, 1, 2},                                        // dp × tp × pp, 1F1B
    {2, 2, "--pp 2 --schedule interleaved --virtual-stages 2 --sequence-parallel", 2, 1, 2},  // interleaved, SP
    {1, 2, "--pp 2 --cp 2 --sequence-parallel", 2, 2, 2},                             // tp × cp × pp, SP
    {4, 1, "--pp 2 --zero 1", 1, 1, 2},                                               // dp 4 × pp 2, ZeRO-1
    {2, 1, "--pp 2 --zero 2", 2, 1, 2},                                               // ZeRO-2 × pp, accumulation 2
    {2, 2, "--pp 2 --zero 2 --sequence-parallel --schedule interleaved --virtual-stages 2", 1, 1, 2},  // + SP, interleaved
    {2, 2, "--pp 2 --zero 1 --sequence-parallel", 1, 1, 2},                           // ZeRO-1 + SP: per-unit norm sums
    {2, 1, "--pp 2 --schedule zb-h1 --bucket-mb 0.01", 1, 1, 2},                      // 02's buckets under B/W split
    {2, 1, "--pp 2 --schedule zb-h1 --zero 1", 1, 1, 2},                              // ZeRO-1 under B/W split
    {1, 2, "--pp 2 --schedule zb-h1", 1, 1, 2},                                       // W on tp's column/row blocks
    {2, 2, "--pp 2 --schedule zb-h1 --zero 1 --sequence-parallel", 1, 1, 2},          // SP: W keeps f's gathered input
};
// DualPipeV: 05's V, rank s holding stages s and 2·pp − 1 − s (rank 0 the embedding and the head);
// the 4 layers are its 2·pp = 4 stages at pp 2, and m >= 2·pp = 4 micro-batches per dp rank.
const Case kDualPipeCases[] = {
    {1, 1, "--pp 2 --schedule dualpipev", 1, 1, 2},                   // the V alone, m = 8
    {2, 1, "--pp 2 --schedule dualpipev --bucket-mb 0.01", 1, 1, 2},  // dp 2: 02's buckets under the V
    {2, 1, "--pp 2 --schedule dualpipev --zero 1", 1, 1, 2},          // dp 2: ZeRO-1 per unit
    {1, 1, "--pp 2 --cp 2 --schedule dualpipev", 1, 2, 2},            // cp 2 (ring, zigzag) × the V
    {1, 2, "--pp 2 --schedule dualpipev --sequence-parallel --async-tp", 1, 1, 2},  // tp 2 + SP, 04a's rings
};
// Uneven stages: 5 layers, 3 and 2 by default, 1 and 4 as given, 1, 2, 1, 1 interleaved.
const std::string kPipe5 = "--layers 5 ";
const Case kUnevenCases[] = {
    {2, 1, "--pp 2", 2, 1, 2},
    {2, 2, "--pp 2 --stage-layers 1,4 --zero 2 --sequence-parallel", 1, 1, 2},
    {1, 2, "--pp 2 --schedule interleaved --virtual-stages 2 --zero 0", 1, 1, 2},
};

// One pipelined mesh against 01: losses and weights, every memory category and the dp bytes as
// predicted.
const Run& check_pipe_case(const Case& c, const std::string& base, const Run& ref) {
  const Run& r = mesh(c.dp, c.tp, base + c.flags + " " + steps(8, c.micro), c.cp, c.pp);
  INFO("dp " << c.dp << " tp " << c.tp << " " << c.flags << " micro-batch " << c.micro);
  REQUIRE(r.log.steps.size() == size_t(kSteps));
  tst::check_equivalent(r, ref);
  for (const char* cat : {"params", "grads", "optimizer", "activations"})
    CHECK(mem(r, cat, "measured") == mem(r, cat, "predicted"));
  check_stage_comm(r);
  return r;
}

}  // namespace

// Equal to 01 by the one criterion of tests/test_util.h (check_equivalent).

TEST_CASE("dp × tp (+ sequence parallel) with plain DP and ZeRO-1/2/3 reproduce 01 (fp32, clipped)", "[08][e2e][equiv]") {
  const Run& ref = single(steps(8, 8));
  CHECK(ref.log.steps[0].at("grad_norm").as_double() > 1.2);  // clipping at 1.0 is active
  for (const Case& c : kCases) {
    const Run& r = mesh(c.dp, c.tp, c.flags + " " + steps(8, c.micro), c.cp);
    INFO("dp " << c.dp << " tp " << c.tp << " " << c.flags << " micro-batch " << c.micro);
    REQUIRE(r.log.steps.size() == size_t(kSteps));
    tst::check_equivalent(r, ref);
  }
}

TEST_CASE("with a pipeline: dp × tp × pp (1F1B, interleaved, ZB-H1 with and without SP), tp × cp × pp, ZeRO-1/2 × pp reproduce 01", "[08][e2e][equiv][pp]") {
  const Run& ref = single(kPipe + steps(8, 8));
  for (const Case& c : kPipeCases) {
    const Run& r = check_pipe_case(c, kPipe, ref);
    const ts::Json& pp = r.log.summary.at("comm").at("pp").at("send");
    CHECK(pp.at("bytes").as_double() == Approx(pp.at("predicted").as_double()).epsilon(1e-12));
  }
}

TEST_CASE("uneven stages and ZeRO under them reproduce 01; memory and bytes as predicted", "[08][e2e][equiv][pp]") {
  const Run& ref = single(kPipe5 + steps(8, 8));
  for (const Case& c : kUnevenCases) {
    check_pipe_case(c, kPipe5, ref);
  }
}

// Each rank's two stages in the V: pp rank 0's memory holds the embedding and the head, its sends
// are 05's count for the V's ends (2m tensors: nothing leaves its last stage or enters its first).
TEST_CASE("with DualPipeV: pp 2, dp 2 × pp 2 (buckets, ZeRO-1), cp 2 × pp 2 and tp 2 × pp 2 reproduce 01; memory and bytes as predicted",
          "[08][e2e][equiv][pp][dualpipev]") {
  const Run& ref = single(kPipe + steps(8, 8));
  for (const Case& c : kDualPipeCases) {
    const Run& r = check_pipe_case(c, kPipe, ref);
    CHECK(r.output.find("pipeline: dualpipev, 2 virtual stage(s) per rank of 1,1,1,1 layers") != std::string::npos);
    const ts::Json& pp = r.log.summary.at("comm").at("pp").at("send");
    CHECK(pp.at("bytes").as_double() == Approx(pp.at("predicted").as_double()).epsilon(1e-12));
    const double sp = c.flags.find("--sequence-parallel") != std::string::npos ? c.tp : 1;
    const double m = 8.0 / c.dp, tensor = 32.0 / c.cp / sp * 64 * 4;  // [b·s/(cp·sp), h] fp32 of micro-batch 1
    CHECK(pp.at("bytes").as_double() == 2 * m * tensor);
  }
}

// 02's buckets under a pipeline leave during the last micro-batch's backward (the cooldown), not
// after the flush: on every rank some bucket's all-reduce runs while a backward layer computes;
// ZeRO-1's per-unit reduce-scatters likewise (their own lane).
TEST_CASE("--trace: the DP reduction overlaps the pipeline's cooldown on every stage", "[08][e2e][overlap][pp]") {
  struct Traced {
    std::string flags;
    int lane;
    const char* prefix;
  };
  for (const Traced& t : {Traced{"", 1, "all_reduce bucket"}, Traced{"--zero 1", 2, "reduce_scatter unit"}}) {
    const std::string path = tst::scratch("pp_dp_trace" + std::to_string(t.lane) + ".json");
    const tst::Result r = tst::run_bin("08_5d_mesh", kTiny + kPipe + "--dp 2 --pp 2 --steps 2 --batch 8 --micro-batch 1 "
                                       "--bucket-mb 0.01 --trace " + path + " " + t.flags, 4, 240);
    INFO(t.flags << "\n" << r.output);
    REQUIRE(r.status == 0);
    const ts::Json ev = ts::Json::parse(ts::read_text_file(path)).at("traceEvents");
    std::map<int64_t, int> comms, overlapping;
    for (const ts::Json& e : ev.as_array()) {
      if (e.at("ph").as_string() != "X" || e.at("tid").as_int() != t.lane || e.at("name").as_string().rfind(t.prefix, 0) != 0)
        continue;
      const int64_t rank = e.at("pid").as_int();
      comms[rank]++;
      const double s = e.at("ts").as_double(), f = s + e.at("dur").as_double();
      for (const ts::Json& c : ev.as_array())
        if (c.at("ph").as_string() == "X" && c.at("pid").as_int() == rank && c.at("tid").as_int() == 0 &&
            c.at("name").as_string().rfind("bwd layer", 0) == 0 && c.at("ts").as_double() < f &&
            s < c.at("ts").as_double() + c.at("dur").as_double()) {
          overlapping[rank]++;
          break;
        }
    }
    for (int64_t rank = 0; rank < 4; rank++) {
      INFO("rank " << rank);
      CHECK(comms[rank] > 2);
      CHECK(overlapping[rank] > 0);
    }
  }
}

TEST_CASE("memory and bytes per rank and group equal the composed predictions", "[08][e2e][mem][comm]") {
  for (const Case& c : kCases) {
    const Run& r = mesh(c.dp, c.tp, c.flags + " " + steps(8, c.micro), c.cp);
    INFO("dp " << c.dp << " tp " << c.tp << " " << c.flags);
    for (const char* cat : {"params", "grads", "optimizer", "activations"})
      CHECK(mem(r, cat, "measured") == mem(r, cat, "predicted"));
    int ops = 0;
    for (const char* group : {"dp", "dp_cp", "tp", "cp"})
      for (const char* op : {"all_reduce", "all_gather", "reduce_scatter", "send", "all_to_all"}) {
        if (!r.log.summary.at("comm").contains(group)) continue;
        const ts::Json& g = r.log.summary.at("comm").at(group);
        if (!g.contains(op)) continue;
        ops++;
        CHECK(g.at(op).at("bytes").as_double() == Approx(g.at(op).at("predicted").as_double()).epsilon(1e-12));
        CHECK(g.at(op).at("predicted").as_double() > 0);
      }
    CHECK(ops >= 2 + (c.cp > 1));  // every group communicates
  }
  // ZeRO-3 over dp 2 on tp 4 blocks holds less than plain DP's tp 2 replica.
  CHECK(mem(mesh(2, 4, "--zero 3 --sequence-parallel " + steps(8, 4)), "optimizer", "measured") <
        mem(mesh(2, 2, "--sequence-parallel " + steps(8, 2)), "optimizer", "measured"));
}

TEST_CASE("HSDP (03a) on the mesh: dp 4 × tp 2 ZeRO-3 and dp 2 × cp 2 ZeRO-1 in shard groups of 2 reproduce 01; "
          "memory and bytes as predicted", "[08][03a][e2e][equiv][mem][comm]") {
  const Run& ref = single(steps(8, 8));
  for (const Case& c : {Case{4, 2, "--zero 3 --dp-shard 2 --sequence-parallel", 2}, Case{2, 1, "--cp 2 --zero 1 --dp-shard 2", 2, 2}}) {
    const Run& r = mesh(c.dp, c.tp, c.flags + " " + steps(8, c.micro), c.cp);
    INFO("dp " << c.dp << " tp " << c.tp << " cp " << c.cp << " " << c.flags << "\n" << r.output);
    REQUIRE(r.log.steps.size() == size_t(kSteps));
    tst::check_equivalent(r, ref);
    for (const char* cat : {"params", "grads", "optimizer", "activations"})
      CHECK(mem(r, cat, "measured") == mem(r, cat, "predicted"));
    // The shard group's reduce-scatter and the replicas' all-reduce, each as predicted.
    for (auto [group, op] : {std::pair{"dp_shard", "reduce_scatter"}, std::pair{"dp_replicate", "all_reduce"}}) {
      const ts::Json& g = r.log.summary.at("comm").at(group).at(op);
      CHECK(g.at("bytes").as_double() == Approx(g.at("predicted").as_double()).epsilon(1e-12));
      CHECK(g.at("bytes").as_double() > 0);
    }
  }
}

TEST_CASE("a dp 2 × tp 2 checkpoint resumes in 01 on its curve, and on dp 1 × tp 4 with ZeRO-3 off", "[08][e2e][ckpt]") {
  const Run& ref = single(steps(8, 8));
  const Run& from = mesh(2, 2, "--zero 1 --steps 3 --batch 8");
  tst::check_resume("01_single_gpu", 1, kTiny + "--steps 6 --batch 8", from.ckpt, ref, 3);
  tst::check_resume("08_5d_mesh", 4, kTiny + "--dp 1 --tp 4 --steps 6 --batch 8", from.ckpt, ref, 3);
  // A dp 2 × tp 2 × pp 2 checkpoint: every stage wrote its units; it resumes in 01 and on tp 4 × pp 2.
  const Run& ref4 = single(kPipe + steps(8, 8));
  const Run& piped = mesh(2, 2, kPipe + "--pp 2 --steps 3 --batch 8 --micro-batch 2", 1, 2);
  tst::check_resume("01_single_gpu", 1, kTiny + kPipe + "--steps 6 --batch 8", piped.ckpt, ref4, 3);
  tst::check_resume("08_5d_mesh", 8, kTiny + kPipe + "--dp 1 --tp 4 --pp 2 --steps 6 --batch 8 --micro-batch 2",
                    piped.ckpt, ref4, 3);
}

// The planner's memory is the runs' own prediction: for meshes it ranks, it equals what a run of
// that mesh measures (params + grads + optimizer + activations at their peaks).
TEST_CASE("--plan: the planner's memory per GPU equals what a run of the mesh measures", "[08][plan]") {
  const std::string log = tst::scratch("plan.jsonl");
  tst::Result r = tst::run_bin("08_5d_mesh", kTiny + "--plan --plan-exhaustive --gpus 8 --dtype fp32 --batch 8 --log-json " + log, 1, 60);
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK(r.output.find("rank mesh") != std::string::npos);
  const ts::Json cands = tst::read_log(log).summary.at("candidates");
  REQUIRE(cands.size() > 10);
  int compared = 0;
  for (const Case& c : kCases) {
    const Run& run = mesh(c.dp, c.tp, c.flags + " " + steps(8, c.micro), c.cp);
    const bool sp = c.flags.find("--sequence-parallel") != std::string::npos;
    const int zero = c.flags.find("--zero ") != std::string::npos ? c.flags[c.flags.find("--zero ") + 7] - '0' : 0;
    if (c.cp > 1 || (c.tp > 1) != sp) continue;  // the planner searches cp only for long sequences, and uses SP with tp
    for (const ts::Json& k : cands.as_array()) {
      if (k.at("dp").as_int() != c.dp || k.at("tp").as_int() != c.tp || k.at("zero").as_int() != zero ||
          k.at("pp").as_int() != 1 || k.at("cp").as_int() != 1 ||
          k.at("micro_batch").as_int() != c.micro || k.at("recompute").as_string() != "none")
        continue;
      double measured = 0;
      for (const char* cat : {"params", "grads", "optimizer", "activations"}) measured += mem(run, cat, "measured");
      INFO("dp " << c.dp << " tp " << c.tp << " " << c.flags);
      CHECK(k.at("memory_bytes").as_double() == measured);
      compared++;
    }
  }
  CHECK(compared >= 2);
  // And a pipeline mesh it ranks: the fuller stage's memory (here stage 0, the one a run reports).
  const std::string log4 = tst::scratch("plan4.jsonl");
  tst::Result r4 = tst::run_bin("08_5d_mesh", kTiny + kPipe + "--plan --plan-exhaustive --gpus 8 --dtype fp32 --batch 8 --log-json " + log4, 1, 60);
  REQUIRE(r4.status == 0);
  const Case& pc = kPipeCases[1];  // dp 2 × tp 2 (+ SP, as the planner pairs them) × pp 2, interleaved
  const Run& piped = mesh(pc.dp, pc.tp, kPipe + pc.flags + " " + steps(8, pc.micro), pc.cp, pc.pp);
  double measured = 0;
  for (const char* cat : {"params", "grads", "optimizer", "activations"}) measured += mem(piped, cat, "measured");
  int found = 0;
  const tst::Log plan4 = tst::read_log(log4);  // kept: the loop reads into it
  for (const ts::Json& k : plan4.summary.at("candidates").as_array())
    if (k.at("dp").as_int() == 2 && k.at("tp").as_int() == 2 && k.at("pp").as_int() == 2 && k.at("cp").as_int() == 1 &&
        k.at("virtual_stages").as_int() == 2 && k.at("zero").as_int() == 0 && k.at("micro_batch").as_int() == 2 &&
        k.at("recompute").as_string() == "none") {
      found++;
      CHECK(k.at("memory_bytes").as_double() == measured);
      CHECK(k.at("bubble").as_double() > 0);
    }
  CHECK(found == 1);
  // One given mesh: the prediction for 8B at dp 8 × tp 8 on 64 H100s is printed with its parts.
  tst::Result one = tst::run_bin("08_5d_mesh", "--plan --preset 8b --gpus 64 --dp 8 --tp 8 --zero 1 --micro-batch 1", 1, 60);
  INFO(one.output);
  CHECK(one.status == 0);
  CHECK(one.output.find("memory per GPU") != std::string::npos);
  CHECK(one.output.find("tok/s/GPU") != std::string::npos);
}

// When nothing fits, the planner names the least memory any candidate needs: here tp 8 with full
// recomputation, the mesh that shards the most on one node, priced alone.
TEST_CASE("--plan: when no mesh fits, the smallest candidate's memory is named", "[08][plan]") {
  const std::string shape = "--plan --preset 70b --gpus 8 --seq 4096 --global-batch-tokens 1048576";
  tst::Result all = tst::run_bin("08_5d_mesh", shape, 1, 60);
  tst::Result one = tst::run_bin("08_5d_mesh", shape + " --dp 1 --tp 8 --zero 0 --recompute full --micro-batch 1", 1, 60);
  INFO(all.output << one.output);
  REQUIRE(all.status == 0);
  REQUIRE(one.status == 0);
  auto after = [](const std::string& s, const std::string& key) {
    const size_t at = s.find(key);
    return at == std::string::npos ? std::string() : s.substr(at + key.size(), s.find(" per GPU", at) - at - key.size());
  };
  const std::string least = after(all.output, "no mesh fits: the smallest needs ");
  CHECK(!least.empty());
  CHECK(least == after(one.output, "memory per GPU ").substr(0, least.size()));
  // 384 = 2^7 · 3 GPUs and 256 sequences: the factor 3 fits no dimension of this model.
  tst::Result none = tst::run_bin("08_5d_mesh", "--plan --preset 3b --gpus 384 --seq 4096 --global-batch-tokens 1048576", 1, 60);
  INFO(none.output);
  CHECK(none.status == 0);
  CHECK(none.output.find("no valid mesh on 384 GPUs: dp must divide the 256 sequences of a step, pp the 28 layers") !=
        std::string::npos);
}

TEST_CASE("bad input: a one-line message, a non-zero exit on every rank, no hang", "[08][errors]") {
  tst::check_errors("08_5d_mesh", kTiny + "--steps 2 ", {
      {4, "--dp 2 --tp 4", "needs 8 ranks but the job has 4"},
      {4, "--dp 2 --tp 2 --heads 2 --kv-heads 1", "--kv-heads 1 is not divisible by --tp 2"},
      {8, "--dp 2 --tp 4 --kv-heads 2", "--kv-heads 2 is not divisible by --tp 4"},
      {4, "--dp 1 --cp 2 --tp 2 --cp-mode ulysses --heads 4 --kv-heads 2 --tp 2", "must divide by --cp 2"},
      {4, "--dp 2 --cp 2 --seq 30", "--seq 30 is not divisible by 2·cp = 4"},
      {4, "--dp 2 --pp 2 --zero 3 --layers 4", "--zero 3 with --pp 2 is not composed"},
      {4, "--dp 2 --pp 2 --zero 2 --schedule zb-h1 --layers 4", "--zero 2 with --schedule zb-h1 is not composed"},
      {4, "--dp 2 --pp 2 --layers 1", "--layers 1 is fewer than --pp 2 × --virtual-stages 1"},
      {4, "--dp 2 --pp 2 --layers 4 --stage-layers 3,2", "--stage-layers '3,2' gives 2 stages of 5 layers in all"},
      {4, "--dp 4 --stage-layers 2", "--stage-layers needs --pp > 1"},
      {4, "--dp 2 --tp 2 --zero 4", "--zero must be 0 (plain DP), 1, 2 or 3"},
      {4, "--dp 4 --batch 6", "--batch 6 is not divisible by --dp 4"},
      {4, "--dp 2 --tp 2 --zero 1 --dp-mode naive", "--dp-mode applies to plain data parallelism"},
      {4, "--dp 4 --dp-shard 2", "--dp-shard 2 shards ZeRO's states: it needs --zero 1, 2 or 3"},
      {4, "--dp 4 --zero 3 --dp-shard 3", "--dp-shard 3 does not divide --dp (4 ranks)"},
      {4, "--dp 2 --pp 2 --layers 4 --rank-order tp-cp-dp-pp", "--rank-order must be dp-pp-cp-tp or pp-dp-cp-tp (got 'tp-cp-dp-pp')"},
  });
}

// DualPipeV's V is two stages per rank; what does not compose with its B/W split is refused as under ZB-H1.
TEST_CASE("bad input with DualPipeV: a one-line message, a non-zero exit on every rank, no hang", "[08][errors][dualpipev]") {
  tst::check_errors("08_5d_mesh", kTiny + "--steps 2 --batch 8 --schedule dualpipev ", {
      {4, "--dp 2 --pp 2 --layers 4 --virtual-stages 3",
       "--schedule dualpipev places two stages on each rank (stage s and stage 2·pp − 1 − s), not --virtual-stages 3"},
      {4, "--dp 2 --pp 2 --layers 4 --virtual-stages 1", "not --virtual-stages 1"},
      {4, "--dp 4 --layers 4", "--schedule dualpipev needs --pp > 1"},
      {4, "--dp 2 --pp 2 --layers 6 --micro-batch 1", "--schedule dualpipev needs --layers 6 divisible by 2 × --pp 2 = 4 stages"},
      {4, "--dp 2 --pp 2 --layers 4 --micro-batch 2", "needs at least 2 × --pp 2 = 4 micro-batches per step (got 2"},
      {4, "--dp 2 --pp 2 --layers 4 --micro-batch 1 --zero 2", "--zero 2 with --schedule dualpipev is not composed"},
      {1, "--plan --gpus 16 --pp 4 --virtual-stages 4", "not --virtual-stages 4"},
      {1, "--plan --gpus 16 --zero 2", "--zero 2 with --schedule dualpipev is not composed"},  // before the search
  });
}

// ----- expert parallelism on the mesh ------------------------------------------------------------

namespace {
// The MoE model of test_ep (experts of ffn 64), with a load-balancing loss so that the router's
// aux gradient takes part; 01 --experts runs the same.
const std::string kMoe = "--experts 4 --top-k 2 --ffn 64 --aux-loss-coef 0.01 ";
// dp 4 × tp 2: ep 4 (ep_dp of 1), ep 2 (ep_dp of 2) and ep 1 (the MoE block replicated over dp
// and tp only); dp 2 × pp 2 × tp 2 with ep 2 (each stage's ep groups run the same 1F1B schedule).
const Case kMoeCases[] = {
    {4, 2, "--ep 4", 1},
    {4, 2, "--ep 2", 2},
    {4, 2, "", 2},
    {2, 2, "--pp 2 --ep 2", 2, 1, 2},
};
const Run& moe_mesh(const Case& c) { return mesh(c.dp, c.tp, kMoe + c.flags + " " + steps(8, c.micro), c.cp, c.pp); }
double mem_total(const Run& r, const char* which) {
  double t = 0;
  for (const char* cat : {"params", "grads", "optimizer", "activations"}) t += mem(r, cat, which);
  return t;
}
}  // namespace

TEST_CASE("MoE under tp with ep 4, ep 2, ep 1, and with a pipeline reproduces 01 --experts", "[08][e2e][equiv][ep]") {
  const Run& ref = single(kMoe + steps(8, 8));
  for (const Case& c : kMoeCases) {
    const Run& r = moe_mesh(c);
    INFO("dp " << c.dp << " tp " << c.tp << " pp " << c.pp << " " << c.flags << " micro-batch " << c.micro);
    REQUIRE(r.log.steps.size() == size_t(kSteps));
    tst::check_equivalent(r, ref);
    for (int s = 0; s < kSteps; s++) {
      const ts::Json& a = r.log.steps[size_t(s)];
      const ts::Json& b = ref.log.steps[size_t(s)];
      CHECK(a.at("moe_tokens_per_expert").dump() == b.at("moe_tokens_per_expert").dump());
      // The auxiliary loss is a forward quantity, under the loss bound.
      CHECK(a.at("moe_aux_loss").as_double() == Approx(b.at("moe_aux_loss").as_double()).epsilon(tst::equiv::kLossRel));
    }
  }
}

// Params, grads and optimizer states exactly (each rank holds E/ep experts, whole over tp);
// activations where routing does not move rows between ranks (ep 1: 07 predicts ep > 1 for
// balanced routing only); every group's bytes: ep's all-to-alls from the run's own routing counts,
// the dense group's all-reduce over the dense Ψ, ep_dp's over this rank's experts.
TEST_CASE("MoE on the mesh: memory and bytes per rank and group equal the predictions", "[08][e2e][mem][comm][ep]") {
  for (const Case& c : kMoeCases) {
    const Run& r = moe_mesh(c);
    INFO("dp " << c.dp << " tp " << c.tp << " pp " << c.pp << " " << c.flags);
    for (const char* cat : {"params", "grads", "optimizer"}) CHECK(mem(r, cat, "measured") == mem(r, cat, "predicted"));
    if (c.flags.find("--ep") == std::string::npos) CHECK(mem(r, "activations", "measured") == mem(r, "activations", "predicted"));
    const ts::Json& comm = r.log.summary.at("comm");
    int ops = 0;
    for (const char* group : {"dp", "tp", "pp", "ep", "ep_dp"})
      for (const char* op : {"all_reduce", "send", "all_to_all"}) {
        if (!comm.contains(group) || !comm.at(group).contains(op)) continue;
        const ts::Json& g = comm.at(group).at(op);
        ops++;
        CHECK(g.at("bytes").as_double() == Approx(g.at("predicted").as_double()).epsilon(1e-12));
        CHECK(g.at("predicted").as_double() > 0);
      }
    const bool ep = c.flags.find("--ep") != std::string::npos, ep_dp = c.flags.find("--ep 2") != std::string::npos && c.pp == 1;
    CHECK(comm.contains("ep") == ep);
    CHECK(comm.contains("ep_dp") == ep_dp);
    CHECK(ops == 2 + ep + ep_dp + (c.pp > 1));
  }
  // dp 4 × tp 2: ep 4 holds 1 of the 4 experts of each layer, ep 1 all 4 (each 3·F·D, fp32).
  const double D = 64, F = 64, L = 2;
  CHECK(mem(moe_mesh(kMoeCases[2]), "params", "measured") - mem(moe_mesh(kMoeCases[0]), "params", "measured") ==
        4 * L * 3 * 3 * F * D);
  // ep 4 and ep 2 at the same tokens: one expert in four stays local instead of one in two.
  CHECK(mem(moe_mesh(kMoeCases[0]), "params", "measured") < mem(moe_mesh(kMoeCases[1]), "params", "measured"));
}

// The split backward under a MoE block: between a layer's B and its W the deferred set holds the
// router's, each routed row's and the shared experts' output-gradient snapshots and inputs
// (lab/05_pipeline_parallel.h, deferred_set_per_token), not the dense MLP's. At ep 1 routing moves
// no rows between ranks, so the activations are exact; both schedules reproduce 01 --experts.
TEST_CASE("MoE under ZB-H1 and DualPipeV: ≡ 01 --experts, activations equal the deferred-set prediction", "[08][e2e][mem][ep][zb]") {
  for (const char* shared : {"", "--shared-experts 1 "})
    for (const char* schedule : {"zb-h1", "dualpipev"}) {
      INFO(schedule << " " << shared);
      const std::string model = kMoe + shared + "--layers 4 ";
      const Run& r = mesh(1, 1, model + "--pp 2 --schedule " + schedule + " " + steps(8, 1), 1, 2);
      tst::check_equivalent(r, single(model + steps(8, 8)));
      CHECK(mem(r, "activations", "measured") == mem(r, "activations", "predicted"));
    }
}

TEST_CASE("a dp 4 × tp 2 × ep 4 checkpoint resumes in 01 --experts and on dp 2 × pp 2 × tp 2 × ep 2", "[08][e2e][ckpt][ep]") {
  const Run& ref = single(kMoe + steps(8, 8));
  const Run& from = mesh(4, 2, kMoe + "--ep 4 --steps 3 --batch 8 --micro-batch 1");
  tst::check_resume("01_single_gpu", 1, kTiny + kMoe + steps(8, 8), from.ckpt, ref, 3);
  tst::check_resume("08_5d_mesh", 8, kTiny + kMoe + "--dp 2 --tp 2 --pp 2 --ep 2 " + steps(8, 2), from.ckpt, ref, 3);
}

// The planner ranks ep for a MoE model, and its memory for a mesh is that run's own prediction.
TEST_CASE("--plan with experts: ep is searched, its memory is the run's prediction", "[08][plan][ep]") {
  const std::string log = tst::scratch("plan_moe.jsonl");
  tst::Result r = tst::run_bin("08_5d_mesh", kTiny + kMoe + "--plan --plan-exhaustive --gpus 8 --dtype fp32 --batch 8 --log-json " + log, 1, 60);
  INFO(r.output);
  REQUIRE(r.status == 0);
  const tst::Log plan = tst::read_log(log);
  int eps = 0, found = 0;
  for (const ts::Json& k : plan.summary.at("candidates").as_array()) {
    eps += k.at("ep").as_int() > 1;
    CHECK(!k.at("sequence_parallel").as_bool());  // not composed with MoE
    if (k.at("ep").as_int() > 1) CHECK(k.at("zero").as_int() == 0);
    if (k.at("dp").as_int() == 4 && k.at("tp").as_int() == 2 && k.at("ep").as_int() == 4 && k.at("pp").as_int() == 1 &&
        k.at("micro_batch").as_int() == 1 && k.at("recompute").as_string() == "none") {
      found++;
      CHECK(k.at("memory_bytes").as_double() == Approx(mem_total(moe_mesh(kMoeCases[0]), "predicted")).epsilon(1e-12));
    }
  }
  CHECK(eps > 10);
  CHECK(found == 1);
}

// ----- DeepSeekMoE on the mesh ---------------------------------------------------------------------

namespace {
// test_ep's DeepSeekMoE: fine-grained routed experts, a shared expert, the sigmoid router with its
// bias moved after every step, group-limited routing, the sequence-wise balance loss.
const std::string kDeepSeek = "--experts 8 --top-k 2 --ffn 64 --expert-ffn 32 --shared-experts 1 --router sigmoid "
                              "--routed-scaling 2.5 --expert-groups 4 --group-limit 2 --aux-loss-coef 0.001 "
                              "--bias-update-rate 0.002 ";
// Every layer's routing bias in a checkpoint (model.layers.{l}.mlp.gate.e_score_correction_bias).
std::vector<std::pair<std::string, std::vector<float>>> routing_biases(const Run& r) {
  std::vector<std::pair<std::string, std::vector<float>>> b;
  for (auto& t : tst::read_tensors(r.ckpt + "/model.safetensors"))
    if (t.first.find(".e_score_correction_bias") != std::string::npos) b.push_back(t);
  return b;
}
}  // namespace

// The bias moves by each layer's loads summed over the ranks that route different tokens (dp, the
// ep ranks cut from it), once per tp group: the routing counts of every step and the final bias
// equal 01's bit for bit, the rest by notes/00's fp32 criterion. (dp, tp, ep) = (2, 2, 2), and
// ZeRO-1 over dp (fp32: no master copies to shard) with the MoE block replicated over dp and tp;
// and dp 2 × pp 2 × ep 2, each stage moving its own layers' biases.
TEST_CASE("DeepSeekMoE with the bias update under tp (with ep, with ZeRO-1) and pp reproduces 01; the bias bit for bit",
          "[08][e2e][equiv][ep]") {
  const Run& ref = single(kDeepSeek + steps(8, 8));
  const auto bias = routing_biases(ref);
  REQUIRE(bias.size() == 2);
  CHECK(*std::max_element(bias[1].second.begin(), bias[1].second.end()) > 0);  // the bias moved
  for (const char* flags : {"--ep 2 ", "--zero 1 "}) {
    const Run& r = mesh(2, 2, kDeepSeek + flags + steps(8, 2));
    INFO("dp 2 tp 2 " << flags);
    REQUIRE(r.log.steps.size() == size_t(kSteps));
    tst::check_equivalent(r, ref);
    for (size_t s = 0; s < size_t(kSteps); s++)
      CHECK(r.log.steps[s].at("moe_tokens_per_expert").dump() == ref.log.steps[s].at("moe_tokens_per_expert").dump());
    CHECK(routing_biases(r) == bias);
  }
  // Under a pipeline each stage moves its own layers' biases, from the loads summed over pp too;
  // the same with the stages outermost (DeepSeek-V3's placement: a stage's ep group on neighbouring
  // ranks, here ranks 0 and 1 instead of 0 and 2).
  const Run& ref4 = single(kDeepSeek + "--layers 4 " + steps(8, 8));
  const auto bias4 = routing_biases(ref4);
  REQUIRE(bias4.size() == 4);
  for (const std::string order : {"", "--rank-order pp-dp-cp-tp "}) {
    const Run& r = mesh(2, 1, kDeepSeek + "--pp 2 --layers 4 --ep 2 " + order + steps(8, 2), 1, 2);
    INFO("dp 2 pp 2 ep 2 " << order << r.output);
    REQUIRE(r.log.steps.size() == size_t(kSteps));
    CHECK(r.output.find("pp 2 x cp 1 x tp 1 (ep 2), tp innermost" + std::string(order.empty() ? "\n" : ", pp outermost\n")) !=
          std::string::npos);
    CHECK(r.output.find(order.empty() ? "rank 0: dp=0 pp=0 cp=0 tp=0 ep=0 | dp {0,2} pp {0,1} ep {0,2}"
                                      : "rank 0: dp=0 pp=0 cp=0 tp=0 ep=0 | dp {0,1} pp {0,2} ep {0,1}") != std::string::npos);
    tst::check_equivalent(r, ref4);
    for (size_t s = 0; s < size_t(kSteps); s++)
      CHECK(r.log.steps[s].at("moe_tokens_per_expert").dump() == ref4.log.steps[s].at("moe_tokens_per_expert").dump());
    CHECK(routing_biases(r) == bias4);
  }
}

TEST_CASE("bad input with experts: a one-line message, a non-zero exit on every rank, no hang", "[08][errors][ep]") {
  tst::check_errors("08_5d_mesh", kTiny + "--steps 2 ", {
      {4, "--dp 4 --ep 2", "--ep 2 needs a mixture of experts"},
      {4, "--dp 4 --ep 3 --experts 6 --batch 12", "--ep 3 does not divide dp × cp = 4"},
      {4, "--dp 4 --ep 4 --experts 6", "--experts 6 is not divisible by --ep 4"},
      {4, "--dp 4 --ep 2 --experts 4 --zero 1", "expert weights differ across the dp ranks of an ep group"},
      {4, "--dp 2 --tp 2 --experts 4 --sequence-parallel", "--sequence-parallel with --experts is not composed"},
      {4, "--dp 2 --cp 2 --experts 4", "--experts with --cp 2 is not composed"},
      {4, "--dp 4 --experts 4 --router sigmoid --bias-update-rate 0.001 --zero 3",
       "--bias-update-rate with --zero 3 is not composed"},
      {4, "--dp 4 --experts 4 --router sigmoid --bias-update-rate 0.001 --zero 2 --dtype bf16",
       "--bias-update-rate with --zero 2 and fp32 master weights is not composed"},
  });
  // The chapters that do not move the bias name those that do.
  tst::check_errors("04_tensor_parallel", kTiny + "--steps 2 ", {
      {2, "--tp 2 --experts 4 --router sigmoid --bias-update-rate 0.001", "(01, 07 and 08 do)"},
  });
  // --plan trains nothing: the mesh a run refuses for the bias update is still planned.
  const tst::Result plan = tst::run_bin("08_5d_mesh", kTiny + "--layers 4 --experts 4 --router sigmoid "
                                        "--bias-update-rate 0.001 --plan --gpus 4 --dp 2 --pp 2 --cp 1 --tp 1", 1, 60);
  INFO(plan.output);
  CHECK(plan.status == 0);
  CHECK(plan.output.find("error") == std::string::npos);
  // One line for the whole job: rank 0 prints it, the other ranks exit with it unprinted.
  tst::Result r = tst::run_bin("08_5d_mesh", kTiny + "--steps 2 --dp 4 --ep 2 --experts 4 --zero 1", 4, 60);
  int lines = 0;
  for (size_t at = r.output.find("error"); at != std::string::npos; at = r.output.find("error", at + 1)) lines++;
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(lines == 1);
}
