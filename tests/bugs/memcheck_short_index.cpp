// memcheck_short_index, in 01_single_gpu --device cuda under the emulated GPU's memcheck build (make
// CUDA=emu SANITIZE=memory): an index array read one slot past what was written. The embedding's
// token ids reach its forward kernel through a fresh device buffer into which only the first N - 1
// ids were copied, so the project's unchanged embedding_forward_kernel reads a last id that nothing
// wrote (the shape of an MoE index array read past its count). Wraps ts::cuda::embedding_forward,
// which the kernels' dispatcher calls. The shadow's initcheck names embedding_forward_kernel and its
// line in common/kernels/kernels_cuda.cu (tests/test_emu_memcheck.cpp).
#include "bug.h"
#include "tensor/device.h"

void real_embedding_forward(const ts::Tensor& out, const ts::Tensor& table, const ts::Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");
void short_embedding_forward(const ts::Tensor& out, const ts::Tensor& table, const ts::Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");

void short_embedding_forward(const ts::Tensor& out, const ts::Tensor& table, const ts::Tensor& tokens, int64_t start) {
  bug::announce("memcheck_short_index");
  ts::Tensor ids = ts::Tensor::empty(tokens.shape, tokens.dtype, ts::Device::CUDA, ts::Tag::Workspace);
  const size_t written = (size_t(tokens.numel()) - 1) * sizeof(int32_t);  // one id short
  CUDA_CHECK(cudaMemcpyAsync(ids.raw(), tokens.raw(), written, cudaMemcpyDeviceToDevice, ts::compute_stream()));
  real_embedding_forward(out, table, ids, start);
}
