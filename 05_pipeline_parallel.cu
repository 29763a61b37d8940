// 05_pipeline_parallel.cu — pipeline parallelism: AFAB (GPipe), 1F1B and interleaved 1F1B.
//
// The playbook's pipeline chapter, runnable. The decoder layers are cut into p·V contiguous
// virtual stages, chunk c of rank s being virtual stage c·p + s (Megatron's round robin); the
// m = batch/micro-batch micro-batches of a step flow through them, and the idle time this leaves
// each rank is the bubble. A schedule is data: build_plan() turns it into one list of actions per
// rank (F, B, send, recv), which the executor (Pipeline) runs. Each schedule is an entry of a
// registry (schedules()), to which the frontier variants, each in a file read after this one, add
// theirs. The lab prices and prints the lists (lab/05_simulator.h: the simulated clock;
// lab/05_pipeline_parallel.h and .cu: predictions, the plan, the reports). A small bubble wants m >> pp:
//   mpirun -np 4 ./build/05_pipeline_parallel --pp 4 --layers 4 --schedule 1f1b --batch 16 --micro-batch 2
//   ./build/05_pipeline_parallel --dry-run --pp 4 --layers 8 --schedule interleaved --virtual-stages 2 --batch 8 --micro-batch 1 --schedule-chart
#ifndef TS_05_PIPELINE_PARALLEL_CU
#define TS_05_PIPELINE_PARALLEL_CU
#include <algorithm>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "training/start.h"
#include "training/train.h"

namespace pp {
using namespace ts;

// ----- the schedule as data ---------------------------------------------------------------------

// F: a chunk's forward (at the last virtual stage also the head's backward); B: its backward; W: its
// weight gradients, where a schedule splits the backward (B then computes the input gradient only).
enum class Op { F, B, W, SendAct, RecvAct, SendGrad, RecvGrad };
struct Action {
  Op op;
  int mb, chunk;  // micro-batch; this rank's chunk c (virtual stage Plan::stage(rank, c))
  bool operator==(const Action& o) const { return op == o.op && mb == o.mb && chunk == o.chunk; }
};
inline bool is_compute(Op o) { return o == Op::F || o == Op::B || o == Op::W; }

struct Plan;
// A schedule, one entry of the registry: what makes it differ from the others, as data.
struct ScheduleKind {
  std::string name;   // as --schedule takes it
  std::string title;  // as the help names it
  std::vector<Action> (*order)(int p, int m, int V, int s) = nullptr;  // rank s's compute actions, in order
  double (*bubble)(int p, int m, int V) = nullptr;      // the playbook's formula for its bubble
  int chunks = 1;               // chunks per rank: 1, any (0: --virtual-stages), or this many always
  bool split_backward = false;  // B the input gradient only, W the weight gradients
  void (*validate)(const RunConfig& rc, int p, int V) = nullptr;  // its own checks (config_error)
  // Where the chunks sit (default: Megatron's round robin): rank s's chunk c's virtual stage, stage k's rank.
  int (*stage)(int p, int s, int c) = [](int p, int s, int c) { return c * p + s; };
  int (*rank_of)(int p, int k) = [](int p, int k) { return k % p; };
  // An order the clock decides (05a: each W where a bubble would be): rewrites the compute lists.
  void (*clock_order)(Plan& pl) = nullptr;
  int id = 0;  // its place in the registry
};
using Schedule = const ScheduleKind*;

// The registry: a function-local static, so that a file read after this one can add to it while
// the program starts (an inline variable, run once however many files include it). A deque keeps
// each entry where it is, so a Schedule stays valid.
inline std::deque<ScheduleKind>& schedules() {
  static std::deque<ScheduleKind> all;
  return all;
}
inline Schedule add_schedule(ScheduleKind k) {
  k.id = int(schedules().size());
  schedules().push_back(std::move(k));
  return &schedules().back();
}
inline const char* schedule_name(Schedule s) { return s->name.c_str(); }
inline bool splits_backward(Schedule s) { return s->split_backward; }
inline bool parse_schedule(const std::string& name, Schedule& s) {
  for (const ScheduleKind& k : schedules())
    if (k.name == name) return s = &k, true;
  return false;
}
// The names (or titles), joined: "a | b | c" (sep " | ") or "a, b or c" (sep ", ", last " or ").
inline std::string schedule_names(const std::string& sep, const std::string& last, bool titles = false) {
  std::string t;
  const std::deque<ScheduleKind>& all = schedules();
  for (size_t i = 0; i < all.size(); i++)
    t += (i == 0 ? "" : i + 1 == all.size() ? last : sep) + (titles ? all[i].title : all[i].name);
  return t;
}

// The whole schedule: per rank its list of actions, compute and p2p, in the order it runs them.
struct Plan {
  int p = 1, m = 1, V = 1;
  Schedule schedule = nullptr;
  std::vector<int> layers;  // per virtual stage k: its decoder layers (the split)
  std::vector<std::vector<Action>> actions;
  int K() const { return p * V; }  // virtual stages in all
  int stage(int rank, int chunk) const { return schedule->stage(p, rank, chunk); }
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
  for (int i = 0; i < K * most - L; i++) s[size_t(i % 2 ? i / 2 : K - 1 - i / 2)]--;
  return s;
}
// The split a run uses: --stage-layers a,b,… when given, one count per virtual stage (k = c·p + s),
// each >= 1, summing to L; else balanced_split.
inline std::vector<int> stage_split(const std::string& text, int L, int K) {
  if (text.empty()) return balanced_split(L, K);
  std::vector<int> s;
  for (size_t at = 0, comma; at <= text.size(); at = comma + 1) {
    comma = std::min(text.find(',', at), text.size());
    const std::string item = text.substr(at, comma - at);
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end || v < 1 || v > L)
      config_error("--stage-layers '%s': '%s' is not a layer count from 1 to %d", text.c_str(), item.c_str(), L);
    s.push_back(int(v));
  }
  const int sum = std::accumulate(s.begin(), s.end(), 0);
  if (int(s.size()) != K || sum != L)
    config_error("--stage-layers '%s' gives %zu stages of %d layers in all; this run has pp × virtual stages = %d "
                 "stages and --layers %d", text.c_str(), s.size(), sum, K, L);
  return s;
}

// Fixed compute orders. AFAB (GPipe, Huang et al. 2019): every F, then every B, micro-batches in order.
inline std::vector<Action> afab_order(int, int m, int, int) {
  std::vector<Action> o;
  for (int i = 0; i < m; i++) o.push_back({Op::F, i, 0});
  for (int i = 0; i < m; i++) o.push_back({Op::B, i, 0});
  return o;
}

// Megatron's interleaved order over rank s's m·V (micro-batch, chunk) units: they come in rounds
// of p micro-batches × V chunks, and within a round the chunks take turns, each for the round's p
// micro-batches, forwards in chunk order and backwards in reverse. Warm-up: 2(p − s − 1) +
// (V − 1)·p forwards; steady state: one forward, one backward; cool-down: the backwards left.
// V = 1 with a warm-up of p − s − 1 forwards is plain 1F1B (PipeDream-1F1B, Narayanan et al.): at
// most p − s micro-batches in flight.
inline std::vector<Action> one_f_one_b_order(int p, int m, int V, int s) {
  const int units = m * V, warmup = std::min(units, V == 1 ? p - s - 1 : 2 * (p - s - 1) + (V - 1) * p);
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

// The playbook's bubble formulas: (p − 1)/m when each rank fills and drains once, (p − 1)/(V·m)
// interleaved (each of the p − 1 warm-up steps costs a chunk, 1/V of a stage).
inline double fill_drain_bubble(int p, int m, int) { return (p - 1.0) / m; }
inline double interleaved_bubble(int p, int m, int V) { return (p - 1.0) / (double(V) * m); }
// Interleaved: V chunks per rank, and its rounds of p micro-batches need m a multiple of p.
inline void validate_interleaved(const RunConfig& rc, int p, int) {
  const int m = rc.batch / rc.micro_batch;
  if (m % p)
    config_error("--schedule interleaved needs the micro-batches per step (%d = batch %d / micro-batch %d) to be a "
                 "multiple of --pp %d", m, rc.batch, rc.micro_batch, p);
}

// The chapter's three schedules, registered as any other file registers one (interleaved: any
// number of chunks per rank, and its own check).
inline const Schedule kAFAB = add_schedule({"afab", "AFAB (GPipe)", afab_order, fill_drain_bubble});
inline const Schedule kOneFOneB = add_schedule({"1f1b", "1F1B", one_f_one_b_order, fill_drain_bubble});
inline const Schedule kInterleaved = add_schedule({"interleaved", "interleaved 1F1B", one_f_one_b_order,
                                                   interleaved_bubble, /*chunks=*/0, false, validate_interleaved});

// The rank that runs virtual stage k, and the p2p actions around each compute action: an F past
// the first virtual stage receives its input, one before the last sends its output; a B before
// the last receives its output gradient, one past the first sends its input gradient. Nothing
// travels between two virtual stages of one rank (p = 1, or consecutive stages on one rank).
inline int stage_rank(const Plan& pl, int k) { return pl.schedule->rank_of(pl.p, k); }
inline void add_p2p(Plan& pl) {
  for (int s = 0; s < pl.p; s++) {
    std::vector<Action> l;
    for (const Action& a : pl.actions[size_t(s)]) {
      const int k = pl.stage(s, a.chunk);
      const bool from_prev = k > 0 && stage_rank(pl, k - 1) != s;
      const bool to_next = k < pl.K() - 1 && stage_rank(pl, k + 1) != s;
      if (a.op == Op::F && from_prev) l.push_back({Op::RecvAct, a.mb, a.chunk});
      if (a.op == Op::B && to_next) l.push_back({Op::RecvGrad, a.mb, a.chunk});
      l.push_back(a);
      if (a.op == Op::F && to_next) l.push_back({Op::SendAct, a.mb, a.chunk});
      if (a.op == Op::B && from_prev) l.push_back({Op::SendGrad, a.mb, a.chunk});
    }
    pl.actions[size_t(s)] = std::move(l);
  }
}

// One message between two ranks: (direction, micro-batch, sending virtual stage).
struct Message {
  static constexpr int kActivation = 0, kGradient = 1;  // dir: forward, backward
  int dir, mb, from;
  bool operator<(const Message& o) const { return std::tie(dir, mb, from) < std::tie(o.dir, o.mb, o.from); }
  bool operator==(const Message& o) const { return dir == o.dir && mb == o.mb && from == o.from; }
};
inline bool is_send(Op o) { return o == Op::SendAct || o == Op::SendGrad; }
// A send's message is from its stage k; a received activation is from k − 1, a gradient from k + 1.
inline Message message_of(const Plan& pl, int s, const Action& a) {
  const int k = pl.stage(s, a.chunk);
  const bool act = a.op == Op::SendAct || a.op == Op::RecvAct;
  return {act ? Message::kActivation : Message::kGradient, a.mb, is_send(a.op) ? k : act ? k - 1 : k + 1};
}
// A message's MPI tag where messages are matched by tag (the executor's buffered sends): its
// number among the step's 2·K·m messages, (dir·K + from)·m + mb, wrapped at 32768 because MPI
// guarantees only tags 0 .. 32767 (the standard's least MPI_TAG_UB). Distinct while 2·p·V·m <= 32768.
inline int message_tag(const Plan& pl, const Message& msg) {
  return ((msg.dir * pl.K() + msg.from) * pl.m + msg.mb) % 32768;
}
inline int peer_of(const Plan& pl, int s, const Action& a) {
  const int k = pl.stage(s, a.chunk);
  return stage_rank(pl, a.op == Op::SendAct || a.op == Op::RecvGrad ? k + 1 : k - 1);
}

// Runs the lists under the strictest semantics, rendezvous: a message completes only while both
// its ends are posted, and a rank leaves a group (the executor's: consecutive p2p actions) when
// all its messages completed. If this finishes, no buffering or ordering of the transport can
// make the executor deadlock.
inline bool completes_under_rendezvous(const Plan& pl) {
  const int p = pl.p;
  std::vector<std::vector<std::vector<Action>>> groups{size_t(p)};  // per rank: its p2p groups
  for (int s = 0; s < p; s++)
    for (size_t i = 0; i < pl.actions[s].size(); i++) {
      if (is_compute(pl.actions[s][i].op)) continue;
      if (i == 0 || is_compute(pl.actions[s][i - 1].op)) groups[s].emplace_back();
      groups[s].back().push_back(pl.actions[s][i]);
    }
  std::vector<size_t> at(size_t(p), 0);            // per rank: the group it has posted
  std::vector<std::set<Message>> done{size_t(p)};  // per rank: the messages that completed
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; s++) {
      if (at[s] >= groups[s].size()) continue;
      bool all = true;
      for (const Action& a : groups[s][at[s]]) {
        const Message msg = message_of(pl, s, a);
        const int peer = peer_of(pl, s, a);
        // Complete before, or now: the peer's posted group holds its other end.
        if (!done[s].count(msg) && at[peer] < groups[peer].size())
          for (const Action& b : groups[peer][at[peer]])
            if (is_send(b.op) != is_send(a.op) && message_of(pl, peer, b) == msg && peer_of(pl, peer, b) == s)
              done[s].insert(msg), done[peer].insert(msg);
        all = all && done[s].count(msg);
      }
      if (all) at[s]++, progress = true;
    }
  }
  for (int s = 0; s < p; s++)
    if (at[s] < groups[s].size()) return false;
  return true;
}

// The one function that makes a schedule: (p, m, V, schedule, split) -> per-rank action lists,
// each rank's compute order with the p2p actions around it. `layers`: the decoder layers of each
// virtual stage (empty: p·V stages of one layer each).
inline Plan build_plan(int p, int m, int V, Schedule sched, std::vector<int> layers = {}) {
  if (layers.empty()) layers.assign(size_t(p * V), 1);
  Plan pl;
  pl.p = p, pl.m = m, pl.V = V, pl.schedule = sched, pl.layers = std::move(layers);
  for (int s = 0; s < p; s++) pl.actions.push_back(sched->order(p, m, V, s));
  if (sched->clock_order) sched->clock_order(pl);
  add_p2p(pl);
  return pl;
}

// ----- the stage layout ---------------------------------------------------------------------------

// Virtual stage k holds the layers after those of stages 0..k−1, i.e. units 1 + first ..
// first + n_k; the first also the embedding (unit 0), the last also the head (unit L+1).
inline std::pair<int, int> stage_units(const std::vector<int>& split, int k) {
  const int K = int(split.size()), L = std::accumulate(split.begin(), split.end(), 0);
  const int first = std::accumulate(split.begin(), split.begin() + k, 0);
  return {k == 0 ? 0 : 1 + first, k == K - 1 ? L + 2 : 1 + first + split[size_t(k)]};
}
// Rank `rank`'s units, chunk by chunk, placed as the schedule places its chunks.
inline ShardSpec shard_spec(const std::vector<int>& split, int p, int V, int rank, Schedule sched = kOneFOneB) {
  ShardSpec s;
  for (int ch = 0; ch < V; ch++) s.unit_runs.push_back(stage_units(split, sched->stage(p, rank, ch)));
  return s;
}
inline ShardSpec shard_spec(const Plan& pl, int rank) { return shard_spec(pl.layers, pl.p, pl.V, rank, pl.schedule); }

inline void validate(const RunConfig& rc, int p, int V, Schedule sched) {
  if (p < 1) config_error("--pp must be >= 1 (got %d)", p);
  if (V < 1) config_error("--virtual-stages must be >= 1 (got %d)", V);
  if (V > 1 && sched->chunks == 1)
    config_error("--virtual-stages %d needs --schedule interleaved (got %s)", V, schedule_name(sched));
  if (sched->validate) sched->validate(rc, p, V);
  if (rc.model.layers < p * V)
    config_error("--layers %d is fewer than --pp %d × --virtual-stages %d: every virtual stage holds at least "
                 "one layer", rc.model.layers, p, V);
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

  // One step; the last stage's head adds the token losses to the model's tally (take_loss), the others none.
  void run_step(const TokenData& data, const RunConfig& rc, long step) {
    st_.clear();
    acts_.clear();
    grads_.clear();
    const double t0 = Trace::get().now_us();
    // The p2p actions since the last compute action: one group, posted together and waited for
    // together (Megatron's send-forward-recv-backward pairs: both directions in flight at once).
    std::vector<Action> group;
    for (const Action& a : pl_.actions[rank_]) {
      if (!is_compute(a.op)) {
        group.push_back(a);
        continue;
      }
      flush(group);
      const double c0 = Trace::get().now_us();
      compute(a, data, rc, step);
      busy_us += Trace::get().now_us() - c0;
    }
    flush(group);
    for (Work& w : in_flight_) w.wait();  // every receive has completed, so every send is matched
    in_flight_.clear();
    span_us += Trace::get().now_us() - t0;
    st_.clear();
    steps_run++;
  }
  // For the lab's stage report: the time in compute and in run_step, and the run_step calls so far
  // (the p2p bytes are per step of these).
  double busy_us = 0, span_us = 0;
  long steps_run = 0;

 protected:
  // Micro-batch mb of the step: the global batch's sequences [mb·b, (mb+1)·b).
  virtual ForwardState begin_microbatch(const TokenData& data, const RunConfig& rc, long step, int mb) {
    const int b = rc.micro_batch;
    const MicroBatch mbt = make_microbatch(data, step, rc.batch, rc.model.seq, mb * b, b, m_.dev);
    return m_.begin_microbatch(mbt.inputs, mbt.targets, b);
  }

  // One F, B or W of this rank's list (W, and B of the input gradient only, where the schedule
  // splits the backward: the model keeps what W needs, unit_backward's `defer`).
  virtual void compute(const Action& a, const TokenData& data, const RunConfig& rc, long step) {
    const int k = pl_.stage(rank_, a.chunk), L = m_.cfg.layers, T = rc.model.seq;
    const auto [ub, ue] = stage_units(pl_.layers, k);  // units [ub, ue): 0 embedding, 1..L layers, L + 1 head
    if (!st_.count(a.mb)) st_.emplace(a.mb, begin_microbatch(data, rc, step, a.mb));
    ForwardState& st = st_.at(a.mb);
    const std::string what = " mb " + std::to_string(a.mb) + " stage " + std::to_string(k);
    if (a.op == Op::F) {
      TraceScope ts("F" + what);
      Tensor x = k == 0 ? Tensor() : take(acts_, {a.mb, k});
      const float grad_scale = 1.f / (float(rc.batch) * T);  // the loss is the mean over the step's tokens
      for (int u = ub; u < ue; u++) m_.unit_forward(u, st, x, grad_scale);
      // The head added this micro-batch's token losses to the model's tally, in micro-batch order
      // as 01 adds them, and left d(loss)/d(its input) in x.
      if (k == pl_.K() - 1) grads_[{a.mb, k}] = x;
      else acts_[{a.mb, k + 1}] = x;
    } else if (a.op == Op::B) {
      const bool defer = splits_backward(pl_.schedule);
      TraceScope ts((defer ? "B (input grad)" : "B") + what);
      Tensor dx = take(grads_, {a.mb, k});
      // The head (unit L + 1) ran its backward inside its F; the other units go top down.
      for (int u = std::min(ue, L + 1) - 1; u >= ub; u--) m_.unit_backward(u, st, dx, defer);
      if (k > 0) grads_[{a.mb, k - 1}] = dx;
    } else {
      TraceScope ts("W" + what);
      // The decoder layers' deferred matmuls; the embedding's backward (unit 0) deferred nothing.
      for (int u = std::min(ue, L + 1) - 1; u >= std::max(ub, 1); u--) m_.unit_backward_weights(u, st);
    }
  }

 private:
  static Tensor take(std::map<std::pair<int, int>, Tensor>& from, std::pair<int, int> k) {
    auto held = from.extract(k);
    TS_CHECK(!held.empty(), "pipeline: no tensor for micro-batch %d, stage %d", k.first, k.second);
    return held.mapped();
  }

  // Rendezvous-safe lists (AFAB, 1F1B): a group's sends and receives are posted together (a send and
  // a receive as one send_recv, which NCCL groups) and waited for together. Otherwise (interleaved,
  // m > p: a link carries both directions of several chunks, in orders that differ at its ends) a
  // send leaves from a copy (Tag::Comm) without waiting, and only receives block: each receive's
  // message was sent at an earlier slot of the simulated clock (lab/05_simulator.h), which plays each
  // list in its order, so by induction over the slots every receive completes (make_plan checks the
  // clock completes). That needs MPI's tags and unmatched sends, even on NCCL (Comm::match_p2p_by_tag).
  void flush(std::vector<Action>& group) {
    if (group.empty()) return;
    TraceScope ts("pp p2p", Lane::Comm);
    struct Post { Tensor t; int peer, tag; };  // one message to post
    std::vector<Post> sends, recvs;
    for (const Action& a : group) {
      // Grouped lists keep one order per link at both ends (the rendezvous check proves it), so
      // messages match in order under one tag; buffered ones are matched by a tag per message.
      const int tag = grouped_ ? 0 : message_tag(pl_, message_of(pl_, rank_, a));
      const int peer = peer_of(pl_, rank_, a), k = pl_.stage(rank_, a.chunk);
      if (is_send(a.op)) {
        Tensor t = a.op == Op::SendAct ? take(acts_, {a.mb, k + 1}) : take(grads_, {a.mb, k - 1});
        if (!grouped_) {
          Tensor c = Tensor::empty(t.shape, t.dtype, t.device(), Tag::Comm);
          copy(c, t);
          t = c;
        }
        sends.push_back({t, peer, tag});
      } else {
        const Tag held = a.op == Op::RecvAct ? Tag::Activations : Tag::Workspace;
        Tensor t = Tensor::empty({tokens_, m_.cfg.dim}, m_.dtype, m_.dev, held);
        (a.op == Op::RecvAct ? acts_ : grads_)[{a.mb, k}] = t;
        recvs.push_back({t, peer, tag});
      }
    }
    group.clear();
    std::vector<Work> works;
    size_t i = 0;  // grouped: sends and receives in pairs, each one send_recv
    for (; grouped_ && i < sends.size() && i < recvs.size(); i++)
      works.push_back(pp_.send_recv_async(sends[i].t, sends[i].peer, recvs[i].t, recvs[i].peer, sends[i].tag));
    for (size_t j = i; j < sends.size(); j++)
      (grouped_ ? works : in_flight_).push_back(pp_.send_async(sends[j].t, sends[j].peer, sends[j].tag));
    for (size_t j = i; j < recvs.size(); j++) works.push_back(pp_.recv_async(recvs[j].t, recvs[j].peer, recvs[j].tag));
    for (Work& w : works) w.wait();
    in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(), [](Work& w) { return w.done(); }),
                     in_flight_.end());
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
};

// ----- the lab (lab/05_pipeline_parallel.cu: the plan, the memory, the reports, the step time) -------
bool order_completes(const Plan& pl);  // on the simulated clock every action runs: no deadlock
void print_plan(RunLog& log, const RunConfig& rc, const Plan& pl, bool chart);
MemoryPrediction predict_memory(const RunConfig& rc, const Plan& pl, int rank);  // states and activations
// The checkpoint, the memory checked, the comm report against the sends predicted, each stage's report.
void add_reports(Loop& loop, TrainingRun& run, Model& model, AdamW& opt, const Pipeline& pipe, const Plan& pl);
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, const Plan& pl);

}  // namespace pp

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 5
using namespace ts;

// The help names every schedule registered, here and in the files read after this one.
static std::string doc() {
  return "05_pipeline_parallel: pipeline parallelism with the " + pp::schedule_names(", ", " and ", true) +
         " schedules.\nusage: mpirun -np P 05_pipeline_parallel --pp P --schedule " + pp::schedule_names("|", "|") +
         " [--virtual-stages V] [flags]";
}
// "interleaved; NAME: 2": the schedules with other than one chunk per rank.
static std::string chunks_help() {
  std::string t;
  for (const pp::ScheduleKind& k : pp::schedules())
    if (k.chunks != 1) t += (t.empty() ? "" : "; ") + k.name + (k.chunks ? ": " + std::to_string(k.chunks) : "");
  return "chunks per rank (" + t + "): V·pp virtual stages";
}

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

// The chapter's flags: the degree, the schedule, the chunks per rank, the layers per stage.
struct PipeFlags {
  int p = 1, V = 1;
  std::string schedule, split;
  bool chart = false;
  void read(Args& args, MeshConfig& mc) {
    p = mc.pp = args.get_int("--pp", 1, "pipeline-parallel degree (= number of ranks)", degree_range());
    schedule = args.get_str("--schedule", "1f1b", pp::schedule_names(" | ", " | "));
    V = args.get_int("--virtual-stages", 1, chunks_help());
    split = args.get_str("--stage-layers", "", "layers per virtual stage a,b,… (default: even, or the ends lighter)");
    chart = args.get_bool("--schedule-chart", "print each rank's timeline of the schedule (unit costs)");
  }
};

// --schedule, checked, and the action lists of every rank for this run's m micro-batches.
static pp::Plan make_plan(const RunConfig& rc, const PipeFlags& f) {
  pp::Schedule sched;
  if (!pp::parse_schedule(f.schedule, sched))
    config_error("unknown --schedule '%s' (%s)", f.schedule.c_str(), pp::schedule_names(", ", " or ").c_str());
  // A schedule with a fixed number of chunks per rank: the default --virtual-stages 1 means its own.
  const int V = sched->chunks > 1 && f.V == 1 ? sched->chunks : f.V;
  pp::validate(rc, f.p, V, sched);
  const pp::Plan plan =
      pp::build_plan(f.p, rc.batch / rc.micro_batch, V, sched, pp::stage_split(f.split, rc.model.layers, f.p * V));
  TS_CHECK(pp::order_completes(plan), "schedule %s at pp %d, m %d, V %d deadlocks", pp::schedule_name(sched), f.p,
           plan.m, V);
  return plan;
}

int main(int argc, char** argv) {
  PipeFlags f;
  TrainingRun run(argc, argv, doc().c_str(), [&](Args& a, RunConfig&, MeshConfig& mc) { f.read(a, mc); });
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
  loop.step = [&](long step) { return train_step(model, opt, pipe, run.data, rc, run.mesh, step); };
  pp::add_reports(loop, run, model, opt, pipe, plan);
  return run.train(loop, pp::step_time_model(rc, plan));
}
#endif  // TS_PROGRAM == 5
#endif  // TS_05_PIPELINE_PARALLEL_CU
