// 05b_dualpipev.cu — DualPipeV (DeepSeek-V3 technical report §3.2.1; deepseek-ai/DualPipe's
// dualpipev.py, "cut in half"), read after 05_pipeline_parallel.cu and 05a_zero_bubble.cu.
//
// What it adds to chapter 05: another placement and another order. 2p stages in a V, rank s
// holding stage s (chunk 0, on the way down) and stage 2p − 1 − s (chunk 1, on the way back up),
// so the first and the last on rank 0 and the turn on rank p − 1; a forward chunk of one
// micro-batch paired with a backward chunk of another (dualpipev.py's F&B pairs, overlapped on a
// GPU), and 05a's split backward so that W fills the bubbles that remain: (p − 1)/(6m).
//
// How it plugs in: a registry entry (pp::add_schedule) with its V placement (stage, rank_of), its
// order, two chunks per rank always, 05a's split backward and its own checks. Both directions of
// each link carry two chunks' messages in orders that differ at its two ends, so its lists run
// with 05's buffered sends, as interleaved's do. The lab's extra lines for it (beside the bubble
// line and under the chart, registered with the lab's pp::prints_also) are here too: they compare
// it with 1F1B, ZB-H1 and the DualPipe README's table, and chart its pairs run as dualpipev.py's
// blocks (PairBlockSimulator, on the lab's clock: lab/05_simulator.h).
//   ./build/05_pipeline_parallel --dry-run --pp 4 --layers 8 --schedule dualpipev --batch 8 --micro-batch 1 --schedule-chart
#ifndef TS_05B_DUALPIPEV_CU
#define TS_05B_DUALPIPEV_CU
#include <algorithm>
#include <array>
#include <vector>

#include "05a_zero_bubble.cu"
#include "lab/05_pipeline_parallel.h"  // pp::prints_also: its lines beside the bubble line, its second chart
#include "lab/05_simulator.h"            // the clock PairBlockSimulator runs the pairs on

namespace pp {

// DualPipeV's order on rank s, step by step as DualPipeV.step() in deepseek-ai/DualPipe runs it
// (chunk 0 = its phase 0, the stage on the way down; chunk 1 = phase 1, on the way up). Every
// backward is a B followed by a W: a zero-bubble one's W waits in a queue (the repository's
// WeightGradStore, first in first out) for a later W; a full one's W comes at once. Where the
// repository pairs a forward with a backward ("F&B", overlapped on a GPU) the pair is adjacent and
// its F marked in `pairs` (one flag per action); not on the last rank at step 4's first turn,
// which the repository leaves unpaired.
inline std::vector<Action> dualpipev_order(int p, int m, int s, std::vector<bool>* pairs = nullptr) {
  std::vector<Action> o;
  std::vector<bool> paired;          // per action in o: an F that opens an F&B pair
  int f[2] = {0, 0}, b[2] = {0, 0};  // per chunk: the next micro-batch to run F / B on
  std::vector<Action> queued;        // the deferred W's, oldest first
  auto put = [&](const Action& a, bool pair = false) { o.push_back(a), paired.push_back(pair); };
  auto F = [&](int c, bool pair = false) { put({Op::F, f[c]++, c}, pair); };
  auto B = [&](int c, bool zero_bubble) {
    put({Op::B, b[c], c});
    if (zero_bubble) queued.push_back({Op::W, b[c]++, c});
    else put({Op::W, b[c]++, c});
  };
  auto W = [&] { put(queued.front()), queued.erase(queued.begin()); };
  const int below = p - s - 1, upto = s + 1;  // ranks below s; ranks 0..s
  for (int i = 0; i < 2 * below; i++) F(0);                      // 1: nF0, the warm-up
  for (int i = 0; i < upto; i++) F(0), F(1);                      // 2: nF0F1
  for (int i = 0; i < below; i++) B(1, true), W(), F(1);          // 3: nB1W1F1, zero bubble
  for (int i = 0; i < m - 2 * p + upto; i++)                      // 4: nF0B1F1B0, the pairs
    F(0, i > 0 || s < p - 1), B(1, false), F(1, true), B(0, false);
  for (int i = 0; i < below; i++) B(1, false), F(1, true), B(0, false);  // 5: nB1F1B0
  for (int i = 0; i < upto; i++)                                   // 6: nB1B0, its second half
    B(1, i > upto / 2 || (i == upto / 2 && s % 2 == 1)), B(0, i >= upto / 2);  // zero bubble
  for (int i = 0; i < below; i++) W(), B(0, true);                 // 7: nWB0
  while (!queued.empty()) W();                                     // 8: nW, the s + 1 left
  if (pairs) *pairs = paired;
  return o;
}
inline std::vector<bool> dualpipev_pairs(int p, int m, int s) {
  std::vector<bool> pairs;
  dualpipev_order(p, m, s, &pairs);
  return pairs;
}

// DualPipeV, a slot one stage's F (= its B = its W), each rank busy 2m·(F + B + W) = 6m slots:
// with each pair run as an F then a full backward, each sending when it ends (this executor), rank
// s idles s slots before its first activation arrives and p − 1 − s after its last: (p − 1)/(6m).
inline double dualpipev_bubble(int p, int m, int) { return (p - 1.0) / (6.0 * m); }
// The DualPipe README's (PP/2 − 1)(F&B + B − 3W) idle per rank, PP = 2p stages, B a full backward
// (2 slots), F&B a pair run as one block whose outputs leave at its end: F + B = 3 slots when
// nothing overlaps. 2(p − 1) slots, what PairBlockSimulator finds.
inline int dualpipe_table_idle_slots(int p) { return (p - 1) * ((1 + 2) + 2 - 3 * 1); }

// The F&B pairs as dualpipev.py's _forward_backward_chunk runs them, for the bubble only: one
// block that waits for both inputs (one _commit_and_wait_comm) and sends both outputs after it
// ends. (This executor runs a pair as an F then a full backward, each sending as soon as it ends.)
class PairBlockSimulator : public Simulator {
 public:
  explicit PairBlockSimulator(SimulatedPlan& pl) : Simulator(pl) {
    for (int s = 0; s < pl.p; s++) pairs_.push_back(dualpipev_pairs(pl.p, pl.m, s));
  }

 protected:
  bool pick(int s, int t, Action& a) override {
    const size_t i = size_t(next_[s]);
    if (i < pairs_[s].size() && pairs_[s][i] && !inputs_ready(order_[s][i + 1], s, t)) return false;
    return Simulator::pick(s, t, a);
  }
  // The pair's full backward (its B and W) in the same block; both outputs (the F's activation,
  // the B's gradient) leave at the block's end.
  int start(const Action& f, int s, int t) override {
    const int end_f = Simulator::start(f, s, t);
    const size_t i = size_t(next_[s]);  // the B after f
    if (!pairs_[s][i - 1]) return end_f;
    const Action& b = order_[s][i];
    const int end = place(order_[s][i + 1], s, place(b, s, end_f));
    forward_finish_[at(f.mb, pl_.stage(s, f.chunk))] = end;
    backward_finish_[at(b.mb, pl_.stage(s, b.chunk))] = end;
    next_[s] += 2, all_started_ += 2;
    return end;
  }

 private:
  std::vector<std::vector<bool>> pairs_;  // per rank: dualpipev_pairs
};
// DualPipeV's plan at (p, m), 2p stages of one slot, its pairs run as blocks: build_plan's lists,
// other slots.
inline SimulatedPlan pair_block_plan(int p, int m);


// The most micro-batch chunks a rank holds saved activations for at once (F run, B not yet).
inline int peak_in_flight(const SimulatedPlan& pl, int rank) {
  int held = 0, peak = 0;
  for (const TimedAction& t : pl.timeline[size_t(rank)]) {
    held += t.action.op == Op::F ? 1 : t.action.op == Op::B ? -1 : 0;
    peak = std::max(peak, held);
  }
  return peak;
}

// Beside the bubble line: 1F1B's and ZB-H1's at the same p and m, whose stages hold twice the
// layers (a slot there is two of DualPipeV's: the ratios compare), and, with its pairs run as
// dualpipev.py's blocks, the DualPipe README's table.
inline void dualpipev_beside_bubble(RunLog& log, const SimulatedPlan& pl) {
  const SimulatedPlan one = simulated_plan(pl.p, pl.m, 1, kOneFOneB), zb = simulated_plan(pl.p, pl.m, 1, kZBH1);
  log.line("  beside it: 1f1b simulated %.4f, formula %.4f; zb-h1 simulated %.4f, formula %.4f", one.bubble(),
           bubble_formula(one.schedule, pl.p, pl.m, 1), zb.bubble(), bubble_formula(zb.schedule, pl.p, pl.m, 1));
  log.line("  idle slots per rank: simulated %d = p - 1; chunks in flight on rank 0: %d, the table's PP + 1 = %d",
           pl.makespan - pl.busiest(), peak_in_flight(pl, 0), 2 * pl.p + 1);
  const SimulatedPlan blocks = pair_block_plan(pl.p, pl.m);
  const int table = dualpipe_table_idle_slots(pl.p);
  log.line("  each F&B pair one block, its outputs sent at its end (dualpipev.py): simulated %d idle slots, bubble "
           "%.4f; DualPipe's (PP/2 - 1)(F&B + B - 3W) = %d (F = W = 1, B = 2, F&B = F + B = 3), bubble %.4f",
           blocks.makespan - blocks.busiest(), blocks.bubble(), table, table / (6.0 * pl.m));
}

// DualPipeV: two stages per rank, 2p equal ones (the V pairs a stage's forward with another's
// backward, which balances only when they cost the same), and at least 2p micro-batches (its step 4
// runs m − 2p + s + 1 times; DualPipeV.step() asserts num_chunks >= 2 · num_ranks).
inline void validate_dualpipev_chunks(int V) {
  if (V != 2)
    config_error("--schedule dualpipev places two stages on each rank (stage s and stage 2·pp − 1 − s), not "
                 "--virtual-stages %d", V);
}
inline void validate_dualpipev(const RunConfig& rc, int p, int V) {
  const int m = rc.batch / rc.micro_batch;
  validate_dualpipev_chunks(V);
  if (rc.model.layers % (2 * p))
    config_error("--schedule dualpipev needs --layers %d divisible by 2 × --pp %d = %d stages", rc.model.layers, p,
                 2 * p);
  if (m < 2 * p)
    config_error("--schedule dualpipev needs at least 2 × --pp %d = %d micro-batches per step (got %d = batch %d / "
                 "micro-batch %d)", p, 2 * p, m, rc.batch, rc.micro_batch);
}

inline const Schedule kDualPipeV = add_schedule([] {
  ScheduleKind k;
  k.name = "dualpipev";
  k.title = "DualPipeV";
  k.order = [](int p, int m, int, int s) { return dualpipev_order(p, m, s); };
  k.bubble = dualpipev_bubble;
  k.chunks = 2;
  k.split_backward = true;
  // The V: chunk 0 the stage s on the way down, chunk 1 the stage 2p − 1 − s on the way back up.
  k.stage = [](int p, int s, int c) { return c == 0 ? s : 2 * p - 1 - s; };
  k.rank_of = [](int p, int k) { return std::min(k, 2 * p - 1 - k); };
  k.validate = validate_dualpipev;
  return k;
}());
// The lists with each F&B pair as dualpipev.py's _forward_backward_chunk runs it, one block: both
// inputs received before the F, then the F, the B and the B's W adjacent, then both outputs sent.
// For an executor that runs a pair's halves side by side (08 under --overlap-a2a); 05's own runs
// each action as it comes. The clock checks the new lists complete, as build_plan's.
struct PairBlocks {
  Plan plan;
  std::vector<std::vector<std::array<Action, 3>>> pairs;  // per rank: each pair's F, B and W
};
inline PairBlocks pair_blocks(const Plan& pl) {
  PairBlocks out{pl, std::vector<std::vector<std::array<Action, 3>>>(size_t(pl.p))};
  for (int s = 0; s < pl.p; s++) {
    const std::vector<bool> opens = dualpipev_pairs(pl.p, pl.m, s);
    const std::vector<Action>& list = pl.actions[size_t(s)];
    std::vector<Action> o;
    for (size_t i = 0, n = 0; i < list.size(); i++) {  // n: the compute actions before list[i]
      if (!is_compute(list[i].op) || !opens[n]) {
        o.push_back(list[i]), n += is_compute(list[i].op);
        continue;
      }
      std::vector<Action> block, sends;
      for (; i < list.size() && block.size() < 3; i++)
        (is_compute(list[i].op) ? block : is_send(list[i].op) ? sends : o).push_back(list[i]);
      const bool full = block.size() == 3 && block[1].op == Op::B && block[2] == Action{Op::W, block[1].mb, block[1].chunk};
      TS_CHECK(full,
               "dualpipev: rank %d's pair at micro-batch %d is not an F then a full backward", s, block[0].mb);
      o.insert(o.end(), block.begin(), block.end());
      o.insert(o.end(), sends.begin(), sends.end());
      out.pairs[size_t(s)].push_back({block[0], block[1], block[2]});
      i--, n += 3;
    }
    out.plan.actions[size_t(s)] = o;
  }
  TS_CHECK(simulate(out.plan).complete, "dualpipev: its pairs as blocks deadlock at pp %d, m %d", pl.p, pl.m);
  return out;
}

// What the lab prints for it beyond the others' (lab/05_pipeline_parallel.h).
inline const bool kDualPipeVPrints = [] {
  prints_also()[kDualPipeV] = {dualpipev_beside_bubble,
                               [](const SimulatedPlan& pl) { return pair_block_plan(pl.p, pl.m); },
                               "the same lists, each F&B pair one block (dualpipev.py):"};
  return true;
}();
inline SimulatedPlan pair_block_plan(int p, int m) {
  SimulatedPlan b(build_plan(p, m, 2, kDualPipeV));
  PairBlockSimulator(b).run();
  return b;
}

}  // namespace pp
#endif  // TS_05B_DUALPIPEV_CU
