// lab/05_simulator.h — 05's lab: a plan on a simulated clock. 05_pipeline_parallel.cu's
// build_plan gives each rank its list of actions; this plays the lists' compute actions on one
// clock and prices the schedule: the timeline and its chart, the makespan, the simulated bubble
// the planner uses, and whether the order completes at all (05's main checks that before a run).
// The variants whose order needs the clock include it too: 05a's W's go where a bubble would be,
// 05b's pairs run as one block for the bubble DualPipe's table counts.
#ifndef TS_LAB_05_SIMULATOR_H
#define TS_LAB_05_SIMULATOR_H
#include <algorithm>
#include <array>
#include <cctype>
#include <numeric>
#include <string>
#include <vector>

#include "../05_pipeline_parallel.cu"

namespace pp {

// The decoder layers rank `rank` holds over its chunks (08's planner finds the busiest stage by it).
inline int rank_layers(const std::vector<int>& split, int p, int rank, Schedule sched = kOneFOneB) {
  int n = 0;
  for (int c = 0; c < int(split.size()) / p; c++) n += split[size_t(sched->stage(p, rank, c))];
  return n;
}

// A compute action placed on the simulated clock: it runs in slots [start, start + slots).
struct TimedAction {
  Action action;
  int start, slots;
};

// The plan with, per rank, its compute actions on the clock (the timeline). A slot is the time
// one layer's forward takes (g layers' when every stage's layer count is a multiple of g: see
// stage_costs).
struct SimulatedPlan : Plan {
  SimulatedPlan() = default;
  explicit SimulatedPlan(const Plan& pl) : Plan(pl) {}
  std::vector<std::vector<TimedAction>> timeline;
  int makespan = 0;       // the slot at which the last action of any rank finishes
  bool complete = false;  // the simulation ran every action (false: the order deadlocks)
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
  // The busiest rank's share of L/p (1 when the split is even).
  double busiest_share() const {
    int most = 0, all = 0;
    for (int s = 0; s < p; s++) {
      const int n = rank_layers(layers, p, s, schedule);
      most = std::max(most, n), all += n;
    }
    return double(most) * p / std::max(1, all);
  }
};

// Each virtual stage's cost in slots: its F takes cost_k slots and its B 2·cost_k (the input and
// the weight gradients, each a matmul the size of the forward's), or, split, B and W cost_k each.
// cost_k is stage k's layer count over g, the greatest common divisor of all the counts, so an
// even split costs one slot per F: the playbook's unit-cost charts.
inline std::vector<int> stage_costs(const std::vector<int>& layers) {
  int g = 0;
  for (int n : layers) g = std::gcd(g, n);
  std::vector<int> cost;
  for (int n : layers) cost.push_back(n / std::max(1, g));
  return cost;
}

// The simulator plays every rank's compute order (its list's F, B and W) on one clock, slot by
// slot: at each slot an idle rank starts its next action if that action's inputs have finished
// (pick). F(mb, k) needs F(mb, k − 1); B(mb, k) needs F(mb, k) and B(mb, k + 1); W(mb, k) needs
// B(mb, k). A slot in which a rank neither computes nor can start anything is a bubble. A variant
// that decides more than its order (what fills a bubble, actions run as one block) overrides pick
// and start.
class Simulator {
 public:
  explicit Simulator(SimulatedPlan& pl)
      : pl_(pl), stage_cost_(stage_costs(pl.layers)), forward_finish_(size_t(pl.m * pl.K()), -1),
        backward_finish_(size_t(pl.m * pl.K()), -1) {}
  virtual ~Simulator() = default;

  // Fills the plan's timeline, makespan and completeness.
  void run() {
    const int p = pl_.p;
    pl_.timeline.assign(size_t(p), {});
    order_.assign(size_t(p), {});
    for (int s = 0; s < p; s++)
      for (const Action& a : pl_.actions[size_t(s)])
        if (is_compute(a.op)) order_[s].push_back(a);
    // Per rank: the slot it is busy until, its place in its order, and the F, B and W it started.
    std::vector<int> busy_until(size_t(p), 0);
    next_.assign(size_t(p), 0);
    started_.assign(size_t(p), {0, 0, 0});
    const int actions = p * pl_.m * pl_.V * (splits_backward(pl_.schedule) ? 3 : 2);  // F, B (and W) each
    const int last_slot = total_work();  // see total_work: past it, a deadlock
    for (int t = 0; t < last_slot && all_started_ < actions; t++)
      for (int s = 0; s < p; s++) {
        Action a{};
        if (busy_until[s] > t || !pick(s, t, a)) continue;  // busy, or nothing can start: a bubble slot
        started_[s][int(a.op)]++;
        busy_until[s] = start(a, s, t);
      }
    pl_.complete = all_started_ == actions;
  }

 protected:
  // The action rank s starts at slot t, if any: the next of its order, once its inputs are ready.
  virtual bool pick(int s, int t, Action& a) {
    if (next_[s] >= int(order_[s].size()) || !inputs_ready(order_[s][next_[s]], s, t)) return false;
    a = order_[s][next_[s]++];
    return true;
  }
  // Starts a on rank s at slot t; returns the slot at which the rank is free again.
  virtual int start(const Action& a, int s, int t) {
    all_started_++;
    return place(a, s, t);
  }
  // Action a on rank s from slot t: its finish, its place on the timeline; returns its end.
  int place(const Action& a, int s, int t) {
    const int k = pl_.stage(s, a.chunk);
    const int slots = stage_cost_[size_t(k)] * (a.op == Op::B && !splits_backward(pl_.schedule) ? 2 : 1);
    if (a.op == Op::F) forward_finish_[at(a.mb, k)] = t + slots;
    if (a.op == Op::B) backward_finish_[at(a.mb, k)] = t + slots;
    pl_.timeline[s].push_back({a, t, slots});
    pl_.makespan = std::max(pl_.makespan, t + slots);
    return t + slots;
  }
  int at(int mb, int k) const { return mb * pl_.K() + k; }  // (micro-batch, virtual stage) in the finish tables
  static bool finished_by(int finish, int t) { return finish >= 0 && finish <= t; }
  bool inputs_ready(const Action& a, int s, int t) const {
    const int k = pl_.stage(s, a.chunk), K = pl_.K();
    if (a.op == Op::F) return k == 0 || finished_by(forward_finish_[at(a.mb, k - 1)], t);
    if (a.op == Op::B)
      return finished_by(forward_finish_[at(a.mb, k)], t) &&
             (k == K - 1 || finished_by(backward_finish_[at(a.mb, k + 1)], t));
    return finished_by(backward_finish_[at(a.mb, k)], t);  // W
  }
  int started(int s, Op op) const { return started_[s][int(op)]; }

  SimulatedPlan& pl_;
  std::vector<std::vector<Action>> order_;  // per rank: its compute order
  std::vector<int> next_;                   // per rank: its place in its order
  int all_started_ = 0;                     // actions started, all ranks
  std::vector<int> stage_cost_;             // per virtual stage: the slots of its F (stage_costs)
  std::vector<int> forward_finish_, backward_finish_;  // per (micro-batch, virtual stage): the slot its
                                                       // F / B finishes; -1 before it starts

 private:
  // The slot by which every schedule that can finish has finished: all ranks' work added up,
  // m·Σ_k 3·cost_k (per micro-batch and virtual stage F + B = 1 + 2, or F + B + W = 1 + 1 + 1,
  // times the stage's cost). Until the last action finishes some rank computes in every slot: a
  // slot where every rank is idle and none can start leaves every finish time and count as it
  // was, so no later slot can start anything either, and the order has deadlocked. So a schedule
  // that completes has a makespan of at most the sum of its actions' slots, and one still short
  // of its actions there never completes (SimulatedPlan::complete false).
  int total_work() const {
    int slots = 0;
    for (int cost : stage_cost_) slots += 3 * cost;
    return pl_.m * slots;
  }
  std::vector<std::array<int, 3>> started_;  // per rank: the F, B and W it started
};

// The plan's lists on the clock, and build_plan's plan on it.
inline SimulatedPlan simulate(const Plan& pl) {
  SimulatedPlan sim(pl);
  Simulator(sim).run();
  return sim;
}
inline SimulatedPlan simulated_plan(int p, int m, int V, Schedule sched, std::vector<int> layers = {}) {
  return simulate(build_plan(p, m, V, sched, std::move(layers)));
}

// One character per slot, one row per rank, like the playbook's figures: F, B or W (lower case
// on odd chunks), and under it the micro-batch (mod 10); '.' is a bubble.
inline std::vector<std::string> schedule_chart(const SimulatedPlan& pl) {
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

}  // namespace pp
#endif  // TS_LAB_05_SIMULATOR_H
