// kernels_cuda.h — the CUDA twins of the ops in kernels.h (same names, same contracts),
// implemented in kernels_cuda.cu. kernels.cu dispatches here when the tensors live on a GPU.
#pragma once
#include "kernels/kernels.h"

#ifdef TS_CUDA
namespace ts {
namespace cuda {

void add(const Tensor& y, const Tensor& a, const Tensor& b);
void add_inplace(const Tensor& y, const Tensor& x);
void scale_inplace(const Tensor& y, float s);
void convert(const Tensor& dst, const Tensor& src);
void embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t vocab_start);
void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_start);
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, float eps);
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd);
void rope_forward(const Tensor& x, const Tensor& pos, float theta);
void rope_backward(const Tensor& dx, const Tensor& pos, float theta);
void matmul(const Tensor& C, const Tensor& A, bool transA, const Tensor& B, bool transB, float alpha, float beta);
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
// The attention ladder: v1 on the CUDA cores (kernels_cuda.cu), v2 on the tensor cores
// (attention_v2.cu: bf16, head dim 64 or 128, 16-byte aligned rows); attention_forward and
// attention_backward above choose (TS_ATTENTION=v1 forces v1).
void attention_forward_v1(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
void attention_backward_v1(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
bool attention_v2_supports(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out);
void attention_forward_v2(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
void attention_backward_v2(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qpos, const Tensor& kpos);
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part, const Tensor& part_lse);
void swap_leading(const Tensor& dst, const Tensor& src, int64_t a, int64_t b);
void swiglu_forward(const Tensor& h, const Tensor& g, const Tensor& u);
void swiglu_backward(const Tensor& dg, const Tensor& du, const Tensor& dh, const Tensor& g, const Tensor& u);
void cross_entropy_forward_backward(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& targets, float grad_scale);
void vocab_ce_max(const Tensor& max, const Tensor& logits);
void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets, int64_t vocab_start);
void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max, const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale);
void adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWParams& p, bool decay, float grad_scale, const Tensor& param_copy);
double sum_squares(const Tensor& x);
std::vector<double> sum_squares_each(const std::vector<Tensor>& xs);
void init_normal(const Tensor& t, uint64_t key, float std, int64_t row0, int64_t col0, int64_t global_cols);
void fill(const Tensor& t, float value);

}  // namespace cuda
}  // namespace ts
#endif
