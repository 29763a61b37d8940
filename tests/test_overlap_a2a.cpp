// ranks: 1
// 07b_overlap_a2a.cu (07 --overlap-a2a) against 07 and 01: the same arithmetic in another order of
// waiting, so bit for bit 07 without the flag and by the fp32 criterion 01, at (dp, ep) ∈ {(2, 2),
// (4, 2), (4, 4)} with 2 and 4 micro-batches per rank, under full recompute, with OpenBLAS's
// SkylakeX kernels, and on the emulated GPU (NCCL's grouped send/recv on the ep group's stream); the
// trace shows an all-to-all in flight while a layer of the other micro-batch starts; 08 at dp × tp ×
// ep; a seeded bug (a combine read before its all-to-all completes) fails the criterion; bad input.
#include <catch2/catch.hpp>

#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "formats/json.h"
#include "test_util.h"

namespace {

const std::string kMoe = "--preset tiny --experts 4 --top-k 2 --ffn 64 --quiet --lr-schedule constant ";
using Run = tst::CachedRun;
std::string mesh(int dp, int ep, int micro) {
  return "--dp " + std::to_string(dp) + " --ep " + std::to_string(ep) + " " + tst::steps_args(4, 8, micro) + " ";
}
const Run& expert(int dp, int ep, int micro, bool overlap, const std::string& rest = "", const std::string& env = "") {
  return tst::cached_run("07_expert_parallel", dp, kMoe + mesh(dp, ep, micro) + (overlap ? "--overlap-a2a " : "") + rest,
                         300, env);
}
const Run& single(const std::string& rest = "") { return tst::cached_run("01_single_gpu", 1, kMoe + tst::steps_args(4, 8, 8) + " " + rest); }
bool bitwise(const Run& a, const Run& b) {
  return a.log.losses() == b.log.losses() &&
         tst::max_abs_diff_files(a.ckpt + "/model.safetensors", b.ckpt + "/model.safetensors") == 0.0;
}

}  // namespace

// Each parameter's gradient gets the pair's first micro-batch's share before the second's, as in
// 07's one-after-another order, and every sum is the same: bit for bit.
TEST_CASE("--overlap-a2a reproduces 07 bit for bit and 01 (fp32) at ep 2 and 4, with dp and accumulation",
          "[07b][e2e][equiv]") {
  const Run& ref = single();
  for (auto [dp, ep, micro] : {std::tuple<int, int, int>{2, 2, 2}, {2, 2, 1}, {4, 2, 1}, {4, 4, 1}}) {
    INFO("dp " << dp << " ep " << ep << " micro-batch " << micro);
    const Run& r = expert(dp, ep, micro, true);
    tst::check_equivalent(r, ref);
    CHECK(bitwise(r, expert(dp, ep, micro, false)));
  }
  // Full recompute reruns each forward's all-to-alls inside the backward, handing over there too.
  const std::string full = "--recompute full";
  tst::check_equivalent(expert(4, 4, 1, true, full), single(full));
}

TEST_CASE("--overlap-a2a with OpenBLAS's SkylakeX kernels reproduces 01", "[07b][e2e][equiv]") {
  const std::string env = "OPENBLAS_CORETYPE=SkylakeX";
  tst::check_equivalent(expert(4, 2, 1, true, "", env), tst::cached_run("01_single_gpu", 1, kMoe + tst::steps_args(4, 8, 8), 180, env));
}

// A pair's activations are alive at once. A leads B by one turn, so when A stands at its peak (the
// end of its forward, or its last layer's forward) B waits on its last layer's combine, at its
// last-layer moment: measured = predicted to the byte (lab/07's schedule_activations), below twice
// one micro-batch's. Where routing moves no rows unevenly (every token to every expert: 2 experts
// top-2 at ep 2, 4 top-4 at ep 4), in 07 with dp, under full recompute, and in 08 with tp.
TEST_CASE("--overlap-a2a: activations measured = predicted, the pair priced at its peak turn", "[07b][e2e][mem]") {
  const std::string two = "--experts 2 --top-k 2 --dp 2 --ep 2 --micro-batch 2 --steps 2 ";
  const auto activations = [&](const char* bin, int np, const std::string& more) -> const ts::Json& {
    return tst::cached_run(bin, np, kMoe + more).log.summary.at("memory").at("activations");
  };
  const double one = activations("07_expert_parallel", 2, two).at("predicted").as_double();
  CHECK(activations("07_expert_parallel", 2, two).at("measured").as_double() == one);
  const std::string four = "--experts 4 --top-k 4 --dp 4 --ep 4 --batch 8 --micro-batch 1 --steps 2 ";
  for (auto [bin, np, args] : {std::tuple<const char*, int, std::string>{"07_expert_parallel", 2, two},
                               {"07_expert_parallel", 2, two + "--recompute full"},
                               {"07_expert_parallel", 4, four},
                               {"08_5d_mesh", 2, two},
                               {"08_5d_mesh", 4, "--experts 2 --top-k 2 --dp 2 --tp 2 --ep 2 --kv-heads 4 --batch 8 "
                                                 "--micro-batch 1 --steps 2"}}) {
    const ts::Json& m = activations(bin, np, args + " --overlap-a2a");
    INFO(bin << " " << args);
    CHECK(m.at("measured").as_double() == m.at("predicted").as_double());
  }
  // Here the end of the forward is one's peak (A) and the pair's is A + F, not 2A: 1,245,440 bytes
  // against 2 × 663,808.
  CHECK(activations("07_expert_parallel", 2, two + " --overlap-a2a").at("predicted").as_double() == 1245440);
  CHECK(one == 663808);
  // DeepSeekMoE's shared experts run after the combine, so B waits there without its last layer's
  // shared set and the pair's peak falls on a later turn (not derived): the prediction then exceeds
  // the measured peak by at most that set (3·Fs·e per token); here by 64 tokens × 256 B.
  const ts::Json& sh = activations("07_expert_parallel", 2, two + "--shared-experts 1 --overlap-a2a");
  CHECK(sh.at("predicted").as_double() - sh.at("measured").as_double() == 64 * 64 * 4);
}

// 08 runs the same schedule on its mesh where no pipeline orders the micro-batches: dp 2 × tp 2 ×
// ep 2 (each tp rank its own ep group's all-to-alls, handed over in the same order on every rank).
TEST_CASE("08 --overlap-a2a at dp 2 × tp 2 × ep 2 and dp 4 × ep 4 reproduces 01", "[07b][08][e2e][equiv]") {
  for (auto [dp, tp, ep] : {std::tuple<int, int, int>{2, 2, 2}, {4, 1, 4}}) {
    INFO("dp " << dp << " tp " << tp << " ep " << ep);
    tst::check_equivalent(tst::cached_run("08_5d_mesh", dp * tp, kMoe + mesh(dp, ep, 1) + "--tp " + std::to_string(tp) +
                                                                       " --kv-heads 4 --overlap-a2a"),
                          single("--kv-heads 4"));
  }
}

// Rank 0's spans in a run's trace: name, start, end.
struct Span {
  std::string name;
  double t0, t1;
};
std::vector<Span> rank0_spans(const std::string& bin, int np, const std::string& args, const std::string& file) {
  const std::string path = tst::scratch(file);
  const tst::Result r = tst::run_bin(bin, args + " --trace " + path, np, 120);
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::ifstream f(path);
  const ts::Json t = ts::Json::parse(std::string(std::istreambuf_iterator<char>(f), {}));
  std::vector<Span> out;
  for (const ts::Json& e : t.at("traceEvents").as_array())
    if (e.contains("dur") && e.at("pid").as_double() == 0)
      out.push_back({e.at("name").as_string(), e.at("ts").as_double(), e.at("ts").as_double() + e.at("dur").as_double()});
  return out;
}
bool starts(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }
// How many spans `inner` names start strictly inside a span `outer` names.
template <class In, class Out>
int started_inside(const std::vector<Span>& spans, In inner, Out outer) {
  int n = 0;
  for (const Span& a : spans)
    for (const Span& b : spans) n += inner(a.name) && outer(b.name) && b.t0 < a.t0 && a.t0 < b.t1;
  return n;
}

// Under a pipeline the micro-batches are the schedule's to order: DualPipeV pairs the F of one with
// the full backward of another (05b's pairs), and 08 runs each pair's halves as two coroutines, each
// one's all-to-all travelling while the other computes. The halves run different stages' layers,
// so no sum changes order: bit for bit 08 without the flag, and 01 by the criterion; with 4 and 8
// micro-batches per rank (1 and 5 pairs on rank 0), under full recompute.
const Run& dualpipev(int batch, bool overlap, const std::string& rest = "") {
  return tst::cached_run("08_5d_mesh", 4, kMoe + "--layers 4 --dp 2 --ep 2 --pp 2 --schedule dualpipev " +
                                              tst::steps_args(4, batch, 1) + " " + (overlap ? "--overlap-a2a " : "") + rest);
}
TEST_CASE("08 --overlap-a2a under DualPipeV: each F&B pair side by side, bit for bit and ≡ 01", "[07b][08][e2e][equiv]") {
  for (int batch : {8, 16}) {
    INFO("batch " << batch);
    const Run& r = dualpipev(batch, true);
    CHECK(bitwise(r, dualpipev(batch, false)));
    tst::check_equivalent(r, tst::cached_run("01_single_gpu", 1, kMoe + "--layers 4 " + tst::steps_args(4, batch, batch)));
  }
  tst::check_equivalent(dualpipev(8, true, "--recompute full"),
                        tst::cached_run("01_single_gpu", 1, kMoe + "--layers 4 " + tst::steps_args(4, 8, 8) + " --recompute full"));
}

// --memory-timeline under the pairs: the phase ("forward unit k", "backward unit k") goes with the
// micro-batch that allocates, across the hand-overs (07b's Interleave resumes each one's phase), so
// each phase's activations add up, per step, to what they add up to one micro-batch after another.
std::map<std::string, long long> activations_by_phase(const std::string& csv) {
  std::ifstream f(csv);
  std::string line;
  std::getline(f, line);
  std::map<std::string, long long> net;
  while (std::getline(f, line)) {
    std::vector<std::string> v;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) v.push_back(x);
    if (v.size() > 5 && v[4] == "activations") net[v[2]] += std::stoll(v[5]);
  }
  return net;
}
TEST_CASE("--memory-timeline under --overlap-a2a: each allocation in its own micro-batch's phase", "[07b][e2e][mem]") {
  tst::TempDir d;
  expert(2, 2, 1, false, "--memory-timeline " + d.file("one.csv"));
  expert(2, 2, 1, true, "--memory-timeline " + d.file("pairs.csv"));
  const auto one = activations_by_phase(d.file("one.csv")), pairs = activations_by_phase(d.file("pairs.csv"));
  REQUIRE(one.size() == 6);  // the embedding and 2 layers forward, the 2 layers and the head backward
  CHECK(pairs == one);
}

// On rank 0 of a DualPipeV run: how many B spans start inside an F span (a pair's halves side by
// side); one after the other, none do.
int paired_spans(bool overlap) {
  const auto spans = rank0_spans("08_5d_mesh", 4, kMoe + "--layers 4 --dp 2 --ep 2 --pp 2 --schedule dualpipev " +
                                                      tst::steps_args(2, 16, 1) + (overlap ? " --overlap-a2a" : ""),
                                 overlap ? "dualpipev_pairs_trace.json" : "dualpipev_trace.json");
  return started_inside(spans, [](const std::string& n) { return starts(n, "B mb ") || starts(n, "B (input grad) mb "); },
                        [](const std::string& n) { return starts(n, "F mb "); });
}

TEST_CASE("the trace shows DualPipeV's pairs side by side under --overlap-a2a", "[07b][08][trace]") {
  CHECK(paired_spans(true) > 0);
  CHECK(paired_spans(false) == 0);
}

#ifdef TS_CUDA_EMU
// The emulated GPU, a GPU per rank: the dispatch and combine are NCCL grouped send/recv on the ep
// group's stream, ordered by events; the result is 01's on the CPU.
TEST_CASE("emulated GPU: --overlap-a2a on NCCL at dp 2 × ep 2 and ep 4 reproduces 01", "[07b][emu][cuda]") {
  const std::string own = "TS_EMU_GPUS=8";
  const Run& ref = single("--device cpu");
  for (auto [dp, ep] : {std::pair<int, int>{2, 2}, {4, 4}}) {
    const Run& r = expert(dp, ep, 1, true, "--device cuda", own);
    INFO(r.output);
    CHECK(r.output.find("nccl") != std::string::npos);
    tst::check_equivalent(r, ref);
  }
  // DualPipeV's pairs on NCCL: each half's all-to-all on the ep group's stream while the other half's
  // kernels queue.
  const Run& v = tst::cached_run("08_5d_mesh", 4, kMoe + "--layers 4 --dp 2 --ep 2 --pp 2 --schedule dualpipev " +
                                                      tst::steps_args(4, 8, 1) + " --overlap-a2a --device cuda", 300, own);
  INFO(v.output);
  tst::check_equivalent(v, tst::cached_run("01_single_gpu", 1, kMoe + "--layers 4 " + tst::steps_args(4, 8, 8) + " --device cpu"));
}
#endif

// A combine's rows read before its all-to-all completes (tests/bugs/early_combine_read.cpp): the
// rows the buffer held before. Where they were never written (the emulated GPU's build poisons new
// memory with NaN) step 0 diverges and the run stops; elsewhere they are stale rows, and the run
// leaves the criterion.
TEST_CASE("seeded bug: a combine read before the all-to-all completes", "[07b][e2e][equiv]") {
  const std::string bug = "tests/bugs/07_expert_parallel+early_combine_read";
  for (auto [dp, ep] : {std::pair<int, int>{2, 2}, {4, 4}}) {
    const std::string args = kMoe + mesh(dp, ep, 1) + "--overlap-a2a-early-combine";
    const tst::Result r = tst::run_bin(bug, args, dp, 120);
    INFO("ep " << ep << "\n" << r.output);
    CHECK(r.output.find("deliberate bug early_combine_read") != std::string::npos);
    if (r.status != 0) {
      CHECK(r.output.find("step 0 diverged") != std::string::npos);
      continue;
    }
    const tst::Equivalence e = tst::compare(tst::cached_run(bug, dp, args), single());
    INFO(e);
    CHECK_FALSE(tst::equivalent(e));
  }
}

// On rank 0: an all-to-all in flight (lane "comm 2", its post to its completion) spans the start of
// a layer's forward or backward (the other micro-batch's, which runs while it travels); without the
// flag the blocking all-to-alls never do.
int overlapped_layers(bool overlap) {
  const auto spans = rank0_spans("07_expert_parallel", 2, kMoe + mesh(2, 2, 1) + (overlap ? "--overlap-a2a" : ""),
                                 overlap ? "a2a_overlap_trace.json" : "a2a_trace.json");
  return started_inside(spans, [](const std::string& n) { return starts(n, "fwd layer ") || starts(n, "bwd layer "); },
                        [](const std::string& n) { return starts(n, "ep all_to_all_v ("); });
}

TEST_CASE("the trace shows an all-to-all in flight while the other micro-batch's layer starts", "[07b][trace]") {
  CHECK(overlapped_layers(true) > 0);
  CHECK(overlapped_layers(false) == 0);
}

TEST_CASE("bad input: --overlap-a2a refused with one line on every rank", "[07b][errors]") {
  tst::check_errors("07_expert_parallel", kMoe + "--steps 1 --overlap-a2a ", {
      {2, "--dp 2 --ep 1", "--overlap-a2a needs --ep > 1"},
      {2, "--dp 2 --ep 2 --batch 6 --micro-batch 1", "--overlap-a2a pairs micro-batches: each rank's 3"},
      {2, "--dp 2 --ep 2 --batch 8 --micro-batch 4", "--overlap-a2a pairs micro-batches: each rank's 1"},
      {2, "--dp 2 --ep 2 --dispatch two-level", "--overlap-a2a overlaps the flat dispatch"},
  });
  tst::check_errors("08_5d_mesh", kMoe + "--steps 1 --overlap-a2a ", {
      {4, "--dp 2 --ep 2 --pp 2", "--overlap-a2a with --pp 2 pairs the F and B of --schedule dualpipev"},
      {2, "--dp 2 --ep 2 --batch 2 --micro-batch 1", "--overlap-a2a pairs micro-batches: each rank's 1"},
  });
}
