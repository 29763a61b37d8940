// hooks.h — the seams through which higher layers tell fatal() and config_error() (core.h) what
// to do besides ending the job: dump the flight recorder, clean up a failed save, finalise MPI,
// name the step. The bottom layer never includes what sets them.
#pragma once
#include <string>

namespace ts {

// Called by fatal() with its message before the job is aborted (the flight recorder's dump).
void set_fatal_hook(void (*hook)(const char* message));
// Called by fatal() first, whose return it appends to the message: what was cleaned up (a
// failed save's temporary files).
void set_fatal_cleanup(std::string (*cleanup)());
// How config_error() finalises, every rank being there: the comm layer sets comm_finalize (its
// communicators released in order, then MPI_Finalize); before comm_init, nothing.
void set_finalize_hook(void (*finalize)());

// Called by the run's step loop so fatal() and the watchdog can name the step.
void set_current_step(long step);
long current_step();

}  // namespace ts
