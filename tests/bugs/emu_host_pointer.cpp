// emu_host_pointer, in 01_single_gpu --device cuda under the emulated GPU (make CUDA=emu): the
// embedding's backward is handed its token ids in host memory, a pointer the GPU cannot dereference
// (the mistake of launching a kernel on a std::vector's data()). Wraps ts::cuda::embedding_backward,
// which the kernels' dispatcher calls, to pass a tokens tensor whose buffer is host memory labelled
// CUDA. The emulator's memcheck refuses the launch of embedding_backward_kernel, naming argument 2
// (tests/test_emu_chapters.cpp, "seeded defects").
#include <memory>
#include <vector>

#include "bug.h"

void real_embedding_backward(const ts::Tensor& dtable, const ts::Tensor& dout, const ts::Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda18embedding_backwardERKNS_6TensorES3_S3_l");
void host_embedding_backward(const ts::Tensor& dtable, const ts::Tensor& dout, const ts::Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda18embedding_backwardERKNS_6TensorES3_S3_l");

void host_embedding_backward(const ts::Tensor& dtable, const ts::Tensor& dout, const ts::Tensor& tokens, int64_t start) {
  bug::announce("emu_host_pointer");
  // Host memory, labelled as the GPU's; kept for the process (its destructor would hand host
  // memory to the device allocator's cache).
  static std::shared_ptr<ts::Buffer> host;
  host = std::make_shared<ts::Buffer>(tokens.nbytes(), ts::Device::CPU, ts::Tag::Workspace);
  host->dev = ts::Device::CUDA;
  static std::vector<std::shared_ptr<ts::Buffer>> kept;
  kept.push_back(host);
  ts::Tensor on_host = tokens;
  on_host.buf = host;
  on_host.byte_offset = 0;
  real_embedding_backward(dtable, dout, on_host, start);
}
