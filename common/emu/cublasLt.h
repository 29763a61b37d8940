// cublasLt.h — the emulated GPU's stand-in for NVIDIA's cuBLASLt header (blas.cu implements it).
//
// Only what the project calls: the FP8 matmul D = alpha · scaleA · scaleB · op(A) op(B) + beta · C
// with its descriptors, preference and heuristic query. Names and values are NVIDIA's (cuBLAS
// documentation, "Using the cuBLASLt API"). The emulated library has kernels for the FP8 cases that
// NVIDIA documents for compute capability 8.9 and 9.0 (cublasLtMatmul(), the FP8 requirements) and
// for nothing else: any other request gets no algorithm from the heuristic, with emu::report saying
// which rule it broke, so the caller's fallback runs as it would where the real library refuses.
#pragma once
#define TS_EMU_CUBLASLT 1  // the project's stand-in, not NVIDIA's header (core.h checks)
#include <cstddef>
#include <cstdint>

#include "cuda_runtime.h"
#include "library_types.h"
// The status, operation and compute types are cuBLAS's (NVIDIA's cublasLt.h has them from
// cublas_api.h, which also declares the cuBLAS calls).
#include "cublas_v2.h"

// ----- opaque objects ----------------------------------------------------------------------------

struct cublasLtContext;
typedef cublasLtContext* cublasLtHandle_t;
struct cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
struct cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
struct cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;

// An algorithm as the heuristic returns it: opaque bytes the caller passes back to cublasLtMatmul.
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};

struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;  // what the algorithm needs, at most the preference's maximum
  cublasStatus_t state;  // CUBLAS_STATUS_SUCCESS for every result returned
  float wavesCount;
  int reserved[4];
};

// ----- attributes ("cublasLtMatmulDescAttributes_t", "cublasLtMatmulPreferenceAttributes_t") ------

enum cublasLtMatmulDescAttributes_t {
  CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,  // int32_t cublasComputeType_t
  CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,    // int32_t cudaDataType: the type of alpha and beta
  CUBLASLT_MATMUL_DESC_POINTER_MODE = 2,  // int32_t cublasLtPointerMode_t
  CUBLASLT_MATMUL_DESC_TRANSA = 3,        // int32_t cublasOperation_t
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
  CUBLASLT_MATMUL_DESC_TRANSC = 5,
  CUBLASLT_MATMUL_DESC_FILL_MODE = 6,
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,  // uint32_t cublasLtEpilogue_t
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,
  CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13,
  CUBLASLT_MATMUL_DESC_ALPHA_VECTOR_BATCH_STRIDE = 14,
  CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = 15,  // int32_t
  CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,  // const void*: a device float multiplying A (null: 1)
  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,
  CUBLASLT_MATMUL_DESC_C_SCALE_POINTER = 19,
  CUBLASLT_MATMUL_DESC_D_SCALE_POINTER = 20,
  CUBLASLT_MATMUL_DESC_AMAX_D_POINTER = 21,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_SCALE_POINTER = 23,
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_AMAX_POINTER = 24,
  CUBLASLT_MATMUL_DESC_FAST_ACCUM = 25,  // int8_t: 1 lets FP8 kernels skip the fp32 promotion
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,
};

enum cublasLtPointerMode_t {
  CUBLASLT_POINTER_MODE_HOST = 0,
  CUBLASLT_POINTER_MODE_DEVICE = 1,
  CUBLASLT_POINTER_MODE_DEVICE_VECTOR = 2,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_ZERO = 3,
  CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST = 4,
};

enum cublasLtEpilogue_t {
  CUBLASLT_EPILOGUE_DEFAULT = 1,  // no epilogue: D is the scaled product plus beta C
};

enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_SEARCH_MODE = 0,         // uint32_t; 0: best fit
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,  // uint64_t; default 0
  CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3,
  // uint32_t, default 256: how aligned the caller promises the matrices' pointers will be.
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
  CUBLASLT_MATMUL_PREF_MAX_WAVES_COUNT = 9,
  CUBLASLT_MATMUL_PREF_IMPL_MASK = 12,
};

// ----- calls ("cuBLASLt API Reference") ------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void* buf, size_t sizeInBytes);

// A column-major rows × cols matrix of `type` whose columns start ld elements apart.
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void* buf,
                                                    size_t sizeInBytes);

// Up to requestedAlgoCount algorithms for the problem the descriptors describe, best first;
// *returnAlgoCount says how many. A problem no kernel takes returns CUBLAS_STATUS_NOT_SUPPORTED.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int* returnAlgoCount);

// D = alpha · (scaleA · scaleB · op(A) op(B)) + beta · C, queued on `stream`. alpha and beta are
// host pointers read at the call; the scale pointers are device pointers read when it runs. A null
// algo runs the heuristic with the default preference.
cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
                              const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspaceSizeInBytes, cudaStream_t stream);
