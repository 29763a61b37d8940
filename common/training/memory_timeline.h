// memory_timeline.h — `--memory-timeline FILE`: every allocation and free of the run, with the
// phase it belongs to (forward unit k, backward unit k, optimizer; the comm category marks the
// communication buffers), the step, and every category's bytes after it: the playbook's chapter-1
// picture of one training step, drawn by `scripts/plot.py --timeline FILE` (weights, gradients
// and optimizer states flat, activations rising through the forward and falling through the
// backward, the optimizer states appearing at the first step). Real or fake runs alike (a fake
// world's rank R records its own). Written by the printing rank (world rank 0) at the run's end.
#pragma once
#include <string>

namespace ts {

class Model;

void memory_timeline_open(const std::string& path);  // "" = off; a file it cannot create is a config_error
bool memory_timeline_on();
// The phase of the allocations from now on.
void memory_phase(const std::string& phase);
// The phase in effect, and its return: a run that interleaves micro-batches as coroutines (07b's
// Interleave) hands each its own phase at each turn.
int memory_phase_now();
void memory_phase_resume(int phase);
// Names the phases from the model's hooks: "forward unit k" from before_unit, relabelled "backward
// unit k" from before_backward (the gathers a backward's before_unit triggers belong to it).
void memory_timeline_attach(Model& model);
// Writes FILE (CSV: event, step, phase, device, tag, delta, then each category's bytes in use).
void memory_timeline_close();

}  // namespace ts
