// memory_model.h — memory predictions: the playbook's formulas for parameters, gradients, optimizer
// states and activations, derived for this model.
#pragma once
#include <cstdint>
#include <string>

#include "tensor/core.h"
#include "model/model.h"
#include "training/config.h"

namespace ts {

struct MemoryPrediction {
  double params = 0, grads = 0, optimizer = 0, activations = 0;
  // --async-save's staging buffer: the fp32 weights and both moments of the range this rank's
  // optimizer covers, 4 B x 3 x Ψ_opt (the range it writes).
  double staging = 0;
  // What the unpredicted `comm` row holds in this technique, for the memory table's footnote
  // (every technique adds the host staging of CUDA tensors that ranks sharing a GPU send by MPI).
  std::string comm_holds;
  void comm_also_holds(const std::string& what) {
    if (!what.empty()) comm_holds += (comm_holds.empty() ? "" : ", ") + what;
  }
};
// Per-rank bytes of parameters (Ψ local), gradients and optimizer states, fp32 or bf16 mixed
// precision (bf16 weights + fp32 gradients + fp32 master/m/v = 2Ψ + 4Ψ + 12Ψ).
MemoryPrediction predict_states(int64_t psi_local, int64_t psi_optimizer, DType dt, bool master_weights);
// A rank holding Ψ_local parameters whole (no optimizer sharding) with activations of one
// micro-batch of the whole model: 01 and 02 exactly.
MemoryPrediction predict_replica(const RunConfig& rc, int64_t psi_local);
// Peak bytes of saved activations for one micro-batch of b sequences (see notes/01), at tensor
// parallelism tp with or without sequence parallelism (notes/04).
double predict_activations(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp = 1, bool sp = false);
// The two moments it takes the larger of (memory_model.cu): the end of the forward, and the last
// layer's forward with its output allocated (07b's pair of micro-batches prices one of each).
struct ActivationMoments { double end_of_forward = 0, last_layer = 0; };
ActivationMoments activation_moments(const ModelConfig& c, int64_t b, DType dt, Recompute rc, int tp = 1, bool sp = false);
// Its terms, per token of the micro-batch: what one decoder layer saves for backward under `rc`
// (Recompute::None: the layer's complete set), and what the head holds at its peak. Pipeline
// stages build their own peaks from them (micro-batches in flight × layers held).
double layer_activation_bytes(const ModelConfig& c, DType dt, Recompute rc, int tp = 1, bool sp = false);
double head_activation_bytes(const ModelConfig& c, DType dt, int tp = 1, bool sp = false);

}  // namespace ts
