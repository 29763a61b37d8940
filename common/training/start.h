// start.h — the start-up every chapter's main shares, written once.
//
// A chapter's main says only what its chapter decides: its flags, its plan and memory prediction,
// its objects (the model's layout, the technique's pieces, the optimizer), its step and its
// step-time prediction. TrainingRun does the rest, in the order every chapter needs:
//   1. the flags: the step-time calibration (--calibration), then the chapter's own (Program);
//   2. --dry-run: the plan printed, and nothing else (no device, no collective);
//   3. the device, the mesh (checked against the world before any collective) and the data; the
//      plan printed; a run whose predicted memory exceeds the device's refused;
//   4. the model on this rank's layout, with FP8's recipe installed under --dtype fp8;
//   5. the weights and the optimizer initialised or resumed ("resumed from …");
//   6. the step-time prediction armed, then the loop.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "model/model.h"
#include "training/program.h"
#include "training/train.h"

namespace ts {

struct Calibration;  // step_time.h: the rate and network a step-time prediction is priced at
struct Gpu;
struct StepTerms;
// A chapter's step-time prediction: its step on a GPU of the calibration (the lab's, step_time.h).
using StepPredictor = std::function<StepTerms(const Gpu&)>;

class TrainingRun : public Program {
 public:
  using Flags = std::function<void(Args&, RunConfig&, MeshConfig&)>;
  // `priced`: the chapter prints its step time against a prediction (--calibration); 01 does not.
  TrainingRun(int argc, char** argv, const char* doc, const Flags& own, bool priced = true);
  ~TrainingRun();  // the model goes before the mesh's communicators

  // Steps 2 and 3. `memory` is this rank's predicted memory, called once the mesh is open (a
  // pipeline's stages differ). Returns false after --dry-run: main returns 0.
  bool start(const std::function<void()>& print_plan, const std::function<MemoryPrediction()>& memory);
  // Step 4: the model of rc on this rank's layout, FP8 installed; the run owns it.
  Model& build_model(const ModelLayout& layout = {});
  // Step 5 for a chapter whose optimizer holds the whole table: init or resume, and the line
  // that says so. A chapter that shards its optimizer resumes with init_or_resume and hands the
  // first step to resumed().
  long init(Model& model, AdamW& opt);
  long resumed(long first);
  // Step 6: `predict` (this run's step on a GPU of the calibration; `dense` names the term of its
  // gradient reduction) armed on the loop, then train_loop from the first step. Returns main's 0.
  int train(Loop& loop, StepPredictor predict = {}, const std::string& dense = "");

  const Calibration& calibration() const { return *calibration_; }

 private:
  // --calibration is read with the chapter's flags, inside Program's constructor: it is filled
  // through the pointer the delegating constructor hands Program before this member exists.
  TrainingRun(std::unique_ptr<Calibration> cal, int argc, char** argv, const char* doc, const Flags& own, bool priced);
  std::unique_ptr<Calibration> calibration_;
  std::unique_ptr<Model> model_;
  long first_ = 0;
};

}  // namespace ts
