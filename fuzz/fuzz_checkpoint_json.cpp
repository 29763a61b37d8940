// config.json and trainer.json validation on arbitrary JSON: accepted, or a FormatError, never a
// crash; an accepted trainer.json has a step whose token count fits 64 bits.
#include <cstdlib>

#include "training/checkpoint.h"
#include "training/checkpoint_files.h"
#include "fuzz_util.h"

static fz::Counts counts{"fuzz_checkpoint_json"};

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  counts.inputs++;
  ts::Json j;
  if (!fz::parse_json(data, size, counts, j)) return 0;
  // A clean error here: rejected both as a config.json and as a trainer.json.
  int rejected = 0;
  try {
    ts::check_hf_config(j, ts::ModelConfig{});
  } catch (const ts::FormatError&) {
    rejected++;
  }
  try {
    const ts::TrainerRecord rec = ts::parse_trainer_record(j);
    const int64_t per_step = int64_t(rec.batch > 0 ? rec.batch : 1) * (rec.seq > 0 ? rec.seq : 1);
    if (rec.step < 0 || rec.step > INT64_MAX / per_step) abort();
    ts::RunConfig rc;
    ts::resume_notes(rec, rc);
  } catch (const ts::FormatError&) {
    rejected++;
  }
  counts.clean_errors += rejected == 2;
  return 0;
}
