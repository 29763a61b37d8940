// memory_model.cu — the playbook's memory formulas for parameters, gradients, optimizer states and activations.
#include "training/memory_model.h"

#include <cmath>

namespace ts {

MemoryPrediction predict_states(int64_t psi, int64_t psi_opt, DType dt, bool master_weights) {
  MemoryPrediction p;
  p.params = double(psi) * dtype_size(dt);
  p.grads = 4.0 * psi;  // fp32 gradients (accumulated in fp32 under bf16 too)
  p.optimizer = 8.0 * psi_opt + (dt != DType::F32 && master_weights ? 4.0 * psi_opt : 0.0);
  p.staging = 12.0 * psi_opt;
  return p;
}

MemoryPrediction predict_replica(const RunConfig& rc, int64_t psi) {
  MemoryPrediction p = predict_states(psi, psi, rc.dtype, rc.master_weights);
  p.activations = predict_activations(rc.model, rc.micro_batch, rc.dtype, rc.recompute);
  return p;
}

// Bytes per token of the micro-batch saved by one decoder layer (notes/01 and notes/04 derive
// each term). e = bytes per element of the compute dtype; statistics (two 1/rms, one lse per
// head) are fp32. Tensor parallelism keeps 1/t of the head- and ffn-sized tensors; sequence
// parallelism also keeps 1/t of the norm-region ones (r = 1/t), plain TP all of them (r = 1).
static double layer_saved_per_token(const ModelConfig& c, double e, Recompute rc, double t, double r) {
  const double D = c.dim, KV = c.kv_dim(), F = c.ffn, H = c.heads;
  const double region = r * (4 * D * e + 8);                      // x, h1, x_mid, h2 + rstd1, rstd2
  const double split = ((2 * D + 2 * KV + 3 * F) * e + 4 * H) / t;  // q, y, k, v, g, u, act + lse
  if (c.experts > 0) {  // dropless MoE (moe.h): probs, choices, src per token; per routed row its
    // token, weight, g, u, act (width F_e), input and output rows; the S shared experts' g, u, act
    // (one SwiGLU of width S·F_e over every token; its act is kept under selective recompute).
    const double E = c.experts, K = c.top_k, Fe = c.expert_width(), Fs = double(c.shared_experts) * Fe;
    // Attention is split over tp; the MoE block is replicated (every tp rank routes every token).
    const double moe =
        ((2 * D + 2 * KV) * e + 4 * H) / t + 4 * E + 8 * K + K * (8 + (3 * Fe + 2 * D) * e) + 3 * Fs * e;
    if (rc == Recompute::None) return region + moe;
    if (rc == Recompute::Selective) return region + moe - r * 2 * D * e - K * Fe * e;
  }
  if (rc == Recompute::None) return region + split;
  if (rc == Recompute::Selective) return region + split - r * 2 * D * e - F * e / t;  // minus h1, h2, act
  return r * D * e;  // full: the layer input only
}

// What the head holds at its peak, per token: final norm input/output and 1/rms, logits [N, V/t].
static double head_saved_per_token(const ModelConfig& c, double e, double t, double r) {
  return r * (2.0 * c.dim * e + 4.0) + c.vocab * e / t;
}

double layer_activation_bytes(const ModelConfig& c, DType dt, Recompute rc, int tp, bool sp) {
  return layer_saved_per_token(c, double(dtype_size(dt)), rc, tp, sp ? 1.0 / tp : 1.0);
}
double head_activation_bytes(const ModelConfig& c, DType dt, int tp, bool sp) {
  return head_saved_per_token(c, double(dtype_size(dt)), tp, sp ? 1.0 / tp : 1.0);
}

// The peak of saved activations is the larger of two moments:
//  A) the end of the forward: every layer's saved set + the head's (final norm in/out, logits);
//  F) the forward of the last layer: L-1 saved sets + that layer's complete set + its output.
ActivationMoments activation_moments(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp, bool sp) {
  const double e = double(dtype_size(dt)), tokens = double(b) * c.seq, t = tp, r = sp ? 1.0 / tp : 1.0;
  const double saved = layer_saved_per_token(c, e, rc, t, r);
  const double all = layer_saved_per_token(c, e, Recompute::None, t, r);
  const double head = head_saved_per_token(c, e, t, r);
  const double A = c.layers * saved + head;
  const double F = (c.layers - 1) * saved + all + r * c.dim * e;
  return {tokens * A, tokens * F};
}
double predict_activations(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp, bool sp) {
  const ActivationMoments m = activation_moments(c, b, dt, rc, tp, sp);
  return std::max(m.end_of_forward, m.last_layer);
}

}  // namespace ts
