// memcheck_misaligned_tile, in 01_single_gpu --device cuda under the emulated GPU's memcheck build
// (make CUDA=emu SANITIZE=memory): a misaligned tile load. After each embedding forward, a kernel
// stages rows of the output into a padded shared-memory tile of bf16 pairs, as attention v2's
// load_tile stages rows (common/kernels/attention_v2.cu), with one slip: the padding is one bf16
// element where an even count keeps every row's 4-byte pairs aligned, so odd rows' pairs lie at
// 2-byte offsets. A GPU faults there (compute-sanitizer memcheck: "misaligned address"); x86 allows
// a 4-byte access at a 2-byte offset, so the emulator let it pass (issue 59). (Attention v2's own
// tiles cannot be handed a misaligned row from outside: its entry refuses unaligned operands.)
// Wraps ts::cuda::embedding_forward, which the kernels' dispatcher calls, to launch the kernel after
// the real one. The shadow's memcheck names pair_tile_kernel and the line of the store
// (tests/test_emu_memcheck.cpp).
#include "bug.h"
#include "tensor/device.h"

using ts::Tensor;
void real_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__real__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");
void tiled_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start)
    __asm__("__wrap__ZN2ts4cuda17embedding_forwardERKNS_6TensorES3_S3_l");

constexpr int kRows = 8, kPairs = 16;  // a tile: 8 rows of 16 bf16 pairs
constexpr int kPad = 1;                 // the defect: 1 bf16 of padding per row, where 2 keep the pairs aligned

__global__ void pair_tile_kernel(float* sums, const uint32_t* src, int64_t row_pairs) {
  __shared__ uint16_t tile[kRows * (2 * kPairs + kPad)];
  for (int e = threadIdx.x; e < kRows * kPairs; e += blockDim.x) {
    const int r = e / kPairs, c = e % kPairs;
    *reinterpret_cast<uint32_t*>(tile + r * (2 * kPairs + kPad) + 2 * c) = src[(blockIdx.x * kRows + r) * row_pairs + c];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < kRows * (2 * kPairs + kPad); i++) s += float(tile[i] & 1u);
    sums[blockIdx.x] = s;
  }
}

void tiled_embedding_forward(const Tensor& out, const Tensor& table, const Tensor& tokens, int64_t start) {
  bug::announce("memcheck_misaligned_tile");
  real_embedding_forward(out, table, tokens, start);
  const int64_t row_bytes = out.size(-1) * int64_t(ts::dtype_size(out.dtype)), rows = out.numel() / out.size(-1);
  if (row_bytes < 4 * kPairs || rows < kRows) return;
  static Tensor sums;
  sums = Tensor::empty({rows / kRows}, ts::DType::F32, ts::Device::CUDA, ts::Tag::Workspace);
  TS_LAUNCH(unsigned(rows / kRows), 64, 0, ts::compute_stream(), pair_tile_kernel)(
      sums.f32(), static_cast<const uint32_t*>(out.raw()), row_bytes / 4);
  KERNEL_CHECK();
}
