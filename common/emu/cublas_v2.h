// cublas_v2.h — the emulated GPU's stand-in for NVIDIA's cuBLAS header (blas.cu implements it).
//
// Only what the project calls: a handle bound to a stream, the atomics mode, and cublasGemmEx.
// Types, names and values are NVIDIA's (cuBLAS documentation, "cuBLAS Datatypes Reference"), so
// that code compiled against this header behaves as against the real one; where the real library
// would run on regardless, or fault later, the emulator returns the documented error status and
// says why (emu::report), and it never accepts what the real one refuses.
#pragma once
#define TS_EMU_CUBLAS 1  // the project's stand-in, not NVIDIA's header (core.h checks)
#include <cstdint>

#include "cuda_runtime.h"
#include "library_types.h"

// ----- datatypes ("cuBLAS Datatypes Reference") --------------------------------------------------

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,  // no handle, or one that was destroyed
  CUBLAS_STATUS_ALLOC_FAILED = 3,
  CUBLAS_STATUS_INVALID_VALUE = 7,  // an argument out of range (a dimension, a leading dimension, a pointer)
  CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,  // the work could not be launched on the GPU
  CUBLAS_STATUS_INTERNAL_ERROR = 14,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,  // a valid request this library (or device) has no kernel for
  CUBLAS_STATUS_LICENSE_ERROR = 16,
};

enum cublasOperation_t {
  CUBLAS_OP_N = 0,  // op(X) = X
  CUBLAS_OP_T = 1,  // op(X) = X^T
  CUBLAS_OP_C = 2,  // op(X) = X^H, the same as X^T for real types
  CUBLAS_OP_HERMITAN = 2,
  CUBLAS_OP_CONJG = 3,  // documented as not supported
};

// Where alpha and beta live. The emulator implements the default, host pointers read at the call.
enum cublasPointerMode_t {
  CUBLAS_POINTER_MODE_HOST = 0,
  CUBLAS_POINTER_MODE_DEVICE = 1,
};

// Whether routines may use atomics (results that can differ from run to run). The emulator never
// does; the mode is kept so that it can be read back.
enum cublasAtomicsMode_t {
  CUBLAS_ATOMICS_NOT_ALLOWED = 0,
  CUBLAS_ATOMICS_ALLOWED = 1,
};

enum cublasComputeType_t {
  CUBLAS_COMPUTE_16F = 64,
  CUBLAS_COMPUTE_16F_PEDANTIC = 65,
  CUBLAS_COMPUTE_32F = 68,  // fp32 products and sums
  CUBLAS_COMPUTE_32F_PEDANTIC = 69,
  CUBLAS_COMPUTE_64F = 70,
  CUBLAS_COMPUTE_64F_PEDANTIC = 71,
  CUBLAS_COMPUTE_32I = 72,
  CUBLAS_COMPUTE_32I_PEDANTIC = 73,
  CUBLAS_COMPUTE_32F_FAST_16F = 74,  // fp32 results from inputs rounded to fp16 (tensor cores)
  CUBLAS_COMPUTE_32F_FAST_16BF = 75,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
};

// The algorithm hint of cublasGemmEx. Since cuBLAS 11 the numbered ones are hints the library may
// ignore; CUBLAS_GEMM_DEFAULT lets it choose.
enum cublasGemmAlgo_t {
  CUBLAS_GEMM_DFALT = -1,
  CUBLAS_GEMM_DEFAULT = -1,
  CUBLAS_GEMM_ALGO0 = 0,
  CUBLAS_GEMM_ALGO23 = 23,
  CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
  CUBLAS_GEMM_DFALT_TENSOR_OP = 99,
  CUBLAS_GEMM_ALGO0_TENSOR_OP = 100,
  CUBLAS_GEMM_ALGO15_TENSOR_OP = 115,
};

struct cublasContext;
typedef cublasContext* cublasHandle_t;

// ----- helper functions ("cuBLAS Helper Function Reference") ------------------------------------

cublasStatus_t cublasCreate(cublasHandle_t* handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
// A new handle works on the null stream; this binds it to another one for every later call.
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream);
cublasStatus_t cublasSetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t mode);
cublasStatus_t cublasGetAtomicsMode(cublasHandle_t handle, cublasAtomicsMode_t* mode);

// ----- BLAS-like extension ("cublasGemmEx()") ------------------------------------------------------
// C = alpha op(A) op(B) + beta C, column-major: op(A) is m × k, op(B) k × n, C m × n. The call
// returns once the product is queued on the handle's stream; alpha and beta are host pointers,
// read before it returns. With beta == 0, C is written without being read.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
                            cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);
