// checkpoint.h — mesh-independent checkpoints in the Hugging Face layout (model.safetensors,
// optimizer.safetensors, config.json, trainer.json): what a chapter calls, the slices its rank
// writes. Every rank writes the slices it owns at their global offsets, so a checkpoint does not
// depend on the mesh that wrote it and resumes on another one. The files, their seal, the
// temporary directory and the rename, loading and resuming are checkpoint_files.h's.
#pragma once
#include <string>
#include <vector>

#include "formats/json.h"
#include "model/model.h"
#include "training/config.h"

namespace ts {

class AdamW;  // optimizer.h

// What one rank contributes: fp32 values of ranges [begin, end) of its flat buffers (weights
// and, when opt is set, the moments over the same range), written at the global offsets the
// table maps them to (tensor-parallel blocks land inside the full tensors). A rank with nothing
// to write passes no slices. Collective over MPI_COMM_WORLD.
struct CheckpointSlice {
  int64_t begin = 0, end = 0;
  Tensor weights;       // fp32 [end - begin] (any device)
  const AdamW* opt = nullptr;  // its m1/m2 cover exactly [begin, end)
};
// With rc.async_save the call returns once the slices are staged in memory (checkpoint.cu
// says which part of the save runs where); a save still in flight is finished first (logged).
void save_checkpoint(const std::string& dir, const RunConfig& rc, const ParamTable& table,
                     const std::vector<CheckpointSlice>& mine, long step, const Json& mesh);
}  // namespace ts
