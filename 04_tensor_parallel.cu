// 04_tensor_parallel.cu — tensor parallelism (Megatron-LM), with sequence parallelism.
//
// The playbook's tensor-parallel chapter, runnable. Every rank reads the same micro-batches; the
// model's matrices are split across the --tp ranks instead:
//   attention  q, k, v column-parallel by heads (heads/tp query heads and kv_heads/tp kv heads
//              per rank, so each GQA group stays on one rank), o_proj row-parallel;
//   MLP        gate and up column-parallel, down_proj row-parallel;
//   embedding  vocabulary-parallel (vocab/tp rows per rank), combined by g;
//   LM head    column-parallel by vocabulary, with a vocabulary-parallel cross-entropy that
//              never gathers the logits.
// The conjugate operators f (identity forward, all-reduce backward) and g (all-reduce forward,
// identity backward) sit before each column-parallel pair and after each row-parallel matmul:
// two all-reduces per layer forward, two backward.
//
// The chapter's figure, read off the code. Each weight is stored [out, in]; tp::split_of below is
// the split table the model's shard spec reads (column-parallel splits rows, row-parallel
// columns). f and g are called in Model::layer_compute (forward) and Model::layer_backward, with
// this file's TensorParallel:
//
//   region     weight                  split                        this rank's output   then
//   embedding  embed_tokens   [V, D]   vocab rows V/tp              partial rows         g
//   attention  (input)                                                                   f
//              q_proj         [D, D]   column (heads/tp)            its heads' q
//              k_proj, v_proj [kvD, D] column (kv_heads/tp)         its heads' k, v
//              o_proj         [D, D]   row (its heads' columns)     partial sum          g, + residual
//   MLP        (input)                                                                   f
//              gate, up       [F, D]   column (ffn/tp)              its ffn/tp units
//              down_proj      [D, F]   row (ffn/tp columns)         partial sum          g, + residual
//   head       (input)                                                                   f
//              lm_head        [V, D]   column (vocab rows V/tp)     its V/tp logits      vocab-parallel loss
//
// RMSNorm weights are whole on every rank (under --sequence-parallel each sees only its tokens,
// so reduce_norm_grads below sums their gradients over tp).
//
// --sequence-parallel: in the RMSNorm/residual regions each rank keeps only its contiguous block
// of the micro-batch's tokens; g becomes a reduce-scatter and f an all-gather (the same bytes as
// the all-reduce they replace), and those activations are stored at 1/tp.
//
// tp must divide the kv heads (a GQA group stays on one rank); the default shape (tiny) has 4 query
// heads and 2 kv heads, so a 4-way run names 4 kv heads:
//   mpirun -np 4 ./build/04_tensor_parallel --tp 4 --sequence-parallel --kv-heads 4
//   ./build/04_tensor_parallel --dry-run --preset 8b --tp 8 --micro-batch 1 --dtype bf16
#ifndef TS_04_TENSOR_PARALLEL_CU
#define TS_04_TENSOR_PARALLEL_CU
#include <cstring>
#include <functional>
#include <map>
#include <vector>

#include "kernels/vocab_ce.h"
#include "formats/data.h"
#include "comm/comm.h"
#include "comm/mesh.h"
#include "comm/trace.h"
#include "model/model.h"
#include "model/tp_ops.h"
#include "training/checkpoint.h"
#include "training/start.h"
#include "training/train.h"

namespace tp {
using namespace ts;

// ----- f and g ---------------------------------------------------------------------------------------

// The model calls f and g at the region boundaries; this fills them with the tp group's
// collectives. Without sequence parallelism: f = (identity, all-reduce), g = (all-reduce,
// identity). With it the token dimension is split outside the column/row-parallel pair:
// f = (all-gather, reduce-scatter), g = (reduce-scatter, all-gather).
class TensorParallel : public TpOps {
 public:
  TensorParallel(Comm& group, bool sequence_parallel) : tp_(group), sp_(sequence_parallel) {}
  Tensor f_forward(const Tensor& x) override { return sp_ ? all_gather(x, "f") : x; }
  Tensor f_backward(const Tensor& dx) override { return sp_ ? reduce_scatter(dx, "f'") : all_reduce(dx, "f'"); }
  Tensor g_forward(const Tensor& y, Tag tag) override { return sp_ ? reduce_scatter(y, "g", tag) : all_reduce(y, "g"); }
  Tensor g_backward(const Tensor& dy) override { return sp_ ? all_gather(dy, "g'") : dy; }
  bool sequence_parallel() const { return sp_; }

 private:
  Tensor all_reduce(const Tensor& t, const char* op) {
    TraceScope s(std::string("tp all_reduce (") + op + ")", Lane::Comm);
    tp_.all_reduce(t);  // in place: the partial sums become the full sum on every rank
    return t;
  }
  // [N/tp, D] -> [N, D]: rank r's rows are tokens [r·N/tp, (r+1)·N/tp) of the micro-batch.
  Tensor all_gather(const Tensor& x, const char* op) {
    TraceScope s(std::string("tp all_gather (") + op + ")", Lane::Comm);
    Tensor out = Tensor::empty({x.size(0) * tp_.size(), x.size(1)}, x.dtype, x.device(), Tag::Workspace);
    tp_.all_gather(out, x);
    return out;
  }
  // [N, D] partial sums -> this rank's [N/tp, D] block of the full sums.
  Tensor reduce_scatter(const Tensor& y, const char* op, Tag tag = Tag::Workspace) {
    TraceScope s(std::string("tp reduce_scatter (") + op + ")", Lane::Comm);
    Tensor out = Tensor::empty({y.size(0) / tp_.size(), y.size(1)}, y.dtype, y.device(), tag);
    tp_.reduce_scatter(out, y);
    return out;
  }
  Comm& tp_;
  bool sp_;
};

// ----- the vocabulary-parallel cross-entropy ---------------------------------------------------------

// Megatron's VocabParallelCrossEntropy. The LM head is split by vocabulary: rank r holds the
// logits x_v [N, V/tp] of the vocabulary rows V_r = [vocab_start, vocab_start + V/tp) for every
// token, and each token's target t (a global id) lies in one rank's rows. Softmax needs the row
// max and the sum of exponentials over the whole vocabulary, and the loss the target's logit. So
// the fused cross-entropy's row passes run in three steps (kernels.h's vocab_ce_*), with one MAX
// all-reduce of N floats and one SUM all-reduce of 2N floats between them, and no rank ever holds
// [N, V]:
//   1. vocab_ce_max     m_r = max_{v in V_r} x_v                     all-reduce MAX -> M = max_r m_r
//   2. vocab_ce_stats   S_r = sum_{v in V_r} exp(x_v - M),
//                       z_r = x_t if t is in V_r, else 0            all-reduce SUM -> S, z = x_t
//   3. vocab_ce_finish  loss = log S + M - z, the same on every rank, and the gradient of the
//                       local logits, dx_v = (exp(x_v - M) / S - [v = t]) · grad_scale, which
//                       needs nothing more from the other ranks.
// With one rank (vocab_start 0, no collectives) this is cross_entropy_forward_backward.
class VocabParallelCrossEntropy : public LossFn {
 public:
  explicit VocabParallelCrossEntropy(Comm& group) : tp_(group) {}
  void forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                        int64_t vocab_start, float grad_scale) override {
    const int64_t N = logits.size(0);
    Tensor max = Tensor::empty({N}, DType::F32, logits.device(), Tag::Workspace);
    Tensor stats = Tensor::empty({2, N}, DType::F32, logits.device(), Tag::Workspace);  // rows: S, z
    vocab_ce_max(max, logits);
    {
      TraceScope s("tp all_reduce (max logit)", Lane::Comm);
      tp_.all_reduce(max, ReduceOp::Max);
    }
    vocab_ce_stats(stats, logits, max, targets, vocab_start);
    {
      TraceScope s("tp all_reduce (sum exp, target logit)", Lane::Comm);
      tp_.all_reduce(stats);
    }
    vocab_ce_finish(losses, dlogits, logits, max, stats, targets, vocab_start, grad_scale);
  }

 private:
  Comm& tp_;
};

// A frontier variant of f and g (04a_async_tp.cu, --async-tp) registers its flag, its checks and
// what it installs in TensorParallel's place; the chapter never names it.
struct Variant {
  std::string flag, help;
  std::function<void(const RunConfig&, int tp, bool sp)> validate;
  std::function<void(Model&, Comm&)> install;
  std::function<std::function<StepTerms(const Gpu&)>(const RunConfig&, int tp)> step_time_model;  // as 04's below
  std::function<void(std::map<std::string, double>&, const RunConfig&, int tp)> comm;  // moves predict_comm's bytes
};
inline std::vector<Variant>& variants() {
  static std::vector<Variant> v;
  return v;
}
inline bool add_variant(Variant v) {
  variants().push_back(std::move(v));
  return true;
}
// The registered variants' flags: the one given (the last, if several), or null.
inline const Variant* read_variant(Args& a) {
  const Variant* on = nullptr;
  for (const Variant& v : variants())
    if (a.get_bool(v.flag, v.help)) on = &v;
  return on;
}

// Installs tensor parallelism into a model built with the tp shard spec.
inline void install(Model& m, Comm& group, bool sequence_parallel, const Variant* variant = nullptr) {
  m.tp = std::make_unique<TensorParallel>(group, sequence_parallel);
  m.loss = std::make_unique<VocabParallelCrossEntropy>(group);
  if (variant) variant->install(m, group);
}

// Under sequence parallelism a norm weight sees only this rank's tokens, so its gradient is a
// partial sum: all-reduced over tp once per step, after the last micro-batch — or, where ZeRO-2/3
// reduce-scatters each unit's gradients as they finish, for that unit (unit >= 0) just before.
inline void reduce_norm_grads(Model& m, Comm& group, int unit = -1) {
  TraceScope s("tp all_reduce (norm weight grads)", Lane::Comm);
  for (size_t i = 0; i < m.table.entries.size(); i++) {
    const ParamEntry& e = m.table.entries[i];
    if (e.replicated_over == "tp" && e.held() && (unit < 0 || e.unit == unit)) group.all_reduce(m.grad(int(i)));
  }
}

// The split table: the chapter's figure as the model's shard spec reads it. Weights are stored
// [out, in], so a column-parallel linear holds a block of rows (Split::Rows) and a row-parallel
// one a block of columns (Split::Cols); the vocabulary tables split their rows. Anything not named
// (the RMSNorm weights) is whole on every rank.
inline Split split_of(const std::string& hf_name) {
  static const std::pair<const char*, Split> table[] = {
      {"model.embed_tokens.weight", Split::Rows},  // vocabulary-parallel embedding: V/tp rows
      {".self_attn.q_proj.weight", Split::Rows},   // column-parallel by heads
      {".self_attn.k_proj.weight", Split::Rows},   // column-parallel by kv heads
      {".self_attn.v_proj.weight", Split::Rows},
      {".self_attn.o_proj.weight", Split::Cols},   // row-parallel: its heads' columns
      {".mlp.gate_proj.weight", Split::Rows},      // column-parallel by ffn units
      {".mlp.up_proj.weight", Split::Rows},
      {".mlp.down_proj.weight", Split::Cols},      // row-parallel
      {"lm_head.weight", Split::Rows},             // column-parallel by vocabulary
  };
  for (const auto& [suffix, split] : table) {
    const size_t n = std::strlen(suffix);
    if (hf_name.size() >= n && hf_name.compare(hf_name.size() - n, n, suffix) == 0) return split;
  }
  return Split::Whole;
}

// The shard spec and the checks every rank makes before any collective.
inline ShardSpec shard_spec(int tp, int tp_rank) {
  ShardSpec s;
  s.tp = tp;
  s.tp_rank = tp_rank;
  s.tp_split = split_of;
  return s;
}

inline void validate(const RunConfig& rc, int tp, bool sp, const Variant* variant = nullptr) {
  const ModelConfig& m = rc.model;
  if (variant) variant->validate(rc, tp, sp);
  if (tp < 1) config_error("--tp must be >= 1 (got %d)", tp);
  if (m.heads % tp) config_error("--heads %d is not divisible by --tp %d (q_proj is split by heads)", m.heads, tp);
  if (m.kv_heads % tp)
    config_error("--kv-heads %d is not divisible by --tp %d (each rank needs whole kv heads for its GQA groups)",
                 m.kv_heads, tp);
  if (m.ffn % tp) config_error("--ffn %d is not divisible by --tp %d (gate/up/down are split by ffn)", m.ffn, tp);
  if (m.vocab % tp) config_error("--vocab %d is not divisible by --tp %d (embedding and lm_head are split by vocabulary)", m.vocab, tp);
  if (sp && (int64_t(rc.micro_batch) * m.seq) % tp)
    config_error("--sequence-parallel: %d tokens per micro-batch (micro-batch %d × seq %d) are not divisible by --tp %d",
                 rc.micro_batch * m.seq, rc.micro_batch, m.seq, tp);
  // Under sequence parallelism the MLP block sees only this rank's tokens: a block the model does
  // not split over tp cannot run so (common/model/model.h says which, and why).
  if (sp && tp > 1)
    if (const char* why = sequence_parallel_refusal(m)) config_error("%s", why);
}

// ----- the playbook's formula: memory per rank (notes/04 derives it) -----------------------------------

// Each rank holds its blocks of the split matrices, with their gradients and optimizer states,
// and 1/tp of the activations saved inside each column/row-parallel pair; under sequence
// parallelism the norm/residual regions' activations are 1/tp too (predict_activations at tp, sp).
inline MemoryPrediction predict_memory(const RunConfig& rc, int tp, bool sp) {
  const int64_t psi = local_param_count(Model::make_table(rc.model, 1, shard_spec(tp, 0)));
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute, tp, sp);
  return p;
}

// ----- the lab (lab/04_tensor_parallel.cu: the plan, the bytes sent, the step time this run predicts) -----
void print_plan(RunLog& log, const RunConfig& rc, int tp, bool sp);
void add_reports(Loop& loop, RunLog& log, const RunConfig& rc, Mesh& mesh, int tp, bool sp, const Variant* variant = nullptr);
std::function<StepTerms(const Gpu&)> step_time_model(const RunConfig& rc, int tp, bool sp);

}  // namespace tp

// ----- the program ------------------------------------------------------------------------------------
#if TS_PROGRAM == 4
using namespace ts;

static const char* kDoc =
    "04_tensor_parallel: Megatron tensor parallelism (column/row-parallel linears, vocabulary-parallel\n"
    "embedding and cross-entropy) with optional sequence parallelism.\n"
    "usage: mpirun -np T 04_tensor_parallel --tp T [--sequence-parallel] [flags]";

// Every tp rank runs the same micro-batches through its shard of the model; the loss is the same
// number on every rank (the vocabulary-parallel cross-entropy reduced it), so only the gradient
// norm needs the group: each rank's blocks are different parameters.
static StepResult train_step(Model& model, AdamW& opt, const TokenData& data, const RunConfig& rc, Mesh& mesh,
                             bool sp, long step) {
  const int T = rc.model.seq, mb = rc.micro_batch;
  ts::zero(model.grads);
  for (int s0 = 0; s0 < rc.batch; s0 += mb) {
    MicroBatch b = make_microbatch(data, step, rc.batch, T, s0, mb, model.dev);
    model.forward_backward(b.inputs, b.targets, mb, 1.f / (float(rc.batch) * T));
  }
  if (sp) tp::reduce_norm_grads(model, mesh.tp());
  const double norm = global_grad_norm(model.table, {{0, model.grads}}, {mesh.tp().mpi()});
  opt.step(model, model.params, model.grads, lr_at(rc, step), step + 1, clip_coefficient(norm, rc.clip), rc);
  return {global_mean_loss(model.take_loss(), double(rc.batch) * T, {}), norm};
}

// Every rank writes its blocks at their global offsets (a replicated norm weight once): the file
// is the same for any tp.
static void save(const RunConfig& rc, Model& model, AdamW& opt, int tp, bool sp, long step) {
  Json m = Json::object();
  m["tp"] = tp;
  m["sequence_parallel"] = sp;
  save_checkpoint(rc.save_dir, rc, model.table, {{0, model.table.total, weights_f32(model.params, opt), &opt}}, step, m);
}

// The chapter's flags: the degree, whether sequence parallelism splits the norms' tokens, and a
// registered variant's (04a_async_tp.cu's --async-tp).
static bool read_tp_flags(Args& args, MeshConfig& mc, const tp::Variant*& variant) {
  mc.tp = args.get_int("--tp", 1, "tensor-parallel degree (= number of ranks)", degree_range());
  variant = tp::read_variant(args);
  return args.get_bool("--sequence-parallel", "split the norm/residual regions' tokens across the tp ranks");
}

int main(int argc, char** argv) {
  bool sp = false;
  const tp::Variant* variant = nullptr;
  TrainingRun run(argc, argv, kDoc, [&](Args& a, RunConfig&, MeshConfig& mc) { sp = read_tp_flags(a, mc, variant); });
  RunConfig& rc = run.rc;
  const int tp = run.mc.tp;
  tp::validate(rc, tp, sp, variant);
  if (!run.start([&] { tp::print_plan(run.log(), rc, tp, sp); }, [&] { return tp::predict_memory(rc, tp, sp); })) return 0;
  Model& model = run.build_model({tp::shard_spec(tp, run.mesh.tp_rank)});  // this rank's column/row blocks
  tp::install(model, run.mesh.tp(), sp, variant);
  AdamW opt(model, 0, model.table.total, rc.master_weights);
  run.init(model, opt);  // each rank initialises (or loads) exactly its blocks of the full model
  Loop loop;
  loop.predicted = tp::predict_memory(rc, tp, sp);
  loop.step = [&](long step) { return train_step(model, opt, run.data, rc, run.mesh, sp, step); };
  loop.save = [&](long step) { save(rc, model, opt, tp, sp, step); };
  tp::add_reports(loop, run.log(), rc, run.mesh, tp, sp, variant);
  return run.train(loop, variant ? variant->step_time_model(rc, tp) : tp::step_time_model(rc, tp, sp));
}
#endif  // TS_PROGRAM == 4
#endif  // TS_04_TENSOR_PARALLEL_CU
