// 08_5d_mesh.cu — the techniques on one mesh, composed from their own files.
//
// The playbook's closing chapters, runnable: world = dp × pp × cp × tp ranks (TP innermost, then
// CP, PP, DP, as in common/comm/mesh.h). This file re-implements nothing: every piece below is the
// technique file's own —
//   02_data_parallel.cu    dp::GradReducer             gradients all-reduced over dp, bucketed
//   03_zero.cu             zero::Zero                  ZeRO-1/2/3 over dp, per-unit shards
//   04_tensor_parallel.cu  tp::install, tp::reduce_norm_grads   column/row-parallel layers, f/g,
//                                                      vocabulary-parallel loss, sequence parallel
//   05_pipeline_parallel.cu pp::shard_spec, pp::build_plan, pp::Pipeline   stages of units, the
//                                                      schedule as action lists, its executor
//   06_context_parallel.cu cp::install, cp::positions  ring (zigzag) or Ulysses attention core
//   07_expert_parallel.cu  ep::install, ep::split_ranges   experts over the ep group, tokens
//                                                      dispatched and combined by all-to-all
// — and 08 only wires them onto one model and one mesh: the model is built with the tp (and ep)
// shard spec, f/g and the loss come from 04, the attention core from 06, the MoE block from 07,
// and the gradients of that shard go to 02's reducer or 03's sharder over dp × cp (cp ranks hold
// different tokens of the same weights); with --ep, 02's reducer takes the dense ranges over dp
// and the expert ranges over ep_dp, as in 07. Hooks take several subscribers, so the
// sequence-parallel norm reduction and ZeRO's reduce-scatter act on the same unit in that order.
//
// The MoE block under tp is Megatron's expert tensor parallel 1: without sequence parallelism
// every tp rank holds the micro-batch's full tokens at the MLP, so the router and the experts are
// replicated over tp and each tp rank runs the same routing and the same all-to-alls in its own
// ep group (the ep groups are cut from dp × cp at each pp, tp coordinate).
//
// What a mesh costs each rank (memory, bytes per group) and the plan a run prints are 08's lab,
// from 02–07's own formulas at this rank's share (lab/08_5d_mesh.h); the planner, `--plan`, ranks
// meshes for a cluster with them (lab/08_plan.h); the entry points main calls are declared below,
// under "the lab", and defined in lab/08_5d_mesh.cu.
//
//   mpirun -np 8 ./build/08_5d_mesh --dp 2 --tp 4 --zero 1 --sequence-parallel --kv-heads 4
//   mpirun -np 8 ./build/08_5d_mesh --dp 4 --tp 2 --ep 4 --experts 4 --top-k 2
//   ./build/08_5d_mesh --dry-run --preset 8b --dp 8 --tp 8 --zero 1 --micro-batch 1 --dtype bf16
#ifndef TS_08_5D_MESH_CU
#define TS_08_5D_MESH_CU
#include <memory>

#include "02_data_parallel.cu"
#include "03_zero.cu"
#include "03a_hsdp.cu"  // zero::hsdp_groups: --dp-shard (HSDP)
#include "04a_async_tp.cu"  // and 04_tensor_parallel.cu: tp::install, with --async-tp (tp::Variant)
#include "05_pipeline_parallel.cu"
#include "05b_dualpipev.cu"  // pp::kDualPipeV (and 05a_zero_bubble.cu's pp::kZBH1): the schedules 08 runs
#include "06_context_parallel.cu"
#include "07b_overlap_a2a.cu"  // and 07_expert_parallel.cu: ep::install, with --overlap-a2a (ep::Schedule)
#include "training/fp8_linear.h"  // fp8::install on the composed model

namespace mesh5d {
using namespace ts;

// The composition one run asks for.
struct Plan {
  MeshConfig mesh;
  int zero = 0;  // 0: plain data parallelism (02), 1–3: ZeRO stage (03)
  int dp_shard = 0;  // HSDP (03a): ZeRO inside groups of this many dense ranks, replicated across (0: none)
  bool sp = false;
  const tp::Variant* tp_variant = nullptr;  // --async-tp (04a_async_tp.cu), or null: 04's f and g
  bool prefetch = true;
  std::string dp_mode = "bucketed";
  double bucket_mb = 25;
  cp::Options cp{cp::Mode::Ring, true};
  pp::Schedule schedule = pp::kOneFOneB;
  int virtual_stages = 1;
  std::string stage_layers;  // --stage-layers a,b,… ("": pp::balanced_split)
  bool two_level = false;    // --dispatch two-level: --plan prices 07's two-level dispatch (08 runs the flat one)
  const ep::Schedule* ep_schedule = nullptr;  // --overlap-a2a (07b_overlap_a2a.cu), or null: one after another
};

// The layers of each virtual stage (05's split: even, the ends lighter, or --stage-layers).
inline std::vector<int> stage_split(const RunConfig& rc, const Plan& p) {
  return pp::stage_split(p.stage_layers, rc.model.layers, p.mesh.pp * p.virtual_stages);
}
// The decoder layers of the stage at pp_rank (its V chunks, round robin or DualPipeV's V).
inline int stage_layers(const RunConfig& rc, const Plan& p, int pp_rank) {
  return pp::rank_layers(stage_split(rc, p), p.mesh.pp, pp_rank, p.schedule);
}
// Whether the rank at pp_rank holds the last virtual stage (the final norm, the head and the loss):
// the last rank under round robin, rank 0 under DualPipeV, whose V turns back to it.
inline bool holds_head(const Plan& p, int pp_rank) {
  const int last = p.mesh.pp * p.virtual_stages - 1;
  return p.schedule->stage(p.mesh.pp, pp_rank, p.virtual_stages - 1) == last;
}
// The pipeline stage with the most layers (the first of them; 0 without a pipeline).
inline int busiest_stage(const RunConfig& rc, const Plan& p) {
  const std::vector<int> split = stage_split(rc, p);
  int busy = 0;
  for (int s = 1; s < p.mesh.pp; s++)
    if (pp::rank_layers(split, p.mesh.pp, s, p.schedule) > pp::rank_layers(split, p.mesh.pp, busy, p.schedule)) busy = s;
  return busy;
}

// What one cp rank holds of each sequence: the model at seq/cp tokens (what 04's and 06's
// formulas see on this mesh).
inline RunConfig local_run(const RunConfig& rc, const Plan& p) {
  RunConfig l = rc;
  l.model = cp::local_model(rc.model, p.mesh.cp);
  return l;
}

// Dense gradients are reduced (or ZeRO-sharded) over the ranks that hold the same weights and
// different tokens: dp × cp.
inline int dense_group_size(const Plan& p) { return p.mesh.dp * p.mesh.cp; }
// The ranks ZeRO shards over: the dense group, or HSDP's shard group.
inline int shard_group_size(const Plan& p) { return p.dp_shard > 0 ? p.dp_shard : dense_group_size(p); }

// DeepSeek-V3's routing bias (--router sigmoid --bias-update-rate γ > 0) is moved in the weights
// a rank holds whole after the step (MoeBlock::update_bias, and in the optimizer's fp32 master
// copy of the flat buffer; a pipeline stage moves its own layers'). Where a rank's are not whole
// it is refused: ZeRO-3 holds no weights outside a unit's gather, and ZeRO-1/2's fp32 master
// copies are per-rank shards the update cannot reach.
inline void validate_bias_update(const RunConfig& rc, const Plan& p) {
  if (!rc.model.sigmoid_router || rc.model.bias_update_rate == 0) return;
  if (p.zero == 3 || (p.zero > 0 && rc.dtype != DType::F32 && rc.master_weights))
    config_error("--bias-update-rate with --zero %d%s is not composed: the routing bias is moved in whole weights and "
                 "master copies, and ZeRO shards them; pass --bias-update-rate 0 or --zero 0", p.zero,
                 p.zero == 3 ? "" : " and fp32 master weights");
}

// ZB-H1 and DualPipeV split each backward into B and W: what does not compose with that, refused
// (also by --plan for the ZeRO stage it is given, before it searches the rest).
inline void validate_split_backward(const Plan& p) {
  if (!pp::splits_backward(p.schedule)) return;
  const char* split = pp::schedule_name(p.schedule);
  if (p.zero == 2)
    config_error("--zero 2 with --schedule %s is not composed: ZeRO-2 holds one unit's gradient buffer at a time, "
                 "and %s writes a unit's gradients in its B and again in its later W, after other units' B", split,
                 p.schedule->title.c_str());
}

// Every check of the pieces, before any collective; the unsupported combinations name why.
// `training`: a run, not a --plan (which trains nothing, so prices DeepSeek-V3 with its bias moving
// on any mesh: the update costs nothing the planner counts).
inline void validate(const RunConfig& rc, const Plan& p, bool training = true) {
  if (training) validate_bias_update(rc, p);
  if (training && p.two_level)
    config_error("--dispatch two-level is priced by --plan; 08's ep groups dispatch flat (07 runs the two-level one)");
  cp::validate(rc, p.mesh.cp, p.cp);
  tp::validate(local_run(rc, p), p.mesh.tp, p.sp, p.tp_variant);
  if (p.cp.mode == cp::Mode::Ulysses && p.mesh.tp > 1 &&
      ((rc.model.heads / p.mesh.tp) % p.mesh.cp || (rc.model.kv_heads / p.mesh.tp) % p.mesh.cp))
    config_error("--cp-mode ulysses with --tp %d: the %d heads and %d kv heads per tp rank must divide by --cp %d",
                 p.mesh.tp, rc.model.heads / p.mesh.tp, rc.model.kv_heads / p.mesh.tp, p.mesh.cp);
  if (p.zero < 0 || p.zero > 3) config_error("--zero must be 0 (plain DP), 1, 2 or 3 (got %d)", p.zero);
  const ModelConfig& m = rc.model;
  if (p.mesh.ep < 1) config_error("--ep must be >= 1 (got %d)", p.mesh.ep);
  if (p.mesh.ep > 1 && m.experts < 1) config_error("--ep %d needs a mixture of experts: pass --experts E (and --top-k K)", p.mesh.ep);
  if (m.experts > 0 && m.experts % p.mesh.ep) config_error("--experts %d is not divisible by --ep %d", m.experts, p.mesh.ep);
  if (dense_group_size(p) % p.mesh.ep)
    config_error("--ep %d does not divide dp × cp = %d (expert-parallel groups are cut from the dp × cp ranks)", p.mesh.ep,
                 dense_group_size(p));
  if (m.experts > 0 && p.mesh.cp > 1)
    config_error("--experts with --cp %d is not composed: expert capacity and the aux loss are per sequence, and cp "
                 "splits each sequence across ranks", p.mesh.cp);
  if (training && p.ep_schedule && p.mesh.pp > 1 && p.schedule != pp::kDualPipeV)
    config_error("%s with --pp %d pairs the F and B of --schedule dualpipev (the schedule orders the micro-batches; "
                 "%s has no pairs)", p.ep_schedule->flag.c_str(), p.mesh.pp, pp::schedule_name(p.schedule));
  if (training && p.ep_schedule) p.ep_schedule->validate(rc, p.mesh, ep::dispatches().front());
  if (p.mesh.ep > 1 && p.zero > 0)
    config_error("--zero %d with --ep %d is not composed: expert weights differ across the dp ranks of an ep group; "
                 "ZeRO shards one flat buffer over dp", p.zero, p.mesh.ep);
  if (p.mesh.pp > 1) {
    RunConfig per_dp = rc;
    per_dp.batch = rc.batch / p.mesh.dp;  // the pipeline's micro-batches are this dp rank's
    pp::validate(per_dp, p.mesh.pp, p.virtual_stages, p.schedule);
    stage_split(rc, p);  // a bad --stage-layers is a config error here, before any collective
    if (p.zero == 3)
      config_error("--zero 3 with --pp %d is not composed: ZeRO-3 gathers each unit in one micro-batch's forward-then-"
                   "backward order, and a pipeline interleaves micro-batches, so every F and B would gather its "
                   "stage's weights again (2·m gathers a step); use --zero 1 or 2", p.mesh.pp);
    validate_split_backward(p);
  }
  if (p.mesh.pp == 1 && !p.stage_layers.empty()) config_error("--stage-layers needs --pp > 1");
  if (p.mesh.pp == 1 && p.schedule == pp::kDualPipeV)
    config_error("--schedule dualpipev needs --pp > 1: its V folds 2·pp stages onto the pp ranks");
  if (p.dp_mode != "naive" && p.dp_mode != "bucketed")
    config_error("--dp-mode must be naive or bucketed (got '%s')", p.dp_mode.c_str());
  if (p.dp_shard > 0 && p.zero == 0) config_error("--dp-shard %d shards ZeRO's states: it needs --zero 1, 2 or 3", p.dp_shard);
  if (p.zero > 0 && p.dp_mode != "bucketed") config_error("--dp-mode applies to plain data parallelism (--zero 0) only");
}

// This rank's shard: its tp blocks of its pipeline stage's units, and of the experts its ep rank's.
inline ShardSpec shard_spec(const RunConfig& rc, const Plan& p, int tp_rank, int pp_rank, int ep_rank) {
  ShardSpec s = tp::shard_spec(p.mesh.tp, tp_rank);
  if (p.mesh.pp > 1)
    s.unit_runs = pp::shard_spec(stage_split(rc, p), p.mesh.pp, p.virtual_stages, pp_rank, p.schedule).unit_runs;
  const ShardSpec e = ep::shard_spec(p.mesh.ep, ep_rank);
  s.ep = e.ep;
  s.ep_rank = e.ep_rank;
  return s;
}

// This rank's table, each unit padded to a multiple of dp·cp when ZeRO shards it. Every ep rank
// holds E/ep experts: ep rank 0's table predicts them all.
inline ParamTable local_table(const RunConfig& rc, const Plan& p, int tp_rank, int pp_rank = 0, int ep_rank = 0) {
  return Model::make_table(rc.model, p.zero > 0 ? shard_group_size(p) : 1, shard_spec(rc, p, tp_rank, pp_rank, ep_rank));
}

// The pipeline's action lists over this dp rank's micro-batches.
inline pp::Plan pipeline_plan(const RunConfig& rc, const Plan& p) {
  return pp::build_plan(p.mesh.pp, rc.batch / p.mesh.dp / rc.micro_batch, p.virtual_stages, p.schedule, stage_split(rc, p));
}
// The part of a micro-batch's tokens one rank's residual stream holds (what travels between stages).
inline double token_share(const Plan& p) { return 1.0 / p.mesh.cp / (p.sp ? p.mesh.tp : 1); }

// ----- the composed step ----------------------------------------------------------------------------

// 05's executor on the mesh: micro-batch mb is this dp rank's (cp ranks: their tokens at their
// positions), and before each compute action `before_compute` runs: 02's buckets under a
// pipeline leave as the last micro-batch's backward completes each unit's gradients, so its
// actions (the head's F, each chunk's B and W) turn the reducers' sync on, during the cooldown,
// not after the flush.
class MeshPipeline : public pp::Pipeline {
 public:
  MeshPipeline(Model& m, Comm& pp, const pp::Plan& plan, int rank, int64_t rows, const pp::PairBlocks* paired)
      : pp::Pipeline(m, pp, paired ? paired->plan : plan, rank, rows), model_(m) {
    if (paired) pairs_ = paired->pairs[size_t(rank)];
  }
  std::function<ForwardState(const TokenData& data, long step, int mb)> microbatch;
  std::function<void(const pp::Action& a)> before_compute;

 protected:
  ForwardState begin_microbatch(const TokenData& data, const RunConfig&, long step, int mb) override {
    return microbatch(data, step, mb);
  }
  void compute(const pp::Action& a, const TokenData& data, const RunConfig& rc, long step) override {
    if (!ran_.empty() && ran_.front() == a) return ran_.erase(ran_.begin()), void();  // ran in its pair
    for (const auto& pair : pairs_)
      if (pair[0] == a) return run_pair(pair, data, rc, step);
    before_compute(a);
    pp::Pipeline::compute(a, data, rc, step);
  }

 private:
  // --overlap-a2a under DualPipeV (pairs_ from 05b's pair_blocks, whose lists hold each pair's F, B
  // and W adjacent): the F and the backward as two coroutines (07b's Interleave), each one's
  // all-to-all travelling while the other computes, as DualPipe overlaps them (DeepSeek-V3
  // §3.2.1). They run different stages' layers, so no gradient sees their order. At each turn the
  // half that resumes gets back its reducers' sync (before_compute) and its place in a deferring
  // backward (Model::deferral), which the other half's work would otherwise take.
  void run_pair(const std::array<pp::Action, 3>& pair, const TokenData& data, const RunConfig& rc, long step) {
    const pp::Action* now[2] = {&pair[0], &pair[1]};
    Model::Deferral held[2];
    int last = -1;
    ep::Interleave halves;
    halves.run(0, 2, [&](int h) {
      if (last >= 0) held[last] = model_.deferral();
      model_.set_deferral(held[h]), last = h;
      before_compute(*now[h]);
    }, [&](int h) {
      for (size_t i = h == 0 ? 0 : 1; i < (h == 0 ? 1 : 3); i++) {
        now[h] = &pair[i];
        before_compute(pair[i]);
        pp::Pipeline::compute(pair[i], data, rc, step);
      }
    });
    ran_ = {pair[1], pair[2]};  // the list's next two entries
  }
  Model& model_;
  std::vector<std::array<pp::Action, 3>> pairs_;
  std::vector<pp::Action> ran_;
};

// One model on one mesh, with the pieces of 02/03/04 attached to it.
class Composed {
 public:
  Composed(const RunConfig& rc, const Plan& p, Mesh& mesh)
      : rc_(rc), p_(p), mesh_(mesh), dense_(p.mesh.cp > 1 ? mesh.dp_cp() : mesh.dp()),
        model_(rc.model, mesh.device, rc.dtype, rc.recompute, layout(rc, p, mesh)), plan_(pipeline_plan(rc, p)) {
    tp::install(model_, mesh.tp(), p.sp, p.tp_variant);
    if (p.mesh.ep > 1) moe_ = &(p.ep_schedule ? p.ep_schedule->install : ep::dispatches().front().install)(
                           model_, mesh.ep(), node_of_ranks(mesh.ep()));
    if (p.mesh.cp > 1) {
      cp::install(model_, mesh.cp(), p.cp);
      mine_ = cp::positions(rc.model.seq, p.mesh.cp, mesh.cp_rank, p.cp.zigzag);
      pos_ = cp::device_ints(mine_, model_.dev);
    }
    if (p.mesh.pp > 1) {
      const int64_t rows = std::llround(double(rc.micro_batch) * rc.model.seq * token_share(p));
      if (p.ep_schedule) paired_ = std::make_unique<pp::PairBlocks>(pp::pair_blocks(plan_));  // --overlap-a2a
      pipe_ = std::make_unique<MeshPipeline>(model_, mesh.pp(), plan_, mesh.pp_rank, rows, paired_.get());
      pipe_->microbatch = [this](const TokenData& data, long step, int mb) {
        const MicroBatch b = local_microbatch(data, step, mb);
        return model_.begin_microbatch(b.inputs, b.targets, rc_.micro_batch, pos_);
      };
      pipe_->before_compute = [this](const pp::Action& a) { set_last(a.mb == plan_.m - 1); };
    }
    // Sequence-parallel norm gradients are partial over tp: reduced before ZeRO scatters the unit
    // (a subscriber added first runs first): every micro-batch's under ZeRO-2/3, the accumulated
    // ones under ZeRO-1 (its last micro-batch); plain DP reduces them after the dp all-reduce.
    if (p.sp && p.zero >= 1)
      model_.unit_grads_ready.add([this](int u) {
        if (p_.zero >= 2 || last_) tp::reduce_norm_grads(model_, mesh_.tp(), u);
      });
    if (p.zero == 0) {
      opt_ = std::make_unique<AdamW>(model_, 0, model_.table.total, rc.master_weights);
      // Under a pipeline too: the buckets leave during the last micro-batch's backward
      // (before_compute above), the stage's cooldown.
      const bool bucketed = p.dp_mode == "bucketed";
      if (p.mesh.ep > 1) {  // 07's split: dense ranges over the dense group, each held expert over ep_dp
        std::vector<std::pair<int64_t, int64_t>> dense_r, expert_r;
        ep::split_ranges(model_.table, dense_r, expert_r);
        reducer_ = std::make_unique<dp::GradReducer>(model_, dense_, bucketed, p.bucket_mb, dense_r);
        experts_ = std::make_unique<dp::GradReducer>(model_, mesh.ep_dp(), bucketed, p.bucket_mb, expert_r);
      } else {
        reducer_ = std::make_unique<dp::GradReducer>(model_, dense_, bucketed, p.bucket_mb);
      }
    } else {
      if (p.dp_shard > 0) hsdp_ = zero::hsdp_groups(dense_, p.dp_shard);  // 03a: shard groups and their replicas
      zero_ = std::make_unique<zero::Zero>(model_, hsdp_.first ? *hsdp_.first : dense_, p.zero, p.prefetch, rc, hsdp_.second.get());
    }
  }

  // Each rank initialises or loads exactly its blocks; ZeRO-1/2 then gather the full tp block.
  long init_or_resume() {
    long first = 0;
    if (zero_) {
      for (int u = 0; u < zero_->units(); u++) {
        const AdamW& o = zero_->opt(u);
        first = ts::init_or_resume(model_, zero_->opt(u), rc_, o.begin, o.end, zero_->weights(u));
      }
      zero_->all_gather_weights();
    } else {
      first = ts::init_or_resume(model_, *opt_, rc_, 0, model_.table.total, model_.params);
    }
    for (Comm* g : groups()) g->reset_stats();
    return first;
  }

  // Micro-batch mb of this dp rank's contiguous slice of the global batch; tp ranks read the
  // same, cp ranks their chunks of each sequence at their absolute positions.
  MicroBatch local_microbatch(const TokenData& data, long step, int mb) const {
    const int T = rc_.model.seq, b = rc_.micro_batch, first_seq = mesh_.dp_rank * (rc_.batch / p_.mesh.dp);
    MicroBatch m = make_microbatch(data, step, rc_.batch, T, first_seq + mb * b, b, model_.dev);
    if (p_.mesh.cp > 1) {
      const cp::LocalBatch l = cp::local_batch(m, b, T, mine_);
      m.inputs = l.inputs;
      m.targets = l.targets;
    }
    return m;
  }

  StepResult step(const TokenData& data, long step) {
    const int T = rc_.model.seq, mb = rc_.micro_batch, n = rc_.batch / p_.mesh.dp / mb;
    if (zero_) zero_->begin_step();
    else ts::zero(model_.grads);
    if (pipe_) {  // the stage's schedule runs every micro-batch; the reductions leave in its cooldown
      pipe_->run_step(data, rc_, step);
      if (zero_) zero_->end_microbatch(true);  // what is still in flight
    } else if (p_.ep_schedule) {  // --overlap-a2a: micro-batches in pairs (zero_ is refused with --ep)
      p_.ep_schedule->run(n, [&](int i) { set_last(i + 1 == n); }, [&](int i) {
        const MicroBatch b = local_microbatch(data, step, i);
        model_.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc_.batch) * T), pos_);
      });
    } else {
      for (int i = 0; i < n; i++) {
        if (zero_) zero_->begin_microbatch();
        set_last(i + 1 == n);
        const MicroBatch b = local_microbatch(data, step, i);
        model_.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc_.batch) * T), pos_);
        if (zero_) zero_->end_microbatch(i + 1 == n);
      }
    }
    // tp blocks, pipeline stages and ep ranks (their experts) hold different parameters: the norm
    // sums over all three, each copy counted once (ParamEntry::counts).
    std::vector<MPI_Comm> shards = {mesh_.tp().mpi(), mesh_.pp().mpi()};
    if (moe_) shards.push_back(mesh_.ep().mpi());
    double norm;
    if (zero_) {
      norm = zero_->grad_norm(shards);
      zero_->optimizer_step(rc_, step, norm);
    } else {
      reducer_->finish();  // what is still in flight (naive mode: every tensor now)
      if (experts_) experts_->finish();
      if (p_.sp) tp::reduce_norm_grads(model_, mesh_.tp());  // after the dp all-reduce has landed
      norm = global_grad_norm(model_.table, {{0, model_.grads}}, shards);
      opt_->step(model_, model_.params, model_.grads, lr_at(rc_, step), step + 1, clip_coefficient(norm, rc_.clip), rc_);
    }
    // The last stage holds the loss (the others add 0); each stage its layers' routing statistics.
    // A layer's loads are summed over the ranks that route different tokens through it: dp (and
    // the ep ranks cut from dp, each routing its own sequences) and cp, not tp (its ranks route
    // the same tokens, the MoE block being whole over tp); pp adds the other stages' layers (zeros
    // here). So DeepSeek-V3's bias moves by 01's loads, on every tp rank alike (notes/08).
    const std::vector<MPI_Comm> token_groups = {dense_.mpi(), mesh_.pp().mpi()};
    StepResult r{global_mean_loss(model_.take_loss(), double(rc_.batch) * T, token_groups), norm};
    if (rc_.model.experts > 0) moe_step_report(model_, r, token_groups, opt_ ? opt_->master : Tensor());
    return r;
  }

  // The step's last micro-batch runs: its backward makes each unit's gradients final, so 02's
  // buckets and ZeRO-1's per-unit reduce-scatters leave as the units finish.
  void set_last(bool last) {
    last_ = last;
    if (reducer_) reducer_->set_sync(last);
    if (experts_) experts_->set_sync(last);
    if (zero_) zero_->set_last(last);
  }

  // The groups this mesh communicates on (size > 1), for the comm report.
  std::vector<Comm*> groups() const {
    std::vector<Comm*> g;
    for (Comm* c : {hsdp_.first ? hsdp_.first.get() : &dense_, hsdp_.second.get(), &mesh_.tp(), &mesh_.cp(), &mesh_.pp()})
      if (c && c->size() > 1) g.push_back(c);
    if (moe_)
      for (Comm* c : {&mesh_.ep(), &mesh_.ep_dp()})
        if (c->size() > 1) g.push_back(c);
    return g;
  }

  // Plain DP: the first ep group's tp ranks write their blocks (as 07: each expert by its owner,
  // the dense tensors by ep rank 0, chosen by ParamEntry::counts; without ep, dp rank 0);
  // ZeRO: every rank writes its chunks.
  std::vector<CheckpointSlice> checkpoint_slices() const {
    if (zero_) return zero_->checkpoint_slices();
    if (dense_.rank() >= p_.mesh.ep) return {};  // the other ep groups are replicas; every stage writes its units
    return {{0, model_.table.total, weights_f32(model_.params, *opt_), opt_.get()}};
  }

  // The ep group's all-to-all bytes so far, from this rank's routing counts (07's prediction).
  double ep_predicted_bytes() const { return moe_ ? moe_->routed_bytes : 0.0; }

  Model& model() { return model_; }
  double hidden_fraction() const { return reducer_ ? reducer_->hidden_fraction() : 0.0; }

 private:
  static ModelLayout layout(const RunConfig& rc, const Plan& p, const Mesh& mesh) {
    ModelLayout l;
    l.shard = shard_spec(rc, p, mesh.tp_rank, mesh.pp_rank, mesh.ep_rank);
    if (p.zero > 0) l.align = shard_group_size(p);
    l.hold_params = p.zero < 3;
    l.hold_grads = p.zero < 2;
    return l;
  }
  const RunConfig& rc_;
  Plan p_;
  Mesh& mesh_;
  Comm& dense_;  // dp, or dp × cp: where dense gradients are reduced
  Model model_;
  std::vector<int32_t> mine_;  // this cp rank's token positions (cp > 1)
  Tensor pos_;
  pp::Plan plan_;
  std::unique_ptr<pp::PairBlocks> paired_;  // --overlap-a2a under DualPipeV: plan_ with its pairs as blocks
  std::unique_ptr<MeshPipeline> pipe_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<dp::GradReducer> reducer_;
  std::unique_ptr<dp::GradReducer> experts_;  // --ep: the expert ranges over ep_dp
  ep::ExpertParallelMoe* moe_ = nullptr;      // --ep: the model's MoE block (the model owns it)
  zero::Groups hsdp_;  // HSDP's shard group and replica group (03a), before the Zero that uses them
  std::unique_ptr<zero::Zero> zero_;
  bool last_ = true;  // the step's last micro-batch is running (set_last)
};

// ----- the lab (lab/08_5d_mesh.cu, read after this file; the planner in lab/08_plan.h) ------------
// --plan's flags (the cluster, the job, and --calibration, which a run's step time is priced with
// too) fill the planner's types, held here behind PlanRequest; --plan runs the search and its
// ranking. A run: its plan and memory predicted before it, the reports after, the step time.
struct PlanRequest;
// What main's flags set beyond the run's: the mesh's options, and what --plan was asked.
struct Options {
  Plan plan;
  bool planning = false, mesh_given = false, show_mesh = false;
  std::shared_ptr<PlanRequest> planner;  // --plan's cluster and job, and --calibration
};
void read_planner_flags(Args& a, Options& o);
void set_up_plan(Args& a, RunConfig& rc, MeshConfig& mc, Options& o);
int plan_cluster(RunLog& log, const RunConfig& rc, Options& o);
void print_run_plan(RunLog& log, const RunConfig& rc, const Options& o, const Mesh& mesh);
MemoryPrediction predict_rank_memory(const RunConfig& rc, const Plan& p, int pp_rank);
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, const Plan& p, Composed& run);
void predict_run_step_time(Loop& loop, RunLog& log, const RunConfig& rc, const Options& o, Device dev);

}  // namespace mesh5d

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 8
using namespace ts;

static const char* kDoc =
    "08_5d_mesh: data, pipeline, context, tensor (+ sequence) and expert parallelism and ZeRO on one mesh, composed\n"
    "from 02–07.\n"
    "usage: mpirun -np N 08_5d_mesh --dp D --pp P --cp C --tp T [--ep E --experts X] [--zero 0|1|2|3] [--sequence-parallel]\n"
    "       [--schedule 1f1b|afab|interleaved|zb-h1|dualpipev] [--cp-mode ring|ulysses] [flags]  (N = D·P·C·T)\n"
    "       08_5d_mesh --plan --preset 8b --gpus 64 [--gpu h100] (runs nothing)";

// DualPipeV's V is two stages per rank, stage s and stage 2·pp − 1 − s: --virtual-stages unset means
// 2, and any other value is refused (here, so that --plan refuses it too).
static void read_dualpipev_stages(Args& a, mesh5d::Plan& plan) {
  if (!a.has("--virtual-stages")) plan.virtual_stages = 2;
  pp::validate_dualpipev_chunks(plan.virtual_stages);
}

// The mesh and each technique's options, checked as 02–07 check them.
static void declare_mesh_flags(Args& a, MeshConfig& mc, mesh5d::Options& o) {
  mesh5d::Plan& plan = o.plan;
  o.mesh_given = a.has("--dp") || a.has("--tp") || a.has("--cp") || a.has("--pp") || a.has("--ep");
  mc.dp = a.get_int("--dp", 1, "data-parallel degree", degree_range());
  mc.tp = a.get_int("--tp", 1, "tensor-parallel degree (innermost: neighbouring ranks)", degree_range());
  mc.pp = a.get_int("--pp", 1, "pipeline-parallel degree", degree_range());
  mc.cp = a.get_int("--cp", 1, "context-parallel degree", degree_range());
  mc.ep = a.get_int("--ep", 1, "expert-parallel degree: experts over groups of this many dp × cp ranks (with --experts)",
                    degree_range());
  const std::string order = a.get_str("--rank-order", "dp-pp-cp-tp",
                                      "world ranks by axis, outermost first: dp-pp-cp-tp | pp-dp-cp-tp (the pipeline "
                                      "stages outermost, Megatron's default: a stage's dp × cp ranks, and its ep groups, on "
                                      "neighbouring ranks and so on few nodes)");
  if (order != "dp-pp-cp-tp" && order != "pp-dp-cp-tp")
    config_error("--rank-order must be dp-pp-cp-tp or pp-dp-cp-tp (got '%s')", order.c_str());
  mc.pp_outer = order == "pp-dp-cp-tp";
  o.show_mesh = a.get_bool("--show-mesh", "print the rank-to-group table (printed anyway at 16 ranks or fewer)");
  plan.zero = a.get_int("--zero", 0, "0 = plain data parallelism, 1/2/3 = ZeRO stage over dp");
  plan.sp = a.get_bool("--sequence-parallel", "split the norm/residual regions' tokens across the tp ranks");
  plan.dp_shard = zero::hsdp_shard(a.get_int("--dp-shard", 0, zero::kDpShardHelp, between(0, 1 << 20)), mc.dp * mc.cp,
                                   mc.cp > 1 ? "dp × cp" : "--dp");
  plan.tp_variant = tp::read_variant(a);
  plan.prefetch = a.get_int("--prefetch", 1, "ZeRO-3: gather the next unit during the current one (1/0)", between(0, 1));
  plan.dp_mode = a.get_str("--dp-mode", "bucketed", "plain DP: naive | bucketed");
  plan.bucket_mb = a.get_double("--bucket-mb", 25, "plain DP: gradient bucket size in MiB", dp::bucket_mb_range());
  const std::string cp_mode = a.get_str("--cp-mode", "ring", "cp > 1: ring | ulysses");
  const int zigzag = a.get_int("--zigzag", 1, "cp > 1: 1 = zigzag chunks (balanced), 0 = contiguous");
  if (cp_mode != "ring" && cp_mode != "ulysses") config_error("--cp-mode must be ring or ulysses (got '%s')", cp_mode.c_str());
  if (zigzag != 0 && zigzag != 1) config_error("--zigzag must be 1 or 0 (got %d)", zigzag);
  plan.cp = {cp_mode == "ring" ? cp::Mode::Ring : cp::Mode::Ulysses, zigzag == 1};
  const std::string sched = a.get_str("--schedule", "1f1b", "pp > 1: " + pp::schedule_names(" | ", " | "));
  plan.virtual_stages = a.get_int("--virtual-stages", 1, "pp > 1, interleaved: chunks per rank (dualpipev: 2)");
  plan.stage_layers = a.get_str("--stage-layers", "", "pp > 1: layers per virtual stage a,b,… (default: even, or the ends lighter)");
  // shard_spec places each rank's stages by the schedule (05's ScheduleKind::stage), so 08 runs DualPipeV's V.
  if (!pp::parse_schedule(sched, plan.schedule))
    config_error("unknown --schedule '%s' (%s)", sched.c_str(), pp::schedule_names(", ", " or ").c_str());
  if (plan.schedule == pp::kDualPipeV) read_dualpipev_stages(a, plan);
  plan.ep_schedule = ep::read_schedule(a);
  plan.two_level = ep::read_dispatch(a, "--plan: price the ep all-to-all as flat, or as 07's two-level dispatch across "
                                        "the nodes an ep group spans (DeepSeek-V3 §3.2.2)").name == "two-level";
}

// The chapter's flags: the planner's (--plan and its cluster and job), the mesh's, and with
// --plan what the flags fix of the mesh to be searched.
static void read_flags(Args& a, RunConfig& rc, MeshConfig& mc, mesh5d::Options& o) {
  o.planning = a.get_bool("--plan", "predict and rank meshes for a cluster; runs nothing");
  mesh5d::read_planner_flags(a, o);
  declare_mesh_flags(a, mc, o);
  mesh5d::set_up_plan(a, rc, mc, o);
}

int main(int argc, char** argv) {
  mesh5d::Options o;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig& rc, MeshConfig& mc) { read_flags(a, rc, mc, o); },
                  /*priced=*/false);  // 08 reads --calibration with its planner's flags
  RunConfig& rc = run.rc;
  o.plan.mesh = run.mc;
  if (o.planning) return mesh5d::plan_cluster(run.log(), rc, o);
  mesh5d::validate(rc, o.plan);
  auto memory = [&] { return mesh5d::predict_rank_memory(rc, o.plan, run.mesh.pp_rank); };  // this rank's stage
  if (!run.start([&] { mesh5d::print_run_plan(run.log(), rc, o, run.mesh); }, memory)) return 0;
  mesh5d::Composed composed(rc, o.plan, run.mesh);
  fp8::install(composed.model(), rc, run.mesh, run.log());  // --dtype fp8: the dense linears' GEMMs on FP8 operands
  run.resumed(composed.init_or_resume());
  Loop loop;
  loop.predicted = memory();  // this rank's stage: the table reports the printing rank (0, or a fake world's R)
  loop.step = [&](long step) { return composed.step(run.data, step); };
  mesh5d::add_reports(loop, run.log(), rc, o.plan, composed);
  mesh5d::predict_run_step_time(loop, run.log(), rc, o, run.dev);
  return run.train(loop);
}
#endif  // TS_PROGRAM == 8
#endif  // TS_08_5D_MESH_CU
