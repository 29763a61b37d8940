// 08_5d_mesh.cu — the techniques on one mesh, composed from their own files.
//
// The playbook's closing chapters, runnable: world = dp × pp × cp × tp ranks (TP innermost, then
// CP, PP, DP, as in common/mesh.h). This file re-implements nothing: every piece below is the
// technique file's own —
//   02_data_parallel.cu    dp::GradReducer             gradients all-reduced over dp, bucketed
//   03_zero.cu             zero::Zero                  ZeRO-1/2/3 over dp, per-unit shards
//   04_tensor_parallel.cu  tp::install, tp::reduce_norm_grads   column/row-parallel layers, f/g,
//                                                      vocabulary-parallel loss, sequence parallel
// — and 08 only wires them onto one model and one mesh: the model is built with the tp shard
// spec, f/g and the loss come from 04, and the gradients of that shard go to 02's reducer or 03's
// sharder over the dp group. Hooks take several subscribers, so the sequence-parallel norm
// reduction and ZeRO's reduce-scatter act on the same unit in that order.
//
//   mpirun -np 8 ./build/08_5d_mesh --dp 2 --tp 4 --zero 1 --sequence-parallel --kv-heads 4
//   ./build/08_5d_mesh --dry-run --preset 8b --dp 8 --tp 8 --zero 1 --micro-batch 1 --dtype bf16
#ifndef TS_08_5D_MESH_CU
#define TS_08_5D_MESH_CU
#include "02_data_parallel.cu"
#include "03_zero.cu"
#include "04_tensor_parallel.cu"

namespace mesh5d {
using namespace ts;

// The composition one run asks for.
struct Plan {
  MeshConfig mesh;
  int zero = 0;  // 0: plain data parallelism (02), 1–3: ZeRO stage (03)
  bool sp = false;
  bool prefetch = true;
  std::string dp_mode = "bucketed";
  double bucket_mb = 25;
};

// Every check of the pieces, before any collective; the unsupported combinations name why.
inline void validate(const RunConfig& rc, const Plan& p) {
  tp::validate(rc, p.mesh.tp, p.sp);
  if (p.zero < 0 || p.zero > 3) config_error("--zero must be 0 (plain DP), 1, 2 or 3 (got %d)", p.zero);
  if (p.mesh.pp != 1 || p.mesh.cp != 1 || p.mesh.ep != 1)
    config_error("--pp, --cp and --ep are not composed by this build of 08_5d_mesh (dp, tp and ZeRO are)");
  if (p.dp_mode != "naive" && p.dp_mode != "bucketed")
    config_error("--dp-mode must be naive or bucketed (got '%s')", p.dp_mode.c_str());
  if (p.zero > 0 && p.dp_mode != "bucketed") config_error("--dp-mode applies to plain data parallelism (--zero 0) only");
}

// This rank's table: its tp blocks, each unit padded to a multiple of dp when ZeRO shards it.
inline ParamTable local_table(const RunConfig& rc, const Plan& p, int tp_rank) {
  return Model::make_table(rc.model, p.zero > 0 ? p.mesh.dp : 1, tp::shard_spec(p.mesh.tp, tp_rank));
}

// ----- predict: memory and communication per rank, from the pieces' own formulas ------------------

inline double micro_batches_per_rank(const RunConfig& rc, const Plan& p) {
  return double(rc.batch) / p.mesh.dp / rc.micro_batch;
}

inline MemoryPrediction predict_memory(const RunConfig& rc, const Plan& p) {
  const ParamTable t = local_table(rc, p, 0);
  MemoryPrediction m;
  if (p.zero == 0) {
    const int64_t psi = local_param_count(t);
    m = predict_states(psi, psi, rc.dtype, rc.master_weights);
  } else {
    m = zero::predict_memory(rc, {p.zero, p.mesh.dp, int(micro_batches_per_rank(rc, p)), p.prefetch, t});
  }
  m.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute, p.mesh.tp, p.sp);
  return m;
}

// Wire bytes per rank per step, per group: tp from 04's formula at this rank's micro-batches, dp
// from 02's all-reduce or 03's reduce-scatter/all-gather over the tp-local Ψ.
inline std::map<std::string, std::map<std::string, double>> predict_comm(const RunConfig& rc, const Plan& p) {
  const double mbs = micro_batches_per_rank(rc, p);
  std::map<std::string, std::map<std::string, double>> c;
  if (p.mesh.tp > 1) c["tp"] = tp::predict_comm(rc, p.mesh.tp, p.sp, mbs, p.sp && p.zero >= 2);
  if (p.mesh.dp > 1) {
    const ParamTable t = local_table(rc, p, 0);
    if (p.zero == 0) c["dp"] = {{"all_reduce", dp::allreduce_bytes(t.total, p.mesh.dp)}};
    else c["dp"] = zero::predict_comm(rc, {p.zero, p.mesh.dp, int(mbs), p.prefetch, t});
  }
  return c;
}

inline void print_plan(RunLog& log, const RunConfig& rc, const Plan& p) {
  print_model(log, rc.model);
  const MemoryPrediction m = predict_memory(rc, p);
  log.line("mesh dp %d × tp %d%s, %s; %d sequences per dp rank in %g micro-batches of %d", p.mesh.dp, p.mesh.tp,
           p.sp ? " (sequence parallel)" : "", p.zero ? ("ZeRO-" + std::to_string(p.zero)).c_str() : "plain DP",
           rc.batch / p.mesh.dp, micro_batches_per_rank(rc, p), rc.micro_batch);
  log.line("per-rank memory predicted: params %s, grads %s, optimizer %s, activations %s", human_bytes(m.params).c_str(),
           human_bytes(m.grads).c_str(), human_bytes(m.optimizer).c_str(), human_bytes(m.activations).c_str());
  for (auto& [group, ops] : predict_comm(rc, p))
    for (auto& [op, b] : ops) log.line("per-rank %s %s per step: %s", group.c_str(), op.c_str(), human_bytes(b).c_str());
}

// ----- the composed step ----------------------------------------------------------------------------

// One model on one mesh, with the pieces of 02/03/04 attached to it.
class Composed {
 public:
  Composed(const RunConfig& rc, const Plan& p, Mesh& mesh)
      : rc_(rc), p_(p), mesh_(mesh), model_(rc.model, mesh.device, rc.dtype, rc.recompute, layout(rc, p, mesh)) {
    tp::install(model_, mesh.tp(), p.sp);
    // Sequence-parallel norm gradients are partial over tp: reduced before ZeRO-2/3 scatters the
    // unit (a subscriber added first runs first), else once per step in finish_backward.
    if (p.sp && p.zero >= 2) model_.unit_grads_ready.add([this](int u) { tp::reduce_norm_grads(model_, mesh_.tp(), u); });
    if (p.zero == 0) {
      opt_ = std::make_unique<AdamW>(model_, 0, model_.table.total, rc.master_weights);
      reducer_ = std::make_unique<dp::GradReducer>(model_, mesh.dp(), p.dp_mode == "bucketed", p.bucket_mb);
    } else {
      zero_ = std::make_unique<zero::Zero>(model_, mesh.dp(), p.zero, p.prefetch, rc);
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
    mesh_.dp().reset_stats();
    mesh_.tp().reset_stats();
    return first;
  }

  // This dp rank's contiguous slice of the global batch, in micro-batches; tp ranks read the same.
  StepResult step(const TokenData& data, long step) {
    const int T = rc_.model.seq, mb = rc_.micro_batch, local = rc_.batch / p_.mesh.dp;
    const int first_seq = mesh_.dp_rank * local;
    if (zero_) zero_->begin_step();
    else ts::zero(model_.grads);
    double loss_sum = 0;
    for (int s0 = 0; s0 < local; s0 += mb) {
      const bool last = s0 + mb == local;
      if (zero_) zero_->begin_microbatch();
      else reducer_->set_sync(last);
      MicroBatch b = make_microbatch(data, step, rc_.batch, T, first_seq + s0, mb, model_.dev);
      loss_sum += model_.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc_.batch) * T));
      if (zero_) {
        if (last && p_.sp && p_.zero == 1) tp::reduce_norm_grads(model_, mesh_.tp());  // before the scatter
        zero_->end_microbatch(last);
      }
    }
    double norm;
    if (zero_) {
      norm = zero_->grad_norm({mesh_.tp().mpi()});
      zero_->optimizer_step(rc_, step, norm);
    } else {
      reducer_->finish();
      if (p_.sp) tp::reduce_norm_grads(model_, mesh_.tp());  // after the dp all-reduce has landed
      norm = global_grad_norm(model_.table, {{0, model_.grads}}, {mesh_.tp().mpi()});
      opt_->step(model_, model_.params, model_.grads, lr_at(rc_, step), step + 1, clip_coefficient(norm, rc_.clip), rc_);
    }
    return {global_mean_loss(loss_sum, double(rc_.batch) * T, {mesh_.dp().mpi()}), norm};
  }

  // Plain DP: dp rank 0's tp ranks write their blocks; ZeRO: every rank writes its chunks.
  std::vector<CheckpointSlice> checkpoint_slices() const {
    if (zero_) return zero_->checkpoint_slices();
    if (mesh_.dp_rank != 0) return {};
    return {{0, model_.table.total, weights_f32(model_.params, *opt_), opt_.get()}};
  }

  Model& model() { return model_; }
  double hidden_fraction() const { return reducer_ ? reducer_->hidden_fraction() : 0.0; }

 private:
  static ModelLayout layout(const RunConfig&, const Plan& p, const Mesh& mesh) {
    ModelLayout l;
    l.shard = tp::shard_spec(p.mesh.tp, mesh.tp_rank);
    if (p.zero > 0) l.align = p.mesh.dp;
    l.hold_params = p.zero < 3;
    l.hold_grads = p.zero < 2;
    return l;
  }
  const RunConfig& rc_;
  Plan p_;
  Mesh& mesh_;
  Model model_;
  std::unique_ptr<AdamW> opt_;
  std::unique_ptr<dp::GradReducer> reducer_;
  std::unique_ptr<zero::Zero> zero_;
};

}  // namespace mesh5d

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 8
using namespace ts;

static const char* kDoc =
    "08_5d_mesh: data, tensor (+ sequence) parallelism and ZeRO on one mesh, composed from 02–04.\n"
    "usage: mpirun -np N 08_5d_mesh --dp D --tp T [--zero 0|1|2|3] [--sequence-parallel] [flags]  (N = D·T)";

int main(int argc, char** argv) {
  mesh5d::Plan plan;
  Program prog(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) {
    mc.dp = a.get_int("--dp", 1, "data-parallel degree");
    mc.tp = a.get_int("--tp", 1, "tensor-parallel degree (innermost: neighbouring ranks)");
    mc.pp = a.get_int("--pp", 1, "pipeline-parallel degree");
    mc.cp = a.get_int("--cp", 1, "context-parallel degree");
    mc.ep = a.get_int("--ep", 1, "expert-parallel degree");
    plan.zero = a.get_int("--zero", 0, "0 = plain data parallelism, 1/2/3 = ZeRO stage over dp");
    plan.sp = a.get_bool("--sequence-parallel", "split the norm/residual regions' tokens across the tp ranks");
    plan.prefetch = a.get_int("--prefetch", 1, "ZeRO-3: gather the next unit during the current one (1/0)") != 0;
    plan.dp_mode = a.get_str("--dp-mode", "bucketed", "plain DP: naive | bucketed");
    plan.bucket_mb = a.get_double("--bucket-mb", 25, "plain DP: gradient bucket size in MiB");
  });
  RunConfig& rc = prog.rc;
  plan.mesh = prog.mc;
  RunLog& log = prog.log();
  mesh5d::validate(rc, plan);
  if (prog.dry_run([&] { mesh5d::print_plan(log, rc, plan); })) return 0;
  prog.open();  // validates world == dp·pp·cp·tp before any collective
  Mesh& mesh = prog.mesh;
  mesh5d::print_plan(log, rc, plan);

  mesh5d::Composed run(rc, plan, mesh);
  const long first = run.init_or_resume();
  if (first > 0) log.line("resumed from %s at step %ld", rc.resume_dir.c_str(), first);

  Loop loop;
  loop.predicted = mesh5d::predict_memory(rc, plan);
  loop.step = [&](long step) { return run.step(prog.data, step); };
  loop.save = [&](long step) {
    Json m = Json::object();
    m["dp"] = plan.mesh.dp;
    m["tp"] = plan.mesh.tp;
    m["zero"] = plan.zero;
    m["sequence_parallel"] = plan.sp;
    save_checkpoint(rc.save_dir, rc, run.model().table, run.checkpoint_slices(), step, m);
  };
  loop.comm = [&](long steps_run) {
    const auto pred = mesh5d::predict_comm(rc, plan);
    Json c = Json::object();
    for (Comm* g : {&mesh.dp(), &mesh.tp()}) {
      if (g->size() == 1) continue;
      Json one = comm_report(log, *g, steps_run, pred.count(g->name()) ? pred.at(g->name()) : std::map<std::string, double>{});
      c[g->name()] = one.at(g->name());
    }
    return c;
  };
  train_loop(rc, prog.dev, log, prog.data, first, loop);
  return 0;
}
#endif  // TS_PROGRAM == 8
#endif  // TS_08_5D_MESH_CU
