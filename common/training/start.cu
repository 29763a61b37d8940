// start.cu — the start-up sequence of start.h.
#include "training/start.h"

#include "training/fp8_linear.h"
#include "training/run.h"
#include "training/step_time.h"

namespace ts {

TrainingRun::TrainingRun(int argc, char** argv, const char* doc, const Flags& own, bool priced)
    : TrainingRun(std::make_unique<Calibration>(), argc, argv, doc, own, priced) {}

TrainingRun::TrainingRun(std::unique_ptr<Calibration> cal, int argc, char** argv, const char* doc, const Flags& own,
                         bool priced)
    : Program(argc, argv, doc,
              [&](Args& a, RunConfig& rc, MeshConfig& mc) {
                if (priced) *cal = read_calibration(a);
                own(a, rc, mc);
              }),
      calibration_(std::move(cal)) {}

TrainingRun::~TrainingRun() { model_.reset(); }

bool TrainingRun::start(const std::function<void()>& print_plan, const std::function<MemoryPrediction()>& memory) {
  if (dry_run(print_plan)) return false;
  open();
  print_plan();
  check_memory_fits(memory(), dev);
  return true;
}

Model& TrainingRun::build_model(const ModelLayout& layout) {
  model_ = std::make_unique<Model>(rc.model, dev, rc.dtype, rc.recompute, layout);
  fp8::install(*model_, rc, mesh, log());  // --dtype fp8: the dense linears' GEMMs on FP8 operands
  return *model_;
}

long TrainingRun::init(Model& model, AdamW& opt) {
  return resumed(init_or_resume(model, opt, rc, 0, model.table.total, model.params));
}

long TrainingRun::resumed(long first) {
  if (first > 0) log().line("resumed from %s at step %ld", rc.resume_dir.c_str(), first);
  return first_ = first;
}

int TrainingRun::train(Loop& loop, StepPredictor predict, const std::string& dense) {
  if (predict) predict_step_time(loop, log(), rc, calibration(), dev, dense, std::move(predict));
  train_loop(rc, dev, log(), data, first_, loop);
  return 0;
}

}  // namespace ts
