// fp8_linear.cu — the FP8 recipes of fp8_linear.h: which operand gets which scale, and where a
// split tensor's amax is reduced.
#include "training/fp8_linear.h"
#include "model/linear_gemms.h"

#include <algorithm>
#include <cmath>

#include "comm/comm.h"
#include "comm/mesh.h"
#include "training/report.h"
#include "comm/watchdog.h"

namespace ts::fp8 {

namespace {

// The dense linears FP8 applies to, by their HF names' endings.
bool is_dense_linear(const std::string& name) {
  static const char* kEnds[] = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                                "self_attn.o_proj.weight", "mlp.gate_proj.weight",    "mlp.up_proj.weight",
                                "mlp.down_proj.weight"};
  for (const char* e : kEnds) {
    const std::string end(e);
    if (name.size() >= end.size() && name.compare(name.size() - end.size(), end.size(), end) == 0) return true;
  }
  return false;
}

// NaN-propagating max: an amax that saw a NaN stays NaN, so the scale becomes NaN and the run's
// finiteness check stops it, rather than a NaN being dropped by a comparison.
float nan_max(float a, float b) { return (std::isnan(a) || a > b) ? a : b; }

int group_size(MPI_Comm c) {
  if (c == MPI_COMM_NULL) return 1;
  int n = 1;
  MPI_Comm_size(c, &n);
  return n;
}

// max over the group's ranks. MPI_MAX's treatment of NaN is unspecified, so NaN travels as +inf
// (scale_for gives NaN for either).
void reduce_max(float* v, int n, MPI_Comm group, const char* what) {
  if (group_size(group) == 1) return;
  for (int i = 0; i < n; i++)
    if (std::isnan(v[i])) v[i] = INFINITY;
  std::vector<float> in(v, v + n);
  watched_allreduce(in.data(), v, n, MPI_FLOAT, MPI_MAX, group, what);
}

// One scale for the whole tensor (the tile covers it).
Quantized per_tensor(const Tensor& t, DType format, float scale) {
  Quantized q;
  q.tr = q.tc = kWhole;
  q.scales = Tensor::empty({1, 1}, DType::F32, t.device(), Tag::Workspace);
  from_host_f32(q.scales, &scale);
  q.q = Tensor::empty(t.shape, format, t.device(), Tag::Workspace);
  quantize(q, t);
  return q;
}

}  // namespace

Fp8Gemms::Fp8Gemms(const Model& m, const Fp8Config& cfg, MPI_Comm tp_group, MPI_Comm cp_group, MPI_Comm step_group,
                   RunLog* log)
    : cfg_(cfg), lin_(m.table.entries.size()), tp_(tp_group), cp_(cp_group), step_(step_group), log_(log) {
  acc_.mantissa_bits = cfg.accum_bits;
  acc_.promote_every = cfg.promote_every;
  for (size_t i = 0; i < lin_.size(); i++) {
    const ParamEntry& e = m.table.entries[i];
    Linear& l = lin_[i];
    l.fp8 = is_dense_linear(e.name);
    l.name = e.name;
    // Column-parallel (a block of rows): W and the output gradient are split, the input is whole.
    // Row-parallel (a block of columns): W and the input are split, the output gradient is whole.
    l.split_w = (e.split == Split::Rows || e.split == Split::Cols) && e.parts > 1;
    l.split_x = e.split == Split::Cols && e.parts > 1;
    l.split_dy = e.split == Split::Rows && e.parts > 1;
  }
}

// tensorwise and delayed: e5m2's range for gradients (Transformer Engine's HYBRID format);
// blockwise: e4m3 everywhere, the fine scales covering the range (DeepSeek-V3 §3.3.2).
DType Fp8Gemms::grad_format() const {
  return cfg_.recipe == Fp8Recipe::Blockwise ? DType::F8E4M3 : DType::F8E5M2;
}

// This tensor's amax as 01 would see it: reduced over the ranks that hold other parts of it.
float Fp8Gemms::reduced_amax(int entry, Role r, const Tensor& t) {
  const Linear& l = lin_[size_t(entry)];
  float a = amax(t);
  const bool split_tp = r == kW ? l.split_w : r == kX ? l.split_x : l.split_dy;
  if (split_tp) reduce_max(&a, 1, tp_, "fp8 amax over tp");
  if (r != kW) reduce_max(&a, 1, cp_, "fp8 amax over cp");  // cp ranks hold other tokens
  return a;
}

Quantized Fp8Gemms::operand(int entry, Role r, const Tensor& t, int tr, int tc, DType format) {
  if (cfg_.recipe == Fp8Recipe::Blockwise) return quantize_current(t, format, tr, tc, cfg_.margin);
  Linear& l = lin_[size_t(entry)];
  float a = 0;
  if (cfg_.recipe == Fp8Recipe::Delayed) {
    l.pending[r] = nan_max(l.pending[r], amax(t));  // reduced over every rank at the step's end
    a = delayed_amax(entry, r);
  }
  if (a == 0) a = reduced_amax(entry, r, t);  // current scaling (delayed: no history yet)
  if (last_step_ < 0) l.first[r] = nan_max(l.first[r], a);
  return per_tensor(t, format, scale_for(a, format, cfg_.margin));
}

void Fp8Gemms::forward(int entry, const Tensor& y, const Tensor& x, const Tensor& W) {
  if (!lin_[size_t(entry)].fp8) return LinearGemms::forward(entry, y, x, W);
  const int t = cfg_.tile;  // used by blockwise only
  const Quantized qx = operand(entry, kX, x, 1, t, DType::F8E4M3), qw = operand(entry, kW, W, t, t, DType::F8E4M3);
  gemm(y, qx, false, qw, true, 0.f, acc_);
}

void Fp8Gemms::input_grad(int entry, const Tensor& dx, const Tensor& dy, const Tensor& W, bool accumulate) {
  if (!lin_[size_t(entry)].fp8) return LinearGemms::input_grad(entry, dx, dy, W, accumulate);
  const int t = cfg_.tile;
  const Quantized qdy = operand(entry, kDY, dy, 1, t, grad_format()), qw = operand(entry, kW, W, t, t, DType::F8E4M3);
  gemm(dx, qdy, false, qw, false, accumulate ? 1.f : 0.f, acc_);
}

// The sum runs over tokens, so blockwise tiles lie along them (tile x 1): DeepSeek-V3 quantizes
// the transposed activations and gradients for this GEMM.
void Fp8Gemms::weight_grad(int entry, const Tensor& dW, const Tensor& dy, const Tensor& x) {
  if (!lin_[size_t(entry)].fp8) return LinearGemms::weight_grad(entry, dW, dy, x);
  const int t = cfg_.tile;
  const Quantized qdy = operand(entry, kDY, dy, t, 1, grad_format()), qx = operand(entry, kX, x, t, 1, DType::F8E4M3);
  gemm(dW, qdy, true, qx, false, 1.f, acc_);
}

void Fp8Gemms::end_step(long step) {
  if (step == last_step_) return;
  if (last_step_ < 0) write_first_step_amax();
  last_step_ = step;
  if (cfg_.recipe != Fp8Recipe::Delayed) return;
  std::vector<float> amax(lin_.size() * 3);
  for (size_t i = 0; i < lin_.size(); i++)
    for (int r = 0; r < 3; r++) amax[i * 3 + size_t(r)] = lin_[i].pending[r];
  reduce_max(amax.data(), int(amax.size()), step_, "fp8 delayed-scaling amax history");
  report_saturation(step, amax);
  for (size_t i = 0; i < lin_.size(); i++) {
    if (!lin_[i].fp8) continue;
    for (int r = 0; r < 3; r++) {
      std::vector<float>& h = lin_[i].history[r];
      h.push_back(amax[i * 3 + size_t(r)]);
      if (int(h.size()) > cfg_.history) h.erase(h.begin());
      lin_[i].pending[r] = 0;
    }
  }
}

// Delayed scaling's failure, as it happens: a tensor whose amax this step exceeded the history's
// max it was scaled by had values past ±max_fp8, clamped there (the saturating cast). `amax` is
// the step's, reduced over every rank, so every rank sees the same; rank 0 prints.
void Fp8Gemms::report_saturation(long step, const std::vector<float>& amax) {
  static const char* kRole[] = {"input", "weight", "output gradient"};
  int over = 0;
  double worst = 1;
  std::string where;
  for (size_t i = 0; i < lin_.size(); i++)
    for (int r = 0; r < 3; r++) {
      // The scale maps 2^margin · the history's amax onto max_fp8: past that, values clamp.
      const float h = delayed_amax(int(i), Role(r)), a = amax[i * 3 + size_t(r)];
      if (!lin_[i].fp8 || h == 0 || !(a > std::ldexp(h, cfg_.margin))) continue;
      over++;
      if (a / h > worst || !std::isfinite(a)) {
        worst = a / h;
        where = lin_[i].name + " " + kRole[r];
      }
    }
  // Every step's line would bury the log while activations grow early in training; the first
  // three, and every jump past twice the history's amax, are printed.
  if (over == 0 || !log_) return;
  if (++saturated_steps_ > 3 && worst < 2) return;
  log_->line("fp8 delayed scaling, step %ld: %d tensor%s exceeded the amax history and saturated at ±max; "
               "worst %s at %.3gx the history's amax",
               step - 1, over, over == 1 ? "" : "s", where.c_str(), worst);
}

// The test hook TS_FP8_AMAX_LOG=PATH: each rank writes PATH.RANK, one line "name x w dy" per
// linear it holds, the amaxes its per-tensor scales came from in step 1, so a test can check
// that a sharded run scaled every tensor as 01 did.
void Fp8Gemms::write_first_step_amax() const {
  const char* path = getenv("TS_FP8_AMAX_LOG");
  if (!path || cfg_.recipe == Fp8Recipe::Blockwise) return;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  FILE* f = fopen((std::string(path) + "." + std::to_string(rank)).c_str(), "w");
  TS_CHECK(f, "TS_FP8_AMAX_LOG: cannot write %s.%d", path, rank);
  for (const Linear& l : lin_)
    if (l.fp8 && l.first[kW] > 0) fprintf(f, "%s %.9g %.9g %.9g\n", l.name.c_str(), l.first[kX], l.first[kW], l.first[kDY]);
  fclose(f);
}

float Fp8Gemms::delayed_amax(int entry, Role r) const {
  float a = 0;
  for (float v : lin_[size_t(entry)].history[r]) a = nan_max(v, a);
  return a;
}

size_t Fp8Gemms::history_bytes() const {
  size_t n = 0;
  for (const Linear& l : lin_)
    for (const auto& h : l.history) n += h.size() * sizeof(float);
  return n;
}

// Blockwise tiles must not straddle a tp shard, or a tile would hold elements of two ranks and
// its scale would differ from 01's. Checked from the shapes, identically on every rank.
static void check_tiles(const RunConfig& rc, int tp) {
  if (rc.fp8.recipe != Fp8Recipe::Blockwise || tp == 1) return;
  const ModelConfig& m = rc.model;
  const struct {
    const char* what;
    int64_t width;
  } split[] = {{"heads x head_dim", int64_t(m.heads) * m.head_dim()},
               {"kv_heads x head_dim", int64_t(m.kv_heads) * m.head_dim()},
               {"ffn", m.ffn}};
  for (const auto& s : split)
    if ((s.width / tp) % rc.fp8.tile != 0)
      config_error("--fp8-recipe blockwise at --tp %d: each rank holds %lld of %s = %lld, not a multiple of --fp8-tile %d",
                   tp, (long long)(s.width / tp), s.what, (long long)s.width, rc.fp8.tile);
}

// What FP8 adds to memory. The weights, gradients, optimizer states and saved activations are
// --dtype bf16's (backward re-quantizes the bf16 input it saved), so the formula's table above
// stands; on top of it: the amax histories (delayed: 3 per linear × history × 4 B, host memory)
// and, for the one GEMM in flight, its two operands' 1-byte codes and fp32 scales (workspace).
// The largest is over the linears held here, with N = micro-batch × seq tokens.
static void print_memory(const Model& m, const RunConfig& rc, RunLog& log) {
  const Fp8Config& f = rc.fp8;
  const int64_t N = int64_t(rc.micro_batch) * rc.model.seq;
  int64_t linears = 0, largest = 0;
  for (const ParamEntry& e : m.table.entries) {
    if (!e.held() || !is_dense_linear(e.name)) continue;
    linears++;
    const int64_t out = e.local_shape[0], in = e.local_shape[1];
    // forward x·Wᵀ, dgrad dy·W, wgrad dyᵀ·x: the codes of both operands of each.
    largest = std::max({largest, N * in + out * in, N * out + out * in, N * out + N * in});
  }
  const int64_t history = f.recipe == Fp8Recipe::Delayed ? linears * 3 * f.history * 4 : 0;
  log.line("fp8 memory: %lld linears; amax histories %lld B; largest GEMM's operand codes %lld B (workspace, "
           "plus its scales)",
           (long long)linears, (long long)history, (long long)largest);
}

void install(Model& m, const RunConfig& rc, Mesh& mesh, RunLog& log) {
  if (rc.fp8.recipe == Fp8Recipe::Off) return;
  check_tiles(rc, mesh.cfg.tp);
  m.gemms = std::make_unique<Fp8Gemms>(m, rc.fp8, mesh.tp().mpi(), mesh.cp().mpi(), mesh.world_comm().mpi(), &log);
  const Fp8Config& f = rc.fp8;
  std::string how = fp8_recipe_name(f.recipe);
  if (f.recipe == Fp8Recipe::Delayed) how += ", history " + std::to_string(f.history) + " steps";
  if (f.recipe == Fp8Recipe::Blockwise)
    how += ", tiles 1x" + std::to_string(f.tile) + " and blocks " + std::to_string(f.tile) + "x" + std::to_string(f.tile);
  if (f.margin) how += ", margin " + std::to_string(f.margin);
  if (f.accum_bits < 23) how += ", accumulator " + std::to_string(f.accum_bits) + " mantissa bits";
  if (f.promote_every) how += ", promoted every " + std::to_string(f.promote_every);
  log.line("fp8: %s; x and W in e4m3, dy in %s; q/k/v/o and gate/up/down GEMMs only%s", how.c_str(),
           f.recipe == Fp8Recipe::Blockwise ? "e4m3" : "e5m2",
           m.dev == Device::CPU ? " (CPU: quantize, then an fp32 GEMM of the codes)" : "");
  print_memory(m, rc, log);
}

}  // namespace ts::fp8
