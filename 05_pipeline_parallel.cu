// 05_pipeline_parallel.cu — pipeline parallelism: AFAB (GPipe), 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV.
//
// The playbook's pipeline chapter, runnable. The decoder layers are cut into p·V contiguous
// virtual stages (L/(p·V) layers each, or an uneven split); virtual stage k = c·p + s is chunk c
// of rank s (Megatron's round-robin assignment: with V = 1 rank s holds one contiguous run). The
// embedding goes with virtual stage 0 (rank 0), the final norm, LM head and loss with virtual
// stage p·V − 1 (rank p − 1). The m = batch/micro-batch micro-batches of a step flow through the
// stages; the idle time this leaves each rank is the bubble:
//   afab         all forwards, then all backwards (GPipe, Huang et al. 2019);
//   1f1b         p − s − 1 warm-up forwards, then the steady state of one forward one backward,
//                then the cool-down's backwards (PipeDream-1F1B, Narayanan et al.): at most
//                p − s micro-batches in flight;
//   interleaved  1F1B over V chunks per rank (Megatron's order; m a multiple of p);
//   zb-h1        each backward split into B (input gradient, on the critical path) and W (weight
//                gradient), W moved into the bubbles (Qi et al. 2023, "Zero Bubble Pipeline
//                Parallelism"), with 1F1B's bound on the micro-batches in flight;
//   dualpipev    2p stages in a V, rank s holding stage s and stage 2p − 1 − s (so the first and
//                the last on rank 0): a forward chunk of one micro-batch paired with a backward
//                chunk of another, B and W split so that W fills the bubbles (DeepSeek-V3
//                technical report §3.2.1; deepseek-ai/DualPipe's dualpipev.py, "cut in half").
// A schedule is data: build_plan() turns (p, m, V, schedule) into one list of actions per rank
// (F, B, W, send, recv); the executor runs the list; --schedule-chart prints its timeline.
//
// Each virtual stage holds L/(p·V) layers when that divides, else the stages at the ends one
// fewer (balanced_split), or what --stage-layers a,b,… says; m = batch / micro-batch should be
// several times pp for a small bubble ((p − 1)/m):
//   mpirun -np 4 ./build/05_pipeline_parallel --pp 4 --layers 4 --schedule 1f1b --batch 16 --micro-batch 2
//   ./build/05_pipeline_parallel --dry-run --pp 4 --layers 4 --schedule zb-h1 --batch 8 --micro-batch 1 --schedule-chart
//   ./build/05_pipeline_parallel --dry-run --pp 4 --layers 8 --schedule dualpipev --batch 8 --micro-batch 1 --schedule-chart
#ifndef TS_05_PIPELINE_PARALLEL_CU
#define TS_05_PIPELINE_PARALLEL_CU
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/threads.h"
#include "comm/trace.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/run.h"
#include "training/step_time.h"
#include "training/train.h"

namespace pp {
using namespace ts;

// ----- the schedule as data ---------------------------------------------------------------------

enum class Schedule { AFAB, OneFOneB, Interleaved, ZBH1, DualPipeV };
inline const char* schedule_name(Schedule s) {
  const char* n[] = {"afab", "1f1b", "interleaved", "zb-h1", "dualpipev"};
  return n[int(s)];
}
// v_shape: the caller places a rank's stages by the plan (shard_spec(const Plan&, …)), so it can
// run DualPipeV's V; a caller that places them round robin knows only the other four.
inline bool parse_schedule(const std::string& name, Schedule& s, bool v_shape = false) {
  for (Schedule c : {Schedule::AFAB, Schedule::OneFOneB, Schedule::Interleaved, Schedule::ZBH1, Schedule::DualPipeV})
    if (name == schedule_name(c) && (v_shape || c != Schedule::DualPipeV)) return s = c, true;
  return false;
}
// ZB-H1 and DualPipeV split each backward into B (input gradient) and W (weight gradients).
inline bool splits_backward(Schedule s) { return s == Schedule::ZBH1 || s == Schedule::DualPipeV; }
// The virtual stage of rank s's chunk c: Megatron's round robin c·p + s, or DualPipeV's V, chunk 0
// the stage s on the way down and chunk 1 the stage 2p − 1 − s on the way back up.
inline int virtual_stage(Schedule sched, int p, int s, int c) {
  if (sched == Schedule::DualPipeV) return c == 0 ? s : 2 * p - 1 - s;
  return c * p + s;
}

// F: forward of a chunk (at the last virtual stage also the head's backward); B: its backward
// (input gradient only under ZB-H1 and DualPipeV); W: the deferred weight gradients.
enum class Op { F, B, W, SendAct, RecvAct, SendGrad, RecvGrad };
struct Action {
  Op op;
  int mb, chunk;  // micro-batch; this rank's chunk c (virtual stage c·p + rank, or the V: virtual_stage)
  bool pair = false;  // DualPipeV: this F and the full backward after it are one of dualpipev.py's F&B pairs
  bool operator==(const Action& o) const { return op == o.op && mb == o.mb && chunk == o.chunk; }
};
inline bool is_compute(Op o) { return o == Op::F || o == Op::B || o == Op::W; }

// A compute action placed on the simulated clock: it runs in slots [start, start + slots).
struct TimedAction {
  Action action;
  int start, slots;
};

// The whole schedule: per rank the compute actions with their simulated slots (the timeline)
// and the full list with the p2p actions in place. A slot is the time one layer's forward takes
// (g layers' when every stage's layer count is a multiple of g: see stage_costs).
struct Plan {
  int p = 1, m = 1, V = 1;
  Schedule schedule = Schedule::OneFOneB;
  std::vector<int> layers;  // per virtual stage k: its decoder layers (the split)
  std::vector<std::vector<TimedAction>> timeline;
  std::vector<std::vector<Action>> actions;
  int makespan = 0;       // the slot at which the last action of any rank finishes
  bool complete = false;  // the simulation ran every action (false: the order deadlocks)
  int K() const { return p * V; }  // virtual stages in all
  int stage(int rank, int chunk) const { return virtual_stage(schedule, p, rank, chunk); }
  // A rank's compute slots; the busiest rank's set the pace of the pipeline.
  int busy(int rank) const {
    int b = 0;
    for (const TimedAction& t : timeline[size_t(rank)]) b += t.slots;
    return b;
  }
  int busiest() const {
    int b = 1;  // at least one slot, so that bubble() never divides by 0
    for (int r = 0; r < p; r++) b = std::max(b, busy(r));
    return b;
  }
  // Idle slots over the busiest rank's compute slots, the playbook's t_bubble / t_ideal.
  double bubble() const { return double(makespan - busiest()) / busiest(); }
  // The layers rank s holds, and the busiest rank's share of L/p (1 when the split is even).
  double busiest_share() const {
    int most = 0, all = 0;
    for (int s = 0; s < p; s++) {
      int n = 0;
      for (int c = 0; c < V; c++) n += layers[size_t(stage(s, c))];
      most = std::max(most, n), all += n;
    }
    return double(most) * p / std::max(1, all);
  }
};

// ----- the stage split ----------------------------------------------------------------------------

// Even when p·V divides L; else the stages at the ends get one layer fewer each, the last first
// (it also runs the head and its vocabulary-wide loss), then the first (the embedding and, under
// 1F1B, the most micro-batches in flight), then inwards: 126 layers on 16 stages are 7, 8 × 14, 7
// (Llama 3 405B's pipeline, Megatron's --decoder-first/last-pipeline-num-layers).
inline std::vector<int> balanced_split(int L, int K) {
  const int most = (L + K - 1) / K;  // ⌈L/K⌉ layers per stage
  std::vector<int> s(size_t(K), most);
  // K·⌈L/K⌉ − L layers too many: the i-th comes off stage K−1, 0, K−2, 1, … (from the ends inwards).
  for (int surplus = K * most - L, i = 0; surplus > 0; surplus--, i++) {
    const int k = i % 2 ? i / 2 : K - 1 - i / 2;
    s[size_t(k)]--;
  }
  return s;
}
// --stage-layers a,b,…: one count per virtual stage (k = c·p + s), each >= 1, summing to L.
inline std::vector<int> parse_split(const std::string& text, int L, int K) {
  std::vector<int> s;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1 || v > L)
      config_error("--stage-layers '%s': '%s' is not a layer count from 1 to %d", text.c_str(), item.c_str(), L);
    s.push_back(int(v));
    at = comma + 1;
  }
  int sum = 0;
  for (int v : s) sum += v;
  if (int(s.size()) != K || sum != L)
    config_error("--stage-layers '%s' gives %zu stages of %d layers in all; this run has pp × virtual stages = %d "
                 "stages and --layers %d", text.c_str(), s.size(), sum, K, L);
  return s;
}
// The split a run uses: --stage-layers when given, else balanced_split.
inline std::vector<int> stage_split(const std::string& text, int L, int K) {
  return text.empty() ? balanced_split(L, K) : parse_split(text, L, K);
}

// The playbook's bubble formulas: (p − 1)/m, (p − 1)/(V·m), and ZB-H1's (p − 1)/(3m). DualPipeV,
// a slot one stage's F (= its B = its W), each rank busy 2m·(F + B + W) = 6m slots: with each pair
// run as an F then a full backward, each sending when it ends (this executor), rank s idles s slots
// before its first activation arrives and p − 1 − s after its last: (p − 1)/(6m).
inline double bubble_formula(Schedule s, int p, int m, int V) {
  if (s == Schedule::Interleaved) return (p - 1.0) / (double(V) * m);
  if (s == Schedule::ZBH1) return (p - 1.0) / (3.0 * m);
  if (s == Schedule::DualPipeV) return (p - 1.0) / (6.0 * m);
  return (p - 1.0) / m;
}
// The DualPipe README's (PP/2 − 1)(F&B + B − 3W) idle per rank, PP = 2p stages, B a full backward
// (2 slots), F&B a pair run as one block whose outputs leave at its end: F + B = 3 slots when
// nothing overlaps. 2(p − 1) slots, what the simulator finds with pair_blocks (see Simulator).
inline int dualpipe_table_idle_slots(int p) { return (p - 1) * ((1 + 2) + 2 - 3 * 1); }

// Fixed compute orders. AFAB: every F, then every B, micro-batches in order.
inline std::vector<Action> afab_order(int m) {
  std::vector<Action> o;
  for (int i = 0; i < m; i++) o.push_back({Op::F, i, 0});
  for (int i = 0; i < m; i++) o.push_back({Op::B, i, 0});
  return o;
}

// Megatron's interleaved order over rank s's m·V (micro-batch, chunk) units: they come in rounds
// of p micro-batches × V chunks, and within a round the chunks take turns, each for the round's p
// micro-batches, forwards in chunk order and backwards in reverse. Warm-up: 2(p − s − 1) +
// (V − 1)·p forwards; steady state: one forward, one backward; cool-down: the backwards left.
// V = 1 with a warm-up of p − s − 1 forwards is plain 1F1B.
inline std::vector<Action> one_f_one_b_order(int p, int m, int V, int s) {
  const int units = m * V;
  const int warmup = std::min(units, V == 1 ? p - s - 1 : 2 * (p - s - 1) + (V - 1) * p);
  // The i-th forward (or backward) unit: round i / (p·V), chunk (i mod p·V) / p of the round,
  // micro-batch i mod p of the round.
  auto unit = [&](Op op, int i) {
    const int round = i / (p * V), chunk = (i % (p * V)) / p, mb = round * p + i % p;
    return Action{op, mb, op == Op::F ? chunk : V - 1 - chunk};
  };
  std::vector<Action> o;
  for (int i = 0; i < warmup; i++) o.push_back(unit(Op::F, i));  // warm-up
  for (int i = 0; i < units - warmup; i++) {                      // steady state
    o.push_back(unit(Op::F, warmup + i));
    o.push_back(unit(Op::B, i));
  }
  for (int i = units - warmup; i < units; i++) o.push_back(unit(Op::B, i));  // cool-down
  return o;
}

// DualPipeV's order on rank s, step by step as DualPipeV.step() in deepseek-ai/DualPipe runs it
// (chunk 0 = its phase 0, the stage on the way down; chunk 1 = phase 1, on the way up). Every
// backward is a B followed by a W: a zero-bubble one's W waits in a queue (the repository's
// WeightGradStore, first in first out) for a later W; a full one's W comes at once. Where the
// repository pairs a forward with a backward ("F&B", overlapped on a GPU) the pair is adjacent and
// its F marked; not on the last rank at step 4's first turn, which the repository leaves unpaired.
inline std::vector<Action> dualpipev_order(int p, int m, int s) {
  std::vector<Action> o;
  int f[2] = {0, 0}, b[2] = {0, 0};  // per chunk: the next micro-batch to run F / B on
  std::vector<Action> queued;        // the deferred W's, oldest first
  auto F = [&](int c, bool pair = false) { o.push_back({Op::F, f[c]++, c, pair}); };
  auto B = [&](int c, bool zero_bubble) {
    o.push_back({Op::B, b[c], c});
    (zero_bubble ? queued : o).push_back({Op::W, b[c]++, c});
  };
  auto W = [&] { o.push_back(queued.front()), queued.erase(queued.begin()); };
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
  return o;
}
inline std::vector<Action> compute_order(Schedule sched, int p, int m, int V, int s) {
  if (sched == Schedule::AFAB) return afab_order(m);
  if (sched == Schedule::DualPipeV) return dualpipev_order(p, m, s);
  return one_f_one_b_order(p, m, V, s);
}

// ----- the simulator ------------------------------------------------------------------------------

// Each virtual stage's cost in slots: its F takes cost_k slots and its B 2·cost_k (the input and
// the weight gradients, each a matmul the size of the forward's), or, split (ZB-H1, DualPipeV), B
// and W cost_k each. cost_k is stage k's layer count over g, the greatest common divisor of all the
// counts, so an even split costs one slot per F: the playbook's unit-cost charts.
inline std::vector<int> stage_costs(const std::vector<int>& layers) {
  int g = 0;
  for (int n : layers) g = std::gcd(g, n);
  std::vector<int> cost;
  for (int n : layers) cost.push_back(n / std::max(1, g));
  return cost;
}

// The simulator plays every rank's compute order on one clock, slot by slot: at each slot an idle
// rank starts its next action if that action's inputs have finished. F(mb, k) needs F(mb, k − 1);
// B(mb, k) needs F(mb, k) and B(mb, k + 1); W(mb, k) needs B(mb, k). AFAB, 1F1B, interleaved and
// DualPipeV (its W's in its order) follow their orders. ZB-H1 follows 1F1B's order of F and B and
// fits the W's in: when the next F or B cannot start, the rank runs its oldest pending W instead
// (what would be a bubble), and an F waits, the W's going first, while p micro-batches hold
// activations (F done, W not: 1F1B's bound at stage 0). A slot in which a rank neither computes nor
// can start anything is a bubble.
// DualPipeV's F&B pairs run as this executor runs them, an F then a full backward, each sending as
// soon as it ends; or, with pair_blocks, as dualpipev.py's _forward_backward_chunk runs them: one
// block that waits for both inputs (one _commit_and_wait_comm) and sends both outputs after it ends.
class Simulator {
 public:
  Simulator(int p, int m, int V, Schedule sched, const std::vector<int>& layers, bool pair_blocks = false)
      : p_(p), m_(m), V_(V), sched_(sched), split_(splits_backward(sched)), fill_(sched == Schedule::ZBH1),
        blocks_(pair_blocks), stage_cost_(stage_costs(layers)),
        forward_finish_(size_t(m * p * V), -1), backward_finish_(size_t(m * p * V), -1) {}

  Plan run(Schedule sched) {
    Plan pl;
    pl.p = p_, pl.m = m_, pl.V = V_, pl.schedule = sched;
    pl.timeline.resize(size_t(p_));
    std::vector<std::vector<Action>> order{size_t(p_)};
    for (int s = 0; s < p_; s++) order[s] = compute_order(sched, p_, m_, V_, s);
    // Per rank: the slot it is busy until, its place in its order, and the F, B and W it started.
    std::vector<int> busy_until(size_t(p_), 0), next(size_t(p_), 0);
    std::vector<int> forwards(size_t(p_), 0), backwards(size_t(p_), 0), weight_grads(size_t(p_), 0);
    const int actions_per_rank = m_ * V_ * (split_ ? 3 : 2);  // F and B (and W) per micro-batch and chunk
    const int in_flight_limit = p_;                          // ZB-H1: most micro-batches with F done, W not
    const int last_slot = total_work();                       // see total_work: past it, a deadlock
    int started = 0;
    for (int t = 0; t < last_slot && started < actions_per_rank * p_; t++)
      for (int s = 0; s < p_; s++) {
        if (busy_until[s] > t) continue;
        Action a{};
        const bool in_order = next[s] < int(order[s].size());
        const bool too_many_in_flight =
            fill_ && in_order && order[s][next[s]].op == Op::F && forwards[s] - weight_grads[s] >= in_flight_limit;
        if (in_order && !too_many_in_flight && inputs_ready(order[s][next[s]], s, t) &&
            !(blocks_ && order[s][next[s]].pair && !inputs_ready(order[s][next[s] + 1], s, t))) {
          a = order[s][next[s]++];
          (a.op == Op::B ? backwards : a.op == Op::F ? forwards : weight_grads)[s]++;
        } else if (fill_ && weight_grads[s] < backwards[s] &&
                   finished_by(backward_finish_[at(weight_grads[s], s)], t)) {
          a = {Op::W, weight_grads[s]++, 0};  // ZB-H1 has V = 1: chunk 0, micro-batches in order
        } else {
          continue;  // nothing can start: a bubble slot
        }
        busy_until[s] = place(pl, a, s, t);
        started++;
        if (blocks_ && a.pair)  // the pair's full backward (its B and W) in the same block
          busy_until[s] = place_pair_rest(pl, a, order[s], next[s], s, busy_until[s]), next[s] += 2, started += 2;
      }
    pl.complete = started == actions_per_rank * p_;
    return pl;
  }

 private:
  // Action a on rank s from slot t: its finish, its place on the timeline; returns its end.
  int place(Plan& pl, const Action& a, int s, int t) {
    const int k = pl.stage(s, a.chunk);
    const int slots = stage_cost_[size_t(k)] * (a.op == Op::B && !split_ ? 2 : 1);
    if (a.op == Op::F) forward_finish_[at(a.mb, k)] = t + slots;
    if (a.op == Op::B) backward_finish_[at(a.mb, k)] = t + slots;
    pl.timeline[s].push_back({a, t, slots});
    pl.makespan = std::max(pl.makespan, t + slots);
    return t + slots;
  }
  // The rest of the block that pair head f opened: order[i] is its B, order[i + 1] that B's W, from
  // slot t. Both outputs (f's activation, the B's gradient) leave at the block's end.
  int place_pair_rest(Plan& pl, const Action& f, const std::vector<Action>& order, int i, int s, int t) {
    const Action& b = order[size_t(i)];
    const int end = place(pl, order[size_t(i) + 1], s, place(pl, b, s, t));
    forward_finish_[at(f.mb, pl.stage(s, f.chunk))] = end;
    backward_finish_[at(b.mb, pl.stage(s, b.chunk))] = end;
    return end;
  }
  // The slot by which every schedule that can finish has finished: all ranks' work added up,
  // m·Σ_k 3·cost_k (per micro-batch and virtual stage F + B = 1 + 2, or F + B + W = 1 + 1 + 1,
  // times the stage's cost). Until the last action finishes some rank computes in every slot: a
  // slot where every rank is idle and none can start leaves every finish time and count as it
  // was, so no later slot can start anything either, and the order has deadlocked. So a schedule
  // that completes has a makespan of at most the sum of its actions' slots, and one still short
  // of its actions there never completes (Plan::complete false).
  int total_work() const {
    int slots = 0;
    for (int cost : stage_cost_) slots += 3 * cost;
    return m_ * slots;
  }
  int at(int mb, int k) const { return mb * p_ * V_ + k; }  // (micro-batch, virtual stage) in the finish tables
  static bool finished_by(int finish, int t) { return finish >= 0 && finish <= t; }
  bool inputs_ready(const Action& a, int s, int t) const {
    const int k = virtual_stage(sched_, p_, s, a.chunk), K = p_ * V_;
    if (a.op == Op::F) return k == 0 || finished_by(forward_finish_[at(a.mb, k - 1)], t);
    if (a.op == Op::B)
      return finished_by(forward_finish_[at(a.mb, k)], t) &&
             (k == K - 1 || finished_by(backward_finish_[at(a.mb, k + 1)], t));
    return finished_by(backward_finish_[at(a.mb, k)], t);  // W
  }
  int p_, m_, V_;
  Schedule sched_;
  bool split_;                      // B is the input gradient only, W the weight gradients
  bool fill_;                       // ZB-H1: the W's fill the slots where nothing else can start
  bool blocks_;                     // DualPipeV: each F&B pair one block (see the class comment)
  std::vector<int> stage_cost_;     // per virtual stage: the slots of its F (stage_costs)
  std::vector<int> forward_finish_, backward_finish_;  // per (micro-batch, virtual stage): the slot its
                                                       // F / B finishes; -1 before it starts
};

// The rank that runs virtual stage k, and the p2p actions around each compute action: an F
// past the first virtual stage receives its input, one before the last sends its output; a B
// before the last receives its output gradient, one past the first sends its input gradient.
// Nothing travels between two virtual stages of one rank (p = 1; DualPipeV's turn at rank p − 1).
inline int stage_rank(const Plan& pl, int k) {
  return pl.schedule == Schedule::DualPipeV ? std::min(k, 2 * pl.p - 1 - k) : k % pl.p;  // the V, or k = c·p + s
}
inline void add_p2p(Plan& pl) {
  pl.actions.assign(size_t(pl.p), {});
  for (int s = 0; s < pl.p; s++)
    for (const TimedAction& t : pl.timeline[s]) {
      const Action& a = t.action;
      const int k = pl.stage(s, a.chunk);
      const bool from_prev = k > 0 && stage_rank(pl, k - 1) != s, to_next = k < pl.K() - 1 && stage_rank(pl, k + 1) != s;
      std::vector<Action>& l = pl.actions[s];
      if (a.op == Op::F && from_prev) l.push_back({Op::RecvAct, a.mb, a.chunk});
      if (a.op == Op::B && to_next) l.push_back({Op::RecvGrad, a.mb, a.chunk});
      l.push_back(a);
      if (a.op == Op::F && to_next) l.push_back({Op::SendAct, a.mb, a.chunk});
      if (a.op == Op::B && from_prev) l.push_back({Op::SendGrad, a.mb, a.chunk});
    }
}

// One message between two ranks: (direction, micro-batch, sending virtual stage).
struct Message {
  static constexpr int kActivation = 0, kGradient = 1;  // dir: forward, backward
  int dir, mb, from;
  bool operator<(const Message& o) const { return std::tie(dir, mb, from) < std::tie(o.dir, o.mb, o.from); }
  bool operator==(const Message& o) const { return dir == o.dir && mb == o.mb && from == o.from; }
};
inline Message message_of(const Plan& pl, int s, const Action& a) {
  const int k = pl.stage(s, a.chunk);
  switch (a.op) {
    case Op::SendAct: return {Message::kActivation, a.mb, k};
    case Op::RecvAct: return {Message::kActivation, a.mb, k - 1};
    case Op::SendGrad: return {Message::kGradient, a.mb, k};
    default: return {Message::kGradient, a.mb, k + 1};  // RecvGrad
  }
}
inline bool is_send(Op o) { return o == Op::SendAct || o == Op::SendGrad; }
// A message's MPI tag where messages are matched by tag (the executor's buffered sends): its
// number among the step's 2·K·m messages, (dir·K + from)·m + mb, wrapped at 32768 because MPI
// guarantees only tags 0 .. 32767 (the standard's least MPI_TAG_UB). Distinct while 2·p·V·m <= 32768.
constexpr int kMpiTagsGuaranteed = 32768;
inline int message_tag(const Plan& pl, const Message& msg) {
  return ((msg.dir * pl.K() + msg.from) * pl.m + msg.mb) % kMpiTagsGuaranteed;
}
inline int peer_of(const Plan& pl, int s, const Action& a) {
  const int k = pl.stage(s, a.chunk);
  return stage_rank(pl, a.op == Op::SendAct || a.op == Op::RecvGrad ? k + 1 : k - 1);
}

// Consecutive p2p actions form one group, posted together and waited for together (Megatron's
// send-forward-recv-backward pairs: where both directions move, both are in flight at once).
inline std::vector<std::vector<Action>> p2p_groups(const std::vector<Action>& list, std::vector<int>* at = nullptr) {
  std::vector<std::vector<Action>> g;
  for (size_t i = 0; i < list.size(); i++) {
    if (is_compute(list[i].op)) continue;
    if (i == 0 || is_compute(list[i - 1].op)) {
      g.emplace_back();
      if (at) at->push_back(int(i));
    }
    g.back().push_back(list[i]);
  }
  return g;
}

// Runs the lists under the strictest semantics, rendezvous: a message completes only while both
// its ends are posted, and a rank leaves a group when all its messages completed. If this
// finishes, no buffering or ordering of the transport can make the executor deadlock.
inline bool completes_under_rendezvous(const Plan& pl) {
  const int p = pl.p;
  std::vector<std::vector<std::vector<Action>>> groups{size_t(p)};
  for (int s = 0; s < p; s++) groups[s] = p2p_groups(pl.actions[s]);
  std::vector<size_t> at(size_t(p), size_t(0));  // per rank: the group it has posted
  std::vector<std::map<Message, bool>> done{size_t(p)};
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; s++) {
      if (at[s] >= groups[s].size()) continue;
      bool all = true;
      for (const Action& a : groups[s][at[s]]) {
        const Message msg = message_of(pl, s, a);
        if (done[s][msg]) continue;
        const int peer = peer_of(pl, s, a);
        bool matched = false;  // the peer's posted group holds the other end of msg
        if (at[peer] < groups[peer].size())
          for (const Action& b : groups[peer][at[peer]])
            if (is_send(b.op) != is_send(a.op) && message_of(pl, peer, b) == msg && peer_of(pl, peer, b) == s)
              matched = true;
        if (matched) done[s][msg] = done[peer][msg] = true;
        else all = false;
      }
      if (all) at[s]++, progress = true;
    }
  }
  for (int s = 0; s < p; s++)
    if (at[s] < groups[s].size()) return false;
  return true;
}

// "3,2": the split as --stage-layers takes it.
inline std::string split_text(const std::vector<int>& split) {
  std::string t;
  for (int n : split) t += (t.empty() ? "" : ",") + std::to_string(n);
  return t;
}

// The one function that makes a schedule: (p, m, V, schedule, split) -> per-rank action lists.
// `layers`: the decoder layers of each virtual stage (empty: p·V equal stages of one slot each).
// `pair_blocks`: DualPipeV's pairs as dualpipev.py runs them (see Simulator), for the bubble only.
inline Plan build_plan(int p, int m, int V, Schedule sched, std::vector<int> layers = {}, bool pair_blocks = false) {
  if (layers.empty()) layers.assign(size_t(p * V), 1);
  Plan pl = Simulator(p, m, V, sched, layers, pair_blocks).run(sched);
  pl.layers = std::move(layers);
  add_p2p(pl);
  return pl;
}

// One character per slot, one row per rank, like the playbook's figures: F, B or W (lower case
// on odd chunks), and under it the micro-batch (mod 10); '.' is a bubble.
inline std::vector<std::string> schedule_chart(const Plan& pl) {
  std::vector<std::string> rows;
  for (int s = 0; s < pl.p; s++) {
    std::string op(size_t(pl.makespan), '.'), mb(size_t(pl.makespan), ' ');
    for (const TimedAction& t : pl.timeline[s])
      for (int i = t.start; i < t.start + t.slots; i++) {
        const char c = t.action.op == Op::F ? 'F' : t.action.op == Op::B ? 'B' : 'W';
        op[size_t(i)] = t.action.chunk % 2 ? char(std::tolower(c)) : c;
        mb[size_t(i)] = char('0' + t.action.mb % 10);
      }
    rows.push_back("stage " + std::to_string(s) + " |" + op + "|");
    rows.push_back("        |" + mb + "|");
  }
  return rows;
}

// ----- the stage layout ---------------------------------------------------------------------------

// Virtual stage k holds the layers after those of stages 0..k−1, i.e. units 1 + first ..
// first + n_k; the first also the embedding (unit 0), the last also the head (unit L+1).
inline std::pair<int, int> stage_units(const std::vector<int>& split, int k) {
  int first = 0, L = 0;
  for (int j = 0; j < int(split.size()); j++) (j < k ? first : L) += split[size_t(j)];
  L += first;
  const int K = int(split.size());
  return {k == 0 ? 0 : 1 + first, k == K - 1 ? L + 2 : 1 + first + split[size_t(k)]};
}
inline ShardSpec shard_spec(const std::vector<int>& split, int p, int V, int rank, Schedule sched = Schedule::OneFOneB) {
  ShardSpec s;
  for (int ch = 0; ch < V; ch++) s.unit_runs.push_back(stage_units(split, virtual_stage(sched, p, rank, ch)));
  return s;
}
inline ShardSpec shard_spec(const Plan& pl, int rank) { return shard_spec(pl.layers, pl.p, pl.V, rank, pl.schedule); }
// The decoder layers rank `rank` holds over its V chunks (placed as virtual_stage places them).
inline int rank_layers(const std::vector<int>& split, int p, int rank, Schedule sched = Schedule::OneFOneB) {
  int n = 0;
  for (int c = 0; c < int(split.size()) / p; c++) n += split[size_t(virtual_stage(sched, p, rank, c))];
  return n;
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
inline void validate(const RunConfig& rc, int p, int V, Schedule sched) {
  if (p < 1) config_error("--pp must be >= 1 (got %d)", p);
  if (V < 1) config_error("--virtual-stages must be >= 1 (got %d)", V);
  if (V > 1 && sched != Schedule::Interleaved && sched != Schedule::DualPipeV)
    config_error("--virtual-stages %d needs --schedule interleaved (got %s)", V, schedule_name(sched));
  if (sched == Schedule::DualPipeV) validate_dualpipev(rc, p, V);
  if (rc.model.layers < p * V)
    config_error("--layers %d is fewer than --pp %d × --virtual-stages %d: every virtual stage holds at least one layer",
                 rc.model.layers, p, V);
  const int m = rc.batch / rc.micro_batch;
  if (sched == Schedule::Interleaved && m % p)
    config_error("--schedule interleaved needs the micro-batches per step (%d = batch %d / micro-batch %d) to be a "
                 "multiple of --pp %d",
                 m, rc.batch, rc.micro_batch, p);
}

// ----- predict: memory and p2p bytes per stage (notes/05 derives each line) ------------------------

// What one layer still holds between its B and its W (ZB-H1, DualPipeV), per token: the snapshotted
// output gradients of its seven matmuls (q D, k and v KV each, o D, gate and up F, down D) and
// the inputs they multiply (h1, y, h2, silu(g)·u).
inline double deferred_bytes_per_token(const ModelConfig& c, DType dt) {
  const double e = dtype_size(dt), D = c.dim, KV = c.kv_dim(), F = c.ffn;
  return ((3 * D + 2 * KV + 2 * F) + (3 * D + F)) * e;
}
// The extra a layer's deferred B holds on top of its complete set: the MLP's three snapshots
// (down D, gate and up F) before its saved tensors go, or, later, all seven snapshots (3D + 2KV +
// 2F) less what went from the complete set by then: g and u (F each), x_mid (D) and 1/rms₂ (one
// fp32 per token, as layer_activation_bytes counts the norms' statistics).
inline double deferred_b_peak_per_token(const ModelConfig& c, DType dt) {
  const double e = dtype_size(dt), D = c.dim, KV = c.kv_dim(), F = c.ffn;
  const double rstd_bytes = sizeof(float);  // 1/rms₂ of one token
  const double mlp_snapshots = (D + 2 * F) * e;
  const double all_snapshots_less_freed = (3 * D + 2 * KV + 2 * F) * e - (2 * F + D) * e - rstd_bytes;
  return std::max(mlp_snapshots, all_snapshots_less_freed);
}

// Peak saved activations of a rank, by replaying its compute list: a micro-batch chunk holds its
// n layers' saved sets from its F to its B (and n deferred sets from its B to its W). The peak is
// at one of: the F of a chunk's last layer ((n − 1) saved + a complete set + the output), the
// head (n saved + the head's tensors), or, when B defers, inside a layer's B.
// tp, sp: the stage's layers are tensor-parallel (04), with or without sequence parallelism (the
// ZB-H1 terms are derived for tp 1).
inline double predict_stage_activations(const Plan& pl, int rank, const ModelConfig& c, int64_t b, DType dt, Recompute rc,
                                        int tp = 1, bool sp = false) {
  const double tokens = double(b) * c.seq, e = dtype_size(dt) * (sp ? 1.0 / tp : 1.0);
  // Bytes per token: a layer's saved set under the recompute mode, its complete set, its output
  // (the next layer's input, [b·s, h]), its deferred set between B and W, the extra inside its B.
  const double saved = layer_activation_bytes(c, dt, rc, tp, sp);
  const double complete = layer_activation_bytes(c, dt, Recompute::None, tp, sp), output = c.dim * e;
  const double deferred = deferred_bytes_per_token(c, dt), in_b = deferred_b_peak_per_token(c, dt);
  double peak = 0, held = 0;  // bytes per token held by chunks in flight
  for (const TimedAction& t : pl.timeline[rank]) {
    const Action& a = t.action;
    const bool last = pl.stage(rank, a.chunk) == pl.K() - 1;
    const int k = pl.stage(rank, a.chunk);
    const double n = pl.layers[size_t(k)];
    if (a.op == Op::F) {
      // An output the stage before left on this rank (DualPipeV's turn) is now the first layer's input.
      if (k > 0 && stage_rank(pl, k - 1) == rank) held -= output;
      peak = std::max(peak, held + (n - 1) * saved + complete + output);
      if (last) peak = std::max(peak, held + n * saved + head_activation_bytes(c, dt, tp, sp));
      held += n * saved;
      // Not sent: the output waits here for the next stage's F, whatever runs in between.
      if (!last && stage_rank(pl, k + 1) == rank) held += output;
    } else if (a.op == Op::B && splits_backward(pl.schedule)) {
      held -= n * saved;
      // Inside the B of the chunk's i-th layer from the top: n − 1 − i layers still saved, i deferred.
      for (int i = 0; i < int(n); i++)
        peak = std::max(peak, held + (n - 1 - i) * saved + i * deferred + complete + in_b);
      held += n * deferred;
    } else {
      held -= a.op == Op::B ? n * saved : n * deferred;
    }
  }
  return tokens * peak;
}

// p2p wire bytes a rank sends per step: one [b·s, h] activation per micro-batch and chunk to
// the next stage, one gradient of the same size to the previous one (the playbook's s·b·h per
// micro-batch each way), except past the ends of the pipeline.
// token_share: the part of a micro-batch's tokens a rank's residual stream holds (1/tp under
// 04's sequence parallelism).
inline double p2p_tensor_bytes(const ModelConfig& c, int64_t b, DType dt, double token_share) {
  return double(b) * c.seq * token_share * c.dim * dtype_size(dt);  // [b·s, h]
}
inline double predict_send_bytes(const ModelConfig& c, int64_t b, DType dt, int p, int m, int V, int rank,
                                 double token_share = 1.0) {
  if (p == 1) return 0;
  const double tensor_bytes = p2p_tensor_bytes(c, b, dt, token_share);
  // m·V of each, less the last virtual stage's activations and the first's gradients (rank p − 1's
  // and rank 0's last and first chunks: they have no next or previous stage).
  const double acts = double(m) * V - (rank == p - 1 ? m : 0), grads = double(m) * V - (rank == 0 ? m : 0);
  return (acts + grads) * tensor_bytes;
}
// The same counted off the plan's lists, which any placement has: under DualPipeV the ranks at the
// ends send 2m tensors (rank 0's last stage and rank p − 1's turn send nothing on), the others 4m.
inline double predict_send_bytes(const ModelConfig& c, int64_t b, DType dt, const Plan& pl, int rank,
                                 double token_share = 1.0) {
  int sends = 0;
  for (const Action& a : pl.actions[size_t(rank)]) sends += is_send(a.op);
  return sends * p2p_tensor_bytes(c, b, dt, token_share);
}

// ----- predict: step time (the pieces in common/training/step_time.h) ------------------------------------------

// p2p calls per step: an activation and a gradient per micro-batch and chunk.
inline double p2p_calls(double micro_batches, int V) { return 2 * micro_batches * V; }

// The pipeline's terms: the busiest rank's layers set the pace (t_compute, set before for L/p
// layers, scaled by its share: 1 when even; t_tp, set before, is already that rank's); the
// simulated bubble idles its compute and its tp collectives alike; the busiest stage's sends (a
// middle one) wait on the critical path. token_share as predict_send_bytes takes it.
inline void price_pipeline(StepTerms& s, const Network& net, const RunConfig& rc, const Plan& pl, double token_share,
                           double micro_batches, int nodes) {
  s.t_compute *= pl.busiest_share();
  s.bubble = pl.bubble();
  s.t_bubble = s.bubble * (s.t_compute + s.t_tp);
  double send = 0;
  for (int r = 0; r < pl.p; r++)
    send = std::max(send, predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, r, token_share));
  s.t_pp = collective_seconds(net, Collective::P2P, send, p2p_calls(micro_batches, pl.V), nodes);
}

// This run's step: each stage computes its 1/p of the layers; then the bubble and the sends. The
// gradients are complete only after the flush, so no reduction could hide behind backward.
inline StepTerms predict_step_time(const Gpu& g, const RunConfig& rc, const Plan& pl) {
  StepTerms s = compute_terms(g, rc, 1, 1, pl.p, pl.p);
  if (pl.p > 1) price_pipeline(s, g.net, rc, pl, 1.0, double(rc.batch) / rc.micro_batch, 1);
  s.total();
  return s;
}

inline MemoryPrediction predict_memory(const RunConfig& rc, const Plan& pl, int rank) {
  const int64_t psi = local_param_count(Model::make_table(rc.model, 1, shard_spec(pl, rank)));
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_stage_activations(pl, rank, rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

// The most micro-batch chunks a rank holds saved activations for at once (F run, B not yet).
inline int peak_in_flight(const Plan& pl, int rank) {
  int held = 0, peak = 0;
  for (const TimedAction& t : pl.timeline[size_t(rank)]) {
    held += t.action.op == Op::F ? 1 : t.action.op == Op::B ? -1 : 0;
    peak = std::max(peak, held);
  }
  return peak;
}

// The simulated bubble against its formula; DualPipeV's also beside 1F1B's and ZB-H1's at the same p
// and m, whose stages hold twice the layers (a slot there is two of DualPipeV's: the ratios
// compare), and, with its pairs run as dualpipev.py's blocks, against the DualPipe README's table.
inline void log_bubble(RunLog& log, const Plan& pl) {
  log.line("bubble (idle / compute): simulated %.4f, formula %.4f", pl.bubble(),
           bubble_formula(pl.schedule, pl.p, pl.m, pl.V));
  if (pl.schedule != Schedule::DualPipeV) return;
  const Plan one = build_plan(pl.p, pl.m, 1, Schedule::OneFOneB), zb = build_plan(pl.p, pl.m, 1, Schedule::ZBH1);
  log.line("  beside it: 1f1b simulated %.4f, formula %.4f; zb-h1 simulated %.4f, formula %.4f", one.bubble(),
           bubble_formula(one.schedule, pl.p, pl.m, 1), zb.bubble(), bubble_formula(zb.schedule, pl.p, pl.m, 1));
  log.line("  idle slots per rank: simulated %d = p - 1; chunks in flight on rank 0: %d, the table's PP + 1 = %d",
           pl.makespan - pl.busiest(), peak_in_flight(pl, 0), 2 * pl.p + 1);
  const Plan blocks = build_plan(pl.p, pl.m, 2, Schedule::DualPipeV, {}, true);
  const int table = dualpipe_table_idle_slots(pl.p);
  log.line("  each F&B pair one block, its outputs sent at its end (dualpipev.py): simulated %d idle slots, bubble "
           "%.4f; DualPipe's (PP/2 - 1)(F&B + B - 3W) = %d (F = W = 1, B = 2, F&B = F + B = 3), bubble %.4f",
           blocks.makespan - blocks.busiest(), blocks.bubble(), table, table / (6.0 * pl.m));
}

inline void print_plan(RunLog& log, const RunConfig& rc, const Plan& pl, bool chart) {
  print_model(log, rc.model);
  log.line("pp %d, schedule %s, %d virtual stage%s per rank, layers per virtual stage %s; m = %d micro-batch%s of %d",
           pl.p, schedule_name(pl.schedule), pl.V, pl.V > 1 ? "s" : "", split_text(pl.layers).c_str(), pl.m,
           pl.m > 1 ? "es" : "", rc.micro_batch);
  for (int s = 0; s < pl.p; s++) {
    const MemoryPrediction mp = predict_memory(rc, pl, s);
    log.line("  stage %d: params %s, grads %s, optimizer %s, activations %s; p2p sent per step %s", s,
             human_bytes(mp.params).c_str(), human_bytes(mp.grads).c_str(), human_bytes(mp.optimizer).c_str(),
             human_bytes(mp.activations).c_str(),
             human_bytes(predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, s)).c_str());
  }
  log_bubble(log, pl);
  // The default micro-batch is the whole batch (m = 1): the stages then take turns.
  const int most = pl.m * rc.micro_batch;  // micro-batches of one sequence each
  if (pl.p > 1 && pl.m < pl.p && rc.micro_batch > 1)
    log.line("hint: with m = %d the stages mostly wait for one another; split the batch with --micro-batch "
             "(--micro-batch 1 gives m = %d, bubble formula %.4f)", pl.m, most, bubble_formula(pl.schedule, pl.p, most, pl.V));
  if (!chart) return;
  for (const std::string& r : schedule_chart(pl)) log.line("%s", r.c_str());
  if (pl.schedule != Schedule::DualPipeV) return;
  log.line("the same lists, each F&B pair one block (dualpipev.py):");
  for (const std::string& r : schedule_chart(build_plan(pl.p, pl.m, 2, Schedule::DualPipeV, {}, true))) log.line("%s", r.c_str());
}

// What the memory table's comm row holds: copies of sends not yet known to be received, which
// only lists that cannot post each send with its receive keep (the executor's flush()).
inline std::string comm_holds(const Plan& pl) {
  if (completes_under_rendezvous(pl)) return "";
  return "copies of the sends still in flight (" + std::string(schedule_name(pl.schedule)) + ")";
}

// ----- the executor -------------------------------------------------------------------------------

// Runs this rank's action list for one step. Activations received are saved tensors (the first
// layer's input); gradients received are workspace. Each p2p group is posted at once and waited
// for before the next compute action, so what a stage holds is exactly what its list says.
class Pipeline {
 public:
  // tokens: b·s of a micro-batch, the rows of every tensor that travels.
  Pipeline(Model& m, Comm& group, const Plan& plan, int rank, int64_t tokens)
      : m_(m), pp_(group), pl_(plan), rank_(rank), tokens_(tokens), grouped_(completes_under_rendezvous(plan)) {
    // A buffered list's messages are matched by their tags (flush()), which NCCL does not have.
    if (!grouped_) pp_.match_p2p_by_tag();
  }
  virtual ~Pipeline() = default;

  // Runs this rank's action list for one step. The last stage's head adds the token losses to
  // the model's tally (take_loss); the other stages add none.
  void run_step(const TokenData& data, const RunConfig& rc, long step) {
    st_.clear();
    acts_.clear();
    grads_.clear();
    const double t0 = Trace::get().now_us();
    const std::vector<Action>& list = pl_.actions[rank_];
    std::vector<Action> group;
    for (const Action& a : list) {
      if (!is_compute(a.op)) {
        group.push_back(a);
        continue;
      }
      flush(group);
      const double c0 = Trace::get().now_us();
      compute(a, data, rc, step);
      busy_us_ += Trace::get().now_us() - c0;
    }
    flush(group);
    for (Work& w : in_flight_) w.wait();  // every receive has completed, so every send is matched
    in_flight_.clear();
    span_us_ += Trace::get().now_us() - t0;
    st_.clear();
  }
  double busy_us() const { return busy_us_; }
  double idle_us() const { return span_us_ - busy_us_; }

 protected:
  // Micro-batch mb of the step: the global batch's sequences [mb·b, (mb+1)·b).
  virtual ForwardState begin_microbatch(const TokenData& data, const RunConfig& rc, long step, int mb) {
    const int b = rc.micro_batch;
    const MicroBatch mbt = make_microbatch(data, step, rc.batch, rc.model.seq, mb * b, b, m_.dev);
    return m_.begin_microbatch(mbt.inputs, mbt.targets, b);
  }

  // One F, B or W of this rank's list.
  virtual void compute(const Action& a, const TokenData& data, const RunConfig& rc, long step) {
    const int k = pl_.stage(rank_, a.chunk), L = m_.cfg.layers, T = rc.model.seq;
    const auto [ub, ue] = stage_units(pl_.layers, k);  // units [ub, ue): 0 embedding, 1..L layers, L + 1 head
    if (!st_.count(a.mb)) st_.emplace(a.mb, begin_microbatch(data, rc, step, a.mb));
    ForwardState& st = st_.at(a.mb);
    const std::string what = " mb " + std::to_string(a.mb) + " stage " + std::to_string(k);
    if (a.op == Op::F) {
      TraceScope ts("F" + what);
      Tensor x = k == 0 ? Tensor() : take(acts_, key(a.mb, k));
      const float grad_scale = 1.f / (float(rc.batch) * T);  // the loss is the mean over the step's tokens
      for (int u = ub; u < ue; u++) m_.unit_forward(u, st, x, grad_scale);
      if (k == K() - 1) {
        // The head added this micro-batch's token losses to the model's tally, in micro-batch
        // order as 01 adds them.
        grads_[key(a.mb, k)] = x;  // the head left d(loss)/d(its input) in x
      } else {
        acts_[key(a.mb, k + 1)] = x;
      }
    } else if (a.op == Op::B) {
      const bool defer = splits_backward(pl_.schedule);
      TraceScope ts((defer ? "B (input grad)" : "B") + what);
      Tensor dx = take(grads_, key(a.mb, k));
      // The head (unit L + 1) ran its backward inside its F; the other units go top down.
      for (int u = std::min(ue, L + 1) - 1; u >= ub; u--) m_.unit_backward(u, st, dx, defer);
      if (k > 0) grads_[key(a.mb, k - 1)] = dx;
    } else {
      TraceScope ts("W" + what);
      // The decoder layers' deferred matmuls; the embedding's backward (unit 0) deferred nothing.
      for (int u = std::min(ue, L + 1) - 1; u >= std::max(ub, 1); u--) m_.unit_backward_weights(u, st);
    }
  }

 private:
  int K() const { return pl_.K(); }
  std::pair<int, int> key(int mb, int k) const { return {mb, k}; }
  static Tensor take(std::map<std::pair<int, int>, Tensor>& from, std::pair<int, int> k) {
    auto it = from.find(k);
    TS_CHECK(it != from.end(), "pipeline: no tensor for micro-batch %d, stage %d", k.first, k.second);
    Tensor t = it->second;
    from.erase(it);
    return t;
  }

  // Rendezvous-safe lists (AFAB, 1F1B, ZB-H1): a group's sends and receives are posted together
  // (a send and a receive as one send_recv, which NCCL groups) and waited for together.
  // Otherwise (interleaved and DualPipeV: one link carries both directions of several chunks in
  // orders that differ at its two ends) a send goes out from a copy (Tag::Comm) without waiting, and only
  // receives block. Every receive's message was sent at an earlier slot of the simulation, whose
  // order each list keeps, so by induction over the slots every receive completes. That needs MPI's
  // semantics (tags, sends that complete unmatched), so such a list's messages travel by MPI even
  // on an NCCL group (Comm::match_p2p_by_tag).
  void flush(std::vector<Action>& group) {
    if (group.empty()) return;
    TraceScope ts("pp p2p", Lane::Comm);
    std::vector<std::pair<Tensor, int>> sends, recvs;  // tensor, tag
    std::vector<int> send_peer, recv_peer;
    for (const Action& a : group) {
      const Message msg = message_of(pl_, rank_, a);
      // Grouped lists keep one order per link at both ends (the rendezvous check proves it), so
      // messages match in order under one tag; buffered ones are matched by a tag per message.
      const int tag = grouped_ ? 0 : message_tag(pl_, msg);
      const int peer = peer_of(pl_, rank_, a);
      const int k = pl_.stage(rank_, a.chunk);
      if (is_send(a.op)) {
        Tensor t = a.op == Op::SendAct ? take(acts_, key(a.mb, k + 1)) : take(grads_, key(a.mb, k - 1));
        if (!grouped_) {
          Tensor c = Tensor::empty(t.shape, t.dtype, t.device(), Tag::Comm);
          copy(c, t);
          t = c;
        }
        sends.push_back({t, tag});
        send_peer.push_back(peer);
      } else {
        Tensor t = Tensor::empty({tokens_, m_.cfg.dim}, m_.dtype, m_.dev, a.op == Op::RecvAct ? Tag::Activations : Tag::Workspace);
        (a.op == Op::RecvAct ? acts_ : grads_)[key(a.mb, k)] = t;
        recvs.push_back({t, tag});
        recv_peer.push_back(peer);
      }
    }
    group.clear();
    std::vector<Work> works;
    size_t i = 0;
    if (grouped_)
      for (; i < sends.size() && i < recvs.size(); i++)
        works.push_back(pp_.send_recv_async(sends[i].first, send_peer[i], recvs[i].first, recv_peer[i], sends[i].second));
    for (size_t j = i; j < sends.size(); j++) {
      Work w = pp_.send_async(sends[j].first, send_peer[j], sends[j].second);
      if (grouped_) works.push_back(std::move(w));
      else in_flight_.push_back(std::move(w));
    }
    for (size_t j = i; j < recvs.size(); j++) works.push_back(pp_.recv_async(recvs[j].first, recv_peer[j], recvs[j].second));
    for (Work& w : works) w.wait();
    in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(), [](Work& w) { return w.done(); }), in_flight_.end());
  }

  Model& m_;
  Comm& pp_;
  const Plan& pl_;
  int rank_;
  int64_t tokens_;
  bool grouped_;
  std::vector<Work> in_flight_;  // buffered sends not known to be complete
  std::map<int, ForwardState> st_;
  std::map<std::pair<int, int>, Tensor> acts_, grads_;  // (micro-batch, virtual stage) -> its input / output gradient
  double busy_us_ = 0, span_us_ = 0;
};

}  // namespace pp

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 5
using namespace ts;

static const char* kDoc =
    "05_pipeline_parallel: pipeline parallelism with the AFAB (GPipe), 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV schedules.\n"
    "usage: mpirun -np P 05_pipeline_parallel --pp P --schedule afab|1f1b|interleaved|zb-h1|dualpipev [--virtual-stages V] "
    "[flags]";

// Every stage runs its list; the last holds the loss (the others add 0), every stage holds
// different parameters, so the gradient norm is summed over the pp group.
static StepResult train_step(Model& model, AdamW& opt, pp::Pipeline& pipe, const TokenData& data, const RunConfig& rc,
                             Mesh& mesh, long step) {
  ts::zero(model.grads);
  pipe.run_step(data, rc, step);
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {mesh.pp().mpi()});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  return {global_mean_loss(model.take_loss(), double(rc.batch) * rc.model.seq, {mesh.pp().mpi()}), norm};
}

// Per stage, gathered to rank 0 for the summary: activations measured and predicted, p2p bytes
// sent per step measured and predicted, and the idle and busy time of the pipeline phase.
static Json stage_report(RunLog& log, Mesh& mesh, const RunConfig& rc, const pp::Plan& pl, const pp::Pipeline& pipe,
                         long steps) {
  const Comm& g = mesh.pp();
  double sent = 0;
  for (auto& [op, s] : g.stats()) sent += s.wire_bytes;
  const double mine[6] = {double(mem_stats(mesh.device).peak[int(Tag::Activations)]),
                          pp::predict_stage_activations(pl, mesh.pp_rank, rc.model, rc.micro_batch, rc.dtype, rc.recompute),
                          sent / double(std::max(1L, steps)),
                          pp::predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, pl, mesh.pp_rank),
                          pipe.idle_us(), pipe.busy_us()};
  std::vector<double> all(size_t(6 * pl.p));
  watched_gather(mine, 6, MPI_DOUBLE, all.data(), 0, g.mpi(), "gather (the stage report)");
  Json stages = Json::array();
  log.line("stage   activations measured / predicted      p2p sent per step measured / predicted   bubble measured");
  for (int s = 0; s < pl.p; s++) {
    const double* v = &all[size_t(6 * s)];
    Json j = Json::object();
    j["activations_measured"] = v[0];
    j["activations_predicted"] = v[1];
    j["send_bytes"] = v[2];
    j["send_predicted"] = v[3];
    j["bubble_measured"] = v[5] > 0 ? v[4] / v[5] : 0.0;
    log.line("  %d   %14s %14s            %14s %14s          %.4f", s, human_bytes(v[0]).c_str(), human_bytes(v[1]).c_str(),
             human_bytes(v[2]).c_str(), human_bytes(v[3]).c_str(), v[5] > 0 ? v[4] / v[5] : 0.0);
    stages.push_back(std::move(j));
  }
  pp::log_bubble(log, pl);
  const ThreadChoice& t = thread_choice();
  const bool crowded = t.local_ranks * t.threads > t.cores;
  if (crowded)
    log.line("(bubble measured: %d ranks × %d thread%s share %d cores here, so it also counts the time a rank waits for "
             "a core; the schedule's own idle time is the simulated one)", t.local_ranks, t.threads,
             t.threads > 1 ? "s" : "", t.cores);
  Json r = Json::object();
  r["bubble_measured_counts_core_waits"] = crowded;
  r["stages"] = std::move(stages);
  r["bubble_simulated"] = pl.bubble();
  r["bubble_formula"] = pp::bubble_formula(pl.schedule, pl.p, pl.m, pl.V);
  r["schedule"] = pp::schedule_name(pl.schedule);
  return r;
}

// --schedule, checked, and the action lists of every rank for this run's m micro-batches.
// The chapter's flags.
struct PipeFlags {
  int p = 1, V = 1;
  std::string schedule, split;
  bool chart = false;
};
static pp::Plan make_plan(const RunConfig& rc, const PipeFlags& f) {
  pp::Schedule sched;
  if (!pp::parse_schedule(f.schedule, sched, true))
    config_error("unknown --schedule '%s' (afab, 1f1b, interleaved, zb-h1 or dualpipev)", f.schedule.c_str());
  // DualPipeV's V is two stages per rank: the default --virtual-stages 1 means its own 2.
  const int V = sched == pp::Schedule::DualPipeV && f.V == 1 ? 2 : f.V;
  pp::validate(rc, f.p, V, sched);
  const pp::Plan plan =
      pp::build_plan(f.p, rc.batch / rc.micro_batch, V, sched, pp::stage_split(f.split, rc.model.layers, f.p * V));
  TS_CHECK(plan.complete, "schedule %s at pp %d, m %d, V %d deadlocks", pp::schedule_name(sched), f.p, plan.m, V);
  return plan;
}

// The loop's checkpoint and reports: every stage writes its units at their global offsets (the
// file is the same for any mesh); the p2p bytes against predict_send_bytes; each stage's memory,
// sends and bubble.
static void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, Model& model, AdamW& opt,
                        pp::Pipeline& pipe, const pp::Plan& plan) {
  loop.save = [&](long step) {
    Json m = Json::object();
    m["pp"] = plan.p;
    m["schedule"] = pp::schedule_name(plan.schedule);
    m["virtual_stages"] = plan.V;
    save_checkpoint(rc.save_dir, rc, model.table, {{0, model.table.total, weights_f32(model.params, opt), &opt}},
                    step, m);
  };
  auto steps_run = std::make_shared<long>(0);  // comm runs first and tells extra how many steps ran
  loop.comm = [&, steps_run](long n) {
    *steps_run = n;
    std::map<std::string, double> pred = {
        {"send", pp::predict_send_bytes(rc.model, rc.micro_batch, rc.dtype, plan, 0)}, {"recv", 0.0}};
    return comm_report(log, mesh.pp(), n, pred);
  };
  loop.extra = [&, steps_run](Json& s) { s["pp"] = stage_report(log, mesh, rc, plan, pipe, *steps_run); };
}

// The chapter's flags: the degree, the schedule, the chunks per rank, the layers per stage.
static PipeFlags read_pipe_flags(Args& args, MeshConfig& mc) {
  PipeFlags f;
  f.p = mc.pp = args.get_int("--pp", 1, "pipeline-parallel degree (= number of ranks)", degree_range());
  f.schedule = args.get_str("--schedule", "1f1b", "afab | 1f1b | interleaved | zb-h1 | dualpipev");
  f.V = args.get_int("--virtual-stages", 1, "chunks per rank (interleaved; dualpipev: 2): V·pp virtual stages");
  f.split = args.get_str("--stage-layers", "", "layers per virtual stage a,b,… (default: even, or the ends lighter)");
  f.chart = args.get_bool("--schedule-chart", "print each rank's timeline of the schedule (unit costs)");
  return f;
}

int main(int argc, char** argv) {
  PipeFlags f;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { f = read_pipe_flags(a, mc); });
  RunConfig& rc = run.rc;
  const pp::Plan plan = make_plan(rc, f);
  if (!run.start([&] { pp::print_plan(run.log(), rc, plan, f.chart); },
                 [&] { return pp::predict_memory(rc, plan, run.mesh.pp_rank); }))
    return 0;
  Model& model = run.build_model({pp::shard_spec(plan, run.mesh.pp_rank)});  // this stage's layers
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);
  pp::Pipeline pipe(model, run.mesh.pp(), plan, run.mesh.pp_rank, int64_t(rc.micro_batch) * rc.model.seq);
  Loop loop;
  loop.predicted = pp::predict_memory(rc, plan, 0);  // stage 0's, the one the memory table reports
  loop.predicted.comm_also_holds(pp::comm_holds(plan));
  loop.step = [&](long step) { return train_step(model, opt, pipe, run.data, rc, run.mesh, step); };
  add_reports(loop, run.log(), rc, run.mesh, model, opt, pipe, plan);
  return run.train(loop, [&](const Gpu& g) { return pp::predict_step_time(g, rc, plan); });
}
#endif  // TS_PROGRAM == 5
#endif  // TS_05_PIPELINE_PARALLEL_CU
