// fake_world_flags.cu — --fake-world, --fake-rank and --device shape's limits (fake_world_flags.h).
#include "training/fake_world_flags.h"
#include "comm/fake_world.h"

#include <mpi.h>

namespace ts {

void read_fake_world_flags(Args& a, const RunConfig& rc) {
  const std::string old = a.group("fake world (one rank of a job, in one process; notes/08)");
  const int n = a.get_int("--fake-world", 0, "run rank --fake-rank of a job of N ranks here, alone: collectives complete at "
                          "once with their real sizes (needs --device shape; 0: off)", at_least(0));
  const int r = a.get_int("--fake-rank", 0, "the rank of the --fake-world job this process is", at_least(0));
  a.group(old);
  const bool shape = rc.device == "shape";
  // (A run's recorded flags, --config ck/trainer.json, hold --fake-rank 0 without a fake world.)
  if (r > 0 && n == 0) config_error("--fake-rank %d needs --fake-world N (the job's ranks)", r);
  if (n > 0 && r >= n) config_error("--fake-rank %d is outside the fake world of %d ranks (0..%d)", r, n, n - 1);
  if (n > 0 && !shape)
    config_error("--fake-world runs one rank without its peers, so its tensors can hold no values: add --device shape");
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (shape && world > 1)
    config_error("--device shape runs in one process (the job has %d): use --fake-world %d --fake-rank R for rank R", world,
                 world);
  // What a run without values cannot do: read or write weights, or report what values decide.
  const std::pair<const char*, bool> refused[] = {{"--resume", !rc.resume_dir.empty()},
                                                  {"--save", !rc.save_dir.empty()},
                                                  {"--eval-every", rc.eval_every > 0},
                                                  {"--numerics-every", a.has("--numerics-every")}};
  for (auto& [flag, given] : refused)
    if (shape && given) config_error("%s needs tensors with values; --device shape has shapes and sizes only", flag);
  set_fake_world(n, r);
}

}  // namespace ts
