// memcheck_device_overrun, in 01_single_gpu --device cuda under the emulated GPU's memcheck build
// (make CUDA=emu SANITIZE=memory): a kernel writes past its output's allocation. The embedding's
// forward writes its rows into a buffer allocated one row short (the mistake of sizing an output
// by the wrong count), so the project's unchanged embedding_forward_kernel writes its last row
// past the end of the allocation, into what follows it on the heap (the default build: silently).
// Wraps ts::cuda::embedding_forward, which the kernels' dispatcher calls. The shadow's memcheck
// names embedding_forward_kernel and the line of the store (tests/test_emu_memcheck.cpp).
#include "bug.h"
#include "tensor/device.h"

using ts::Tensor;
void real_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");
void short_out_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");

void short_out_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start) {
  bug::announce("memcheck_device_overrun");
  static Tensor rows;  // the queued kernel writes it later
  rows = Tensor::empty({tokens.numel() - 1, table.size(1)}, out.dtype, ts::Device::CUDA, ts::Tag::Workspace);
  real_embedding_forward(rows, table, tokens, start);
}
