// kernels.h — every op the model needs, forward and backward.
//
// Each op checks its arguments and dispatches on the device of its tensors (kernels.cu). On the
// CPU it runs the plain loops of kernels_ref.cu, the readable reference of every op and the test
// oracle, or, where those are too slow to train with, the tuned kernels of kernels_cpu.cu; on a
// GPU its CUDA twin in kernels_cuda.cu. The kernels of a chapter's own idea live in that chapter:
// the merge of partial attentions and the Ulysses packing in 06_context_parallel.cu (their CUDA
// twins in kernels_cuda.cu).
// Activations are fp32 or bf16 (the "T" below: the dtype of x/y/q/...); norm weights, gradients
// of parameters, statistics (rstd, lse) and losses are always fp32 — the mixed-precision recipe of
// the playbook: bf16 compute, fp32 master weights and fp32 gradient accumulation.
// No float atomics: every op is bitwise reproducible run to run.
#pragma once
#include "tensor/core.h"
#include "kernels/elementwise.h"
#include "kernels/vocab_ce.h"

namespace ts {

// ----- embedding: out[n,:] = table[tok[n],:] ---------------------------------------------------
// table [V, D] (T), tokens int32 [N], out [N, D] (T). vocab_start: the first row this shard
// owns (vocab-parallel embedding); tokens outside [vocab_start, vocab_start + V) give zeros.
void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start = 0);
// dtable [V, D] fp32 += scatter of dout [N, D] (T). Deterministic: rows accumulate in token order.
void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start = 0);

// ----- RMSNorm: y = x / sqrt(mean(x^2) + eps) * w ----------------------------------------------
// x, y [N, D] (T); w [D] fp32; rstd [N] fp32 saved for backward.
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps);
// dx [N, D] (T) = (overwrites); dw [D] fp32 += (accumulates, rows in order).
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x,
                      const Tensor& w, const Tensor& rstd);

// ----- RoPE, HF convention: x' = x*cos + rotate_half(x)*sin, rotate_half([a,b]) = [-b, a] -------
// x [B, S, H, hd] (T), in place. pos int32 [S]: the absolute position of each of the S rows
// (0..S-1 normally; a context-parallel rank passes the positions of its chunks).
// inv_freq_j = theta^(-2j/hd). backward applies the inverse rotation to the gradient.
void rope_forward(const Tensor& x, const Tensor& pos, float theta);
void rope_backward(const Tensor& dx, const Tensor& pos, float theta);

// ----- matmul (row-major): C = alpha * op(A) @ op(B) + beta * C ----------------------------------
// A, B same dtype (fp32 or bf16); C fp32 or the same dtype as A. Accumulation is fp32.
// cuBLAS on CUDA, OpenBLAS sgemm on the CPU (bf16 inputs are widened to fp32 first).
void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB,
            float alpha = 1.f, float beta = 0.f);
// The linear layer in the [out, in] storage of HF: y[N, out] = x[N, in] @ W^T.
void linear_forward(const Tensor& y, const Tensor& x, const Tensor& W);
// dx[N, in] = dy @ W (overwrite, or accumulate when accumulate_dx); dW[out, in] fp32 += dy^T @ x.
void linear_backward(const Tensor& dx, const Tensor& dW, const Tensor& dy, const Tensor& x,
                     const Tensor& W, bool accumulate_dx = false);

// ----- causal GQA attention -------------------------------------------------------------------
// q [B, S, H, hd], k, v [B, S, KVH, hd] (T), H % KVH == 0: head h reads kv head h / (H/KVH).
// out [B, S, H, hd] (T); lse [B, H, S] fp32: the per-row log-sum-exp of the scaled, masked
// scores — the only softmax statistic saved; backward recomputes the probabilities from it.
// Masking is by position: key j is visible to query i iff kpos[j] <= qpos[i] (int32 [S] each),
// which is plain causal for 0..S-1 and also serves context-parallel chunks. scale = 1/sqrt(hd).
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                       const Tensor& v, const Tensor& qpos, const Tensor& kpos);
// dq, dk, dv overwritten (T).
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                        const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& qpos, const Tensor& kpos);

// ----- SwiGLU: h = silu(g) * u -------------------------------------------------------------------
// g, u, h [N, F] (T). backward overwrites dg, du.
void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u);
void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u);

// ----- fused softmax + cross-entropy ----------------------------------------------------------
// logits [N, V] (T), targets int32 [N]. losses [N] fp32 = logsumexp(row) - row[target].
// dlogits [N, V] (T, may alias logits) = (softmax(row) - onehot(target)) * grad_scale; the
// probabilities are never stored. Stable for large logits (max subtracted).
void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                    const Tensor& targets, float grad_scale);

// ----- optimizer and norms ---------------------------------------------------------------------
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay;
  long step;  // 1-based, for bias correction
};
// param, grad, m, v fp32 [n]. Decoupled weight decay: p -= lr * (mhat/(sqrt(vhat)+eps) + wd*p),
// applied only when decay is true (the caller passes it for 2-D tensors). grad_scale multiplies
// the gradient first (the clip coefficient). When param_copy is defined (bf16 compute weights),
// it receives the updated value rounded to bf16.
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                const AdamWParams& p, bool decay, float grad_scale, const Tensor& param_copy);
// Sum of squares of an fp32 tensor in double, in a fixed order (deterministic).
double sum_squares(const Tensor& x);
// The same for several tensors at once, each its own sum in the same fixed order; on CUDA one
// host synchronisation for all of them instead of one each (a sharded gradient norm).
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs);

// ----- counter-based init -------------------------------------------------------------------
// Fills t (any device, fp32) with N(0, std) values that are a pure function of (key, global
// index). The tensor is the slice rows [row0, row0 + t.size(0)), cols [col0, col0 + t.size(1))
// of a global matrix with global_cols columns (a 1-D tensor: row0 = 0, global_cols = numel).
void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols);
void fill(const Tensor& t, float value);

}  // namespace ts
