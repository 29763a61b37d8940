// hooks.h — the seams through which higher layers tell fatal() and config_error() (core.h) what
// to do besides ending the job: dump the flight recorder, clean up a failed save, finalise MPI,
// name the step. The bottom layer never includes what sets them.
#pragma once
#include <cstddef>
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

// Called with each CUDA block the caching allocator hands out again, before its new user runs, on
// the stream that user runs on: the emulated GPU poisons it there as it poisons a fresh cudaMalloc
// (initcheck: last use's values would hide a read of what this use never wrote). Unset on a GPU.
void set_recycle_hook(void (*hook)(void* p, size_t bytes, void* stream));

// Called by the run's step loop so fatal() and the watchdog can name the step.
void set_current_step(long step);
long current_step();

}  // namespace ts
