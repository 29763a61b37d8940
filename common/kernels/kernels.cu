// kernels.cu — the ops of kernels.h: each checks its arguments and dispatches on the device of
// its tensors, to one of three implementations with the same contract:
//   ref::   the plain loops of kernels_ref.cu, where they are fast enough to train with
//           (elementwise, embedding forward, SwiGLU, AdamW, init); the reference of every op;
//   cpu::   the tuned CPU kernels of kernels_cpu.cu (embedding backward, RMSNorm, RoPE, matmul,
//           attention, cross-entropy, sum of squares), held to ref:: by tests/test_kernels.cpp,
//           and the vocabulary-parallel cross-entropy's steps, held to the fused cross-entropy;
//   cuda::  the CUDA twins of kernels_cuda.cu, for tensors on a GPU.
// The argument checks are shared (kernels_internal.h) with the chapter that defines kernels of
// its own: 06's merge and packing.
#include "kernels/kernels.h"

#include "kernels/kernels_cpu.h"
#include "kernels/kernels_internal.h"
#include "kernels/kernels_ref.h"
#include "kernels/profile.h"
#include "tensor/shape_only.h"
#ifdef TS_CUDA
#include "kernels/kernels_cuda.h"
#endif

namespace ts {
namespace detail {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); i++) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}
}  // namespace

// ===== argument checks ==========================================================================

void check_defined(const char* op, const char* name, const Tensor& t) {
  TS_CHECK(t.defined(), "%s: %s is an undefined tensor", op, name);
}

void check_shape(const char* op, const char* name, const Tensor& t, const std::vector<int64_t>& shape) {
  check_defined(op, name, t);
  TS_CHECK(t.shape == shape, "%s: %s must have shape %s, got %s", op, name, shape_str(shape).c_str(),
           t.str().c_str());
}

void check_dtype(const char* op, const char* name, const Tensor& t, DType dt) {
  check_defined(op, name, t);
  TS_CHECK(t.dtype == dt, "%s: %s must be %s, got %s", op, name, dtype_name(dt), t.str().c_str());
}

void check_float(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  TS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16, "%s: %s must be f32 or bf16, got %s", op, name,
           t.str().c_str());
}

void check_same_dtype(const char* op, const Tensor& a, const char* an, const Tensor& b, const char* bn) {
  TS_CHECK(a.dtype == b.dtype, "%s: %s and %s must have the same dtype, got %s and %s", op, an, bn,
           a.str().c_str(), b.str().c_str());
}

Device common_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) first = t;
    TS_CHECK(t->device() == first->device(), "%s: tensors on different devices (%s and %s)", op,
             first->str().c_str(), t->str().c_str());
  }
  return first ? first->device() : Device::CPU;
}

int64_t rows_of(const char* op, const char* name, const Tensor& t, int64_t D) {
  check_defined(op, name, t);
  TS_CHECK(t.dim() >= 1 && t.size(-1) == D, "%s: %s must be [..., %lld], got %s", op, name, (long long)D,
           t.str().c_str());
  return D ? t.numel() / D : 0;
}

void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* refname) {
  check_defined(op, name, t);
  TS_CHECK(t.shape == ref.shape && t.dtype == ref.dtype, "%s: %s must match %s (%s), got %s", op, name, refname,
           ref.str().c_str(), t.str().c_str());
}

void check_numel(const char* op, const char* name, const Tensor& t, int64_t n, DType dt) {
  check_dtype(op, name, t, dt);
  TS_CHECK(t.numel() == n, "%s: %s must have %lld elements, got %s", op, name, (long long)n, t.str().c_str());
}

}  // namespace detail

using namespace detail;

namespace {

// A matrix view of a tensor: rows = numel / last dim, cols = last dim ([B, S, D] -> [B*S, D]).
struct Mat {
  int64_t rows, cols;
};
Mat as_matrix(const char* op, const char* name, const Tensor& t) {
  check_defined(op, name, t);
  TS_CHECK(t.dim() >= 2, "%s: %s must have at least 2 dimensions, got %s", op, name, t.str().c_str());
  const int64_t cols = t.size(-1);
  return {cols ? t.numel() / cols : 0, cols};
}
}  // namespace

// A CUDA tensor reaches the CUDA twin; in a CPU-only build no CUDA tensor can exist.
#ifdef TS_CUDA
#define CUDA_TWIN(call) cuda::call
#else
#define CUDA_TWIN(call) fatal("CUDA tensor in a CPU-only build")
#endif

// ===== public ops ===============================================================================

void add(const Tensor& y, const Tensor& a, const Tensor& b) {
  TS_PROFILE_OP("add", y);
  check_float("add", "y", y);
  check_like("add", "a", a, y, "y");
  check_like("add", "b", b, y, "y");
  TS_SHAPE_ONLY_SKIP();
  if (common_device("add", {&y, &a, &b}) == Device::CUDA) return CUDA_TWIN(add(y, a, b));
  ref::add(y, a, b);
}

void add_inplace(const Tensor& y, const Tensor& x) {
  TS_PROFILE_OP("add_inplace", y);
  check_float("add_inplace", "y", y);
  check_like("add_inplace", "x", x, y, "y");
  TS_SHAPE_ONLY_SKIP();
  if (common_device("add_inplace", {&y, &x}) == Device::CUDA) return CUDA_TWIN(add_inplace(y, x));
  ref::add(y, y, x);
}

void scale_inplace(const Tensor& y, float s) {
  TS_PROFILE_OP("scale_inplace", y);
  check_float("scale_inplace", "y", y);
  TS_SHAPE_ONLY_SKIP();
  if (y.device() == Device::CUDA) return CUDA_TWIN(scale_inplace(y, s));
  ref::scale_inplace(y, s);
}

void convert(const Tensor& dst, const Tensor& src) {
  TS_PROFILE_OP("convert", dst);
  check_float("convert", "dst", dst);
  check_float("convert", "src", src);
  TS_CHECK(dst.numel() == src.numel(), "convert: %s <- %s: element counts differ", dst.str().c_str(),
           src.str().c_str());
  TS_SHAPE_ONLY_SKIP();
  if (common_device("convert", {&dst, &src}) == Device::CUDA) return CUDA_TWIN(convert(dst, src));
  ref::convert(dst, src);
}

void fill(const Tensor& t, float value) {
  TS_PROFILE_OP("fill", t);
  check_float("fill", "t", t);
  TS_SHAPE_ONLY_SKIP();
  if (t.device() == Device::CUDA) return CUDA_TWIN(fill(t, value));
  ref::fill(t, value);
}

void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start) {
  TS_PROFILE_OP("embedding_forward", out);
  const char* op = "embedding_forward";
  check_float(op, "table", table);
  TS_CHECK(table.dim() == 2, "%s: table must be [V, D], got %s", op, table.str().c_str());
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t D = table.size(1), N = tokens.numel();
  TS_CHECK(rows_of(op, "out", out, D) == N, "%s: out %s must hold one row per token (%lld tokens)", op,
           out.str().c_str(), (long long)N);
  check_same_dtype(op, out, "out", table, "table");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&out, &table, &tokens}) == Device::CUDA)
    return CUDA_TWIN(embedding_forward(out, table, tokens, vocab_start));
  ref::embedding_forward(out, table, tokens, vocab_start);
}

void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start) {
  TS_PROFILE_OP("embedding_backward", dtable);
  const char* op = "embedding_backward";
  check_dtype(op, "dtable", dtable, DType::F32);
  TS_CHECK(dtable.dim() == 2, "%s: dtable must be [V, D], got %s", op, dtable.str().c_str());
  check_dtype(op, "tokens", tokens, DType::I32);
  const int64_t D = dtable.size(1), N = tokens.numel();
  check_float(op, "dout", dout);
  TS_CHECK(rows_of(op, "dout", dout, D) == N, "%s: dout %s must hold one row per token (%lld tokens)", op,
           dout.str().c_str(), (long long)N);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&dtable, &dout, &tokens}) == Device::CUDA)
    return CUDA_TWIN(embedding_backward(dtable, dout, tokens, vocab_start));
  cpu::embedding_backward(dtable, dout, tokens, vocab_start);
}

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps) {
  TS_PROFILE_OP("rmsnorm_forward", y);
  const char* op = "rmsnorm_forward";
  check_float(op, "x", x);
  check_dtype(op, "w", w, DType::F32);
  TS_CHECK(w.dim() == 1, "%s: w must be [D], got %s", op, w.str().c_str());
  const int64_t D = w.size(0), N = rows_of(op, "x", x, D);
  check_like(op, "y", y, x, "x");
  check_numel(op, "rstd", rstd, N, DType::F32);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&y, &rstd, &x, &w}) == Device::CUDA) return CUDA_TWIN(rmsnorm_forward(y, rstd, x, w, eps));
  cpu::rmsnorm_forward(y, rstd, x, w, eps);
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  TS_PROFILE_OP("rmsnorm_backward", dx);
  const char* op = "rmsnorm_backward";
  check_float(op, "x", x);
  check_dtype(op, "w", w, DType::F32);
  TS_CHECK(w.dim() == 1, "%s: w must be [D], got %s", op, w.str().c_str());
  const int64_t D = w.size(0), N = rows_of(op, "x", x, D);
  check_like(op, "dx", dx, x, "x");
  check_like(op, "dy", dy, x, "x");
  check_shape(op, "dw", dw, w.shape);
  check_dtype(op, "dw", dw, DType::F32);
  check_numel(op, "rstd", rstd, N, DType::F32);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&dx, &dw, &dy, &x, &w, &rstd}) == Device::CUDA)
    return CUDA_TWIN(rmsnorm_backward(dx, dw, dy, x, w, rstd));
  cpu::rmsnorm_backward(dx, dw, dy, x, w, rstd);
}

namespace {
void check_rope(const char* op, const Tensor& x, const Tensor& pos) {
  check_float(op, "x", x);
  TS_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "%s: x must be [B, S, H, hd] with even hd, got %s", op,
           x.str().c_str());
  check_shape(op, "pos", pos, {x.size(1)});
  check_dtype(op, "pos", pos, DType::I32);
}
}  // namespace

void rope_forward(const Tensor& x, const Tensor& pos, float theta) {
  TS_PROFILE_OP("rope_forward", x);
  check_rope("rope_forward", x, pos);
  TS_SHAPE_ONLY_SKIP();
  if (common_device("rope_forward", {&x, &pos}) == Device::CUDA) return CUDA_TWIN(rope_forward(x, pos, theta));
  cpu::rope_forward(x, pos, theta);
}

void rope_backward(const Tensor& dx, const Tensor& pos, float theta) {
  TS_PROFILE_OP("rope_backward", dx);
  check_rope("rope_backward", dx, pos);
  TS_SHAPE_ONLY_SKIP();
  if (common_device("rope_backward", {&dx, &pos}) == Device::CUDA) return CUDA_TWIN(rope_backward(dx, pos, theta));
  cpu::rope_backward(dx, pos, theta);
}

void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta) {
  TS_PROFILE_OP("matmul", C);
  const char* op = "matmul";
  check_float(op, "A", A);
  check_same_dtype(op, A, "A", B, "B");
  check_float(op, "C", C);
  TS_CHECK(C.dtype == DType::F32 || C.dtype == A.dtype, "%s: C must be f32 or %s, got %s", op,
           dtype_name(A.dtype), C.str().c_str());
  const Mat a = as_matrix(op, "A", A), b = as_matrix(op, "B", B), c = as_matrix(op, "C", C);
  const int64_t M = transA ? a.cols : a.rows, K = transA ? a.rows : a.cols;
  const int64_t Kb = transB ? b.cols : b.rows, N = transB ? b.rows : b.cols;
  TS_CHECK(K == Kb && c.rows == M && c.cols == N,
           "%s: shapes do not compose: C %s = op(A) %s%s @ op(B) %s%s (as [M, K] @ [K, N] = [%lld, %lld] @ "
           "[%lld, %lld])",
           op, C.str().c_str(), A.str().c_str(), transA ? "^T" : "", B.str().c_str(), transB ? "^T" : "",
           (long long)M, (long long)K, (long long)Kb, (long long)N);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&C, &A, &B}) == Device::CUDA) return CUDA_TWIN(matmul(C, A, transA, B, transB, alpha, beta));
  cpu::matmul(C, A, transA, B, transB, alpha, beta);
}

void linear_forward(const Tensor& y, const Tensor& x, const Tensor& W) {
  TS_PROFILE_OP("linear_forward", x);
  matmul(y, x, false, W, true);
}

void linear_backward(const Tensor& dx, const Tensor& dW, const Tensor& dy, const Tensor& x, const Tensor& W,
                     bool accumulate_dx) {
  TS_PROFILE_OP("linear_backward", dy);
  if (dx.defined()) matmul(dx, dy, false, W, false, 1.0f, accumulate_dx ? 1.0f : 0.0f);  // dx = dy W
  if (dW.defined()) {
    check_dtype("linear_backward", "dW", dW, DType::F32);
    matmul(dW, dy, true, x, false, 1.0f, 1.0f);  // dW += dy^T x: gradient accumulation in fp32
  }
}

namespace {
void check_attention(const char* op, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                     const Tensor& v, const Tensor& qpos, const Tensor& kpos) {
  check_float(op, "q", q);
  TS_CHECK(q.dim() == 4, "%s: q must be [B, S, H, hd], got %s", op, q.str().c_str());
  TS_CHECK(k.dim() == 4 && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3),
           "%s: k must be [B, S, KVH, hd] matching q %s, got %s", op, q.str().c_str(), k.str().c_str());
  check_same_dtype(op, q, "q", k, "k");
  check_like(op, "v", v, k, "k");
  check_like(op, "out", out, q, "q");
  const int64_t B = q.size(0), S = q.size(1), H = q.size(2), KVH = k.size(2);
  TS_CHECK(KVH > 0 && H % KVH == 0, "%s: heads %lld not divisible by kv heads %lld", op, (long long)H,
           (long long)KVH);
  check_shape(op, "lse", lse, {B, H, S});
  check_dtype(op, "lse", lse, DType::F32);
  check_shape(op, "qpos", qpos, {S});
  check_dtype(op, "qpos", qpos, DType::I32);
  check_shape(op, "kpos", kpos, {S});
  check_dtype(op, "kpos", kpos, DType::I32);
}
}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& qpos, const Tensor& kpos) {
  TS_PROFILE_OP("attention_forward", out);
  const char* op = "attention_forward";
  check_attention(op, out, lse, q, k, v, qpos, kpos);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&out, &lse, &q, &k, &v, &qpos, &kpos}) == Device::CUDA)
    return CUDA_TWIN(attention_forward(out, lse, q, k, v, qpos, kpos));
  cpu::attention_forward(out, lse, q, k, v, qpos, kpos);
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos,
                        const Tensor& kpos) {
  TS_PROFILE_OP("attention_backward", dq);
  const char* op = "attention_backward";
  check_attention(op, out, lse, q, k, v, qpos, kpos);
  check_like(op, "dq", dq, q, "q");
  check_like(op, "dout", dout, q, "q");
  check_like(op, "dk", dk, k, "k");
  check_like(op, "dv", dv, k, "k");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&dq, &dk, &dv, &dout, &out, &lse, &q, &k, &v, &qpos, &kpos}) == Device::CUDA)
    return CUDA_TWIN(attention_backward(dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos));
  cpu::attention_backward(dq, dk, dv, dout, out, lse, q, k, v, qpos, kpos);
}

void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u) {
  TS_PROFILE_OP("swiglu_forward", h);
  const char* op = "swiglu_forward";
  check_float(op, "g", g);
  check_like(op, "u", u, g, "g");
  check_like(op, "h", h, g, "g");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&h, &g, &u}) == Device::CUDA) return CUDA_TWIN(swiglu_forward(h, g, u));
  ref::swiglu_forward(h, g, u);
}

void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u) {
  TS_PROFILE_OP("swiglu_backward", dg);
  const char* op = "swiglu_backward";
  check_float(op, "g", g);
  check_like(op, "u", u, g, "g");
  check_like(op, "dh", dh, g, "g");
  check_like(op, "dg", dg, g, "g");
  check_like(op, "du", du, g, "g");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&dg, &du, &dh, &g, &u}) == Device::CUDA) return CUDA_TWIN(swiglu_backward(dg, du, dh, g, u));
  ref::swiglu_backward(dg, du, dh, g, u);
}

void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale) {
  TS_PROFILE_OP("cross_entropy_forward_backward", losses);
  const char* op = "cross_entropy_forward_backward";
  check_float(op, "logits", logits);
  TS_CHECK(logits.dim() >= 1, "%s: logits must be [N, V], got %s", op, logits.str().c_str());
  const int64_t V = logits.size(-1), N = rows_of(op, "logits", logits, V);
  check_numel(op, "targets", targets, N, DType::I32);
  check_numel(op, "losses", losses, N, DType::F32);
  if (dlogits.defined()) check_like(op, "dlogits", dlogits, logits, "logits");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&losses, &dlogits, &logits, &targets}) == Device::CUDA)
    return CUDA_TWIN(cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale));
  for (int64_t n = 0; n < N; n++)
    TS_CHECK(targets.i32()[n] >= 0 && targets.i32()[n] < V, "%s: target %d of row %lld outside the vocab [0, %lld)",
             op, targets.i32()[n], (long long)n, (long long)V);
  cpu::cross_entropy_forward_backward(losses, dlogits, logits, targets, grad_scale);
}

namespace {
// The arguments the vocabulary-parallel steps share: logits [N, Vl] (T) and max [N] fp32, then
// for steps 2 and 3 (stats defined) stats [2, N] fp32 and targets int32 [N]. Returns N.
int64_t check_vocab_ce(const char* op, const Tensor& logits, const Tensor& max, const Tensor& stats,
                       const Tensor& targets) {
  check_float(op, "logits", logits);
  TS_CHECK(logits.dim() >= 1, "%s: logits must be [N, Vl], got %s", op, logits.str().c_str());
  const int64_t N = rows_of(op, "logits", logits, logits.size(-1));
  check_numel(op, "max", max, N, DType::F32);
  if (!stats.defined()) return N;
  check_dtype(op, "stats", stats, DType::F32);
  check_shape(op, "stats", stats, {2, N});
  check_numel(op, "targets", targets, N, DType::I32);
  return N;
}
}  // namespace

void vocab_ce_max(const Tensor& max, const Tensor& logits) {
  TS_PROFILE_OP("vocab_ce_max", max);
  const char* op = "vocab_ce_max";
  check_vocab_ce(op, logits, max, Tensor(), Tensor());
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&max, &logits}) == Device::CUDA) return CUDA_TWIN(vocab_ce_max(max, logits));
  cpu::vocab_ce_max(max, logits);
}

void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets,
                    int64_t vocab_start) {
  TS_PROFILE_OP("vocab_ce_stats", stats);
  const char* op = "vocab_ce_stats";
  const int64_t N = check_vocab_ce(op, logits, max, stats, targets);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&stats, &logits, &max, &targets}) == Device::CUDA)
    return CUDA_TWIN(vocab_ce_stats(stats, logits, max, targets, vocab_start));
  for (int64_t n = 0; n < N; n++)  // no rank would own it: its logit would silently read as 0
    TS_CHECK(targets.i32()[n] >= 0, "%s: target %d of row %lld is negative", op, targets.i32()[n], (long long)n);
  cpu::vocab_ce_stats(stats, logits, max, targets, vocab_start);
}

void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max,
                     const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale) {
  TS_PROFILE_OP("vocab_ce_finish", losses);
  const char* op = "vocab_ce_finish";
  const int64_t N = check_vocab_ce(op, logits, max, stats, targets);
  check_numel(op, "losses", losses, N, DType::F32);
  if (dlogits.defined()) check_like(op, "dlogits", dlogits, logits, "logits");
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&losses, &dlogits, &logits, &max, &stats, &targets}) == Device::CUDA)
    return CUDA_TWIN(vocab_ce_finish(losses, dlogits, logits, max, stats, targets, vocab_start, grad_scale));
  cpu::vocab_ce_finish(losses, dlogits, logits, max, stats, targets, vocab_start, grad_scale);
}

void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p,
                bool decay, float grad_scale, const Tensor& param_copy) {
  TS_PROFILE_OP("adamw_step", param);
  const char* op = "adamw_step";
  check_dtype(op, "param", param, DType::F32);
  const int64_t n = param.numel();
  check_numel(op, "grad", grad, n, DType::F32);
  check_numel(op, "m", m, n, DType::F32);
  check_numel(op, "v", v, n, DType::F32);
  if (param_copy.defined()) {
    check_float(op, "param_copy", param_copy);
    TS_CHECK(param_copy.numel() == n, "%s: param_copy %s must have %lld elements", op, param_copy.str().c_str(),
             (long long)n);
  }
  TS_CHECK(p.step >= 1, "%s: step is 1-based (bias correction 1 - beta^step), got %ld", op, p.step);
  TS_SHAPE_ONLY_SKIP();
  if (common_device(op, {&param, &grad, &m, &v, &param_copy}) == Device::CUDA)
    return CUDA_TWIN(adamw_step(param, grad, m, v, p, decay, grad_scale, param_copy));
  ref::adamw_step(param, grad, m, v, p, decay, grad_scale, param_copy);
}

double sum_squares(const Tensor& x) {
  TS_PROFILE_OP("sum_squares", x);
  check_dtype("sum_squares", "x", x, DType::F32);
  TS_SHAPE_ONLY_SKIP(0.0);
#ifdef TS_CUDA
  if (x.device() == Device::CUDA) return cuda::sum_squares(x);
#endif
  return cpu::sum_squares(x);
}

std::vector<double> sum_squares_each(const std::vector<Tensor>& xs) {
  for (const Tensor& x : xs) check_dtype("sum_squares_each", "x", x, DType::F32);
#ifdef TS_CUDA
  if (!xs.empty() && xs[0].device() == Device::CUDA) return cuda::sum_squares_each(xs);
#endif
  std::vector<double> r;
  for (const Tensor& x : xs) r.push_back(sum_squares(x));
  return r;
}

void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols) {
  TS_PROFILE_OP("init_normal", t);
  const char* op = "init_normal";
  check_dtype(op, "t", t, DType::F32);
  TS_CHECK(t.dim() == 1 || t.dim() == 2, "%s: t must be 1-D or 2-D, got %s", op, t.str().c_str());
  const int64_t rows = t.dim() == 2 ? t.size(0) : 1, cols = t.size(-1);
  TS_CHECK(row0 >= 0 && col0 >= 0 && col0 + cols <= global_cols && (t.dim() == 2 || row0 == 0),
           "%s: slice rows [%lld, +%lld) cols [%lld, +%lld) does not fit a global matrix of %lld columns", op,
           (long long)row0, (long long)rows, (long long)col0, (long long)cols, (long long)global_cols);
  TS_SHAPE_ONLY_SKIP();
  if (t.device() == Device::CUDA) return CUDA_TWIN(init_normal(t, key, std, row0, col0, global_cols));
  ref::init_normal(t, key, std, row0, col0, global_cols);
}

}  // namespace ts
