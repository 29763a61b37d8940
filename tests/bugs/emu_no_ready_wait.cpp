// emu_no_ready_wait, in 02_data_parallel --device cuda under the emulated GPU's ThreadSanitizer build
// (make CUDA=emu SANITIZE=thread), two ranks each on its own emulated GPU (NCCL's path): comm.cu's
// nccl_issue records `ready` on the compute stream and makes the communicator's stream wait for it
// before the NCCL call, so the all-reduce reads the gradients only after the backward kernels have
// written them. Here that wait is removed: the all-reduce on the communication stream and the
// kernels on the compute stream touch the same gradient buffer with nothing ordering them.
// Wraps cudaEventRecord (to know which events the compute stream recorded) and cudaStreamWaitEvent
// (to drop another stream's wait for such an event). ThreadSanitizer reports the race between the
// stream that runs the NCCL operation and the kernel (tests/test_emu_races.cpp).
#include <map>

#include "bug.h"
#include "tensor/device.h"  // ts::compute_stream()

// The emulated runtime's functions have C++ linkage (common/emu/cuda_runtime.h): their mangled names.
cudaError_t real_record(cudaEvent_t e, cudaStream_t s) __asm__("__real__Z15cudaEventRecordP10CUevent_stP11CUstream_st");
cudaError_t spy_record(cudaEvent_t e, cudaStream_t s) __asm__("__wrap__Z15cudaEventRecordP10CUevent_stP11CUstream_st");
cudaError_t real_wait(cudaStream_t s, cudaEvent_t e, unsigned flags)
    __asm__("__real__Z19cudaStreamWaitEventP11CUstream_stP10CUevent_stj");
cudaError_t drop_wait(cudaStream_t s, cudaEvent_t e, unsigned flags)
    __asm__("__wrap__Z19cudaStreamWaitEventP11CUstream_stP10CUevent_stj");

static std::map<cudaEvent_t, cudaStream_t>& recorded_on() {
  static std::map<cudaEvent_t, cudaStream_t> m;
  return m;
}
cudaError_t spy_record(cudaEvent_t e, cudaStream_t s) {
  recorded_on()[e] = s;
  return real_record(e, s);
}
cudaError_t drop_wait(cudaStream_t s, cudaEvent_t e, unsigned flags) {
  auto it = recorded_on().find(e);
  if (s != ts::compute_stream() && it != recorded_on().end() && it->second == ts::compute_stream()) {
    bug::announce("emu_no_ready_wait");
    return cudaSuccess;  // the communication stream no longer waits for the compute stream
  }
  return real_wait(s, e, flags);
}
