// checkpoint.h — mesh-independent checkpoints in the HF layout.
//
//   DIR/model.safetensors      fp32 master weights, HF names, full global shapes
//   DIR/optimizer.safetensors  AdamW first and second moments ("exp_avg.<name>", "exp_avg_sq.<name>")
//   DIR/config.json            HF LlamaConfig fields: `transformers` loads the model as it is
//   DIR/trainer.json           step, data position, the learning-rate schedule, mesh and flags
//
// With --keep-last N, DIR holds the last N checkpoints as DIR/step_000400, DIR/step_000800, …
// (six digits, more past a million steps), each laid out as above.
//
// Every rank writes the slices it owns at their global offsets, so a checkpoint does not depend
// on the mesh that wrote it and resumes on another one. The files are written into a temporary
// directory, synced, then swapped in with one rename: a crash mid-save leaves the previous
// checkpoint intact.
#pragma once
#include <string>

#include "json.h"
#include "model.h"
#include "train.h"

namespace ts {

// What one rank contributes: fp32 values of ranges [begin, end) of its flat buffers (weights
// and, when opt is set, the moments over the same range), written at the global offsets the
// table maps them to (tensor-parallel blocks land inside the full tensors). A rank with nothing
// to write passes no slices. Collective over MPI_COMM_WORLD.
struct CheckpointSlice {
  int64_t begin = 0, end = 0;
  Tensor weights;       // fp32 [end - begin] (any device)
  const AdamW* opt = nullptr;  // its m1/m2 cover exactly [begin, end)
};
void save_checkpoint(const std::string& dir, const RunConfig& rc, const ParamTable& table,
                     const std::vector<CheckpointSlice>& mine, long step, const Json& mesh);

struct CheckpointInfo {
  long step = 0;
  bool has_optimizer = false;
  Json trainer;
};
// Validates the directory (files present, config matching the model, tensors with the right
// names and shapes) with config_error on any problem, then reads [begin, end) of the weights
// into `weights` (fp32) and, when opt is given and the optimizer file exists, of the moments.
CheckpointInfo load_checkpoint(const std::string& dir, const ModelConfig& cfg, const ParamTable& table,
                               int64_t begin, int64_t end, const Tensor& weights, AdamW* opt);

// The complete step_ checkpoints under dir (an unfinished save is still a .tmp), oldest first.
std::vector<std::pair<long, std::string>> step_checkpoints(const std::string& dir);
// What --resume DIR names: DIR itself when it is a checkpoint, else the newest complete step_
// checkpoint under it; a config_error when there is neither.
std::string resolve_checkpoint(const std::string& dir);

// config.json for the HF LlamaConfig of this model.
Json hf_config(const ModelConfig& c);

}  // namespace ts
