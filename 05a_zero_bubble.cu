// 05a_zero_bubble.cu — ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), read after
// 05_pipeline_parallel.cu.
//
// What it adds to chapter 05: the backward split in two. 1F1B's B computes two gradients, the
// input's (which the stage before waits for: the critical path) and the weights' (which nothing
// waits for until the optimizer). ZB-H1 runs B as the input gradient only and the weight gradients
// as a separate action W (the model's unit_backward with `defer`, then unit_backward_weights), and
// moves each W into what would be a bubble. With 1F1B's bound on the micro-batches in flight (p
// until their W), the bubble drops from (p − 1)/m to (p − 1)/(3m) at the same memory for the
// activations, plus the snapshots a deferred W holds (lab/05_pipeline_parallel.h,
// deferred_set_per_token).
//
// How it plugs in: a registry entry (pp::add_schedule, as 05 registers its own three) with
// split_backward set (B and W one slot each, so the executor defers) and an order the clock
// decides: FillSimulator, on the lab's simulated clock (lab/05_simulator.h), puts each W where a
// bubble would be. Its lists are rendezvous-safe, like 1F1B's: ZB-H1 needs no buffered sends.
//   ./build/05_pipeline_parallel --dry-run --pp 4 --layers 4 --schedule zb-h1 --batch 8 --micro-batch 1 --schedule-chart
#ifndef TS_05A_ZERO_BUBBLE_CU
#define TS_05A_ZERO_BUBBLE_CU
#include <vector>

#include "05_pipeline_parallel.cu"
#include "lab/05_simulator.h"  // the clock FillSimulator places the W's on

namespace pp {

// ZB-H1 follows 1F1B's order of F and B and fits the W's in: when the next F or B cannot start,
// the rank runs its oldest pending W instead (what would be a bubble), and an F waits, the W's
// going first, while p micro-batches hold activations (F done, W not: 1F1B's bound at stage 0).
class FillSimulator : public Simulator {
 public:
  using Simulator::Simulator;

 protected:
  bool pick(int s, int t, Action& a) override {
    const int forwards = started(s, Op::F), backwards = started(s, Op::B), weight_grads = started(s, Op::W);
    const bool next_is_f = next_[s] < int(order_[s].size()) && order_[s][next_[s]].op == Op::F;
    const int in_flight_limit = pl_.p;  // most micro-batches with F done, W not
    const bool too_many_in_flight = next_is_f && forwards - weight_grads >= in_flight_limit;
    if (!too_many_in_flight && Simulator::pick(s, t, a)) return true;
    if (weight_grads < backwards && finished_by(backward_finish_[at(weight_grads, s)], t)) {
      a = {Op::W, weight_grads, 0};  // ZB-H1 has V = 1: chunk 0, micro-batches in order
      return true;
    }
    return false;
  }
};

// ZB-H1's lists: 1F1B's F and B, and each W where FillSimulator starts it. The lab's plain
// simulator, playing these lists, finds FillSimulator's timeline again (tests/test_pp.cpp): where
// FillSimulator holds an F back (p micro-batches short of their W), 1F1B's order leaves at most
// p − s − 1 of them short of their B, so a W is ready instead, and no slot FillSimulator leaves
// idle could have started the list's next action.
inline void zb_h1_order(Plan& pl) {
  SimulatedPlan sim(pl);
  FillSimulator(sim).run();
  for (int s = 0; s < pl.p; s++) {
    pl.actions[size_t(s)].clear();
    for (const TimedAction& t : sim.timeline[size_t(s)]) pl.actions[size_t(s)].push_back(t.action);
  }
}

// Qi et al.'s (p − 1)(F + B − W) idle per rank over 3m slots of work, with F = B = W = 1 slot.
inline double zb_h1_bubble(int p, int m, int) { return (p - 1.0) / (3.0 * m); }

inline const Schedule kZBH1 = add_schedule([] {
  ScheduleKind k;
  k.name = "zb-h1";
  k.title = "ZB-H1";
  k.order = one_f_one_b_order;  // its F and B; zb_h1_order places the W's
  k.bubble = zb_h1_bubble;
  k.split_backward = true;
  k.clock_order = zb_h1_order;
  return k;
}());

}  // namespace pp
#endif  // TS_05A_ZERO_BUBBLE_CU
