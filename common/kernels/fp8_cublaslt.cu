// fp8_cublaslt.cu — the FP8 GEMM on the tensor cores of sm_89/sm_90, through cuBLASLt (fp8.h:
// native_gemm). cuBLASLt calls, and one one-thread kernel that forms the dequantization factor.
//
// cuBLAS is column-major, and its FP8 GEMMs take only the "TN" layout: op(A) = Aᵀ and op(B) = B,
// i.e. both operands stored with K contiguous. A row-major [r, c] matrix is the column-major
// [c, r] one, so our row-major C [M, N] = op(A) op(B) is cuBLAS's column-major Cᵀ [N, M] =
// op(B)ᵀ op(A)ᵀ, with our B (stored [N, K], K contiguous) as cuBLAS's A under CUBLAS_OP_T and our
// A (stored [M, K]) as cuBLAS's B under CUBLAS_OP_N. The forward y = x Wᵀ is that layout already;
// the input gradient dx = dy W and the weight gradient dW = dyᵀ x each have one operand stored the
// other way, which transpose_codes turns first (Transformer Engine keeps such transposed FP8
// copies alongside the others for the same reason).
//
// The scales stay on the device. cuBLASLt's FP8 matmul computes
//   D = alpha · scaleA · scaleB · op(A) op(B) + beta · C
// (cuBLASLt docs, cublasLtMatmul(); CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER: device
// floats that the kernel reads when it runs, 1 when unset), so it wants *dequantization* factors,
// while Quantized::scales are quantization scales (value = code / scale, fp8.h). A one-thread
// kernel on the compute stream writes 1/sA · 1/sB, formed in double and rounded once to fp32, into
// a device float that becomes cuBLASLt's A scale; alpha is 1 and the B scale is left unset. One
// factor, with the other two exactly 1, keeps the result independent of the order in which the
// library multiplies alpha, scaleA and scaleB (undocumented), and equal to the bits of the earlier
// path that read both scales to the host and passed the same double-formed product as alpha;
// separate fp32 reciprocals on the two pointers would differ from it by up to an ulp or two of the
// factor. No device-to-host copy, so no synchronisation per GEMM. C = D = out with beta 1:
// fp8::gemm has already put beta · C there. FAST_ACCUM stays off, so cuBLASLt promotes the tensor
// cores' partial sums to fp32 (DeepSeek-V3 §3.3.2's concern).
#include "kernels/fp8.h"
#include "tensor/device.h"

#ifdef TS_CUDA
#include <cublasLt.h>
#if defined(TS_CUDA_EMU) && !defined(TS_EMU_CUBLASLT)
#error "the emulated GPU's build found NVIDIA's cublasLt.h: common/emu/ must come first on the include path"
#endif

#include <cstdlib>
#include <cstring>

namespace ts::fp8 {
namespace {

cublasLtHandle_t lt_handle() {
  static cublasLtHandle_t h = [] {
    cublasLtHandle_t x;
    CUBLAS_CHECK(cublasLtCreate(&x));
    return x;
  }();
  return h;
}

// The device's compute capability as 10·major + minor (89: Ada, 90: Hopper).
int capability() {
  static int cc = [] {
    int d = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&d));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d));
    return 10 * major + minor;
  }();
  return cc;
}

// cuBLASLt's workspace: 32 MiB, the size NVIDIA recommends on Hopper, allocated once.
constexpr size_t kWorkspace = size_t(32) << 20;
void* workspace() {
  static void* w = [] {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, kWorkspace));
    return p;
  }();
  return w;
}

// The dequantization factor of a per-tensor GEMM, 1/sA · 1/sB, formed as the host would: each
// reciprocal and the product in double (IEEE division and multiplication on either side), one
// rounding to fp32 at the end.
__global__ void dequant_factor_kernel(float* factor, const float* sa, const float* sb) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *factor = float((1.0 / double(*sa)) * (1.0 / double(*sb)));
}

// The device float cuBLASLt reads as its A scale, allocated once. Every GEMM writes it and reads it
// on the one compute stream, so a GEMM's factor is never overwritten before its matmul has run.
float* factor_buffer() {
  static float* f = [] {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, sizeof(float)));
    return static_cast<float*>(p);
  }();
  return f;
}

cudaDataType_t lt_type(DType t) { return t == DType::F8E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

// The codes of op(X) [rows, K] with K contiguous: X itself when it is stored so, else transposed.
Tensor k_contiguous(const Tensor& q, bool stored_k_major, int64_t rows, int64_t K) {
  if (stored_k_major) return q;
  Tensor t = Tensor::empty({rows, K}, q.dtype, q.device(), Tag::Workspace);
  transpose_codes(t, q.reshape({K, rows}));
  return t;
}

// One column-major layout descriptor [rows, cols], leading dimension rows.
cublasLtMatrixLayout_t layout(cudaDataType_t type, int64_t rows, int64_t cols) {
  cublasLtMatrixLayout_t l;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), rows));
  return l;
}

// The descriptors of one call, destroyed with it.
struct LtCall {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtCall() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// The largest power of two, up to 256, that divides an address: what cuBLASLt may assume of it.
// Its preference promises 256-byte operands by default, which a weight gradient's view into the
// flat gradient buffer need not be (a --dim that is no multiple of 64).
uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while (a > 1 && uintptr_t(p) % a) a /= 2;
  return a;
}
void promise_alignment(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const void* p) {
  const uint32_t a = alignment_of(p);
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &a, sizeof a));
}

}  // namespace

bool native_gemm(const Tensor& out, const Quantized& A, bool transA, const Quantized& B, bool transB, int64_t M,
                 int64_t N, int64_t K) {
  const char* mode = getenv("TS_FP8_GEMM");
  if (mode && strcmp(mode, "decode") == 0) return false;
  if (out.device() != Device::CUDA || capability() < 89) return false;
  if (A.scales.numel() != 1 || B.scales.numel() != 1) return false;  // per-tensor scales only
  if (A.q.dtype == DType::F8E5M2 && B.q.dtype == DType::F8E5M2) return false;  // no e5m2 × e5m2 kernel
  if (M % 16 || N % 16 || K % 16) return false;  // cuBLASLt's FP8 alignment
  const Tensor a = k_contiguous(A.q, !transA, M, K);  // op(A) [M, K]: stored [M, K] unless transA
  const Tensor b = k_contiguous(B.q, transB, N, K);   // op(B)ᵀ [N, K]: stored [N, K] when transB
  const float alpha = 1.f, beta = 1.f;  // the dequantization factor is cuBLASLt's A scale
  LtCall call;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&call.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  const int8_t fast_accum = 0;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof fast_accum));
  float* factor = factor_buffer();  // cuBLASLt's A is our op(B)ᵀ; the factor covers both operands
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(call.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &factor, sizeof factor));
  call.a = layout(lt_type(B.q.dtype), K, N);  // cuBLAS's A: our op(B)ᵀ, column-major [K, N]
  call.b = layout(lt_type(A.q.dtype), K, M);  // cuBLAS's B: our op(A), column-major [K, M]
  call.c = layout(CUDA_R_32F, N, M);          // C = D: our row-major out [M, N]
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&call.pref));
  const size_t ws = kWorkspace;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(call.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  promise_alignment(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b.raw());  // cuBLAS's A is our b
  promise_alignment(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a.raw());
  promise_alignment(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, out.raw());
  promise_alignment(call.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, out.raw());
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(lt_handle(), call.op, call.a, call.b, call.c, call.c, call.pref, 1, &heur,
                                     &found) != CUBLAS_STATUS_SUCCESS ||
      found == 0)
    return false;  // this cuBLASLt has no kernel for the combination: the decode path runs instead
  TS_LAUNCH(1, 1, 0, compute_stream(), dequant_factor_kernel)(factor, A.scales.f32(), B.scales.f32());
  KERNEL_CHECK();
  CUBLAS_CHECK(cublasLtMatmul(lt_handle(), call.op, &alpha, b.raw(), call.a, a.raw(), call.b, &beta, out.raw(), call.c,
                              out.raw(), call.c, &heur.algo, workspace(), kWorkspace, compute_stream()));
  return true;
}

}  // namespace ts::fp8

#else  // a CPU-only build: every GEMM takes the decode path

namespace ts::fp8 {
bool native_gemm(const Tensor&, const Quantized&, bool, const Quantized&, bool, int64_t, int64_t, int64_t) {
  return false;
}
}  // namespace ts::fp8

#endif
