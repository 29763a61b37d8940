// vocab_ce.h — the fused cross-entropy's row passes as three ops, for a vocabulary split over
// ranks (kernels.h includes it; 04_tensor_parallel.cu, which runs them, includes only this).
#pragma once
#include "tensor/core.h"

namespace ts {

// ----- vocabulary-parallel cross-entropy: the fused op in three steps -------------------------
// The row passes of cross_entropy_forward_backward, split where 04's collectives go (Megatron's
// VocabParallelCrossEntropy; 04_tensor_parallel.cu has the formulas). logits [N, Vl] (T) hold the
// vocabulary rows [vocab_start, vocab_start + Vl) of every token; targets int32 [N] are global
// ids (>= 0); max [N] and stats [2, N] are fp32. Between the steps the caller all-reduces max
// with MAX, then stats with SUM, over the ranks that share the vocabulary. With one rank
// (vocab_start 0, no collectives) the three give the fused op's losses and dlogits.
// max = each row's max over these columns.
void vocab_ce_max(const Tensor& max, const Tensor& logits);
// stats[0] = each row's sum of exp(x - max); stats[1] = the target's logit where these columns
// hold it, else 0.
void vocab_ce_stats(const Tensor& stats, const Tensor& logits, const Tensor& max, const Tensor& targets,
                    int64_t vocab_start);
// losses [N] fp32 = log stats[0] + max - stats[1]; dlogits [N, Vl] (T, may alias logits;
// undefined: losses only) = (exp(x - max) / stats[0] - onehot(target)) * grad_scale.
void vocab_ce_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits, const Tensor& max,
                     const Tensor& stats, const Tensor& targets, int64_t vocab_start, float grad_scale);

}  // namespace ts
