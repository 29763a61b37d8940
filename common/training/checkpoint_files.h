// checkpoint_files.h — the rest of checkpoint.h's story, which the loop and the start-up use and a
// chapter does not: the asynchronous save's progress, loading and resuming (the seal and digests
// checked first), the Hugging Face config, trainer.json's record, and the lock on a --save
// directory.
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
// directory of this job's own (DIR.tmp.<pid>), synced, then swapped in with one rename: a crash
// mid-save leaves the previous checkpoint intact. A save whose weights or moments hold a NaN or an
// infinity is not published.
//
// A checkpoint is sealed: trainer.json lists every other file with its digest, and its "seal" is
// the digest of trainer.json itself (all its members but the seal). Before any tensor is used, a
// load checks the seal, that every checkpoint file present is listed, and every listed file's
// digest: an edited step, a removed file list, a deleted or swapped file is refused, never
// half-loaded.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "formats/json.h"
#include "model/model.h"
#include "training/checkpoint.h"
#include "training/config.h"

namespace ts {

// Collective, at every step boundary (train_loop): moves an asynchronous save on once every
// rank has written its part (one small all-reduce while a save is in flight; nothing otherwise).
void progress_async_save();
// Collective: waits until the save in flight is published; returns the seconds waited (0: none).
double finish_async_save();
// The most bytes this rank has held staged for a save (12 per parameter it writes).
size_t checkpoint_staging_peak();

struct CheckpointInfo {
  long step = 0;
  bool has_optimizer = false;
  Json trainer;
};
// Validates the directory (files present and matching the digests trainer.json records, config
// matching the model, tensors with the right names, shapes and dtypes) with config_error on any
// problem, then reads [begin, end) of the weights
// into `weights` (fp32) and, when opt is given and the optimizer file exists, of the moments.
CheckpointInfo load_checkpoint(const std::string& dir, const ModelConfig& cfg, const ParamTable& table,
                               int64_t begin, int64_t end, const Tensor& weights, AdamW* opt);

// The published step_ checkpoints under dir (an unfinished save is still a .tmp), oldest first.
std::vector<std::pair<long, std::string>> step_checkpoints(const std::string& dir);
// What --resume DIR names: DIR itself when it is a checkpoint, else the newest intact step_
// checkpoint under it (sealed, every file matching its digest), saying which newer ones it passed
// over and why; a config_error when there is none.
std::string resolve_checkpoint(const std::string& dir);

// config.json for the HF LlamaConfig of this model.
Json hf_config(const ModelConfig& c);
// config.json against the model: FormatError naming the first field that differs or is malformed
// (absent optional fields take transformers' defaults).
void check_hf_config(const Json& config, const ModelConfig& c);

// What trainer.json records of the run that saved it (0 or "" where a field is absent). Parsing
// validates: FormatError for a step that is negative or whose token count overflows, a field of
// the wrong type, a file list naming anything but a file of the checkpoint.
struct TrainerRecord {
  long step = 0;
  int batch = 0, seq = 0;
  std::string dtype, data;
  bool has_seed = false;
  int64_t seed = 0;
  std::vector<std::pair<std::string, std::string>> files;  // file name -> digest (file_digest)
};
TrainerRecord parse_trainer_record(const Json& trainer);
// trainer.json's seal: the digest of its members other than "seal", as the save writes them.
std::string trainer_seal(const Json& trainer);
// trainer.json of the checkpoint in dir, read and checked (not the other files' digests):
// FormatError when it cannot be read, holds impossible values (parse_trainer_record), does not
// match its seal, or does not list a checkpoint file that is present. A directory without it is
// a plain HF model (present = false: the weights of step 0), unless it holds optimizer state,
// which without its step is a partial checkpoint (FormatError).
struct TrainerState {
  bool present = false;
  Json json;
  TrainerRecord rec;
};
TrainerState read_trainer(const std::string& dir);
// This run against the record: FormatError for what cannot be right (no step left to run; another
// synthetic source), and one note per deliberate change (batch, seq, dtype, data) saying what it means.
std::vector<std::string> resume_notes(const TrainerRecord& rec, const RunConfig& rc);

// Takes the --save directory for this job (an exclusive lock on DIR.lock, held until the process
// ends), or says why not: another job holds it. Rank 0 calls it before the first step.
std::string lock_checkpoint_dir(const std::string& save_dir);

}  // namespace ts
